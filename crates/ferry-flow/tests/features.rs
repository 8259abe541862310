//! What users see of cancellation, continue-as-new, child runs, queries and limits, on a
//! real log in a real directory, across restarts.

use ferry_flow::{Ctx, Engine, FlowError, Limit, Limits, Outcome, RunStatus, Signal, Workflow};
use ferry_testkit::{Scratch, eventually};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

static GO: Signal<u32> = Signal::new("go");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_run_cleans_up_and_ends_cancelled_also_across_a_restart() {
    static HOLD: Workflow<(), String> = Workflow::new("hold");
    static CLEANUPS: AtomicU32 = AtomicU32::new(0);
    static WAITING: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-cancel");
    let dir = scratch.dir("flow");
    let code = |ctx: Ctx, _: ()| async move {
        ctx.step("reserve", |_| async { Ok(()) }).await?;
        WAITING.fetch_add(1, Ordering::SeqCst);
        match ctx.wait_for(GO, None).await {
            Err(FlowError::Cancelled) => {
                assert!(ctx.cancelled());
                // Cleanup after a cancellation: steps run normally.
                ctx.step("release", |_| async {
                    CLEANUPS.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                })
                .await?;
                Err(FlowError::Cancelled)
            }
            other => Ok(format!("{other:?}")),
        }
    };
    {
        let engine = Engine::builder(&dir).register(HOLD, code).open().unwrap();
        engine.start(HOLD, "a", &()).await.unwrap();
        engine.start(HOLD, "b", &()).await.unwrap();
        eventually("both runs to wait", || WAITING.load(Ordering::SeqCst) == 2).await;
        assert!(engine.cancel("a").await.unwrap());
        let err = engine
            .run::<String>("a")
            .unwrap()
            .result()
            .await
            .unwrap_err();
        assert!(matches!(err, FlowError::Cancelled), "{err}");
        assert_eq!(CLEANUPS.load(Ordering::SeqCst), 1);
        assert!(
            !engine.cancel("a").await.unwrap(),
            "a finished run is not cancelled again"
        );
    }
    // After a restart a's cancellation and cleanup replay without running again; b,
    // never cancelled, still waits.
    let engine = Engine::builder(&dir).register(HOLD, code).open().unwrap();
    assert_eq!(
        engine.status("a"),
        Some(RunStatus::Finished(Outcome::Cancelled))
    );
    assert_eq!(engine.status("b"), Some(RunStatus::Running));
    engine.signal("b", GO, &1).await.unwrap();
    let out = engine.run::<String>("b").unwrap().result().await.unwrap();
    assert_eq!(out, "Ok(Some(1))");
    assert_eq!(CLEANUPS.load(Ordering::SeqCst), 1);
    assert!(matches!(
        engine.cancel("nope").await,
        Err(FlowError::UnknownRun { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancellation_requested_before_a_crash_is_observed_after_it() {
    static SLEEPY: Workflow<(), String> = Workflow::new("sleepy");
    static SLEEPING: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-cancel-restart");
    let dir = scratch.dir("flow");
    let code = |ctx: Ctx, _: ()| async move {
        SLEEPING.fetch_add(1, Ordering::SeqCst);
        let r = ctx.sleep(Duration::from_secs(3600)).await;
        if matches!(r, Err(FlowError::Cancelled)) {
            return Ok("cancelled mid-sleep".to_string());
        }
        r?;
        Ok("slept an hour".to_string())
    };
    {
        let engine = Engine::builder(&dir).register(SLEEPY, code).open().unwrap();
        engine.start(SLEEPY, "s", &()).await.unwrap();
        eventually("the sleep", || SLEEPING.load(Ordering::SeqCst) == 1).await;
        // Journal the request and stop before the run's reaction is durable.
        engine.cancel("s").await.unwrap();
    }
    let engine = Engine::builder(&dir).register(SLEEPY, code).open().unwrap();
    let out = engine.run::<String>("s").unwrap().result().await.unwrap();
    assert_eq!(out, "cancelled mid-sleep");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_run_can_be_cancelled() {
    static P: Workflow<(), ()> = Workflow::new("p");
    static WAITING: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-cancel-parked");
    let dir = scratch.dir("flow");
    {
        let engine = Engine::builder(&dir)
            .register(P, |ctx: Ctx, _: ()| async move {
                ctx.step("old", |_| async { Ok(()) }).await?;
                WAITING.fetch_add(1, Ordering::SeqCst);
                ctx.wait_for(GO, None).await?;
                Ok(())
            })
            .open()
            .unwrap();
        engine.start(P, "p", &()).await.unwrap();
        eventually("the wait", || WAITING.load(Ordering::SeqCst) == 1).await;
    }
    let changed = |ctx: Ctx, _: ()| async move {
        ctx.step("new", |_| async { Ok(()) }).await?;
        Ok(())
    };
    {
        let engine = Engine::builder(&dir).register(P, changed).open().unwrap();
        eventually("parking", || {
            matches!(engine.status("p"), Some(RunStatus::Parked(_)))
        })
        .await;
        assert!(engine.cancel("p").await.unwrap());
        let err = engine.run::<()>("p").unwrap().result().await.unwrap_err();
        assert!(matches!(err, FlowError::Cancelled), "{err}");
    }
    let engine = Engine::builder(&dir).register(P, changed).open().unwrap();
    assert_eq!(
        engine.status("p"),
        Some(RunStatus::Finished(Outcome::Cancelled)),
        "the cancellation of a parked run is durable"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_as_new_keeps_the_history_bounded_and_the_run_whole() {
    static COUNTER: Workflow<u32, u32> = Workflow::new("counter");
    static STEPS: AtomicU32 = AtomicU32::new(0);
    static KEYS: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let scratch = Scratch::new("flow-can");
    let dir = scratch.dir("flow");
    // Each generation adds one signal's value and 1 (a step), then continues; the
    // tenth finishes. A history limit of 8 entries would fail a run that kept one
    // generation.
    let code = |ctx: Ctx, total: u32| async move {
        let add = ctx.wait_for(GO, None).await?.unwrap_or(0);
        let one: u32 = ctx
            .step("one", |s| {
                STEPS.fetch_add(1, Ordering::SeqCst);
                KEYS.lock().unwrap().push(s.key().to_string());
                async { Ok(1) }
            })
            .await?;
        let total = total + add + one;
        if ctx.run_id() == "c" && total < 10 * 11 / 2 + 10 {
            return Err(ctx.continue_as_new(&total));
        }
        Ok(total)
    };
    let limits = Limits {
        history: 8,
        ..Limits::default()
    };
    {
        let engine = Engine::builder(&dir)
            .limits(limits)
            .register(COUNTER, code)
            .open()
            .unwrap();
        engine.start(COUNTER, "c", &0).await.unwrap();
        // Signals sent ahead of the generations that consume them carry over.
        for v in 1..=5 {
            engine.signal("c", GO, &v).await.unwrap();
        }
        eventually("five generations", || STEPS.load(Ordering::SeqCst) == 5).await;
    }
    let engine = Engine::builder(&dir)
        .limits(limits)
        .register(COUNTER, code)
        .open()
        .unwrap();
    for v in 6..=10 {
        engine.signal("c", GO, &v).await.unwrap();
    }
    let out = engine.run::<u32>("c").unwrap().result().await.unwrap();
    assert_eq!(out, 55 + 10);
    assert_eq!(
        STEPS.load(Ordering::SeqCst),
        10,
        "each generation's step ran once"
    );
    let keys = KEYS.lock().unwrap().clone();
    assert_eq!(keys[0], "c/0/2");
    assert_eq!(keys[9], "c/9/2", "keys name the generation");
    let info = engine.runs();
    assert_eq!(info[0].generation, 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_runs_once_and_its_result_survives_a_restart_of_the_parent() {
    static PARENT: Workflow<u32, String> = Workflow::new("parent");
    static CHILD: Workflow<u32, u32> = Workflow::new("child");
    static CHILD_STEPS: AtomicU32 = AtomicU32::new(0);
    static PARENT_WAITING: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-child");
    let dir = scratch.dir("flow");
    let builder = |dir: &std::path::Path| {
        Engine::builder(dir)
            .register(PARENT, |ctx: Ctx, n: u32| async move {
                let doubled = ctx.child(CHILD, &n).await?;
                PARENT_WAITING.fetch_add(1, Ordering::SeqCst);
                ctx.wait_for(GO, None).await?;
                let failed = ctx.child(CHILD, &0).await;
                Ok(format!("{doubled} {failed:?}"))
            })
            .register(CHILD, |ctx: Ctx, n: u32| async move {
                let d: u32 = ctx
                    .step("double", |_| {
                        CHILD_STEPS.fetch_add(1, Ordering::SeqCst);
                        async move {
                            if n == 0 {
                                Err("zero".into())
                            } else {
                                Ok(n * 2)
                            }
                        }
                    })
                    .await?;
                Ok(d)
            })
    };
    {
        let engine = builder(&dir).open().unwrap();
        engine.start(PARENT, "p", &21).await.unwrap();
        eventually("the first child", || {
            PARENT_WAITING.load(Ordering::SeqCst) == 1
        })
        .await;
        let runs = engine.runs();
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[1].id, "p/0/1");
        assert_eq!(runs[1].parent.as_deref(), Some("p"));
        assert_eq!(
            engine.run::<u32>("p/0/1").unwrap().result().await.unwrap(),
            42
        );
    }
    let engine = builder(&dir).open().unwrap();
    engine.signal("p", GO, &1).await.unwrap();
    let out = engine.run::<String>("p").unwrap().result().await.unwrap();
    assert!(
        out.starts_with(
            "42 Err(Child { id: \"p/0/3\", error: \"step \\\"double\\\" failed: zero\" })"
        ),
        "{out}"
    );
    assert_eq!(
        CHILD_STEPS.load(Ordering::SeqCst),
        2,
        "each child's step ran once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_parent_cancels_the_child_it_waits_for() {
    static PARENT: Workflow<(), String> = Workflow::new("parent");
    static CHILD: Workflow<(), ()> = Workflow::new("child");
    let scratch = Scratch::new("flow-child-cancel");
    let engine = Engine::builder(scratch.dir("flow"))
        .register(PARENT, |ctx: Ctx, _: ()| async move {
            match ctx.child(CHILD, &()).await {
                Err(FlowError::Cancelled) => Ok("parent saw its cancellation".to_string()),
                other => Ok(format!("{other:?}")),
            }
        })
        .register(CHILD, |ctx: Ctx, _: ()| async move {
            ctx.wait_for(GO, None).await?;
            Ok(())
        })
        .open()
        .unwrap();
    engine.start(PARENT, "p", &()).await.unwrap();
    eventually("the child", || engine.status("p/0/1").is_some()).await;
    engine.cancel("p").await.unwrap();
    let out = engine.run::<String>("p").unwrap().result().await.unwrap();
    assert_eq!(out, "parent saw its cancellation");
    let child = engine.run::<()>("p/0/1").unwrap().result().await;
    assert!(matches!(child, Err(FlowError::Cancelled)), "{child:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queries_see_what_the_run_published_also_after_a_restart() {
    static Q: Workflow<(), ()> = Workflow::new("q");
    static AT_WAIT: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-query");
    let dir = scratch.dir("flow");
    let code = |ctx: Ctx, _: ()| async move {
        ctx.publish(&"charging")?;
        let id = ctx.uuid()?;
        ctx.step("charge", |_| async { Ok(()) }).await?;
        ctx.publish(&format!("awaiting review ({id})"))?;
        AT_WAIT.fetch_add(1, Ordering::SeqCst);
        ctx.wait_for(GO, None).await?;
        Ok(())
    };
    let first;
    {
        let engine = Engine::builder(&dir).register(Q, code).open().unwrap();
        engine.start(Q, "q", &()).await.unwrap();
        eventually("the wait", || AT_WAIT.load(Ordering::SeqCst) == 1).await;
        first = engine.query::<String>("q").unwrap().unwrap();
        assert!(first.starts_with("awaiting review ("), "{first}");
        assert_eq!(first.len(), "awaiting review ()".len() + 36);
    }
    let engine = Engine::builder(&dir).register(Q, code).open().unwrap();
    eventually("the replay", || AT_WAIT.load(Ordering::SeqCst) == 2).await;
    assert_eq!(
        engine.query::<String>("q").unwrap().unwrap(),
        first,
        "replay publishes the same state, with the same uuid"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_fail_the_one_run_or_refuse_the_caller_with_a_clear_error() {
    static BIG: Workflow<usize, String> = Workflow::new("big");
    static TEXT: Workflow<String, ()> = Workflow::new("text");
    static RUNS: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-limits");
    let dir = scratch.dir("flow");
    let limits = Limits {
        payload_bytes: 4096,
        history: 20,
        timers: 2,
        signals: 3,
    };
    let code = |ctx: Ctx, n: usize| async move {
        match n {
            // A step result over the payload limit: the body ran once; the step fails.
            0 => {
                let r: Result<String, _> = ctx
                    .step("fetch", |_| {
                        RUNS.fetch_add(1, Ordering::SeqCst);
                        async { Ok("x".repeat(10_000)) }
                    })
                    .await;
                r.map(|s| s.len().to_string())
            }
            // An endless loop of steps: the history limit ends it.
            1 => loop {
                ctx.step("tick", |_| async { Ok(()) }).await?;
            },
            // Too many sleeps at once.
            2 => {
                let (a, b, c) = tokio::join!(
                    ctx.sleep(Duration::from_millis(50)),
                    ctx.sleep(Duration::from_millis(50)),
                    ctx.sleep(Duration::from_millis(50)),
                );
                Ok(format!("{a:?} {b:?} {c:?}"))
            }
            // An output over the payload limit.
            3 => Ok("y".repeat(10_000)),
            // Blocked on another signal while GO signals pile up, then consumes them.
            _ => {
                static OPEN: Signal<()> = Signal::new("open");
                ctx.wait_for(OPEN, Some(Duration::from_secs(1))).await?;
                for _ in 0..3 {
                    ctx.wait_for(GO, None).await?;
                }
                Ok("ok".into())
            }
        }
    };
    let engine = Engine::builder(&dir)
        .limits(limits)
        .register(BIG, code)
        .register(TEXT, |_: Ctx, _: String| async { Ok(()) })
        .open()
        .unwrap();
    let result = |id: &'static str| {
        let h = engine.run::<String>(id).unwrap();
        async move { h.result().await }
    };
    engine.start(BIG, "payload", &0).await.unwrap();
    let err = result("payload").await.unwrap_err().to_string();
    assert!(
        err.contains("over the limit of 4096") && err.contains("blob store"),
        "{err}"
    );
    engine.start(BIG, "history", &1).await.unwrap();
    let err = result("history").await.unwrap_err().to_string();
    assert!(
        err.contains("history length") && err.contains("continue_as_new"),
        "{err}"
    );
    engine.start(BIG, "timers", &2).await.unwrap();
    let out = result("timers").await.unwrap();
    assert!(out.contains("Ok(()) Ok(()) Err(LimitExceeded"), "{out}");
    engine.start(BIG, "output", &3).await.unwrap();
    let err = result("output").await.unwrap_err().to_string();
    assert!(err.contains("the run's output"), "{err}");

    // Callers over a limit are refused and nothing is journaled.
    let records = engine.log_stats().records;
    let err = engine.start(TEXT, "huge-input", &"z".repeat(10_000)).await;
    assert!(
        matches!(
            err,
            Err(FlowError::LimitExceeded {
                limit: Limit::Payload,
                ..
            })
        ),
        "{:?}",
        err.err()
    );
    assert!(engine.status("huge-input").is_none());
    engine.start(BIG, "waiter", &9).await.unwrap();
    for i in 0..3 {
        engine.signal("waiter", GO, &i).await.unwrap();
    }
    let before = engine.log_stats().records;
    let err = engine.signal("waiter", GO, &3).await.unwrap_err();
    assert!(
        matches!(
            err,
            FlowError::LimitExceeded {
                limit: Limit::Signals,
                ..
            }
        ),
        "{err}"
    );
    static HUGE: Signal<String> = Signal::new("huge");
    let err = engine
        .signal("waiter", HUGE, &"h".repeat(5000))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            FlowError::LimitExceeded {
                limit: Limit::Payload,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        engine.log_stats().records,
        before,
        "refused calls journal nothing"
    );
    assert!(records < before);
    assert_eq!(
        result("waiter").await.unwrap(),
        "ok",
        "other runs are unaffected"
    );
    drop(engine);

    // After a restart the over-limit step is not run again: its refusal is journaled.
    let engine = Engine::builder(&dir)
        .limits(limits)
        .register(BIG, code)
        .open()
        .unwrap();
    let err = engine
        .run::<String>("payload")
        .unwrap()
        .result()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("over the limit"), "{err}");
    assert_eq!(RUNS.load(Ordering::SeqCst), 1);
}
