//! `Engine::metrics`: what an application serves on its `/metrics`, checked against
//! what the runs did and what `Engine::runs` says, before and after a restart.

use ferry_flow::{
    Ctx, Engine, EngineBuilder, FlowError, Limits, Retry, RunStatus, Signal, Workflow,
};
use ferry_testkit::{Scratch, eventually};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

static GO: Signal<u32> = Signal::new("go");
static M: Workflow<u32, u32> = Workflow::new("m");
/// Mode 6's code changed between the engine's two opens (its run then parks).
static CHANGED: AtomicBool = AtomicBool::new(false);
static WAITING: AtomicU32 = AtomicU32::new(0);
static FLAKY: AtomicU32 = AtomicU32::new(0);

async fn modes(ctx: Ctx, mode: u32) -> Result<u32, FlowError> {
    match mode {
        // One step.
        0 | 50 => ctx.step("a", |_| async { Ok(mode) }).await,
        // Two failed attempts, then one that succeeds.
        1 => {
            ctx.step("flaky", |_| async {
                match FLAKY.fetch_add(1, Ordering::SeqCst) {
                    0 | 1 => Err("not yet".into()),
                    _ => Ok(1),
                }
            })
            .retry(Retry::exponential(3, Duration::from_millis(1)))
            .await
        }
        // An attempt that times out, and no retry: the run fails.
        2 => {
            ctx.step("slow", |_| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok(2)
            })
            .timeout(Duration::from_millis(20))
            .await
        }
        // Waits for a signal (3 gets one, 4 is cancelled).
        3 | 4 => {
            WAITING.fetch_add(1, Ordering::SeqCst);
            Ok(ctx.wait_for(GO, None).await?.unwrap_or(0))
        }
        5 => Err(ctx.continue_as_new(&50)),
        // A step, then a wait; after the change, a different step.
        6 => {
            let name = if CHANGED.load(Ordering::SeqCst) {
                "b"
            } else {
                "a"
            };
            ctx.step(name, |_| async { Ok(6) }).await?;
            WAITING.fetch_add(1, Ordering::SeqCst);
            Ok(ctx.wait_for(GO, None).await?.unwrap_or(0))
        }
        // A result over the payload limit: the body ran, and the attempt ends in error.
        7 => {
            let big: String = ctx
                .step("big", |_| async { Ok("x".repeat(10_000)) })
                .await?;
            Ok(big.len() as u32)
        }
        _ => unreachable!(),
    }
}

fn builder(dir: &std::path::Path) -> EngineBuilder {
    Engine::builder(dir).register(M, modes).limits(Limits {
        payload_bytes: 4096,
        ..Limits::default()
    })
}

/// The value of the one sample `name` (with its labels, as written) in `text`.
fn sample(text: &str, name: &str) -> f64 {
    let found: Vec<f64> = text
        .lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .collect();
    assert_eq!(found.len(), 1, "{name} once in:\n{text}");
    found[0]
}

/// Every sample line is `name[{labels}] value`, of a family announced before it.
fn well_formed(text: &str) {
    let mut families = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            families.push(rest.split(' ').next().unwrap().to_string());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (name, value) = line.rsplit_once(' ').expect("name and value");
        assert!(value.parse::<f64>().is_ok(), "a number in {line:?}");
        let base = name.split('{').next().unwrap();
        assert!(
            families.iter().any(|f| base == f
                || [
                    f.to_string() + "_bucket",
                    f.to_string() + "_sum",
                    f.to_string() + "_count"
                ]
                .contains(&base.to_string())),
            "{base} announced before {line:?}"
        );
    }
}

fn by_state(engine: &Engine) -> BTreeMap<&'static str, usize> {
    let mut m = BTreeMap::new();
    for r in engine.runs() {
        let s = match r.status {
            RunStatus::Running => "running",
            RunStatus::Parked(_) => "parked",
            RunStatus::Finished(ferry_flow::Outcome::Ok(_)) => "finished",
            RunStatus::Finished(ferry_flow::Outcome::Err(_)) => "failed",
            RunStatus::Finished(ferry_flow::Outcome::Cancelled) => "cancelled",
        };
        *m.entry(s).or_default() += 1;
    }
    m
}

fn gauges_match_runs(engine: &Engine, text: &str) {
    let runs = by_state(engine);
    for s in ["running", "parked", "finished", "failed", "cancelled"] {
        assert_eq!(
            sample(text, &format!("ferry_flow_runs{{state=\"{s}\"}}")),
            runs.get(s).copied().unwrap_or(0) as f64,
            "{s} runs"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_what_runs_did_and_survive_a_restart_as_gauges() {
    let scratch = Scratch::new("flow-metrics");
    let dir = scratch.dir("flow");
    {
        let engine = builder(&dir).open().unwrap();
        for mode in 0..=7 {
            engine.start(M, &format!("r{mode}"), &mode).await.unwrap();
        }
        eventually("three runs to wait", || WAITING.load(Ordering::SeqCst) == 3).await;
        engine.signal("r3", GO, &3).await.unwrap();
        assert!(engine.cancel("r4").await.unwrap());
        for mode in (0..=5).chain([7]) {
            let _ = engine
                .run::<u32>(&format!("r{mode}"))
                .unwrap()
                .result()
                .await;
        }
        let text = engine.metrics();
        well_formed(&text);
        gauges_match_runs(&engine, &text);
        // r0, r1, r3 and r5 finished, r2 and r7 failed, r4 was cancelled, r6 waits.
        for (s, n) in [
            ("running", 8.0),
            ("finished", 4.0),
            ("failed", 2.0),
            ("cancelled", 1.0),
            ("parked", 0.0),
        ] {
            let name = format!("ferry_flow_runs_entered_total{{state=\"{s}\"}}");
            assert_eq!(sample(&text, &name), n, "{name}");
        }
        assert_eq!(sample(&text, "ferry_flow_runs{state=\"running\"}"), 1.0);
        // r0, r1's third attempt, r5's second generation and r6; r1's first two and
        // r7, whose result was refused; r2.
        for (r, n) in [("ok", 4.0), ("error", 3.0), ("timeout", 1.0)] {
            let name = format!("ferry_flow_step_attempts_total{{result=\"{r}\"}}");
            assert_eq!(sample(&text, &name), n, "{name}");
        }
        assert_eq!(sample(&text, "ferry_flow_runs_continued_total"), 1.0);
        assert_eq!(sample(&text, "ferry_flow_signals_total"), 1.0);
        assert_eq!(sample(&text, "ferry_flow_cancels_total"), 1.0);
        let stats = engine.log_stats();
        assert_eq!(
            sample(&text, "ferry_flow_log_records_total"),
            stats.records as f64
        );
        assert_eq!(
            sample(&text, "ferry_flow_log_syncs_total"),
            stats.syncs as f64
        );
        let cycles: u64 = stats.write_us.count();
        assert!(cycles > 0);
        assert_eq!(
            sample(&text, "ferry_flow_log_write_seconds_count"),
            cycles as f64
        );
        assert_eq!(
            sample(&text, "ferry_flow_log_write_seconds_bucket{le=\"+Inf\"}"),
            cycles as f64
        );
    }
    // Reopened with mode 6's code changed: recovery puts every run in its state
    // without counting it as entered again; r6 then parks.
    CHANGED.store(true, Ordering::SeqCst);
    let engine = builder(&dir).open().unwrap();
    eventually("r6 to park", || {
        matches!(engine.status("r6"), Some(RunStatus::Parked(_)))
    })
    .await;
    let text = engine.metrics();
    well_formed(&text);
    gauges_match_runs(&engine, &text);
    assert_eq!(sample(&text, "ferry_flow_runs{state=\"finished\"}"), 4.0);
    assert_eq!(sample(&text, "ferry_flow_runs{state=\"parked\"}"), 1.0);
    assert_eq!(
        sample(&text, "ferry_flow_runs_entered_total{state=\"running\"}"),
        0.0
    );
    assert_eq!(
        sample(&text, "ferry_flow_runs_entered_total{state=\"parked\"}"),
        1.0
    );
    assert_eq!(sample(&text, "ferry_flow_resumed_runs"), 1.0);
    assert_eq!(sample(&text, "ferry_flow_recovery_torn_bytes"), 0.0);
    assert!(sample(&text, "ferry_flow_recovered_records") > 0.0);
    assert!(sample(&text, "ferry_flow_recovery_seconds") > 0.0);
    // Cancelling the parked run moves it, and the gauges follow.
    assert!(engine.cancel("r6").await.unwrap());
    let text = engine.metrics();
    gauges_match_runs(&engine, &text);
    assert_eq!(sample(&text, "ferry_flow_runs{state=\"cancelled\"}"), 2.0);
}
