//! Edges of replay and limits: code that stops short of its journal, code that catches a
//! mismatch and goes on, a step at a full history, a call refused by a limit followed by
//! more calls and a restart, two waits for the same signal at once, signals sent once
//! per key.

mod common;

use ferry_flow::{Ctx, Engine, FlowError, Limits, RunStatus, Signal, Workflow};
use ferry_testkit::{Scratch, eventually};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

static W: Workflow<u32, String> = Workflow::new("w");
static GO: Signal<u32> = Signal::new("go");

/// Step "a" then a wait for GO, journaled; the engine stops while the run waits.
async fn journal_a_then_wait(dir: &std::path::Path) {
    let waiting = std::sync::Arc::new(AtomicU32::new(0));
    let w = waiting.clone();
    let engine = Engine::builder(dir)
        .register(W, move |ctx: Ctx, _: u32| {
            let w = w.clone();
            async move {
                ctx.step("a", |_| async { Ok(1) }).await?;
                w.fetch_add(1, Ordering::SeqCst);
                ctx.wait_for(GO, None).await?;
                Ok("old".to_string())
            }
        })
        .open()
        .unwrap();
    engine.start(W, "r", &0).await.unwrap();
    eventually("the wait", || waiting.load(Ordering::SeqCst) == 1).await;
    // The start, step "a" and the WaitStarted record, durable before the engine goes.
    common::journaled(&engine, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn code_that_stops_short_of_its_journal_parks_and_can_be_cancelled() {
    let scratch = Scratch::new("flow-short");
    let dir = scratch.dir("flow");
    journal_a_then_wait(&dir).await;
    let engine = Engine::builder(&dir)
        .register(W, |ctx: Ctx, _: u32| async move {
            ctx.step("a", |_| async { Ok(1) }).await?;
            Ok("new".to_string())
        })
        .open()
        .unwrap();
    eventually("parking", || {
        matches!(engine.status("r"), Some(RunStatus::Parked(_)))
    })
    .await;
    let Some(RunStatus::Parked(why)) = engine.status("r") else {
        unreachable!()
    };
    assert!(why.contains("the end of the workflow"), "{why}");
    assert!(engine.cancel("r").await.unwrap());
    let err = engine
        .run::<String>("r")
        .unwrap()
        .result()
        .await
        .unwrap_err();
    assert!(matches!(err, FlowError::Cancelled), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn code_that_catches_a_mismatch_runs_nothing_more_and_parks() {
    static COMPENSATED: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-caught");
    let dir = scratch.dir("flow");
    journal_a_then_wait(&dir).await;
    let engine = Engine::builder(&dir)
        .register(W, |ctx: Ctx, _: u32| async move {
            match ctx.step("b", |_| async { Ok(2) }).await {
                Ok(_) => Ok("b".to_string()),
                Err(e) => {
                    // Compensation the code thinks it owes: must not run against a
                    // journal it no longer lines up with.
                    let _: Result<u32, _> = ctx
                        .step("compensate", |_| async {
                            COMPENSATED.fetch_add(1, Ordering::SeqCst);
                            Ok(0)
                        })
                        .await;
                    Err(FlowError::Invalid(format!("b: {e}")))
                }
            }
        })
        .open()
        .unwrap();
    eventually("parking", || {
        matches!(engine.status("r"), Some(RunStatus::Parked(_)))
    })
    .await;
    assert_eq!(COMPENSATED.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_at_a_full_history_does_not_run_its_body() {
    static C_RUNS: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-full");
    let engine = Engine::builder(scratch.dir("flow"))
        .limits(Limits {
            history: 3,
            ..Limits::default()
        })
        .register(W, |ctx: Ctx, n: u32| async move {
            // Started, a and b fill the history of 3 (generation 0 only).
            if n == 0 {
                ctx.step("a", |_| async { Ok(()) }).await?;
                ctx.step("b", |_| async { Ok(()) }).await?;
            }
            let c = ctx
                .step("c", |_| async {
                    C_RUNS.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                })
                .await;
            match c {
                Err(FlowError::LimitExceeded { .. }) if n == 0 => {
                    // The limit's own advice: a fresh history for the rest.
                    Err(ctx.continue_as_new(&1))
                }
                other => Ok(format!("{other:?}")),
            }
        })
        .open()
        .unwrap();
    let h = engine.start(W, "r", &0).await.unwrap();
    assert_eq!(h.result().await.unwrap(), "Ok(())");
    assert_eq!(
        C_RUNS.load(Ordering::SeqCst),
        1,
        "step c ran once, in generation 1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_refused_by_a_limit_leaves_no_hole_for_the_replay() {
    static WAITING: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-hole");
    let dir = scratch.dir("flow");
    let open = |dir: &std::path::Path| {
        Engine::builder(dir)
            .limits(Limits {
                timers: 1,
                ..Limits::default()
            })
            .register(W, |ctx: Ctx, _: u32| async move {
                let (a, b) = tokio::join!(
                    ctx.sleep(Duration::from_millis(20)),
                    ctx.sleep(Duration::from_millis(20)),
                );
                let refused = a.is_err() || b.is_err();
                ctx.step("report", |_| async { Ok(()) }).await?;
                WAITING.fetch_add(1, Ordering::SeqCst);
                let go = ctx.wait_for(GO, None).await?.unwrap_or(0);
                Ok(format!("refused={refused} go={go}"))
            })
            .open()
            .unwrap()
    };
    {
        let engine = open(&dir);
        engine.start(W, "r", &0).await.unwrap();
        eventually("the wait", || WAITING.load(Ordering::SeqCst) == 1).await;
        // Start, TimerSet, TimerRefused, TimerFired, step "report", WaitStarted.
        common::journaled(&engine, 6).await;
    }
    let engine = open(&dir);
    eventually("the replay", || WAITING.load(Ordering::SeqCst) == 2).await;
    assert_eq!(engine.status("r"), Some(RunStatus::Running), "not parked");
    engine.signal("r", GO, &7).await.unwrap();
    let out = engine.run::<String>("r").unwrap().result().await.unwrap();
    assert_eq!(out, "refused=true go=7");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_waits_for_one_name_take_one_signal_each() {
    let scratch = Scratch::new("flow-two-waits");
    let engine = Engine::builder(scratch.dir("flow"))
        .register(W, |ctx: Ctx, _: u32| async move {
            let (a, b) = tokio::join!(ctx.wait_for(GO, None), ctx.wait_for(GO, None));
            Ok(format!("{:?} {:?}", a?, b?))
        })
        .open()
        .unwrap();
    engine.start(W, "r", &0).await.unwrap();
    // Both waits journaled (the start and two WaitStarted) before the signals come.
    common::journaled(&engine, 3).await;
    engine.signal("r", GO, &1).await.unwrap();
    engine.signal("r", GO, &2).await.unwrap();
    // (join! rotates which future it polls first: which wait took which signal varies;
    // that each took its own does not.)
    let out = engine.run::<String>("r").unwrap().result().await.unwrap();
    assert!(
        out == "Some(1) Some(2)" || out == "Some(2) Some(1)",
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_sent_twice_with_one_key_is_delivered_once_also_after_a_restart() {
    let scratch = Scratch::new("flow-signal-once");
    let dir = scratch.dir("flow");
    let open = |dir: &std::path::Path| {
        Engine::builder(dir)
            .register(W, |ctx: Ctx, _: u32| async move {
                let a = ctx.wait_for(GO, None).await?;
                let b = ctx.wait_for(GO, Some(Duration::from_millis(300))).await?;
                Ok(format!("{a:?} {b:?}"))
            })
            .open()
            .unwrap()
    };
    {
        let engine = open(&dir);
        engine.start(W, "r", &0).await.unwrap();
        engine.signal_once("r", GO, &1, "approve-1").await.unwrap();
    }
    let engine = open(&dir);
    // The sender retries (it never saw the answer): nothing more is delivered.
    engine.signal_once("r", GO, &1, "approve-1").await.unwrap();
    let out = engine.run::<String>("r").unwrap().result().await.unwrap();
    assert_eq!(out, "Some(1) None");
}

/// Guards docs/flow.md §2's promise to a sender that retries `signal_once` after a crash:
/// the retry returns once the first delivery is durable, even when the run consumed it
/// and finished meanwhile, so the sender can tell a delivered signal from a lost one.
/// Checked in the same process, after a restart that replays the log, and after
/// compaction folded the finished run into a checkpoint (the log before it retired).
/// A key never delivered is refused as `RunFinished`, an unknown run as `UnknownRun`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_signal_once_succeeds_after_the_run_finished_also_from_a_checkpoint() {
    let scratch = Scratch::new("flow-signal-once-finished");
    let dir = scratch.dir("flow");
    let open = |dir: &std::path::Path, compact: bool| {
        let mut b = Engine::builder(dir).register(W, |ctx: Ctx, _: u32| async move {
            let a = ctx.wait_for(GO, None).await?;
            Ok(format!("{a:?}"))
        });
        if compact {
            b = b.compact_every(1).compact_interval(Duration::ZERO);
        }
        b.open().unwrap()
    };
    let refused = |r: Result<(), FlowError>| {
        assert!(
            matches!(&r, Err(FlowError::RunFinished { id, signal }) if id == "r" && signal == "go"),
            "{r:?}"
        );
    };
    {
        let engine = open(&dir, false);
        engine.start(W, "r", &0).await.unwrap();
        engine.signal_once("r", GO, &1, "approve-1").await.unwrap();
        let out = engine.run::<String>("r").unwrap().result().await.unwrap();
        assert_eq!(out, "Some(1)");
        engine.signal_once("r", GO, &1, "approve-1").await.unwrap();
        refused(engine.signal_once("r", GO, &2, "approve-2").await);
        refused(engine.signal("r", GO, &3).await);
    }
    {
        // Replayed from the log.
        let engine = open(&dir, true);
        engine.signal_once("r", GO, &1, "approve-1").await.unwrap();
        refused(engine.signal_once("r", GO, &2, "approve-2").await);
        eventually("a compaction", || {
            engine
                .metrics()
                .lines()
                .any(|l| l.starts_with("ferry_flow_compactions_total ") && !l.ends_with(" 0"))
        })
        .await;
    }
    let journal = ferry_flow::read_journal(&dir).unwrap();
    assert!(
        journal.finished.contains_key("r") && !journal.records.contains_key("r"),
        "the checkpoint holds the run as finished: {journal:?}"
    );
    // From the checkpoint alone.
    let engine = open(&dir, false);
    engine.signal_once("r", GO, &1, "approve-1").await.unwrap();
    refused(engine.signal_once("r", GO, &2, "approve-2").await);
    assert!(matches!(
        engine.signal_once("nobody", GO, &1, "approve-1").await,
        Err(FlowError::UnknownRun { id }) if id == "nobody"
    ));
    assert_eq!(
        engine.run::<String>("r").unwrap().result().await.unwrap(),
        "Some(1)"
    );
}
