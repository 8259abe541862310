//! A sync that fails while a run waits, on a shard's thread, for what it depends on to
//! be durable: the wait ends with the log's error, the step after it never runs, the
//! run's code sees the error, and every caller awaiting a result hears of it (nothing
//! hangs). And an engine dropped with callers still waiting answers them too.

use ferry_flow::{Ctx, Engine, FlowError, Signal, Workflow};
use ferry_log::sim::SimStorage;
use ferry_testkit::{Scratch, eventually};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

static W: Workflow<u32, u32> = Workflow::new("w");
static GO: Signal<()> = Signal::new("go");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_sync_ends_the_waits_of_runs_on_shard_threads() {
    let scratch = Scratch::new("flow-failed-sync");
    let storage = Arc::new(SimStorage::new(7));
    let entered = Arc::new(AtomicBool::new(false));
    let release = Arc::new(AtomicBool::new(false));
    let b_ran = Arc::new(AtomicU32::new(0));
    let seen: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
    let (e, r, b, s) = (
        entered.clone(),
        release.clone(),
        b_ran.clone(),
        seen.clone(),
    );
    let engine = Engine::builder(scratch.dir("flow"))
        .storage(storage.clone())
        .register(W, move |ctx: Ctx, n: u32| {
            let (e, r, b, s) = (e.clone(), r.clone(), b.clone(), s.clone());
            async move {
                if n == 2 {
                    ctx.wait_for(GO, None).await?;
                    return Ok(2);
                }
                if n == 0 {
                    // The path that works: every wait on a shard's list.
                    ctx.step("a", |_| async { Ok(1) }).await?;
                    ctx.step("b", |_| async { Ok(2) }).await?;
                    return Ok(0);
                }
                ctx.step("a", move |_| {
                    let (e, r) = (e.clone(), r.clone());
                    async move {
                        e.store(true, Ordering::SeqCst);
                        while !r.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        Ok(1)
                    }
                })
                .await?;
                // Waits for step a's result to be durable: that sync fails.
                let got = ctx
                    .step("b", move |_| {
                        b.fetch_add(1, Ordering::SeqCst);
                        async { Ok(2) }
                    })
                    .await;
                if let Err(err) = &got {
                    *s.lock().unwrap() = Some(err.to_string());
                }
                got
            }
        })
        .open()
        .unwrap();
    let ok = engine.start(W, "ok", &0).await.unwrap();
    assert_eq!(ok.result().await.unwrap(), 0);

    // A run that touches no log while the sync fails: its caller must hear of it too.
    let idle = engine.start(W, "idle", &2).await.unwrap();
    let idle_result = tokio::spawn(async move { idle.result().await });
    let bad = engine.start(W, "bad", &1).await.unwrap();
    let bad_result = tokio::spawn(async move { bad.result().await });
    eventually("step a's body", || entered.load(Ordering::SeqCst)).await;
    // Every sync from now fails (the next one alone could be a sync of something else).
    storage.fail_syncs_from_now();
    release.store(true, Ordering::SeqCst);
    eventually("the run to see the error", || {
        seen.lock().unwrap().is_some()
    })
    .await;
    let err = seen.lock().unwrap().clone().unwrap();
    assert!(err.contains("sync") || err.contains("durable"), "{err}");
    assert_eq!(
        b_ran.load(Ordering::SeqCst),
        0,
        "step b ran without step a durable"
    );
    // Every caller waiting for a result hears that the journal failed (the runs resume
    // when the engine reopens), and so does one that asks afterwards: nothing hangs.
    for (what, waiting) in [("bad", bad_result), ("idle", idle_result)] {
        let got = tokio::time::timeout(Duration::from_secs(30), waiting)
            .await
            .unwrap_or_else(|_| panic!("{what}'s result() still waits"))
            .unwrap();
        assert!(matches!(got, Err(FlowError::Log(_))), "{what}: {got:?}");
    }
    let later = engine.run::<u32>("idle").unwrap().result().await;
    assert!(matches!(later, Err(FlowError::Log(_))), "{later:?}");
}

/// A caller waiting for a result when the engine is dropped hears that it stopped, and
/// a handle left over keeps neither the engine nor its directory: it reopens at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_engine_answers_every_result_and_lets_go_of_the_directory() {
    let scratch = Scratch::new("flow-drop");
    let dir = scratch.dir("flow");
    let open = || {
        Engine::builder(&dir)
            .register(W, |ctx: Ctx, n: u32| async move {
                ctx.step("a", move |_| async move { Ok(n) }).await?;
                ctx.publish(&"waiting")?;
                ctx.wait_for(GO, None).await?;
                Ok(n)
            })
            .open()
            .unwrap()
    };
    let engine = open();
    let h = engine.start(W, "r", &7).await.unwrap();
    let waiting = tokio::spawn(async move { h.result().await });
    let kept = engine.run::<u32>("r").unwrap();
    eventually("the run to wait for its signal", || {
        engine.query::<String>("r").ok().flatten().as_deref() == Some("waiting")
    })
    .await;
    drop(engine);
    let got = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("result() still waits after the engine was dropped")
        .unwrap();
    assert!(matches!(got, Err(FlowError::Stopped)), "{got:?}");
    assert!(matches!(kept.result().await, Err(FlowError::Stopped)));
    let engine = open();
    engine.signal("r", GO, &()).await.unwrap();
    assert_eq!(engine.run::<u32>("r").unwrap().result().await.unwrap(), 7);
}

/// A sync that fails while no run's own code touches the log (every run waits for a
/// signal; the failure surfaces in the signal's own wait): the callers waiting for
/// those runs' results still hear of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_met_by_a_signal_reaches_the_callers_of_waiting_runs() {
    let scratch = Scratch::new("flow-failed-signal");
    let storage = Arc::new(SimStorage::new(11));
    let engine = Engine::builder(scratch.dir("flow"))
        .storage(storage.clone())
        .register(W, |ctx: Ctx, n: u32| async move {
            ctx.publish(&"waiting")?;
            ctx.wait_for(GO, None).await?;
            Ok(n)
        })
        .open()
        .unwrap();
    let mut waiting = Vec::new();
    for id in ["a", "b"] {
        let h = engine.start(W, id, &1).await.unwrap();
        eventually("the run to wait for its signal", || {
            engine.query::<String>(id).ok().flatten().as_deref() == Some("waiting")
        })
        .await;
        waiting.push((id, tokio::spawn(async move { h.result().await })));
    }
    storage.fail_syncs_from_now();
    let sent = engine.signal("a", GO, &()).await;
    assert!(matches!(sent, Err(FlowError::Log(_))), "{sent:?}");
    for (id, w) in waiting {
        let got = tokio::time::timeout(Duration::from_secs(30), w)
            .await
            .unwrap_or_else(|_| panic!("{id}'s result() still waits"))
            .unwrap();
        assert!(matches!(got, Err(FlowError::Log(_))), "{id}: {got:?}");
    }
}
