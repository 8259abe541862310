//! One shipped database (docs/ship.md §3).
//!
//! A step:
//! 1. Check the file is the one we track (dev, inode); a new one owes a base.
//! 2. Prove the WAL continues what we read (§3.3) and scan new committed transactions.
//!    Anything unproven owes a base.
//! 3. Owing a base: take one (§3.6) and send it.
//! 4. Ship unacknowledged transactions, one request in flight.
//! 5. Past the WAL cap with the peer away: give up on the lineage, fold, owe a base.
//! 6. Idle with everything acknowledged: fold the WAL (§3.5).
//!
//! Persisted: `ShipState`, a hint written after a base, before a fold, about once a second
//! while shipping, and at shutdown. A crash anywhere leaves either a state the next run
//! can re-prove against the WAL, or one that leads to a base.

use super::client::{Client, Reply};
use super::error::StepError;
use super::{TXN_INLINE_BYTES_MAX, UNACKED_BYTES_MAX};
use crate::proto::{
    self, BaseHeader, Code, EpochQuery, Position, RecordHeader, Refusal, TxnsQuery,
};
use crate::proto::{BATCH_BYTES_MAX, PART_BYTES_MAX};
use crate::quiet;
use crate::ship_state::{self as state, FileId, Fingerprint, ShipState};
use crate::wal::{self, Cursor, Header, Pages, ScanLimits, Stop, Txn};
use ferry_core::backoff::Backoff;
use ferry_core::epoch::Epoch;
use ferry_core::seams::{SplitMix64, wall_ms};
use rusqlite::Connection;
use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Save the state at most this often while shipping: a restart then rescans at most a
/// second of WAL, and the primary's disk sees one small fsync a second from us.
const STATE_SAVE_INTERVAL: Duration = Duration::from_secs(1);
/// Retry a fold that a reader held up after this long, even with no new commits.
const FOLD_RETRY: Duration = Duration::from_secs(5);
/// A commit whose frames are in the `-wal` but not yet published in the wal-index is
/// looked at again every `UNPUBLISHED_RECHECK`, `UNPUBLISHED_RECHECKS_FAST` times, then
/// every `UNPUBLISHED_RECHECK_SLOW`. An app publishes right after its commit's sync (well
/// under a millisecond to some tens of them), and in another process it says nothing when
/// it does: inotify saw the frames written, before the sync. Seeing it soon matters: an
/// app that checkpoints itself may reset the WAL a few milliseconds later, and a commit of
/// the old cycle the shipper never saw published costs a base. One that stays unpublished
/// is a commit its writer died in; it is looked at every `UNPUBLISHED_RECHECK_SLOW` until
/// the app's next writer overwrites it, for a read of the index and of one frame each time.
const UNPUBLISHED_RECHECK: Duration = Duration::from_millis(1);
const UNPUBLISHED_RECHECKS_FAST: u32 = 100;
const UNPUBLISHED_RECHECK_SLOW: Duration = Duration::from_millis(100);
/// How often a step re-checks what rarely changes: the file's identity, its header's
/// change counter, the `-wal` file's identity, the WAL cap. A step per commit cannot
/// afford a stat of each every time.
const IDENTITY_INTERVAL: Duration = Duration::from_millis(50);
/// How long a replaced file waits for the `-wal` and `-shm` of the file it replaced to be
/// removed (see `Track::wait_for_stale_sidecars`), and how often it looks meanwhile.
const STALE_SIDECAR_WAIT: Duration = Duration::from_secs(10);
const STALE_SIDECAR_RECHECK: Duration = Duration::from_millis(10);
/// Folds wait while the last request took longer than this, or while more than
/// `FOLD_UNACKED_MAX` of pages wait for acknowledgement (see `Track::may_fold`).
const FOLD_RTT_MAX: Duration = Duration::from_millis(50);
const FOLD_UNACKED_MAX: u64 = 1 << 20;
/// While a base is owed, the WAL is folded at most this often.
const OWING_FOLD_INTERVAL: Duration = Duration::from_millis(200);
/// Retries after failures: 50 ms doubling to 2 s, full jitter. A retry is one small
/// request (or a refused connect), so a short cap costs the peer nothing while it is away
/// and lets the standby catch up within a couple of seconds of its return; with a 30 s cap
/// a ten-second outage could leave it behind for another twenty.
const BACKOFF: Backoff = Backoff::new(
    Duration::from_millis(50),
    Duration::from_secs(2),
    Duration::from_millis(10),
);

/// Settings of a tracked database.
#[derive(Clone, Copy, Debug)]
pub struct TrackConfig {
    /// WAL bytes not acknowledged beyond which the lineage is given up (fold, base).
    pub wal_max_bytes: u64,
    /// The WAL is folded only when it holds at least this many frames.
    pub fold_min_frames: u32,
    /// Ship with at least this epoch.
    pub epoch: Option<Epoch>,
}

/// What the scheduler does next with this database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// More work now.
    Again,
    /// A batch went out: step again to send what committed meanwhile, paced (see
    /// `shipper::PACE`).
    Sent,
    /// Nothing to do until a commit (or the backstop poll).
    Idle,
    /// Retry after a delay.
    After(Duration),
    /// The database file is gone: stop tracking it.
    Gone,
    /// Fenced by a newer epoch: stop shipping it.
    Fenced,
}

/// Why a base was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum BaseReason {
    /// Nothing was ever shipped (or the state was lost).
    First,
    /// The database file was replaced (new inode, or a foreign change counter).
    Replaced,
    /// The WAL was reset in a way that cannot be proven clean.
    Reset,
    /// The WAL below the cursor changed (a lost unsynced tail, or damage).
    Rewritten,
    /// The peer was away past the WAL cap.
    WalCap,
    /// The receiver has no replica, another generation, or less than was acknowledged.
    PeerLost,
    /// The page size changed.
    PageSize,
}

impl BaseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            BaseReason::First => "first",
            BaseReason::Replaced => "replaced",
            BaseReason::Reset => "reset",
            BaseReason::Rewritten => "rewritten",
            BaseReason::WalCap => "wal_cap",
            BaseReason::PeerLost => "peer_lost",
            BaseReason::PageSize => "page_size",
        }
    }
}

/// Counters for status and metrics.
#[derive(Clone, Debug, Default)]
pub struct TrackStats {
    pub transactions_shipped: u64,
    pub body_bytes_shipped: u64,
    pub page_bytes_shipped: u64,
    pub requests: u64,
    pub bases: BTreeMap<&'static str, u64>,
    pub base_bytes: u64,
    pub folds: u64,
    pub last_ack_ms: Option<u64>,
    pub last_error: Option<String>,
    pub failures: u32,
}

/// A scanned transaction waiting for its acknowledgement.
struct Unacked {
    seq: u64,
    txn: Txn,
    observed_ms: u64,
    seen: Instant,
}

/// One tracked database.
pub struct Track {
    pub name: String,
    path: PathBuf,
    wal_path: PathBuf,
    state_path: PathBuf,
    main: Connection,
    barrier: Connection,
    db: FileId,
    header_fd: Arc<File>,
    wal: Option<(FileId, File)>,
    /// The persisted part: epoch, generation, the acknowledged seq and its cursor.
    st: ShipState,
    /// Where scanning has reached; None while the WAL was empty at the base. Never past
    /// what SQLite published (`published`).
    scan: Option<Cursor>,
    scan_stop: Stop,
    /// The furthest SQLite's wal-index was seen to publish of the cycle it named then
    /// (docs/ship.md §3.2). Frames past it are not committed for SQLite, whatever their
    /// checksums say; once the index has moved on to a new cycle, this is all the shipper
    /// knows of where the old one ended.
    published: super::fold::PublishedEnds,
    /// A valid commit follows what SQLite published (being published, or one its writer
    /// died in): where the scan stopped before it, and how many times in a row.
    unpublished: Option<(Cursor, u32)>,
    unacked: VecDeque<Unacked>,
    unacked_bytes: u64,
    /// Seq the next scanned transaction gets.
    next_seq: u64,
    /// Highest seq the receiver holds (may be ahead of what was scanned after a restart).
    acked: u64,
    /// Next part of transaction `acked + 1` the receiver expects.
    resume_part: u32,
    /// The receiver's WAL checksum at `acked` (0: unknown).
    acked_checksum: u64,
    /// A scan found the receiver holding another history than this WAL.
    forked: bool,
    /// How long the last txns request took (a slow peer postpones folds).
    last_request: Duration,
    /// The receiver's position is known and checked (after a probe or a base).
    probed: bool,
    /// The WAL chain from the header to the cursor was verified in full (once per open).
    chain_verified: bool,
    batch_bytes_max: usize,
    fenced: Option<String>,
    dirty: bool,
    saved_at: Instant,
    fold_tried: Option<(Cursor, Instant)>,
    /// After a failure, no request goes out before this.
    retry_at: Option<Instant>,
    /// Last fold while a base was owed.
    owing_fold_at: Option<Instant>,
    /// Last checks of the file's identity, its change counter and the WAL cap; and
    /// whether the `-wal` path must be looked at again (it may have been replaced).
    identity_at: Instant,
    counters_at: Instant,
    cap_at: Instant,
    wal_stat_due: bool,
    /// The `-shm` file at the last identity check (the `-wal` one is `wal`'s), and since
    /// when the file has been seen replaced while they were still there (see
    /// `wait_for_stale_sidecars`).
    shm: Option<FileId>,
    replaced_at: Option<Instant>,
    /// A step failed inside SQLite: open new connections before the next one.
    reopen_due: bool,
    /// Why the owed base is owed (for status and metrics).
    pending_reason: Option<BaseReason>,
    /// Bytes of the base in flight and its size, shared with status.
    progress: Arc<BaseProgress>,
    /// The shipper's folder thread, and what it tells this database about its folds.
    folder: Arc<super::fold::Folder>,
    fold_state: Arc<super::fold::FoldState>,
    config: TrackConfig,
    rng: SplitMix64,
    pub stats: TrackStats,
}

impl Track {
    /// Open a database for shipping. `dir` is the shipper's directory.
    pub fn open(
        dir: &Path,
        name: &str,
        config: TrackConfig,
        progress: Arc<BaseProgress>,
        folder: Arc<super::fold::Folder>,
    ) -> Result<Track, StepError> {
        let path = dir.join(format!("{name}.db"));
        let main = crate::sqlite::open_primary(&path)?;
        let mode: String = main.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            // Not switched for the app: changing the journal mode under an app that is
            // opening the database itself can make its own switch fail. A new database is
            // usually switched by its app a moment later; the shipper looks again then.
            return Err(StepError::Peer(format!(
                "{} is in {mode} journal mode; ferry-ship ships the WAL: open it with \
                 ferry_ship::prepare_connection or PRAGMA journal_mode=WAL",
                path.display()
            )));
        }
        let mut barrier = crate::sqlite::open_primary(&path)?;
        crate::sqlite::eager_busy_handler(&mut barrier)?;
        let meta = quiet::stat(&path)?;
        let db = FileId {
            dev: meta.dev,
            ino: meta.ino,
        };
        let state_path = state::path(dir, name);
        let loaded = match state::load(&state_path) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(db = name, "{e}; a base will be sent");
                None
            }
        };
        let mut st = loaded.unwrap_or(ShipState {
            version: state::VERSION,
            needs_base: true,
            ..ShipState::default()
        });
        if st.db.is_some_and(|d| d != db) {
            st.needs_base = true;
        }
        if st.generation == 0 {
            st.needs_base = true;
        }
        if let Some(e) = config.epoch {
            if e > st.epoch {
                st.epoch = e;
                st.needs_base = true;
            } else if e < st.epoch {
                tracing::warn!(
                    db = name,
                    "--epoch {e} is below the epoch {} this database already ships with; keeping {}",
                    st.epoch,
                    st.epoch
                );
            }
        }
        let acked = st.acked_seq;
        let shm = shm_id(&path);
        Ok(Track {
            name: name.to_string(),
            wal_path: crate::names::sidecar(&path, "-wal"),
            header_fd: main_fd(&path)?,
            path,
            state_path,
            main,
            barrier,
            db,
            wal: None,
            scan: st.cursor,
            scan_stop: Stop::End,
            published: {
                let mut ends = super::fold::PublishedEnds::default();
                if let Some(end) = st.published {
                    ends.note(end);
                }
                ends
            },
            unpublished: None,
            unacked: VecDeque::new(),
            unacked_bytes: 0,
            next_seq: acked + 1,
            acked,
            resume_part: 0,
            acked_checksum: 0,
            forked: false,
            last_request: Duration::ZERO,
            probed: false,
            chain_verified: false,
            batch_bytes_max: BATCH_BYTES_MAX,
            fenced: None,
            dirty: false,
            saved_at: Instant::now(),
            fold_tried: None,
            pending_reason: None,
            retry_at: None,
            owing_fold_at: None,
            identity_at: Instant::now(),
            counters_at: Instant::now() - IDENTITY_INTERVAL,
            cap_at: Instant::now(),
            wal_stat_due: true,
            shm,
            replaced_at: None,
            reopen_due: false,
            progress,
            folder,
            fold_state: Arc::default(),
            config,
            rng: SplitMix64::from_entropy(),
            st,
            stats: TrackStats::default(),
        })
    }

    /// Run one step and say what comes next. Errors become a backoff and a status line.
    pub fn step(&mut self, client: &Client) -> Next {
        match self.step_inner(client) {
            Ok(next) => next,
            Err(e) => Next::After(self.failed(&e)),
        }
    }

    fn step_inner(&mut self, client: &Client) -> Result<Next, StepError> {
        if self.fenced.is_some() {
            return Ok(Next::Fenced);
        }
        if self.reopen_due {
            if self.fold_state.forget.load(Ordering::SeqCst) {
                // The folder still holds its connections (see `failed`).
                return Ok(Next::After(STALE_SIDECAR_RECHECK));
            }
            self.reopen()?;
            self.reopen_due = false;
        }
        if self.identity_at.elapsed() >= IDENTITY_INTERVAL || self.st.needs_base {
            // At most every IDENTITY_INTERVAL: a step per commit cannot afford the stat
            // calls, and a replaced file read meanwhile fails the continuity proof anyway
            // (its WAL has other salts).
            self.identity_at = Instant::now();
            self.wal_stat_due = true;
            match quiet::stat(&self.path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Next::Gone),
                Err(e) => return Err(e.into()),
                Ok(m)
                    if (FileId {
                        dev: m.dev,
                        ino: m.ino,
                    }) != self.db =>
                {
                    if let Some(wait) = self.wait_for_stale_sidecars() {
                        return Ok(Next::After(wait));
                    }
                    self.reopen()?;
                    self.owe_base(BaseReason::Replaced);
                }
                Ok(_) => self.shm = shm_id(&self.path),
            }
        }
        if !self.st.needs_base && !self.probed && self.backing_off().is_none() {
            // After a start, learn where the receiver stands before shipping anything: a
            // request mixing transactions it holds with ones it does not could otherwise
            // apply a forked history on top of its own (see `probe`).
            if let Err(e) = self.probe(client) {
                self.failed(&e);
            }
        }
        if !self.st.needs_base
            && let Err(reason) = self.advance()?
        {
            self.owe_base(reason);
        }
        if self.st.needs_base {
            self.fold_while_owing()?;
            if let Some(wait) = self.backing_off() {
                return Ok(Next::After(wait));
            }
            return self.send_base(client);
        }
        if self.over_cap()? {
            tracing::warn!(db = %self.name, limit = self.config.wal_max_bytes, "the peer is away past the WAL cap: folding, a base will follow");
            self.owe_base(BaseReason::WalCap);
            self.folder
                .request(&self.path, self.db.ino, None, &self.fold_state);
            return Ok(Next::Again);
        }
        if self.may_fold() {
            self.fold()?;
        }
        if !self.unacked.is_empty() {
            // While the peer is backed off, steps still run on every commit for the local
            // work above (scan, cap, folds while a base is owed): the WAL stays bounded.
            if let Some(wait) = self.backing_off() {
                return Ok(Next::After(wait));
            }
            if !self.probed {
                // Nothing ships before the receiver's position is known and checked.
                return Ok(Next::After(Duration::from_millis(50)));
            }
            return self.ship(client);
        }
        self.save_if_due()?;
        Ok(if self.scan_stop == Stop::Budget {
            Next::Again
        } else if let Some((_, n)) = self.unpublished {
            Next::After(if n < UNPUBLISHED_RECHECKS_FAST {
                UNPUBLISHED_RECHECK
            } else {
                UNPUBLISHED_RECHECK_SLOW
            })
        } else {
            Next::Idle
        })
    }

    /// Count a failure, say so once, and back off; returns the delay.
    fn failed(&mut self, e: &StepError) -> Duration {
        self.stats.failures += 1;
        if let StepError::Sqlite(e) = e
            && !matches!(
                e.sqlite_error_code(),
                Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
            )
        {
            // A connection can be left unusable for good (a wal-index file removed or
            // replaced under it, a descriptor gone bad); new ones see the files as they
            // are now. The folder drops its own too: SQLite shares one wal-index mapping
            // among all of a process's connections to a file, so ours alone would not do.
            self.reopen_due = true;
            self.folder.forget(&self.path, &self.fold_state);
        }
        let msg = e.to_string();
        if self.stats.last_error.as_deref() != Some(&msg) || self.stats.failures == 1 {
            tracing::warn!(db = %self.name, failures = self.stats.failures, "{msg}");
        }
        self.stats.last_error = Some(msg);
        let delay = BACKOFF.delay(self.stats.failures, &mut self.rng);
        self.retry_at = Some(Instant::now() + delay);
        delay
    }

    /// Ask the receiver where it stands, and check it holds our history (docs/ship.md
    /// §3.7): behind what it acknowledged, another lineage, or another transaction at our
    /// acknowledged seq each owe a base; ahead of our saved state, the scan checks the
    /// WAL checksum when it reaches the receiver's seq.
    fn probe(&mut self, client: &Client) -> Result<(), StepError> {
        match client
            .position(&self.name)
            .map_err(|e| StepError::Peer(e.0))?
        {
            Reply::Ok(pos) => {
                if pos.generation != self.st.generation
                    || pos.epoch != self.st.epoch
                    || pos.seq < self.st.acked_seq
                {
                    self.owe_base(BaseReason::PeerLost);
                } else if pos.seq == self.st.acked_seq {
                    let ours = self.st.cursor.map_or(0, |c| pack(c.checksum));
                    if !same_history(ours, pos.checksum) {
                        tracing::warn!(db = %self.name, seq = pos.seq, "the receiver holds another history than this WAL");
                        self.owe_base(BaseReason::Rewritten);
                    }
                    self.resume_part = pos.pending_part;
                } else {
                    self.acked = pos.seq;
                    self.acked_checksum = pos.checksum;
                    self.resume_part = pos.pending_part;
                }
                self.probed = true;
                Ok(())
            }
            Reply::Refused { refusal, .. } if refusal.code == Code::NotFound => {
                self.owe_base(BaseReason::PeerLost);
                self.probed = true;
                Ok(())
            }
            Reply::Refused { status, refusal } => Err(StepError::Peer(format!(
                "asking the receiver for its position (HTTP {status}): {}",
                refusal.error
            ))),
        }
    }

    /// Time left before the next attempt to reach the peer after a failure.
    fn backing_off(&self) -> Option<Duration> {
        self.retry_at
            .and_then(|at| at.checked_duration_since(Instant::now()))
            .filter(|d| !d.is_zero())
    }

    fn owe_base(&mut self, reason: BaseReason) {
        if !self.st.needs_base || self.pending_reason.is_none() {
            tracing::info!(db = %self.name, reason = reason.as_str(), "a base is owed");
            self.pending_reason = Some(reason);
        }
        self.st.needs_base = true;
        self.unacked.clear();
        self.unacked_bytes = 0;
    }

    /// The database file was replaced (renamed over). If its old `-wal` or `-shm` is still
    /// at its path, any connection opened on the new file now would read it through the
    /// old file's WAL and wal-index (SQLite shares both by path), and a checkpoint would
    /// copy the old file's pages into the new one. Whoever replaced the file is expected
    /// to remove them (a restore does): wait for that, up to `STALE_SIDECAR_WAIT`, with
    /// the old connections kept and nothing shipped; the time to wait again, or None to
    /// open the new file now. Past the wait SQLite gets the new file as it stands, which
    /// is what the app's own connections get.
    fn wait_for_stale_sidecars(&mut self) -> Option<Duration> {
        let wal_now = quiet::stat(&self.wal_path).ok().map(|m| FileId {
            dev: m.dev,
            ino: m.ino,
        });
        let wal_stale = wal_now.is_some() && wal_now == self.wal.as_ref().map(|(id, _)| *id);
        let shm_now = shm_id(&self.path);
        let shm_stale = shm_now.is_some() && shm_now == self.shm;
        let files = match (wal_stale, shm_stale) {
            (false, false) => {
                self.replaced_at = None;
                return None;
            }
            (true, true) => format!("{0}.db-wal and {0}.db-shm", self.name),
            (true, false) => format!("{}.db-wal", self.name),
            (false, true) => format!("{}.db-shm", self.name),
        };
        let since = *self.replaced_at.get_or_insert_with(Instant::now);
        if since.elapsed() >= STALE_SIDECAR_WAIT {
            tracing::warn!(db = %self.name, "{}.db was replaced but {files} of the file it replaced are still there after {STALE_SIDECAR_WAIT:?}: opening it anyway, as SQLite will for the app", self.name);
            self.replaced_at = None;
            return None;
        }
        let msg = format!(
            "{}.db was replaced, but {files} still belong to the file it replaced: SQLite \
             would read the new file through them; waiting for them to be removed",
            self.name
        );
        if self.stats.last_error.as_deref() != Some(&msg) {
            tracing::warn!(db = %self.name, "{msg}");
        }
        self.stats.last_error = Some(msg);
        // Look again at the next step, not after IDENTITY_INTERVAL.
        self.identity_at = Instant::now() - IDENTITY_INTERVAL;
        Some(STALE_SIDECAR_RECHECK)
    }

    fn reopen(&mut self) -> Result<(), StepError> {
        self.main = crate::sqlite::open_primary(&self.path)?;
        self.barrier = crate::sqlite::open_primary(&self.path)?;
        crate::sqlite::eager_busy_handler(&mut self.barrier)?;
        let meta = quiet::stat(&self.path)?;
        self.db = FileId {
            dev: meta.dev,
            ino: meta.ino,
        };
        self.header_fd = main_fd(&self.path)?;
        self.wal = None;
        self.wal_stat_due = true;
        self.chain_verified = false;
        Ok(())
    }

    /// The `-wal` file, reopened if it was replaced; None if there is none.
    fn wal_file(&mut self) -> Result<Option<&File>, StepError> {
        if self.wal.is_some() && !self.wal_stat_due {
            return Ok(self.wal.as_ref().map(|(_, f)| f));
        }
        self.wal_stat_due = false;
        let meta = match quiet::stat(&self.wal_path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.wal = None;
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        let id = FileId {
            dev: meta.dev,
            ino: meta.ino,
        };
        if self.wal.as_ref().is_none_or(|(have, _)| *have != id) {
            match quiet::open(&self.wal_path) {
                Ok(f) => self.wal = Some((id, f)),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    self.wal = None;
                    return Ok(None);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(self.wal.as_ref().map(|(_, f)| f))
    }

    /// Prove continuity and scan (docs/ship.md §3.3). `Err(reason)` owes a base.
    fn advance(&mut self) -> Result<Result<(), BaseReason>, StepError> {
        loop {
            let wal = self.wal_file()?;
            let header = match wal {
                Some(f) => read_header_settled(f)?,
                None => None,
            };
            let Some(cursor) = self.scan else {
                // The WAL was empty at the base. A first cycle continues it only if no
                // checkpoint wrote the main file since (it would have folded frames we
                // never saw).
                let Some(h) = header else { return Ok(Ok(())) };
                if self.st.main.is_none() || self.st.main != Some(fingerprint(&self.path)?) {
                    return Ok(Err(BaseReason::Reset));
                }
                self.scan = Some(h.start());
                continue;
            };
            let Some(h) = header else {
                // The WAL is gone, empty or its header invalid: frames after the cursor
                // may have been folded and dropped (TRUNCATE). Nothing proves otherwise.
                return Ok(Err(BaseReason::Reset));
            };
            let f = self
                .wal
                .as_ref()
                .map(|(_, f)| f)
                .expect("a header was read from it");
            if h.salts == cursor.salts {
                if h.page_size != cursor.page_size {
                    return Ok(Err(BaseReason::PageSize));
                }
                if !wal::cursor_holds(f, &cursor)? {
                    return Ok(Err(BaseReason::Rewritten));
                }
                if !self.chain_verified {
                    // Once per open, walk the whole chain to the cursor: after a power loss
                    // the frame at the cursor can survive while frames below it did not,
                    // and SQLite's own recovery would then end the WAL earlier.
                    if wal::chain_to(f, &h, cursor.frame)? != Some(cursor.checksum) {
                        tracing::warn!(db = %self.name, frame = cursor.frame, "the WAL below the saved cursor changed");
                        return Ok(Err(BaseReason::Rewritten));
                    }
                    // A cursor saved past what SQLite published covers a commit whose
                    // writer died before publishing it (or one that overwrote it).
                    if let Some(now) = crate::sqlite::wal_index_end(&self.main)
                        && now.salts == cursor.salts
                        && now.frame < cursor.frame
                    {
                        tracing::warn!(db = %self.name, frame = cursor.frame, published = now.frame, "the saved cursor is past what SQLite published");
                        return Ok(Err(BaseReason::Rewritten));
                    }
                    self.chain_verified = true;
                }
                let end = self.published_end(cursor.salts);
                self.scan_more(cursor, false, end)?;
                if std::mem::take(&mut self.forked) {
                    return Ok(Err(BaseReason::Rewritten));
                }
                return self.check_counters();
            }
            match prove_new_cycle(f, &cursor, &h)? {
                Proof::Clean => {
                    tracing::debug!(db = %self.name, from = cursor.frame, "WAL reset proven clean; continuing in the new cycle");
                    self.scan = Some(h.start());
                }
                Proof::OldCycleGoesOn => {
                    // Read what the old cycle still holds past our cursor, as far as SQLite
                    // published it, then check the new cycle has not reached those slots
                    // while we read.
                    let seen = self.published_end(cursor.salts);
                    self.scan_more(cursor, true, seen)?;
                    let reached = self.scan.expect("scan_more sets it");
                    let f = self.wal.as_ref().map(|(_, f)| f).expect("still open");
                    if !self.forked && wal::continues(f, &reached)? {
                        let Some(end) = self.old_cycle_end(&reached)? else {
                            tracing::info!(db = %self.name, frame = reached.frame, "the old WAL cycle goes on past what SQLite was seen to publish, with a last commit the main file does not show");
                            return Ok(Err(BaseReason::Reset));
                        };
                        self.scan_more(reached, true, end)?;
                    }
                    if std::mem::take(&mut self.forked) {
                        return Ok(Err(BaseReason::Rewritten));
                    }
                    // The old cycle's chain ended right after what was read (at `reached`,
                    // or further on with no commit) unless the new cycle had overwritten
                    // the slot after it by then. It only grows, so not having reached that
                    // slot now proves it had not then, and the header, unchanged, that no
                    // second reset began meanwhile.
                    let reached = self.scan.expect("scan_more sets it").frame;
                    let f = self.wal.as_ref().map(|(_, f)| f).expect("still open");
                    let same = wal::read_header(f)?.and_then(|x| x.ok()) == Some(h);
                    let overwritten = wal::reached(f, &h, reached + 1)?;
                    if !same || overwritten {
                        tracing::info!(db = %self.name, cursor = cursor.frame, reached, same_header = same, "the new WAL cycle reached the old one's frames while they were read");
                        return Ok(Err(BaseReason::Reset));
                    }
                    if self.scan == Some(cursor) {
                        tracing::info!(db = %self.name, frame = cursor.frame, "the old WAL cycle goes on past the cursor with no commit in it");
                        return Ok(Err(BaseReason::Reset));
                    }
                }
                Proof::Unproven(reason, why) => {
                    tracing::info!(db = %self.name, "WAL reset not provably clean: {why}");
                    return Ok(Err(reason));
                }
            }
        }
    }

    /// After a reset, where the old cycle's published frames end, given that valid
    /// frames follow `from`, the end of what SQLite was seen to publish: the end of the old
    /// cycle's valid chain if its last commit is in the main file, else None.
    ///
    /// An app that checkpoints itself can publish its last commits and reset the WAL
    /// between two looks of the shipper. Every commit the chain holds after `from` but the
    /// last was published: the next one could only be written after it. The last was
    /// too if the checkpoint that let the WAL reset copied it: then the main file holds each
    /// of its pages as it wrote them (a checkpoint copies each page's last image as the WAL
    /// holds it, page 1 included). A commit whose writer died before publishing it was
    /// never copied; the main file shows it only where it changed nothing, and a page the
    /// new cycle has copied since shows another image: both answer None, and a base is
    /// sent, never a guess.
    fn old_cycle_end(&self, from: &Cursor) -> Result<Option<u32>, StepError> {
        let f = self
            .wal
            .as_ref()
            .map(|(_, f)| f)
            .expect("callers opened the WAL");
        let positions = ScanLimits {
            txn_inline_bytes_max: 0,
            budget_bytes: u64::MAX,
        };
        let chain = wal::scan(f, from, positions)?;
        let Some(last) = chain.txns.last() else {
            return Ok(Some(from.frame));
        };
        let images: Vec<(u32, Option<Box<[u8]>>)> = match &last.pages {
            wal::Pages::Frames(refs) => refs
                .iter()
                .map(|(pgno, r)| Ok((*pgno, wal::read_verified(f, r)?)))
                .collect::<io::Result<_>>()?,
            wal::Pages::Inline(images) => images
                .iter()
                .map(|(pgno, image)| (*pgno, Some(image.clone())))
                .collect(),
        };
        let mut on_disk = vec![0u8; from.page_size as usize];
        for (pgno, image) in images {
            let Some(image) = image else {
                return Ok(None);
            };
            let at = (pgno as u64 - 1) * from.page_size as u64;
            if self.header_fd.read_exact_at(&mut on_disk, at).is_err() || on_disk[..] != image[..] {
                return Ok(None);
            }
        }
        Ok(Some(last.last_frame))
    }

    /// The last frame of the cycle `salts` that SQLite has published: from the wal-index
    /// while it names that cycle, else the furthest it was seen to, by this track, by the
    /// folder's checkpoints or before a restart (`published`); 0 if it never was.
    fn published_end(&mut self, salts: wal::Salts) -> u32 {
        // While the index names the cycle, it is the truth (an end noted earlier may be of
        // an index since rebuilt smaller, after a power loss).
        if let Some(now) = crate::sqlite::wal_index_end(&self.main)
            && now.salts == salts
        {
            self.published.note(now);
            return now.frame;
        }
        if let Some(frame) = self.fold_state.published(salts) {
            self.published
                .note(crate::sqlite::WalIndexEnd { salts, frame });
        }
        self.published.get(salts).unwrap_or(0)
    }

    /// Scan committed transactions after `from` up to frame `end` (what SQLite
    /// published), queueing them for shipping.
    fn scan_more(&mut self, from: Cursor, everything: bool, end: u32) -> Result<(), StepError> {
        let budget = if everything {
            u64::MAX
        } else {
            UNACKED_BYTES_MAX.saturating_sub(self.unacked_bytes)
        };
        if budget == 0 {
            self.scan_stop = Stop::Budget;
            return Ok(());
        }
        let f = self
            .wal
            .as_ref()
            .map(|(_, f)| f)
            .expect("callers opened the WAL");
        let published = wal::Upto {
            src: f,
            len: wal::frame_offset(from.page_size, end.max(from.frame) + 1),
        };
        let found = wal::scan(
            &published,
            &from,
            ScanLimits {
                txn_inline_bytes_max: TXN_INLINE_BYTES_MAX,
                budget_bytes: budget,
            },
        )?;
        // A valid frame right after what SQLite published: a commit being published, or
        // one whose writer died before it could be. Look again soon, not at the next event.
        self.unpublished = if found.stop == Stop::End
            && found.end.frame >= end
            && wal::continues(f, &found.end)?
        {
            match self.unpublished {
                Some((at, n)) if at == found.end => Some((at, n + 1)),
                _ => Some((found.end, 0)),
            }
        } else {
            None
        };
        self.scan = Some(found.end);
        self.scan_stop = found.stop;
        let now = Instant::now();
        let observed_ms = wall_ms();
        for txn in found.txns {
            if let Some(c) = txn.page1_counters.iter().max() {
                self.st.counters = Some(match self.st.counters {
                    Some((lo, hi)) => (lo, hi.max(*c)),
                    None => (*c, *c),
                });
            }
            let seq = self.next_seq;
            self.next_seq += 1;
            if seq <= self.acked {
                // The receiver already holds it (we restarted behind it). Whether it holds
                // *this* history shows at the last one it holds: the checksum there covers
                // everything before it. After a primary power loss the same seqs can name
                // other transactions.
                if seq == self.acked && !same_history(pack(txn.end.checksum), self.acked_checksum) {
                    tracing::warn!(db = %self.name, seq, "the receiver holds another history than this WAL (a lost tail rewritten?)");
                    self.forked = true;
                    return Ok(());
                }
                self.st.acked_seq = seq;
                self.st.cursor = Some(txn.end);
                self.dirty = true;
                continue;
            }
            self.unacked_bytes += txn.page_bytes();
            self.unacked.push_back(Unacked {
                seq,
                txn,
                observed_ms,
                seen: now,
            });
        }
        Ok(())
    }

    /// docs/ship.md §3.3 rule 5: the main file's change counter must be one we saw.
    fn check_counters(&mut self) -> Result<Result<(), BaseReason>, StepError> {
        if self.counters_at.elapsed() < IDENTITY_INTERVAL {
            return Ok(Ok(()));
        }
        self.counters_at = Instant::now();
        let Some(now) = main_counter(&self.header_fd)? else {
            return Ok(Ok(()));
        };
        match self.st.counters {
            None => self.st.counters = Some((now, now)),
            Some((lo, hi)) if lo <= now && now <= hi => {
                if now != lo {
                    self.st.counters = Some((now, hi));
                }
            }
            Some((lo, hi)) => {
                tracing::warn!(db = %self.name, counter = now, lo, hi, "the main file's change counter is not one this shipper saw: the file was overwritten");
                return Ok(Err(BaseReason::Replaced));
            }
        }
        Ok(Ok(()))
    }

    fn over_cap(&mut self) -> Result<bool, StepError> {
        if self.cap_at.elapsed() < IDENTITY_INTERVAL {
            return Ok(false);
        }
        self.cap_at = Instant::now();
        let Some(cursor) = self.scan else {
            return Ok(false);
        };
        let wal_len = self
            .wal
            .as_ref()
            .map(|(_, f)| quiet::fstat(f).map(|m| m.len))
            .transpose()?
            .unwrap_or(0);
        // Frames not scanned count only while the scan is held back by its budget: then
        // the file's length past the cursor is WAL still to ship. Otherwise the scan
        // reached the cycle's end, and the file's length says nothing (a reset keeps the
        // file, with frames of older cycles past the current one's end).
        let unscanned = if self.scan_stop == Stop::Budget {
            wal_len.saturating_sub(wal::frame_offset(cursor.page_size, cursor.frame + 1))
        } else {
            0
        };
        let unacked_wal: u64 = self.unacked.iter().map(|u| u.txn.wal_bytes).sum();
        Ok(unacked_wal + unscanned > self.config.wal_max_bytes)
    }

    /// Fold when the WAL holds enough frames and nothing waiting to ship still needs it:
    /// every transaction not yet acknowledged is held in memory (a large one kept as frame
    /// references keeps the WAL), and the scan reached the WAL's end. Under sustained load
    /// the shipper is never fully idle, and waiting for that would let the WAL grow to the
    /// cap; folding what is already held costs nothing.
    ///
    /// But only while requests come back quickly and little is outstanding: the fold runs
    /// on another thread, and if this one then sits in a slow request, the app can reset
    /// the WAL and write past our cursor before the next step proves the reset, which then
    /// costs a base. A slow peer postpones folds instead (the WAL cap still bounds it).
    fn may_fold(&self) -> bool {
        let Some(cursor) = self.scan else {
            return false;
        };
        let tried = self
            .fold_tried
            .is_some_and(|(c, at)| c == cursor && at.elapsed() < FOLD_RETRY);
        self.unacked
            .iter()
            .all(|u| matches!(u.txn.pages, Pages::Inline(_)))
            && self.scan_stop == Stop::End
            && cursor.frame >= self.config.fold_min_frames
            && !self.fold_state.busy.load(Ordering::SeqCst)
            && self.last_request <= FOLD_RTT_MAX
            && self.backing_off().is_none()
            && self.unacked_bytes <= FOLD_UNACKED_MAX
            && !tried
    }

    /// Fold the WAL (docs/ship.md §3.5) on the folder thread. The proof of a later step
    /// covers whatever the checkpoint copies and whatever reset follows.
    fn fold(&mut self) -> Result<(), StepError> {
        self.save()?;
        let cursor = self.scan.expect("may_fold checked");
        tracing::debug!(db = %self.name, frame = cursor.frame, "fold requested");
        if self.folder.request(
            &self.path,
            self.db.ino,
            Some(cursor.salts),
            &self.fold_state,
        ) {
            self.fold_tried = Some((cursor, Instant::now()));
        }
        Ok(())
    }

    /// While a base is owed nothing in the WAL needs keeping: fold it (at most every
    /// `OWING_FOLD_INTERVAL`) so it stays bounded however long the peer is away.
    fn fold_while_owing(&mut self) -> Result<(), StepError> {
        if self
            .owing_fold_at
            .is_some_and(|at| at.elapsed() < OWING_FOLD_INTERVAL)
        {
            return Ok(());
        }
        let page_size = self.main_page_size();
        let frames = match self.wal_file()? {
            Some(f) => quiet::fstat(f)?.len / wal::frame_bytes(page_size),
            None => 0,
        };
        if frames >= self.config.fold_min_frames as u64 {
            self.folder
                .request(&self.path, self.db.ino, None, &self.fold_state);
            self.owing_fold_at = Some(Instant::now());
        }
        Ok(())
    }

    fn save_if_due(&mut self) -> Result<(), StepError> {
        if self.dirty && self.saved_at.elapsed() >= STATE_SAVE_INTERVAL {
            self.save()?;
        }
        Ok(())
    }

    /// Persist the state now.
    pub fn save(&mut self) -> Result<(), StepError> {
        self.st.db = Some(self.db);
        self.st.published = self.st.cursor.and_then(|c| {
            let frame = self.published_end(c.salts);
            (frame > 0).then_some(crate::sqlite::WalIndexEnd {
                salts: c.salts,
                frame,
            })
        });
        state::save(&self.state_path, &self.st)?;
        self.dirty = false;
        self.saved_at = Instant::now();
        Ok(())
    }

    /// Build and send one batch of records.
    fn ship(&mut self, client: &Client) -> Result<Next, StepError> {
        let (body, txns, page_bytes) = match self.build_batch()? {
            Ok(b) => b,
            Err(reason) => {
                self.owe_base(reason);
                return Ok(Next::Again);
            }
        };
        let q = TxnsQuery {
            epoch: self.st.epoch.0,
            generation: self.st.generation,
            page_size: self.page_size(),
        };
        let sent_at = Instant::now();
        let reply = client.send_txns(&self.name, q, &body);
        self.last_request = sent_at.elapsed();
        tracing::debug!(db = %self.name, txns, bytes = body.len(), ms = self.last_request.as_secs_f64() * 1e3, ok = reply.is_ok(), "request");
        let reply = reply.map_err(|e| StepError::Peer(e.0))?;
        self.stats.requests += 1;
        match reply {
            Reply::Ok(pos) => {
                self.stats.body_bytes_shipped += body.len() as u64;
                self.stats.page_bytes_shipped += page_bytes;
                self.stats.transactions_shipped += txns;
                self.on_position(&pos)?;
                Ok(Next::Sent)
            }
            Reply::Refused { status, refusal } => self.on_refusal(status, refusal),
        }
    }

    fn page_size(&self) -> u32 {
        self.scan
            .map(|c| c.page_size)
            .unwrap_or_else(|| self.main_page_size())
    }

    fn main_page_size(&self) -> u32 {
        self.main
            .query_row("PRAGMA page_size", [], |r| r.get(0))
            .unwrap_or(4096)
    }

    /// Records from `acked + 1` (part `resume_part`) up to `batch_bytes_max`.
    #[allow(clippy::type_complexity)]
    fn build_batch(&mut self) -> Result<Result<(Vec<u8>, u64, u64), BaseReason>, StepError> {
        let page_size = self.page_size();
        let pages_per_part = (PART_BYTES_MAX / page_size as usize).max(1);
        let mut body = Vec::new();
        let (mut txns, mut page_bytes) = (0u64, 0u64);
        let f = self.wal.as_ref().map(|(_, f)| f);
        'txns: for u in &self.unacked {
            let first_part = if u.seq == self.acked + 1 {
                self.resume_part as usize
            } else {
                0
            };
            let read_back;
            let pages: Vec<(u32, &[u8])> = match &u.txn.pages {
                Pages::Inline(p) => p.iter().map(|(n, d)| (*n, &d[..])).collect(),
                Pages::Frames(_) => {
                    read_back = match page_list(&u.txn, f)? {
                        Some(p) => p,
                        None => return Ok(Err(BaseReason::Rewritten)),
                    };
                    read_back.iter().map(|(n, d)| (*n, &d[..])).collect()
                }
            };
            let chunks: Vec<&[(u32, &[u8])]> = if pages.is_empty() {
                vec![&pages[..]]
            } else {
                pages.chunks(pages_per_part).collect()
            };
            for (part, chunk) in chunks.iter().enumerate().skip(first_part) {
                let len = proto::record_bytes(page_size, chunk.len());
                if !body.is_empty() && body.len() + len > self.batch_bytes_max {
                    break 'txns;
                }
                let last = part + 1 == chunks.len();
                let h = RecordHeader {
                    seq: u.seq,
                    part: part as u32,
                    last,
                    commit_pages: if last { u.txn.commit_size } else { 0 },
                    page_count: chunk.len() as u32,
                    observed_ms: u.observed_ms,
                    wal_checksum: pack(u.txn.end.checksum),
                };
                proto::encode_record(&mut body, &h, chunk.iter().copied());
                page_bytes += chunk.len() as u64 * page_size as u64;
                if last {
                    txns += 1;
                }
            }
        }
        Ok(Ok((body, txns, page_bytes)))
    }

    fn on_position(&mut self, pos: &Position) -> Result<(), StepError> {
        if pos.generation != self.st.generation || pos.epoch != self.st.epoch {
            self.owe_base(BaseReason::PeerLost);
            return Ok(());
        }
        if pos.seq < self.acked {
            tracing::warn!(db = %self.name, held = pos.seq, acked = self.acked, "the receiver holds less than it acknowledged");
            self.owe_base(BaseReason::PeerLost);
            return Ok(());
        }
        self.acked = pos.seq;
        self.acked_checksum = pos.checksum;
        self.resume_part = pos.pending_part;
        self.stats.last_ack_ms = Some(wall_ms());
        self.stats.failures = 0;
        self.stats.last_error = None;
        self.retry_at = None;
        while self.unacked.front().is_some_and(|u| u.seq <= self.acked) {
            let u = self.unacked.pop_front().expect("checked");
            if u.seq == self.acked && !same_history(pack(u.txn.end.checksum), pos.checksum) {
                tracing::warn!(db = %self.name, seq = u.seq, "the receiver's transaction {} is not ours: its history forked", u.seq);
                self.owe_base(BaseReason::PeerLost);
                return Ok(());
            }
            self.unacked_bytes -= u.txn.page_bytes();
            self.st.acked_seq = u.seq;
            self.st.cursor = Some(u.txn.end);
            self.dirty = true;
        }
        Ok(())
    }

    fn on_refusal(&mut self, status: u16, refusal: Refusal) -> Result<Next, StepError> {
        match refusal.code {
            Code::Fenced => {
                tracing::error!(db = %self.name, "{}", refusal.error);
                self.stats.last_error = Some(refusal.error.clone());
                self.fenced = Some(refusal.error);
                Ok(Next::Fenced)
            }
            Code::NeedsBase => {
                self.owe_base(BaseReason::PeerLost);
                Ok(Next::Again)
            }
            Code::Behind => match refusal.position {
                Some(pos) if pos.generation == self.st.generation && pos.seq >= self.acked => {
                    self.on_position(&pos)?;
                    Ok(Next::Again)
                }
                _ => {
                    self.owe_base(BaseReason::PeerLost);
                    Ok(Next::Again)
                }
            },
            Code::TooLarge if self.batch_bytes_max > PART_BYTES_MAX => {
                self.batch_bytes_max = (self.batch_bytes_max / 2).max(PART_BYTES_MAX);
                Ok(Next::Again)
            }
            _ => Err(StepError::Peer(format!(
                "receiver refused (HTTP {status}): {}",
                refusal.error
            ))),
        }
    }

    /// Take a base and send it (docs/ship.md §3.6).
    fn send_base(&mut self, client: &Client) -> Result<Next, StepError> {
        let reason = self.pending_reason.unwrap_or(BaseReason::First);
        let snap = self.snapshot()?;
        let result = self.send_snapshot(client, &snap, reason);
        let _ = self.main.execute_batch("ROLLBACK");
        self.progress.clear();
        result
    }

    fn send_snapshot(
        &mut self,
        client: &Client,
        snap: &Snapshot,
        reason: BaseReason,
    ) -> Result<Next, StepError> {
        let generation = ferry_core::seams::random_nonzero_u64();
        self.st = ShipState {
            version: state::VERSION,
            epoch: self.st.epoch,
            generation,
            acked_seq: 0,
            cursor: snap.cursor,
            main: if snap.cursor.is_none() {
                Some(snap.fingerprint)
            } else {
                None
            },
            db: Some(self.db),
            needs_base: true,
            counters: snap.counters,
            // The snapshot was pinned at the end SQLite had published.
            published: snap.cursor.map(|c| crate::sqlite::WalIndexEnd {
                salts: c.salts,
                frame: c.frame,
            }),
        };
        self.save()?;
        let header = BaseHeader {
            page_size: snap.page_size,
            page_count: snap.page_count,
            epoch: self.st.epoch,
            generation,
            seq: 0,
            observed_ms: wall_ms(),
            wal_checksum: snap.cursor.map_or(0, |c| pack(c.checksum)),
        };
        let total = header.stream_bytes();
        tracing::info!(db = %self.name, reason = reason.as_str(), pages = snap.page_count, bytes = total, "sending a base");
        self.progress.start(total);
        let mut reader = BaseReader::new(&self.main, header, self.progress.clone());
        let started = Instant::now();
        let reply = client
            .send_base(
                &self.name,
                EpochQuery {
                    epoch: self.st.epoch.0,
                    generation,
                },
                total,
                &mut reader,
            )
            .map_err(|e| StepError::Peer(e.0))?;
        if let Some(e) = reader.error.take() {
            return Err(StepError::Io(e));
        }
        match reply {
            Reply::Ok(pos) if pos.generation == generation => {
                // Position first, then the durable flag: if saving fails, the base is
                // owed again rather than shipping from a cursor the base already covers.
                self.st.needs_base = false;
                if let Err(e) = self.save() {
                    self.st.needs_base = true;
                    return Err(e);
                }
                self.scan = snap.cursor;
                self.scan_stop = Stop::End;
                self.unpublished = None;
                self.unacked.clear();
                self.unacked_bytes = 0;
                self.next_seq = 1;
                self.acked = 0;
                self.resume_part = 0;
                self.pending_reason = None;
                self.fold_tried = None;
                self.probed = true;
                self.acked_checksum = pack(snap.cursor.map_or(wal::Checksum(0, 0), |c| c.checksum));
                *self.stats.bases.entry(reason.as_str()).or_default() += 1;
                self.stats.base_bytes += total;
                self.stats.failures = 0;
                self.retry_at = None;
                self.stats.last_error = None;
                self.stats.last_ack_ms = Some(wall_ms());
                tracing::info!(db = %self.name, reason = reason.as_str(), bytes = total, secs = started.elapsed().as_secs_f64(), "base installed on the receiver");
                Ok(Next::Again)
            }
            Reply::Ok(pos) => Err(StepError::Peer(format!(
                "the receiver answered the base with generation {:#x}, not {generation:#x}",
                pos.generation
            ))),
            Reply::Refused { status, refusal } if refusal.code == Code::Fenced => {
                self.on_refusal(status, refusal)
            }
            Reply::Refused { status, refusal } => Err(StepError::Peer(format!(
                "receiver refused the base (HTTP {status}): {}",
                refusal.error
            ))),
        }
    }

    /// Pin a read snapshot at a known WAL position (docs/ship.md §3.6 steps 1–3). The
    /// read transaction on `main` stays open; the caller ends it.
    fn snapshot(&mut self) -> Result<Snapshot, StepError> {
        // Read most of the WAL before taking the write lock, so writers wait only for the
        // tail that arrives meanwhile.
        let pre = Some(self.scan_to_end(None, false)?);
        self.barrier.execute_batch("BEGIN IMMEDIATE")?;
        let pinned = (|| -> Result<Snapshot, StepError> {
            let (cursor, counters) = self.scan_to_end(pre, true)?;
            self.main.execute_batch("BEGIN")?;
            self.main
                .query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))?;
            let page_count: u32 = self.main.query_row("PRAGMA page_count", [], |r| r.get(0))?;
            let page_size: u32 = self.main.query_row("PRAGMA page_size", [], |r| r.get(0))?;
            let counter = main_counter(&self.header_fd)?;
            let counters = match (counter, counters) {
                (Some(c), Some((_, hi))) => Some((c, hi.max(c))),
                (Some(c), None) => Some((c, c)),
                (None, x) => x,
            };
            Ok(Snapshot {
                cursor,
                counters,
                page_count,
                page_size,
                fingerprint: fingerprint(&self.path)?,
            })
        })();
        let _ = self.barrier.execute_batch("ROLLBACK");
        if pinned.is_err() {
            let _ = self.main.execute_batch("ROLLBACK");
        }
        pinned
    }

    /// Scan the current WAL cycle to the end of what SQLite published, keeping only
    /// positions (no page images). Continues from `from` when the cycle is the same and its
    /// cursor still holds. `pinned`: the caller holds the write lock, so that end stands
    /// still and must be read from the wal-index itself, naming this cycle: it is where
    /// the snapshot that follows will read.
    fn scan_to_end(&mut self, from: Option<Tail>, pinned: bool) -> Result<Tail, StepError> {
        let Some(f) = self.wal_file()? else {
            return Ok((None, None));
        };
        let Some(Ok(h)) = wal::read_header(f)? else {
            return Ok((None, None));
        };
        if pinned {
            match crate::sqlite::wal_index_end(&self.main) {
                // Nothing published: the snapshot reads the main file alone, and whatever
                // the WAL holds (a writer's frames spilled and rolled back, or one that died
                // starting a cycle) is not in it; frames to come start a cycle of their own.
                Some(now) if now.frame == 0 => return Ok((None, None)),
                Some(now) if now.salts == h.salts => {}
                _ => {
                    return Err(StepError::Io(io::Error::other(
                        "SQLite's wal-index cannot be read, or names another cycle than the WAL \
                         with frames published; retrying",
                    )));
                }
            }
        }
        let end = self.published_end(h.salts);
        let f = self
            .wal
            .as_ref()
            .map(|(_, f)| f)
            .expect("wal_file opened it");
        let (mut cursor, mut counters) = (h.start(), None);
        if let Some((Some(c), cs)) = from
            && c.salts == h.salts
            && wal::cursor_holds(f, &c)?
        {
            cursor = c;
            counters = cs;
        }
        let limits = ScanLimits {
            txn_inline_bytes_max: 0,
            budget_bytes: u64::MAX,
        };
        let published = wal::Upto {
            src: f,
            len: wal::frame_offset(h.page_size, end.max(cursor.frame) + 1),
        };
        let found = wal::scan(&published, &cursor, limits)?;
        for t in &found.txns {
            for c in &t.page1_counters {
                counters = Some(match counters {
                    Some((lo, hi)) => (lo.min(*c), hi.max(*c)),
                    None => (*c, *c),
                });
            }
        }
        Ok((Some(found.end), counters))
    }

    /// Status of this database.
    pub fn status(&self) -> super::DbStatus {
        let now = Instant::now();
        let head = self.next_seq.saturating_sub(1).max(self.acked);
        super::DbStatus {
            name: self.name.clone(),
            state: if self.fenced.is_some() {
                "fenced"
            } else if self.st.needs_base {
                "base owed"
            } else if self.stats.failures > 0 {
                "retrying"
            } else if self.unacked.is_empty() {
                "idle"
            } else {
                "shipping"
            }
            .to_string(),
            epoch: self.st.epoch,
            generation: self.st.generation,
            acked_seq: self.acked,
            head_seq: head,
            lag_transactions: self.unacked.len() as u64,
            lag_bytes: self.unacked.iter().map(|u| u.txn.wal_bytes).sum(),
            lag_seconds: self
                .unacked
                .front()
                .map_or(0.0, |u| now.duration_since(u.seen).as_secs_f64()),
            wal_bytes: quiet::stat(&self.wal_path).map(|m| m.len).unwrap_or(0),
            failures: self.stats.failures,
            last_error: self.stats.last_error.clone(),
            bases: self
                .stats
                .bases
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
            folds: self.fold_state.complete.load(Ordering::Relaxed),
            transactions_shipped: self.stats.transactions_shipped,
            body_bytes_shipped: self.stats.body_bytes_shipped,
            page_bytes_shipped: self.stats.page_bytes_shipped,
            base_bytes_shipped: self.stats.base_bytes,
            base_progress: None,
            last_ack_ms: self.stats.last_ack_ms,
        }
    }
}

/// The end of a WAL scan and the page-1 change counters seen on the way.
type Tail = (Option<Cursor>, Option<(u32, u32)>);

/// What a base snapshot pinned.
struct Snapshot {
    cursor: Option<Cursor>,
    counters: Option<(u32, u32)>,
    page_count: u32,
    page_size: u32,
    fingerprint: Fingerprint,
}

/// The outcome of §3.3 rule 4.
enum Proof {
    /// The old cycle ended exactly at the cursor: continue in the new one.
    Clean,
    /// The old cycle still holds valid frames after the cursor: read them first.
    OldCycleGoesOn,
    /// Not provable; why, for the log.
    Unproven(BaseReason, String),
}

/// docs/ship.md §3.3 rule 4: did the old cycle end exactly at `cursor` before the reset
/// that started the cycle `h` names?
///
/// The order of the reads matters. The file's length and slot P+1 are read first, the
/// new cycle's reach after, and the header last: the new cycle only grows, so not having
/// reached slot P after slot P+1 was read proves it had not reached that slot when it
/// was read, and an unchanged header proves no further reset happened meanwhile.
fn prove_new_cycle(f: &File, cursor: &Cursor, h: &Header) -> io::Result<Proof> {
    if h.page_size != cursor.page_size {
        return Ok(Proof::Unproven(
            BaseReason::PageSize,
            format!("page size {} → {}", cursor.page_size, h.page_size),
        ));
    }
    // One reset by a writer increments salt-1; anything else (two resets, a reset by a
    // connection that never reset before) gives another value.
    if h.salts.0 != cursor.salts.0.wrapping_add(1) {
        return Ok(Proof::Unproven(
            BaseReason::Reset,
            format!(
                "salt-1 went from {:#x} to {:#x}, not by one reset",
                cursor.salts.0, h.salts.0
            ),
        ));
    }
    let p = cursor.frame;
    let frames_in_file = (quiet::fstat(f)?
        .len
        .saturating_sub(wal::HEADER_BYTES as u64)
        / cursor.frame_bytes()) as u32;
    if frames_in_file < p {
        return Ok(Proof::Unproven(
            BaseReason::Reset,
            format!("the WAL was truncated to {frames_in_file} frames, below our cursor {p}"),
        ));
    }
    // Slot P+1, if the file has one: does the old cycle go on there?
    let goes_on = frames_in_file > p && wal::continues(f, cursor)?;
    // If it does, the caller reads on and bounds the new cycle by where the old one ended.
    // If not, the new cycle must not have reached our cursor's slot by now (or it may have
    // overwritten slot P+1 before it was read, or fill a file truncated and grown again to
    // end there): it only grows, so not reached now means not reached then.
    if !goes_on && (p == 0 || wal::reached(f, h, p)?) {
        return Ok(Proof::Unproven(
            BaseReason::Reset,
            format!("the new cycle reached our cursor's slot {p}"),
        ));
    }
    if wal::read_header(f)?.and_then(|x| x.ok()).as_ref() != Some(h) {
        return Ok(Proof::Unproven(
            BaseReason::Reset,
            "the WAL was reset again while the reset was being proved".into(),
        ));
    }
    Ok(if goes_on {
        Proof::OldCycleGoesOn
    } else {
        Proof::Clean
    })
}

/// Read the WAL header; if it does not validate while the file holds one, read again a
/// few times: a writer starting a new cycle rewrites the header, and a read can land in
/// the middle of that write. Only a header that stays invalid is treated as one (a
/// spurious "reset" would cost a base).
fn read_header_settled(f: &File) -> io::Result<Option<Header>> {
    for attempt in 0..HEADER_READS {
        match wal::read_header(f)? {
            Some(Ok(h)) => return Ok(Some(h)),
            None => return Ok(None),
            Some(Err(_)) if attempt + 1 < HEADER_READS => {
                std::thread::sleep(Duration::from_millis(1))
            }
            Some(Err(_)) => {}
        }
    }
    Ok(None)
}

/// Reads of a WAL header that does not validate before believing it.
const HEADER_READS: u32 = 3;

/// The pages of a transaction in page order, read back and verified if it was kept as
/// frame references; None if a frame no longer validates.
fn page_list(txn: &Txn, wal: Option<&File>) -> io::Result<Option<wal::PageImages>> {
    match &txn.pages {
        Pages::Inline(p) => Ok(Some(p.clone())),
        Pages::Frames(refs) => {
            let Some(f) = wal else { return Ok(None) };
            let mut out = Vec::with_capacity(refs.len());
            for (pgno, r) in refs {
                match wal::read_verified(f, r)? {
                    Some(page) => out.push((*pgno, page)),
                    None => return Ok(None),
                }
            }
            Ok(Some(out))
        }
    }
}

/// A checksum as the wire carries it.
fn pack(c: wal::Checksum) -> u64 {
    ((c.0 as u64) << 32) | c.1 as u64
}

/// Does the receiver's checksum for a transaction match ours? 0 means the receiver does
/// not know (it has held nothing since its base was taken from an empty WAL).
fn same_history(ours: u64, theirs: u64) -> bool {
    theirs == 0 || ours == theirs
}

/// The main file's size and modification time. Only read around a base with an empty WAL,
/// so asking for the mtime (see `quiet`) costs the app nothing measurable.
fn fingerprint(path: &Path) -> io::Result<Fingerprint> {
    let m = std::fs::metadata(path)?;
    Ok(Fingerprint {
        len: m.len(),
        mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
    })
}

/// The change counter in the main file's header, read through a descriptor that is
/// never closed; None if the file is shorter than a header (a new, empty database).
fn main_counter(fd: &File) -> io::Result<Option<u32>> {
    let mut b = [0u8; 28];
    match fd.read_exact_at(&mut b, 0) {
        Ok(()) => Ok(Some(u32::from_be_bytes(
            b[24..28].try_into().expect("4 bytes"),
        ))),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(e),
    }
}

/// The `-shm` file now beside the database file at `path`.
fn shm_id(path: &Path) -> Option<FileId> {
    quiet::stat(&crate::names::sidecar(path, "-shm"))
        .ok()
        .map(|m| FileId {
            dev: m.dev,
            ino: m.ino,
        })
}

/// A read-only descriptor on a main database file, one per inode, never closed: closing
/// any descriptor of a file drops every POSIX lock this process holds on it, SQLite's
/// included (sqlite.org howtocorrupt.html §2.2).
fn main_fd(path: &Path) -> io::Result<Arc<File>> {
    type ByInode = BTreeMap<(u64, u64), Arc<File>>;
    static FDS: OnceLock<Mutex<ByInode>> = OnceLock::new();
    let meta = quiet::stat(path)?;
    let key = (meta.dev, meta.ino);
    let mut fds = FDS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(f) = fds.get(&key) {
        return Ok(f.clone());
    }
    let f = Arc::new(quiet::open(path)?);
    fds.insert(key, f.clone());
    Ok(f)
}

/// Streams a base: header, pages from `sqlite_dbpage` in the pinned read transaction,
/// trailer.
struct BaseReader<'c> {
    conn: &'c Connection,
    header: BaseHeader,
    head: Vec<u8>,
    next_pgno: u32,
    crc: u32,
    buf: Vec<u8>,
    at: usize,
    done: bool,
    progress: Arc<BaseProgress>,
    error: Option<io::Error>,
}

impl<'c> BaseReader<'c> {
    fn new(conn: &'c Connection, header: BaseHeader, progress: Arc<BaseProgress>) -> Self {
        BaseReader {
            conn,
            head: header.encode().to_vec(),
            header,
            next_pgno: 1,
            crc: 0,
            buf: Vec::new(),
            at: 0,
            done: false,
            progress,
            error: None,
        }
    }

    fn refill(&mut self) -> io::Result<()> {
        self.at = 0;
        if !self.head.is_empty() {
            self.buf = std::mem::take(&mut self.head);
            return Ok(());
        }
        if self.next_pgno <= self.header.page_count {
            let page: Vec<u8> = self
                .conn
                .prepare_cached("SELECT data FROM sqlite_dbpage WHERE pgno = ?1")
                .and_then(|mut s| s.query_row([self.next_pgno], |r| r.get(0)))
                .map_err(|e| {
                    io::Error::other(format!("reading page {} for the base: {e}", self.next_pgno))
                })?;
            if page.len() != self.header.page_size as usize {
                return Err(io::Error::other(format!(
                    "page {} has {} bytes, not {}",
                    self.next_pgno,
                    page.len(),
                    self.header.page_size
                )));
            }
            self.crc = crc32c::crc32c_append(self.crc, &page);
            self.buf = page;
            self.next_pgno += 1;
            return Ok(());
        }
        if !self.done {
            self.done = true;
            self.buf = proto::base_trailer(self.crc).to_vec();
            return Ok(());
        }
        self.buf.clear();
        Ok(())
    }
}

impl Read for BaseReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.at >= self.buf.len() {
            if let Err(e) = self.refill() {
                self.error = Some(io::Error::new(e.kind(), e.to_string()));
                return Err(e);
            }
            if self.buf.is_empty() {
                return Ok(0);
            }
        }
        let n = out.len().min(self.buf.len() - self.at);
        out[..n].copy_from_slice(&self.buf[self.at..self.at + n]);
        self.at += n;
        self.progress.sent.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Progress of a base in flight, readable by status while the step runs.
#[derive(Debug, Default)]
pub struct BaseProgress {
    pub sent: AtomicU64,
    /// 0 when no base is in flight.
    pub total: AtomicU64,
}

impl BaseProgress {
    fn start(&self, total: u64) {
        self.sent.store(0, Ordering::Relaxed);
        self.total.store(total, Ordering::Relaxed);
    }
    fn clear(&self) {
        self.total.store(0, Ordering::Relaxed);
    }
    /// `(sent, total)` while a base is in flight.
    pub fn get(&self) -> Option<(u64, u64)> {
        let total = self.total.load(Ordering::Relaxed);
        (total > 0).then(|| (self.sent.load(Ordering::Relaxed), total))
    }
}
