//! The engine on the simulated disk, deterministically: one thread, tokio's clock
//! paused (it jumps to the next timer whenever every task waits), the engine's shards
//! as tasks on that thread and its disk syncing at moments the seed picks. So a seed
//! fixes everything: the workload, the faults, the interleaving and every time; the
//! same seed runs the same way twice, every step at the same millisecond of tokio time
//! (checked below). The wall clock runs 0.5% slow against tokio's timers, so timers
//! fire before their wake-up by the wall clock and the engine must sleep again.
//!
//! Workflows run, and at a random moment one of the faults the seed picks strikes: the
//! machine loses power (only what the log synced survives, the rest torn), the process
//! dies (the page cache survives), a sync fails (the log refuses everything after it),
//! or a write fails. The engine reopens and the same runs are started again, several
//! times over. Some runs sleep durably between two steps, some wait for a signal sent
//! while they run; the shards have few places for running runs, or the default, or
//! no bound (`max_running`). The external world is a ledger of step executions.
//! Invariants, against the model: every run finishes with the model's result; no step
//! whose result the journal held after a fault (read back before the engine reopens)
//! runs again, nor does one once a later step of its run has started (that later step
//! started only after the earlier result was durable); the step after a sleep never
//! starts before the sleep's wake-up time by the engine's clock. `FERRY_FLOW_SEED=N` replays one seed; `FERRY_FLOW_SEEDS=N` sets how many
//! (default 60).
//!
//! The same workload also runs on real threads (shards, the log's writer, a
//! multi-thread runtime, the system clock) for a few seeds: not reproducible, but it
//! shakes out what only concurrency shows.

mod common;

use ferry_core::seams::{Clock, Rng, SplitMix64};
use ferry_flow::{Ctx, Engine, RunStatus, Signal, Workflow};
use ferry_log::sim::SimStorage;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
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
/// ms it may run at, ms of tokio time since the simulation began).
type Line = (String, u32, u64, u64, u64);

/// The simulation's wall clock: tokio's time (paused, so it moves only when every task
/// waits for a timer), running 0.5% slow, so a timer that tokio fires on time finds the
/// wall clock short of its wake-up time and must sleep again rather than fire early.
struct SlowClock {
    origin: tokio::time::Instant,
}

impl Clock for SlowClock {
    fn now(&self) -> std::time::Instant {
        tokio::time::Instant::now().into_std()
    }
    fn wall_ms(&self) -> u64 {
        let ms = self.origin.elapsed().as_millis() as u64;
        1_800_000_000_000 + ms - ms / 200
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// One thread, tokio's clock paused: reproducible from the seed.
    Deterministic,
    /// Shard threads, the log's writer thread, a multi-thread runtime.
    Threads,
}

/// Run seed `seed`; the ledger it left.
fn run(seed: u64, mode: Mode) -> Result<Vec<Line>, String> {
    let rt = match mode {
        Mode::Deterministic => tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build(),
        Mode::Threads => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build(),
    }
    .unwrap();
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        // Generous in tokio time; in the deterministic mode a stuck run would otherwise
        // hang the test (the paused clock jumps ahead forever).
        match tokio::time::timeout(Duration::from_secs(600), simulate(seed, mode)).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "seed {seed}: still running after 600 s of tokio time"
            )),
        }
    })
}

async fn simulate(seed: u64, mode: Mode) -> Result<Vec<Line>, String> {
    let mut rng = SplitMix64::seeded(seed);
    let sim = Arc::new(SimStorage::new(seed ^ 0xf10));
    let origin = tokio::time::Instant::now();
    let clock: Arc<dyn Clock> = match mode {
        Mode::Deterministic => Arc::new(SlowClock { origin }),
        Mode::Threads => Arc::new(ferry_core::seams::SystemClock),
    };
    let ledger: Arc<Mutex<Vec<Line>>> = Arc::default();
    let runs = 20 + rng.below(40) as u32;
    let mut signalled = BTreeSet::new();
    // The round whose engine is open, and steps run by the engine of another (a dropped
    // engine's runs must stop with it, as a dead process's do).
    let live = Arc::new(AtomicU64::new(0));
    let zombies = Arc::new(AtomicU64::new(0));
    // After each fault, how long the ledger was and which step results the journal
    // held: none of those steps may run again.
    let mut settled: Vec<(usize, BTreeSet<(String, u32)>)> = Vec::new();
    for round in 0..4 {
        let last = round == 3;
        live.store(round, Ordering::SeqCst);
        let (l, c) = (ledger.clone(), clock.clone());
        let (live2, zombies2) = (live.clone(), zombies.clone());
        let mut builder = Engine::builder("unused")
            .storage(sim.clone())
            .clock(clock.clone())
            .shards(1 + rng.below(3) as usize)
            // Few places for the 20-60 runs (or the default): runs wait for one, and
            // those that sleep or wait for a signal must give theirs up.
            .max_running(match rng.below(3) {
                0 => None,
                1 => Some(1 + rng.below(4) as usize),
                _ => Some(ferry_flow::DEFAULT_MAX_RUNNING),
            });
        if mode == Mode::Deterministic {
            builder = builder.on_this_thread(seed.wrapping_add(round));
        }
        let engine = builder
            .register(CHAIN, move |ctx: Ctx, n: u32| {
                let (l, c) = (l.clone(), c.clone());
                let (live, zombies) = (live2.clone(), zombies2.clone());
                async move {
                    let mut acc = n;
                    let mut not_before = 0;
                    for step in 0..STEPS {
                        let (l, c) = (l.clone(), c.clone());
                        let (live, zombies) = (live.clone(), zombies.clone());
                        let run = ctx.run_id().to_string();
                        acc = ctx
                            .step(&format!("s{step}"), move |_| {
                                let (l, c, run) = (l.clone(), c.clone(), run.clone());
                                if live.load(Ordering::SeqCst) != round {
                                    zombies.fetch_add(1, Ordering::SeqCst);
                                }
                                async move {
                                    let tokio_ms = origin.elapsed().as_millis() as u64;
                                    let line = (run, step, c.wall_ms(), not_before, tokio_ms);
                                    l.lock().unwrap().push(line);
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
        let result: Result<(), String> = async {
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
                if !signalled.contains(&id) && engine.signal(&id, BONUS, &1000).await.is_ok() {
                    signalled.insert(id);
                }
            }
            if last {
                for (i, h) in handles.iter().enumerate() {
                    let got = h.result().await.map_err(|e| format!("run r{i}: {e}"))?;
                    if got != want(i as u32) {
                        return Err(format!("run r{i}: {got}, want {}", want(i as u32)));
                    }
                }
                return Ok(());
            }
            // Strike once enough of the outside world has happened (or every run is done).
            match fault {
                Fault::SyncFails => sim.fail_sync_after(1 + rng_fault % 20),
                Fault::WriteFails => sim.fail_write_after(1 + rng_fault % 20),
                _ => {}
            }
            // A failed sync or write stops the log, and with it the runs: once nothing
            // happened for 60 ms (longer than any sleep), strike anyway.
            let (mut seen, mut idle) = (0, 0);
            for _ in 0..500 {
                let done = (0..runs)
                    .all(|i| !matches!(engine.status(&format!("r{i}")), Some(RunStatus::Running)));
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
            Ok(())
        }
        .await;
        sim.halt();
        gauges_match_runs(&engine).map_err(|e| format!("seed {seed} round {round}: {e}"))?;
        if let Err(e) = result {
            // A start refused because the power was cut is expected; anything in the
            // last round is not.
            if last {
                return Err(format!("seed {seed} round {round}: {e}"));
            }
        }
        drop(engine);
        if !last {
            match fault {
                Fault::ProcessDies => sim.kill(),
                _ => sim.crash(),
            }
            let held =
                durable_steps(&sim).map_err(|e| format!("seed {seed} round {round}: {e}"))?;
            settled.push((ledger.lock().unwrap().len(), held));
        }
    }
    let zombies = zombies.load(Ordering::SeqCst);
    if zombies > 0 {
        return Err(format!(
            "seed {seed}: {zombies} steps ran in an engine dropped before them"
        ));
    }
    let ledger = ledger.lock().unwrap().clone();
    for (from, held) in &settled {
        if let Some((run, step, ..)) = ledger[*from..]
            .iter()
            .find(|(run, step, ..)| held.contains(&(run.clone(), *step)))
        {
            return Err(format!(
                "seed {seed}: {run}: step {step} ran again though the journal held its result"
            ));
        }
    }
    let mut by_run: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for (run, step, at, not_before, _) in ledger.iter() {
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
    Ok(ledger)
}

/// The steps whose results the journal on `sim` holds, as the next open will find it.
/// Read from a copy: recovering `sim` itself would cut its torn tail before the
/// engine's own open gets to.
fn durable_steps(sim: &Arc<SimStorage>) -> Result<BTreeSet<(String, u32)>, String> {
    let journal = ferry_flow::read_journal_on(Arc::new(sim.copy()))
        .map_err(|e| format!("reading the journal: {e}"))?;
    Ok(common::steps_held(&journal))
}

/// The metrics' runs by state, kept as runs change state, agree with the runs map.
/// On real threads a run may still settle while this looks (what it journaled before
/// the halt became durable): it compares a view of the map taken between two equal
/// readings of the gauges.
fn gauges_match_runs(engine: &Engine) -> Result<(), String> {
    const STATES: [&str; 5] = ["running", "parked", "finished", "failed", "cancelled"];
    let gauges = || -> Result<Vec<f64>, String> {
        let text = engine.metrics();
        STATES
            .iter()
            .map(|s| {
                let name = format!("ferry_flow_runs{{state=\"{s}\"}} ");
                text.lines()
                    .find_map(|l| l.strip_prefix(&name))
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| format!("no {name} in the metrics"))
            })
            .collect()
    };
    let mut last = String::new();
    for _ in 0..100 {
        let before = gauges()?;
        let mut counted = [0.0; 5];
        for r in engine.runs() {
            counted[match r.status {
                RunStatus::Running => 0,
                RunStatus::Parked(_) => 1,
                RunStatus::Finished(ferry_flow::Outcome::Ok(_)) => 2,
                RunStatus::Finished(ferry_flow::Outcome::Err(_)) => 3,
                RunStatus::Finished(ferry_flow::Outcome::Cancelled) => 4,
            }] += 1.0;
        }
        if gauges()? != before {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        }
        if before == counted {
            return Ok(());
        }
        last = format!("metrics say {before:?} runs {STATES:?}, the runs map {counted:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    Err(last)
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
        let seed = one.parse().expect("FERRY_FLOW_SEED is a number");
        if let Err(e) = run(seed, Mode::Deterministic) {
            panic!("{e}");
        }
        return;
    }
    // Steps cut short by a fault and run again: the faults must bite.
    let mut reruns = 0;
    let seeds: u64 = std::env::var("FERRY_FLOW_SEEDS")
        .map_or(60, |n| n.parse().expect("FERRY_FLOW_SEEDS is a number"));
    for seed in 0..seeds {
        match run(seed, Mode::Deterministic) {
            Ok(ledger) => {
                let once: BTreeSet<(&str, u32)> =
                    ledger.iter().map(|l| (l.0.as_str(), l.1)).collect();
                reruns += ledger.len() - once.len();
            }
            Err(e) => panic!(
                "{e}\nreproduce with: FERRY_FLOW_SEED={seed} cargo test -p ferry-flow --test sim"
            ),
        }
    }
    assert!(reruns > 0, "no fault ever cut a step short");
}

#[test]
fn a_seed_runs_the_same_way_twice() {
    for seed in [3, 17, 29, 41, 55] {
        let a = run(seed, Mode::Deterministic).unwrap();
        let b = run(seed, Mode::Deterministic).unwrap();
        assert!(a.len() > 20, "seed {seed}: only {} steps ran", a.len());
        assert_eq!(a, b, "seed {seed}: two runs differ");
    }
}

#[test]
fn the_same_faults_on_real_threads() {
    for seed in 0..8 {
        if let Err(e) = run(seed, Mode::Threads) {
            panic!("{e} (on real threads: the seed does not reproduce the interleaving)");
        }
    }
}
