//! The engine's first slice, on a real log in a real directory: a journaled step does not
//! run again after a restart, starting an id twice gives one run, a run whose code took
//! another path is parked (and stays parked), a failed step fails the run.

mod common;

use ferry_flow::{Ctx, Engine, FlowError, RunStatus, Workflow};
use ferry_testkit::{Scratch, eventually};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

static ORDER: Workflow<u32, String> = Workflow::new("order");
static REFUND: Workflow<u32, u32> = Workflow::new("refund");

/// An engine on `dir` with `code` registered as ORDER.
fn open<F, Fut>(dir: &std::path::Path, code: F) -> Engine
where
    F: Fn(Ctx, u32) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<String, FlowError>> + 'static,
{
    Engine::builder(dir).register(ORDER, code).open().unwrap()
}

/// The result of run `id`, which must exist.
async fn result_of(engine: &Engine, id: &str) -> Result<String, FlowError> {
    engine
        .run::<String>(id)
        .expect("the run exists")
        .result()
        .await
}

/// Step "a", then a step "b" that never finishes: the run is mid-way when the engine
/// stops.
async fn stuck_after_a(
    ctx: Ctx,
    n: u32,
    a_runs: &'static AtomicU32,
    b_started: &'static AtomicU32,
) -> Result<String, FlowError> {
    let a: u32 = ctx
        .step("a", |_| async move {
            a_runs.fetch_add(1, Ordering::SeqCst);
            Ok(n * 10)
        })
        .await?;
    let _: u32 = ctx
        .step("b", |_| async move {
            b_started.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
            Ok(0)
        })
        .await?;
    Ok(format!("a={a}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journaled_step_does_not_run_again_after_a_restart() {
    static A_RUNS: AtomicU32 = AtomicU32::new(0);
    static B_STARTED: AtomicU32 = AtomicU32::new(0);
    static KEYS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let scratch = Scratch::new("flow-restart");
    let dir = scratch.dir("flow");
    {
        let engine = Engine::builder(&dir)
            .register(ORDER, |ctx, n| stuck_after_a(ctx, n, &A_RUNS, &B_STARTED))
            .open()
            .unwrap();
        engine.start(ORDER, "order-1", &4).await.unwrap();
        // Step b's body runs only once step a's result is durable.
        eventually("step b to start", || B_STARTED.load(Ordering::SeqCst) == 1).await;
        assert_eq!(engine.status("order-1"), Some(RunStatus::Running));
    }
    let engine = Engine::builder(&dir)
        .register(ORDER, |ctx: Ctx, n: u32| async move {
            let a: u32 = ctx
                .step("a", |_| async move {
                    A_RUNS.fetch_add(1, Ordering::SeqCst);
                    Ok(n * 10)
                })
                .await?;
            let b: u32 = ctx
                .step("b", |s| {
                    KEYS.lock().unwrap().push(s.key().to_string());
                    async { Ok(7) }
                })
                .await?;
            Ok(format!("a={a} b={b}"))
        })
        .open()
        .unwrap();
    let run = engine
        .run::<String>("order-1")
        .expect("the run survived the restart");
    assert_eq!(run.result().await.unwrap(), "a=40 b=7");
    assert_eq!(A_RUNS.load(Ordering::SeqCst), 1, "step a ran again");
    assert_eq!(*KEYS.lock().unwrap(), vec!["order-1/0/2".to_string()]);
    // Finished runs answer from the journal after another restart, running nothing.
    drop(run);
    drop(engine);
    let engine = Engine::builder(&dir)
        .register(ORDER, |_ctx: Ctx, _n: u32| async move {
            panic!("a finished run must not run again")
        })
        .open()
        .unwrap();
    assert_eq!(result_of(&engine, "order-1").await.unwrap(), "a=40 b=7");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starting_an_id_twice_gives_one_run() {
    static RUNS: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-idem");
    let engine = Engine::builder(scratch.dir("flow"))
        .register(REFUND, |_: Ctx, n: u32| async move { Ok(n) })
        .register(ORDER, |ctx: Ctx, n: u32| async move {
            ctx.step("count", |_| async {
                RUNS.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await?;
            Ok(format!("n={n}"))
        })
        .open()
        .unwrap();
    let first = engine.start(ORDER, "same", &1).await.unwrap();
    let second = engine.start(ORDER, "same", &2).await.unwrap();
    assert_eq!(first.result().await.unwrap(), "n=1");
    assert_eq!(
        second.result().await.unwrap(),
        "n=1",
        "the second start returned the first run"
    );
    assert_eq!(RUNS.load(Ordering::SeqCst), 1);
    assert!(matches!(
        engine.start(ORDER, &"x".repeat(300), &1).await,
        Err(FlowError::Invalid(_))
    ));
    // Ids with '/' are child runs' (parent/generation/position): a caller's would
    // collide with a child of another run.
    assert!(matches!(
        engine.start(ORDER, "same/0/1", &1).await,
        Err(FlowError::Invalid(e)) if e.contains("'/'")
    ));
    // The id is taken by another workflow: refused, not a handle of the wrong type.
    assert!(matches!(
        engine.start(REFUND, "same", &1).await,
        Err(FlowError::Invalid(e)) if e.contains("exists as workflow \"order\"")
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_code_changed_path_is_parked_until_the_code_takes_its_path_again() {
    static A_RUNS: AtomicU32 = AtomicU32::new(0);
    static B_STARTED: AtomicU32 = AtomicU32::new(0);
    static OTHER: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-nondet");
    let dir = scratch.dir("flow");
    {
        let engine = Engine::builder(&dir)
            .register(ORDER, |ctx, n| stuck_after_a(ctx, n, &A_RUNS, &B_STARTED))
            .open()
            .unwrap();
        engine.start(ORDER, "o", &1).await.unwrap();
        eventually("step b to start", || B_STARTED.load(Ordering::SeqCst) == 1).await;
    }
    // A deploy that calls another step first.
    let changed = |ctx: Ctx, _n: u32| async move {
        ctx.step("fraud-check", |_| async {
            OTHER.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await?;
        Ok("done".to_string())
    };
    {
        let engine = open(&dir, changed);
        let err = result_of(&engine, "o").await.unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("nondeterminism at position 1"), "{msg}");
        assert!(
            msg.contains("step \"a\"") && msg.contains("step \"fraud-check\""),
            "{msg}"
        );
        assert!(matches!(engine.status("o"), Some(RunStatus::Parked(_))));
    }
    {
        let engine = open(&dir, changed);
        let err = result_of(&engine, "o").await.unwrap_err();
        assert!(err.to_string().contains("nondeterminism"), "{err}");
        assert_eq!(
            OTHER.load(Ordering::SeqCst),
            0,
            "no step of a parked run runs"
        );
    }
    // A deploy that takes the recorded path again: the run resumes where it stopped.
    let engine = Engine::builder(&dir)
        .register(ORDER, |ctx: Ctx, n: u32| async move {
            let a: u32 = ctx.step("a", |_| async move { Ok(n * 10) }).await?;
            let b: u32 = ctx.step("b", |_| async { Ok(5) }).await?;
            Ok(format!("a={a} b={b}"))
        })
        .open()
        .unwrap();
    assert_eq!(result_of(&engine, "o").await.unwrap(), "a=10 b=5");
    assert_eq!(A_RUNS.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_step_fails_the_run_with_its_error() {
    let scratch = Scratch::new("flow-fail");
    let engine = Engine::builder(scratch.dir("flow"))
        .register(ORDER, |ctx: Ctx, _n: u32| async move {
            let _: u32 = ctx
                .step("charge", |_| async { Err("card declined".into()) })
                .await?;
            Ok("paid".to_string())
        })
        .open()
        .unwrap();
    let run = engine.start(ORDER, "f", &1).await.unwrap();
    let err = run.result().await.unwrap_err();
    // The run failed (not a step named "workflow"): its error carries the step's.
    assert!(
        matches!(&err, FlowError::RunFailed { error } if error.contains("step \"charge\" failed: card declined")),
        "{err:?}"
    );
}

/// Guards the retry policy's stop on a permanent failure: a step whose body says a
/// failure is permanent is not tried again, however many attempts its policy allows,
/// while transient failures before it are retried; each attempt sees its own number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_step_error_stops_the_retries_and_attempts_are_numbered() {
    use ferry_flow::{Retry, StepError};
    static SEEN: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());
    let scratch = Scratch::new("flow-permanent");
    let engine = Engine::builder(scratch.dir("flow"))
        .register(ORDER, |ctx: Ctx, _n: u32| async move {
            let _: u32 = ctx
                .step("charge", |s| {
                    let attempt = s.attempt();
                    async move {
                        SEEN.lock().unwrap().push(attempt);
                        if attempt < 3 {
                            Err(StepError::transient("gateway timeout"))
                        } else {
                            Err(StepError::permanent("card reported stolen"))
                        }
                    }
                })
                .retry(Retry::exponential(10, Duration::from_millis(1)))
                .await?;
            Ok("paid".to_string())
        })
        .open()
        .unwrap();
    let run = engine.start(ORDER, "p", &1).await.unwrap();
    let err = run.result().await.unwrap_err();
    assert!(
        matches!(&err, FlowError::RunFailed { error } if error.contains("card reported stolen")),
        "{err:?}"
    );
    assert_eq!(
        *SEEN.lock().unwrap(),
        vec![1, 2, 3],
        "stopped at the permanent one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patches_and_values_replay_as_first_seen() {
    static STARTED: AtomicU32 = AtomicU32::new(0);
    static EXTRA: AtomicU32 = AtomicU32::new(0);
    static SEEN: std::sync::Mutex<Vec<(u64, u64)>> = std::sync::Mutex::new(Vec::new());
    let scratch = Scratch::new("flow-patch");
    let dir = scratch.dir("flow");
    // Old code: read the clock and a random number, run step "a", then wait forever.
    {
        let engine = Engine::builder(&dir)
            .register(ORDER, |ctx: Ctx, _n: u32| async move {
                let (t, r) = (ctx.now_ms()?, ctx.random_u64()?);
                SEEN.lock().unwrap().push((t, r));
                ctx.step("a", |_| async { Ok(()) }).await?;
                let _: u32 = ctx
                    .step("wait", |_| async {
                        STARTED.fetch_add(1, Ordering::SeqCst);
                        std::future::pending::<()>().await;
                        Ok(0)
                    })
                    .await?;
                Ok("old".to_string())
            })
            .open()
            .unwrap();
        engine.start(ORDER, "old-run", &1).await.unwrap();
        eventually("the old run to wait", || {
            STARTED.load(Ordering::SeqCst) == 1
        })
        .await;
    }
    // New code: an extra step behind a patch, before step "a". The old run journaled
    // step "a" there, so it keeps its old path; a run that has not passed the patch
    // point yet (or a new run) takes the new one.
    let new_code = |ctx: Ctx, _n: u32| async move {
        let (t, r) = (ctx.now_ms()?, ctx.random_u64()?);
        SEEN.lock().unwrap().push((t, r));
        if ctx.patched("extra-step")? {
            ctx.step("extra", |_| async {
                EXTRA.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await?;
        }
        ctx.step("a", |_| async { Ok(()) }).await?;
        let _: u32 = ctx.step("wait", |_| async { Ok(1) }).await?;
        Ok("new".to_string())
    };
    {
        let engine = open(&dir, new_code);
        // The old run keeps its old path: no extra step, and the same clock and number.
        assert_eq!(result_of(&engine, "old-run").await.unwrap(), "new");
        assert_eq!(EXTRA.load(Ordering::SeqCst), 0);
        let seen = SEEN.lock().unwrap().clone();
        assert_eq!(seen.len(), 2);
        assert_eq!(seen[0], seen[1], "replay saw other values");
        // A new run takes the patch.
        let run = engine.start(ORDER, "new-run", &2).await.unwrap();
        assert_eq!(run.result().await.unwrap(), "new");
        assert_eq!(EXTRA.load(Ordering::SeqCst), 1);
    }
    // Replayed again, the new run still takes the patch (and does not run it again).
    let engine = open(&dir, new_code);
    assert_eq!(result_of(&engine, "new-run").await.unwrap(), "new");
    assert_eq!(EXTRA.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_sleep_keeps_its_wake_up_time_across_a_restart_and_never_fires_early() {
    static TIMES: std::sync::Mutex<Vec<(&'static str, u64)>> = std::sync::Mutex::new(Vec::new());
    fn wall_ms() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    }
    let code = |ctx: Ctx, _n: u32| async move {
        ctx.step("before", |_| async {
            TIMES.lock().unwrap().push(("before", wall_ms()));
            Ok(())
        })
        .await?;
        ctx.sleep(Duration::from_millis(400)).await?;
        ctx.step("after", |_| async {
            TIMES.lock().unwrap().push(("after", wall_ms()));
            Ok(())
        })
        .await?;
        Ok("slept".to_string())
    };
    let scratch = Scratch::new("flow-sleep");
    let dir = scratch.dir("flow");
    {
        let engine = open(&dir, code);
        engine.start(ORDER, "s", &1).await.unwrap();
        eventually("step before", || !TIMES.lock().unwrap().is_empty()).await;
        // The start, step "before" and the timer, durable before the engine goes.
        common::journaled(&engine, 3).await;
    }
    // Down past the wake-up time: the timer keeps its original time and fires at once
    // on restart (about 700 ms after "before"), instead of 400 ms after the restart
    // (about 1,100 ms).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let engine = open(&dir, code);
    assert_eq!(result_of(&engine, "s").await.unwrap(), "slept");
    let times = TIMES.lock().unwrap().clone();
    assert_eq!(times.len(), 2, "{times:?}");
    let waited = times[1].1 - times[0].1;
    assert!(waited >= 400, "the timer fired early: {waited} ms");
    assert!(
        waited < 1000,
        "the timer started its delay again after the restart: {waited} ms"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_back_off_time_out_and_keep_their_count_across_a_restart() {
    use ferry_flow::Retry;
    static ATTEMPTS: AtomicU32 = AtomicU32::new(0);
    static GIVE_UP: AtomicU32 = AtomicU32::new(0);
    // Attempts 1 and 2 fail (2 by timing out), 3 hangs until the engine stops, and after
    // the restart attempt 4 succeeds: the count carried over.
    let code = |ctx: Ctx, _n: u32| async move {
        let v: u32 = ctx
            .step("flaky", |s| {
                let key = s.key().to_string();
                async move {
                    let n = ATTEMPTS.fetch_add(1, Ordering::SeqCst) + 1;
                    assert_eq!(key, "r/0/1", "every attempt gets the same key");
                    match n {
                        1 => Err("503".into()),
                        2 => {
                            tokio::time::sleep(Duration::from_secs(5)).await;
                            Ok(0)
                        }
                        3 => std::future::pending().await,
                        _ => Ok(n),
                    }
                }
            })
            .retry(Retry::exponential(5, Duration::from_millis(20)))
            .timeout(Duration::from_millis(200))
            .await?;
        Ok(format!("attempt {v}"))
    };
    let scratch = Scratch::new("flow-retry");
    let dir = scratch.dir("flow");
    {
        let engine = open(&dir, code);
        engine.start(ORDER, "r", &1).await.unwrap();
        eventually("attempt 3", || ATTEMPTS.load(Ordering::SeqCst) == 3).await;
    }
    let engine = open(&dir, code);
    assert_eq!(result_of(&engine, "r").await.unwrap(), "attempt 4");

    // A step that always fails gives up after its attempts, with the last error.
    let engine2_dir = scratch.dir("flow2");
    let engine2 = Engine::builder(&engine2_dir)
        .register(ORDER, |ctx: Ctx, _n: u32| async move {
            let _: u32 = ctx
                .step("down", |_| async {
                    GIVE_UP.fetch_add(1, Ordering::SeqCst);
                    Err("connection refused".into())
                })
                .retry(Retry::exponential(3, Duration::from_millis(1)))
                .await?;
            Ok(String::new())
        })
        .open()
        .unwrap();
    let msg = engine2
        .start(ORDER, "g", &1)
        .await
        .unwrap()
        .result()
        .await
        .unwrap_err()
        .to_string();
    assert!(msg.contains("connection refused"), "{msg}");
    assert_eq!(GIVE_UP.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_arrive_in_order_time_out_and_survive_a_restart() {
    use ferry_flow::Signal;
    static REVIEW: Signal<String> = Signal::new("review");
    static WAITING: AtomicU32 = AtomicU32::new(0);
    let code = |ctx: Ctx, _n: u32| async move {
        // Times out: nobody signals "never".
        static NEVER: Signal<u32> = Signal::new("never");
        let none = ctx.wait_for(NEVER, Some(Duration::from_millis(50))).await?;
        assert!(none.is_none());
        let first = ctx.wait_for(REVIEW, None).await?.unwrap();
        ctx.step("mark", |_| async {
            WAITING.fetch_add(1, Ordering::SeqCst);
            Ok(())
        })
        .await?;
        let second = ctx
            .wait_for(REVIEW, Some(Duration::from_secs(30)))
            .await?
            .unwrap();
        Ok(format!("{first} then {second}"))
    };
    let scratch = Scratch::new("flow-signal");
    let dir = scratch.dir("flow");
    {
        let engine = open(&dir, code);
        engine.start(ORDER, "sig", &1).await.unwrap();
        engine
            .signal("sig", REVIEW, &"approved".to_string())
            .await
            .unwrap();
        eventually("the first signal to be consumed", || {
            WAITING.load(Ordering::SeqCst) == 1
        })
        .await;
        // Now waiting for the second one; the engine stops.
    }
    let engine = open(&dir, code);
    engine
        .signal("sig", REVIEW, &"shipped".to_string())
        .await
        .unwrap();
    assert_eq!(
        result_of(&engine, "sig").await.unwrap(),
        "approved then shipped"
    );
    assert_eq!(
        WAITING.load(Ordering::SeqCst),
        1,
        "the step between the waits ran again"
    );
    assert!(matches!(
        engine.signal("sig", REVIEW, &"late".to_string()).await,
        Err(FlowError::RunFinished { id, signal }) if id == "sig" && signal == "review"
    ));
    assert!(matches!(
        engine.signal("nobody", REVIEW, &"x".to_string()).await,
        Err(FlowError::UnknownRun { id }) if id == "nobody"
    ));
}
