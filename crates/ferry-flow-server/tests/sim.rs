//! T10: a server, two workers and a faulty network, deterministically from one seed
//! (docs/flow-server.md §16). One thread, tokio's clock paused (it jumps to the next
//! timer whenever every task waits): the server's log on the simulated disk
//! (`Server::open_driven`) syncing when the seed says; two workers reaching it through
//! in-memory links that the seed delays, holds one way or both, and cuts mid-frame;
//! workers killed and coming back; the server crashing (power loss or process death)
//! and coming back. The workers' clocks run 0.5% slow against the server's, inside the
//! 1% the deadline allows for. The same seed runs the same way twice (checked); for
//! that, whatever waits in the server and here wakes in a fixed order (no `watch`,
//! whose waiters wake in a random one, no blocking pool).
//!
//! Two tests, one driver ([`drive`]), at the end of which every fault is lifted, the
//! shards must be held again and the workers must have got on, and the server loses
//! power once more; what its log holds as it reopens is then checked.
//!
//! - **Acts** (`a_server_two_workers_and_a_faulty_network_from_one_seed`): the workers'
//!   connections (`Worker::connect_here`) with an executor of the test's own per shard:
//!   an *act* (a step body) every few milliseconds while the grant may act
//!   (`ShardStream::may_act`), each appending one record. Invariants:
//!   1. every record acknowledged durable is in the log at its shard and position,
//!      byte for byte;
//!   2. no record of a shard's epoch *e* follows the grant of a later epoch, and each
//!      record's epoch is the shard's current one (guarantee 1);
//!   3. each shard's positions run 0, 1, 2, … once each: a record sent again after a
//!      cut or a restart is acknowledged, not written twice (guarantee 5);
//!   4. every act under epoch *e* of a shard comes before the first under a later
//!      epoch (guarantee 2: the old holder stops before anyone else may start).
//! - **Runs** (`engines_on_a_server_through_a_faulty_network_from_one_seed`): engines
//!   (`EngineBuilder::server_here`) running a workflow of four steps (each body works
//!   up to 40 ms, a durable sleep of up to a second after it, some runs wait for a
//!   signal), started and signalled by a client through the server. Invariants: every
//!   run finishes with the model's result (the server's index); no step body runs
//!   again once a later step of its run started (its result was durable), nor twice
//!   under one epoch; 2, 3 and 4 above for step bodies.
//!
//! `FERRY_FLOW_SEED=N` replays one seed; `FERRY_FLOW_SEEDS=N` sets how many (default 12);
//! `FERRY_FLOW_TRACE=1` prints each seed's trace.

use ferry_core::seams::{Rng, SplitMix64};
use ferry_flow::log::{Config as LogConfig, Log};
use ferry_flow::remote::proto::{Call, CallKind};
use ferry_flow::remote::worker::{
    Dialer, Event, Seams, ShardStream, Stream, Worker, WorkerSettings,
};
use ferry_flow::{Ctx, Engine, FlowError, JournalLog, Signal, SimStorage, Workflow};
use ferry_flow_server::server::{Connector, Server, Settings};
use ferry_flow_server::store::{EPOCH_RECORD, SHARD_RECORD};
use ferry_testkit::Scratch;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::Path;
use std::rc::Rc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;

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
    hold_up: Gate,
    hold_down: Gate,
    /// Bumped to cut every connection of the worker.
    cut: Gate,
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
        let dead = Arc::new(Gate::default());
        let link = |up: bool| Link {
            net: self.clone(),
            w,
            up,
            cuts: self.faults[w].cut.get(),
            dead: dead.clone(),
        };
        tokio::spawn(link(true).pump(near_r, far_w));
        tokio::spawn(link(false).pump(far_r, near_w));
        Ok(Box::new(worker_end))
    }
}

/// A value that tasks wait on, waking in the order they came (tokio's `watch` wakes its
/// waiters in an order drawn at random, which a seed could not replay).
#[derive(Default)]
struct Gate {
    value: AtomicU64,
    changed: Notify,
}

impl Gate {
    fn get(&self) -> u64 {
        self.value.load(Relaxed)
    }

    fn set(&self, v: u64) {
        self.value.store(v, Relaxed);
        self.changed.notify_waiters();
    }

    /// Resolves once `ok` holds for the value.
    async fn until(&self, ok: impl Fn(u64) -> bool) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if ok(self.get()) {
                return;
            }
            changed.await;
        }
    }
}

/// One direction of one connection.
struct Link {
    net: Arc<Net>,
    w: usize,
    up: bool,
    /// The worker's cuts when the connection was made: one more cuts it.
    cuts: u64,
    /// Either direction ending ends the other (1: ended).
    dead: Arc<Gate>,
}

impl Link {
    async fn pump(self, mut from: impl AsyncRead + Unpin, mut to: impl AsyncWrite + Unpin) {
        let f = &self.net.faults[self.w];
        let hold = if self.up { &f.hold_up } else { &f.hold_down };
        let cuts = self.cuts;
        let mut buf = vec![0u8; 4096];
        loop {
            let n = tokio::select! {
                biased;
                _ = f.cut.until(|c| c != cuts) => break,
                _ = self.dead.until(|d| d == 1) => break,
                r = from.read(&mut buf) => match r {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                },
            };
            // Held: nothing passes until the hold lifts; then what was sent arrives, as
            // TCP's retransmissions would deliver it.
            tokio::select! {
                biased;
                _ = f.cut.until(|c| c != cuts) => break,
                _ = self.dead.until(|d| d == 1) => break,
                _ = hold.until(|h| h == 0) => {}
            }
            let delay = {
                let max = *self.net.delay_max.lock().unwrap();
                self.net.below(max + 1)
            };
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            if self.up && f.cut_mid.swap(false, Relaxed) {
                let part = 1 + self.net.below(n as u64) as usize;
                let _ = to.write_all(&buf[..part.min(n)]).await;
                break;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        self.dead.set(1);
        let _ = to.shutdown().await;
    }
}

/// A worker connecting: it, or why not.
type Connect<W> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<W, String>>>>;

/// What the workers run, on top of the faults and the server that [`drive`] plays:
/// their connections' own acts ([`Acts`]) or engines with workflows ([`Runs`]).
trait Side {
    type Worker: 'static;
    /// A worker of the net, connected (or why not: it tries again later).
    fn connect(net: Arc<Net>, w: usize, session: u128) -> Connect<Self::Worker>;
    /// One millisecond of the workers' life.
    fn tick(
        &mut self,
        now: u64,
        workers: &[Option<Self::Worker>],
        server: Option<&Server>,
        rng: &mut SplitMix64,
        trace: &mut Vec<String>,
    );
    /// At the end, healed, the server still up: whether the workers got on.
    fn healed(&mut self, server: &Server) -> Result<(), String>;
    /// Whether the server compacts now and then (folding records into checkpoints and
    /// retiring them from the log).
    const COMPACTS: bool;
    /// Against the server's log, read back after a last power loss.
    fn check(&self, log: &ServerLog, broken: &mut Vec<String>, trace: &mut Vec<String>);
}

/// The server's log as it reopened, by shard.
#[derive(Default)]
struct ServerLog {
    shards: BTreeMap<u32, ShardLog>,
    records: u64,
}

/// One shard's records in the log: each one's epoch, kind and bytes, by position from
/// `base` (what compaction folded into the shard's checkpoint is no longer there).
#[derive(Default)]
struct ShardLog {
    /// The epoch of the shard's newest epoch record (0: retired with what was folded).
    epoch: u64,
    base: Option<u64>,
    records: Vec<(u64, u8, Vec<u8>)>,
}

/// What a simulation leaves: its trace (compared between two runs of a seed).
#[derive(Debug, PartialEq)]
struct Outcome {
    trace: Vec<String>,
    records: u64,
    server_deaths: u32,
}

fn seeds() -> Vec<u64> {
    match std::env::var("FERRY_FLOW_SEED") {
        Ok(s) => vec![s.parse().expect("FERRY_FLOW_SEED is a number")],
        Err(_) => {
            let n = std::env::var("FERRY_FLOW_SEEDS")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(12u64);
            (1..=n).collect()
        }
    }
}

/// Every seed, the first two twice (the same seed must run the same way).
fn each_seed(name: &str, run: impl Fn(u64) -> Result<Outcome, String>) {
    let (mut failed, mut deaths) = (Vec::new(), 0);
    let seeds = seeds();
    for &seed in &seeds {
        match run(seed) {
            Ok(a) => {
                deaths += a.server_deaths;
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
                    "{name} seed {seed}: {} records, {} trace lines",
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
    // Not vacuous: the seeds crash the server now and then.
    assert!(
        seeds.len() < 6 || deaths > 0,
        "{} seeds and the server never died",
        seeds.len()
    );
}

/// Run `side` under seed `seed`: one thread, tokio's clock paused.
fn run<S: Side>(seed: u64, side: S) -> Result<Outcome, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let scratch = Scratch::new(&format!("flow-server-sim-{seed}"));
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        BASE.with(|b| b.set(Some(tokio::time::Instant::now().into_std())));
        match tokio::time::timeout(Duration::from_secs(600), drive(seed, scratch.path(), side))
            .await
        {
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

/// The seams of worker `w` of `net`.
fn seams(net: Arc<Net>, w: usize, session: u128) -> Seams {
    let dial: Dialer = Arc::new(move || {
        let n = net.clone();
        Box::pin(async move { n.dial(w) })
    });
    Seams {
        dial,
        clock: worker_clock,
        session,
    }
}

/// A worker's connection being made.
type Connecting<S> = tokio::task::JoinHandle<Result<<S as Side>::Worker, String>>;

/// The faults, the server's life and its disk, and the workers' comings and goings,
/// from `seed`; `side` does the rest.
async fn drive<S: Side>(seed: u64, dir: &Path, mut side: S) -> Result<Outcome, String> {
    let mut rng = SplitMix64::seeded(seed);
    let t0 = tokio::time::Instant::now();
    let ms = || t0.elapsed().as_millis() as u64;
    let storage = Arc::new(SimStorage::new(seed));
    let net = Arc::new(Net {
        server: Mutex::new(None),
        faults: (0..WORKERS)
            .map(|_| Faults {
                hold_up: Gate::default(),
                hold_down: Gate::default(),
                cut: Gate::default(),
                cut_mid: AtomicBool::new(false),
            })
            .collect(),
        rng: Mutex::new(SplitMix64::seeded(seed ^ 0x5eed)),
        delay_max: Mutex::new(0),
    });
    let mut server = Some(open_server(dir, &storage)?);
    *net.server.lock().unwrap() = server.as_ref().map(Server::connector);
    let mut server_back_at = 0u64;
    let mut server_deaths = 0;
    let mut trace: Vec<String> = Vec::new();
    let mut sessions = 0u128;
    let mut session = |rng: &mut SplitMix64| {
        sessions += 1;
        (u128::from(rng.next_u64()) << 64) | sessions
    };
    // Each worker: connected (None while killed or connecting), when it comes back,
    // and its connection being made (a held network can keep one waiting).
    let mut workers: Vec<Option<S::Worker>> = (0..WORKERS).map(|_| None).collect();
    let mut back_at = [1u64; WORKERS];
    // The second worker joins later: the server rebalances.
    back_at[1] = 1000 + rng.below(3000);
    let mut connecting: Vec<Option<Connecting<S>>> = (0..WORKERS).map(|_| None).collect();
    let mut holds_until = [0u64; WORKERS];

    let end = (FAULTY + HEALED).as_millis() as u64;
    let faulty = FAULTY.as_millis() as u64;
    loop {
        tokio::time::sleep(Duration::from_millis(1)).await;
        let now = ms();
        if now >= end {
            break;
        }
        if now < faulty {
            for w in 0..WORKERS {
                let f = &net.faults[w];
                match rng.below(12_000) {
                    0..=3 => {
                        trace.push(format!("{now} cut {w}"));
                        f.cut.set(f.cut.get() + 1);
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
                        f.hold_up.set(u64::from(up));
                        f.hold_down.set(u64::from(down));
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
                server_deaths += 1;
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
                f.hold_up.set(0);
                f.hold_down.set(0);
                f.cut_mid.store(false, Relaxed);
            }
            *net.delay_max.lock().unwrap() = 0;
        }
        for (w, until) in holds_until.iter_mut().enumerate() {
            if *until != 0 && now >= *until {
                *until = 0;
                net.faults[w].hold_up.set(0);
                net.faults[w].hold_down.set(0);
            }
        }
        if server.is_none() && now >= server_back_at {
            trace.push(format!("{now} server back"));
            let s = open_server(dir, &storage)?;
            *net.server.lock().unwrap() = Some(s.connector());
            server = Some(s);
        }
        for w in 0..WORKERS {
            if workers[w].is_none() && back_at[w] != 0 && now >= back_at[w] {
                back_at[w] = 0;
                let s = session(&mut rng);
                connecting[w] = Some(tokio::task::spawn_local(S::connect(net.clone(), w, s)));
            }
            if connecting[w].as_ref().is_some_and(|c| c.is_finished()) {
                let c = connecting[w].take().expect("finished");
                match c.await.expect("a connect does not panic") {
                    Ok(worker) => {
                        trace.push(format!("{now} worker {w} connects"));
                        workers[w] = Some(worker);
                    }
                    Err(e) => {
                        trace.push(format!("{now} worker {w} does not connect: {e}"));
                        back_at[w] = now + 200;
                    }
                }
            }
        }
        // Compaction now and then, when the side can tell its records from a checkpoint.
        if S::COMPACTS
            && let Some(s) = &server
            && rng.below(2_500) == 0
        {
            match s.compact() {
                Ok(c) => trace.push(format!("{now} compacted up to {}", c.read)),
                Err(e) => trace.push(format!("{now} compaction failed: {e}")),
            }
        }
        // The disk syncs when the seed says.
        if let Some(s) = &server
            && rng.below(2) == 0
        {
            s.write_log();
        }
        side.tick(now, &workers, server.as_ref(), &mut rng, &mut trace);
    }

    // Healed for a while: every shard must be held, and the workers got on.
    let server = server.ok_or("the server is not back at the end")?;
    let held = server.holders();
    if held.iter().any(|(_, h)| h.is_none()) {
        return Err(format!(
            "healed for {HEALED:?}, shards are still free: {held:?}"
        ));
    }
    side.healed(&server)?;
    // Not vacuous: shards moved (the second worker joining moves some, at least).
    if held.iter().all(|h| h.0 < 2) {
        return Err(format!("no shard ever moved: {held:?}"));
    }
    trace.push(format!(
        "epochs at the end: {:?}",
        held.iter().map(|h| h.0).collect::<Vec<_>>()
    ));

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
    let mut back = ServerLog::default();
    let mut broken = Vec::new();
    log.read(log.start_lsn(), |r| {
        let p = r.payload;
        let shard = || u32::from_be_bytes(p[0..4].try_into().unwrap());
        let epoch = || u64::from_be_bytes(p[4..12].try_into().unwrap());
        match r.kind {
            EPOCH_RECORD => {
                let (shard, epoch) = (shard(), epoch());
                let s = back.shards.entry(shard).or_default();
                if epoch <= s.epoch {
                    broken.push(format!(
                        "shard {shard}: epoch {epoch} granted after {}",
                        s.epoch
                    ));
                }
                s.epoch = epoch;
            }
            SHARD_RECORD => {
                back.records += 1;
                let (shard, epoch) = (shard(), epoch());
                let position = u64::from_be_bytes(p[12..20].try_into().unwrap());
                let s = back.shards.entry(shard).or_default();
                // The epoch record before it may have been retired with the records
                // compaction folded: then the first record tells.
                if s.epoch == 0 && s.base.is_none() {
                    s.epoch = epoch;
                }
                if epoch != s.epoch {
                    broken.push(format!(
                        "shard {shard}: a record of epoch {epoch} at position {position} while epoch {} holds it (invariant 2)",
                        s.epoch
                    ));
                }
                let next = *s.base.get_or_insert(position) + s.records.len() as u64;
                if position != next {
                    broken.push(format!(
                        "shard {shard}: position {position} where {next} was next (invariant 3)"
                    ));
                }
                s.records.push((epoch, p[20], p[21..].to_vec()));
            }
            _ => {}
        }
    })
    .map_err(|e| format!("reading the log back: {e}"))?;
    side.check(&back, &mut broken, &mut trace);
    broken.truncate(10);
    if !broken.is_empty() {
        return Err(broken.join("\n"));
    }
    Ok(Outcome {
        trace,
        records: back.records,
        server_deaths,
    })
}

/// Per shard, the acts (or step bodies) of an epoch all come before the first of a
/// later epoch (invariant 4). `acts`: shard, epoch, ms.
fn epochs_never_overlap(acts: &[(u32, u64, u64)], broken: &mut Vec<String>) {
    let mut last_of: BTreeMap<(u32, u64), u64> = BTreeMap::new();
    let mut first_of: BTreeMap<(u32, u64), u64> = BTreeMap::new();
    for &(shard, epoch, at) in acts {
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
}

/// The workers' connections with an executor of the test's own per shard: an act
/// (a step body) only while the grant may act, each appending one record.
#[derive(Default)]
struct Acts {
    /// Shard, epoch, ms.
    acts: Vec<(u32, u64, u64)>,
    /// Records the workers were told are durable: shard, position, bytes.
    acked: Vec<(u32, u64, Vec<u8>)>,
    pending: Vec<Pending>,
    acked_at_heal: Option<usize>,
}

/// A record appended and not yet acknowledged.
struct Pending {
    stream: Arc<ShardStream>,
    end: u64,
    bytes: Vec<u8>,
}

impl Side for Acts {
    type Worker = Worker;
    // Its records are not a journal's: a checkpoint would leave them out.
    const COMPACTS: bool = false;

    fn connect(net: Arc<Net>, w: usize, session: u128) -> Connect<Worker> {
        Box::pin(async move {
            let mut s = WorkerSettings::new("sim");
            s.name = format!("worker {w}");
            Worker::connect_here(s, seams(net, w, session))
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn tick(
        &mut self,
        now: u64,
        workers: &[Option<Worker>],
        _server: Option<&Server>,
        rng: &mut SplitMix64,
        trace: &mut Vec<String>,
    ) {
        if now >= FAULTY.as_millis() as u64 && self.acked_at_heal.is_none() {
            self.acked_at_heal = Some(self.acked.len());
        }
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
                self.acts.push((shard, epoch, now));
                let bytes = format!("w{w} s{shard} e{epoch} #{}", self.acts.len()).into_bytes();
                match stream.append(ACT, &bytes) {
                    Ok(end) => self.pending.push(Pending {
                        stream: stream.clone(),
                        end,
                        bytes,
                    }),
                    Err(e) => trace.push(format!("{now} worker {w} shard {shard}: {e}")),
                }
            }
        }
        let acked = &mut self.acked;
        self.pending.retain(|p| {
            if p.stream.durable_lsn() >= p.end {
                acked.push((p.stream.shard(), p.end - 1, p.bytes.clone()));
                false
            } else {
                !p.stream.is_lost()
            }
        });
    }

    fn healed(&mut self, _server: &Server) -> Result<(), String> {
        if Some(self.acked.len()) == self.acked_at_heal {
            return Err(format!(
                "healed for {HEALED:?}, nothing more was acknowledged"
            ));
        }
        Ok(())
    }

    fn check(&self, log: &ServerLog, broken: &mut Vec<String>, trace: &mut Vec<String>) {
        for (shard, position, bytes) in &self.acked {
            let found = log
                .shards
                .get(shard)
                .and_then(|s| {
                    let at = position.checked_sub(s.base.unwrap_or(0))?;
                    s.records.get(at as usize)
                })
                .map(|r| &r.2);
            if found != Some(bytes) {
                broken.push(format!(
                    "shard {shard}: acknowledged {:?} at position {position}, the log has {:?} (invariant 1)",
                    String::from_utf8_lossy(bytes),
                    found.map(|b| String::from_utf8_lossy(b).to_string())
                ));
            }
        }
        epochs_never_overlap(&self.acts, broken);
        trace.push(format!(
            "{} acts, {} acknowledged",
            self.acts.len(),
            self.acked.len()
        ));
    }
}

#[test]
fn a_server_two_workers_and_a_faulty_network_from_one_seed() {
    each_seed("acts", |seed| run(seed, Acts::default()));
}

static CHAIN: Workflow<u32, u32> = Workflow::new("chain");
static BONUS: Signal<u32> = Signal::new("bonus");
const STEPS: u32 = 4;
/// Runs started, one every 300 ms of the faulty part.
const RUNS: u32 = 40;

/// Runs with n % 4 == 2 wait for a signal (the value 1000) after their second step.
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

thread_local! {
    /// Every step body that ran: run, step, the epoch it ran under, ms.
    static LEDGER: std::cell::RefCell<Vec<(String, u32, u64, u64)>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

fn sim_ms() -> u64 {
    let base = BASE.with(|b| b.get()).expect("the simulation set its base");
    (tokio::time::Instant::now().into_std() - base).as_millis() as u64
}

/// The engines' clock: tokio's.
struct SimClock;

impl ferry_core::seams::Clock for SimClock {
    fn now(&self) -> std::time::Instant {
        tokio::time::Instant::now().into_std()
    }
    fn wall_ms(&self) -> u64 {
        1_800_000_000_000 + sim_ms()
    }
}

/// A run lives for seconds, so that faults strike while many are under way: each step
/// body works for up to 40 ms (a lease may run out meanwhile), and a durable sleep of
/// up to a second follows it.
async fn chain(ctx: Ctx, n: u32) -> Result<u32, FlowError> {
    let mut acc = n;
    for step in 0..STEPS {
        let run = ctx.run_id().to_string();
        let works = u64::from((n * 7 + step * 13) % 41);
        acc = ctx
            .step(&format!("s{step}"), move |s| {
                let epoch = s.epoch().unwrap_or(0);
                LEDGER.with(|l| l.borrow_mut().push((run.clone(), step, epoch, sim_ms())));
                async move {
                    tokio::time::sleep(Duration::from_millis(works)).await;
                    Ok(acc * 3 + 1)
                }
            })
            .await?;
        ctx.sleep(Duration::from_millis(u64::from(
            (n * 37 + step * 101) % 1000,
        )))
        .await?;
        if step == 1 && n % 4 == 2 {
            acc += ctx.wait_for(BONUS, None).await?.unwrap_or(0);
        }
    }
    Ok(acc)
}

/// Engines as the server's workers, with the workflow above; starts and signals come
/// from a client of the server (they reach the holder whoever it is).
#[derive(Default)]
struct Runs {
    /// Per run: its start, and (if it waits for one) its signal.
    started: BTreeMap<u32, Rc<Cell<Asked>>>,
    signalled: BTreeMap<u32, Rc<Cell<Asked>>>,
}

/// Where a call through the server stands.
#[derive(Clone, Copy, Default, PartialEq)]
enum Asked {
    /// Not asked, or refused (ask again).
    #[default]
    Not,
    Waiting,
    Done,
}

/// A call through the server; whether it was answered Ok goes to `asked`.
fn call(server: &Server, kind: CallKind, key: String, asked: &Rc<Cell<Asked>>) {
    asked.set(Asked::Waiting);
    let answer = server.call(Call { kind, key });
    let asked = asked.clone();
    tokio::task::spawn_local(async move {
        let ok = matches!(answer.await, Ok(ferry_flow::remote::proto::Outcome::Ok(_)));
        asked.set(if ok { Asked::Done } else { Asked::Not });
    });
}

impl Side for Runs {
    type Worker = Engine;
    const COMPACTS: bool = true;

    fn connect(net: Arc<Net>, w: usize, session: u128) -> Connect<Engine> {
        Box::pin(async move {
            Engine::builder(format!("/nonexistent/worker-{w}"))
                .server_here(seams(net, w, session))
                .clock(Arc::new(SimClock))
                .register(CHAIN, chain)
                .open_here()
                .await
                .map_err(|e| e.to_string())
        })
    }

    fn tick(
        &mut self,
        now: u64,
        _workers: &[Option<Engine>],
        server: Option<&Server>,
        _rng: &mut SplitMix64,
        _trace: &mut Vec<String>,
    ) {
        let Some(server) = server else { return };
        if !now.is_multiple_of(20) {
            return;
        }
        for n in 0..RUNS.min((now / 300) as u32 + 1) {
            let id = format!("r{n}");
            let started = self.started.entry(n).or_default();
            if started.get() == Asked::Not {
                let kind = CallKind::Start {
                    workflow: CHAIN.name().into(),
                    id: id.clone(),
                    input: serde_json::to_vec(&n).unwrap(),
                };
                call(server, kind, id.clone(), started);
            }
            if n % 4 == 2 && started.get() == Asked::Done {
                let signalled = self.signalled.entry(n).or_default();
                if signalled.get() == Asked::Not {
                    let kind = CallKind::Signal {
                        id: id.clone(),
                        name: BONUS.name().into(),
                        value: serde_json::to_vec(&1000u32).unwrap(),
                    };
                    call(server, kind, format!("bonus/{id}"), signalled);
                }
            }
        }
    }

    fn healed(&mut self, server: &Server) -> Result<(), String> {
        for n in 0..RUNS {
            let id = format!("r{n}");
            let run = server
                .run(&id)
                .ok_or_else(|| format!("run {id} was never started"))?;
            let want = serde_json::json!(want(n));
            if run.state != "finished" || run.detail.as_ref() != Some(&want) {
                return Err(format!(
                    "run {id} is {} with {:?} at the end, want finished with {want}",
                    run.state, run.detail
                ));
            }
        }
        Ok(())
    }

    fn check(&self, _log: &ServerLog, broken: &mut Vec<String>, trace: &mut Vec<String>) {
        let ledger = LEDGER.with(|l| std::mem::take(&mut *l.borrow_mut()));
        // A step whose result was durable never runs again: once a later step of its
        // run started (which waited for that durability), no earlier step runs; and no
        // step runs twice under one epoch.
        let mut furthest: BTreeMap<&str, u32> = BTreeMap::new();
        let mut seen: BTreeMap<(&str, u32, u64), u64> = BTreeMap::new();
        for (run, step, epoch, at) in &ledger {
            let f = furthest.entry(run).or_insert(*step);
            if *step < *f {
                broken.push(format!(
                    "run {run}: step s{step} ran at {at} ms, after s{f} had started"
                ));
            }
            *f = (*f).max(*step);
            if let Some(first) = seen.insert((run, *step, *epoch), *at) {
                broken.push(format!(
                    "run {run}: step s{step} ran twice under epoch {epoch}, at {first} and {at} ms"
                ));
            }
        }
        let acts: Vec<(u32, u64, u64)> = ledger
            .iter()
            .map(|(run, _, epoch, at)| (ferry_flow::shard_of(run, SHARDS), *epoch, *at))
            .collect();
        epochs_never_overlap(&acts, broken);
        for (run, step, epoch, at) in &ledger {
            trace.push(format!("{at} {run} s{step} e{epoch}"));
        }
        trace.push(format!("{} step bodies ran", ledger.len()));
    }
}

/// The same faults under engines running workflows: every run started through the
/// server finishes with the model's result, no step whose result was durable runs
/// again, and a shard's step bodies under one epoch all start before the first under
/// the next.
#[test]
fn engines_on_a_server_through_a_faulty_network_from_one_seed() {
    each_seed("runs", |seed| {
        LEDGER.with(|l| l.borrow_mut().clear());
        run(seed, Runs::default())
    });
}
