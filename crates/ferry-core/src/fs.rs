//! Files that must survive a crash.
//!
//! [`write_atomic`] (and [`install`], its last steps, for a file written another way)
//! replaces a file so that after a crash at any instant the path holds
//! either the old content or the new, never a mix: write a temporary file in the same
//! directory, fsync it, rename it over the target, fsync the directory (without the last
//! step the rename itself may be lost on power failure).
//!
//! [`DirLock`] keeps a second process out of a directory it must own alone.

use crate::{Class, Classify};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// Replace `path` with `bytes`, atomically and durably.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = parent_dir(path);
    let name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} names no file", path.display()),
        )
    })?;
    let mut tmp_name = name.to_os_string();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        install(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The last steps of an atomic replacement, for a file written some other way (by
/// SQLite's backup API, say): `tmp`, already complete and fsynced, in the directory of
/// `path`, is renamed over `path` and the directory fsynced. A crash at any instant
/// leaves `path` old or new; without the directory's fsync the rename itself may be
/// lost on power failure.
pub fn install(tmp: &Path, path: &Path) -> io::Result<()> {
    debug_assert_eq!(
        parent_dir(tmp),
        parent_dir(path),
        "a rename within one directory"
    );
    std::fs::rename(tmp, path)?;
    fsync_dir(&parent_dir(path))
}

/// fsync a directory, making renames and creations in it durable.
pub fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The directory holding `path` (`.` for a bare file name).
pub fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// How long `DirLock::try_acquire` keeps trying a lock it found held.
const HELD_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

/// An exclusive advisory lock (flock) on a file, held until dropped. The lock belongs to
/// the open file description, so it is released when the process dies, even by SIGKILL.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    path: PathBuf,
}

/// Why a lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error(
        "{path} is locked by another process ({what}); stop that process first, or use another directory"
    )]
    Held { path: PathBuf, what: String },
    #[error("cannot open lock file {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

impl Classify for LockError {
    /// A lock still held after `HELD_GRACE` belongs to another live process: a person
    /// must stop it (or pick another directory), and retrying meets it again. The I/O
    /// error of opening the lock file classes as itself.
    fn class(&self) -> Class {
        match self {
            LockError::Held { .. } => Class::Permanent,
            LockError::Io { source, .. } => source.class(),
        }
    }
}

impl DirLock {
    /// Take the lock at `path`, or fail if another holds it. `what` names the owner for
    /// the message.
    ///
    /// A lock found held is tried again for up to `HELD_GRACE` before that failure: a
    /// lock let go by this process can stay held for a moment by a child it is starting
    /// (between fork and exec the child shares every open file, the lock's among them,
    /// until exec closes it). Seen in CI: a test that closed a log and opened it again at
    /// once was refused while another test in the process spawned a child.
    pub fn try_acquire(path: &Path, what: &str) -> Result<DirLock, LockError> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| LockError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        let began = std::time::Instant::now();
        loop {
            match file.try_lock() {
                Ok(()) => {
                    return Ok(DirLock {
                        _file: file,
                        path: path.to_path_buf(),
                    });
                }
                Err(std::fs::TryLockError::WouldBlock) if began.elapsed() < HELD_GRACE => {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(LockError::Held {
                        path: path.to_path_buf(),
                        what: what.to_string(),
                    });
                }
                Err(std::fs::TryLockError::Error(source)) => {
                    return Err(LockError::Io {
                        path: path.to_path_buf(),
                        source,
                    });
                }
            }
        }
    }

    /// Take the lock at `path`, waiting for its holder to let go.
    pub fn acquire(path: &Path) -> Result<DirLock, LockError> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| LockError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        file.lock().map_err(|source| LockError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(DirLock {
            _file: file,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_atomic_replaces_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("ferry-core-fs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("state.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_held_lock_is_refused_with_its_owner_named() {
        let dir = std::env::temp_dir().join(format!("ferry-core-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("lock");
        let held = DirLock::try_acquire(&p, "a receiver").unwrap();
        let err = DirLock::try_acquire(&p, "a receiver").unwrap_err();
        assert!(err.to_string().contains("a receiver"), "{err}");
        drop(held);
        DirLock::try_acquire(&p, "a receiver").unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
