//! A sync that fails while a run waits, on a shard's thread, for what it depends on to
//! be durable: the wait ends with the log's error, the step after it never runs, and
//! the run's code sees the error (nothing hangs).

use ferry_flow::{Ctx, Engine, Workflow};
use ferry_log::sim::SimStorage;
use ferry_testkit::{Scratch, eventually};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

static W: Workflow<u32, u32> = Workflow::new("w");

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

    engine.start(W, "bad", &1).await.unwrap();
    eventually("step a's body", || entered.load(Ordering::SeqCst)).await;
    storage.fail_sync_after(1);
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
}
