//! Recovery of one name's replica after a stop (docs/ship.md §4.3), run by
//! [`Slot::sync`] whenever the position record is not the one this process last wrote.
//!
//! 1. A `replace` intent whose swap was cut short: put the old replica back.
//! 2. Remove a half-built base and the attic.
//! 3. A `group` intent: read the witness page inside a write transaction. The post image
//!    means the group committed; the pre image means it did not, and a commit of page 1 as
//!    it stands makes that final (`Replica::settle`); anything else means someone else
//!    wrote the replica: it is set aside (`.ferry/NAME.untrusted-TIME/`) and a base is
//!    owed.
//! 4. Write a clean record, and open the replica.
//!
//! If the commit that makes "not committed" final fails (a full disk), the decision is
//! held open: the replica stays open (no index rebuild can bring the group back while it
//! is), no record is written, and every later write settles it first.

use super::error::SlotError;
use super::replica::{self, Replica};
use super::slot::Slot;
use super::state::{Intent, Pos, Record};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

impl Slot {
    /// Decide where the replica stands after `record` (docs/ship.md §4.3), and leave a
    /// clean record behind.
    pub(super) fn recover(&mut self, record: Record) -> Result<(), SlotError> {
        if let Intent::Replace { .. } = record.intent {
            self.undo_half_swap()?;
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
                        record.pos.without_replica()
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
            pos = pos.without_replica();
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
                let pos = pos.without_replica();
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
    fn undo_half_swap(&self) -> Result<(), SlotError> {
        let old = self.paths.attic.join("db");
        // A replica in place needs nothing here, whichever it is (the new one: the swap
        // committed; the old one: it never began); the intent's inode tells them apart.
        if self.paths.replica.exists() || !old.exists() {
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
            .with_extension(format!("untrusted-{}", self.clock.wall_ms()));
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
}
