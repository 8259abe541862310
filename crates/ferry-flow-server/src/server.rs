//! The server (docs/flow-server.md): connections from workers over TCP or a Unix socket,
//! the lease table driven by their hellos, pings, releases and a timer, and the store
//! taking their appends, with one task that turns the log's durability into `Durable`
//! answers and sends grants once their epochs are durable.
//!
//! Locking: one mutex over the table, the store, the open connections and the calls in
//! flight; every frame is handled under it, briefly (an append copies into the log's
//! open batch and returns). Nothing waits for the disk under it: the durability task
//! waits outside and takes it to hand out what a sync covered. The index of runs has a
//! lock of its own, taken after this one.
//!
//! Rooms: `conn` (one connection: its Hello and each frame), `calls` (calls across
//! shards, §9), `status` (/status and /metrics).

mod calls;
mod conn;
mod status;

pub use conn::session_tag;
pub use status::{LogStatus, ShardStatus, Status, WorkerStatus};

use calls::{Forward, call_in, route, stop_calls};
use conn::connection;

use crate::checkpoints::{Checkpoints, CheckpointsError, Compacted, read_kept, write_kept};
use crate::index::{Index, RunSummary};
use crate::lease::{Action, LeaseTable, SessionId};
use crate::replica::{self, Replica, ReplicaError};
use crate::store::{Kept, Store};
use ferry_core::ConfigError;
use ferry_flow::log::{Config as LogConfig, Error as LogError, Log, Lsn};
use ferry_flow::remote::proto::{self, Body, Call, Frame, Granted, Outcome, Refused, ShardPos};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Notify, mpsc};

/// The server's settings (docs/flow-server.md §3, §13).
#[derive(Clone, Debug)]
pub struct Settings {
    pub shards: u32,
    pub lease: Duration,
    pub ping_every: Duration,
    pub stuck_after: Duration,
    /// SHA-256 of each token a worker or client may present; empty: no token asked (the
    /// socket's own permissions are the guard).
    pub tokens: Vec<[u8; 32]>,
    /// The largest record taken, in bytes.
    pub record_max: u32,
    /// How long a call waits for its run's shard to have a holder before it is refused
    /// as `NoHolder` (docs/flow-server.md §9).
    pub call_wait: Duration,
    /// Compact once the log grew by this many bytes (or a minute passed) (§7).
    pub compact_bytes: u64,
    /// How long a finished run stays known (its result, its id taken) after the first
    /// compaction that saw it finished.
    pub retention: Duration,
}

pub const SHARDS_MAX: u32 = 1024;
/// The longest lease and stuck time (their milliseconds travel as u32 in the Welcome).
pub const LEASE_MAX: Duration = Duration::from_secs(600);
pub const STUCK_MAX: Duration = Duration::from_secs(3600);

/// The most a recovery page carries (docs/flow-server.md §7), records' framing
/// included; a page holds at least one record.
pub const PAGE_MAX: u32 = 1 << 20;

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            shards: 16,
            lease: Duration::from_secs(5),
            ping_every: Duration::from_secs(1),
            stuck_after: Duration::from_secs(10),
            tokens: Vec::new(),
            record_max: (1 << 20) + 64,
            call_wait: Duration::from_secs(5),
            compact_bytes: 64 << 20,
            retention: Duration::from_secs(24 * 3600),
        }
    }
}

impl Settings {
    /// The arithmetic of docs/flow-server.md §3, checked once before anything opens.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.shards == 0 || self.shards > SHARDS_MAX {
            return Err(ConfigError::new(
                "shards",
                self.shards,
                format!("must be 1 to {SHARDS_MAX}"),
            ));
        }
        if self.lease > LEASE_MAX {
            return Err(ConfigError::new(
                "lease",
                format!("{:?}", self.lease),
                format!("must be at most {LEASE_MAX:?}: a dead worker's shards wait this long"),
            ));
        }
        if self.stuck_after > STUCK_MAX {
            return Err(ConfigError::new(
                "stuck_after",
                format!("{:?}", self.stuck_after),
                format!("must be at most {STUCK_MAX:?}"),
            ));
        }
        if self.ping_every.is_zero() || self.ping_every * 3 > self.lease {
            return Err(ConfigError::new(
                "ping_every",
                format!("{:?}", self.ping_every),
                format!(
                    "must be above zero and at most a third of lease ({:?}), so that two lost pings cost no lease",
                    self.lease
                ),
            ));
        }
        if self.stuck_after < self.ping_every * 2 {
            return Err(ConfigError::new(
                "stuck_after",
                format!("{:?}", self.stuck_after),
                format!(
                    "must be at least two pings ({:?}): a shard's turns are only heard with its pings",
                    self.ping_every * 2
                ),
            ));
        }
        if self.call_wait > LEASE_MAX {
            return Err(ConfigError::new(
                "call_wait",
                format!("{:?}", self.call_wait),
                format!("must be at most {LEASE_MAX:?}: a caller waits this long for a holder"),
            ));
        }
        if self.record_max as usize + 64 > proto::FRAME_MAX {
            return Err(ConfigError::new(
                "record_max",
                self.record_max,
                format!(
                    "must leave room for a frame's head within {}",
                    proto::FRAME_MAX
                ),
            ));
        }
        Ok(())
    }
}

/// The hash a token is kept as.
pub fn token_hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// The server's clock: tokio's, which is the system's monotonic clock unless a
/// simulation paused it (then a seed decides every moment, tests/sim.rs).
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// The server's stop: set once, for good. Its waiters wake in the order they came
/// (tokio's `watch` spreads its waiters by a random draw, which a simulation could not
/// play again from its seed).
#[derive(Default)]
pub(crate) struct Stop {
    /// Set: the server stops.
    set: AtomicBool,
    /// Wakes every waiter once it is set.
    notify: Notify,
}

impl Stop {
    pub(crate) fn set(&self) {
        self.set.store(true, SeqCst);
        self.notify.notify_waiters();
    }

    pub(crate) fn is_set(&self) -> bool {
        self.set.load(SeqCst)
    }

    /// Resolves once set.
    pub(crate) async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }
}

/// A running server's shared state.
pub struct Server {
    inner: Arc<Inner>,
}

struct Inner {
    settings: Settings,
    log: Arc<Log>,
    state: Mutex<State>,
    /// Woken by every append and every grant, for the durability task.
    appended: Notify,
    /// The durability task as the log's writer sees it: after a sync that woke it, the
    /// writer waits (up to the log's `follow`) until the workers it acknowledged have
    /// sent their next appends, so that those ride the next sync.
    follower: ferry_flow::log::Follower,
    /// Turns true when the server stops: connections and tasks end.
    stop: Stop,
    /// The timer and the durability task, once started.
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    counts: Counts,
    /// The runs, from durable records (list, show, result). Its own lock, taken after
    /// `state`'s where both are: a list does not hold up appends.
    index: Mutex<Index>,
    /// Long-polled results, by run: how many wait, and what wakes them when that run
    /// finishes or parks (only those look again). An entry goes with its last waiter.
    ended: Mutex<HashMap<String, (usize, Arc<Notify>)>>,
    /// Each shard's checkpoint (taken before `state` where both are).
    checkpoints: Mutex<Checkpoints>,
    /// `DIR/shards`: the checkpoints and the kept epochs.
    shards_dir: std::path::PathBuf,
    /// When the last compaction ran, and where the log ended then.
    compacted: Mutex<(Instant, Lsn)>,
    /// With `--replicate`: the log kept in a JetStream stream too.
    replicated: Option<Replicated>,
    /// The log is driven by the caller (a simulation): reads run where they are asked
    /// for, not on the blocking pool, whose threads would race the simulation's clock.
    driven: bool,
}

impl Inner {
    /// Run `run` finished or parked: its result long-polls look again.
    fn run_settled(&self, run: &str) {
        if let Some((_, n)) = ferry_core::sync::lock(&self.ended).get(run) {
            n.notify_waiters();
        }
    }

    /// Run `read` (file or log reads) off the runtime's threads; when driven, at once
    /// (under the server's lock: a simulation runs on one thread anyway).
    fn read_off(&self, read: impl FnOnce() + Send + 'static) {
        if self.driven {
            read();
        } else {
            tokio::task::spawn_blocking(read);
        }
    }
}

/// The log kept in a JetStream stream too (docs/flow-server-replica.md): a record is
/// durable once the stream has it as well.
struct Replicated {
    /// Every record of the log before this is in the stream.
    lsn: AtomicU64,
    /// Woken when the log's durable position moved.
    wake: Notify,
    /// Taken by the replicating task when the server starts.
    replica: Mutex<Option<Replica>>,
}

/// Counters for /metrics, from the server's start.
#[derive(Default)]
struct Counts {
    grants: AtomicU64,
    resumes: AtomicU64,
    revokes_expired: AtomicU64,
    revokes_stuck: AtomicU64,
    revokes_rebalance: AtomicU64,
    releases: AtomicU64,
    records: AtomicU64,
    records_again: AtomicU64,
    refused_fenced: AtomicU64,
    refused_other: AtomicU64,
}

struct State {
    table: LeaseTable,
    store: Store,
    /// Each connected session's connection: its number and outgoing frames. A session
    /// that connects again replaces its entry (and the old connection is closed).
    conns: BTreeMap<SessionId, (u64, mpsc::UnboundedSender<Frame>)>,
    /// Numbers connections as they are accepted: a Hello on an older connection than
    /// its session's current one is stale (it was in a buffer when the worker moved on).
    next_conn: u64,
    /// Grants whose epoch record ends at the position: sent once it is durable.
    grants: Vec<(Lsn, SessionId, u32, u64)>,
    /// The log failed: every append is refused from then on.
    failed: bool,
    /// What each worker called itself, for status.
    names: BTreeMap<SessionId, String>,
    /// Sessions the last round of acknowledgements reached that have not appended
    /// since: the durability task's follower goes idle once none is left.
    replies_due: BTreeSet<SessionId>,
    /// Shards whose current grant found its session's connection gone: never sent.
    unsent: BTreeSet<u32>,
    /// Calls on their way to their run's holder, by the id they are forwarded under.
    calls: BTreeMap<u64, Forward>,
    next_call: u64,
}

impl Server {
    /// Open (or create) the server's log in `dir` and read it back.
    pub fn open(dir: &Path, settings: Settings, log: LogConfig) -> Result<Server, OpenError> {
        Server::open_with(dir, settings, log, None)
    }

    /// [`Server::open`] on a directory that [`Replica::restore`] just rebuilt (so the
    /// stream has everything its log holds), publishing every record to the stream as
    /// well: records and grants count as durable once the stream has them too.
    pub fn open_replicated(
        dir: &Path,
        settings: Settings,
        log: LogConfig,
        replica: Replica,
    ) -> Result<Server, OpenError> {
        Server::open_with(dir, settings, log, Some(replica))
    }

    /// [`Server::open`] with its log on `storage` and driven by the caller
    /// ([`Server::write_log`]) instead of a writer thread: the simulation's server
    /// (tests/sim.rs), whose disk syncs when the seed says. `dir` keeps the checkpoints.
    pub fn open_driven(
        dir: &Path,
        storage: Arc<dyn ferry_flow::log::Storage>,
        settings: Settings,
        log: LogConfig,
    ) -> Result<Server, OpenError> {
        settings.check()?;
        fits(&settings, &log)?;
        make_dir(dir)?;
        let (log, _) = Log::open_driven(storage, log)?;
        Server::open_on(dir, settings, log, None, true)
    }

    /// Write and sync what was appended, on a log opened by [`Server::open_driven`].
    /// False if there was nothing to write.
    pub fn write_log(&self) -> bool {
        self.inner.log.write_pending()
    }

    fn open_with(
        dir: &Path,
        settings: Settings,
        log: LogConfig,
        replica: Option<Replica>,
    ) -> Result<Server, OpenError> {
        settings.check()?;
        fits(&settings, &log)?;
        make_dir(dir)?;
        let (log, _) = Log::open_dir(&dir.join("log"), log)?;
        Server::open_on(dir, settings, log, replica, false)
    }

    fn open_on(
        dir: &Path,
        settings: Settings,
        log: Log,
        replica: Option<Replica>,
        driven: bool,
    ) -> Result<Server, OpenError> {
        // Rebuilt from the stream: all of it is there.
        let in_stream = log.end_lsn();
        let follower = log.follower();
        let log = Arc::new(log);
        let shards_dir = dir.join("shards");
        let kept = read_kept(&shards_dir)?;
        if let Some(k) = &kept
            && k.shards != settings.shards
        {
            return Err(OpenError::Dir(format!(
                "this server's directory was made for {} shards, not {}: start it with \
                 --shards {} (runs are placed by shard, so the count cannot change)",
                k.shards, settings.shards, k.shards
            )));
        }
        let checkpoints = Checkpoints::open(&shards_dir, settings.shards, log.start_lsn())?;
        // The runs the checkpoints keep, then those of the log after them.
        let mut index = Index::new(settings.shards);
        for k in 0..settings.shards {
            let c = checkpoints.shard(k);
            for (id, workflow, parent, generation, outcome) in c.finished() {
                index.finished_run(k, id, workflow, parent, generation, outcome);
            }
            for rec in c.active_records() {
                index.durable_record(k, ferry_flow::journal::RECORD_KIND, rec);
            }
        }
        let (store, opened) = Store::open(
            log.clone(),
            settings.shards,
            &checkpoints.bases(),
            kept.as_ref(),
            &mut |shard, kind, bytes| index.durable_record(shard, kind, bytes),
        )?;
        tracing::info!(
            records = opened.records,
            runs = index.len(),
            shards = settings.shards,
            "ferry flow server: log read back"
        );
        let table = LeaseTable::new(
            crate::lease::Settings {
                shards: settings.shards,
                lease: settings.lease,
                stuck_after: settings.stuck_after,
            },
            &opened.epochs,
            now(),
        );
        Ok(Server {
            inner: Arc::new(Inner {
                settings,
                log,
                state: Mutex::new(State {
                    table,
                    store,
                    conns: BTreeMap::new(),
                    next_conn: 0,
                    grants: Vec::new(),
                    failed: false,
                    names: BTreeMap::new(),
                    replies_due: BTreeSet::new(),
                    unsent: BTreeSet::new(),
                    calls: BTreeMap::new(),
                    next_call: 0,
                }),
                appended: Notify::new(),
                follower,
                stop: Stop::default(),
                tasks: Mutex::new(Vec::new()),
                counts: Counts::default(),
                index: Mutex::new(index),
                ended: Mutex::new(HashMap::new()),
                checkpoints: Mutex::new(checkpoints),
                shards_dir,
                compacted: Mutex::new((now(), 0)),
                replicated: replica.map(|replica| Replicated {
                    lsn: AtomicU64::new(in_stream),
                    wake: Notify::new(),
                    replica: Mutex::new(Some(replica)),
                }),
                driven,
            }),
        })
    }

    /// Start the timer and the durability task (on the caller's runtime).
    pub fn start(&self) {
        let ticker = tokio::spawn(tick(self.inner.clone()));
        let pump = tokio::spawn(pump(self.inner.clone()));
        let mut tasks = ferry_core::sync::lock(&self.inner.tasks);
        tasks.extend([ticker, pump]);
        // A driven server (a simulation) compacts only when asked ([`Server::compact`]):
        // compaction reads and writes off the runtime's threads.
        if !self.inner.driven {
            tasks.push(tokio::spawn(compactor(self.inner.clone())));
        }
        if let Some(r) = &self.inner.replicated
            && let Some(replica) = ferry_core::sync::lock(&r.replica).take()
        {
            tasks.push(tokio::spawn(replicate(self.inner.clone(), replica)));
        }
    }

    /// Compact now (docs/flow-server.md §7): fold what is durable into each shard's
    /// checkpoint, forget runs finished longer than the retention ago, keep the
    /// epochs, and retire the log below. Blocking (it reads the log and writes files).
    pub fn compact(&self) -> Result<Compacted, CheckpointsError> {
        compact(&self.inner)
    }

    /// Stop: every connection closes (its worker resumes elsewhere or later), the tasks
    /// end, and the log is closed once the last of them let go of it. What was appended
    /// is written and synced by the log's close; nothing unacknowledged is promised.
    pub async fn shutdown(self) {
        self.inner.stop.set();
        // Calls in flight hold the server until they are answered.
        stop_calls(&mut ferry_core::sync::lock(&self.inner.state));
        let tasks: Vec<_> = ferry_core::sync::lock(&self.inner.tasks)
            .drain(..)
            .collect();
        for t in tasks {
            let _ = t.await;
        }
        // Connections hold the server until they see the stop.
        let mut inner = self.inner;
        loop {
            match Arc::try_unwrap(inner) {
                Ok(inner) => {
                    let State { store, .. } =
                        inner.state.into_inner().unwrap_or_else(|e| e.into_inner());
                    drop(store);
                    if let Some(log) = Arc::into_inner(inner.log)
                        && let Err(e) = log.close()
                    {
                        tracing::error!(error = %e, "ferry flow server: the log did not close cleanly");
                    }
                    return;
                }
                Err(still) => {
                    inner = still;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
    }

    /// What an accept loop serves connections with. It holds the server open: drop it
    /// (stop accepting) before [`Server::shutdown`].
    pub fn connector(&self) -> Connector {
        Connector {
            inner: self.inner.clone(),
        }
    }

    /// Resolves once the server stopped: asked to, or because its log failed
    /// ([`Server::failed`] says which).
    pub async fn stopped(&self) {
        self.inner.stop.wait().await;
    }

    /// Whether the log failed (the server stopped itself).
    pub fn failed(&self) -> bool {
        ferry_core::sync::lock(&self.inner.state).failed
    }

    /// Make a call about a run (docs/flow-server.md §9): a start, signal, cancel or query
    /// goes to the holder of the run's shard (waiting up to `call_wait` for one); a
    /// result is answered from the index, waiting up to its `wait_ms` for the run to
    /// end.
    pub fn call(
        &self,
        call: Call,
    ) -> impl std::future::Future<Output = Result<Outcome, Refused>> + Send + 'static {
        call_in(self.inner.clone(), call)
    }

    /// Runs by id from the index (durable records), in `state` if given, after `after`,
    /// at most `limit`.
    pub fn runs(&self, state: Option<&str>, after: Option<&str>, limit: usize) -> Vec<RunSummary> {
        ferry_core::sync::lock(&self.inner.index).list(state, after, limit)
    }

    /// Whether `token` may use the server: one of its tokens, or any when it has none.
    pub fn authorized(&self, token: Option<&str>) -> bool {
        authorized(&self.inner.settings, token)
    }

    /// Whether the server asks for tokens.
    pub fn has_tokens(&self) -> bool {
        !self.inner.settings.tokens.is_empty()
    }

    /// The largest record the server takes.
    pub fn record_max(&self) -> u32 {
        self.inner.settings.record_max
    }

    /// One run from the index.
    pub fn run(&self, id: &str) -> Option<RunSummary> {
        ferry_core::sync::lock(&self.inner.index).get(id).cloned()
    }

    /// Each shard's epoch and holder as the table sees it (for status and tests).
    pub fn holders(&self) -> Vec<(u64, Option<SessionId>)> {
        let state = ferry_core::sync::lock(&self.inner.state);
        (0..self.inner.settings.shards)
            .map(|s| state.table.holder(s))
            .collect()
    }
}

/// Serves connections for a [`Server`].
#[derive(Clone)]
pub struct Connector {
    inner: Arc<Inner>,
}

impl Connector {
    /// Serve one connection until it closes or the server stops.
    pub fn connection<S>(&self, stream: S) -> impl std::future::Future<Output = ()> + Send + 'static
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        connection(self.inner.clone(), stream)
    }
}

fn make_dir(dir: &Path) -> Result<(), OpenError> {
    std::fs::create_dir_all(dir).map_err(|e| {
        OpenError::Dir(format!(
            "cannot create the server's directory {}: {e}",
            dir.display()
        ))
    })
}

/// A shard's record travels in the log with 21 bytes of its own.
fn fits(settings: &Settings, log: &LogConfig) -> Result<(), ConfigError> {
    if u64::from(settings.record_max) + 21 > u64::from(log.record_bytes_max) {
        return Err(ConfigError::new(
            "record_max",
            settings.record_max,
            format!(
                "must fit, with 21 bytes of framing, in the log's largest record ({})",
                log.record_bytes_max
            ),
        ));
    }
    Ok(())
}

/// Why the server did not open.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Checkpoints(#[from] CheckpointsError),
    #[error("{0}")]
    Dir(String),
    #[error(transparent)]
    Log(#[from] LogError),
}

/// Compacts (off the runtime's threads) once the log grew by `compact_bytes` since the
/// last compaction, or a minute passed with anything new.
async fn compactor(inner: Arc<Inner>) {
    let mut failed = false;
    loop {
        tokio::select! {
            biased;
            _ = inner.stop.wait() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        let (last, at) = *ferry_core::sync::lock(&inner.compacted);
        let grown = durable_lsn(&inner).saturating_sub(at);
        // After a failure, a minute (not at once: it would read the log again).
        let minute = now().saturating_duration_since(last) >= Duration::from_secs(60);
        let due =
            (grown >= inner.settings.compact_bytes && (!failed || minute)) || (grown > 0 && minute);
        if !due {
            continue;
        }
        let i = inner.clone();
        failed = match tokio::task::spawn_blocking(move || compact(&i)).await {
            Ok(Ok(_)) => false,
            Ok(Err(e)) => {
                tracing::error!(error = %e, "ferry flow server: compaction failed; the log keeps everything, and it is tried again in a minute");
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "ferry flow server: compaction panicked");
                true
            }
        };
        if failed {
            ferry_core::sync::lock(&inner.compacted).0 = now();
        }
    }
}

fn compact(inner: &Inner) -> Result<Compacted, CheckpointsError> {
    let started = now();
    let mut checkpoints = ferry_core::sync::lock(&inner.checkpoints);
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let retention_ms = inner.settings.retention.as_millis() as u64;
    let done = checkpoints.compact(&inner.log, durable_lsn(inner), now_ms, retention_ms)?;
    let kept = {
        // Every shard's records below `done.read` are folded: reads of each start
        // there (the segments below go).
        let bases = checkpoints.bases();
        let mut state = ferry_core::sync::lock(&inner.state);
        for (shard, &base) in bases.iter().enumerate() {
            state.store.set_base(shard as u32, base, done.read);
        }
        Kept {
            shards: inner.settings.shards,
            epochs: state.store.epochs(),
        }
    };
    ferry_core::sync::lock(&inner.index).forget(&done.expired);
    write_kept(&inner.shards_dir, &kept)?;
    let retired = inner.log.retire_below(done.read)?;
    *ferry_core::sync::lock(&inner.compacted) = (now(), done.read);
    tracing::info!(
        shards = done.moved.len(),
        expired = done.expired.len(),
        skipped = done.skipped.len(),
        retired,
        ms = started.elapsed().as_secs_f64() * 1e3,
        "ferry flow server: checkpoints written"
    );
    Ok(done)
}

async fn tick(inner: Arc<Inner>) {
    let every = inner.settings.ping_every / 4;
    loop {
        tokio::select! {
            biased;
            _ = inner.stop.wait() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let mut state = ferry_core::sync::lock(&inner.state);
        let actions = state.table.tick(now());
        carry_out(&inner, &mut state, actions);
        route(&mut state, now(), &inner.settings);
        // Names of sessions the table forgot go with them.
        if state.names.len() > state.conns.len() {
            let known: BTreeSet<SessionId> = state
                .table
                .sessions()
                .into_iter()
                .map(|(id, _)| id)
                .collect();
            state.names.retain(|id, _| known.contains(id));
        }
    }
}

/// Waits for the log to make what was appended durable, then answers `Durable` to each
/// shard's holder and sends the grants it covered.
async fn pump(inner: Arc<Inner>) {
    loop {
        let appended = inner.appended.notified();
        tokio::pin!(appended);
        appended.as_mut().enable();
        let target = inner.log.end_lsn();
        if inner.log.durable_lsn() < target
            && let Err(e) = inner.log.durable_following(target, &inner.follower).await
        {
            fail(&inner, &format!("the log failed: {e}"));
            return;
        }
        if let Some(r) = &inner.replicated {
            r.wake.notify_one();
        }
        // Whatever is durable now is answered, however it got there: by this wait, or
        // by a sync before it. (Answering only after a wait of its own left a grant
        // whose epoch a sync made durable first unsent until the next append, 10 s
        // later in a demo run.)
        deliver(&inner);
        if inner.log.durable_lsn() >= inner.log.end_lsn() {
            // Registered before `target` was read: no append since is missed.
            tokio::select! {
                biased;
                _ = inner.stop.wait() => return,
                _ = appended => {}
            }
        }
    }
}

/// Answer `Durable` to each shard's holder for what is durable, and send the grants
/// whose epochs are.
fn deliver(inner: &Inner) {
    let durable = durable_lsn(inner);
    let mut state = ferry_core::sync::lock(&inner.state);
    let state = &mut *state;
    // Whom this round acknowledges: the log's writer waits for their replies.
    state.replies_due.clear();
    let mut ended = Vec::new();
    let moved = state.store.advance(durable);
    if !moved.is_empty() {
        // Before the acknowledgements: what a worker was told is durable, the index shows.
        let mut index = ferry_core::sync::lock(&inner.index);
        for &(shard, position) in &moved {
            index.durable(shard, position, &mut ended);
        }
    }
    for run in &ended {
        inner.run_settled(run);
    }
    for (shard, position) in moved {
        let (epoch, holder) = state.table.holder(shard);
        if let Some(h) = holder
            && state.conns.contains_key(&h)
        {
            state.replies_due.insert(h);
        }
        if let Some((_, tx)) = holder.and_then(|h| state.conns.get(&h)) {
            let _ = tx.send(Frame {
                id: 0,
                body: Body::Durable(vec![ShardPos {
                    shard,
                    epoch,
                    position,
                }]),
            });
        }
    }
    let (ready, waiting): (Vec<_>, Vec<_>) = state
        .grants
        .drain(..)
        .partition(|&(end, ..)| end <= durable);
    state.grants = waiting;
    for (_, session, shard, epoch) in ready {
        // Still this session's at this epoch (not revoked while the epoch was written)?
        if let Err(e) = state.table.check(session, shard, epoch) {
            tracing::info!(shard, epoch, session = %session_tag(session), "ferry flow server: a grant not sent: {e}");
            continue;
        }
        tracing::info!(shard, epoch, session = %session_tag(session), "ferry flow server: shard granted");
        state.unsent.insert(shard);
        if let Some((_, tx)) = state.conns.get(&session) {
            state.unsent.remove(&shard);
            let _ = tx.send(Frame {
                id: 0,
                body: Body::Grant(vec![Granted {
                    shard,
                    epoch,
                    checkpoint: state.store.base(shard),
                    end: state.store.end(shard),
                }]),
            });
        }
    }
    // Nobody to wait for: the writer may go on.
    if state.replies_due.is_empty() {
        inner.follower.idle();
    }
    // Calls that waited for a grant just sent.
    if !state.calls.is_empty() {
        route(state, now(), &inner.settings);
    }
}

/// Everything before this is durable: synced, and with `--replicate` in the stream too.
fn durable_lsn(inner: &Inner) -> Lsn {
    let synced = inner.log.durable_lsn();
    match &inner.replicated {
        Some(r) => synced.min(r.lsn.load(Relaxed)),
        None => synced,
    }
}

/// Publishes what the log made durable to the stream, one batch at a time (what the
/// log syncs meanwhile rides the next), and answers for it once the stream has it.
async fn replicate(inner: Arc<Inner>, mut replica: Replica) {
    let lost = replica.lost();
    tokio::select! {
        biased;
        why = lost => fail(&inner, &why),
        _ = replicating(&inner, &mut replica) => {}
    }
    // Stopping (or deposed): a standby may take over at once.
    replica.release().await;
}

async fn replicating(inner: &Inner, replica: &mut Replica) {
    let r = inner.replicated.as_ref().expect("replicated");
    // Where the records queued for the stream end.
    let mut queued = r.lsn.load(Relaxed);
    loop {
        let woken = r.wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        // One batch in flight: what syncs meanwhile rides the next. More in flight was
        // slower here (docs/notes/2026-12-07-flow-replica-in-flight.md).
        if queued < inner.log.durable_lsn() && replica.in_flight() == 0 {
            let log = inner.log.clone();
            match tokio::task::spawn_blocking(move || replica::read_batch(&log, queued)).await {
                Ok(Ok((batch, end))) if end > queued => {
                    replica.queue(&batch, end);
                    queued = end;
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    fail(
                        inner,
                        &format!("reading the log to replicate it failed: {e}"),
                    );
                    return;
                }
                Err(e) => {
                    fail(
                        inner,
                        &format!("reading the log to replicate it panicked: {e}"),
                    );
                    return;
                }
            }
        }
        let sent = replica.send().await;
        let acked = match sent {
            Err(e) => Err(e),
            Ok(()) => tokio::select! {
                biased;
                _ = inner.stop.wait() => return,
                acked = replica.acked() => acked,
                // More is durable: queue it (the acknowledgement awaited stays awaited).
                _ = woken => continue,
            },
        };
        let acked = match acked {
            // A sequence refused means another server took over, unless every message
            // past the last acknowledged one is this server's (sent again after a
            // timeout) or a deposed server's void part: read the stream back.
            Err(e) if e.transient() || matches!(e, ReplicaError::Deposed { .. }) => {
                tracing::warn!(error = %e, "ferry flow server: the stream did not take a batch; sending what it lacks again (nothing in it is acknowledged until it does)");
                tokio::select! {
                    biased;
                    _ = inner.stop.wait() => return,
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
                replica.recover().await
            }
            acked => acked,
        };
        match acked {
            Ok(Some(end)) => {
                r.lsn.store(end, Relaxed);
                deliver(inner);
            }
            Ok(None) => {}
            Err(e) if e.transient() => {
                tracing::warn!(error = %e, "ferry flow server: the stream cannot be read back yet; trying again");
            }
            Err(e) => {
                fail(inner, &e);
                return;
            }
        }
    }
}

/// The log failed, or the stream went to another server: nothing past what was
/// answered can be promised, so the server stops (every connection closes; workers
/// wait for it to come back, or go to a standby) rather than answer for records it may
/// not have. A restart recovers the log.
fn fail(inner: &Inner, e: &dyn std::fmt::Display) {
    tracing::error!(error = %e, "ferry flow server: stopping; started again, it recovers what was durable");
    let mut state = ferry_core::sync::lock(&inner.state);
    state.failed = true;
    inner.stop.set();
    stop_calls(&mut state);
}

/// Do what the table asked: write epochs (grants go out once durable), send revokes and
/// drains.
fn carry_out(inner: &Inner, state: &mut State, actions: Vec<Action>) {
    for a in actions {
        match a {
            Action::Grant { shard, .. } if state.failed => state.table.grant_failed(shard),
            Action::Grant {
                session,
                shard,
                epoch,
            } => match state.store.epoch_record(shard, epoch, session) {
                Ok(end) => {
                    inner.counts.grants.fetch_add(1, Relaxed);
                    ferry_core::sync::lock(&inner.index).granted(shard);
                    state.grants.push((end, session, shard, epoch));
                    inner.appended.notify_one();
                }
                Err(e) => {
                    tracing::error!(error = %e, shard, "ferry flow server: a grant's epoch could not be written");
                    state.table.grant_failed(shard);
                }
            },
            Action::Revoke {
                session,
                shard,
                epoch,
                reason,
            } => {
                tracing::info!(shard, epoch, ?reason, "ferry flow server: shard revoked");
                let c = &inner.counts;
                match reason {
                    proto::RevokeReason::Expired => &c.revokes_expired,
                    proto::RevokeReason::Stuck => &c.revokes_stuck,
                    proto::RevokeReason::Rebalance => &c.revokes_rebalance,
                }
                .fetch_add(1, Relaxed);
                send(
                    state,
                    session,
                    Body::Revoke {
                        shard,
                        epoch,
                        reason,
                    },
                );
            }
            Action::Drain {
                session,
                shard,
                epoch,
            } => send(state, session, Body::Drain { shard, epoch }),
            // Resumes are answered in the Welcome.
            Action::Resumed { .. } => {
                inner.counts.resumes.fetch_add(1, Relaxed);
            }
        }
    }
}

/// `session` will not be waited for after the last round of acknowledgements (it
/// replied, or left): the log's writer goes on once nobody is left to wait for.
fn replied(inner: &Inner, state: &mut State, session: SessionId) {
    if state.replies_due.remove(&session) && state.replies_due.is_empty() {
        inner.follower.idle();
    }
}

fn send(state: &State, session: SessionId, body: Body) {
    if let Some((_, tx)) = state.conns.get(&session) {
        let _ = tx.send(Frame { id: 0, body });
    }
}

fn refused(to: u64, refused: Refused) -> Frame {
    Frame {
        id: 0,
        body: Body::Refused { to, refused },
    }
}

/// Whether `token` is one of the settings' tokens, or any is when there are none.
fn authorized(settings: &Settings, token: Option<&str>) -> bool {
    settings.tokens.is_empty()
        || token.is_some_and(|t| {
            let given = token_hash(t);
            settings.tokens.iter().any(|h| constant_time_eq(h, &given))
        })
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
