//! The engine on the simulated disk: workflows run, the machine loses power at a random
//! moment (only what the log synced survives, the rest torn), the engine reopens and the
//! same runs are started again, several times over. The external world is a ledger of
//! step executions. Invariants: every run finishes with the model's result; no step runs
//! again once a later step of its run has started (that later step started only after
//! the earlier result was durable: re-running it would re-run an acknowledged step).
//! `FERRY_FLOW_SEED=N` replays one seed.

use ferry_core::seams::{Rng, SplitMix64};
use ferry_flow::{Ctx, Engine, RunStatus, Workflow};
use ferry_log::sim::SimStorage;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

static CHAIN: Workflow<u32, u32> = Workflow::new("chain");
const STEPS: u32 = 4;

fn want(n: u32) -> u32 {
    (0..STEPS).fold(n, |acc, _| acc * 3 + 1)
}

fn run(seed: u64) -> Result<(), String> {
    let mut rng = SplitMix64::seeded(seed);
    let sim = Arc::new(SimStorage::new(seed ^ 0xf10));
    let ledger: Arc<Mutex<Vec<(String, u32)>>> = Arc::default();
    let runs = 20 + rng.below(40) as u32;
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
                    for step in 0..STEPS {
                        let l = l.clone();
                        let run = ctx.run_id().to_string();
                        acc = ctx
                            .step(&format!("s{step}"), move |_| {
                                let (l, run) = (l.clone(), run.clone());
                                async move {
                                    l.lock().unwrap().push((run, step));
                                    tokio::task::yield_now().await;
                                    Ok(acc * 3 + 1)
                                }
                            })
                            .await?;
                    }
                    Ok(acc)
                }
            })
            .open()
            .map_err(|e| format!("seed {seed} round {round}: open: {e}"))?;
        let cut_after = ledger.lock().unwrap().len() + 1 + rng.below(u64::from(runs) * 2) as usize;
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
            if last {
                for (i, h) in handles.iter().enumerate() {
                    let got = h.result().await.map_err(|e| format!("run r{i}: {e}"))?;
                    if got != want(i as u32) {
                        return Err(format!("run r{i}: {got}, want {}", want(i as u32)));
                    }
                }
            } else {
                // Lose power once enough of the outside world has happened (or every run
                // is done).
                for _ in 0..500 {
                    let done = (0..runs).all(|i| {
                        !matches!(engine.status(&format!("r{i}")), Some(RunStatus::Running))
                    });
                    if done || ledger.lock().unwrap().len() >= cut_after {
                        break;
                    }
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
            sim.crash();
        }
    }
    let ledger = ledger.lock().unwrap();
    let mut by_run: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (run, step) in ledger.iter() {
        by_run.entry(run).or_default().push(*step);
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

#[test]
fn power_loss_never_reruns_an_acknowledged_step() {
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
