//! A self-verifying SQLite workload. Each transaction inserts rows, sometimes drops all
//! rows of an older transaction, logs what it did, and extends a hash chain stored in the
//! database. [`verify`] recomputes everything from the rows, so any snapshot can be
//! checked on its own: a partial transaction, a missing one, or a torn page shows up as a
//! chain or digest mismatch.

use crate::Rng;
use rusqlite::{Connection, OptionalExtension, params};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, txn INTEGER NOT NULL, payload BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS t_txn ON t(txn);
CREATE TABLE IF NOT EXISTS log(txn INTEGER PRIMARY KEY, rows INTEGER NOT NULL, digest INTEGER NOT NULL,
                               drops INTEGER NOT NULL, dropped INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('txn', 0), ('chain', 0);
";

/// What one transaction does.
#[derive(Clone, Copy, Debug)]
pub enum Shape {
    /// 1 to `rows` rows of 16 to `payload` random bytes.
    Rows { rows: u64, payload: u64 },
    /// One row of exactly `bytes` (a large transaction).
    Big { bytes: u64 },
    /// Drop all rows of a random older transaction, and insert one row.
    Drop,
}

/// Create the workload's tables in one transaction, so that no commit boundary shows
/// them half made (a replica may be read at any of them).
pub fn init(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch(&format!("BEGIN IMMEDIATE; {SCHEMA} COMMIT;"))
}

fn h(prev: u64, data: &[u8]) -> u64 {
    let a = crc32c::crc32c_append(prev as u32, data) as u64;
    let b = crc32c::crc32c_append((prev >> 32) as u32 ^ 0x9e37_79b9, data) as u64;
    let x = (a | (b << 32)) ^ prev.rotate_left(17);
    x.wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ (x >> 29)
}

/// Write one transaction of `shape`; returns its number.
pub fn write(conn: &Connection, rng: &mut Rng, shape: Shape) -> rusqlite::Result<u64> {
    conn.execute_batch("BEGIN IMMEDIATE")?;
    match write_inner(conn, rng, shape) {
        Ok(n) => {
            conn.execute_batch("COMMIT")?;
            Ok(n)
        }
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}

fn write_inner(conn: &Connection, rng: &mut Rng, shape: Shape) -> rusqlite::Result<u64> {
    let txn: i64 = conn.query_row("SELECT v FROM meta WHERE k = 'txn'", [], |r| r.get(0))?;
    let chain: i64 = conn.query_row("SELECT v FROM meta WHERE k = 'chain'", [], |r| r.get(0))?;
    let txn = txn + 1;
    let mut drops = 0i64;
    let payloads: Vec<Vec<u8>> = match shape {
        Shape::Rows { rows, payload } => {
            let n = rng.range(1, rows + 1);
            (0..n)
                .map(|_| {
                    let len = rng.range(16, payload.max(17)) as usize;
                    rng.bytes(len)
                })
                .collect()
        }
        Shape::Big { bytes } => vec![rng.bytes(bytes as usize)],
        Shape::Drop => {
            let victim: Option<i64> = conn
                .query_row(
                    "SELECT txn FROM log WHERE dropped = 0 AND txn < ?1 ORDER BY txn LIMIT 1 OFFSET ?2",
                    params![txn, rng.range(0, 20) as i64],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(v) = victim {
                conn.execute("DELETE FROM t WHERE txn = ?1", [v])?;
                conn.execute("UPDATE log SET dropped = 1 WHERE txn = ?1", [v])?;
                drops = v;
            }
            vec![rng.bytes(100)]
        }
    };
    let mut digest = 0u64;
    let mut insert = conn.prepare_cached("INSERT INTO t(txn, payload) VALUES (?1, ?2)")?;
    for p in &payloads {
        insert.execute(params![txn, p])?;
        let id = conn.last_insert_rowid();
        digest = h(h(digest, &id.to_le_bytes()), p);
    }
    conn.execute(
        "INSERT INTO log(txn, rows, digest, drops) VALUES (?1, ?2, ?3, ?4)",
        params![txn, payloads.len() as i64, digest as i64, drops],
    )?;
    let chain = link(chain as u64, txn, payloads.len() as u64, digest, drops);
    conn.execute("UPDATE meta SET v = ?1 WHERE k = 'txn'", [txn])?;
    conn.execute("UPDATE meta SET v = ?1 WHERE k = 'chain'", [chain as i64])?;
    Ok(txn as u64)
}

fn link(chain: u64, txn: i64, rows: u64, digest: u64, drops: i64) -> u64 {
    let mut b = Vec::with_capacity(32);
    b.extend_from_slice(&txn.to_le_bytes());
    b.extend_from_slice(&rows.to_le_bytes());
    b.extend_from_slice(&digest.to_le_bytes());
    b.extend_from_slice(&drops.to_le_bytes());
    h(chain, &b)
}

/// The result of a successful verification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verified {
    pub txns: u64,
    pub chain: u64,
}

/// Why a database fails [`verify`].
#[derive(Debug)]
pub enum VerifyError {
    /// SQLite refused the reads (no such table yet, busy, locked): no verdict on the data.
    Sqlite(rusqlite::Error),
    /// The data contradicts itself: not a consistent copy of the workload.
    Inconsistent(String),
}

impl std::fmt::Display for VerifyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VerifyError::Sqlite(e) => e.fmt(f),
            VerifyError::Inconsistent(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for VerifyError {}

impl From<rusqlite::Error> for VerifyError {
    fn from(e: rusqlite::Error) -> Self {
        VerifyError::Sqlite(e)
    }
}

/// Check a database (or replica) against itself, inside one read transaction.
pub fn verify(conn: &Connection) -> Result<Verified, VerifyError> {
    if !conn.is_autocommit() {
        // The caller holds a transaction: verify inside it.
        return verify_inner(conn);
    }
    conn.execute_batch("BEGIN")?;
    let r = verify_inner(conn);
    let _ = conn.execute_batch("COMMIT");
    r
}

fn verify_inner(conn: &Connection) -> Result<Verified, VerifyError> {
    let e = VerifyError::Sqlite;
    let txns: i64 = conn
        .query_row("SELECT v FROM meta WHERE k = 'txn'", [], |r| r.get(0))
        .map_err(e)?;
    let chain: i64 = conn
        .query_row("SELECT v FROM meta WHERE k = 'chain'", [], |r| r.get(0))
        .map_err(e)?;
    let mut stmt = conn
        .prepare("SELECT txn, rows, digest, drops, dropped FROM log ORDER BY txn")
        .map_err(e)?;
    let logs: Vec<(i64, i64, i64, i64, i64)> = stmt
        .query_map([], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })
        .map_err(e)?
        .collect::<Result<_, _>>()
        .map_err(e)?;
    if logs.len() as i64 != txns {
        return Err(VerifyError::Inconsistent(format!(
            "meta says {txns} transactions, the log holds {}",
            logs.len()
        )));
    }
    let mut c = 0u64;
    let mut dropped_by = std::collections::HashMap::new();
    for (i, (txn, rows, digest, drops, _)) in logs.iter().enumerate() {
        if *txn != i as i64 + 1 {
            return Err(VerifyError::Inconsistent(format!(
                "log entry {i} is transaction {txn}"
            )));
        }
        c = link(c, *txn, *rows as u64, *digest as u64, *drops);
        if *drops != 0 {
            dropped_by.insert(*drops, *txn);
        }
    }
    if c != chain as u64 {
        return Err(VerifyError::Inconsistent(format!(
            "the hash chain over {txns} transactions does not match meta"
        )));
    }
    let mut rows_stmt = conn
        .prepare("SELECT id, payload FROM t WHERE txn = ?1 ORDER BY id")
        .map_err(e)?;
    for (txn, rows, digest, _, dropped) in &logs {
        let got: Vec<(i64, Vec<u8>)> = rows_stmt
            .query_map([txn], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(e)?
            .collect::<Result<_, _>>()
            .map_err(e)?;
        if *dropped != 0 {
            if !got.is_empty() || !dropped_by.contains_key(txn) {
                return Err(VerifyError::Inconsistent(format!(
                    "transaction {txn} is marked dropped but its rows or its dropper disagree"
                )));
            }
            continue;
        }
        let d = got
            .iter()
            .fold(0u64, |d, (id, p)| h(h(d, &id.to_le_bytes()), p));
        if got.len() as i64 != *rows || d != *digest as u64 {
            return Err(VerifyError::Inconsistent(format!(
                "transaction {txn}: {} rows with digest {d:x}, the log says {rows} with {:x}",
                got.len(),
                *digest as u64
            )));
        }
    }
    Ok(Verified {
        txns: txns as u64,
        chain: chain as u64,
    })
}

/// `PRAGMA integrity_check` on a connection.
pub fn integrity(conn: &Connection) -> String {
    conn.query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap_or_else(|e| e.to_string())
}

/// The transaction count a database shows, or 0 if it has none yet.
pub fn txns(conn: &Connection) -> u64 {
    conn.query_row("SELECT v FROM meta WHERE k = 'txn'", [], |r| {
        r.get::<_, i64>(0)
    })
    .map(|v| v as u64)
    .unwrap_or(0)
}

/// How a [`Writer`] writes.
#[derive(Clone, Debug)]
pub struct WriterConfig {
    /// Transactions per second (0 = as fast as possible).
    pub rate: u64,
    pub rows: u64,
    pub payload: u64,
    /// Percent of transactions that drop an older one.
    pub drop_percent: u64,
    /// Percent of transactions that write one big row, and its size.
    pub big_percent: u64,
    pub big_bytes: u64,
    /// Prepare the connection with ferry_ship::prepare_connection semantics (no
    /// autocheckpoint); false leaves SQLite's defaults, autocheckpoint included.
    pub prepared: bool,
    pub seed: u64,
}

impl Default for WriterConfig {
    fn default() -> Self {
        WriterConfig {
            rate: 200,
            rows: 4,
            payload: 400,
            drop_percent: 5,
            big_percent: 0,
            big_bytes: 0,
            prepared: true,
            seed: 1,
        }
    }
}

/// An app writing the workload in a thread.
pub struct Writer {
    stop: Arc<AtomicBool>,
    pub written: Arc<AtomicU64>,
    handle: Option<JoinHandle<Result<u64, String>>>,
}

impl Writer {
    pub fn start(db: &Path, config: WriterConfig) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(AtomicU64::new(0));
        let (s, w, path) = (stop.clone(), written.clone(), db.to_path_buf());
        let handle = std::thread::spawn(move || write_loop(&path, &config, &s, &w));
        Writer {
            stop,
            written,
            handle: Some(handle),
        }
    }

    /// Wait until the writer has written at least `n` transactions; false if it has not
    /// after `limit`.
    pub fn wait_written(&self, n: u64, limit: Duration) -> bool {
        crate::wait_until(limit, || self.written.load(Ordering::SeqCst) >= n)
    }

    /// Stop and return the number of the last transaction written.
    pub fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        self.handle
            .take()
            .expect("joined once")
            .join()
            .expect("the writer panicked")
            .unwrap_or_else(|e| panic!("writer: {e}"))
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Open an app connection the way the writer does.
pub fn open_app(db: &Path, prepared: bool) -> rusqlite::Result<Connection> {
    let conn = Connection::open(db)?;
    conn.busy_timeout(Duration::from_secs(10))?;
    conn.query_row("PRAGMA journal_mode=WAL", [], |_| Ok(()))?;
    if prepared {
        conn.pragma_update(None, "wal_autocheckpoint", 0)?;
        conn.set_db_config(
            rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
            true,
        )?;
    }
    init(&conn)?;
    Ok(conn)
}

fn write_loop(
    path: &Path,
    c: &WriterConfig,
    stop: &AtomicBool,
    written: &AtomicU64,
) -> Result<u64, String> {
    let conn = open_app(path, c.prepared).map_err(|e| e.to_string())?;
    let mut rng = Rng::new(c.seed);
    let start = Instant::now();
    let mut last = txns(&conn);
    let mut i = 0u64;
    while !stop.load(Ordering::SeqCst) {
        if c.rate > 0 {
            let due = start + Duration::from_secs_f64(i as f64 / c.rate as f64);
            if let Some(w) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(w);
            }
        }
        i += 1;
        let shape = if rng.chance(c.big_percent) {
            Shape::Big { bytes: c.big_bytes }
        } else if rng.chance(c.drop_percent) {
            Shape::Drop
        } else {
            Shape::Rows {
                rows: c.rows,
                payload: c.payload,
            }
        };
        match write(&conn, &mut rng, shape) {
            Ok(n) => {
                last = n;
                written.store(n, Ordering::SeqCst);
            }
            Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DatabaseBusy) => continue,
            Err(e) => return Err(format!("writing transaction {}: {e}", last + 1)),
        }
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_accepts_the_workload_and_catches_a_missing_row() {
        let conn = Connection::open_in_memory().unwrap();
        init(&conn).unwrap();
        let mut rng = Rng::new(3);
        for i in 0..200 {
            let shape = if i % 7 == 0 {
                Shape::Drop
            } else {
                Shape::Rows {
                    rows: 3,
                    payload: 200,
                }
            };
            write(&conn, &mut rng, shape).unwrap();
        }
        assert_eq!(verify(&conn).unwrap().txns, 200);
        conn.execute("DELETE FROM t WHERE id = (SELECT max(id) FROM t)", [])
            .unwrap();
        assert!(verify(&conn).is_err());
    }
}
