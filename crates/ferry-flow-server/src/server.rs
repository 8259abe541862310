//! The server (docs/flow-server.md): connections from workers over TCP or a Unix socket,
//! the lease table driven by their hellos, pings, releases and a timer, and the store
//! taking their appends, with one task that turns the log's durability into `Durable`
//! answers and sends grants once their epochs are durable.
//!
//! Locking: one mutex over the table, the store and the open connections; every frame
//! is handled under it, briefly (an append copies into the log's open batch and
//! returns). Nothing waits for the disk under it: the durability task waits outside and
//! takes it to hand out what a sync covered.

use crate::index::{Index, RunSummary};
use crate::lease::{Action, LeaseTable, SessionId};
use crate::store::{AppendError, Store};
use ferry_core::ConfigError;
use ferry_flow::log::{Config as LogConfig, Error as LogError, Log, Lsn};
use ferry_flow::remote::io::{FrameReader, ReadError, write_frame};
use ferry_flow::remote::proto::{
    self, Body, Call, CallKind, Frame, Granted, Hello, Outcome, PROTOCOL, Refused, Role, ShardPos,
    Welcome,
};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc, oneshot, watch};

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
    stop: watch::Sender<bool>,
    /// The timer and the durability task, once started.
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    counts: Counts,
    /// The runs, from durable records (list, show, result). Its own lock, taken after
    /// `state`'s where both are: a list does not hold up appends.
    index: Mutex<Index>,
    /// Woken when a run finishes or parks: long-polled results look again.
    ended: Notify,
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
    conns: HashMap<SessionId, (u64, mpsc::UnboundedSender<Frame>)>,
    /// Numbers connections as they are accepted: a Hello on an older connection than
    /// its session's current one is stale (it was in a buffer when the worker moved on).
    next_conn: u64,
    /// Grants whose epoch record ends at the position: sent once it is durable.
    grants: Vec<(Lsn, SessionId, u32, u64)>,
    /// The log failed: every append is refused from then on.
    failed: bool,
    /// What each worker called itself, for status.
    names: HashMap<SessionId, String>,
    /// Sessions the last round of acknowledgements reached that have not appended
    /// since: the durability task's follower goes idle once none is left.
    replies_due: std::collections::HashSet<SessionId>,
    /// Shards whose current grant found its session's connection gone: never sent.
    unsent: std::collections::HashSet<u32>,
    /// Calls on their way to their run's holder, by the id they are forwarded under.
    calls: HashMap<u64, Forward>,
    next_call: u64,
}

/// A call on its way to the holder of its run's shard (docs/flow-server.md §9).
struct Forward {
    call: Call,
    shard: u32,
    /// The session and epoch it was sent to; none while it waits for a holder.
    sent: Option<(SessionId, u64)>,
    /// Not sent again before this (the holder was still recovering the shard).
    not_before: Instant,
    /// Refused as `NoHolder` if it found none by then.
    until: Instant,
    reply: oneshot::Sender<Result<Outcome, Refused>>,
}

/// What `/status` answers (version 1): each shard's epoch, holder and records, each
/// worker, and the log's figures.
#[derive(Debug, serde::Serialize)]
pub struct Status {
    pub version: u32,
    pub shards: Vec<ShardStatus>,
    pub workers: Vec<WorkerStatus>,
    pub log: LogStatus,
}

#[derive(Debug, serde::Serialize)]
pub struct ShardStatus {
    pub shard: u32,
    pub epoch: u64,
    /// The holding session, in hex; none while free (or fenced after a revoke).
    pub holder: Option<String>,
    /// The holder was sent its grant: the epoch is durable (until then the shard is
    /// the holder's, but the holder does not know it yet).
    pub granted: bool,
    pub records: u64,
    pub durable: u64,
}

#[derive(Debug, serde::Serialize)]
pub struct WorkerStatus {
    pub session: String,
    pub name: String,
    pub connected: bool,
    pub shards: Vec<u32>,
}

#[derive(Debug, serde::Serialize)]
pub struct LogStatus {
    pub durable: u64,
    pub end: u64,
    pub segments: usize,
    pub syncs: u64,
    pub records: u64,
}

impl Server {
    /// Open (or create) the server's log in `dir` and read it back.
    pub fn open(dir: &Path, settings: Settings, log: LogConfig) -> Result<Server, OpenError> {
        settings.check()?;
        std::fs::create_dir_all(dir).map_err(|e| {
            OpenError::Dir(format!(
                "cannot create the server's directory {}: {e}",
                dir.display()
            ))
        })?;
        let (log, _) = Log::open_dir(&dir.join("log"), log)?;
        let follower = log.follower();
        let log = Arc::new(log);
        let mut index = Index::new(settings.shards);
        let (store, opened) =
            Store::open(log.clone(), settings.shards, &mut |shard, kind, bytes| {
                index.durable_record(shard, kind, bytes)
            })?;
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
            Instant::now(),
        );
        Ok(Server {
            inner: Arc::new(Inner {
                settings,
                log,
                state: Mutex::new(State {
                    table,
                    store,
                    conns: HashMap::new(),
                    next_conn: 0,
                    grants: Vec::new(),
                    failed: false,
                    names: HashMap::new(),
                    replies_due: std::collections::HashSet::new(),
                    unsent: std::collections::HashSet::new(),
                    calls: HashMap::new(),
                    next_call: 0,
                }),
                appended: Notify::new(),
                follower,
                stop: watch::channel(false).0,
                tasks: Mutex::new(Vec::new()),
                counts: Counts::default(),
                index: Mutex::new(index),
                ended: Notify::new(),
            }),
        })
    }

    /// Start the timer and the durability task (on the caller's runtime).
    pub fn start(&self) {
        let ticker = tokio::spawn(tick(self.inner.clone(), self.inner.stop.subscribe()));
        let pump = tokio::spawn(pump(self.inner.clone(), self.inner.stop.subscribe()));
        ferry_core::sync::lock(&self.inner.tasks).extend([ticker, pump]);
    }

    /// Stop: every connection closes (its worker resumes elsewhere or later), the tasks
    /// end, and the log is closed once the last of them let go of it. What was appended
    /// is written and synced by the log's close; nothing unacknowledged is promised.
    pub async fn shutdown(self) {
        let _ = self.inner.stop.send(true);
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

    /// The `/status` answer.
    pub fn status(&self) -> Status {
        let state = ferry_core::sync::lock(&self.inner.state);
        let shards = (0..self.inner.settings.shards)
            .map(|shard| {
                let (epoch, holder) = state.table.holder(shard);
                ShardStatus {
                    shard,
                    epoch,
                    holder: holder.map(session_tag),
                    granted: holder.is_some()
                        && !state.grants.iter().any(|g| g.2 == shard)
                        && !state.unsent.contains(&shard),
                    records: state.store.end(shard),
                    durable: state.store.durable(shard),
                }
            })
            .collect();
        let workers = state
            .table
            .sessions()
            .into_iter()
            .map(|(id, connected)| WorkerStatus {
                session: session_tag(id),
                name: state.names.get(&id).cloned().unwrap_or_default(),
                connected,
                shards: state.table.held_by(id).iter().map(|h| h.shard).collect(),
            })
            .collect();
        let st = self.inner.log.stats();
        Status {
            version: 1,
            shards,
            workers,
            log: LogStatus {
                durable: st.durable,
                end: st.end,
                segments: st.segments,
                syncs: st.syncs,
                records: st.records,
            },
        }
    }

    /// `/metrics`: Prometheus text (0.0.4).
    pub fn metrics(&self) -> String {
        let status = self.status();
        let c = &self.inner.counts;
        let held = status.shards.iter().filter(|s| s.holder.is_some()).count();
        let connected = status.workers.iter().filter(|w| w.connected).count();
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (labels, v) in samples {
                out.push_str(&format!("{name}{labels} {v}\n"));
            }
        };
        metric(
            "ferry_flow_server_shards",
            "gauge",
            "shards, and how many are held",
            &[
                ("{state=\"held\"}", held as u64),
                ("{state=\"free\"}", (status.shards.len() - held) as u64),
            ],
        );
        metric(
            "ferry_flow_server_workers",
            "gauge",
            "workers the lease table knows, connected or within their lease",
            &[
                ("{connected=\"true\"}", connected as u64),
                (
                    "{connected=\"false\"}",
                    (status.workers.len() - connected) as u64,
                ),
            ],
        );
        metric(
            "ferry_flow_server_grants_total",
            "counter",
            "shards granted at a new epoch",
            &[("", c.grants.load(Relaxed))],
        );
        metric(
            "ferry_flow_server_resumes_total",
            "counter",
            "shards a reconnecting worker resumed at the same epoch",
            &[("", c.resumes.load(Relaxed))],
        );
        metric(
            "ferry_flow_server_revokes_total",
            "counter",
            "shards taken from a worker, by reason",
            &[
                ("{reason=\"expired\"}", c.revokes_expired.load(Relaxed)),
                ("{reason=\"stuck\"}", c.revokes_stuck.load(Relaxed)),
                ("{reason=\"rebalance\"}", c.revokes_rebalance.load(Relaxed)),
            ],
        );
        metric(
            "ferry_flow_server_releases_total",
            "counter",
            "shards workers handed back",
            &[("", c.releases.load(Relaxed))],
        );
        metric(
            "ferry_flow_server_records_total",
            "counter",
            "records appended, and records sent again that were already held",
            &[
                ("{kind=\"new\"}", c.records.load(Relaxed)),
                ("{kind=\"again\"}", c.records_again.load(Relaxed)),
            ],
        );
        metric(
            "ferry_flow_server_refused_total",
            "counter",
            "requests refused: fenced (a stale epoch or a shard not held) or other",
            &[
                ("{kind=\"fenced\"}", c.refused_fenced.load(Relaxed)),
                ("{kind=\"other\"}", c.refused_other.load(Relaxed)),
            ],
        );
        metric(
            "ferry_flow_server_log_syncs_total",
            "counter",
            "syncs of the server's log (each covers every shard's records since the last)",
            &[("", status.log.syncs)],
        );
        metric(
            "ferry_flow_server_log_durable_bytes",
            "gauge",
            "the log's durable position",
            &[("", status.log.durable)],
        );
        out
    }

    /// Resolves once the server stopped: asked to, or because its log failed
    /// ([`Server::failed`] says which).
    pub async fn stopped(&self) {
        let mut stop = self.inner.stop.subscribe();
        let _ = stop.wait_for(|s| *s).await;
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
        let tokens = &self.inner.settings.tokens;
        tokens.is_empty()
            || token.is_some_and(|t| {
                let given = token_hash(t);
                tokens.iter().any(|h| constant_time_eq(h, &given))
            })
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

/// Why the server did not open.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Dir(String),
    #[error(transparent)]
    Log(#[from] LogError),
}

async fn tick(inner: Arc<Inner>, mut stop: watch::Receiver<bool>) {
    let every = inner.settings.ping_every / 4;
    loop {
        tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(every) => {}
        }
        let mut state = ferry_core::sync::lock(&inner.state);
        let actions = state.table.tick(Instant::now());
        carry_out(&inner, &mut state, actions);
        route(&mut state, Instant::now(), inner.settings.call_wait);
        // Names of sessions the table forgot go with them.
        if state.names.len() > state.conns.len() {
            let known: std::collections::HashSet<SessionId> = state
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
async fn pump(inner: Arc<Inner>, mut stop: watch::Receiver<bool>) {
    loop {
        let appended = inner.appended.notified();
        tokio::pin!(appended);
        appended.as_mut().enable();
        let target = inner.log.end_lsn();
        if inner.log.durable_lsn() < target
            && let Err(e) = inner.log.durable_following(target, &inner.follower).await
        {
            fail(&inner, &e);
            return;
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
                _ = stop.wait_for(|s| *s) => return,
                _ = appended => {}
            }
        }
    }
}

/// Answer `Durable` to each shard's holder for what is durable, and send the grants
/// whose epochs are.
fn deliver(inner: &Inner) {
    let durable = inner.log.durable_lsn();
    let mut state = ferry_core::sync::lock(&inner.state);
    let state = &mut *state;
    // Whom this round acknowledges: the log's writer waits for their replies.
    state.replies_due.clear();
    let mut ended = false;
    let moved = state.store.advance(durable);
    if !moved.is_empty() {
        // Before the acknowledgements: what a worker was told is durable, the index shows.
        let mut index = ferry_core::sync::lock(&inner.index);
        for &(shard, position) in &moved {
            ended |= index.durable(shard, position);
        }
    }
    if ended {
        inner.ended.notify_waiters();
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
                    checkpoint: 0,
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
        route(state, Instant::now(), inner.settings.call_wait);
    }
}

/// The log failed: nothing it holds past its last sync can be promised, so the server
/// stops (every connection closes; workers wait for it to come back) rather than
/// answer for records it may not have. A restart recovers the log.
fn fail(inner: &Inner, e: &LogError) {
    tracing::error!(error = %e, "ferry flow server: the log failed; the server stops, and recovers when started again");
    ferry_core::sync::lock(&inner.state).failed = true;
    let _ = inner.stop.send(true);
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

/// A call arrives (from a connection or the HTTP API): a result is answered from the
/// index; the rest are forwarded to the run's holder.
async fn call_in(inner: Arc<Inner>, call: Call) -> Result<Outcome, Refused> {
    if let CallKind::Result { id, wait_ms } = &call.kind {
        return result(&inner, id, Duration::from_millis(u64::from(*wait_ms))).await;
    }
    let shard = ferry_flow::shard_of(call.kind.run(), inner.settings.shards);
    let (tx, rx) = oneshot::channel();
    {
        let mut state = ferry_core::sync::lock(&inner.state);
        let now = Instant::now();
        state.next_call += 1;
        let id = state.next_call;
        state.calls.insert(
            id,
            Forward {
                call,
                shard,
                sent: None,
                not_before: now,
                until: now + inner.settings.call_wait,
                reply: tx,
            },
        );
        route(&mut state, now, inner.settings.call_wait);
    }
    // The server stopping drops the call.
    rx.await.unwrap_or(Err(Refused::Unavailable {
        retry_after_ms: 1000,
    }))
}

/// Run `id`'s outcome from the index, once it ended (waiting up to `wait`): the run's
/// summary as JSON, state running if it had not ended by then.
async fn result(inner: &Inner, id: &str, wait: Duration) -> Result<Outcome, Refused> {
    let until = tokio::time::Instant::now() + wait.min(Duration::from_secs(60));
    loop {
        let ended = inner.ended.notified();
        tokio::pin!(ended);
        ended.as_mut().enable();
        let run = ferry_core::sync::lock(&inner.index).get(id).cloned();
        let Some(run) = run else {
            return Ok(Outcome::Err {
                kind: "unknown_run".into(),
                message: format!("no run {id:?}: it was never started (durably) on this server"),
            });
        };
        let past = tokio::time::Instant::now() >= until;
        if run.finished() || run.state == "parked" || past {
            let json = serde_json::to_vec(&run).expect("a summary serializes");
            return Ok(Outcome::Ok(json));
        }
        tokio::select! {
            _ = ended => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
}

/// Send each waiting call to its shard's holder, once it has one whose grant went out;
/// take back calls whose holder lost the shard (they go to the next one: their keys make
/// a second delivery a no-op); refuse those that waited `call_wait` for a holder.
fn route(state: &mut State, now: Instant, call_wait: Duration) {
    let State {
        calls,
        table,
        conns,
        grants,
        unsent,
        ..
    } = state;
    calls.retain(|&id, f| {
        let (epoch, holder) = table.holder(f.shard);
        let ready = holder.filter(|h| {
            conns.contains_key(h)
                && !unsent.contains(&f.shard)
                && !grants.iter().any(|g| g.2 == f.shard)
        });
        if let Some(sent) = f.sent
            && (Some(sent.0), sent.1) != (ready, epoch)
        {
            // Its holder let go before answering: the next one gets as long.
            f.sent = None;
            f.until = now + call_wait;
        }
        if f.sent.is_some() {
            return true;
        }
        if let Some(h) = ready
            && now >= f.not_before
        {
            let (_, tx) = &conns[&h];
            let _ = tx.send(Frame {
                id,
                body: Body::Call(f.call.clone()),
            });
            f.sent = Some((h, epoch));
            return true;
        }
        true
    });
    for (_, f) in calls.extract_if(|_, f| f.sent.is_none() && now >= f.until) {
        let _ = f.reply.send(Err(Refused::NoHolder { shard: f.shard }));
    }
}

/// `session`'s connection went: the calls sent on it go again (to whichever holder).
fn unsend(state: &mut State, session: SessionId) {
    for f in state.calls.values_mut() {
        if f.sent.is_some_and(|(h, _)| h == session) {
            f.sent = None;
        }
    }
}

/// The holder `session` answered call `id`. A holder still recovering the shard answers
/// `not_held`: the call is sent again shortly.
fn answered(
    state: &mut State,
    session: SessionId,
    id: u64,
    outcome: Outcome,
    now: Instant,
    call_wait: Duration,
) {
    let Some(f) = state.calls.get_mut(&id) else {
        return;
    };
    if f.sent.is_none_or(|(h, _)| h != session) {
        return;
    }
    if matches!(&outcome, Outcome::Err { kind, .. } if kind == "not_held") {
        f.sent = None;
        f.not_before = now + Duration::from_millis(20);
        f.until = f.until.max(now + call_wait);
        return;
    }
    let f = state.calls.remove(&id).expect("looked at it");
    let _ = f.reply.send(Ok(outcome));
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

/// How long a connection may take to say hello, and the most its frames may hold
/// until it has.
const HELLO_WITHIN: Duration = Duration::from_secs(10);
const HELLO_FRAME_MAX: usize = 64 << 10;
/// A peer that does not take a frame within this is cut off (it would hold the
/// server's shutdown, and its queue, forever).
const WRITE_WITHIN: Duration = Duration::from_secs(10);

/// Who a connection is, once it said hello.
#[derive(Clone, Copy)]
enum Peer {
    Worker(SessionId),
    Client,
}

async fn connection<S>(inner: Arc<Inner>, stream: S)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut reader, mut writer) = tokio::io::split(stream);
    let (tx, mut rx) = mpsc::unbounded_channel::<Frame>();
    let write = tokio::spawn(async move {
        while let Some(frame) = rx.recv().await {
            let close = matches!(frame.body, Body::Refused { ref refused, .. } if closes(refused));
            let wrote = tokio::time::timeout(WRITE_WITHIN, write_frame(&mut writer, &frame)).await;
            if !matches!(wrote, Ok(Ok(()))) || close {
                break;
            }
        }
        let _ = tokio::time::timeout(WRITE_WITHIN, writer.shutdown()).await;
    });
    let conn_no = {
        let mut state = ferry_core::sync::lock(&inner.state);
        state.next_conn += 1;
        state.next_conn
    };
    let mut frames = FrameReader::default();
    frames.limit(HELLO_FRAME_MAX);
    let hello_by = tokio::time::Instant::now() + HELLO_WITHIN;
    let mut peer: Option<Peer> = None;
    let mut stop = inner.stop.subscribe();
    loop {
        let read = tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => break,
            _ = tokio::time::sleep_until(hello_by), if peer.is_none() => {
                let _ = tx.send(refused(0, Refused::Malformed { what: format!("no Hello within {HELLO_WITHIN:?}") }));
                break;
            }
            read = frames.next(&mut reader) => read,
        };
        let frame = match read {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(ReadError::Io(e)) => {
                tracing::debug!(error = %e, "ferry flow server: a connection broke");
                break;
            }
            Err(ReadError::Malformed(e)) => {
                let _ = tx.send(refused(0, e.into()));
                break;
            }
        };
        let id = frame.id;
        let answer = match (peer, frame.body) {
            (None, Body::Hello(hello)) => match hello_in(&inner, &tx, conn_no, id, hello) {
                Ok(p) => {
                    peer = Some(p);
                    frames.limit(proto::FRAME_MAX);
                    None
                }
                Err(r) => Some(refused(id, r)),
            },
            (None, _) => Some(refused(
                id,
                Refused::Malformed {
                    what: "the first frame must be a Hello".into(),
                },
            )),
            (Some(_), Body::Call(call)) => {
                let answer = call_in(inner.clone(), call);
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _ = tx.send(match answer.await {
                        Ok(outcome) => Frame {
                            id: 0,
                            body: Body::Answer { call: id, outcome },
                        },
                        Err(r) => refused(id, r),
                    });
                });
                None
            }
            (Some(Peer::Client), _) => Some(refused(
                id,
                Refused::Malformed {
                    what: "a client holds no shards: only calls come from a client".into(),
                },
            )),
            (Some(Peer::Worker(s)), body) => handle(&inner, &tx, s, conn_no, id, body),
        };
        if let Some(answer) = answer {
            let close = matches!(&answer.body, Body::Refused { refused, .. } if closes(refused));
            if let Body::Refused { refused, .. } = &answer.body {
                let c = &inner.counts;
                if refused.is_fenced() {
                    &c.refused_fenced
                } else {
                    &c.refused_other
                }
                .fetch_add(1, Relaxed);
            }
            let _ = tx.send(answer);
            // Nothing after a frame refused as malformed is applied.
            if close {
                break;
            }
        }
    }
    if let Some(Peer::Worker(s)) = peer {
        let mut state = ferry_core::sync::lock(&inner.state);
        // Only if this connection is still the session's (a reconnect replaces it).
        if state.conns.get(&s).is_some_and(|(n, _)| *n == conn_no) {
            state.conns.remove(&s);
            unsend(&mut state, s);
            let actions = state.table.disconnect(s, Instant::now());
            carry_out(&inner, &mut state, actions);
            // No reply will come from it.
            replied(&inner, &mut state, s);
        }
    }
    drop(tx);
    // A peer that does not read is cut off by the write timeout; past that, let go.
    if tokio::time::timeout(WRITE_WITHIN * 2, write).await.is_err() {
        tracing::warn!("ferry flow server: a connection's writer did not finish");
    }
}

/// Refusals after which the connection closes.
fn closes(r: &Refused) -> bool {
    matches!(
        r,
        Refused::Malformed { .. } | Refused::Unauthorized | Refused::Version { .. }
    )
}

/// A session's id as logs and status show it: enough to tell workers apart, not enough
/// to speak as one.
pub fn session_tag(id: SessionId) -> String {
    format!("{:08x}", (id >> 96) as u32)
}

fn hello_in(
    inner: &Inner,
    tx: &mpsc::UnboundedSender<Frame>,
    conn_no: u64,
    id: u64,
    hello: Hello,
) -> Result<Peer, Refused> {
    if hello.version != PROTOCOL {
        return Err(Refused::Version {
            supported: PROTOCOL,
        });
    }
    let settings = &inner.settings;
    if !settings.tokens.is_empty() {
        let given = token_hash(&hello.token);
        if !settings.tokens.iter().any(|t| constant_time_eq(t, &given)) {
            return Err(Refused::Unauthorized);
        }
    }
    let mut state = ferry_core::sync::lock(&inner.state);
    let state = &mut *state;
    let welcome = |grants| Frame {
        id,
        body: Body::Welcome(Welcome {
            version: PROTOCOL,
            session: hello.session,
            shards: settings.shards,
            lease_ms: settings.lease.as_millis() as u32,
            ping_ms: settings.ping_every.as_millis() as u32,
            stuck_ms: settings.stuck_after.as_millis() as u32,
            record_max: settings.record_max,
            grants,
        }),
    };
    if hello.role == Role::Client {
        let _ = tx.send(welcome(Vec::new()));
        return Ok(Peer::Client);
    }
    // A reconnect replaces the session's old connection (which is closed); a Hello on
    // a connection older than the session's current one is stale.
    if let Some((n, old)) = state.conns.get(&hello.session) {
        if *n > conn_no {
            return Err(Refused::Malformed {
                what: "a Hello on a connection older than this session's current one".into(),
            });
        }
        let _ = old.send(refused(
            0,
            Refused::Malformed {
                what: "this session connected again: this connection is replaced".into(),
            },
        ));
    }
    state.conns.insert(hello.session, (conn_no, tx.clone()));
    // Answers to calls sent on the old connection may never come: they go again.
    unsend(state, hello.session);
    state.names.insert(hello.session, hello.name.clone());
    // A shard whose acknowledged records the server no longer has durable is not
    // resumed: that would build on a hole (the server lost what it acknowledged, which
    // only a restore from an older copy does).
    let resume: Vec<(u32, u64)> = hello
        .resume
        .iter()
        .filter(|r| {
            let ok = r.shard < settings.shards && r.acked <= state.store.durable(r.shard);
            if !ok && r.shard < settings.shards {
                tracing::error!(
                    shard = r.shard,
                    acknowledged = r.acked,
                    durable = state.store.durable(r.shard),
                    "ferry flow server: a worker resumes past what this server holds durably; \
                     was the server's directory restored from an older copy?"
                );
            }
            ok
        })
        .map(|r| (r.shard, r.epoch))
        .collect();
    let actions = state
        .table
        .connect(hello.session, hello.max_shards, &resume, Instant::now());
    let resumed: Vec<Granted> = actions
        .iter()
        .filter_map(|a| match *a {
            Action::Resumed { shard, epoch, .. } => Some(Granted {
                shard,
                epoch,
                checkpoint: 0,
                end: state.store.durable(shard),
            }),
            _ => None,
        })
        .collect();
    let _ = tx.send(welcome(resumed));
    carry_out(inner, state, actions);
    tracing::info!(session = %session_tag(hello.session), name = %hello.name, max_shards = hello.max_shards, "ferry flow server: a worker connected");
    Ok(Peer::Worker(hello.session))
}

/// One frame from a session that said hello; its answer, if it has one now.
fn handle(
    inner: &Inner,
    tx: &mpsc::UnboundedSender<Frame>,
    session: SessionId,
    conn_no: u64,
    id: u64,
    body: Body,
) -> Option<Frame> {
    let mut state = ferry_core::sync::lock(&inner.state);
    let state = &mut *state;
    // A connection its session replaced speaks no more.
    if state.conns.get(&session).is_none_or(|(n, _)| *n != conn_no) {
        return Some(refused(
            id,
            Refused::Malformed {
                what: "this connection was replaced by a newer one of its session".into(),
            },
        ));
    }
    let now = Instant::now();
    let answer = |body| Some(Frame { id, body });
    match body {
        Body::Ping(turns) => {
            let turns: Vec<(u32, u64, u64)> =
                turns.iter().map(|t| (t.shard, t.epoch, t.turns)).collect();
            let held = state.table.ping(session, &turns, now);
            answer(Body::Pong(held))
        }
        Body::Append(a) => {
            if let Err(r) = state.table.check(session, a.shard, a.epoch) {
                return Some(refused(id, r));
            }
            if state.failed {
                return Some(refused(
                    id,
                    Refused::Unavailable {
                        retry_after_ms: 1000,
                    },
                ));
            }
            if a.records
                .iter()
                .any(|r| r.bytes.len() + 1 > inner.settings.record_max as usize)
            {
                return Some(refused(
                    id,
                    Refused::TooLarge {
                        limit: u64::from(inner.settings.record_max),
                    },
                ));
            }
            let count = a.records.len() as u64;
            let before = state.store.end(a.shard);
            let appended = state.store.append(a.shard, a.epoch, a.first, &a.records);
            // A reply from a worker the last round acknowledged, whatever it held: once
            // it is in the log, the writer need not wait for it.
            replied(inner, state, session);
            let new = state.store.end(a.shard) - before;
            if new > 0 {
                let skip = (before - a.first) as usize;
                let mut index = ferry_core::sync::lock(&inner.index);
                for (i, r) in a.records[skip..skip + new as usize].iter().enumerate() {
                    index.appended(a.shard, before + i as u64 + 1, r.kind, &r.bytes);
                }
            }
            inner.counts.records.fetch_add(new, Relaxed);
            inner
                .counts
                .records_again
                .fetch_add(count.saturating_sub(new), Relaxed);
            match appended {
                Ok(Some(_)) => {
                    inner.appended.notify_one();
                    None
                }
                // Every record was there already: acknowledge what of it is durable now;
                // the rest is acknowledged when the sync that covers it comes.
                Ok(None) => {
                    let durable = state.store.durable(a.shard);
                    (durable >= a.first + count && count > 0).then(|| Frame {
                        id: 0,
                        body: Body::Durable(vec![ShardPos {
                            shard: a.shard,
                            epoch: a.epoch,
                            position: durable,
                        }]),
                    })
                }
                Err(AppendError::Refused(r)) => Some(refused(id, r)),
                Err(AppendError::Log(e)) => {
                    tracing::error!(error = %e, "ferry flow server: the log failed; the server stops, and recovers when started again");
                    state.failed = true;
                    let _ = inner.stop.send(true);
                    Some(refused(
                        id,
                        Refused::Unavailable {
                            retry_after_ms: 1000,
                        },
                    ))
                }
            }
        }
        Body::Release { shard, epoch, end } => {
            if let Err(r) = state.table.check(session, shard, epoch) {
                return Some(refused(id, r));
            }
            // Everything up to `end` must be here: a worker releases only what it has
            // seen acknowledged.
            if state.store.end(shard) < end {
                return Some(refused(
                    id,
                    Refused::PositionGap {
                        shard,
                        expected: state.store.end(shard),
                    },
                ));
            }
            match state.table.release(session, shard, epoch, now) {
                Ok(actions) => {
                    inner.counts.releases.fetch_add(1, Relaxed);
                    carry_out(inner, state, actions);
                    answer(Body::Released { shard, epoch })
                }
                Err(r) => Some(refused(id, r)),
            }
        }
        Body::Recover {
            shard,
            epoch,
            from,
            max_bytes,
        } => {
            if let Err(r) = state.table.check(session, shard, epoch) {
                return Some(refused(id, r));
            }
            // Read without the lock (a page is up to 1 MiB, and the read passes other
            // shards' records): every other connection's pings and appends go on.
            let page = state.store.page(shard, from);
            let tx = tx.clone();
            tokio::task::spawn_blocking(move || {
                let answer = match page.read(max_bytes.clamp(1, PAGE_MAX)) {
                    Ok((records, last)) => Frame {
                        id,
                        body: Body::Records(proto::Records {
                            shard,
                            epoch,
                            first: from,
                            records,
                            last,
                        }),
                    },
                    Err(e) => {
                        tracing::error!(error = %e, shard, "ferry flow server: a shard's records could not be read");
                        refused(
                            id,
                            Refused::Unavailable {
                                retry_after_ms: 1000,
                            },
                        )
                    }
                };
                let _ = tx.send(answer);
            });
            None
        }
        Body::Answer { call, outcome } => {
            answered(state, session, call, outcome, now, inner.settings.call_wait);
            None
        }
        Body::Hello(_) => Some(refused(
            id,
            Refused::Malformed {
                what: "a second Hello on one connection".into(),
            },
        )),
        // Frames only the server sends.
        _ => Some(refused(
            id,
            Refused::Malformed {
                what: "a frame only the server sends".into(),
            },
        )),
    }
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
