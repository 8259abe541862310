//! A replica: an ordinary SQLite database in WAL mode that the receiver writes page
//! images into through `sqlite_dbpage`, one SQLite transaction per group.
//!
//! Applying a group (docs/ship.md §4.2):
//! 1. `BEGIN IMMEDIATE`.
//! 2. Find a witness: the first page whose new image differs from the current one.
//! 3. Write the position record with the intent (pre, post, witness); fdatasync.
//! 4. Write the pages in page order, then the truncation if the database shrank.
//! 5. `COMMIT` (synchronous=FULL).
//!
//! A crash before 5 leaves the replica at `pre`; after it at `post`. [`resolve`] reads the
//! witness to tell which, because SQLite commits all of a transaction's pages or none.

use super::state::{Intent, Pos, Record, StateFile, Witness};
use crate::names::sidecar;
use crate::proto::BaseHeader;
use rusqlite::{Connection, OpenFlags, OptionalExtension, params};
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Pages per step of the backup API during promotion: 4 MiB at 4 KiB pages, short enough
/// that readers of the replica are never held up for long.
const BACKUP_PAGES_PER_STEP: i32 = 1024;

/// Bytes of pages written to a replica's WAL after which it is checkpointed (see
/// `Receiver::checkpoint_step`).
pub const CHECKPOINT_BYTES: u64 = 4 << 20;

/// What went wrong with a replica operation.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("SQLite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    /// The position record could not be written: the state file must be reopened.
    #[error("writing the position record failed: {0}")]
    State(io::Error),
    /// What the shipper sent is not acceptable (the replica is untouched).
    #[error("{0}")]
    Invalid(String),
}

/// An open replica.
///
/// Its connection only ever touches pages through `sqlite_dbpage` and reads the size with
/// `PRAGMA page_count` (page 1's raw header). It must never read through the b-tree layer
/// (queries on tables, `quick_check`): pages written through `sqlite_dbpage` replace the
/// bytes under the b-tree's cached decoding of them, so that connection's view of the
/// tables is stale. Everything that reads tables opens a connection of its own.
pub struct Replica {
    conn: Connection,
    path: PathBuf,
    page_size: u32,
    /// Pages written since the WAL was last checkpointed to its end; unknown (so, due) at
    /// open.
    wal_pages: u64,
}

/// Where a page of a group comes from.
#[derive(Clone, Copy)]
pub enum Src<'a> {
    Mem(&'a [u8]),
    /// At this offset in the spool file.
    Spool(u64),
}

/// The effect of a group of transactions: the last image of each page (at most the final
/// size) and the final size in pages.
pub struct Group<'a> {
    pub pages: std::collections::BTreeMap<u32, Src<'a>>,
    pub size: u32,
}

impl Replica {
    /// Open an existing replica database.
    pub fn open(path: &Path) -> Result<Replica, ReplicaError> {
        let conn = Connection::open_with_flags(
            path,
            OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        configure(&conn)?;
        let page_size: u32 = conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        Ok(Replica {
            conn,
            path: path.to_path_buf(),
            page_size,
            wal_pages: u64::MAX / 2,
        })
    }

    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn page_count(&self) -> rusqlite::Result<u32> {
        self.conn.query_row("PRAGMA page_count", [], |r| r.get(0))
    }

    fn read_page(&self, pgno: u32) -> rusqlite::Result<Option<Vec<u8>>> {
        self.conn
            .prepare_cached("SELECT data FROM sqlite_dbpage WHERE pgno = ?1")?
            .query_row([pgno], |r| r.get(0))
            .optional()
    }

    /// Apply `group`, moving the replica from `pre` to `post`, with the intent written to
    /// `state` before the commit. `spool` resolves pages that live in the spool file.
    pub fn apply(
        &mut self,
        group: &Group<'_>,
        spool: Option<&std::fs::File>,
        pre: Pos,
        post: Pos,
        state: &mut StateFile,
    ) -> Result<(), ReplicaError> {
        let page = |src: &Src<'_>| -> io::Result<Vec<u8>> {
            match src {
                Src::Mem(b) => Ok(b.to_vec()),
                Src::Spool(at) => {
                    let f =
                        spool.ok_or_else(|| io::Error::other("a spooled page without a spool"))?;
                    let mut buf = vec![0u8; self.page_size as usize];
                    f.read_exact_at(&mut buf, *at)?;
                    Ok(buf)
                }
            }
        };
        let tx = Transaction::begin(&self.conn)?;
        let size_pre = self.page_count()?;
        let mut witness = None;
        for (pgno, src) in &group.pages {
            let new = page(src)?;
            let old = (*pgno <= size_pre)
                .then(|| self.read_page(*pgno))
                .transpose()?
                .flatten();
            if let Some(w) = witness_of(*pgno, old.as_deref(), &new, size_pre, group.size) {
                witness = Some(w);
                break;
            }
        }
        let witness = witness.unwrap_or(Witness {
            size_pre,
            size_post: group.size,
            ..Witness::default()
        });
        state
            .write(&Record {
                pos: post,
                intent: Intent::Group { pre, witness },
            })
            .map_err(ReplicaError::State)?;
        {
            let mut insert = self
                .conn
                .prepare_cached("INSERT INTO sqlite_dbpage(pgno, data) VALUES (?1, ?2)")?;
            // Page 1 last: it holds the schema, and a statement after a schema change
            // re-reads it, refusing root pages beyond the pages written so far.
            for (pgno, src) in group
                .pages
                .iter()
                .filter(|(p, _)| **p != 1)
                .chain(group.pages.get_key_value(&1))
            {
                insert.execute(params![pgno, page(src)?])?;
            }
            if group.size < size_pre {
                insert.execute(params![group.size + 1, rusqlite::types::Null])?;
            }
        }
        tx.commit()?;
        self.wal_pages = self.wal_pages.saturating_add(group.pages.len() as u64);
        Ok(())
    }

    /// Replace the replica's content with the staged base at `staged` (built and checked
    /// by [`build`]), in place, in one SQLite transaction: readers holding the replica
    /// open see the old state until the commit and the new one after, and never a mix.
    pub fn copy_from(
        &mut self,
        staged: &Path,
        pre: Pos,
        post: Pos,
        state: &mut StateFile,
    ) -> Result<(), ReplicaError> {
        let src = Connection::open_with_flags(
            staged,
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        let src_page_size: u32 = src.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        if src_page_size != self.page_size {
            return Err(ReplicaError::Invalid(format!(
                "the base's page size {src_page_size} differs from the replica's {}",
                self.page_size
            )));
        }
        let count: u32 = src.query_row("PRAGMA page_count", [], |r| r.get(0))?;
        let mut read = src.prepare("SELECT data FROM sqlite_dbpage WHERE pgno = ?1")?;
        let mut page =
            |pgno: u32| -> rusqlite::Result<Vec<u8>> { read.query_row([pgno], |r| r.get(0)) };
        let tx = Transaction::begin(&self.conn)?;
        let size_pre = self.page_count()?;
        let mut witness = None;
        for pgno in 1..=count {
            let new = page(pgno)?;
            let old = (pgno <= size_pre)
                .then(|| self.read_page(pgno))
                .transpose()?
                .flatten();
            if let Some(w) = witness_of(pgno, old.as_deref(), &new, size_pre, count) {
                witness = Some(w);
                break;
            }
        }
        let witness = witness.unwrap_or(Witness {
            size_pre,
            size_post: count,
            ..Witness::default()
        });
        state
            .write(&Record {
                pos: post,
                intent: Intent::Group { pre, witness },
            })
            .map_err(ReplicaError::State)?;
        {
            let mut insert = self
                .conn
                .prepare_cached("INSERT INTO sqlite_dbpage(pgno, data) VALUES (?1, ?2)")?;
            // Page 1 last, as in apply().
            for pgno in (2..=count).chain(std::iter::once(1)) {
                insert.execute(params![pgno, page(pgno)?])?;
            }
            if count < size_pre {
                insert.execute(params![count + 1, rusqlite::types::Null])?;
            }
        }
        tx.commit()?;
        self.wal_pages = self.wal_pages.saturating_add(count.into());
        Ok(())
    }

    /// Is the WAL due for a checkpoint?
    pub fn checkpoint_due(&self) -> bool {
        self.wal_pages.saturating_mul(self.page_size.into()) >= CHECKPOINT_BYTES
    }

    /// Copy to the database what the WAL holds beyond the last checkpoint, on this
    /// connection, between two groups: with nothing committing meanwhile it reaches the
    /// WAL's end (unless a reader still uses an older snapshot), and the next group
    /// restarts the WAL from its start. Returns the frames in the WAL and those copied.
    pub fn checkpoint_tail(&mut self) -> rusqlite::Result<(i64, i64)> {
        let (log, done) = checkpoint(&self.conn)?;
        if done >= log {
            self.wal_pages = 0;
        }
        Ok((log, done))
    }

    /// Did the group behind `w` commit, as recovery must record it? Like [`Self::resolve`], and
    /// when the answer is no, a commit of page 1 as it stands makes it final.
    ///
    /// A receiver killed inside SQLite's commit can leave the group's frames whole and
    /// synced in the `-wal` while the index in `-shm` does not count them yet: SQLite
    /// writes and syncs a commit's frames before it publishes them there. As long as some
    /// connection keeps the `-shm` alive (a reader of the replica), every connection opened
    /// meanwhile, this one too, sees the state before the group, and the witness says it
    /// did not commit. But once the last connection closes without checkpointing (a
    /// read-only reader cannot), the next one to open rebuilds the index from the `-wal`,
    /// finds the group, and the replica would hold what the position record says it does
    /// not. The commit written here lands right after the frames the index counts, over
    /// the group's first frame; the group's later frames then fail the `-wal`'s running
    /// checksum, and no rebuild can take them again. Only page 1's bytes that SQLite itself
    /// rewrites change (`PAGE1_REWRITTEN`).
    ///
    /// The decision and the commit happen under the write lock, and this connection keeps
    /// the `-shm` alive throughout, so no rebuild can come between them. A commit that
    /// fails can leave things as they were, or worse (one that restarted the WAL first
    /// leaves the index empty beside the group's whole chain): its caller must write no
    /// record until a commit here succeeds, so that a restart decides again from the
    /// replica itself.
    pub fn settle(&mut self, w: &Witness) -> Result<Option<bool>, ReplicaError> {
        let tx = Transaction::begin(&self.conn)?;
        let decided = self.resolve(w)?;
        if decided == Some(false) {
            let first = self.read_page(1)?.ok_or_else(|| {
                ReplicaError::Invalid("the replica has no page 1 to commit again".into())
            })?;
            self.conn
                .prepare_cached("INSERT INTO sqlite_dbpage(pgno, data) VALUES (1, ?1)")?
                .execute(params![first])?;
            tx.commit()?;
        }
        Ok(decided)
    }

    /// Did the group behind `w` commit? `Some(true)` yes, `Some(false)` no, `None` if the
    /// witness shows neither image: something else wrote the replica.
    pub fn resolve(&self, w: &Witness) -> Result<Option<bool>, ReplicaError> {
        let size = self.page_count()?;
        if w.pgno == 0 {
            return Ok(if size == w.size_post {
                Some(true)
            } else if size == w.size_pre {
                Some(false)
            } else {
                None
            });
        }
        let page = (w.pgno <= size)
            .then(|| self.read_page(w.pgno))
            .transpose()?
            .flatten();
        Ok(match page {
            None if w.pre_absent => Some(false),
            None => None,
            Some(p) => {
                let c = witness_crc(w.pgno, &p);
                if c == w.post_crc {
                    Some(true)
                } else if !w.pre_absent && c == w.pre_crc {
                    Some(false)
                } else {
                    None
                }
            }
        })
    }

    /// Copy the replica, page for page, to `dest` through SQLite's backup API. Readers of
    /// the replica are not blocked. The copy is a standalone WAL-mode database, fsynced.
    pub fn copy_to(
        &self,
        dest: &Path,
        progress: &mut dyn FnMut(u32, u32),
    ) -> Result<(), ReplicaError> {
        let _ = std::fs::remove_file(dest);
        let mut out = Connection::open(dest)?;
        {
            let backup = rusqlite::backup::Backup::new(&self.conn, &mut out)?;
            loop {
                let step = backup.step(BACKUP_PAGES_PER_STEP)?;
                let p = backup.progress();
                progress(p.pagecount as u32 - p.remaining as u32, p.pagecount as u32);
                match step {
                    rusqlite::backup::StepResult::Done => break,
                    rusqlite::backup::StepResult::More => {}
                    rusqlite::backup::StepResult::Busy | rusqlite::backup::StepResult::Locked => {
                        std::thread::sleep(std::time::Duration::from_millis(5))
                    }
                    _ => std::thread::sleep(std::time::Duration::from_millis(5)),
                }
            }
        }
        out.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
        check(&out, "quick_check")?;
        drop(out);
        std::fs::File::open(dest)?.sync_all()?;
        Ok(())
    }
}

/// The witness for a page if its new image differs from the old (None: same content).
fn witness_of(
    pgno: u32,
    old: Option<&[u8]>,
    new: &[u8],
    size_pre: u32,
    size_post: u32,
) -> Option<Witness> {
    if old.is_some_and(|o| masked_eq(pgno, o, new)) {
        return None;
    }
    Some(Witness {
        pgno,
        pre_crc: old.map_or(0, |o| witness_crc(pgno, o)),
        pre_absent: old.is_none(),
        post_crc: witness_crc(pgno, new),
        size_pre,
        size_post,
    })
}

/// Bytes of page 1 that SQLite itself rewrites when it commits page 1 on the replica: the
/// file change counter (24..28), version-valid-for (92..96) and the SQLite version number
/// (96..100). They are left out when telling a page's old image from its new one, or the
/// witness would match neither.
const PAGE1_REWRITTEN: [std::ops::Range<usize>; 2] = [24..28, 92..100];

fn witness_crc(pgno: u32, data: &[u8]) -> u32 {
    if pgno != 1 || data.len() < 100 {
        return crc32c::crc32c(data);
    }
    let mut masked = data.to_vec();
    for r in PAGE1_REWRITTEN {
        masked[r].fill(0);
    }
    crc32c::crc32c(&masked)
}

fn masked_eq(pgno: u32, a: &[u8], b: &[u8]) -> bool {
    if pgno != 1 || a.len() < 100 || a.len() != b.len() {
        return a == b;
    }
    a[..24] == b[..24] && a[28..92] == b[28..92] && a[100..] == b[100..]
}

/// Build a database from a base stream in a new file at `path` (not in use by anyone):
/// the pages, the trailer check, a commit, then `quick_check` on a fresh connection.
/// Returns the file's inode once it is complete, checked and synced, standing alone
/// without a `-wal`. On any error the caller deletes the file; nothing live was touched.
///
/// The check runs after the commit, on a new connection, because pages written through
/// `sqlite_dbpage` do not update the b-tree layer's page count within the transaction,
/// so a schema read or `quick_check` inside it sees a stale size.
pub fn build(
    path: &Path,
    body: &mut dyn Read,
    header: &BaseHeader,
    quick_check: bool,
) -> Result<u64, ReplicaError> {
    remove_with_sidecars(path)?;
    let conn = Connection::open(path)?;
    conn.pragma_update(None, "page_size", header.page_size)?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(ReplicaError::Invalid(format!(
            "could not put the new replica in WAL mode ({mode})"
        )));
    }
    configure(&conn)?;
    let tx = Transaction::begin(&conn)?;
    let mut crc = 0u32;
    let mut buf = vec![0u8; header.page_size as usize];
    {
        let mut insert = conn.prepare("INSERT INTO sqlite_dbpage(pgno, data) VALUES (?1, ?2)")?;
        let mut page1 = None;
        for pgno in 1..=header.page_count {
            read_page_from(body, &mut buf, pgno, header)?;
            crc = crc32c::crc32c_append(crc, &buf);
            if pgno == 1 {
                // Written last, see Replica::apply().
                page1 = Some(buf.clone());
            } else {
                insert.execute(params![pgno, &buf])?;
            }
        }
        if let Some(p1) = page1 {
            insert.execute(params![1, p1])?;
        }
    }
    read_trailer(body, crc)?;
    tx.commit()?;
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
    drop(conn);
    if quick_check {
        let check = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE)?;
        self::check(&check, "quick_check")?;
        check.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))?;
    }
    let file = std::fs::File::open(path)?;
    file.sync_all()?;
    Ok(file.metadata()?.ino())
}

/// Put a built replica at `replica`, moving the old replica and its `-wal`/`-shm` into
/// `attic` first, so that no new reader can ever pair the new file with the old WAL.
pub fn swap_in(built: &Path, replica: &Path, attic: &Path) -> io::Result<()> {
    let _ = std::fs::remove_dir_all(attic);
    std::fs::create_dir_all(attic)?;
    for (suffix, name) in [("", "db"), ("-wal", "db-wal"), ("-shm", "db-shm")] {
        let from = sidecar(replica, suffix);
        match std::fs::rename(&from, attic.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    std::fs::rename(built, replica)?;
    ferry_core::fs::fsync_dir(&ferry_core::fs::parent_dir(replica))?;
    ferry_core::fs::fsync_dir(&ferry_core::fs::parent_dir(built))?;
    let _ = std::fs::remove_dir_all(attic);
    Ok(())
}

/// Remove a database file and its `-wal` and `-shm`.
pub fn remove_with_sidecars(path: &Path) -> io::Result<()> {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        match std::fs::remove_file(sidecar(path, suffix)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A PASSIVE checkpoint on `conn`: the checkpointer's own connection for the bulk (see
/// `Receiver::checkpoint_step`), the applying one for the tail. Returns the frames in the
/// WAL and the frames copied.
pub fn checkpoint(conn: &Connection) -> rusqlite::Result<(i64, i64)> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
        Ok((r.get(1)?, r.get(2)?))
    })
}

/// Open a connection for background checkpoints of a replica.
pub fn open_for_checkpoints(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    conn.busy_timeout(std::time::Duration::from_millis(100))?;
    conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    Ok(conn)
}

fn configure(conn: &Connection) -> rusqlite::Result<()> {
    conn.busy_timeout(crate::sqlite::BUSY_TIMEOUT)?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    // Checkpoints run on another connection (open_for_checkpoints), so a commit never
    // waits for one.
    conn.pragma_update(None, "wal_autocheckpoint", 0)?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_MISUSE),
            Some(format!(
                "the replica could not be put in WAL mode (it stayed {mode})"
            )),
        ));
    }
    Ok(())
}

fn check(conn: &Connection, pragma: &str) -> Result<(), ReplicaError> {
    let verdict: String = conn.query_row(&format!("PRAGMA {pragma}"), [], |r| r.get(0))?;
    if verdict != "ok" {
        return Err(ReplicaError::Invalid(format!(
            "the base is not a sound SQLite database: {pragma} says {verdict}"
        )));
    }
    Ok(())
}

fn read_page_from(
    body: &mut dyn Read,
    buf: &mut [u8],
    pgno: u32,
    header: &BaseHeader,
) -> Result<(), ReplicaError> {
    body.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => ReplicaError::Invalid(format!(
            "the base ended at page {pgno} of {}: the upload was cut short",
            header.page_count
        )),
        _ => ReplicaError::Io(e),
    })?;
    if pgno == 1 {
        if &buf[..16] != b"SQLite format 3\0" {
            return Err(ReplicaError::Invalid(
                "the base's first page is not a SQLite database header".into(),
            ));
        }
        let raw = u16::from_be_bytes([buf[16], buf[17]]) as u32;
        let size = if raw == 1 { 65_536 } else { raw };
        if size != header.page_size {
            return Err(ReplicaError::Invalid(format!(
                "the base says page size {} but its database header says {size}",
                header.page_size
            )));
        }
    }
    Ok(())
}

fn read_trailer(body: &mut dyn Read, crc: u32) -> Result<(), ReplicaError> {
    let mut t = [0u8; crate::proto::BASE_TRAILER_BYTES];
    let mut got = 0;
    while got < t.len() {
        match body.read(&mut t[got..])? {
            0 => break,
            n => got += n,
        }
    }
    crate::proto::check_base_trailer(&t[..got], crc)
        .map_err(|e| ReplicaError::Invalid(e.to_string()))?;
    let mut extra = [0u8; 1];
    if body.read(&mut extra)? != 0 {
        return Err(ReplicaError::Invalid(
            "the base has bytes after its trailer".into(),
        ));
    }
    Ok(())
}

/// `BEGIN IMMEDIATE` … `COMMIT`, rolled back when dropped without a commit.
struct Transaction<'c> {
    conn: &'c Connection,
    done: bool,
}

impl<'c> Transaction<'c> {
    fn begin(conn: &'c Connection) -> rusqlite::Result<Self> {
        conn.execute_batch("BEGIN IMMEDIATE")?;
        Ok(Transaction { conn, done: false })
    }

    fn commit(mut self) -> Result<(), ReplicaError> {
        self.done = true;
        if let Err(e) = self.conn.execute_batch("COMMIT") {
            let _ = self.conn.execute_batch("ROLLBACK");
            return Err(e.into());
        }
        Ok(())
    }
}

impl Drop for Transaction<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.conn.execute_batch("ROLLBACK");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{BaseHeader, base_trailer};
    use ferry_core::epoch::Epoch;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ferry-replica-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A base stream of the database `conn` as it stands.
    fn base_of(conn: &Connection, generation: u64) -> (BaseHeader, Vec<u8>) {
        let page_size: u32 = conn
            .query_row("PRAGMA page_size", [], |r| r.get(0))
            .unwrap();
        let pages = pages_of(conn);
        let h = BaseHeader {
            page_size,
            page_count: pages.len() as u32,
            epoch: Epoch(0),
            generation,
            seq: 0,
            observed_ms: 0,
            wal_checksum: 0,
        };
        let mut body = h.encode().to_vec();
        let mut crc = 0;
        for p in &pages {
            crc = crc32c::crc32c_append(crc, p);
            body.extend_from_slice(p);
        }
        body.extend_from_slice(&base_trailer(crc));
        (h, body)
    }

    /// Every page of `conn`'s database, in order.
    fn pages_of(c: &Connection) -> Vec<Vec<u8>> {
        c.prepare("SELECT data FROM sqlite_dbpage ORDER BY pgno")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }

    /// A replica at `dir/r.db`, built from a base of `p` and swapped in.
    fn replica_of(dir: &Path, p: &Connection) -> (BaseHeader, PathBuf, Replica) {
        let (h, body) = base_of(p, 1);
        let rpath = dir.join("r.db");
        let built = dir.join("r.base");
        build(&built, &mut &body[HEADER..], &h, true).unwrap();
        swap_in(&built, &rpath, &dir.join("attic")).unwrap();
        let r = Replica::open(&rpath).unwrap();
        (h, rpath, r)
    }

    fn primary(dir: &Path, rows: usize) -> Connection {
        let c = Connection::open(dir.join("p.db")).unwrap();
        c.execute_batch("PRAGMA journal_mode=WAL; CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB); CREATE INDEX tv ON t(v);")
            .unwrap();
        for _ in 0..rows {
            c.execute("INSERT INTO t(v) VALUES (randomblob(300))", [])
                .unwrap();
        }
        c
    }

    #[test]
    fn a_built_base_equals_its_primary_and_an_in_place_base_replaces_it() {
        let dir = scratch("build");
        let p = primary(&dir, 200);
        let (_, rpath, mut r) = replica_of(&dir, &p);
        assert_eq!(
            crate::sqlite::digest(&Connection::open(&rpath).unwrap()).unwrap(),
            crate::sqlite::digest(&p).unwrap()
        );

        for _ in 0..300 {
            p.execute("INSERT INTO t(v) VALUES (randomblob(500))", [])
                .unwrap();
        }
        p.execute("DELETE FROM t WHERE id % 3 = 0", []).unwrap();
        let (h2, body2) = base_of(&p, 2);
        let (mut state, _) = super::super::state::StateFile::open(&dir.join("s")).unwrap();
        let pos = Pos {
            page_size: h2.page_size,
            ..Pos::default()
        };
        let staged = dir.join("staged");
        build(&staged, &mut &body2[HEADER..], &h2, true).unwrap();
        r.copy_from(&staged, pos, pos, &mut state).unwrap();
        // A fresh connection: the applying one never reads through the b-tree (see Replica).
        let fresh = Connection::open(&rpath).unwrap();
        assert_eq!(
            crate::sqlite::digest(&fresh).unwrap(),
            crate::sqlite::digest(&p).unwrap()
        );
        assert_eq!(
            r.page_count().unwrap(),
            p.query_row("PRAGMA page_count", [], |x| x.get::<_, u32>(0))
                .unwrap()
        );
        let ok: String = fresh
            .query_row("PRAGMA integrity_check", [], |x| x.get(0))
            .unwrap();
        assert_eq!(ok, "ok");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    const HEADER: usize = crate::proto::BASE_HEADER_BYTES;

    /// Recovery decides whether a group committed from its witness alone: over random
    /// transactions (growth, deletes, updates, schema changes that rewrite page 1,
    /// VACUUM that shrinks), each group applied must read back as committed from a
    /// fresh connection, as `Slot::recover` reads it.
    #[test]
    fn the_witness_of_every_committed_group_resolves_as_committed() {
        let dir = scratch("witness");
        let p = primary(&dir, 50);
        let (h, rpath, mut r) = replica_of(&dir, &p);
        let (mut state, _) = StateFile::open(&dir.join("s")).unwrap();
        let mut before = pages_of(&p);
        let mut rng = ferry_core::seams::SplitMix64::seeded(12345);
        let mut next = || ferry_core::seams::Rng::next_u64(&mut rng);
        let pos = Pos {
            page_size: h.page_size,
            ..Pos::default()
        };
        let mut bad = 0;
        for i in 0..3000u32 {
            let k = next() % 10;
            match k {
                0..=4 => {
                    p.execute(
                        "INSERT INTO t(v) VALUES (randomblob(?1))",
                        [(next() % 2000) as i64],
                    )
                    .unwrap();
                }
                5 => {
                    p.execute("DELETE FROM t WHERE id % 7 = ?1", [(next() % 7) as i64])
                        .unwrap();
                }
                6 => {
                    p.execute(
                        "UPDATE t SET v = randomblob(100) WHERE id % 5 = ?1",
                        [(next() % 5) as i64],
                    )
                    .unwrap();
                }
                7 => {
                    p.execute_batch(&format!(
                        "CREATE TABLE IF NOT EXISTS x{} (a); DROP TABLE IF EXISTS x{};",
                        i % 3,
                        (i + 1) % 3
                    ))
                    .unwrap();
                }
                8 => {
                    if next() % 20 == 0 {
                        p.execute_batch("VACUUM").unwrap();
                    }
                }
                _ => {
                    p.execute("INSERT INTO t(v) VALUES (1)", []).unwrap();
                }
            }
            let after = pages_of(&p);
            let mut pages = std::collections::BTreeMap::new();
            for (at, pg) in after.iter().enumerate() {
                if before.get(at) != Some(pg) {
                    pages.insert(at as u32 + 1, Src::Mem(pg.as_slice()));
                }
            }
            if pages.is_empty() && after.len() == before.len() {
                before = after;
                continue;
            }
            let group = Group {
                pages,
                size: after.len() as u32,
            };
            r.apply(&group, None, pos, pos, &mut state).unwrap();
            let (_, rec) = StateFile::open(&dir.join("s")).unwrap();
            let Intent::Group { witness, .. } = rec.expect("a record").intent else {
                panic!("apply writes a group's intent")
            };
            let fresh = Replica::open(&rpath).unwrap();
            let got = fresh.resolve(&witness).unwrap();
            if got != Some(true) {
                bad += 1;
                eprintln!("txn {i} kind {k}: resolve {got:?} witness {witness:?}");
            }
            before = after;
        }
        assert_eq!(bad, 0, "committed groups resolved as not committed");
        assert_eq!(
            crate::sqlite::digest(&Connection::open(&rpath).unwrap()).unwrap(),
            crate::sqlite::digest(&p).unwrap()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
