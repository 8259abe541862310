//! `EngineBuilder::max_running`: how many runs run at once on a shard, what waits for a
//! place, and what gives its place up while it waits.

use ferry_flow::{Ctx, Engine, FlowError, Signal, Workflow};
use ferry_testkit::{Scratch, eventually};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

/// The value of the gauge `name` (no labels) in the engine's metrics.
fn gauge(engine: &Engine, name: &str) -> f64 {
    let metrics = engine.metrics();
    let line = metrics
        .lines()
        .find(|l| l.split(' ').next() == Some(name))
        .unwrap_or_else(|| panic!("no {name} in\n{metrics}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_more_than_max_running_runs_run_at_once_and_the_rest_wait_in_order() {
    static HOLD: Workflow<u32, u32> = Workflow::new("hold");
    static LIVE: AtomicU32 = AtomicU32::new(0);
    static MOST: AtomicU32 = AtomicU32::new(0);
    static ORDER: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());
    static GATE: AtomicBool = AtomicBool::new(false);
    let scratch = Scratch::new("flow-running");
    let engine = Engine::builder(scratch.dir("flow"))
        .shards(1)
        .max_running(Some(3))
        .register(HOLD, |ctx: Ctx, n: u32| async move {
            ctx.step("hold", move |_| async move {
                ORDER.lock().unwrap().push(n);
                let live = LIVE.fetch_add(1, Ordering::SeqCst) + 1;
                MOST.fetch_max(live, Ordering::SeqCst);
                while !GATE.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                LIVE.fetch_sub(1, Ordering::SeqCst);
                Ok(n)
            })
            .await
        })
        .open()
        .unwrap();
    for n in 0..10 {
        engine.start(HOLD, &format!("r{n}"), &n).await.unwrap();
    }
    eventually("three runs to hold their step", || {
        LIVE.load(Ordering::SeqCst) == 3
    })
    .await;
    // Every start was acknowledged; seven of them wait for a place (once their shard
    // took them up).
    eventually("seven runs to wait for a place", || {
        gauge(&engine, "ferry_flow_runs_waiting") == 7.0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(MOST.load(Ordering::SeqCst), 3);
    GATE.store(true, Ordering::SeqCst);
    for n in 0..10 {
        let out = engine
            .run::<u32>(&format!("r{n}"))
            .unwrap()
            .result()
            .await
            .unwrap();
        assert_eq!(out, n);
    }
    assert_eq!(MOST.load(Ordering::SeqCst), 3);
    assert_eq!(gauge(&engine, "ferry_flow_runs_waiting"), 0.0);
    // Places are given in the order the runs reached their shard: their starts' order.
    assert_eq!(*ORDER.lock().unwrap(), (0..10).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_waiting_for_a_signal_a_timer_or_a_child_give_up_their_place() {
    static GO: Signal<u32> = Signal::new("go");
    static WAITER: Workflow<(), u32> = Workflow::new("waiter");
    static SLEEPER: Workflow<(), u32> = Workflow::new("sleeper");
    static PARENT: Workflow<(), u32> = Workflow::new("parent");
    static CHILD: Workflow<u32, u32> = Workflow::new("child");
    static WAITING: AtomicU32 = AtomicU32::new(0);
    let scratch = Scratch::new("flow-running-parked");
    // One shard, one place: anything that kept its place while it waited would stop
    // every other run on the engine.
    let open = || {
        Engine::builder(scratch.dir("flow"))
            .shards(1)
            .max_running(Some(1))
            .register(WAITER, |ctx: Ctx, ()| async move {
                WAITING.fetch_add(1, Ordering::SeqCst);
                let got = ctx.wait_for(GO, None).await?.unwrap_or(0);
                ctx.step("after", move |_| async move { Ok(got + 1) }).await
            })
            .register(SLEEPER, |ctx: Ctx, ()| async move {
                ctx.sleep(Duration::from_millis(300)).await?;
                ctx.step("after", |_| async { Ok(7) }).await
            })
            .register(PARENT, |ctx: Ctx, ()| async move {
                let a = ctx.child(CHILD, &1).await?;
                let b = ctx.child(CHILD, &2).await?;
                Ok::<u32, FlowError>(a + b)
            })
            .register(CHILD, |ctx: Ctx, n: u32| async move {
                ctx.step("double", move |_| async move { Ok(n * 2) }).await
            })
            .open()
            .unwrap()
    };
    {
        let engine = open();
        engine.start(SLEEPER, "sleeper", &()).await.unwrap();
        for n in 0..5 {
            engine.start(WAITER, &format!("w{n}"), &()).await.unwrap();
        }
        engine.start(PARENT, "parent", &()).await.unwrap();
        // Each waiter reached its wait with the sleeper asleep before it: each gave its
        // place to the next.
        eventually("every waiter to wait", || {
            WAITING.load(Ordering::SeqCst) == 5
        })
        .await;
        let parent = engine.run::<u32>("parent").unwrap().result().await;
        assert_eq!(
            parent.unwrap(),
            6,
            "the children ran while their parent waited"
        );
        let sleeper = engine.run::<u32>("sleeper").unwrap().result().await;
        assert_eq!(sleeper.unwrap(), 7);
        assert!(
            WAITING.load(Ordering::SeqCst) == 5,
            "the waiters still wait"
        );
    }
    // After a restart the waiters replay up to their wait, one place for them all.
    let engine = open();
    eventually("every waiter to wait again", || {
        WAITING.load(Ordering::SeqCst) == 10
    })
    .await;
    for n in 0..5 {
        engine.signal(&format!("w{n}"), GO, &n).await.unwrap();
    }
    for n in 0..5 {
        let out = engine
            .run::<u32>(&format!("w{n}"))
            .unwrap()
            .result()
            .await
            .unwrap();
        assert_eq!(out, n + 1);
    }
}

#[test]
fn a_bound_of_zero_is_refused() {
    let scratch = Scratch::new("flow-running-zero");
    let err = Engine::builder(scratch.dir("flow"))
        .max_running(Some(0))
        .open()
        .err()
        .expect("max_running 0 is refused");
    assert!(
        matches!(&err, ferry_flow::FlowError::Config(c) if c.setting == "max_running" && c.value == "0"),
        "{err}"
    );
    assert!(err.to_string().contains("must be between 1"), "{err}");
}
