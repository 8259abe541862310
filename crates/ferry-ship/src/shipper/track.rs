//! One shipped database (docs/ship.md §3): the step that proves, scans, ships and folds.
//!
//! A step:
//! 1. Check the file is the one we track (`files`: dev, inode); a new one owes a base.
//! 2. Prove the WAL continues what we read (`proof`, §3.3) and scan new committed
//!    transactions into the queue (`batch`). Anything unproven owes a base.
//! 3. Owing a base: take one (`base`, §3.6) and send it.
//! 4. Ship unacknowledged transactions, one request in flight (`batch`).
//! 5. Past the WAL cap with the peer away: give up on the lineage, fold, owe a base.
//! 6. Enough frames and nothing waiting needs them: fold the WAL (`fold_policy`, §3.5).
//!
//! Persisted: `ShipState`, a hint written after a base, before a fold, about once a second
//! while shipping, and at shutdown. A crash anywhere leaves either a state the next run
//! can re-prove against the WAL, or one that leads to a base.

use super::base::{BaseOwed, BaseProgress, BaseReason};
use super::batch::{Acked, Batch, Unacked, pack, same_history};
use super::client::{Client, Reply};
use super::error::StepError;
use super::files::{Files, Identity, STALE_SIDECAR_RECHECK, STALE_SIDECAR_WAIT, fingerprint};
use super::fold::{FoldState, Folder};
use super::fold_policy::{self, FoldPolicy, FoldView};
use super::limits::TXN_INLINE_BYTES_MAX;
use super::proof::{self, Proof, ProofState, Unproven};
use crate::proto::{Code, Position, Refusal, TxnsQuery};
use crate::quiet;
use crate::ship_state::{self as state, ShipState};
use crate::sqlite::WalIndexEnd;
use crate::wal::{self, Cursor, ScanLimits, Stop};
use ferry_core::backoff::Backoff;
use ferry_core::epoch::Epoch;
use ferry_core::seams::{Clock, SplitMix64};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Save the state at most this often while shipping: a restart then rescans at most a
/// second of WAL, and the primary's disk sees one small fsync a second from us.
const STATE_SAVE_INTERVAL: Duration = Duration::from_secs(1);
/// Retries after failures: 50 ms doubling to 2 s, full jitter. A retry is one small
/// request (or a refused connect), so a short cap costs the peer nothing while it is away
/// and lets the standby catch up within a couple of seconds of its return; with a 30 s cap
/// a ten-second outage could leave it behind for another twenty.
const BACKOFF: Backoff = Backoff::new(
    Duration::from_millis(50),
    Duration::from_secs(2),
    Duration::from_millis(10),
);
/// Before the receiver's position is known, a database with transactions waits this long
/// between steps (the probe runs at the start of each).
const PROBE_WAIT: Duration = Duration::from_millis(50);

/// Settings of a tracked database.
#[derive(Clone)]
pub struct TrackConfig {
    /// WAL bytes not acknowledged beyond which the lineage is given up (fold, base).
    pub wal_max_bytes: u64,
    /// The WAL is folded only when it holds at least this many frames.
    pub fold_min_frames: u32,
    /// Ship with at least this epoch.
    pub epoch: Option<Epoch>,
    /// Time for every deadline, interval and stamp of the track.
    pub clock: Arc<dyn Clock>,
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
    /// Steps run since the track opened.
    pub steps: u64,
}

/// One tracked database.
pub struct Track {
    pub name: String,
    /// The files and the handles on them (rule 1 of the proof).
    pub(super) files: Files,
    /// The persisted part: epoch, generation, the acknowledged seq and its cursor.
    pub(super) st: ShipState,
    state_path: PathBuf,
    /// `st` changed since it was saved, at `saved_at`.
    dirty: bool,
    saved_at: Instant,
    /// Where the scan stands and what the continuity proof keeps between steps.
    pub(super) proof: ProofState,
    /// The transactions waiting for the receiver, and where it stands.
    pub(super) batch: Batch,
    /// When to fold; the folder thread that does it, and what it says back.
    pub(super) fold: FoldPolicy,
    folder: Arc<Folder>,
    fold_state: Arc<FoldState>,
    /// Why a base is owed, and the progress of one in flight.
    pub(super) base: BaseOwed,
    /// The receiver fenced this primary: the refusal, for status.
    fenced: Option<String>,
    /// After a failure, no request goes out before this.
    pub(super) retry_at: Option<Instant>,
    config: TrackConfig,
    pub(super) rng: SplitMix64,
    pub stats: TrackStats,
}

impl Track {
    /// Open a database for shipping. `dir` is the shipper's directory.
    pub fn open(
        dir: &Path,
        name: &str,
        config: TrackConfig,
        progress: Arc<BaseProgress>,
        folder: Arc<Folder>,
        fold_state: Arc<FoldState>,
    ) -> Result<Track, StepError> {
        let now = config.clock.now();
        let files = Files::open(dir.join(format!("{name}.db")), now)?;
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
        if st.db.is_some_and(|d| d != files.db) {
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
                    "the configured epoch {e} is below the epoch {} this database already ships with; keeping {}",
                    st.epoch,
                    st.epoch
                );
            }
        }
        Ok(Track {
            name: name.to_string(),
            files,
            state_path,
            dirty: false,
            saved_at: now,
            proof: ProofState::new(st.cursor, st.published, now),
            batch: Batch::new(st.acked_seq),
            fold: FoldPolicy::new(now),
            folder,
            fold_state,
            base: BaseOwed {
                reason: None,
                progress,
            },
            fenced: None,
            retry_at: None,
            rng: SplitMix64::from_entropy(),
            config,
            st,
            stats: TrackStats::default(),
        })
    }

    pub(super) fn now(&self) -> Instant {
        self.config.clock.now()
    }

    pub(super) fn wall_ms(&self) -> u64 {
        self.config.clock.wall_ms()
    }

    /// Run one step and say what comes next. Errors become a backoff and a status line.
    pub fn step(&mut self, client: &Client) -> Next {
        self.stats.steps += 1;
        match self.step_inner(client) {
            Ok(next) => next,
            Err(e) => Next::After(self.failed(&e)),
        }
    }

    fn step_inner(&mut self, client: &Client) -> Result<Next, StepError> {
        if self.fenced.is_some() {
            return Ok(Next::Fenced);
        }
        if self.files.reopen_due {
            if self.fold_state.forget.load(Ordering::SeqCst) {
                // The folder still holds its connections (see `failed`).
                return Ok(Next::After(STALE_SIDECAR_RECHECK));
            }
            self.reopen()?;
            self.files.reopen_due = false;
        }
        if let Some(next) = self.check_identity()? {
            return Ok(next);
        }
        if !self.st.needs_base && !self.batch.probed && self.backing_off().is_none() {
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
                .request(&self.files.path, self.files.db.ino, None, &self.fold_state);
            return Ok(Next::Again);
        }
        if self.may_fold() {
            self.fold()?;
        }
        if !self.batch.is_empty() {
            // While the peer is backed off, steps still run on every commit for the local
            // work above (scan, cap, folds while a base is owed): the WAL stays bounded.
            if let Some(wait) = self.backing_off() {
                return Ok(Next::After(wait));
            }
            if !self.batch.probed {
                // Nothing ships before the receiver's position is known and checked.
                return Ok(Next::After(PROBE_WAIT));
            }
            return self.ship(client);
        }
        self.save_if_due()?;
        Ok(if self.proof.stop == Stop::Budget {
            Next::Again
        } else if let Some(wait) = self.proof.recheck() {
            Next::After(wait)
        } else {
            Next::Idle
        })
    }

    /// Rule 1 (see `files`): Some(next) when the step stops here.
    fn check_identity(&mut self) -> Result<Option<Next>, StepError> {
        let now = self.now();
        match self.files.check_identity(now, self.st.needs_base)? {
            Identity::Same => {}
            Identity::Gone => return Ok(Some(Next::Gone)),
            Identity::Stale { files } => {
                let msg = format!(
                    "{}.db was replaced, but {files} still belong to the file it replaced: SQLite \
                     would read the new file through them; waiting for them to be removed",
                    self.name
                );
                if self.stats.last_error.as_deref() != Some(&msg) {
                    tracing::warn!(db = %self.name, "{msg}");
                }
                self.stats.last_error = Some(msg);
                return Ok(Some(Next::After(STALE_SIDECAR_RECHECK)));
            }
            Identity::StaleAnyway { files } => {
                tracing::warn!(db = %self.name, "{}.db was replaced but {files} of the file it replaced are still there after {STALE_SIDECAR_WAIT:?}: opening it anyway, as SQLite will for the app", self.name);
                self.reopen()?;
                self.owe_base(BaseReason::Replaced);
            }
            Identity::Replaced => {
                self.reopen()?;
                self.owe_base(BaseReason::Replaced);
            }
        }
        Ok(None)
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
            self.files.reopen_due = true;
            self.folder.forget(&self.files.path, &self.fold_state);
        }
        let msg = e.to_string();
        if self.stats.last_error.as_deref() != Some(&msg) || self.stats.failures == 1 {
            tracing::warn!(db = %self.name, failures = self.stats.failures, "{msg}");
        }
        self.stats.last_error = Some(msg);
        let delay = BACKOFF.delay(self.stats.failures, &mut self.rng);
        self.retry_at = Some(self.now() + delay);
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
                    self.batch.resume_part = pos.pending_part;
                } else {
                    self.batch.acked = pos.seq;
                    self.batch.acked_checksum = pos.checksum;
                    self.batch.resume_part = pos.pending_part;
                }
                self.batch.probed = true;
                Ok(())
            }
            Reply::Refused { refusal, .. } if refusal.code == Code::NotFound => {
                self.owe_base(BaseReason::PeerLost);
                self.batch.probed = true;
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
        self.backing_off_at(self.now())
    }

    fn backing_off_at(&self, now: Instant) -> Option<Duration> {
        self.retry_at
            .and_then(|at| at.checked_duration_since(now))
            .filter(|d| !d.is_zero())
    }

    pub(super) fn owe_base(&mut self, reason: BaseReason) {
        if !self.st.needs_base || self.base.reason.is_none() {
            tracing::info!(db = %self.name, reason = reason.as_str(), "a base is owed");
            self.base.reason = Some(reason);
        }
        self.st.needs_base = true;
        self.batch.clear();
    }

    fn reopen(&mut self) -> Result<(), StepError> {
        self.files.reopen()?;
        self.proof.chain_verified = false;
        Ok(())
    }

    /// Log why continuity was not proven; the base it owes.
    fn unproven(&self, u: Unproven) -> BaseReason {
        if u.reason == BaseReason::Reset {
            tracing::info!(db = %self.name, "WAL reset not provably clean: {}", u.why);
        } else {
            tracing::warn!(db = %self.name, reason = u.reason.as_str(), "{}", u.why);
        }
        u.reason
    }

    /// Prove continuity and scan (docs/ship.md §3.3). `Err(reason)` owes a base.
    fn advance(&mut self) -> Result<Result<(), BaseReason>, StepError> {
        loop {
            let header = match self.files.wal_file()? {
                Some(f) => super::files::read_header_settled(f)?,
                None => None,
            };
            let Some(cursor) = self.proof.scan else {
                // The WAL was empty at the base. A first cycle continues it only if no
                // checkpoint wrote the main file since (it would have folded frames we
                // never saw).
                let Some(h) = header else { return Ok(Ok(())) };
                if self.st.main.is_none() || self.st.main != Some(fingerprint(&self.files.path)?) {
                    return Ok(Err(BaseReason::Reset));
                }
                self.proof.scan = Some(h.start());
                continue;
            };
            let Some(h) = header else {
                // The WAL is gone, empty or its header invalid: frames after the cursor
                // may have been folded and dropped (TRUNCATE). Nothing proves otherwise.
                return Ok(Err(BaseReason::Reset));
            };
            let f = self.files.wal().expect("a header was read from it");
            if h.salts == cursor.salts {
                let verify = !self.proof.chain_verified;
                let files = &self.files;
                let index = || files.index_end();
                if let Err(u) = proof::same_cycle(f, &cursor, &h, verify, index)? {
                    return Ok(Err(self.unproven(u)));
                }
                self.proof.chain_verified = true;
                let end = self.published_end(cursor.salts);
                self.scan_more(cursor, false, end)?;
                if std::mem::take(&mut self.proof.forked) {
                    return Ok(Err(BaseReason::Rewritten));
                }
                return self.check_counters();
            }
            match proof::new_cycle(f, &cursor, &h)? {
                Proof::Clean => {
                    tracing::debug!(db = %self.name, from = cursor.frame, "WAL reset proven clean; continuing in the new cycle");
                    self.proof.scan = Some(h.start());
                }
                Proof::OldCycleGoesOn => {
                    // Read what the old cycle still holds past our cursor, as far as SQLite
                    // published it, then check the new cycle has not reached those slots
                    // while we read.
                    let seen = self.published_end(cursor.salts);
                    self.scan_more(cursor, true, seen)?;
                    let reached = self.proof.scan.expect("scan_more sets it");
                    let f = self.files.wal().expect("still open");
                    if !self.proof.forked && wal::continues(f, &reached)? {
                        let main = &*self.files.header_fd;
                        let Some(end) = proof::old_cycle_end(f, main, &reached)? else {
                            tracing::info!(db = %self.name, frame = reached.frame, "the old WAL cycle goes on past what SQLite was seen to publish, with a last commit the main file does not show");
                            return Ok(Err(BaseReason::Reset));
                        };
                        self.scan_more(reached, true, end)?;
                    }
                    if std::mem::take(&mut self.proof.forked) {
                        return Ok(Err(BaseReason::Rewritten));
                    }
                    let reached = self.proof.scan.expect("scan_more sets it");
                    let f = self.files.wal().expect("still open");
                    if let Err(u) = proof::old_cycle_ended(f, &h, &cursor, &reached)? {
                        return Ok(Err(self.unproven(u)));
                    }
                }
                Proof::Unproven(u) => return Ok(Err(self.unproven(u))),
            }
        }
    }

    /// The last frame of the cycle `salts` that SQLite has published: from the wal-index
    /// while it names that cycle, else the furthest it was seen to, by this track, by the
    /// folder's checkpoints or before a restart (`proof.published`); 0 if it never was.
    pub(super) fn published_end(&mut self, salts: wal::Salts) -> u32 {
        // While the index names the cycle, it is the truth (an end noted earlier may be of
        // an index since rebuilt smaller, after a power loss).
        if let Some(now) = self.files.index_end()
            && now.salts == salts
        {
            self.proof.published.note(now);
            return now.frame;
        }
        if let Some(frame) = self.fold_state.published(salts) {
            self.proof.published.note(WalIndexEnd { salts, frame });
        }
        self.proof.published.get(salts).unwrap_or(0)
    }

    /// Scan committed transactions after `from` up to frame `end` (what SQLite
    /// published), queueing them for shipping.
    fn scan_more(&mut self, from: Cursor, everything: bool, end: u32) -> Result<(), StepError> {
        let budget = if everything {
            u64::MAX
        } else {
            self.batch.budget()
        };
        if budget == 0 {
            self.proof.stop = Stop::Budget;
            return Ok(());
        }
        let f = self.files.wal().expect("callers opened the WAL");
        let limit = end.max(from.frame);
        let published = wal::Upto {
            src: f,
            len: wal::frame_offset(from.page_size, limit + 1),
        };
        let found = wal::scan(
            &published,
            &from,
            ScanLimits {
                txn_inline_bytes_max: TXN_INLINE_BYTES_MAX,
                budget_bytes: budget,
            },
        )?;
        assert!(
            found.end.salts == from.salts
                && from.frame <= found.end.frame
                && found.end.frame <= limit,
            "{}: a scan never goes backwards nor past what SQLite published (from frame {} to {}, published {limit})",
            self.name,
            from.frame,
            found.end.frame
        );
        // A valid frame right after what SQLite published: a commit being published, or
        // one whose writer died before it could be. Look again soon, not at the next event.
        let held_back =
            found.stop == Stop::End && found.end.frame >= end && wal::continues(f, &found.end)?;
        self.proof.note_unpublished(found.end, held_back);
        self.proof.scan = Some(found.end);
        self.proof.stop = found.stop;
        let now = self.now();
        let observed_ms = self.wall_ms();
        for txn in found.txns {
            if let Some(c) = txn.page1_counters.iter().max() {
                self.st.counters = Some(proof::raise_counters(self.st.counters, *c));
            }
            let seq = self.batch.take_seq();
            if seq <= self.batch.acked {
                // The receiver already holds it (we restarted behind it). Whether it holds
                // *this* history shows at the last one it holds: the checksum there covers
                // everything before it. After a primary power loss the same seqs can name
                // other transactions.
                if seq == self.batch.acked
                    && !same_history(pack(txn.end.checksum), self.batch.acked_checksum)
                {
                    tracing::warn!(db = %self.name, seq, "the receiver holds another history than this WAL (a lost tail rewritten?)");
                    self.proof.forked = true;
                    return Ok(());
                }
                self.record_acked(seq, txn.end);
                continue;
            }
            self.batch.push(Unacked {
                seq,
                txn,
                observed_ms,
                seen: now,
            });
        }
        Ok(())
    }

    /// The receiver holds transaction `seq`, which ends at `end`: the state may move there.
    fn record_acked(&mut self, seq: u64, end: Cursor) {
        assert!(
            seq > self.st.acked_seq,
            "{}: a shipped position never goes backwards (seq {seq} after {})",
            self.name,
            self.st.acked_seq
        );
        self.st.acked_seq = seq;
        self.st.cursor = Some(end);
        self.dirty = true;
    }

    /// docs/ship.md §3.3 rule 5: the main file's change counter must be one we saw.
    fn check_counters(&mut self) -> Result<Result<(), BaseReason>, StepError> {
        if !self.proof.counters_due(self.now()) {
            return Ok(Ok(()));
        }
        let Some(now) = self.files.main_counter()? else {
            return Ok(Ok(()));
        };
        match proof::check_counter(self.st.counters, now) {
            proof::Counter::InRange(range) => self.st.counters = Some(range),
            proof::Counter::Below(u) => return Ok(Err(self.unproven(u))),
            proof::Counter::Above { now, lo, hi } => {
                // Where SQLite's publishing ends, read after the counter.
                let caught_up = self.proof.stop == Stop::End
                    && self
                        .proof
                        .scan
                        .is_some_and(|c| c.frame >= self.published_end(c.salts));
                if let Err(u) = proof::counter_above(now, lo, hi, caught_up) {
                    return Ok(Err(self.unproven(u)));
                }
                tracing::debug!(db = %self.name, counter = now, hi, "the main file's change counter is past what the scan read; judged again once it catches up");
            }
        }
        Ok(Ok(()))
    }

    fn over_cap(&mut self) -> Result<bool, StepError> {
        if !self.fold.cap_due(self.now()) {
            return Ok(false);
        }
        let Some(cursor) = self.proof.scan else {
            return Ok(false);
        };
        let wal_len = self
            .files
            .wal()
            .map(|f| quiet::fstat(f).map(|m| m.len))
            .transpose()?
            .unwrap_or(0);
        Ok(fold_policy::over_cap(
            self.batch.lag_wal_bytes(),
            wal_len,
            &cursor,
            self.proof.stop,
            self.config.wal_max_bytes,
        ))
    }

    /// Runs every step: what needs no clock (the WAL below the threshold, a fold in
    /// flight, …) rules most steps out before the clock is read, once.
    fn may_fold(&self) -> bool {
        let view = FoldView {
            scan: self.proof.scan,
            stop: self.proof.stop,
            all_inline: self.batch.all_inline(),
            folder_busy: self.fold_state.busy.load(Ordering::SeqCst),
            // Not read by `may_fold_untimed`; filled in below, with the clock.
            backing_off: false,
            unacked_bytes: self.batch.unacked_bytes(),
            fold_min_frames: self.config.fold_min_frames,
        };
        if !self.fold.may_fold_untimed(&view) {
            return false;
        }
        let now = self.now();
        let view = FoldView {
            backing_off: self.backing_off_at(now).is_some(),
            ..view
        };
        self.fold.may_fold(&view, now)
    }

    /// Fold the WAL (docs/ship.md §3.5) on the folder thread. The proof of a later step
    /// covers whatever the checkpoint copies and whatever reset follows.
    fn fold(&mut self) -> Result<(), StepError> {
        self.save()?;
        let cursor = self.proof.scan.expect("may_fold checked");
        tracing::debug!(db = %self.name, frame = cursor.frame, "fold requested");
        if self.folder.request(
            &self.files.path,
            self.files.db.ino,
            Some(cursor.salts),
            &self.fold_state,
        ) {
            let now = self.now();
            self.fold.folded(cursor, now);
        }
        Ok(())
    }

    /// While a base is owed nothing in the WAL needs keeping: fold it (at most every
    /// `OWING_FOLD_INTERVAL`) so it stays bounded however long the peer is away.
    fn fold_while_owing(&mut self) -> Result<(), StepError> {
        let now = self.now();
        if !self.fold.owing_fold_due(now) {
            return Ok(());
        }
        let page_size = self.files.main_page_size();
        let frames = match self.files.wal_file()? {
            Some(f) => quiet::fstat(f)?.len / wal::frame_bytes(page_size),
            None => 0,
        };
        if frames >= self.config.fold_min_frames as u64 {
            self.folder
                .request(&self.files.path, self.files.db.ino, None, &self.fold_state);
            self.fold.owing_folded(now);
        }
        Ok(())
    }

    fn save_if_due(&mut self) -> Result<(), StepError> {
        if self.dirty && self.now().saturating_duration_since(self.saved_at) >= STATE_SAVE_INTERVAL
        {
            self.save()?;
        }
        Ok(())
    }

    /// Persist the state now.
    pub fn save(&mut self) -> Result<(), StepError> {
        self.st.db = Some(self.files.db);
        self.st.published = self.st.cursor.and_then(|c| {
            let frame = self.published_end(c.salts);
            (frame > 0).then_some(WalIndexEnd {
                salts: c.salts,
                frame,
            })
        });
        state::save(&self.state_path, &self.st)?;
        self.dirty = false;
        self.saved_at = self.now();
        Ok(())
    }

    /// Build and send one batch of records.
    fn ship(&mut self, client: &Client) -> Result<Next, StepError> {
        let Some(body) = self.batch.build(self.page_size(), self.files.wal())? else {
            self.owe_base(BaseReason::Rewritten);
            return Ok(Next::Again);
        };
        let q = TxnsQuery {
            epoch: self.st.epoch.0,
            generation: self.st.generation,
            page_size: self.page_size(),
        };
        let sent_at = self.now();
        let reply = client.send_txns(&self.name, q, &body.bytes);
        self.fold.last_request = self.now().saturating_duration_since(sent_at);
        tracing::debug!(db = %self.name, txns = body.txns, bytes = body.bytes.len(), ms = self.fold.last_request.as_secs_f64() * 1e3, ok = reply.is_ok(), "request");
        let reply = reply.map_err(|e| StepError::Peer(e.0))?;
        self.stats.requests += 1;
        match reply {
            Reply::Ok(pos) => {
                self.stats.body_bytes_shipped += body.bytes.len() as u64;
                self.stats.page_bytes_shipped += body.page_bytes;
                self.stats.transactions_shipped += body.txns;
                self.on_position(&pos);
                Ok(Next::Sent)
            }
            Reply::Refused { status, refusal } => self.on_refusal(status, refusal),
        }
    }

    fn page_size(&self) -> u32 {
        self.proof
            .scan
            .map(|c| c.page_size)
            .unwrap_or_else(|| self.files.main_page_size())
    }

    fn on_position(&mut self, pos: &Position) {
        if pos.generation != self.st.generation || pos.epoch != self.st.epoch {
            self.owe_base(BaseReason::PeerLost);
            return;
        }
        match self.batch.acknowledge(pos) {
            Acked::Regressed { held, acked } => {
                tracing::warn!(db = %self.name, held, acked, "the receiver holds less than it acknowledged");
                self.owe_base(BaseReason::PeerLost);
            }
            Acked::Moved { through } => self.acknowledged(through),
            Acked::Forked { seq, through } => {
                self.acknowledged(through);
                tracing::warn!(db = %self.name, seq, "the receiver's transaction {seq} is not ours: its history forked");
                self.owe_base(BaseReason::PeerLost);
            }
        }
    }

    /// The receiver answered with our history: the peer is well, and the state moves to
    /// the last of our transactions it now holds.
    fn acknowledged(&mut self, through: Option<(u64, Cursor)>) {
        self.stats.last_ack_ms = Some(self.wall_ms());
        self.stats.failures = 0;
        self.stats.last_error = None;
        self.retry_at = None;
        if let Some((seq, end)) = through {
            self.record_acked(seq, end);
        }
    }

    pub(super) fn on_refusal(&mut self, status: u16, refusal: Refusal) -> Result<Next, StepError> {
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
                Some(pos)
                    if pos.generation == self.st.generation && pos.seq >= self.batch.acked =>
                {
                    self.on_position(&pos);
                    Ok(Next::Again)
                }
                _ => {
                    self.owe_base(BaseReason::PeerLost);
                    Ok(Next::Again)
                }
            },
            Code::TooLarge if self.batch.shrink() => Ok(Next::Again),
            _ => Err(StepError::Peer(format!(
                "receiver refused (HTTP {status}): {}",
                refusal.error
            ))),
        }
    }

    /// A base was installed: the receiver holds seq 0 of the new generation.
    pub(super) fn based(&mut self, scan: Option<Cursor>, checksum: u64) {
        self.proof.scan = scan;
        self.proof.stop = Stop::End;
        self.proof.unpublished = None;
        self.batch.restart_at_base(checksum);
        self.base.reason = None;
        self.fold.forget();
        self.stats.failures = 0;
        self.retry_at = None;
        self.stats.last_error = None;
        self.stats.last_ack_ms = Some(self.wall_ms());
    }

    /// Status of this database.
    pub fn status(&self) -> super::status::DbStatus {
        let now = self.now();
        let head = self.batch.next_seq.saturating_sub(1).max(self.batch.acked);
        super::status::DbStatus {
            name: self.name.clone(),
            state: if self.fenced.is_some() {
                "fenced"
            } else if self.st.needs_base {
                "base owed"
            } else if self.stats.failures > 0 {
                "retrying"
            } else if self.batch.is_empty() {
                "idle"
            } else {
                "shipping"
            }
            .to_string(),
            epoch: self.st.epoch,
            generation: self.st.generation,
            acked_seq: self.batch.acked,
            head_seq: head,
            lag_transactions: self.batch.len() as u64,
            lag_bytes: self.batch.lag_wal_bytes(),
            lag_seconds: self.batch.lag(now).as_secs_f64(),
            wal_bytes: quiet::stat(&self.files.wal_path)
                .map(|m| m.len)
                .unwrap_or(0),
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
            steps: self.stats.steps,
            unpublished_seen: self.proof.unpublished_seen,
        }
    }
}
