//! Promotion: turn a replica into a primary (docs/ship.md §4.6). Safe alongside a running
//! receiver, and idempotent.
//!
//! 1. Take `NAME.lock`; recover the state.
//! 2. Write a record with `epoch + 1` and the promoted flag: from now on the old shipper
//!    is fenced. A pending partial transaction is discarded (never acknowledged).
//! 3. Copy the replica with SQLite's backup API into `PATH.promote-tmp`, check it with
//!    `quick_check`, fsync it, rename it to `PATH`, fsync the directory.
//! 4. Write `PATH`'s shipper state (`.ferry-ship/STEM.json` beside it) with the new epoch
//!    and `needs_base`, atomically (`ferry_core::fs::write_atomic`).
//! 5. Remove the replica files; the record keeps the epoch.
//!
//! A crash after 2 leaves the name fenced with its replica in place: a rerun skips 2,
//! and if `PATH` already holds the replica's data (a crash after 3), skips the copy too.

use super::error::PromoteError;
use super::paths::Paths;
use super::replica;
use super::slot::Slot;
use super::state::{FLAG_PROMOTED, Intent, Pos, Record};
use ferry_core::ConfigError;
use ferry_core::epoch::Epoch;
use ferry_core::seams::SystemClock;
use std::path::Path;
use std::sync::Arc;

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
/// (docs/ship.md §4.6). Safe alongside a running receiver, and idempotent. A `dest` that
/// cannot be used is a [`ConfigError`] for the setting `dest`.
pub fn promote(
    dir: &Path,
    name: &str,
    dest: &Path,
    progress: &mut dyn FnMut(u32, u32),
) -> Result<Promoted, PromoteError> {
    crate::sqlite::check_library()?;
    crate::names::validate(name)?;
    let paths = Paths::new(dir, name);
    if !paths.state.exists() {
        return Err(PromoteError::NoSuchReplica {
            name: name.to_string(),
            dir: dir.to_path_buf(),
        });
    }
    if sqlite_path_eq(dest, &paths.replica) {
        return Err(ConfigError::new(
            "dest",
            dest.display(),
            "is the replica itself; promote to another path",
        )
        .into());
    }
    let mut slot = Slot::new(name, paths.clone(), Arc::new(SystemClock));
    let _flock = slot.sync()?;
    if slot.pos.promoted() && !slot.pos.has_replica() {
        return Err(PromoteError::AlreadyPromoted {
            name: name.to_string(),
            epoch: slot.pos.epoch,
        });
    }
    let resumed = slot.pos.promoted();
    if !slot.pos.has_replica() {
        return Err(PromoteError::NeverReceived {
            name: name.to_string(),
        });
    }
    let fenced = if slot.pos.promoted() {
        slot.pos
    } else {
        let pos = Pos {
            epoch: slot.pos.epoch.next(),
            flags: slot.pos.flags | FLAG_PROMOTED,
            ..slot.pos
        };
        assert!(
            pos.epoch > slot.pos.epoch,
            "promotion raises the epoch (from {})",
            slot.pos.epoch
        );
        slot.settle_decision()?;
        slot.write_state(Record {
            pos,
            intent: Intent::None,
        })?;
        slot.pos = pos;
        pos
    };
    let replica = slot.replica.as_ref().ok_or_else(|| PromoteError::NotOpen {
        name: name.to_string(),
    })?;
    let pages = replica.page_count().map_err(|source| PromoteError::Read {
        path: paths.replica.clone(),
        source,
    })?;
    // A rerun after a crash past the copy: the copy at `dest` is this replica's, finish.
    let copied = resumed && dest.exists() && same_content(&paths.replica, dest)?;
    if dest.exists() && !copied {
        return Err(PromoteError::Exists {
            dest: dest.to_path_buf(),
        });
    }
    if !copied {
        copy(replica, name, dest, progress)?;
    }
    crate::ship_state::seed_promoted(dest, fenced.epoch).map_err(|source| PromoteError::Io {
        what: "writing the new primary's shipper state beside",
        path: dest.to_path_buf(),
        source,
    })?;
    slot.replica = None;
    slot.drop_replica()?;
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

/// Step 3: copy the replica to `dest` so that `dest` holds either nothing or the whole,
/// checked, durable copy: SQLite's backup API writes and fsyncs a temporary file beside
/// it (the copy may be as large as the database, so it is not built in memory), and
/// `ferry_core::fs::install` renames it over `dest` and fsyncs the directory.
fn copy(
    replica: &replica::Replica,
    name: &str,
    dest: &Path,
    progress: &mut dyn FnMut(u32, u32),
) -> Result<(), PromoteError> {
    let io = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| PromoteError::Io { what, path, source }
    };
    let tmp = crate::names::sidecar(dest, ".promote-tmp");
    let parent = ferry_core::fs::parent_dir(dest);
    std::fs::create_dir_all(&parent).map_err(io("cannot create", &parent))?;
    // Copies, checks with quick_check and fsyncs the file.
    replica
        .copy_to(&tmp, progress)
        .map_err(|source| PromoteError::Copy {
            name: name.to_string(),
            path: tmp.clone(),
            source,
        })?;
    ferry_core::fs::install(&tmp, dest).map_err(io("moving the copy to", dest))?;
    let _ = replica::remove_with_sidecars(&tmp);
    Ok(())
}

/// Do two databases hold the same data (read on connections of their own)?
fn same_content(a: &Path, b: &Path) -> Result<bool, PromoteError> {
    let digest = |p: &Path| {
        rusqlite::Connection::open_with_flags(p, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .and_then(|c| crate::sqlite::digest(&c))
            .map_err(|source| PromoteError::Read {
                path: p.to_path_buf(),
                source,
            })
    };
    Ok(digest(a)? == digest(b)?)
}

fn sqlite_path_eq(a: &Path, b: &Path) -> bool {
    crate::sqlite::canonical(a) == crate::sqlite::canonical(b)
}
