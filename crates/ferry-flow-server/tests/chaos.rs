//! A seeded walk of network faults (docs/flow-server.md §16, T10's seeded half): a
//! server and two worker engines, each worker behind a fault proxy, runs started and
//! signalled through either worker while the walk cuts connections mid-frame, holds one
//! direction or both (past the lease, sometimes) and slows them. Real threads and
//! sockets, so the seed fixes the workload and the faults, not the interleaving: not
//! the deterministic simulation T10 asks for (`crates/ferry-flow/tests/sim.rs` is that,
//! for the embedded engine). `FERRY_FLOW_SEED=N` replays one seed's choices.
//!
//! Invariants: every run finishes with the model's result, its signal taken once; a
//! step body never runs twice under one grant of its shard (same key, same epoch); and
//! no step body runs again once a later step of its run has started (the later step
//! started only after the earlier result was durable on the server).

mod common;

use ferry_core::seams::{Rng, SplitMix64};
use ferry_flow::{Ctx, Engine, FlowError, Signal, Workflow};
use ferry_testkit::Scratch;
use ferry_testkit::proxy::FaultProxy;
use std::sync::Mutex;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

static WALK: Workflow<u32, u64> = Workflow::new("walk");
static GO: Signal<u32> = Signal::new("go");

/// One step body's run: (run, step, the shard's epoch, when, in order).
static LEDGER: Mutex<Vec<(u32, u32, u64)>> = Mutex::new(Vec::new());

const SHARDS: u32 = 4;
const RUNS: u32 = 48;

/// The model: what run `n` returns (even runs wait for "go", sent with the value n).
fn want(n: u32) -> u64 {
    let a = u64::from(n) * 3;
    if n.is_multiple_of(2) {
        a + u64::from(n)
    } else {
        a + 1
    }
}

fn ran(n: u32, step: u32, epoch: Option<u64>) {
    LEDGER
        .lock()
        .unwrap()
        .push((n, step, epoch.expect("a worker's step knows its epoch")));
}

async fn walk(ctx: Ctx, n: u32) -> Result<u64, FlowError> {
    let a: u64 = ctx
        .step("a", |s| async move {
            ran(n, 1, s.epoch());
            // Long enough for a fault to catch some bodies under way.
            tokio::time::sleep(Duration::from_millis(u64::from(n % 5) * 40)).await;
            Ok(u64::from(n) * 3)
        })
        .await?;
    if n.is_multiple_of(3) {
        ctx.sleep(Duration::from_millis(50 + u64::from(n % 7) * 30))
            .await?;
    }
    let go = if n.is_multiple_of(2) {
        u64::from(ctx.wait_for(GO, None).await?.unwrap_or(0))
    } else {
        1
    };
    ctx.step("b", |s| async move {
        ran(n, 2, s.epoch());
        Ok(a + go)
    })
    .await
}

async fn open_at(dir: std::path::PathBuf, addr: String) -> Engine {
    tokio::task::spawn_blocking(move || {
        Engine::builder(dir)
            .server(addr)
            .register(WALK, walk)
            .open()
            .unwrap()
    })
    .await
    .unwrap()
}

/// Try `f` until it succeeds (transient refusals while the network misbehaves), for at
/// most 60 s.
async fn until_ok<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), FlowError>>,
{
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match f().await {
            Ok(()) => return,
            Err(e) => {
                assert!(Instant::now() < deadline, "{what}: still failing: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_walk_of_network_faults_loses_no_run_and_runs_no_durable_step_again() {
    let seed: u64 = std::env::var("FERRY_FLOW_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    eprintln!("seed {seed} (FERRY_FLOW_SEED={seed} replays its choices)");
    let scratch = Scratch::new("flow-chaos");
    let socket = scratch.path().join("s.sock");
    let server = common::start(scratch.path(), &socket, SHARDS);
    let proxies = [FaultProxy::start(server.tcp), FaultProxy::start(server.tcp)];
    let engines = [
        open_at(scratch.dir("a"), format!("127.0.0.1:{}", proxies[0].port())).await,
        open_at(scratch.dir("b"), format!("127.0.0.1:{}", proxies[1].port())).await,
    ];
    ferry_testkit::eventually("every shard held", || {
        engines.iter().map(|e| e.held_shards().len()).sum::<usize>() == SHARDS as usize
    })
    .await;
    let mut rng = SplitMix64::seeded(seed);
    // The faults, on a task of their own: about 8 s of them, then a calm network.
    let choices: Vec<(usize, u64, u64, u64)> = (0..24)
        .map(|_| {
            (
                rng.below(2) as usize,
                rng.below(6),
                100 + rng.below(1400),
                rng.below(300),
            )
        })
        .collect();
    let faults: Vec<_> = proxies.iter().map(|p| p.faults_handle()).collect();
    let walker = tokio::spawn(async move {
        for (i, kind, ms, bytes) in choices {
            let f = &faults[i];
            match kind {
                0 => f.cut_after.store(1 + bytes, SeqCst),
                1 => f.hold_up.store(true, SeqCst),
                2 => f.hold_down.store(true, SeqCst),
                3 => f.blackhole(true),
                4 => f.delay_ms.store(bytes / 30, SeqCst),
                _ => {}
            }
            tokio::time::sleep(Duration::from_millis(ms)).await;
            f.blackhole(false);
            f.delay_ms.store(0, SeqCst);
            tokio::time::sleep(Duration::from_millis(bytes)).await;
        }
    });
    // Runs started through either worker while the faults strike; the even ones
    // signalled through either, once each by key (on this task: an engine's calls are
    // not Send).
    let mut starts = Vec::new();
    for n in 0..RUNS {
        let (engines, via, go_via) = (&engines, rng.below(2) as usize, rng.below(2) as usize);
        let pause = rng.below(4000);
        starts.push(async move {
            tokio::time::sleep(Duration::from_millis(pause)).await;
            let id = format!("walk-{n}");
            until_ok(&format!("starting {id}"), || async {
                engines[via].start(WALK, &id, &n).await.map(|_| ())
            })
            .await;
            if n.is_multiple_of(2) {
                until_ok(&format!("signalling {id}"), || async {
                    engines[go_via]
                        .signal_once(&id, GO, &n, &format!("go-{n}"))
                        .await
                })
                .await;
            }
        });
    }
    futures_util::future::join_all(starts).await;
    walker.await.unwrap();
    // Every run finishes with the model's result; the server's index says so.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let done: Vec<_> = (0..RUNS)
            .filter_map(|n| server.server.run(&format!("walk-{n}")))
            .filter(|r| r.finished())
            .collect();
        if done.len() == RUNS as usize {
            for r in done {
                let n: u32 = r.id["walk-".len()..].parse().unwrap();
                assert_eq!(r.state, "finished", "{r:?}");
                assert_eq!(
                    r.detail,
                    Some(serde_json::json!(want(n))),
                    "run {n}: the model's result"
                );
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "seed {seed}: only {} of {RUNS} runs finished",
            done.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ledger = LEDGER.lock().unwrap().clone();
    for n in 0..RUNS {
        let mine: Vec<(usize, u32, u64)> = ledger
            .iter()
            .enumerate()
            .filter(|(_, l)| l.0 == n)
            .map(|(i, l)| (i, l.1, l.2))
            .collect();
        for step in [1, 2] {
            let epochs: Vec<u64> = mine.iter().filter(|l| l.1 == step).map(|l| l.2).collect();
            let mut unique = epochs.clone();
            unique.dedup();
            assert_eq!(
                unique, epochs,
                "seed {seed}: run {n} step {step} ran twice under one grant: {mine:?}"
            );
        }
        if let Some(first_b) = mine.iter().find(|l| l.1 == 2) {
            assert!(
                !mine.iter().any(|l| l.1 == 1 && l.0 > first_b.0),
                "seed {seed}: run {n}'s first step ran again after its second started: {mine:?}"
            );
        }
    }
    let again = ledger.len() - 2 * RUNS as usize;
    let moved = ledger.iter().filter(|l| l.2 > 1).count();
    eprintln!(
        "seed {seed}: {} step bodies for {RUNS} runs ({again} again after a move; {moved} under a later grant than the first)",
        ledger.len()
    );
    for e in engines {
        common::close(e).await;
    }
    server.stop().await;
}
