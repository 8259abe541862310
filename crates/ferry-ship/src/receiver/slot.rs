//! One name on the receiver: its position record, its replica, a transaction being
//! received in parts (docs/ship.md §4).
//!
//! Every operation runs under the name's mutex and its cross-process flock, after
//! [`Slot::sync`] re-read the position record (recovering if another process wrote it).
//! Applying a request:
//! 1. The acceptance rule ([`super::accept`]) admits it and plans what each record does.
//! 2. Parts are spooled (`.ferry/NAME.spool`, not durable: the shipper resends from
//!    part 0 after a restart); whole transactions wait in memory.
//! 3. Ready transactions are applied in groups, each one replica transaction with its
//!    intent recorded first ([`super::replica`]); a group ends after a transaction that
//!    shrinks the database.
//!
//! A crash anywhere leaves the position record with an intent or without; recovery
//! ([`super::recovery`]) decides from the replica's witness page which holds.

use super::accept::{self, Partial, Rejection, Step};
use super::error::{Refused, SlotError};
use super::paths::Paths;
use super::replica::{self, Group, Replica, ReplicaError, Src};
use super::state::{FLAG_HAS_REPLICA, Intent, Pos, Record, StateFile, Witness};
use super::status::ReplicaStatus;
use crate::proto::{self, BaseHeader, Code, Position};
use ferry_core::epoch::Epoch;
use ferry_core::fs::DirLock;
use ferry_core::seams::Clock;
use std::collections::BTreeMap;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU8;

/// One name: its position record, its replica, a transaction being received in parts.
pub struct Slot {
    pub(super) name: String,
    pub(super) paths: Paths,
    /// None after a failed write: nothing may be written until it is reopened and the
    /// replica recovered.
    pub(super) state: Option<StateFile>,
    /// The committed position (recovered). Within a generation its seq only rises, and
    /// its epoch never falls (asserted where it moves: `advance`).
    pub(super) pos: Pos,
    pub(super) replica: Option<Replica>,
    pub(super) pending: Option<Pending>,
    pub(super) stats: Stats,
    /// Where the bulk half of the replica's checkpoint stands: `BULK_*`.
    pub(super) bulk: Arc<AtomicU8>,
    /// Wall time for status and for naming a replica set aside.
    pub(super) clock: Arc<dyn Clock>,
    /// Recovery decided the group behind this witness had not committed but could not yet
    /// make that final (`Replica::settle`: its commit failed, on a full disk say). Until it
    /// is, `replica` stays open, which keeps SQLite from rebuilding the replica's index
    /// and so the group invisible, and the group's intent stays the newest record, so a
    /// restart decides again from the replica itself. Every write settles it first
    /// (`settle_decision`): a record written over that intent would make the decision
    /// final without the commit that keeps the group out.
    pub(super) unsettled: Option<Witness>,
}

/// A replica to checkpoint, and its slot's `bulk`.
pub(super) type BulkJob = (PathBuf, Arc<AtomicU8>);

pub(super) const BULK_IDLE: u8 = 0;
pub(super) const BULK_QUEUED: u8 = 1;
pub(super) const BULK_DONE: u8 = 2;

#[derive(Default)]
pub(super) struct Stats {
    pub(super) transactions: u64,
    pub(super) page_bytes: u64,
    pub(super) bases: u64,
    pub(super) refusals: u64,
    pub(super) last_apply_ms: Option<u64>,
    pub(super) last_observed_ms: Option<u64>,
    pub(super) last_error: Option<String>,
}

/// A transaction arriving in parts, spooled to a file (not durable: the shipper resends
/// from part 0 after a receiver restart).
pub(super) struct Pending {
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
    pub fn new(name: &str, paths: Paths, clock: Arc<dyn Clock>) -> Slot {
        Slot {
            clock,
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

    pub(super) fn replica_err(&self, source: ReplicaError) -> SlotError {
        SlotError::Replica {
            name: self.name.clone(),
            source,
        }
    }

    /// Make recovery's pending decision final (see `unsettled`), then write the clean
    /// record it could not write. Called before anything else is written.
    pub(super) fn settle_decision(&mut self) -> Result<(), SlotError> {
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

    pub(super) fn write_state(&mut self, rec: Record) -> Result<(), SlotError> {
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

    /// Word a rejection of the acceptance rule for the shipper: what, and what to do.
    pub(super) fn rejected(&self, why: Rejection) -> Refused {
        let name = &self.name;
        let (code, error) = match why {
            Rejection::Fenced { epoch, held } => {
                let why = if self.pos.promoted() {
                    "the replica was promoted"
                } else {
                    "a newer primary took over"
                };
                (
                    Code::Fenced,
                    format!(
                        "{name}: epoch {epoch} is fenced: {why} at epoch {held}. This shipper's primary is stale; stop it. \
                         To ship from it again on purpose, give the shipper epoch {} (its `epoch` setting)",
                        held.next()
                    ),
                )
            }
            Rejection::NewerEpoch { epoch, held } => (
                Code::NeedsBase,
                format!("{name}: epoch {epoch} is newer than the replica's {held}: send a base"),
            ),
            Rejection::NoReplica => (
                Code::NeedsBase,
                format!("{name}: there is no replica yet: send a base"),
            ),
            Rejection::OtherGeneration { generation, held } => (
                Code::NeedsBase,
                format!(
                    "{name}: generation {generation:#x} is not the replica's ({held:#x}): send a base"
                ),
            ),
            Rejection::PageSize { page_size, held } => (
                Code::NeedsBase,
                format!("{name}: page size changed from {held} to {page_size}: send a base"),
            ),
            Rejection::Forked { seq, theirs, ours } => (
                Code::NeedsBase,
                format!(
                    "{name}: transaction {seq} differs from the one applied here (WAL checksum {theirs:#x}, not {ours:#x}): \
                     the primary's history forked; send a base"
                ),
            ),
            Rejection::Behind { seq, part } => (
                Code::Behind,
                format!(
                    "{name}: transaction {seq} part {part} does not follow the replica's position (seq {}); resume from it",
                    self.pos.seq
                ),
            ),
        };
        Refused::new(code, error).at(self.position())
    }

    /// The admission checks of docs/ship.md §4.4, steps 2 to 4.
    pub(super) fn admit(
        &self,
        epoch: Epoch,
        generation: u64,
        page_size: Option<u32>,
    ) -> Result<(), Refused> {
        accept::admit(
            &self.pos,
            self.replica.is_some(),
            epoch,
            generation,
            page_size,
        )
        .map_err(|why| self.rejected(why))
    }

    /// Apply what in `records` follows the position; spool parts; skip what is held. The
    /// acceptance rule plans it all before anything is written.
    pub(super) fn apply_records(&mut self, records: &[proto::Record<'_>]) -> Result<(), SlotError> {
        let headers: Vec<proto::RecordHeader> = records.iter().map(|r| r.header).collect();
        let partial = self.pending.as_ref().map(|p| Partial {
            seq: p.seq,
            next_part: p.next_part,
        });
        let plan = accept::plan(&self.pos, partial, &headers)
            .map_err(|why| SlotError::Refused(self.rejected(why)))?;
        let mut ready: Vec<Ready<'_>> = Vec::new();
        for step in &plan.steps {
            match *step {
                Step::Whole(i) => {
                    let (h, pages) = (&records[i].header, &records[i].pages);
                    ready.push(Ready {
                        seq: h.seq,
                        commit_pages: h.commit_pages,
                        bytes: pages.len() as u64 * self.pos.page_size as u64,
                        pages: pages.iter().map(|(n, d)| (*n, Src::Mem(d))).collect(),
                        observed_ms: h.observed_ms,
                        wal_checksum: h.wal_checksum,
                    });
                }
                Step::Flush => self.apply_ready(std::mem::take(&mut ready))?,
                Step::Part { index, last } => {
                    let h = &records[index].header;
                    self.spool(h, &records[index].pages)?;
                    if last {
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
                    }
                }
            }
        }
        self.apply_ready(ready)?;
        if let Some(&last) = plan.ready.last() {
            assert_eq!(
                self.pos.seq, last,
                "an apply covers exactly the transactions the acceptance rule validated"
            );
        }
        Ok(())
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
        for (i, t) in ready.iter().enumerate() {
            assert_eq!(
                t.seq,
                self.pos.seq + 1 + i as u64,
                "transactions ready to apply follow the position without a gap"
            );
        }
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
            self.advance(post);
            self.stats.transactions += txns;
            self.stats.page_bytes += bytes;
            self.stats.last_apply_ms = Some(self.clock.wall_ms());
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
    pub(super) fn install_base(
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
        // Fenced before it got here (`accept::fence`): a base never lowers the epoch.
        assert!(
            post.epoch >= pre.epoch,
            "{}: an epoch never falls (a base at {} over {})",
            self.name,
            post.epoch,
            pre.epoch
        );
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
        self.stats.last_apply_ms = Some(self.clock.wall_ms());
        self.stats.last_observed_ms = Some(header.observed_ms);
        tracing::info!(db = %self.name, generation = format_args!("{:#x}", header.generation), pages = header.page_count, "base installed");
        Ok(())
    }

    pub(super) fn drop_replica(&mut self) -> Result<(), SlotError> {
        // The replica goes, and with it the group an unsettled decision kept out.
        self.unsettled = None;
        self.replica = None;
        self.pending = None;
        let pos = Pos {
            checksum: 0,
            ..self.pos.without_replica()
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

    pub(super) fn status(&self) -> ReplicaStatus {
        let bytes = self.paths.replica_bytes().with_wal;
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

    /// Move the position after a group applied, checking what may never happen: an epoch
    /// that falls, and within a generation a seq that does not rise. A broken one means
    /// the acceptance rule let through what it must refuse; nothing more may be written
    /// on top of it. (A base starts a lineage of its own: `install_base` checks its epoch.)
    fn advance(&mut self, post: Pos) {
        assert!(
            post.epoch >= self.pos.epoch,
            "{}: an epoch never falls (from {} to {})",
            self.name,
            self.pos.epoch,
            post.epoch
        );
        assert!(
            post.generation != self.pos.generation || post.seq > self.pos.seq,
            "{}: a position only rises within a generation (seq {} to {} in {:#x})",
            self.name,
            self.pos.seq,
            post.seq,
            post.generation
        );
        self.pos = post;
    }
}
