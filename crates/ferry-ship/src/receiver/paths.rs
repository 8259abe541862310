//! The files of one name in a receiver directory (docs/ship.md §4.1).

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
}
