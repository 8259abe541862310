//! The engine on the simulated disk: workflows run, and at a random moment one of the
//! faults the seed picks strikes: the machine loses power (only what the log synced
//! survives, the rest torn), the process dies (the page cache survives), a sync fails
//! (the log refuses everything after it), or a write fails. The engine reopens and the
//! same runs are started again, several times over. Some runs sleep durably between two
//! steps, some wait for a signal sent while they run. The external world is a ledger of
//! step executions. Invariants, against the model: every run finishes with the model's
//! result; no step runs again once a later step of its run has started (that later step
//! started only after the earlier result was durable: re-running it would re-run an
//! acknowledged step); the step after a sleep never starts before the sleep's wake-up
//! time by the wall clock. `FERRY_FLOW_SEED=N` replays one seed's workload and faults.

use ferry_core::seams::{Rng, SplitMix64};
use ferry_flow::{Ctx, Engine, RunStatus, Signal, Workflow};
use ferry_log::sim::SimStorage;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

static CHAIN: Workflow<u32, u32> = Workflow::new("chain");
static BONUS: Signal<u32> = Signal::new("bonus");
const STEPS: u32 = 4;

/// Runs with n % 3 == 1 sleep 5-40 ms after their first step; n % 4 == 2 wait for a
/// signal (the value 1000) after their second.
fn want(n: u32) -> u32 {
    (0..STEPS).fold(n, |acc, step| {
        let acc = acc * 3 + 1;
        if step == 1 && n % 4 == 2 {
            acc + 1000
        } else {
            acc
        }
    })
}

/// One ledger line: a step body ran (run, step, wall ms when it ran, the earliest wall
/// ms it may run at).
type Line = (String, u32, u64, u64);

fn run(seed: u64) -> Result<(), String> {
    let mut rng = SplitMix64::seeded(seed);
    let sim = Arc::new(SimStorage::new(seed ^ 0xf10));
    let ledger: Arc<Mutex<Vec<Line>>> = Arc::default();
    let runs = 20 + rng.below(40) as u32;
    let signalled: Arc<Mutex<std::collections::BTreeSet<String>>> = Arc::default();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for round in 0..4 {
        let last = round == 3;
        let l = ledger.clone();
        let engine = Engine::builder("unused")
            .storage(sim.clone())
            .shards(1 + rng.below(3) as usize)
            .register(CHAIN, move |ctx: Ctx, n: u32| {
                let l = l.clone();
                async move {
                    let mut acc = n;
                    let mut not_before = 0;
                    for step in 0..STEPS {
                        let l = l.clone();
                        let run = ctx.run_id().to_string();
                        acc = ctx
                            .step(&format!("s{step}"), move |_| {
                                let (l, run) = (l.clone(), run.clone());
                                async move {
                                    let now = ferry_core::seams::wall_ms();
                                    l.lock().unwrap().push((run, step, now, not_before));
                                    tokio::task::yield_now().await;
                                    Ok(acc * 3 + 1)
                                }
                            })
                            .await?;
                        if step == 0 && n % 3 == 1 {
                            // The start time is journaled, so the wake-up is the same
                            // moment on every replay.
                            let t0 = ctx.now_ms()?;
                            not_before = t0 + 5 + u64::from(n % 36);
                            ctx.sleep_until_ms(not_before).await?;
                        }
                        if step == 1 && n % 4 == 2 {
                            acc += ctx.wait_for(BONUS, None).await?.unwrap_or(0);
                        }
                    }
                    Ok(acc)
                }
            })
            .open()
            .map_err(|e| format!("seed {seed} round {round}: open: {e}"))?;
        let cut_after = ledger.lock().unwrap().len() + 1 + rng.below(u64::from(runs) * 2) as usize;
        let fault = [
            Fault::PowerLoss,
            Fault::ProcessDies,
            Fault::SyncFails,
            Fault::WriteFails,
        ][rng.below(4) as usize];
        let rng_fault = rng.below(1000);
        let signalled = signalled.clone();
        let result = rt.block_on(async {
            let mut handles = Vec::new();
            for i in 0..runs {
                handles.push(
                    engine
                        .start(CHAIN, &format!("r{i}"), &i)
                        .await
                        .map_err(|e| e.to_string())?,
                );
            }
            // Every waiting run gets its signal, once: a signal whose send returned is
            // durable, so a run that already has one is not signalled again.
            for i in (0..runs).filter(|i| i % 4 == 2) {
                let id = format!("r{i}");
                let got = signalled.lock().unwrap().contains(&id);
                if !got && engine.signal(&id, BONUS, &1000).await.is_ok() {
                    signalled.lock().unwrap().insert(id);
                }
            }
            if last {
                for (i, h) in handles.iter().enumerate() {
                    let got = h.result().await.map_err(|e| format!("run r{i}: {e}"))?;
                    if got != want(i as u32) {
                        return Err(format!("run r{i}: {got}, want {}", want(i as u32)));
                    }
                }
            } else {
                // Strike once enough of the outside world has happened (or every run is
                // done).
                match fault {
                    Fault::SyncFails => sim.fail_sync_after(1 + rng_fault % 20),
                    Fault::WriteFails => sim.fail_write_after(1 + rng_fault % 20),
                    _ => {}
                }
                // A failed sync or write stops the log, and with it the runs: once
                // nothing happened for 60 ms (longer than any sleep), strike anyway.
                let (mut seen, mut idle) = (0, 0);
                for _ in 0..500 {
                    let done = (0..runs).all(|i| {
                        !matches!(engine.status(&format!("r{i}")), Some(RunStatus::Running))
                    });
                    let now = ledger.lock().unwrap().len();
                    if done || now >= cut_after || idle > 60 {
                        break;
                    }
                    (seen, idle) = if now == seen {
                        (seen, idle + 1)
                    } else {
                        (now, 0)
                    };
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                sim.halt();
            }
            Ok(())
        });
        if let Err(e) = result {
            // A start refused because the power was cut is expected; anything in the
            // last round is not.
            if last {
                return Err(format!("seed {seed} round {round}: {e}"));
            }
            sim.halt();
        }
        drop(engine);
        if !last {
            match fault {
                Fault::ProcessDies => sim.kill(),
                _ => sim.crash(),
            }
        }
    }
    let ledger = ledger.lock().unwrap();
    let mut by_run: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (run, step, at, not_before) in ledger.iter() {
        by_run.entry(run).or_default().push(*step);
        if at < not_before {
            return Err(format!(
                "seed {seed}: {run}: step {step} ran at {at}, before its sleep's wake-up {not_before}"
            ));
        }
    }
    for (run, steps) in &by_run {
        for w in steps.windows(2) {
            if w[1] < w[0] {
                return Err(format!(
                    "seed {seed}: {run}: step {} ran again after step {} had started: {steps:?}",
                    w[1], w[0]
                ));
            }
        }
    }
    Ok(())
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    PowerLoss,
    ProcessDies,
    SyncFails,
    WriteFails,
}

#[test]
fn faults_never_rerun_an_acknowledged_step_nor_fire_a_timer_early() {
    if let Ok(one) = std::env::var("FERRY_FLOW_SEED") {
        if let Err(e) = run(one.parse().expect("FERRY_FLOW_SEED is a number")) {
            panic!("{e}");
        }
        return;
    }
    for seed in 0..40 {
        if let Err(e) = run(seed) {
            panic!(
                "{e}\nreproduce with: FERRY_FLOW_SEED={seed} cargo test -p ferry-flow --test sim"
            );
        }
    }
}
