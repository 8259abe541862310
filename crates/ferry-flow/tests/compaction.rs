//! Compaction and retention (docs/flow.md §5): checkpoints fold the log so its old
//! segments are retired, and a restart from a checkpoint sees every run as it was;
//! finished runs are forgotten after the retention period and their ids can be used
//! again.

use ferry_flow::{
    Class, Classify, Ctx, Engine, EngineBuilder, FlowError, RunStatus, Signal, Workflow,
};
use ferry_testkit::{Scratch, eventually};
use std::path::Path;
use std::time::{Duration, Instant};
// (the runs started in waves below are even, so they finish without signals)

static CHAIN: Workflow<u32, u32> = Workflow::new("chain");
static GO: Signal<u32> = Signal::new("go");

/// Small segments, compacted at every 8 KiB; runs with an odd input wait for a signal
/// (twice, continuing as new in between) after their steps.
fn builder(dir: &Path) -> EngineBuilder {
    Engine::builder(dir)
        .log_config(ferry_log::Config {
            segment_bytes: 32 << 10,
            record_bytes_max: 4 << 10,
            ..Default::default()
        })
        .limits(ferry_flow::Limits {
            payload_bytes: 4 << 10,
            ..Default::default()
        })
        .compact_every(8 << 10)
        .compact_interval(Duration::ZERO)
        .register(CHAIN, |ctx: Ctx, n: u32| async move {
            let mut acc = n;
            for s in 0..3 {
                acc = ctx
                    .step(&format!("s{s}"), |_| async move { Ok(acc * 2 + 1) })
                    .await?;
            }
            if n % 2 == 1 && n < 10_000 {
                let got = ctx.wait_for(GO, None).await?.unwrap_or(0);
                return Err(ctx.continue_as_new(&(10_000 + got)));
            }
            if n >= 10_000 {
                let got = ctx.wait_for(GO, None).await?.unwrap_or(0);
                return Ok(acc + got);
            }
            Ok(acc)
        })
}

fn want(n: u32) -> u32 {
    (0..3).fold(n, |a, _| a * 2 + 1)
}

fn files(dir: &Path, suffix: &str) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            let e = e.as_ref().unwrap();
            let name = e.file_name().into_string().unwrap();
            name.ends_with(suffix) || (suffix == "checkpoint" && name.starts_with("checkpoint-"))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_retire_segments_and_a_restart_sees_every_run_as_it_was() {
    let scratch = Scratch::new("flow-compact");
    let dir = scratch.dir("flow");
    const RUNS: u32 = 300;
    {
        let engine = builder(&dir).open().unwrap();
        for i in 0..RUNS {
            engine.start(CHAIN, &format!("r{i}"), &i).await.unwrap();
        }
        // Even runs finish; odd ones wait, get a signal, continue as new and wait again.
        for i in (0..RUNS).step_by(2) {
            let h = engine.run::<u32>(&format!("r{i}")).unwrap();
            assert_eq!(h.result().await.unwrap(), want(i));
        }
        for i in (1..RUNS).step_by(2) {
            engine.signal(&format!("r{i}"), GO, &i).await.unwrap();
        }
        eventually("a checkpoint and retired segments", || {
            files(&dir, "checkpoint") == 1 && engine.log_stats().segments < 10
        })
        .await;
        eventually("every odd run in its second generation", || {
            engine.runs().iter().filter(|r| r.generation == 1).count() == (RUNS / 2) as usize
        })
        .await;
    }
    let engine = builder(&dir).open().unwrap();
    let rec = engine.recovery();
    assert_eq!(rec.resumed, (RUNS / 2) as usize);
    for i in (0..RUNS).step_by(2) {
        assert_eq!(
            engine
                .run::<u32>(&format!("r{i}"))
                .unwrap()
                .result()
                .await
                .unwrap(),
            want(i),
            "finished runs answer from the checkpoint"
        );
    }
    for i in (1..RUNS).step_by(2) {
        engine.signal(&format!("r{i}"), GO, &1).await.unwrap();
    }
    for i in (1..RUNS).step_by(2) {
        let out = engine
            .run::<u32>(&format!("r{i}"))
            .unwrap()
            .result()
            .await
            .unwrap();
        assert_eq!(out, want(10_000 + i) + 1, "run r{i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_runs_are_forgotten_after_retention_and_their_ids_reused() {
    let scratch = Scratch::new("flow-retention");
    let dir = scratch.dir("flow");
    let engine = builder(&dir)
        .retention(Duration::from_millis(1))
        .open()
        .unwrap();
    for i in (0..40).step_by(2) {
        let h = engine.start(CHAIN, &format!("r{i}"), &i).await.unwrap();
        assert_eq!(h.result().await.unwrap(), want(i));
    }
    // More journal, in waves, until a compaction has seen r0 finished and a later one
    // forgot it.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut i = 100;
    while engine.status("r0").is_some() {
        assert!(Instant::now() < deadline, "r0 was never forgotten");
        for _ in 0..20 {
            engine.start(CHAIN, &format!("x{i}"), &i).await.unwrap();
            i += 2;
        }
        tokio::time::sleep(Duration::from_millis(120)).await;
    }
    let err = engine
        .run::<u32>("r0")
        .map(|_| ())
        .ok_or(FlowError::Stopped);
    assert!(err.is_err());
    // The id starts a new run.
    let h = engine.start(CHAIN, "r0", &4).await.unwrap();
    assert_eq!(h.result().await.unwrap(), want(4));
    // The metrics account for every run: each one that finished is held or expired.
    eventually("the metrics to settle", || {
        let text = engine.metrics();
        let get = |name: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or(-1.0)
        };
        let (held, expired) = (
            get("ferry_flow_runs{state=\"finished\"}"),
            get("ferry_flow_runs_expired_total"),
        );
        expired >= 1.0
            && get("ferry_flow_compactions_total") >= 1.0
            && get("ferry_flow_runs{state=\"running\"}") == 0.0
            && held + expired == get("ferry_flow_runs_entered_total{state=\"finished\"}")
            && held == engine.runs().len() as f64
    })
    .await;
    // The engine goes before reopening (its log holds the directory).
    drop((h, engine));
    let engine = builder(&dir).open().unwrap();
    assert!(matches!(
        engine.status("r0"),
        Some(RunStatus::Finished(_)) | None
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_checkpoint_refuses_to_open() {
    let scratch = Scratch::new("flow-bad-checkpoint");
    let dir = scratch.dir("flow");
    {
        let engine = builder(&dir).open().unwrap();
        for i in 0..200 {
            engine
                .start(CHAIN, &format!("r{i}"), &(i * 2))
                .await
                .unwrap();
        }
        eventually("a checkpoint", || files(&dir, "checkpoint") == 1).await;
    }
    damage(&checkpoint_file(&dir));
    let err = match builder(&dir).open() {
        Err(e) => e,
        Ok(_) => panic!("opened on a damaged checkpoint"),
    };
    assert!(matches!(err, FlowError::Damaged { .. }), "{err:?}");
    assert_eq!(err.class(), Class::Corrupted);
    let msg = err.to_string();
    assert!(
        msg.contains("is unreadable") && msg.contains("checksum") && msg.contains("restore"),
        "the log before the checkpoint was retired, so only a copy helps: {msg}"
    );
}

/// Guards the hint a damaged checkpoint gives when the log still holds everything
/// from its start (nothing retired): moving the file aside must really be enough, so
/// the test follows the hint and checks every run is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_checkpoint_over_a_whole_log_can_be_moved_aside() {
    let scratch = Scratch::new("flow-bad-checkpoint-whole-log");
    let dir = scratch.dir("flow");
    // Segments far larger than what is written: nothing is ever retired.
    let whole = |dir: &Path| builder(dir).log_config(ferry_log::Config::default());
    {
        let engine = whole(&dir).open().unwrap();
        for i in 0..20 {
            let h = engine
                .start(CHAIN, &format!("r{i}"), &(i * 2))
                .await
                .unwrap();
            h.result().await.unwrap();
        }
        eventually("a checkpoint", || files(&dir, "checkpoint") == 1).await;
        assert_eq!(engine.log_stats().segments, 1, "nothing retired");
    }
    let cp = checkpoint_file(&dir);
    damage(&cp);
    let err = match whole(&dir).open() {
        Err(e) => e.to_string(),
        Ok(_) => panic!("opened on a damaged checkpoint"),
    };
    assert!(err.contains("move this file"), "{err}");
    std::fs::rename(&cp, scratch.dir("aside").join("damaged")).unwrap();
    let engine = whole(&dir).open().unwrap();
    for i in 0..20 {
        let out = engine.run::<u32>(&format!("r{i}")).unwrap().result().await;
        assert_eq!(out.unwrap(), want(i * 2));
    }
}

fn checkpoint_file(dir: &Path) -> std::path::PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("checkpoint-")
        })
        .unwrap()
}

/// Flip one bit in the middle of `path`.
fn damage(path: &Path) {
    let mut bytes = std::fs::read(path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 4;
    std::fs::write(path, &bytes).unwrap();
}
