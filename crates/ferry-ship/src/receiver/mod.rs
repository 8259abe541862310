//! The receiver: one replica per database name in a directory, kept at the position the
//! shipper last had acknowledged (docs/ship.md §4).
//!
//! Every operation on a name runs under that name's mutex and its cross-process flock
//! (`.ferry/NAME.lock`, which `ferry promote` also takes), and first re-reads the position
//! record, so a promotion by another process is seen before anything is written.
//!
//! A request is validated in full (body, token, epoch, generation, page size) before
//! anything is applied; then complete transactions are applied in groups, each one
//! replica transaction with its intent recorded first (see [`replica`]).

pub mod replica;
pub mod server;
pub mod state;

use crate::proto::{self, BaseHeader, Code, Position, Refusal, TxnsQuery};
use ferry_core::epoch::{Epoch, Fence};
use ferry_core::fs::DirLock;
use ferry_core::metrics::{Exposition, Histogram};
use ferry_core::{Class, Classify};
use replica::{Group, Replica, ReplicaError, Src};
use state::{FLAG_HAS_REPLICA, FLAG_PROMOTED, Intent, Pos, Record, StateFile, Witness};
use std::collections::{BTreeMap, HashMap};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::Instant;

pub use crate::proto::BODY_BYTES_MAX;
/// Default largest base.
pub const BASE_BYTES_MAX: u64 = 64 << 30;
/// How a receiver is set up. Checked by [`Receiver::open`].
#[derive(Clone, Debug)]
pub struct ReceiverConfig {
    pub dir: PathBuf,
    /// Bearer token every request must carry, if set.
    pub token: Option<String>,
    pub max_body_bytes: u64,
    pub max_base_bytes: u64,
    /// Run `PRAGMA quick_check` on every base before installing it.
    pub base_quick_check: bool,
}

impl ReceiverConfig {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        ReceiverConfig {
            dir: dir.into(),
            token: None,
            max_body_bytes: BODY_BYTES_MAX,
            max_base_bytes: BASE_BYTES_MAX,
            base_quick_check: true,
        }
    }
}

/// A refusal to send back: an HTTP status and its JSON body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused(pub Refusal);

impl Refused {
    pub fn new(code: Code, error: impl Into<String>) -> Self {
        Refused(Refusal {
            error: error.into(),
            code,
            position: None,
        })
    }
    fn at(mut self, pos: Position) -> Self {
        self.0.position = Some(pos);
        self
    }
    pub fn status(&self) -> u16 {
        status_of(self.0.code)
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.error)
    }
}

impl std::error::Error for Refused {}

impl Classify for Refused {
    fn class(&self) -> Class {
        match self.0.code {
            Code::Busy | Code::StorageFull | Code::Internal => Class::Transient,
            Code::Corrupt => Class::Corrupted,
            _ => Class::Permanent,
        }
    }
}

/// The HTTP status of each refusal code.
pub fn status_of(code: Code) -> u16 {
    match code {
        Code::Fenced | Code::NeedsBase | Code::Behind => 409,
        Code::BadRequest | Code::Corrupt => 400,
        Code::TooLarge => 413,
        Code::Unauthorized => 401,
        Code::NotFound => 404,
        Code::Busy => 503,
        Code::StorageFull => 507,
        Code::Internal => 500,
    }
}

/// The receiver.
pub struct Receiver {
    config: ReceiverConfig,
    ferry_dir: PathBuf,
    _lock: DirLock,
    slots: Mutex<HashMap<String, Arc<Mutex<Slot>>>>,
    /// Bulk checkpoints for the checkpointer thread (see [`Receiver::checkpoint_step`]), and
    /// the other end until the thread takes it.
    bulk_tx: mpsc::Sender<BulkJob>,
    bulk_rx: Mutex<Option<mpsc::Receiver<BulkJob>>>,
    pub(crate) apply_latency: Histogram,
    started: Instant,
    requests_refused: AtomicU64,
}

impl Receiver {
    /// Open (creating if needed) the receiver directory, lock it, check SQLite, and
    /// recover every replica found there.
    pub fn open(config: ReceiverConfig) -> Result<Arc<Receiver>, String> {
        crate::sqlite::check_library()?;
        crate::sqlite::check_dbpage(
            &rusqlite::Connection::open_in_memory().map_err(|e| e.to_string())?,
        )?;
        if config.max_body_bytes < proto::BATCH_BYTES_MAX as u64 * 2 {
            return Err(format!(
                "--max-body-bytes {} is below twice the shipper's batch size ({} bytes): shippers would be refused",
                config.max_body_bytes,
                proto::BATCH_BYTES_MAX
            ));
        }
        let ferry_dir = config.dir.join(".ferry");
        std::fs::create_dir_all(&ferry_dir).map_err(|e| {
            format!(
                "cannot create the receiver directory {}: {e}",
                ferry_dir.display()
            )
        })?;
        let lock = DirLock::try_acquire(&ferry_dir.join("receiver.lock"), "another ferry receiver")
            .map_err(|e| e.to_string())?;
        let (bulk_tx, bulk_rx) = mpsc::channel();
        let receiver = Arc::new(Receiver {
            config,
            ferry_dir,
            _lock: lock,
            slots: Mutex::new(HashMap::new()),
            bulk_tx,
            bulk_rx: Mutex::new(Some(bulk_rx)),
            apply_latency: Histogram::latency(),
            started: Instant::now(),
            requests_refused: AtomicU64::new(0),
        });
        for name in receiver.names_on_disk() {
            let slot = receiver.slot(&name, false).map_err(|e| e.to_string())?;
            if let Some(slot) = slot {
                let mut s = lock_slot(&slot);
                match s.sync() {
                    Ok(_flock) => receiver.checkpoint_step(&mut s),
                    Err(e) => {
                        tracing::error!(db = %name, error = %e, "replica not usable until fixed");
                        s.stats.last_error = Some(e.to_string());
                    }
                }
            }
        }
        Ok(receiver)
    }

    pub fn config(&self) -> &ReceiverConfig {
        &self.config
    }

    /// Start the background checkpointer; it stops when the receiver is dropped. Without
    /// it, replicas are never checkpointed.
    pub fn start_checkpointer(self: &Arc<Self>) {
        let Some(rx) = self.bulk_rx.lock().expect("checkpointer lock").take() else {
            return;
        };
        std::thread::Builder::new()
            .name("ferry-ckpt".into())
            .spawn(move || {
                // Ends when the receiver, and with it the sender, is dropped.
                for (path, bulk) in rx {
                    let outcome =
                        replica::open_for_checkpoints(&path).and_then(|c| replica::checkpoint(&c));
                    match outcome {
                        Ok((log, done)) => {
                            tracing::debug!(db = %path.display(), log, done, "replica checkpoint, bulk");
                            bulk.store(BULK_DONE, Ordering::Release);
                        }
                        Err(e) => {
                            tracing::warn!(db = %path.display(), error = %e, "replica checkpoint failed");
                            bulk.store(BULK_IDLE, Ordering::Release);
                        }
                    }
                }
            })
            .expect("spawning a thread only fails when the process is out of resources");
    }

    /// After a write to `s`'s replica: checkpoint it if due, in two halves, so that its
    /// WAL restarts from the start instead of growing for as long as transactions keep
    /// arriving.
    ///
    /// SQLite restarts a WAL only when a writer begins with every frame checkpointed. A
    /// checkpoint beside a stream of groups never ends there: some always commit while it
    /// runs. So the bulk is handed to the checkpointer thread, which copies it on a
    /// connection of its own while groups go on applying, and once it is done the next
    /// call, between two groups, copies on the applying connection the few frames
    /// committed meanwhile (`Replica::checkpoint_tail`). The next group then restarts the
    /// WAL, and the WAL file keeps its size, its frames rewritten in place.
    fn checkpoint_step(&self, s: &mut Slot) {
        let Some(r) = s.replica.as_mut() else {
            return;
        };
        if !r.checkpoint_due() {
            return;
        }
        match s.bulk.load(Ordering::Acquire) {
            BULK_IDLE => {
                s.bulk.store(BULK_QUEUED, Ordering::Release);
                let job = (s.paths.replica.clone(), s.bulk.clone());
                if self.bulk_tx.send(job).is_err() {
                    s.bulk.store(BULK_IDLE, Ordering::Release);
                }
            }
            BULK_DONE => {
                s.bulk.store(BULK_IDLE, Ordering::Release);
                match r.checkpoint_tail() {
                    Ok((log, done)) => {
                        tracing::debug!(db = %s.name, log, done, "replica checkpoint, tail")
                    }
                    Err(e) => {
                        tracing::warn!(db = %s.name, error = %e, "replica checkpoint failed")
                    }
                }
            }
            _ => {}
        }
    }

    fn names_on_disk(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.ferry_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let f = e.file_name();
                let s = f.to_str()?;
                let name = s.strip_suffix(".state")?;
                crate::names::validate(name).ok()?;
                Some(name.to_string())
            })
            .collect();
        names.sort();
        names
    }

    fn slot(&self, name: &str, create: bool) -> Result<Option<Arc<Mutex<Slot>>>, Refused> {
        crate::names::validate(name).map_err(|e| Refused::new(Code::BadRequest, e))?;
        let mut slots = self.slots.lock().expect("slot map lock");
        if let Some(s) = slots.get(name) {
            return Ok(Some(s.clone()));
        }
        let paths = Paths::new(&self.config.dir, name);
        if !create && !paths.state.exists() {
            return Ok(None);
        }
        let slot = Arc::new(Mutex::new(Slot::new(name, paths)));
        slots.insert(name.to_string(), slot.clone());
        Ok(Some(slot))
    }

    /// Where a replica stands, or None if the receiver has never heard of it.
    pub fn position(&self, name: &str) -> Result<Option<Position>, Refused> {
        let Some(slot) = self.slot(name, false)? else {
            return Ok(None);
        };
        let mut s = lock_slot(&slot);
        let _flock = s.sync().map_err(|e| self.refused(e))?;
        Ok(Some(s.position()))
    }

    /// Every replica this receiver holds or fences.
    pub fn list(&self) -> Vec<Position> {
        let names = self.names_on_disk();
        names
            .iter()
            .filter_map(|n| self.position(n).ok().flatten())
            .collect()
    }

    /// `POST …/txns`: apply what follows the replica's position (docs/ship.md §4.4).
    pub fn apply_txns(&self, name: &str, q: TxnsQuery, body: &[u8]) -> Result<Position, Refused> {
        let result = self.apply_txns_inner(name, q, body);
        if let Err(e) = &result {
            self.note_refusal(name, e);
        }
        result
    }

    fn apply_txns_inner(&self, name: &str, q: TxnsQuery, body: &[u8]) -> Result<Position, Refused> {
        let Some(slot) = self.slot(name, false)? else {
            return Err(Refused::new(
                Code::NeedsBase,
                format!("there is no replica of {name} here yet: send a base"),
            ));
        };
        let mut s = lock_slot(&slot);
        let _flock = s.sync().map_err(|e| self.refused(e))?;
        // Admission first: a body framed for another page size would only fail to parse.
        s.admit(Epoch(q.epoch), q.generation, Some(q.page_size))?;
        let records = proto::decode_records(body, q.page_size).map_err(|e| {
            let code = match e {
                proto::BodyError::Crc { .. } | proto::BodyError::Truncated { .. } => Code::Corrupt,
                _ => Code::BadRequest,
            };
            Refused::new(code, format!("{name}: {e}"))
        })?;
        let started = Instant::now();
        let outcome = s.apply_records(&records);
        if outcome.is_ok() {
            self.apply_latency.observe(started.elapsed());
        }
        outcome.map_err(|e| self.refused(e))?;
        self.checkpoint_step(&mut s);
        Ok(s.position())
    }

    /// `POST …/base`: install a streamed base (docs/ship.md §4.5). `body` yields the
    /// whole stream, header included.
    pub fn apply_base(
        &self,
        name: &str,
        epoch: Epoch,
        generation: u64,
        body: &mut dyn Read,
    ) -> Result<Position, Refused> {
        let result = self.apply_base_inner(name, epoch, generation, body);
        if let Err(e) = &result {
            self.note_refusal(name, e);
        }
        result
    }

    fn apply_base_inner(
        &self,
        name: &str,
        epoch: Epoch,
        generation: u64,
        body: &mut dyn Read,
    ) -> Result<Position, Refused> {
        crate::names::validate(name).map_err(|e| Refused::new(Code::BadRequest, e))?;
        let mut hb = [0u8; proto::BASE_HEADER_BYTES];
        body.read_exact(&mut hb).map_err(|_| {
            Refused::new(
                Code::Corrupt,
                format!("{name}: the base ended inside its header"),
            )
        })?;
        let header = BaseHeader::decode(&hb)
            .map_err(|e| Refused::new(Code::Corrupt, format!("{name}: {e}")))?;
        if header.epoch != epoch || header.generation != generation {
            return Err(Refused::new(
                Code::BadRequest,
                format!("{name}: the base header's epoch/generation differ from the request's"),
            ));
        }
        self.check_base_size(name, header.page_count as u64 * header.page_size as u64)?;
        let slot = self.slot(name, true)?.expect("created on demand");
        let mut s = lock_slot(&slot);
        let _flock = s.sync().map_err(|e| self.refused(e))?;
        match Fence::check(epoch, s.pos.epoch) {
            Fence::Stale { held } => return Err(s.fenced(epoch, held)),
            Fence::Current | Fence::Newer { .. } => {}
        }
        s.install_base(body, &header, self.config.base_quick_check)
            .map_err(|e| self.refused(e))?;
        self.checkpoint_step(&mut s);
        Ok(s.position())
    }

    /// Refuse a base larger than allowed, before reading it.
    pub fn check_base_size(&self, name: &str, bytes: u64) -> Result<(), Refused> {
        if bytes > self.config.max_base_bytes {
            return Err(Refused::new(
                Code::TooLarge,
                format!(
                    "{name}: the base is {bytes} bytes, over this receiver's limit of {} (raise --max-base-bytes)",
                    self.config.max_base_bytes
                ),
            ));
        }
        Ok(())
    }

    /// `DELETE …`: drop a replica (the name stays fenced at its epoch).
    pub fn delete(&self, name: &str, epoch: Epoch) -> Result<bool, Refused> {
        let Some(slot) = self.slot(name, false)? else {
            return Ok(false);
        };
        let mut s = lock_slot(&slot);
        let _flock = s.sync().map_err(|e| self.refused(e))?;
        if let Fence::Stale { held } = Fence::check(epoch, s.pos.epoch) {
            return Err(s.fenced(epoch, held));
        }
        let had = s.pos.has_replica();
        s.drop_replica().map_err(|e| self.refused(e))?;
        Ok(had)
    }

    fn refused(&self, e: SlotError) -> Refused {
        e.into_refused()
    }

    fn note_refusal(&self, name: &str, e: &Refused) {
        self.requests_refused.fetch_add(1, Ordering::Relaxed);
        if let Ok(Some(slot)) = self.slot(name, false) {
            let mut s = lock_slot(&slot);
            s.stats.refusals += 1;
            if !matches!(e.0.code, Code::Behind) {
                s.stats.last_error = Some(e.0.error.clone());
            }
        }
        match e.0.code {
            Code::Behind | Code::NeedsBase => {
                tracing::debug!(db = name, code = ?e.0.code, "{}", e.0.error)
            }
            _ => tracing::warn!(db = name, code = ?e.0.code, "{}", e.0.error),
        }
    }

    /// Status of every replica.
    pub fn status(&self) -> ReceiverStatus {
        let mut replicas = Vec::new();
        for name in self.names_on_disk() {
            let Ok(Some(slot)) = self.slot(&name, false) else {
                continue;
            };
            let mut s = lock_slot(&slot);
            let flock = s.sync();
            if let Err(e) = &flock {
                s.stats.last_error = Some(e.to_string());
            }
            replicas.push(s.status());
        }
        ReceiverStatus {
            dir: self.config.dir.display().to_string(),
            uptime_secs: self.started.elapsed().as_secs(),
            replicas,
        }
    }

    /// Prometheus text.
    pub fn metrics(&self) -> String {
        let status = self.status();
        let mut e = Exposition::new();
        for r in &status.replicas {
            e.gauge(
                "ferry_receive_seq",
                "Last applied transaction of the generation.",
                &[("db", &r.name)],
                r.seq as f64,
            );
        }
        for r in &status.replicas {
            e.gauge(
                "ferry_receive_epoch",
                "Fencing epoch of the replica.",
                &[("db", &r.name)],
                r.epoch.0 as f64,
            );
        }
        for r in &status.replicas {
            e.counter(
                "ferry_receive_transactions_total",
                "Transactions applied.",
                &[("db", &r.name)],
                r.transactions,
            );
        }
        for r in &status.replicas {
            e.counter(
                "ferry_receive_page_bytes_total",
                "Page bytes applied.",
                &[("db", &r.name)],
                r.page_bytes,
            );
        }
        for r in &status.replicas {
            e.counter(
                "ferry_receive_bases_total",
                "Bases installed.",
                &[("db", &r.name)],
                r.bases,
            );
        }
        for r in &status.replicas {
            e.counter(
                "ferry_receive_refusals_total",
                "Requests refused.",
                &[("db", &r.name)],
                r.refusals,
            );
        }
        for r in &status.replicas {
            e.gauge(
                "ferry_receive_lag_seconds",
                "Time from the shipper seeing the last applied commit to its apply (clocks of two machines).",
                &[("db", &r.name)],
                r.lag_ms.unwrap_or(0) as f64 / 1000.0,
            );
        }
        e.histogram(
            "ferry_receive_apply_seconds",
            "Time to apply one txns request.",
            &[],
            &self.apply_latency,
        );
        e.finish()
    }
}

/// Receiver status, for `GET /status` and `ferry receive status`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ReceiverStatus {
    pub dir: String,
    pub uptime_secs: u64,
    pub replicas: Vec<ReplicaStatus>,
}

/// One replica's status.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ReplicaStatus {
    pub name: String,
    pub epoch: Epoch,
    pub generation: u64,
    pub seq: u64,
    pub page_size: u32,
    pub pages: u32,
    pub bytes: u64,
    pub promoted: bool,
    pub has_replica: bool,
    pub pending_part: u32,
    pub transactions: u64,
    pub page_bytes: u64,
    pub bases: u64,
    pub refusals: u64,
    /// Wall-clock ms of the last apply.
    pub last_apply_ms: Option<u64>,
    /// Shipper-observed commit time to apply time of the last applied transaction.
    pub lag_ms: Option<u64>,
    pub last_error: Option<String>,
}

/// Paths of one name.
#[derive(Clone, Debug)]
pub struct Paths {
    pub replica: PathBuf,
    pub state: PathBuf,
    pub lock: PathBuf,
    pub spool: PathBuf,
    pub base: PathBuf,
    pub attic: PathBuf,
}

impl Paths {
    pub fn new(dir: &Path, name: &str) -> Paths {
        let f = dir.join(".ferry");
        Paths {
            replica: dir.join(format!("{name}.db")),
            state: f.join(format!("{name}.state")),
            lock: f.join(format!("{name}.lock")),
            spool: f.join(format!("{name}.spool")),
            base: f.join(format!("{name}.base")),
            attic: f.join(format!("{name}.attic")),
        }
    }
}

/// Why an operation on a slot failed.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("{0}")]
    Refused(Refused),
    #[error("{name}: {source}")]
    Replica { name: String, source: ReplicaError },
    #[error("{name}: {what}: {source}")]
    Io {
        name: String,
        what: &'static str,
        source: io::Error,
    },
    #[error(
        "{name}: the replica was changed by something other than ferry (its witness page matches neither \
         side of the last transaction); it cannot be trusted. Move {path} away and let the shipper send a base"
    )]
    Foreign { name: String, path: String },
}

impl SlotError {
    fn into_refused(self) -> Refused {
        match self {
            SlotError::Refused(r) => r,
            SlotError::Replica {
                name,
                source: ReplicaError::Invalid(what),
            } => Refused::new(
                Code::BadRequest,
                format!("{name}: {what}; the replica is unchanged"),
            ),
            SlotError::Replica {
                name,
                source: ReplicaError::Sqlite(e),
            } => sqlite_refusal(&name, &e),
            SlotError::Replica {
                name,
                source: ReplicaError::Io(e) | ReplicaError::State(e),
            }
            | SlotError::Io {
                name, source: e, ..
            } => {
                if e.kind() == io::ErrorKind::StorageFull {
                    Refused::new(
                        Code::StorageFull,
                        format!(
                            "{name}: the receiver's disk is full ({e}); free space, it retries"
                        ),
                    )
                } else {
                    Refused::new(
                        Code::Internal,
                        format!("{name}: I/O error on the receiver: {e}"),
                    )
                }
            }
            e @ SlotError::Foreign { .. } => Refused::new(Code::Internal, e.to_string()),
        }
    }
}

impl Classify for SlotError {
    fn class(&self) -> Class {
        match self {
            SlotError::Refused(r) => r.class(),
            SlotError::Replica {
                source: ReplicaError::Invalid(_),
                ..
            } => Class::Permanent,
            SlotError::Replica {
                name,
                source: ReplicaError::Sqlite(e),
            } => sqlite_refusal(name, e).class(),
            SlotError::Replica {
                source: ReplicaError::Io(e) | ReplicaError::State(e),
                ..
            }
            | SlotError::Io { source: e, .. } => e.class(),
            SlotError::Foreign { .. } => Class::Corrupted,
        }
    }
}

fn sqlite_refusal(name: &str, e: &rusqlite::Error) -> Refused {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DiskFull) => Refused::new(
            Code::StorageFull,
            format!("{name}: the receiver's disk is full ({e}); free space, it retries"),
        ),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
            Refused::new(
                Code::Busy,
                format!("{name}: the replica is locked ({e}); retry"),
            )
        }
        _ => Refused::new(
            Code::Internal,
            format!("{name}: SQLite error on the replica: {e}"),
        ),
    }
}

/// Two WAL checksums name the same history, or one of them is unknown (0).
fn same_history(a: u64, b: u64) -> bool {
    a == 0 || b == 0 || a == b
}

fn lock_slot(slot: &Mutex<Slot>) -> MutexGuard<'_, Slot> {
    // A panic while holding a slot can only come from a broken internal invariant; the
    // slot is re-synced from disk before use anyway, so carrying on is sound.
    slot.lock().unwrap_or_else(|p| p.into_inner())
}

/// One name: its position record, its replica, a transaction being received in parts.
pub struct Slot {
    name: String,
    paths: Paths,
    /// None after a failed write: nothing may be written until it is reopened and the
    /// replica recovered.
    state: Option<StateFile>,
    /// The committed position (recovered).
    pos: Pos,
    replica: Option<Replica>,
    pending: Option<Pending>,
    stats: Stats,
    /// Where the bulk half of the replica's checkpoint stands: `BULK_*`.
    bulk: Arc<AtomicU8>,
    /// Recovery decided the group behind this witness had not committed but could not yet
    /// make that final (`Replica::settle`: its commit failed, on a full disk say). Until it
    /// is, `replica` stays open, which keeps SQLite from rebuilding the replica's index
    /// and so the group invisible, and the group's intent stays the newest record, so a
    /// restart decides again from the replica itself. Every write settles it first
    /// (`settle_decision`): a record written over that intent would make the decision
    /// final without the commit that keeps the group out.
    unsettled: Option<Witness>,
}

/// A replica to checkpoint, and its slot's `bulk`.
type BulkJob = (PathBuf, Arc<AtomicU8>);

const BULK_IDLE: u8 = 0;
const BULK_QUEUED: u8 = 1;
const BULK_DONE: u8 = 2;

#[derive(Default)]
struct Stats {
    transactions: u64,
    page_bytes: u64,
    bases: u64,
    refusals: u64,
    last_apply_ms: Option<u64>,
    last_observed_ms: Option<u64>,
    last_error: Option<String>,
}

/// A transaction arriving in parts, spooled to a file (not durable: the shipper resends
/// from part 0 after a receiver restart).
struct Pending {
    seq: u64,
    next_part: u32,
    file: std::fs::File,
    /// Last image of each page so far: offset in the spool.
    index: BTreeMap<u32, u64>,
    len: u64,
    observed_ms: u64,
}

/// A transaction ready to apply.
struct Ready<'a> {
    seq: u64,
    commit_pages: u32,
    pages: Vec<(u32, Src<'a>)>,
    bytes: u64,
    observed_ms: u64,
    wal_checksum: u64,
}

impl Slot {
    pub fn new(name: &str, paths: Paths) -> Slot {
        Slot {
            name: name.to_string(),
            paths,
            state: None,
            pos: Pos::default(),
            replica: None,
            pending: None,
            stats: Stats::default(),
            bulk: Arc::default(),
            unsettled: None,
        }
    }

    /// Take the name's flock and bring the in-memory view up to date with disk: (re)open
    /// the position record and recover if another process wrote it, or if a failure left
    /// it closed. The returned lock must be held for the whole operation.
    pub fn sync(&mut self) -> Result<DirLock, SlotError> {
        let io = |what, source| SlotError::Io {
            name: self.name.clone(),
            what,
            source,
        };
        let flock = DirLock::acquire(&self.paths.lock).map_err(|e| match e {
            ferry_core::fs::LockError::Io { source, .. } => io("locking", source),
            held => io("locking", io::Error::other(held.to_string())),
        })?;
        let (file, record) =
            StateFile::open(&self.paths.state).map_err(|e| io("opening the position record", e))?;
        let fresh = self
            .state
            .as_ref()
            .is_none_or(|mine| mine.counter() != file.counter());
        if fresh {
            self.replica = None;
            self.pending = None;
            let _ = std::fs::remove_file(&self.paths.spool);
            self.state = Some(file);
            if let Err(e) = self.recover(record.unwrap_or_default()) {
                // Recover again next time rather than serve a guess.
                self.state = None;
                return Err(e);
            }
        }
        Ok(flock)
    }

    /// Decide where the replica stands after `record` (docs/ship.md §4.3), and leave a
    /// clean record behind.
    fn recover(&mut self, record: Record) -> Result<(), SlotError> {
        if let Intent::Replace { ino, .. } = record.intent {
            self.undo_half_swap(ino)?;
        }
        let _ = replica::remove_with_sidecars(&self.paths.base);
        let _ = std::fs::remove_dir_all(&self.paths.attic);
        self.unsettled = None;
        // The replica recovery decided from, kept open when its decision is not final.
        let mut kept = None;
        let mut pos = match record.intent {
            Intent::None => record.pos,
            Intent::Group { pre, witness } => {
                let mut r = self.open_replica_at(&record.pos)?;
                let decided = match r.as_mut() {
                    None => None,
                    Some(r) => match r.settle(&witness) {
                        Ok(decided) => decided,
                        Err(e) => {
                            let decided = r.resolve(&witness).map_err(|e| self.replica_err(e))?;
                            if decided == Some(false) {
                                tracing::warn!(db = %self.name, error = %e, "recovered, but the decision that the last transaction had not committed is not final yet: nothing is written until it is");
                                self.unsettled = Some(witness);
                            }
                            decided
                        }
                    },
                };
                match decided {
                    Some(true) => record.pos,
                    Some(false) => {
                        if self.unsettled.is_some() {
                            kept = r.take();
                        }
                        pre
                    }
                    None if r.is_none() => pre,
                    None => {
                        drop(r);
                        let err = SlotError::Foreign {
                            name: self.name.clone(),
                            path: self.paths.replica.display().to_string(),
                        };
                        let aside = self.set_aside()?;
                        tracing::error!(db = %self.name, kept = %aside.display(), "{err}; set aside, the shipper will send a base");
                        self.stats.last_error =
                            Some(format!("{err} (set aside as {})", aside.display()));
                        Pos {
                            generation: 0,
                            seq: 0,
                            flags: record.pos.flags & !FLAG_HAS_REPLICA,
                            ..record.pos
                        }
                    }
                }
            }
            Intent::Replace { pre, ino } => {
                let now = std::fs::metadata(&self.paths.replica).map(|m| m.ino()).ok();
                if now == Some(ino) { record.pos } else { pre }
            }
        };
        if record.intent != Intent::None {
            // Which page decided, and its sizes: what to look at if a decision is ever
            // doubted (a reader that saw the group, say).
            let (pgno, size_pre, size_post) = match record.intent {
                Intent::Group { witness: w, .. } => (w.pgno, w.size_pre, w.size_post),
                _ => (0, 0, 0),
            };
            tracing::info!(
                db = %self.name,
                seq = pos.seq,
                last = record.pos.seq,
                committed = pos == record.pos,
                witness_page = pgno,
                size_pre,
                size_post,
                "recovered: the last transaction {} before the stop",
                if pos == record.pos { "had committed" } else { "had not committed" }
            );
        }
        if let Some(r) = kept {
            if r.page_size() == pos.page_size {
                self.pos = pos;
                self.replica = Some(r);
                self.stats.last_error = Some(format!(
                    "{}: recovered to seq {}, but the decision that the last transaction had \
                     not committed is not final yet (its commit failed); nothing is written until it is",
                    self.name, pos.seq
                ));
                return Ok(());
            }
            // Replaced behind ferry's back: the path below sets it aside, and the group
            // goes with it.
            self.unsettled = None;
        }
        if pos.has_replica() && !self.paths.replica.exists() {
            tracing::warn!(db = %self.name, "the replica file is gone; the shipper will send a base");
            pos.flags &= !FLAG_HAS_REPLICA;
            pos.generation = 0;
            pos.seq = 0;
        }
        if record.intent != Intent::None || pos != record.pos {
            self.write_state(Record {
                pos,
                intent: Intent::None,
            })?;
        }
        self.pos = pos;
        self.replica = None;
        if pos.has_replica() {
            let r = Replica::open(&self.paths.replica).map_err(|e| self.replica_err(e))?;
            if r.page_size() != pos.page_size {
                drop(r);
                let aside = self.set_aside()?;
                tracing::error!(db = %self.name, kept = %aside.display(), "the replica's page size is not the recorded one: it was replaced behind ferry's back; set aside, the shipper will send a base");
                let pos = Pos {
                    generation: 0,
                    seq: 0,
                    flags: pos.flags & !FLAG_HAS_REPLICA,
                    ..pos
                };
                self.write_state(Record {
                    pos,
                    intent: Intent::None,
                })?;
                self.pos = pos;
                return Ok(());
            }
            self.replica = Some(r);
        }
        Ok(())
    }

    /// A crash inside `swap_in` can leave the old replica in the attic and no new one in
    /// place: put the old one back, so the position before the base still holds.
    fn undo_half_swap(&self, new_ino: u64) -> Result<(), SlotError> {
        let now = std::fs::metadata(&self.paths.replica).map(|m| m.ino()).ok();
        let old = self.paths.attic.join("db");
        let _ = new_ino; // present: committed; the old inode: the swap never began
        if now.is_some() || !old.exists() {
            return Ok(());
        }
        let io = |source| SlotError::Io {
            name: self.name.clone(),
            what: "restoring the replica after a crash mid-base",
            source,
        };
        for (name, suffix) in [("db-wal", "-wal"), ("db-shm", "-shm"), ("db", "")] {
            let from = self.paths.attic.join(name);
            if from.exists() {
                std::fs::rename(&from, crate::names::sidecar(&self.paths.replica, suffix))
                    .map_err(io)?;
            }
        }
        tracing::warn!(db = %self.name, "put back the replica a crash left half swapped out");
        Ok(())
    }

    /// Move an untrusted replica out of the readers' way, keeping it for inspection.
    fn set_aside(&self) -> Result<PathBuf, SlotError> {
        let aside = self
            .paths
            .attic
            .with_extension(format!("untrusted-{}", ferry_core::seams::wall_ms()));
        std::fs::create_dir_all(&aside)
            .and_then(|_| {
                for suffix in ["", "-wal", "-shm"] {
                    let from = crate::names::sidecar(&self.paths.replica, suffix);
                    if from.exists() {
                        std::fs::rename(&from, aside.join(format!("{}.db{suffix}", self.name)))?;
                    }
                }
                Ok(())
            })
            .map_err(|e| SlotError::Io {
                name: self.name.clone(),
                what: "setting aside an untrusted replica",
                source: e,
            })?;
        Ok(aside)
    }

    fn open_replica_at(&self, pos: &Pos) -> Result<Option<Replica>, SlotError> {
        if !pos.has_replica() || !self.paths.replica.exists() {
            return Ok(None);
        }
        Replica::open(&self.paths.replica)
            .map(Some)
            .map_err(|e| self.replica_err(e))
    }

    fn replica_err(&self, source: ReplicaError) -> SlotError {
        SlotError::Replica {
            name: self.name.clone(),
            source,
        }
    }

    /// Make recovery's pending decision final (see `unsettled`), then write the clean
    /// record it could not write. Called before anything else is written.
    fn settle_decision(&mut self) -> Result<(), SlotError> {
        let Some(witness) = self.unsettled else {
            return Ok(());
        };
        let r = self
            .replica
            .as_mut()
            .expect("an unsettled decision keeps its replica open");
        match r.settle(&witness) {
            Ok(Some(false)) => {}
            Ok(_) => {
                // Not possible while this connection stayed open; decide again from disk.
                self.replica = None;
                self.state = None;
                return Err(SlotError::Io {
                    name: self.name.clone(),
                    what: "making recovery's decision final",
                    source: io::Error::other(
                        "the replica's witness page changed while the decision waited; recovering again",
                    ),
                });
            }
            Err(e) => return Err(self.replica_err(e)),
        }
        self.unsettled = None;
        self.stats.last_error = None;
        tracing::info!(db = %self.name, seq = self.pos.seq, "recovery's decision is final");
        self.write_state(Record {
            pos: self.pos,
            intent: Intent::None,
        })
    }

    fn write_state(&mut self, rec: Record) -> Result<(), SlotError> {
        assert!(
            self.unsettled.is_none(),
            "a record written over an unsettled decision: it would make the decision final without its commit"
        );
        let state = self
            .state
            .as_mut()
            .expect("sync() opens the state file before any write");
        if let Err(e) = state.write(&rec) {
            self.state = None;
            self.replica = None;
            return Err(SlotError::Io {
                name: self.name.clone(),
                what: "writing the position record",
                source: e,
            });
        }
        Ok(())
    }

    pub fn position(&self) -> Position {
        Position {
            name: self.name.clone(),
            epoch: self.pos.epoch,
            generation: self.pos.generation,
            seq: self.pos.seq,
            pending_part: self.pending.as_ref().map_or(0, |p| p.next_part),
            page_size: self.pos.page_size,
            pages: self
                .replica
                .as_ref()
                .and_then(|r| r.page_count().ok())
                .unwrap_or(0),
            promoted: self.pos.promoted(),
            checksum: self.pos.checksum,
        }
    }

    fn fenced(&self, epoch: Epoch, held: Epoch) -> Refused {
        let why = if self.pos.promoted() {
            "the replica was promoted"
        } else {
            "a newer primary took over"
        };
        Refused::new(
            Code::Fenced,
            format!(
                "{}: epoch {epoch} is fenced: {why} at epoch {held}. This shipper's primary is stale; stop it. \
                 To ship from it again on purpose, start the shipper with --epoch {}",
                self.name,
                held.next()
            ),
        )
        .at(self.position())
    }

    /// The admission checks of docs/ship.md §4.4, steps 2 to 4.
    fn admit(&self, epoch: Epoch, generation: u64, page_size: Option<u32>) -> Result<(), Refused> {
        match Fence::check(epoch, self.pos.epoch) {
            Fence::Stale { held } => return Err(self.fenced(epoch, held)),
            Fence::Newer { held } => {
                return Err(Refused::new(
                    Code::NeedsBase,
                    format!(
                        "{}: epoch {epoch} is newer than the replica's {held}: send a base",
                        self.name
                    ),
                )
                .at(self.position()));
            }
            Fence::Current => {}
        }
        if !self.pos.has_replica() || self.replica.is_none() {
            return Err(Refused::new(
                Code::NeedsBase,
                format!("{}: there is no replica yet: send a base", self.name),
            )
            .at(self.position()));
        }
        if generation != self.pos.generation {
            return Err(Refused::new(
                Code::NeedsBase,
                format!(
                    "{}: generation {generation:#x} is not the replica's ({:#x}): send a base",
                    self.name, self.pos.generation
                ),
            )
            .at(self.position()));
        }
        if let Some(ps) = page_size
            && ps != self.pos.page_size
        {
            return Err(Refused::new(
                Code::NeedsBase,
                format!(
                    "{}: page size changed from {} to {ps}: send a base",
                    self.name, self.pos.page_size
                ),
            )
            .at(self.position()));
        }
        Ok(())
    }

    /// Apply what in `records` follows the position; spool parts; skip what is held.
    fn apply_records(&mut self, records: &[proto::Record<'_>]) -> Result<(), SlotError> {
        let mut ready: Vec<Ready<'_>> = Vec::new();
        let mut next_seq = self.pos.seq + 1;
        let mut accepted = 0;
        let mut gap = None;
        for r in records {
            let h = &r.header;
            let expected_part = match &self.pending {
                Some(p) if p.seq == next_seq => p.next_part,
                _ => 0,
            };
            if h.seq == self.pos.seq && h.last && !same_history(h.wal_checksum, self.pos.checksum) {
                // The shipper's transaction at our position is not the one we applied: its
                // primary's history forked (a lost tail rewritten). Nothing after it can
                // follow what we hold.
                return Err(SlotError::Refused(
                    Refused::new(
                        Code::NeedsBase,
                        format!(
                            "{}: transaction {} differs from the one applied here (WAL checksum {:#x}, not {:#x}): \
                             the primary's history forked; send a base",
                            self.name, h.seq, h.wal_checksum, self.pos.checksum
                        ),
                    )
                    .at(self.position()),
                ));
            }
            if h.seq < next_seq || (h.seq == next_seq && h.part < expected_part) {
                continue; // held already: a resend
            }
            if h.seq != next_seq || h.part != expected_part {
                gap = Some((h.seq, h.part));
                break;
            }
            accepted += 1;
            if h.part == 0 && h.last {
                ready.push(Ready {
                    seq: h.seq,
                    commit_pages: h.commit_pages,
                    bytes: r.pages.len() as u64 * self.pos.page_size as u64,
                    pages: r.pages.iter().map(|(n, d)| (*n, Src::Mem(d))).collect(),
                    observed_ms: h.observed_ms,
                    wal_checksum: h.wal_checksum,
                });
                next_seq += 1;
                continue;
            }
            if h.part == 0 && !ready.is_empty() {
                // A new transaction in parts replaces the spool: apply what is ready
                // first, since a finished transaction in parts reads its pages from it.
                self.apply_ready(std::mem::take(&mut ready))?;
            }
            self.spool(h, &r.pages)?;
            if h.last {
                let p = self.pending.as_ref().expect("spool() just created it");
                ready.push(Ready {
                    seq: h.seq,
                    commit_pages: h.commit_pages,
                    bytes: p.index.len() as u64 * self.pos.page_size as u64,
                    pages: p
                        .index
                        .iter()
                        .map(|(n, at)| (*n, Src::Spool(*at)))
                        .collect(),
                    observed_ms: p.observed_ms,
                    wal_checksum: h.wal_checksum,
                });
                next_seq += 1;
            }
        }
        if accepted == 0
            && let Some((seq, part)) = gap
        {
            return Err(SlotError::Refused(
                    Refused::new(
                        Code::Behind,
                        format!(
                            "{}: transaction {seq} part {part} does not follow the replica's position (seq {}); resume from it",
                            self.name, self.pos.seq
                        ),
                    )
                    .at(self.position()),
                ));
        }
        self.apply_ready(ready)
    }

    fn spool(&mut self, h: &proto::RecordHeader, pages: &[(u32, &[u8])]) -> Result<(), SlotError> {
        let result = self.spool_inner(h, pages);
        if let Err(source) = result {
            // The spool and its index no longer agree: drop it; the shipper resends the
            // transaction from part 0.
            self.pending = None;
            let _ = std::fs::remove_file(&self.paths.spool);
            return Err(SlotError::Io {
                name: self.name.clone(),
                what: "spooling a partial transaction",
                source,
            });
        }
        Ok(())
    }

    fn spool_inner(&mut self, h: &proto::RecordHeader, pages: &[(u32, &[u8])]) -> io::Result<()> {
        if h.part == 0 {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&self.paths.spool)?;
            self.pending = Some(Pending {
                seq: h.seq,
                next_part: 0,
                file,
                index: BTreeMap::new(),
                len: 0,
                observed_ms: h.observed_ms,
            });
        }
        let p = self
            .pending
            .as_mut()
            .expect("part 0 creates the pending transaction");
        // Positional writes; the index moves only past pages written.
        let mut at = p.len;
        let mut written = Vec::with_capacity(pages.len());
        for (pgno, data) in pages {
            p.file.write_all_at(data, at)?;
            written.push((*pgno, at));
            at += data.len() as u64;
        }
        p.index.extend(written);
        p.len = at;
        p.next_part += 1;
        Ok(())
    }

    /// Apply ready transactions in groups. A group ends after a transaction that shrinks
    /// the database, so a truncation is always the last act of its replica transaction.
    fn apply_ready(&mut self, ready: Vec<Ready<'_>>) -> Result<(), SlotError> {
        if !ready.is_empty() {
            self.settle_decision()?;
        }
        let mut size = match &self.replica {
            Some(r) => r.page_count().map_err(|e| self.replica_err(e.into()))?,
            None => return Ok(()),
        };
        let mut start = 0;
        while start < ready.len() {
            let mut end = start;
            let mut group = Group {
                pages: BTreeMap::new(),
                size,
            };
            let (mut txns, mut bytes) = (0u64, 0u64);
            while end < ready.len() {
                let t = &ready[end];
                for (pgno, src) in &t.pages {
                    group.pages.insert(*pgno, *src);
                }
                let shrinks = t.commit_pages < size;
                size = t.commit_pages;
                group.size = size;
                txns += 1;
                bytes += t.bytes;
                end += 1;
                if shrinks {
                    break;
                }
            }
            group.pages.retain(|pgno, _| *pgno <= group.size);
            let last = &ready[end - 1];
            let pre = self.pos;
            let post = Pos {
                seq: last.seq,
                checksum: last.wal_checksum,
                ..pre
            };
            let spool = self.pending.as_ref().map(|p| &p.file);
            let replica = self
                .replica
                .as_mut()
                .expect("admit() checked there is a replica");
            let state = self.state.as_mut().expect("sync() opened the state file");
            if let Err(e) = replica.apply(&group, spool, pre, post, state) {
                // Recover before the next write: after an error the intent record may be
                // on disk, and only the witness can say whether the group committed.
                self.replica = None;
                self.state = None;
                return Err(self.replica_err(e));
            }
            self.pos = post;
            self.stats.transactions += txns;
            self.stats.page_bytes += bytes;
            self.stats.last_apply_ms = Some(ferry_core::seams::wall_ms());
            self.stats.last_observed_ms = Some(last.observed_ms);
            if self.pending.as_ref().is_some_and(|p| p.seq <= post.seq) {
                self.pending = None;
                let _ = std::fs::remove_file(&self.paths.spool);
            }
            start = end;
        }
        Ok(())
    }

    /// Install a base: in place if the replica exists with the same page size, else by
    /// building a new file and swapping it in.
    fn install_base(
        &mut self,
        body: &mut dyn Read,
        header: &BaseHeader,
        quick_check: bool,
    ) -> Result<(), SlotError> {
        self.settle_decision()?;
        self.pending = None;
        let _ = std::fs::remove_file(&self.paths.spool);
        let pre = self.pos;
        let post = Pos {
            epoch: header.epoch,
            generation: header.generation,
            seq: 0,
            page_size: header.page_size,
            flags: FLAG_HAS_REPLICA,
            checksum: header.wal_checksum,
        };
        let ino = replica::build(&self.paths.base, body, header, quick_check).map_err(|e| {
            let _ = replica::remove_with_sidecars(&self.paths.base);
            self.replica_err(e)
        })?;
        let in_place = self
            .replica
            .as_ref()
            .is_some_and(|r| r.page_size() == header.page_size);
        if in_place {
            let replica = self.replica.as_mut().expect("checked above");
            let state = self.state.as_mut().expect("sync() opened the state file");
            let copied = replica.copy_from(&self.paths.base, pre, post, state);
            let _ = replica::remove_with_sidecars(&self.paths.base);
            if let Err(e) = copied {
                self.replica = None;
                self.state = None;
                return Err(self.replica_err(e));
            }
        } else {
            self.write_state(Record {
                pos: post,
                intent: Intent::Replace { pre, ino },
            })?;
            self.replica = None;
            replica::swap_in(&self.paths.base, &self.paths.replica, &self.paths.attic).map_err(
                |e| SlotError::Io {
                    name: self.name.clone(),
                    what: "moving the new replica into place",
                    source: e,
                },
            )?;
            self.write_state(Record {
                pos: post,
                intent: Intent::None,
            })?;
            self.replica =
                Some(Replica::open(&self.paths.replica).map_err(|e| self.replica_err(e))?);
        }
        self.pos = post;
        self.stats.bases += 1;
        self.stats.last_apply_ms = Some(ferry_core::seams::wall_ms());
        self.stats.last_observed_ms = Some(header.observed_ms);
        tracing::info!(db = %self.name, generation = format_args!("{:#x}", header.generation), pages = header.page_count, "base installed");
        Ok(())
    }

    fn drop_replica(&mut self) -> Result<(), SlotError> {
        // The replica goes, and with it the group an unsettled decision kept out.
        self.unsettled = None;
        self.replica = None;
        self.pending = None;
        let pos = Pos {
            generation: 0,
            seq: 0,
            checksum: 0,
            flags: self.pos.flags & !FLAG_HAS_REPLICA,
            ..self.pos
        };
        self.write_state(Record {
            pos,
            intent: Intent::None,
        })?;
        replica::remove_with_sidecars(&self.paths.replica).map_err(|e| SlotError::Io {
            name: self.name.clone(),
            what: "removing the replica",
            source: e,
        })?;
        self.pos = pos;
        Ok(())
    }

    fn status(&self) -> ReplicaStatus {
        let bytes = [
            &self.paths.replica,
            &crate::names::sidecar(&self.paths.replica, "-wal"),
        ]
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
        let pos = self.position();
        ReplicaStatus {
            name: self.name.clone(),
            epoch: self.pos.epoch,
            generation: self.pos.generation,
            seq: self.pos.seq,
            page_size: self.pos.page_size,
            pages: pos.pages,
            bytes,
            promoted: self.pos.promoted(),
            has_replica: self.pos.has_replica(),
            pending_part: pos.pending_part,
            transactions: self.stats.transactions,
            page_bytes: self.stats.page_bytes,
            bases: self.stats.bases,
            refusals: self.stats.refusals,
            last_apply_ms: self.stats.last_apply_ms,
            lag_ms: match (self.stats.last_apply_ms, self.stats.last_observed_ms) {
                (Some(a), Some(o)) => Some(a.saturating_sub(o)),
                _ => None,
            },
            last_error: self.stats.last_error.clone(),
        }
    }
}

/// Status read straight from a receiver directory, for `ferry receive status --dir` when
/// no receiver runs (safe while one does: each name is read under its flock).
pub fn offline_status(dir: &Path) -> Result<ReceiverStatus, String> {
    let ferry_dir = dir.join(".ferry");
    let rd = std::fs::read_dir(&ferry_dir).map_err(|e| {
        format!(
            "{} holds no replicas ({e}); has `ferry receive` run there?",
            dir.display()
        )
    })?;
    let mut names: Vec<String> = rd
        .flatten()
        .filter_map(|e| {
            let f = e.file_name();
            let name = f.to_str()?.strip_suffix(".state")?.to_string();
            crate::names::validate(&name).ok().map(|_| name)
        })
        .collect();
    names.sort();
    // Read-only: recovering here would write a record, and a running receiver would take
    // that for another process's change and drop the transaction it is receiving.
    let mut replicas = Vec::new();
    for name in names {
        let paths = Paths::new(dir, &name);
        let record = StateFile::open(&paths.state).map(|(_, r)| r.unwrap_or_default());
        let bytes = [
            &paths.replica,
            &crate::names::sidecar(&paths.replica, "-wal"),
        ]
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
        let (pos, last_error) = match record {
            Ok(r) if r.intent == Intent::None => (r.pos, None),
            Ok(r) => (
                r.pos,
                Some(
                    "the last transaction's outcome is resolved when the receiver starts"
                        .to_string(),
                ),
            ),
            Err(e) => (
                Pos::default(),
                Some(format!("cannot read the position record: {e}")),
            ),
        };
        let main_len = std::fs::metadata(&paths.replica)
            .map(|m| m.len())
            .unwrap_or(0);
        replicas.push(ReplicaStatus {
            name,
            epoch: pos.epoch,
            generation: pos.generation,
            seq: pos.seq,
            page_size: pos.page_size,
            pages: if pos.page_size > 0 {
                (main_len / pos.page_size as u64) as u32
            } else {
                0
            },
            bytes,
            promoted: pos.promoted(),
            has_replica: pos.has_replica(),
            pending_part: 0,
            transactions: 0,
            page_bytes: 0,
            bases: 0,
            refusals: 0,
            last_apply_ms: None,
            lag_ms: None,
            last_error,
        });
    }
    Ok(ReceiverStatus {
        dir: dir.display().to_string(),
        uptime_secs: 0,
        replicas,
    })
}

/// What `ferry promote` did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Promoted {
    pub name: String,
    pub path: String,
    pub epoch: Epoch,
    pub generation: u64,
    pub seq: u64,
    pub pages: u32,
    pub bytes: u64,
    /// The promoted copy was made by an earlier, interrupted run.
    pub resumed: bool,
}

/// Promote the replica `name` in the receiver directory `dir` to a primary at `dest`
/// (docs/ship.md §4.6). Safe alongside a running receiver, and idempotent.
pub fn promote(
    dir: &Path,
    name: &str,
    dest: &Path,
    progress: &mut dyn FnMut(u32, u32),
) -> Result<Promoted, String> {
    crate::sqlite::check_library()?;
    crate::names::validate(name)?;
    let paths = Paths::new(dir, name);
    if !paths.state.exists() {
        return Err(format!(
            "{}: no replica named {name} in {} (see `ferry receive status`)",
            dir.display(),
            dir.display()
        ));
    }
    if sqlite_path_eq(dest, &paths.replica) {
        return Err(format!(
            "--to {} is the replica itself; promote to another path",
            dest.display()
        ));
    }
    let mut slot = Slot::new(name, paths.clone());
    let _flock = slot.sync().map_err(|e| e.to_string())?;
    if slot.pos.promoted() && !slot.pos.has_replica() {
        return Err(format!(
            "{name} was already promoted at epoch {}; its replica was moved out then (see the first promote's report)",
            slot.pos.epoch
        ));
    }
    let resumed = slot.pos.promoted();
    if !slot.pos.has_replica() {
        return Err(format!(
            "{name} has no replica to promote (no base was ever received)"
        ));
    }
    let fenced = if slot.pos.promoted() {
        slot.pos
    } else {
        let pos = Pos {
            epoch: slot.pos.epoch.next(),
            flags: slot.pos.flags | FLAG_PROMOTED,
            ..slot.pos
        };
        slot.settle_decision().map_err(|e| e.to_string())?;
        slot.write_state(Record {
            pos,
            intent: Intent::None,
        })
        .map_err(|e| e.to_string())?;
        slot.pos = pos;
        pos
    };
    let replica = slot
        .replica
        .as_ref()
        .ok_or_else(|| format!("{name}: the replica could not be opened"))?;
    let pages = replica.page_count().map_err(|e| e.to_string())?;
    // A rerun after a crash past the copy: the copy at `dest` is this replica's, finish.
    let copied = resumed && dest.exists() && same_content(&paths.replica, dest)?;
    if dest.exists() && !copied {
        return Err(format!(
            "{} already exists; promote will not overwrite a database. Move it away and rerun",
            dest.display()
        ));
    }
    if !copied {
        let tmp = crate::names::sidecar(dest, ".promote-tmp");
        if let Some(parent) = dest.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
        }
        replica
            .copy_to(&tmp, progress)
            .map_err(|e| format!("copying {name} to {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, dest)
            .map_err(|e| format!("moving the copy to {}: {e}", dest.display()))?;
        let _ = replica::remove_with_sidecars(&tmp);
        ferry_core::fs::fsync_dir(&ferry_core::fs::parent_dir(dest)).map_err(|e| e.to_string())?;
    }
    crate::ship_state::seed_promoted(dest, fenced.epoch)
        .map_err(|e| format!("writing the new primary's shipper state: {e}"))?;
    slot.replica = None;
    slot.drop_replica().map_err(|e| e.to_string())?;
    let bytes = std::fs::metadata(dest).map(|m| m.len()).unwrap_or(0);
    Ok(Promoted {
        name: name.to_string(),
        path: dest.display().to_string(),
        epoch: fenced.epoch,
        generation: fenced.generation,
        seq: fenced.seq,
        pages,
        bytes,
        resumed,
    })
}

/// Do two databases hold the same data (read on connections of their own)?
fn same_content(a: &Path, b: &Path) -> Result<bool, String> {
    let digest = |p: &Path| {
        rusqlite::Connection::open_with_flags(p, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .and_then(|c| crate::sqlite::digest(&c))
            .map_err(|e| format!("reading {}: {e}", p.display()))
    };
    Ok(digest(a)? == digest(b)?)
}

fn sqlite_path_eq(a: &Path, b: &Path) -> bool {
    crate::sqlite::canonical(a) == crate::sqlite::canonical(b)
}
