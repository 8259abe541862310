//! The files of one shipped database and the shipper's handles on them: the connections,
//! the `-wal` descriptor, the descriptor that reads the main file's header, and the
//! identity of each (docs/ship.md §3.1, §3.3 rule 1).
//!
//! Identity is checked at most every `IDENTITY_INTERVAL` (a step runs per commit and
//! cannot afford the `stat` calls; a file replaced in between fails rule 4 anyway, since
//! its WAL has other salts):
//! 1. `stat` the database: missing means it is gone; another `(dev, inode)` means it was
//!    replaced.
//! 2. Replaced while the old file's `-wal` or `-shm` is still at its path: wait for them
//!    to be removed (up to `STALE_SIDECAR_WAIT`), keeping the old connections, since
//!    SQLite would read the new file through them.
//! 3. Otherwise reopen everything on the new file, and owe a base.
//!
//! The shipper never opens and closes the main file or `-shm` with ordinary file I/O:
//! closing any descriptor of a file drops every POSIX lock the process holds on it,
//! SQLite's included. Nothing here is persisted.

use super::error::StepError;
use super::limits::IDENTITY_INTERVAL;
use crate::quiet;
use crate::ship_state::{FileId, Fingerprint};
use crate::wal::{self, Header};
use ferry_core::sync::lock;
use rusqlite::Connection;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a replaced file waits for the `-wal` and `-shm` of the file it replaced to be
/// removed, and how often it looks meanwhile.
pub const STALE_SIDECAR_WAIT: Duration = Duration::from_secs(10);
pub const STALE_SIDECAR_RECHECK: Duration = Duration::from_millis(10);
/// Reads of a WAL header that does not validate before believing it.
const HEADER_READS: u32 = 3;

/// What the identity check found.
#[derive(Debug, PartialEq, Eq)]
pub enum Identity {
    /// The same file (or not looked at: not due).
    Same,
    /// The database file is gone.
    Gone,
    /// Replaced, and nothing of the old file is left at its paths: reopen, owe a base.
    Replaced,
    /// Replaced, but these of the old file are still there (`NAME.db-wal and
    /// NAME.db-shm`, or one of them): wait.
    Stale { files: String },
    /// Replaced, and `files` of the old file are still there past the wait: reopen anyway.
    StaleAnyway { files: String },
}

/// The files of one database, and the shipper's handles on them.
pub struct Files {
    pub path: PathBuf,
    pub wal_path: PathBuf,
    /// Our checkpoints and base reads.
    pub main: Connection,
    /// Holds the write lock for the moment a base pins its snapshot.
    pub barrier: Connection,
    /// The database file the connections are on.
    pub db: FileId,
    /// Reads the main file's header (and pages, for the proof): one per inode, never
    /// closed (see `main_fd`).
    pub header_fd: Arc<File>,
    /// The `-wal` file and its identity; None when there is none.
    wal: Option<(FileId, File)>,
    /// The `-wal` path must be looked at again (it may have been replaced).
    wal_stat_due: bool,
    /// The `-shm` file at the last identity check.
    shm: Option<FileId>,
    /// Since when the database has been seen replaced while the old sidecars stayed.
    replaced_at: Option<Instant>,
    /// Last identity check.
    identity_at: Instant,
    /// A step failed inside SQLite: open new connections before the next one.
    pub reopen_due: bool,
    /// `main` was found in WAL mode, and ran no statement since: its wal-index mapping can
    /// be read without asking again (see [`Files::index_end`]).
    mapped: Cell<bool>,
}

impl Files {
    /// Open the database at `path` for shipping: it must be in WAL mode.
    pub fn open(path: PathBuf, now: Instant) -> Result<Files, StepError> {
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
        let db = FileId::from(quiet::stat(&path)?);
        Ok(Files {
            wal_path: crate::names::sidecar(&path, "-wal"),
            header_fd: main_fd(&path, db)?,
            shm: shm_id(&path),
            db,
            main,
            barrier,
            path,
            wal: None,
            wal_stat_due: true,
            replaced_at: None,
            identity_at: now,
            reopen_due: false,
            mapped: Cell::new(false),
        })
    }

    /// New connections and descriptors on the file now at the path.
    pub fn reopen(&mut self) -> Result<(), StepError> {
        self.main = crate::sqlite::open_primary(&self.path)?;
        self.barrier = crate::sqlite::open_primary(&self.path)?;
        crate::sqlite::eager_busy_handler(&mut self.barrier)?;
        self.db = FileId::from(quiet::stat(&self.path)?);
        self.header_fd = main_fd(&self.path, self.db)?;
        self.wal = None;
        self.wal_stat_due = true;
        self.mapped.set(false);
        Ok(())
    }

    /// Rule 1, when due (every `IDENTITY_INTERVAL`, or at once with `force`).
    pub fn check_identity(&mut self, now: Instant, force: bool) -> io::Result<Identity> {
        if !force && now.saturating_duration_since(self.identity_at) < IDENTITY_INTERVAL {
            return Ok(Identity::Same);
        }
        self.identity_at = now;
        self.wal_stat_due = true;
        self.mapped.set(false);
        let m = match quiet::stat(&self.path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Identity::Gone),
            Err(e) => return Err(e),
            Ok(m) => m,
        };
        if FileId::from(m) == self.db {
            self.shm = shm_id(&self.path);
            return Ok(Identity::Same);
        }
        Ok(self.stale_sidecars(now))
    }

    /// The database file was replaced (renamed over). If its old `-wal` or `-shm` is still
    /// at its path, any connection opened on the new file now would read it through the
    /// old file's WAL and wal-index (SQLite shares both by path), and a checkpoint would
    /// copy the old file's pages into the new one. Whoever replaced the file is expected
    /// to remove them (a restore does): wait for that, up to `STALE_SIDECAR_WAIT`, with
    /// the old connections kept and nothing shipped. Past the wait SQLite gets the new
    /// file as it stands, which is what the app's own connections get.
    fn stale_sidecars(&mut self, now: Instant) -> Identity {
        let wal_now = quiet::stat(&self.wal_path).ok().map(FileId::from);
        let wal_stale = wal_now.is_some() && wal_now == self.wal.as_ref().map(|(id, _)| *id);
        let shm_now = shm_id(&self.path);
        let shm_stale = shm_now.is_some() && shm_now == self.shm;
        let name = self.path.file_name().unwrap_or_default().to_string_lossy();
        let files = match (wal_stale, shm_stale) {
            (false, false) => {
                self.replaced_at = None;
                return Identity::Replaced;
            }
            (true, true) => format!("{name}-wal and {name}-shm"),
            (true, false) => format!("{name}-wal"),
            (false, true) => format!("{name}-shm"),
        };
        let since = *self.replaced_at.get_or_insert(now);
        if now.saturating_duration_since(since) >= STALE_SIDECAR_WAIT {
            self.replaced_at = None;
            return Identity::StaleAnyway { files };
        }
        // Look again at the next step, not after IDENTITY_INTERVAL.
        self.identity_at = now.checked_sub(IDENTITY_INTERVAL).unwrap_or(now);
        Identity::Stale { files }
    }

    /// The `-wal` file, reopened if it was replaced; None if there is none.
    pub fn wal_file(&mut self) -> Result<Option<&File>, StepError> {
        if self.wal.is_some() && !self.wal_stat_due {
            return Ok(self.wal());
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
        let id = FileId::from(meta);
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
        Ok(self.wal())
    }

    /// The `-wal` file as last opened by [`Self::wal_file`].
    pub fn wal(&self) -> Option<&File> {
        self.wal.as_ref().map(|(_, f)| f)
    }

    /// What SQLite has published of the WAL ([`crate::sqlite::wal_index_end`]). The journal
    /// mode is asked at most once per identity check: asking is a read transaction, which
    /// cost as much as the rest of a step. In between, the mapping it found stays the
    /// connection's, since nothing else runs a statement on `main` without calling
    /// [`Files::ran_statement`].
    pub fn index_end(&self) -> Option<crate::sqlite::WalIndexEnd> {
        if !self.mapped.get() {
            if !crate::sqlite::in_wal_mode(&self.main) {
                return None;
            }
            self.mapped.set(true);
        }
        crate::sqlite::wal_index_end_mapped(&self.main)
    }

    /// A statement ran on `main`: it may have found the database out of WAL mode and
    /// dropped the connection's wal-index mapping, so ask the mode again before reading it.
    pub fn ran_statement(&self) {
        self.mapped.set(false);
    }

    /// The page size SQLite reports for the database (4096 if it cannot say).
    pub fn main_page_size(&self) -> u32 {
        self.ran_statement();
        self.main
            .query_row("PRAGMA page_size", [], |r| r.get(0))
            .unwrap_or(4096)
    }

    /// The change counter in the main file's header.
    pub fn main_counter(&self) -> io::Result<Option<u32>> {
        main_counter(&self.header_fd)
    }
}

/// Read the WAL header; if it does not validate while the file holds one, read again a
/// few times: a writer starting a new cycle rewrites the header, and a read can land in
/// the middle of that write. Only a header that stays invalid is treated as one (a
/// spurious "reset" would cost a base).
pub fn read_header_settled(f: &File) -> io::Result<Option<Header>> {
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

/// The main file's size and modification time. Only read around a base with an empty WAL,
/// so asking for the mtime (see `quiet`) costs the app nothing measurable.
pub fn fingerprint(path: &Path) -> io::Result<Fingerprint> {
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
        .map(FileId::from)
}

/// A read-only descriptor on the main database file at `path`, whose identity the caller
/// has just read (`id`), one per inode, never closed: closing any descriptor of a file
/// drops every POSIX lock this process holds on it, SQLite's included (sqlite.org
/// howtocorrupt.html §2.2).
fn main_fd(path: &Path, id: FileId) -> io::Result<Arc<File>> {
    type ByInode = BTreeMap<(u64, u64), Arc<File>>;
    static FDS: OnceLock<Mutex<ByInode>> = OnceLock::new();
    let key = (id.dev, id.ino);
    let mut fds = lock(FDS.get_or_init(Default::default));
    if let Some(f) = fds.get(&key) {
        return Ok(f.clone());
    }
    let f = Arc::new(quiet::open(path)?);
    fds.insert(key, f.clone());
    Ok(f)
}
