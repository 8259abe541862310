//! The files of one name in a receiver directory (docs/ship.md §4.1).

use std::io;
use std::path::{Path, PathBuf};

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

    /// Bytes the replica takes on disk (a file that is not there counts 0).
    pub fn replica_bytes(&self) -> ReplicaBytes {
        let len = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
        let main = len(&self.replica);
        ReplicaBytes {
            main,
            with_wal: main + len(&crate::names::sidecar(&self.replica, "-wal")),
        }
    }
}

/// What [`Paths::replica_bytes`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaBytes {
    /// The main file.
    pub main: u64,
    /// The main file and its `-wal`.
    pub with_wal: u64,
}

/// The names with a position record in `ferry_dir` (a receiver directory's `.ferry`),
/// sorted. Entries that cannot be read, and files whose name is not a valid one, are
/// skipped.
pub fn names_in(ferry_dir: &Path) -> io::Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(ferry_dir)?
        .flatten()
        .filter_map(|e| {
            let f = e.file_name();
            let name = f.to_str()?.strip_suffix(".state")?;
            crate::names::validate(name).ok()?;
            Some(name.to_string())
        })
        .collect();
    names.sort();
    Ok(names)
}
