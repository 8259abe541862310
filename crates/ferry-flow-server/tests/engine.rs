//! The engine as a server's worker (`Engine::builder(..).server(..)`, docs/flow-server.md
//! §1, §7, §8): the same workflow code as embedded, its shards granted by a real server
//! over a real socket; shards spread over the workers present, move to a standby when
//! their holder closes, and their runs resume there from what the server holds, with
//! no journaled step run twice.

mod common;

use common::{close, more_than_once, open_worker, start};
use ferry_flow::{Ctx, Engine, FlowError, Signal, Workflow};
use ferry_testkit::{Scratch, eventually};
use std::collections::BTreeMap;
use std::sync::Mutex;

static ORDER: Workflow<u32, u64> = Workflow::new("order");
static GO: Signal<u32> = Signal::new("go");

/// How many times each step's body ran, by its key, across every engine of the test.
static RAN: Mutex<BTreeMap<String, u32>> = Mutex::new(BTreeMap::new());

/// An order: charge (a step), wait for "go", ship (a step).
async fn order(ctx: Ctx, n: u32) -> Result<u64, FlowError> {
    let charged: u64 = ctx
        .step("charge", |s| async move {
            *RAN.lock().unwrap().entry(s.key().to_string()).or_default() += 1;
            assert!(s.epoch().is_some(), "a worker's step knows its epoch");
            Ok(u64::from(n) * 10)
        })
        .await?;
    let go = ctx.wait_for(GO, None).await?.unwrap_or(0);
    let shipped: u64 = ctx
        .step("ship", |s| async move {
            *RAN.lock().unwrap().entry(s.key().to_string()).or_default() += 1;
            Ok(u64::from(go))
        })
        .await?;
    Ok(charged + shipped)
}

/// Guards guarantees 4 and 5 with real engines: one worker runs orders on the shards
/// it is granted; a second worker joining takes some shards over (rebalance); the first
/// closing hands the rest back; every order, started on the first, finishes on the
/// second with each step's body run once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_move_between_worker_engines_and_every_run_finishes_once() {
    const SHARDS: u32 = 4;
    const RUNS: u32 = 40;
    let scratch = Scratch::new("flow-engine-move");
    let socket = scratch.path().join("s.sock");
    let server = start(scratch.path(), &socket, SHARDS);
    let a = open_worker(&scratch.dir("a"), &socket, |b| b.register(ORDER, order)).await;
    eventually("the first worker to hold every shard", || {
        a.held_shards().len() == SHARDS as usize
    })
    .await;
    // Orders on every shard, each charged and waiting for "go".
    for i in 0..RUNS {
        a.start(ORDER, &format!("order-{i}"), &i).await.unwrap();
    }
    eventually("every order to be charged", || {
        RAN.lock()
            .unwrap()
            .keys()
            .filter(|k| k.ends_with("/1"))
            .count()
            == RUNS as usize
    })
    .await;
    // A second worker: the server asks the first for half of the shards.
    let b = open_worker(&scratch.dir("b"), &socket, |b| b.register(ORDER, order)).await;
    eventually("the shards to spread over both workers", || {
        a.held_shards().len() == 2 && b.held_shards().len() == 2
    })
    .await;
    // A run on a shard the worker does not hold is refused as such.
    let (elsewhere, _) = b.held_shards()[0];
    let foreign = (0..RUNS).map(|i| format!("order-{i}")).find(|id| {
        a.query::<u32>(id)
            .is_err_and(|e| matches!(e, FlowError::NotHeld { shard, .. } if shard == elsewhere))
    });
    assert!(
        foreign.is_some(),
        "some order lives on shard {elsewhere}, held by b"
    );
    // The first hands everything back as it closes.
    close(a).await;
    eventually("the second worker to hold every shard", || {
        b.held_shards().len() == SHARDS as usize
    })
    .await;
    for i in 0..RUNS {
        b.signal(&format!("order-{i}"), GO, &1).await.unwrap();
    }
    for i in 0..RUNS {
        let out = b
            .run::<u64>(&format!("order-{i}"))
            .expect("recovered on the second worker")
            .result()
            .await
            .unwrap();
        assert_eq!(out, u64::from(i) * 10 + 1);
    }
    assert_eq!(more_than_once(&RAN), Vec::<(String, u32)>::new());
    assert_eq!(RAN.lock().unwrap().len(), 2 * RUNS as usize);
    close(b).await;
    server.stop().await;
}

static WEDGE: Workflow<u32, u64> = Workflow::new("wedge");

/// Guards guarantee 3 (T7): a step body that blocks its shard's thread stops the
/// shard's turns while the worker's pings flow; the shard is handed back (or revoked)
/// after `stuck_after` and granted to the other worker, where the step runs again
/// with the same key under a higher epoch and the run finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wedged_shard_moves() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static FIRST: AtomicBool = AtomicBool::new(true);
    static BODIES: Mutex<Vec<(String, Option<u64>)>> = Mutex::new(Vec::new());
    let scratch = Scratch::new("flow-engine-wedge");
    let socket = scratch.path().join("s.sock");
    let settings = ferry_flow_server::server::Settings {
        stuck_after: std::time::Duration::from_millis(1_000),
        ..common::settings(1)
    };
    let server = common::start_with(scratch.path(), &socket, settings);
    let open = |dir: std::path::PathBuf| {
        let addr = format!("unix:{}", socket.display());
        tokio::task::spawn_blocking(move || {
            Engine::builder(dir)
                .server(addr)
                .register(WEDGE, |ctx: Ctx, n: u32| async move {
                    ctx.step("block", |s| async move {
                        BODIES
                            .lock()
                            .unwrap()
                            .push((s.key().to_string(), s.epoch()));
                        if FIRST.swap(false, Ordering::SeqCst) {
                            // Wedges the shard's thread: no await, no turns.
                            std::thread::sleep(std::time::Duration::from_secs(4));
                        }
                        Ok(u64::from(n) + s.epoch().unwrap_or(0) * 1_000)
                    })
                    .await
                })
                .open()
                .unwrap()
        })
    };
    let a = open(scratch.dir("a")).await.unwrap();
    eventually("a to hold the shard", || a.held_shards().len() == 1).await;
    a.start(WEDGE, "w", &7).await.unwrap();
    eventually("the body to start on a", || {
        BODIES.lock().unwrap().len() == 1
    })
    .await;
    let b = open(scratch.dir("b")).await.unwrap();
    eventually("the wedged shard to move to b", || {
        b.held_shards().len() == 1
    })
    .await;
    let out = b
        .run::<u64>("w")
        .expect("recovered on b")
        .result()
        .await
        .unwrap();
    let bodies = BODIES.lock().unwrap().clone();
    assert_eq!(bodies.len(), 2, "{bodies:?}");
    assert_eq!(bodies[0].0, bodies[1].0, "the same key on both workers");
    let (first, second) = (bodies[0].1.unwrap(), bodies[1].1.unwrap());
    assert!(second > first, "a higher epoch on b: {bodies:?}");
    assert_eq!(out, 7 + second * 1_000);
    close(b).await;
    // a's close waits for its wedged thread to come back.
    close(a).await;
    server.stop().await;
}

static MIX: Workflow<u32, u64> = Workflow::new("mix");
static KID: Workflow<u32, u64> = Workflow::new("kid");

/// A workflow that uses most of what a run can do: a step, a child, a signal, a
/// durable sleep, continue-as-new, a drawn value.
async fn mix(ctx: Ctx, n: u32) -> Result<u64, FlowError> {
    let a: u64 = ctx
        .step("a", |_| async move { Ok(u64::from(n) * 2) })
        .await?;
    let kid: u64 = ctx.child(KID, &n).await?;
    let go = ctx.wait_for(GO, None).await?.unwrap_or(0);
    ctx.sleep(std::time::Duration::from_millis(10)).await?;
    if n < 1_000 && n.is_multiple_of(3) {
        return Err(ctx.continue_as_new(&(n + 1_000)));
    }
    // A drawn value is journaled like a step (what it is differs between engines).
    ctx.random_u64()?;
    ctx.step("b", |_| async move { Ok(a + kid + u64::from(go)) })
        .await
}

/// The runs an engine lists, without what may differ between two engines.
fn listing(e: &Engine) -> Vec<(String, String, u32, String, Option<String>)> {
    e.runs()
        .into_iter()
        .map(|r| {
            let status = format!("{:?}", r.status);
            (r.id, r.workflow, r.generation, status, r.parent)
        })
        .collect()
}

/// Guards guarantee 7's first half (T1, without the HTTP API yet): the same workflow
/// code on a worker of a server and on an embedded engine gives the same results and
/// the same runs (children, generations, statuses), signals included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_and_a_worker_match_the_embedded_engine() {
    const RUNS: u32 = 12;
    let scratch = Scratch::new("flow-engine-match");
    let socket = scratch.path().join("s.sock");
    let server = start(scratch.path(), &socket, 4);
    let open = |dir: std::path::PathBuf, addr: Option<String>| {
        tokio::task::spawn_blocking(move || {
            let mut b = Engine::builder(dir).shards(4);
            if let Some(addr) = addr {
                b = b.server(addr);
            }
            b.register(MIX, mix)
                .register(KID, |ctx: Ctx, n: u32| async move {
                    ctx.step("k", |_| async move { Ok(u64::from(n) + 1) }).await
                })
                .open()
                .unwrap()
        })
    };
    let embedded = open(scratch.dir("embedded"), None).await.unwrap();
    let worker = open(
        scratch.dir("worker"),
        Some(format!("unix:{}", socket.display())),
    )
    .await
    .unwrap();
    eventually("the worker to hold every shard", || {
        worker.held_shards().len() == 4
    })
    .await;
    let mut outputs = Vec::new();
    for e in [&embedded, &worker] {
        for i in 0..RUNS {
            e.start(MIX, &format!("mix-{i}"), &i).await.unwrap();
        }
        let mut out = Vec::new();
        for i in 0..RUNS {
            let id = format!("mix-{i}");
            // A signal for each generation's wait.
            while e.status(&id) == Some(ferry_flow::RunStatus::Running) {
                let _ = e.signal(&id, GO, &(i + 5)).await;
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            out.push(e.run::<u64>(&id).unwrap().result().await.unwrap());
        }
        outputs.push(out);
    }
    assert_eq!(outputs[0], outputs[1], "the same results");
    assert_eq!(listing(&embedded), listing(&worker), "the same runs");
    close(worker).await;
    drop(embedded);
    server.stop().await;
}

static QUICK: Workflow<u32, u64> = Workflow::new("quick");
static WAIT: Workflow<u32, u64> = Workflow::new("wait");
static PARENT: Workflow<u32, u64> = Workflow::new("parent");

/// Guards §14's worker retention: a worker forgets its finished runs `retention` after
/// it saw them finish (its memory does not grow with every run it ever held), a child
/// not before its parent finished; their results still come from the server's index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_forgets_finished_runs_after_its_retention_and_the_server_still_answers() {
    const RUNS: u32 = 20;
    let scratch = Scratch::new("flow-engine-retention");
    let socket = scratch.path().join("s.sock");
    let server = start(scratch.path(), &socket, 2);
    let w = open_worker(&scratch.dir("w"), &socket, |b| {
        b.retention(std::time::Duration::from_millis(300))
            .register(QUICK, |ctx: Ctx, n: u32| async move {
                ctx.step("s", |_| async move { Ok(u64::from(n) + 7) }).await
            })
            .register(WAIT, |ctx: Ctx, _: u32| async move {
                Ok(u64::from(ctx.wait_for(GO, None).await?.unwrap_or(0)))
            })
            .register(PARENT, |ctx: Ctx, n: u32| async move {
                let kid: u64 = ctx.child(QUICK, &n).await?;
                Ok(kid + u64::from(ctx.wait_for(GO, None).await?.unwrap_or(0)))
            })
    })
    .await;
    eventually("the worker to hold every shard", || {
        w.held_shards().len() == 2
    })
    .await;
    // A run still waiting stays however long it waits.
    w.start(WAIT, "waiting", &1).await.unwrap();
    // A finished child stays while its parent waits.
    w.start(PARENT, "parent", &1).await.unwrap();
    for i in 0..RUNS {
        let id = format!("quick-{i}");
        w.start(QUICK, &id, &i).await.unwrap();
        assert_eq!(
            w.run::<u64>(&id).unwrap().result().await.unwrap(),
            u64::from(i) + 7
        );
    }
    eventually("the finished runs to be forgotten", || {
        let ids: Vec<String> = w.runs().into_iter().map(|r| r.id).collect();
        ids.len() == 3 && ids[0] == "parent" && ids[1].starts_with("parent/") && ids[2] == "waiting"
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(w.runs().len(), 3, "the child stays while its parent waits");
    w.signal("parent", GO, &2).await.unwrap();
    assert_eq!(
        w.run::<u64>("parent").unwrap().result().await.unwrap(),
        8 + 2
    );
    eventually("the parent and its child to be forgotten", || {
        w.runs().iter().map(|r| r.id.as_str()).collect::<Vec<_>>() == ["waiting"]
    })
    .await;
    let expired = w.metrics().lines().find_map(|l| {
        l.strip_prefix("ferry_flow_runs_expired_total ")?
            .parse::<u64>()
            .ok()
    });
    assert_eq!(
        expired,
        Some(u64::from(RUNS) + 2),
        "the expiries are counted"
    );
    for i in 0..RUNS {
        let id = format!("quick-{i}");
        assert_eq!(
            w.run::<u64>(&id).unwrap().result().await.unwrap(),
            u64::from(i) + 7,
            "{id}'s result from the server's index"
        );
    }
    close(w).await;
    server.stop().await;
}

static STRAY: Workflow<u32, u64> = Workflow::new("stray");

/// Guards §10's parked runs: a run whose workflow its holder does not register is
/// parked there, and the server's index shows it parked, with the reason, at once to a
/// result long-poll; a cancel ends it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_parked_by_its_holder_shows_parked_on_the_server() {
    use ferry_flow::remote::proto::{Call, CallKind, Outcome};
    let scratch = Scratch::new("flow-engine-parked");
    let socket = scratch.path().join("s.sock");
    let server = start(scratch.path(), &socket, 2);
    let a = open_worker(&scratch.dir("a"), &socket, |b| {
        b.register(STRAY, |ctx: Ctx, n: u32| async move {
            Ok(u64::from(ctx.wait_for(GO, None).await?.unwrap_or(0) + n))
        })
    })
    .await;
    eventually("the first worker to hold every shard", || {
        a.held_shards().len() == 2
    })
    .await;
    a.start(STRAY, "stray-1", &1).await.unwrap();
    close(a).await;
    // A worker of another build, without the workflow.
    let b = open_worker(&scratch.dir("b"), &socket, |b| {
        b.register(QUICK, |_: Ctx, n: u32| async move { Ok(u64::from(n)) })
    })
    .await;
    eventually("the server to show the run parked", || {
        server
            .server
            .run("stray-1")
            .is_some_and(|r| r.state == "parked")
    })
    .await;
    let detail = server.server.run("stray-1").unwrap().detail.unwrap();
    assert!(
        detail
            .to_string()
            .contains("no workflow named \\\"stray\\\""),
        "{detail}"
    );
    let asked = std::time::Instant::now();
    let answer = server
        .server
        .call(Call {
            kind: CallKind::Result {
                id: "stray-1".into(),
                wait_ms: 30_000,
            },
            key: String::new(),
        })
        .await
        .unwrap();
    let Outcome::Ok(summary) = answer else {
        panic!("{answer:?}")
    };
    let summary: serde_json::Value = serde_json::from_slice(&summary).unwrap();
    assert_eq!(summary["state"], "parked", "{summary}");
    assert!(
        asked.elapsed() < std::time::Duration::from_secs(10),
        "a parked run's result is answered at once"
    );
    assert!(b.cancel("stray-1").await.unwrap());
    eventually("the cancel to show", || {
        server
            .server
            .run("stray-1")
            .is_some_and(|r| r.state == "cancelled")
    })
    .await;
    close(b).await;
    server.stop().await;
}
