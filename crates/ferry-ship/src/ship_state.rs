//! What the shipper persists per database (`DIR/.ferry-ship/NAME.json`, docs/ship.md §3.7),
//! written by the shipper and, for a new primary, by promotion (`seed_promoted`): both
//! sides use it, so it sits below them.
//!
//! It is a hint that may lag: the receiver's position is the truth. It is written
//! atomically (temp file, fsync, rename, fsync directory) after a base, before a fold, at
//! most once a second while shipping, and at shutdown. A missing or unreadable file means
//! a base.

use crate::wal::Cursor;
use ferry_core::epoch::Epoch;
use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};

pub const VERSION: u32 = 1;

/// Identity of a file: a new inode under the same name is a different file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

/// The main file's size and modification time: it changes whenever a checkpoint writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fingerprint {
    pub len: u64,
    pub mtime_ns: i128,
}

/// The persisted state of one shipped database.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShipState {
    pub version: u32,
    /// Fencing epoch this primary ships with. Only promotion (or a person) raises it.
    pub epoch: Epoch,
    /// Generation of the last base sent (0: none yet).
    pub generation: u64,
    /// Seq of the last transaction known acknowledged whose WAL position is `cursor`.
    pub acked_seq: u64,
    /// WAL position right after transaction `acked_seq`. None: the WAL was empty then,
    /// and `main` fingerprints the main file at that moment.
    pub cursor: Option<Cursor>,
    pub main: Option<Fingerprint>,
    /// The database file this state belongs to.
    pub db: Option<FileId>,
    /// A base is owed before anything else ships.
    pub needs_base: bool,
    /// Change counters the main file may legitimately carry: `[lo, hi]`.
    pub counters: Option<(u32, u32)>,
    /// The furthest SQLite was seen to publish of `cursor`'s cycle (docs/ship.md §3.2):
    /// after a restart the wal-index may have moved on to a new cycle, and the frames of
    /// the old one past the cursor are then shipped only up to here.
    #[serde(default)]
    pub published: Option<crate::sqlite::WalIndexEnd>,
}

/// Where the state of `name` lives in the shipper directory `dir`.
pub fn path(dir: &Path, name: &str) -> PathBuf {
    dir.join(".ferry-ship").join(format!("{name}.json"))
}

/// A state file that exists but cannot be used. The shipper sends a base and overwrites
/// it; a person reading status sees which file and why.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot read {}: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{} is not a valid shipper state: {source}", path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{} has version {found}, this ferry writes {VERSION}", path.display())]
    Version { path: PathBuf, found: u32 },
    #[error("{} holds an impossible WAL position", path.display())]
    Impossible { path: PathBuf },
}

impl ferry_core::Classify for StateError {
    fn class(&self) -> ferry_core::Class {
        match self {
            StateError::Read { source, .. } => source.class(),
            StateError::Version { .. } => ferry_core::Class::Permanent,
            StateError::Parse { .. } | StateError::Impossible { .. } => {
                ferry_core::Class::Corrupted
            }
        }
    }
}

/// Load a state file: Ok(None) if it is missing; an error names the file if it is not
/// readable (the caller sends a base and overwrites it).
pub fn load(path: &Path) -> Result<Option<ShipState>, StateError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(StateError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let state: ShipState = serde_json::from_slice(&bytes).map_err(|source| StateError::Parse {
        path: path.to_path_buf(),
        source,
    })?;
    if state.version != VERSION {
        return Err(StateError::Version {
            path: path.to_path_buf(),
            found: state.version,
        });
    }
    // A WAL of 2^31 frames would be at least 8 TiB: such a cursor is damage, not a place.
    if state
        .cursor
        .is_some_and(|c| c.frame >= 1 << 31 || !crate::wal::valid_page_size(c.page_size))
    {
        return Err(StateError::Impossible {
            path: path.to_path_buf(),
        });
    }
    Ok(Some(state))
}

/// Write a state file atomically and durably.
pub fn save(path: &Path, state: &ShipState) -> io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut json = serde_json::to_vec_pretty(state).expect("the state always serializes");
    json.push(b'\n');
    ferry_core::fs::write_atomic(path, &json)
}

/// After a promotion, leave a state beside the promoted database so that a shipper
/// started on it ships with the new epoch (and starts with a base).
pub fn seed_promoted(db: &Path, epoch: Epoch) -> io::Result<()> {
    let dir = ferry_core::fs::parent_dir(db);
    let Some(name) = db.file_name().and_then(crate::names::from_file_name) else {
        // Not NAME.db: no shipper would pick it up by name; nothing to seed.
        return Ok(());
    };
    let p = path(&dir, &name);
    if let Ok(Some(existing)) = load(&p)
        && existing.epoch >= epoch
    {
        return Ok(());
    }
    save(
        &p,
        &ShipState {
            version: VERSION,
            epoch,
            needs_base: true,
            ..ShipState::default()
        },
    )
}
