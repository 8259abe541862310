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
//!
//! The rooms, lowest first:
//! - [`state`]: the two-slot position record and its intents. Pure encoding over a file.
//! - [`accept`]: the acceptance rule, which request is taken at which position. Pure.
//! - [`replica`]: applying groups and staged bases through `sqlite_dbpage`, the witness.
//! - `slot`: one name, carrying out the rule's plan; `recovery`: deciding an intent left
//!   by a stop; [`promote`](promote()): turning a replica into a primary.
//! - [`error`]: every error and refusal; [`status`]: status and metrics.
//! - this module: the [`Receiver`], its names, its checkpointer; [`server`]: HTTP.

pub mod accept;
pub mod error;
mod paths;
mod promote;
mod recovery;
pub mod replica;
pub mod server;
mod slot;
pub mod state;
pub mod status;

pub use error::{OfflineError, OpenError, PromoteError, Refused, SlotError, status_of};
pub use paths::Paths;
pub use promote::{Promoted, promote};
pub use status::{ReceiverStatus, ReplicaStatus, offline_status};

use crate::proto::{self, BaseHeader, Code, Position, TxnsQuery};
use ferry_core::epoch::Epoch;
use ferry_core::fs::DirLock;
use ferry_core::metrics::Histogram;
use ferry_core::seams::{Clock, SystemClock};
use ferry_core::sync::lock;
use ferry_core::{Class, Classify, ConfigError};
use slot::{BULK_DONE, BULK_IDLE, BULK_QUEUED, BulkJob, Slot};
use std::collections::HashMap;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Instant;

pub use crate::proto::BODY_BYTES_MAX;
/// Default largest base.
pub const BASE_BYTES_MAX: u64 = 64 << 30;
/// How a receiver is set up. Checked by [`Receiver::open`].
#[derive(Clone)]
pub struct ReceiverConfig {
    pub dir: PathBuf,
    /// Bearer token every request must carry, if set.
    pub token: Option<String>,
    pub max_body_bytes: u64,
    pub max_base_bytes: u64,
    /// Run `PRAGMA quick_check` on every base before installing it.
    pub base_quick_check: bool,
    /// Time, for latencies, uptime and the wall-clock stamps status shows.
    pub clock: Arc<dyn Clock>,
}

impl ReceiverConfig {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        ReceiverConfig {
            dir: dir.into(),
            token: None,
            max_body_bytes: BODY_BYTES_MAX,
            max_base_bytes: BASE_BYTES_MAX,
            base_quick_check: true,
            clock: Arc::new(SystemClock),
        }
    }

    /// Check every setting once, before anything opens; an error names the setting as
    /// this struct spells it.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.max_body_bytes < proto::BATCH_BYTES_MAX as u64 * 2 {
            return Err(ConfigError::new(
                "max_body_bytes",
                self.max_body_bytes,
                format!(
                    "is below twice the shipper's batch size ({} bytes): shippers would be refused",
                    proto::BATCH_BYTES_MAX
                ),
            ));
        }
        Ok(())
    }
}

impl std::fmt::Debug for ReceiverConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReceiverConfig")
            .field("dir", &self.dir)
            .field("token", &self.token.as_ref().map(|_| "(set)"))
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_base_bytes", &self.max_base_bytes)
            .field("base_quick_check", &self.base_quick_check)
            .finish_non_exhaustive()
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
    pub fn open(config: ReceiverConfig) -> Result<Arc<Receiver>, OpenError> {
        crate::sqlite::check_library()?;
        crate::sqlite::check_dbpage(&rusqlite::Connection::open_in_memory()?)?;
        config.check()?;
        let ferry_dir = config.dir.join(".ferry");
        std::fs::create_dir_all(&ferry_dir).map_err(|source| OpenError::Dir {
            path: ferry_dir.clone(),
            source,
        })?;
        let dir_lock =
            DirLock::try_acquire(&ferry_dir.join("receiver.lock"), "another ferry receiver")?;
        let (bulk_tx, bulk_rx) = mpsc::channel();
        let started = config.clock.now();
        let receiver = Arc::new(Receiver {
            config,
            ferry_dir,
            _lock: dir_lock,
            slots: Mutex::new(HashMap::new()),
            bulk_tx,
            bulk_rx: Mutex::new(Some(bulk_rx)),
            apply_latency: Histogram::latency(),
            started,
            requests_refused: AtomicU64::new(0),
        });
        for name in receiver.names_on_disk() {
            if let Some(slot) = receiver.slot_of(&name, false) {
                let mut s = lock(&slot);
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
        let Some(rx) = lock(&self.bulk_rx).take() else {
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

    /// The names with a position record here; none if the directory cannot be read (a
    /// status or a list then shows no replica rather than failing).
    fn names_on_disk(&self) -> Vec<String> {
        paths::names_in(&self.ferry_dir).unwrap_or_default()
    }

    fn slot(&self, name: &str, create: bool) -> Result<Option<Arc<Mutex<Slot>>>, Refused> {
        crate::names::validate(name).map_err(|e| Refused::new(Code::BadRequest, e.to_string()))?;
        Ok(self.slot_of(name, create))
    }

    /// The slot of a valid name; None if it has no state file and `create` is false.
    fn slot_of(&self, name: &str, create: bool) -> Option<Arc<Mutex<Slot>>> {
        let mut slots = lock(&self.slots);
        if let Some(s) = slots.get(name) {
            return Some(s.clone());
        }
        let paths = Paths::new(&self.config.dir, name);
        if !create && !paths.state.exists() {
            return None;
        }
        let slot = Arc::new(Mutex::new(Slot::new(
            name,
            paths,
            self.config.clock.clone(),
        )));
        slots.insert(name.to_string(), slot.clone());
        Some(slot)
    }

    /// Where a replica stands, or None if the receiver has never heard of it.
    pub fn position(&self, name: &str) -> Result<Option<Position>, Refused> {
        let Some(slot) = self.slot(name, false)? else {
            return Ok(None);
        };
        let mut s = lock(&slot);
        let _flock = s.sync()?;
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
        let mut s = lock(&slot);
        let _flock = s.sync()?;
        // Admission first: a body framed for another page size would only fail to parse.
        s.admit(Epoch(q.epoch), q.generation, Some(q.page_size))?;
        let records = proto::decode_records(body, q.page_size).map_err(|e| {
            let code = match e.class() {
                Class::Corrupted => Code::Corrupt,
                _ => Code::BadRequest,
            };
            Refused::new(code, format!("{name}: {e}"))
        })?;
        let started = self.config.clock.now();
        let outcome = s.apply_records(&records);
        if outcome.is_ok() {
            let took = self.config.clock.now().saturating_duration_since(started);
            self.apply_latency.observe(took);
        }
        outcome?;
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
        crate::names::validate(name).map_err(|e| Refused::new(Code::BadRequest, e.to_string()))?;
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
        let mut s = lock(&slot);
        let _flock = s.sync()?;
        accept::fence(s.pos.epoch, epoch).map_err(|why| s.rejected(why))?;
        s.install_base(body, &header, self.config.base_quick_check)?;
        self.checkpoint_step(&mut s);
        Ok(s.position())
    }

    /// Refuse a base larger than allowed, before reading it.
    pub fn check_base_size(&self, name: &str, bytes: u64) -> Result<(), Refused> {
        if bytes > self.config.max_base_bytes {
            return Err(Refused::new(
                Code::TooLarge,
                format!(
                    "{name}: the base is {bytes} bytes, over this receiver's limit of {} (raise its max_base_bytes)",
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
        let mut s = lock(&slot);
        let _flock = s.sync()?;
        accept::fence(s.pos.epoch, epoch).map_err(|why| s.rejected(why))?;
        let had = s.pos.has_replica();
        s.drop_replica()?;
        Ok(had)
    }

    fn note_refusal(&self, name: &str, e: &Refused) {
        self.requests_refused.fetch_add(1, Ordering::Relaxed);
        if let Ok(Some(slot)) = self.slot(name, false) {
            let mut s = lock(&slot);
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
            let mut s = lock(&slot);
            let flock = s.sync();
            if let Err(e) = &flock {
                s.stats.last_error = Some(e.to_string());
            }
            replicas.push(s.status());
        }
        ReceiverStatus {
            dir: self.config.dir.display().to_string(),
            uptime_secs: self
                .config
                .clock
                .now()
                .saturating_duration_since(self.started)
                .as_secs(),
            replicas,
        }
    }

    /// Prometheus text.
    pub fn metrics(&self) -> String {
        status::metrics(&self.status(), &self.apply_latency)
    }
}
