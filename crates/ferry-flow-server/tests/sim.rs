//! T10: a server, two workers and a faulty network, deterministically from one seed
//! (docs/flow-server.md §16). One thread, tokio's clock paused (it jumps to the next
//! timer whenever every task waits): the server's log on the simulated disk
//! (`SimStorage`) syncing when the seed says, two workers' real connections
//! (`Worker::connect_here`) reaching it through in-memory links that the seed delays,
//! holds one way or both, and cuts mid-frame, and the server itself crashing (power
//! loss or process death) and coming back. The same seed runs the same way twice
//! (checked). The workers' clocks run 0.5% slow against the server's, inside the 1% the
//! deadline allows for.
//!
//! Each worker acts for the shards it holds as a shard's executor would: a step body
//! (an *act*) only while the grant may act (`ShardStream::may_act`), each act appending
//! one record; a record counts as acknowledged once the stream says it is durable.
//! Drains are answered with a release, as the engine's holder does. At the end every
//! fault is lifted, the shards must be held and moving again, and the server loses
//! power once more. Invariants, from the server's log as it reopens and from the acts:
//!
//! 1. Every acknowledged record is in the log at its shard and position, byte for byte.
//! 2. No record of a shard's epoch *e* follows the grant of a later epoch, and every
//!    record's epoch is the shard's current one (guarantee 1: fencing).
//! 3. Each shard's positions run 0, 1, 2, … once each: a record sent again after a
//!    cut or a restart is acknowledged, not written twice (guarantee 5).
//! 4. Every act under epoch *e* of a shard happened before the first act under a later
//!    epoch (guarantee 2: the old holder stops acting before anyone else may start).
//!
//! `FERRY_FLOW_SEED=N` replays one seed; `FERRY_FLOW_SEEDS=N` sets how many (default 12);
//! `FERRY_FLOW_TRACE=1` prints each seed's trace.

use ferry_core::seams::{Rng, SplitMix64};
use ferry_flow::JournalLog;
use ferry_flow::SimStorage;
use ferry_flow::log::{Config as LogConfig, Log};
use ferry_flow::remote::worker::{
    Dialer, Event, Seams, ShardStream, Stream, Worker, WorkerSettings,
};
use ferry_flow_server::server::{Connector, Server, Settings};
use ferry_testkit::Scratch;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

const SHARDS: u32 = 4;
const WORKERS: usize = 2;
/// How long faults strike, then how long everything runs healed, in tokio time.
const FAULTY: Duration = Duration::from_secs(20);
const HEALED: Duration = Duration::from_secs(6);
/// The record kind the acts append (the server's index ignores it).
const ACT: u8 = 9;

fn settings() -> Settings {
    Settings {
        shards: SHARDS,
        lease: Duration::from_millis(1000),
        ping_every: Duration::from_millis(100),
        stuck_after: Duration::from_secs(2),
        // No compaction inside a simulation (it runs off the runtime's thread).
        compact_bytes: u64::MAX,
        ..Settings::default()
    }
}

thread_local! {
    /// Where the workers' clock starts: set as each simulation starts.
    static BASE: Cell<Option<std::time::Instant>> = const { Cell::new(None) };
}

/// The workers' clock: tokio's, 0.5% slow (a deadline allows for 1%).
fn worker_clock() -> Duration {
    let base = BASE.with(|b| b.get()).expect("the simulation set its base");
    let e = tokio::time::Instant::now().into_std() - base;
    e - e / 200
}

/// One worker's side of the network: what the seed does to its connections.
struct Faults {
    /// Hold what the worker sends / what the server sends (true: held).
    hold_up: watch::Sender<bool>,
    hold_down: watch::Sender<bool>,
    /// Bumped to cut every connection of the worker.
    cut: watch::Sender<u64>,
    /// Cut the next chunk the worker sends part-way (mid-frame).
    cut_mid: AtomicBool,
}

/// The network: the server's connector while it is up, each worker's faults, and the
/// seed's choices for delays.
struct Net {
    server: Mutex<Option<Connector>>,
    faults: Vec<Faults>,
    rng: Mutex<SplitMix64>,
    /// The most a chunk is delayed, in ms.
    delay_max: Mutex<u64>,
}

impl Net {
    fn below(&self, n: u64) -> u64 {
        self.rng.lock().unwrap().below(n)
    }

    /// A new connection of worker `w`: an in-memory pipe each way through the faults.
    fn dial(self: &Arc<Net>, w: usize) -> std::io::Result<Box<dyn Stream>> {
        let Some(c) = self.server.lock().unwrap().clone() else {
            return Err(std::io::ErrorKind::ConnectionRefused.into());
        };
        let (worker_end, near) = tokio::io::duplex(1 << 16);
        let (far, server_end) = tokio::io::duplex(1 << 16);
        tokio::spawn(c.connection(server_end));
        let (near_r, near_w) = tokio::io::split(near);
        let (far_r, far_w) = tokio::io::split(far);
        let f = &self.faults[w];
        let dead = watch::channel(false).0;
        let link = |up: bool| Link {
            net: self.clone(),
            w,
            up,
            hold: if up {
                f.hold_up.subscribe()
            } else {
                f.hold_down.subscribe()
            },
            cut: f.cut.subscribe(),
            dead: dead.clone(),
        };
        tokio::spawn(link(true).pump(near_r, far_w));
        tokio::spawn(link(false).pump(far_r, near_w));
        Ok(Box::new(worker_end))
    }
}

/// One direction of one connection.
struct Link {
    net: Arc<Net>,
    w: usize,
    up: bool,
    hold: watch::Receiver<bool>,
    cut: watch::Receiver<u64>,
    /// Either direction ending ends the other.
    dead: watch::Sender<bool>,
}

impl Link {
    async fn pump(mut self, mut from: impl AsyncRead + Unpin, mut to: impl AsyncWrite + Unpin) {
        let mut dead = self.dead.subscribe();
        let mut buf = vec![0u8; 4096];
        loop {
            let n = tokio::select! {
                biased;
                _ = self.cut.changed() => break,
                _ = dead.wait_for(|d| *d) => break,
                r = from.read(&mut buf) => match r {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                },
            };
            // Held: nothing passes until the hold lifts; then what was sent arrives, as
            // TCP's retransmissions would deliver it.
            tokio::select! {
                biased;
                _ = self.cut.changed() => break,
                _ = dead.wait_for(|d| *d) => break,
                _ = self.hold.wait_for(|h| !*h) => {}
            }
            let delay = {
                let max = *self.net.delay_max.lock().unwrap();
                self.net.below(max + 1)
            };
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            let f = &self.net.faults[self.w];
            if self.up && f.cut_mid.swap(false, Relaxed) {
                let part = 1 + self.net.below(n as u64) as usize;
                let _ = to.write_all(&buf[..part.min(n)]).await;
                break;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = self.dead.send(true);
        let _ = to.shutdown().await;
    }
}

/// An act: worker, shard, epoch, ms of tokio time since the start.
type Act = (usize, u32, u64, u64);

/// A record the workers were told is durable: shard, position, bytes.
type Acked = (u32, u64, Vec<u8>);

/// A record appended and not yet acknowledged.
struct Pending {
    stream: Arc<ShardStream>,
    end: u64,
    bytes: Vec<u8>,
}

/// What a simulation leaves: its trace (compared between two runs of a seed).
#[derive(Debug, PartialEq)]
struct Outcome {
    trace: Vec<String>,
    records: u64,
}

#[test]
fn a_server_two_workers_and_a_faulty_network_from_one_seed() {
    let seeds: Vec<u64> = match std::env::var("FERRY_FLOW_SEED") {
        Ok(s) => vec![s.parse().expect("FERRY_FLOW_SEED is a number")],
        Err(_) => {
            let n = std::env::var("FERRY_FLOW_SEEDS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(12u64);
            (1..=n).collect()
        }
    };
    let mut failed = Vec::new();
    for &seed in &seeds {
        match run(seed) {
            Ok(a) => {
                // The first seeds run twice: the same seed must run the same way.
                if seed <= 2 {
                    let b = run(seed).unwrap_or_else(|e| panic!("seed {seed}, second run: {e}"));
                    assert_eq!(a, b, "seed {seed}: two runs differ");
                }
                if std::env::var_os("FERRY_FLOW_TRACE").is_some() {
                    for line in &a.trace {
                        eprintln!("{line}");
                    }
                }
                eprintln!(
                    "seed {seed}: {} records, {} trace lines",
                    a.records,
                    a.trace.len()
                );
            }
            Err(e) => failed.push(format!("seed {seed}: {e}")),
        }
    }
    assert!(
        failed.is_empty(),
        "{} seeds failed (replay with FERRY_FLOW_SEED=N):\n{}",
        failed.len(),
        failed.join("\n")
    );
}

fn run(seed: u64) -> Result<Outcome, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let scratch = Scratch::new(&format!("flow-server-sim-{seed}"));
    rt.block_on(async {
        BASE.with(|b| b.set(Some(tokio::time::Instant::now().into_std())));
        match tokio::time::timeout(Duration::from_secs(600), simulate(seed, scratch.path())).await {
            Ok(r) => r,
            Err(_) => Err("stuck: 600 s of tokio time".into()),
        }
    })
}

fn open_server(dir: &Path, storage: &Arc<SimStorage>) -> Result<Server, String> {
    let st: Arc<dyn ferry_flow::log::Storage> = storage.clone();
    let server = Server::open_driven(dir, st, settings(), LogConfig::default())
        .map_err(|e| format!("the server did not open: {e}"))?;
    server.start();
    Ok(server)
}

/// A worker of the net, its connection a task on this runtime.
async fn connect(net: &Arc<Net>, w: usize, session: u128) -> Option<Worker> {
    let n = net.clone();
    let dial: Dialer = Arc::new(move || {
        let n = n.clone();
        Box::pin(async move { n.dial(w) })
    });
    let seams = Seams {
        dial,
        clock: worker_clock,
        session,
    };
    let mut s = WorkerSettings::new("sim");
    s.name = format!("worker {w}");
    Worker::connect_here(s, seams).await.ok()
}

async fn simulate(seed: u64, dir: &Path) -> Result<Outcome, String> {
    let mut rng = SplitMix64::seeded(seed);
    let t0 = tokio::time::Instant::now();
    let ms = || t0.elapsed().as_millis() as u64;
    let storage = Arc::new(SimStorage::new(seed));
    let net = Arc::new(Net {
        server: Mutex::new(None),
        faults: (0..WORKERS)
            .map(|_| Faults {
                hold_up: watch::channel(false).0,
                hold_down: watch::channel(false).0,
                cut: watch::channel(0).0,
                cut_mid: AtomicBool::new(false),
            })
            .collect(),
        rng: Mutex::new(SplitMix64::seeded(seed ^ 0x5eed)),
        delay_max: Mutex::new(0),
    });
    let mut server = Some(open_server(dir, &storage)?);
    *net.server.lock().unwrap() = server.as_ref().map(Server::connector);
    let mut server_back_at = 0u64;

    let mut trace: Vec<String> = Vec::new();
    let mut acts: Vec<Act> = Vec::new();
    let mut acked: Vec<Acked> = Vec::new();
    let mut pending: Vec<Pending> = Vec::new();
    // Each worker: its connection (None while killed) and when it comes back.
    let mut workers: Vec<Option<Worker>> = Vec::new();
    let mut back_at = [0u64; WORKERS];
    let mut sessions = 0u128;
    let mut session = |rng: &mut SplitMix64| {
        sessions += 1;
        (u128::from(rng.next_u64()) << 64) | sessions
    };
    workers.push(connect(&net, 0, session(&mut rng)).await);
    workers.push(None);
    // Connections being made (a held network can keep one waiting for its welcome).
    let mut connecting: Vec<Option<tokio::task::JoinHandle<Option<Worker>>>> =
        (0..WORKERS).map(|_| None).collect();
    // The second worker joins later: the server rebalances.
    back_at[1] = 1000 + rng.below(3000);
    // When each hold lifts.
    let mut holds_until = [0u64; WORKERS];
    let mut acts_n = 0u64;
    let mut acked_at_heal = 0;

    let end = (FAULTY + HEALED).as_millis() as u64;
    let faulty = FAULTY.as_millis() as u64;
    loop {
        tokio::time::sleep(Duration::from_millis(1)).await;
        let now = ms();
        if now >= end {
            break;
        }
        // Faults, while they strike.
        if now < faulty {
            for w in 0..WORKERS {
                let f = &net.faults[w];
                match rng.below(12_000) {
                    0..=3 => {
                        trace.push(format!("{now} cut {w}"));
                        f.cut.send_modify(|c| *c += 1);
                    }
                    4..=6 => {
                        trace.push(format!("{now} cut mid-frame {w}"));
                        f.cut_mid.store(true, Relaxed);
                    }
                    7..=9 => {
                        let (up, down) = match rng.below(3) {
                            0 => (true, false),
                            1 => (false, true),
                            _ => (true, true),
                        };
                        holds_until[w] = now + 100 + rng.below(2_400);
                        trace.push(format!(
                            "{now} hold {w} up {up} down {down} until {}",
                            holds_until[w]
                        ));
                        f.hold_up.send_replace(up);
                        f.hold_down.send_replace(down);
                    }
                    10 if workers[w].is_some() => {
                        // The worker's process dies: its connection goes with it.
                        trace.push(format!("{now} kill worker {w}"));
                        workers[w] = None;
                        back_at[w] = now + rng.below(2_000);
                    }
                    _ => {}
                }
            }
            if rng.below(4_000) == 0 {
                let d = rng.below(6);
                trace.push(format!("{now} delays up to {d} ms"));
                *net.delay_max.lock().unwrap() = d;
            }
            if server.is_some() && rng.below(9_000) == 0 {
                // The server dies: its process, or the machine's power.
                let power = rng.below(2) == 0;
                trace.push(format!("{now} server dies (power loss: {power})"));
                *net.server.lock().unwrap() = None;
                storage.halt();
                let s = server.take().expect("up");
                // A write that fails wakes whoever waits for the disk.
                s.write_log();
                s.shutdown().await;
                if power {
                    storage.crash();
                } else {
                    storage.kill();
                }
                server_back_at = now + rng.below(1_500);
            }
        } else if now == faulty {
            trace.push(format!("{now} every fault lifted"));
            for f in &net.faults {
                f.hold_up.send_replace(false);
                f.hold_down.send_replace(false);
                f.cut_mid.store(false, Relaxed);
            }
            acked_at_heal = acked.len();
            *net.delay_max.lock().unwrap() = 0;
        }
        for (w, until) in holds_until.iter_mut().enumerate() {
            if *until != 0 && now >= *until {
                *until = 0;
                net.faults[w].hold_up.send_replace(false);
                net.faults[w].hold_down.send_replace(false);
            }
        }
        // The server comes back.
        if server.is_none() && now >= server_back_at {
            trace.push(format!("{now} server back"));
            let s = open_server(dir, &storage)?;
            *net.server.lock().unwrap() = Some(s.connector());
            server = Some(s);
        }
        // Workers come back.
        for w in 0..WORKERS {
            if workers[w].is_none() && back_at[w] != 0 && now >= back_at[w] {
                back_at[w] = 0;
                let (n, s) = (net.clone(), session(&mut rng));
                connecting[w] = Some(tokio::spawn(async move { connect(&n, w, s).await }));
            }
            if connecting[w].as_ref().is_some_and(|c| c.is_finished()) {
                let c = connecting[w].take().expect("finished");
                workers[w] = c.await.expect("a connect does not panic");
                trace.push(format!(
                    "{now} worker {w} connects: {}",
                    workers[w].is_some()
                ));
                if workers[w].is_none() {
                    back_at[w] = now + 200;
                }
            }
        }
        // The disk syncs when the seed says.
        if let Some(s) = &server
            && rng.below(2) == 0
        {
            s.write_log();
        }
        // The workers' executors.
        for (w, worker) in workers.iter().enumerate() {
            let Some(worker) = worker else { continue };
            while let Some(e) = worker.next_event(Duration::ZERO) {
                trace.push(format!("{now} worker {w}: {e:?}"));
                if let Event::Drain { shard, epoch } = e {
                    worker.release(shard, epoch);
                }
            }
            for shard in 0..SHARDS {
                let Some(stream) = worker.stream(shard) else {
                    continue;
                };
                stream.turns.fetch_add(1, Relaxed);
                if !stream.may_act() || rng.below(3) != 0 {
                    continue;
                }
                let epoch = stream.epoch();
                acts_n += 1;
                acts.push((w, shard, epoch, now));
                let bytes = format!("w{w} s{shard} e{epoch} #{acts_n}").into_bytes();
                match stream.append(ACT, &bytes) {
                    Ok(end) => pending.push(Pending {
                        stream: stream.clone(),
                        end,
                        bytes,
                    }),
                    Err(e) => trace.push(format!("{now} worker {w} shard {shard}: {e}")),
                }
            }
        }
        pending.retain(|p| {
            if p.stream.durable_lsn() >= p.end {
                acked.push((p.stream.shard(), p.end - 1, p.bytes.clone()));
                false
            } else {
                !p.stream.is_lost()
            }
        });
    }

    // Healed for a while: every shard must be held and moving.
    let server = server.ok_or("the server is not back at the end")?;
    let held = server.holders();
    if held.iter().any(|(_, h)| h.is_none()) {
        return Err(format!(
            "healed for {HEALED:?}, shards are still free: {held:?}"
        ));
    }
    if acked.len() == acked_at_heal {
        return Err(format!(
            "healed for {HEALED:?}, nothing more was acknowledged"
        ));
    }
    trace.push(format!("held at the end: {held:?}"));

    // The server loses power once more; its log, read back, is the truth.
    *net.server.lock().unwrap() = None;
    storage.halt();
    server.write_log();
    server.shutdown().await;
    drop(workers);
    storage.crash();
    let st: Arc<dyn ferry_flow::log::Storage> = storage.clone();
    let (log, _) =
        Log::open_driven(st, LogConfig::default()).map_err(|e| format!("reopen: {e}"))?;
    let mut shards: BTreeMap<u32, ShardLog> = BTreeMap::new();
    let mut records = 0u64;
    let mut broken = Vec::new();
    log.read(log.start_lsn(), |r| {
        let p = r.payload;
        match r.kind {
            3 => {
                let shard = u32::from_be_bytes(p[0..4].try_into().unwrap());
                let epoch = u64::from_be_bytes(p[4..12].try_into().unwrap());
                let s = shards.entry(shard).or_default();
                if epoch <= s.epoch && s.epoch != 0 {
                    broken.push(format!("shard {shard}: epoch {epoch} granted after {}", s.epoch));
                }
                s.epoch = epoch;
            }
            2 => {
                records += 1;
                let shard = u32::from_be_bytes(p[0..4].try_into().unwrap());
                let epoch = u64::from_be_bytes(p[4..12].try_into().unwrap());
                let position = u64::from_be_bytes(p[12..20].try_into().unwrap());
                let s = shards.entry(shard).or_default();
                if epoch != s.epoch {
                    broken.push(format!(
                        "shard {shard}: a record of epoch {epoch} at position {position} while epoch {} holds it (invariant 2)",
                        s.epoch
                    ));
                }
                if position != s.records.len() as u64 {
                    broken.push(format!(
                        "shard {shard}: position {position} where {} was next (invariant 3)",
                        s.records.len()
                    ));
                }
                s.records.push(p[21..].to_vec());
            }
            _ => {}
        }
    })
    .map_err(|e| format!("reading the log back: {e}"))?;
    for (shard, position, bytes) in &acked {
        let found = shards
            .get(shard)
            .and_then(|s| s.records.get(*position as usize));
        if found != Some(bytes) {
            broken.push(format!(
                "shard {shard}: acknowledged {:?} at position {position}, the log has {:?} (invariant 1)",
                String::from_utf8_lossy(bytes),
                found.map(|b| String::from_utf8_lossy(b).to_string())
            ));
        }
    }
    // Invariant 4: per shard, acts by epoch never interleave in time.
    let mut last_of: BTreeMap<(u32, u64), u64> = BTreeMap::new();
    let mut first_of: BTreeMap<(u32, u64), u64> = BTreeMap::new();
    for &(_, shard, epoch, at) in &acts {
        last_of.insert((shard, epoch), at);
        first_of.entry((shard, epoch)).or_insert(at);
    }
    for (&(shard, epoch), &last) in &last_of {
        if let Some((&(_, later), &first)) = first_of
            .range((shard, epoch + 1)..(shard + 1, 0))
            .find(|(_, first)| **first <= last)
        {
            broken.push(format!(
                "shard {shard}: epoch {epoch} acted at {last} ms, epoch {later} already at {first} ms (invariant 4)"
            ));
        }
    }
    broken.truncate(10);
    if !broken.is_empty() {
        return Err(broken.join("\n"));
    }
    trace.push(format!(
        "{} acts, {} acknowledged, {records} records",
        acts.len(),
        acked.len()
    ));
    Ok(Outcome { trace, records })
}

#[derive(Default)]
struct ShardLog {
    epoch: u64,
    records: Vec<Vec<u8>>,
}
