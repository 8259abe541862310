//! SQLite as ferry opens it.
//!
//! - [`check_library`]: the linked SQLite is rusqlite's bundled build at 3.51.3 or later,
//!   which fixes the WAL-reset bug (a checkpoint racing a writer could drop committed
//!   writes in 3.7.0 to 3.51.2). Every ferry-ship entry point calls it.
//! - [`check_dbpage`]: the receiver needs `sqlite_dbpage`, compiled in by
//!   `SQLITE_ENABLE_DBPAGE_VTAB` (`.cargo/config.toml`).
//! - [`prepare_connection`]: what an app does to every connection of a shipped database.
//! - The wake registry: a commit on a prepared connection wakes any shipper in this process
//!   that tracks the database, within microseconds.

use ferry_core::sync::lock;
use rusqlite::{Connection, OpenFlags};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

/// SQLite 3.51.3 as `sqlite3_libversion_number()` spells it.
pub const SQLITE_VERSION_MIN: i32 = 3_051_003;

/// How long a ferry connection waits for a lock before SQLITE_BUSY. Long enough to ride
/// out an app's write transaction, short enough that a stuck lock shows up in status.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The linked SQLite cannot run ferry-ship. Permanent: only another build fixes it.
#[derive(Debug, thiserror::Error)]
pub enum LibraryError {
    #[error(
        "SQLite {version} is linked, but ferry-ship needs 3.51.3 or later (earlier versions can lose \
         committed writes when a checkpoint races a writer); build with rusqlite's bundled SQLite"
    )]
    TooOld { version: &'static str },
    #[error(
        "this build of SQLite lacks the sqlite_dbpage table the receiver applies pages with ({source}); \
         build ferry from its workspace, whose .cargo/config.toml sets \
         LIBSQLITE3_FLAGS=SQLITE_ENABLE_DBPAGE_VTAB"
    )]
    NoDbpage { source: rusqlite::Error },
}

impl ferry_core::Classify for LibraryError {
    fn class(&self) -> ferry_core::Class {
        ferry_core::Class::Permanent
    }
}

/// Can waiting cure this SQLite error? A busy or locked database (another connection
/// holds the lock) and a full disk (space may be freed) can; anything else fails the
/// same way again.
pub fn waiting_cures(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(
            rusqlite::ErrorCode::DatabaseBusy
                | rusqlite::ErrorCode::DatabaseLocked
                | rusqlite::ErrorCode::DiskFull
        )
    )
}

/// Refuse to run on a SQLite that has the WAL-reset bug.
pub fn check_library() -> Result<(), LibraryError> {
    if rusqlite::version_number() < SQLITE_VERSION_MIN {
        return Err(LibraryError::TooOld {
            version: rusqlite::version(),
        });
    }
    Ok(())
}

/// Refuse to apply pages without `sqlite_dbpage`.
pub fn check_dbpage(conn: &Connection) -> Result<(), LibraryError> {
    conn.query_row(
        "SELECT count(*) FROM sqlite_dbpage WHERE pgno = 1",
        [],
        |_| Ok(()),
    )
    .map_err(|source| LibraryError::NoDbpage { source })
}

/// Where SQLite's wal-index (`-shm`) says the WAL's committed frames end: the salts of the
/// cycle it describes (as the WAL header spells them) and its last committed frame
/// (`mxFrame`).
///
/// Only frames up to it are committed for SQLite. A writer killed after syncing a commit's
/// frames but before publishing them here leaves a commit that chains and validates in the
/// `-wal`, and yet, while another connection (the shipper's own) keeps the index alive, the
/// next writer overwrites it, and a checkpoint never copies it: a shipper that took it
/// would give the replica a transaction the primary never had.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WalIndexEnd {
    pub salts: crate::wal::Salts,
    pub frame: u32,
}

/// The wal-index's first region, as every SQLite connection maps it (`WALINDEX_PGSZ`).
const WAL_INDEX_REGION_BYTES: i32 = 32 * 1024;
/// The wal-index header: `iVersion u32, unused u32, iChange u32, isInit u8, bigEndCksum u8,
/// szPage u16, mxFrame u32, nPage u32, aFrameCksum[2] u32, aSalt[2] u32, aCksum[2] u32`
/// in native byte order (the salts as raw bytes of the WAL header), stored twice in a
/// row. A writer writes the second copy, then the first; a reader that finds them equal
/// read no half-written header.
const WAL_INDEX_HEADER_BYTES: usize = 48;
/// `WALINDEX_MAX_VERSION`, the header's `iVersion`.
const WAL_INDEX_VERSION: u32 = 3_007_000;
/// Reads of the two copies before giving up for now: they differ only while a commit
/// publishes itself, a few instructions' worth.
const WAL_INDEX_READS_MAX: usize = 100;

/// Read [`WalIndexEnd`] through `conn`'s own mapping of the `-shm` (the VFS's `xShmMap`, as
/// SQLite itself does): the file is never opened or closed here, which would drop the
/// locks SQLite holds on it. None if the connection's VFS has no shared memory, no index is
/// mapped yet, or the header did not read consistently.
pub fn wal_index_end(conn: &Connection) -> Option<WalIndexEnd> {
    if !in_wal_mode(conn) {
        return None;
    }
    wal_index_end_mapped(conn)
}

/// Whether `conn` is in WAL mode. Asking reads the schema, which opens the WAL of a WAL
/// database and maps its wal-index: afterwards the connection keeps that mapping until it
/// closes its WAL, which only a statement of its own does.
pub fn in_wal_mode(conn: &Connection) -> bool {
    conn.prepare_cached("PRAGMA journal_mode")
        .and_then(|mut s| s.query_row([], |r| r.get::<_, String>(0)))
        .is_ok_and(|mode| mode.eq_ignore_ascii_case("wal"))
}

/// [`wal_index_end`] without asking the journal mode first: only for a connection that
/// [`in_wal_mode`] found in WAL mode and that ran no statement since. On a connection that
/// is not in WAL mode, `xShmMap` would create a `-shm` and attach a handle only closing
/// the WAL detaches; asking costs a read transaction, as much as the rest of a step.
pub fn wal_index_end_mapped(conn: &Connection) -> Option<WalIndexEnd> {
    use rusqlite::ffi;
    use std::ffi::c_void;
    let mut file: *mut ffi::sqlite3_file = std::ptr::null_mut();
    let mut region: *mut c_void = std::ptr::null_mut();
    #[allow(unsafe_code)]
    // SAFETY: SQLITE_FCNTL_FILE_POINTER stores the main database's `sqlite3_file` (owned
    // by the open connection `conn`, which outlives this call) into `file`. Its methods
    // table is SQLite's own; version 2 and later have `xShmMap`, which with bExtend = 0
    // returns the region the connection's shared-memory node already maps (or maps it, as
    // the connection's next read would), or null if there is none; it stays mapped until
    // the connection closes.
    unsafe {
        let rc = ffi::sqlite3_file_control(
            conn.handle(),
            c"main".as_ptr(),
            ffi::SQLITE_FCNTL_FILE_POINTER,
            (&mut file as *mut *mut ffi::sqlite3_file).cast(),
        );
        if rc != ffi::SQLITE_OK || file.is_null() {
            return None;
        }
        let methods = (*file).pMethods;
        if methods.is_null() || (*methods).iVersion < 2 {
            return None;
        }
        let map = (*methods).xShmMap?;
        if map(file, 0, WAL_INDEX_REGION_BYTES, 0, &mut region) != ffi::SQLITE_OK
            || region.is_null()
        {
            return None;
        }
    }
    let base = region as *const u8;
    for _ in 0..WAL_INDEX_READS_MAX {
        let mut copies = [[0u8; WAL_INDEX_HEADER_BYTES]; 2];
        for (c, copy) in copies.iter_mut().enumerate() {
            for (i, b) in copy.iter_mut().enumerate() {
                #[allow(unsafe_code)]
                // SAFETY: the region is at least WAL_INDEX_REGION_BYTES long and mapped
                // for as long as `conn` is open; other processes write it concurrently,
                // hence volatile byte reads, checked below by comparing the two copies.
                unsafe {
                    *b = std::ptr::read_volatile(base.add(c * WAL_INDEX_HEADER_BYTES + i));
                }
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        }
        let [first, second] = &copies;
        let u32_at = |at: usize| u32::from_ne_bytes(first[at..at + 4].try_into().expect("4 bytes"));
        if first == second
            && first[12] != 0
            && u32_at(0) == WAL_INDEX_VERSION
            && header_checksum(first) == (u32_at(40), u32_at(44))
        {
            let salt =
                |at: usize| u32::from_be_bytes(first[at..at + 4].try_into().expect("4 bytes"));
            return Some(WalIndexEnd {
                salts: crate::wal::Salts(salt(32), salt(36)),
                frame: u32_at(16),
            });
        }
        std::thread::yield_now();
    }
    None
}

/// The checksum SQLite keeps over a wal-index header's first 40 bytes (`walChecksumBytes`
/// in native byte order, as `walIndexWriteHdr` computes it): a header that fails it is one
/// SQLite itself would not trust.
fn header_checksum(h: &[u8; WAL_INDEX_HEADER_BYTES]) -> (u32, u32) {
    let (mut s1, mut s2) = (0u32, 0u32);
    for pair in h[..40].chunks_exact(8) {
        let a = u32::from_ne_bytes(pair[..4].try_into().expect("4 bytes"));
        let b = u32::from_ne_bytes(pair[4..].try_into().expect("4 bytes"));
        s1 = s1.wrapping_add(a).wrapping_add(s2);
        s2 = s2.wrapping_add(b).wrapping_add(s1);
    }
    (s1, s2)
}

/// Prepare an app's connection to a database that ferry ships:
/// WAL mode, no automatic checkpoints (the shipper folds the WAL once the receiver has
/// it), no checkpoint when the last connection closes, a busy handler that waits up to
/// `BUSY_TIMEOUT` in steps short enough that a fold's lock of a millisecond or two costs
/// the app about that long (see [`app_busy`]), and a hook that wakes an in-process
/// shipper after every commit.
///
/// Without it the database still ships, but an app checkpoint that races the shipper can
/// cost a full base, and an in-process shipper notices commits by inotify instead.
pub fn prepare_connection(conn: &mut Connection) -> rusqlite::Result<()> {
    conn.busy_handler(Some(app_busy))?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_MISUSE),
            Some(format!(
                "could not switch the database to WAL mode (it stayed {mode}); is it in memory?"
            )),
        ));
    }
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
        true,
    )?;
    // wal_autocheckpoint is itself a WAL hook: set it first, then install ours over it.
    conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    if let Some(path) = conn.path().map(canonical) {
        install_wake_hook(conn, interned(path));
    }
    Ok(())
}

/// Install a WAL hook that wakes shippers of `path` after every commit. rusqlite's own
/// `wal_hook` takes a plain function with no context, so the hook is set through the C
/// API with the path as its context.
fn install_wake_hook(conn: &Connection, path: &'static PathBuf) {
    use rusqlite::ffi;
    use std::ffi::{c_char, c_int, c_void};
    extern "C" fn on_commit(
        context: *mut c_void,
        _db: *mut ffi::sqlite3,
        _schema: *const c_char,
        _pages: c_int,
    ) -> c_int {
        // SAFETY: `context` is the `&'static PathBuf` passed below; it is never freed.
        #[allow(unsafe_code)]
        let path = unsafe { &*(context as *const PathBuf) };
        // A panic must not unwind into SQLite; a failed wake only delays shipping until
        // inotify or the backstop poll notices the commit.
        let _ = std::panic::catch_unwind(|| wake_path(path));
        ffi::SQLITE_OK
    }
    let context = path as *const PathBuf as *mut c_void;
    // SAFETY: the handle is valid for the life of `conn`; the hook and its context live
    // for the whole process (the context is interned and never freed), so SQLite may call
    // the hook until the connection closes.
    #[allow(unsafe_code)]
    unsafe {
        ffi::sqlite3_wal_hook(conn.handle(), Some(on_commit), context);
    }
}

/// A `'static` copy of `path`, one per distinct path for the life of the process: the WAL
/// hook's context must outlive every connection, and a process opens a bounded set of
/// databases.
fn interned(path: PathBuf) -> &'static PathBuf {
    static PATHS: OnceLock<Mutex<HashMap<PathBuf, &'static PathBuf>>> = OnceLock::new();
    let mut paths = lock(PATHS.get_or_init(Mutex::default));
    paths
        .entry(path.clone())
        .or_insert_with(|| Box::leak(Box::new(path)))
}

/// Open a connection for ferry's own use on a primary database: read-write (checkpoints
/// need it), never creating the file, with the settings of [`prepare_connection`] minus
/// the hook.
pub fn open_primary(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )?;
    conn.busy_timeout(BUSY_TIMEOUT)?;
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
        true,
    )?;
    conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    Ok(conn)
}

/// Between attempts at a lock held by an app (see [`eager_busy_handler`]).
pub const EAGER_RETRY: Duration = Duration::from_micros(50);

/// A busy handler that retries every 50 µs, for up to `BUSY_TIMEOUT`: install it on a
/// connection that must take the write lock from an app that commits back to back.
/// SQLite's own handler sleeps 1 ms, then 2, 5, 10…, and against such a writer it almost
/// never lands in the microseconds between two transactions: a base or a fold would wait
/// for the app to pause, which under load is never.
pub fn eager_busy_handler(conn: &mut Connection) -> rusqlite::Result<()> {
    conn.busy_handler(Some(eager_busy))
}

fn eager_busy(attempts: i32) -> bool {
    if (attempts as u128) * EAGER_RETRY.as_micros() >= BUSY_TIMEOUT.as_micros() {
        return false;
    }
    std::thread::sleep(EAGER_RETRY);
    true
}

/// Between attempts of a prepared app connection at a lock, for its first
/// `APP_FINE_FOR`; then `APP_COARSE_RETRY`.
const APP_FINE_RETRY: Duration = Duration::from_micros(100);
const APP_FINE_FOR: Duration = Duration::from_millis(10);
const APP_COARSE_RETRY: Duration = Duration::from_millis(1);

/// The busy handler `prepare_connection` installs. The locks an app meets most are a
/// fold's, held for one small checkpoint (a millisecond or two); SQLite's own handler
/// sleeps 1 ms, then 2, then 5, so an app that meets one waits up to three times as
/// long as the lock is held. This one retries every 100 µs for 10 ms, then every
/// millisecond, up to `BUSY_TIMEOUT` in all.
fn app_busy(attempts: i32) -> bool {
    let fine = (APP_FINE_FOR.as_micros() / APP_FINE_RETRY.as_micros()) as u32;
    let attempts = attempts.max(0) as u32;
    let waited = if attempts <= fine {
        APP_FINE_RETRY * attempts
    } else {
        APP_FINE_FOR + APP_COARSE_RETRY * (attempts - fine)
    };
    if waited >= BUSY_TIMEOUT {
        return false;
    }
    std::thread::sleep(if attempts < fine {
        APP_FINE_RETRY
    } else {
        APP_COARSE_RETRY
    });
    true
}

/// Best-effort canonical path: wake keys must match however the path was spelled.
pub fn canonical(path: impl AsRef<Path>) -> PathBuf {
    let path = path.as_ref();
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

type Waker = dyn Fn() + Send + Sync;

fn registry() -> &'static Mutex<HashMap<PathBuf, Vec<Weak<Waker>>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<PathBuf, Vec<Weak<Waker>>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Wake every shipper in this process that tracks the database at `path`.
pub fn wake_path(path: &Path) {
    let wakers: Vec<Arc<Waker>> = {
        let map = lock(registry());
        match map.get(path) {
            Some(list) => list.iter().filter_map(Weak::upgrade).collect(),
            None => return,
        }
    };
    for w in wakers {
        w();
    }
}

/// A waker registered for a database path; dropping it unregisters.
pub struct Registration {
    path: PathBuf,
    waker: Arc<Waker>,
}

/// Register `waker` to run when a prepared connection commits to `path`.
pub fn register_waker(path: &Path, waker: Arc<Waker>) -> Registration {
    let path = canonical(path);
    let mut map = lock(registry());
    let list = map.entry(path.clone()).or_default();
    list.retain(|w| w.strong_count() > 0);
    list.push(Arc::downgrade(&waker));
    Registration { path, waker }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut map = lock(registry());
        if let Some(list) = map.get_mut(&self.path) {
            list.retain(|w| {
                w.strong_count() > 0 && !std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(&self.waker))
            });
            if list.is_empty() {
                map.remove(&self.path);
            }
        }
    }
}

/// A logical digest of a database: every table's rows in rowid (or key) order, hashed
/// with their types. Two databases with equal digests hold the same data, whatever their
/// page layout; `ferry demo` and the tests compare a replica with its primary this way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Digest {
    pub tables: u64,
    pub rows: u64,
    pub hash: u64,
}

pub fn digest(conn: &Connection) -> rusqlite::Result<Digest> {
    let tables: Vec<(String, bool)> = conn
        .prepare("SELECT name, sql LIKE '%WITHOUT ROWID%' FROM sqlite_schema WHERE type = 'table' ORDER BY name")?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<Result<_, _>>()?;
    let mut d = Digest {
        tables: tables.len() as u64,
        rows: 0,
        hash: 0xcbf2_9ce4_8422_2325,
    };
    for (name, without_rowid) in tables {
        mix(&mut d.hash, name.as_bytes());
        let quoted = name.replace('"', "\"\"");
        let columns = conn
            .prepare(&format!("SELECT * FROM \"{quoted}\" LIMIT 0"))?
            .column_count();
        let order = if without_rowid {
            (1..=columns)
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        } else {
            "rowid".to_string()
        };
        let mut stmt = conn.prepare(&format!("SELECT * FROM \"{quoted}\" ORDER BY {order}"))?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            d.rows += 1;
            for i in 0..columns {
                use rusqlite::types::ValueRef;
                match row.get_ref(i)? {
                    ValueRef::Null => mix(&mut d.hash, b"n"),
                    ValueRef::Integer(v) => {
                        mix(&mut d.hash, b"i");
                        mix(&mut d.hash, &v.to_le_bytes())
                    }
                    ValueRef::Real(v) => {
                        mix(&mut d.hash, b"r");
                        mix(&mut d.hash, &v.to_le_bytes())
                    }
                    ValueRef::Text(t) => {
                        mix(&mut d.hash, b"t");
                        mix(&mut d.hash, t)
                    }
                    ValueRef::Blob(b) => {
                        mix(&mut d.hash, b"b");
                        mix(&mut d.hash, b)
                    }
                }
            }
        }
    }
    Ok(d)
}

fn mix(h: &mut u64, bytes: &[u8]) {
    let c = crc32c::crc32c(bytes) as u64 | ((bytes.len() as u64) << 32);
    *h = (*h ^ c).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29) ^ (*h >> 17);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    // Guards the reading of SQLite's wal-index: the end it gives is SQLite's, frame for
    // frame, as commits go in, across a WAL reset, and not moved by a whole commit laid in
    // the `-wal` that no writer published (a writer killed between the two).
    #[test]
    fn the_wal_index_end_is_what_sqlite_published() {
        use std::os::unix::fs::FileExt;
        let dir = std::env::temp_dir().join(format!("ferry-walindex-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.db");
        let mut app = Connection::open(&path).unwrap();
        prepare_connection(&mut app).unwrap();
        let watcher = Connection::open(&path).unwrap();
        watcher
            .query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))
            .unwrap();
        let wal_end = || {
            let wal = std::fs::read(dir.join("a.db-wal")).unwrap();
            let h = crate::wal::Header::parse(&wal).unwrap();
            (
                h.salts,
                crate::wal::scan(&wal, &h.start(), crate::wal::POSITIONS_ONLY)
                    .unwrap()
                    .end
                    .frame,
            )
        };
        app.execute_batch("CREATE TABLE t(x); INSERT INTO t VALUES (randomblob(5000));")
            .unwrap();
        for _ in 0..3 {
            app.execute("INSERT INTO t VALUES (randomblob(3000))", [])
                .unwrap();
            let (salts, frame) = wal_end();
            assert_eq!(wal_index_end(&watcher), Some(WalIndexEnd { salts, frame }));
        }
        // A reset: a checkpoint of everything, then the next commit starts a new cycle.
        app.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
            .unwrap();
        app.execute("INSERT INTO t VALUES (1)", []).unwrap();
        let (salts, frame) = wal_end();
        let published = wal_index_end(&watcher).unwrap();
        assert_eq!(published, WalIndexEnd { salts, frame });

        // A commit nobody published: made on a copy, its frames laid after ours.
        let twin = dir.join("twin");
        std::fs::create_dir_all(&twin).unwrap();
        std::fs::copy(&path, twin.join("a.db")).unwrap();
        std::fs::copy(dir.join("a.db-wal"), twin.join("a.db-wal")).unwrap();
        let t = Connection::open(twin.join("a.db")).unwrap();
        t.pragma_update(None, "wal_autocheckpoint", 0).unwrap();
        t.execute("INSERT INTO t VALUES (randomblob(9000))", [])
            .unwrap();
        let twin_wal = std::fs::read(twin.join("a.db-wal")).unwrap();
        let ours = std::fs::read(dir.join("a.db-wal")).unwrap();
        // The twin's commit starts after the last published frame (the file goes on with
        // frames of the cycle before, which it overwrites).
        let at = crate::wal::frame_offset(4096, frame + 1) as usize;
        assert!(twin_wal.len() > at && twin_wal[..at] == ours[..at]);
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("a.db-wal"))
            .unwrap()
            .write_all_at(&twin_wal[at..], at as u64)
            .unwrap();
        assert!(
            wal_end().1 > frame,
            "the unpublished commit validates in the -wal"
        );
        assert_eq!(wal_index_end(&watcher), Some(published));
        drop(t);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn waiting_cures_a_held_lock_and_a_full_disk_only() {
        let failure = |code| rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), None);
        for code in [
            rusqlite::ffi::SQLITE_BUSY,
            rusqlite::ffi::SQLITE_LOCKED,
            rusqlite::ffi::SQLITE_FULL,
        ] {
            assert!(waiting_cures(&failure(code)), "{code}");
        }
        for code in [rusqlite::ffi::SQLITE_CORRUPT, rusqlite::ffi::SQLITE_IOERR] {
            assert!(!waiting_cures(&failure(code)), "{code}");
        }
        assert!(!waiting_cures(&rusqlite::Error::QueryReturnedNoRows));
    }

    #[test]
    fn the_bundled_sqlite_is_new_enough_and_has_dbpage() {
        check_library().unwrap();
        let conn = Connection::open_in_memory().unwrap();
        check_dbpage(&conn).unwrap();
    }

    #[test]
    fn a_prepared_connection_wakes_a_registered_waker_on_commit_and_never_checkpoints() {
        let dir = std::env::temp_dir().join(format!("ferry-sqlite-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.db");
        let mut conn = Connection::open(&path).unwrap();
        prepare_connection(&mut conn).unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let reg = register_waker(
            &path,
            Arc::new(move || {
                h.fetch_add(1, Ordering::SeqCst);
            }),
        );
        conn.execute_batch("CREATE TABLE t(x); INSERT INTO t VALUES (1);")
            .unwrap();
        conn.execute("INSERT INTO t VALUES (2)", []).unwrap();
        assert_eq!(hits.load(Ordering::SeqCst), 3, "one wake per commit");
        drop(reg);
        conn.execute("INSERT INTO t VALUES (3)", []).unwrap();
        assert_eq!(
            hits.load(Ordering::SeqCst),
            3,
            "no wake after unregistering"
        );
        for _ in 0..1500 {
            conn.execute("INSERT INTO t VALUES (randomblob(3000))", [])
                .unwrap();
        }
        drop(conn);
        let wal = std::fs::metadata(dir.join("a.db-wal")).unwrap().len();
        assert!(
            wal > 1500 * 3000,
            "the WAL was folded behind the shipper's back: {wal} bytes"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
