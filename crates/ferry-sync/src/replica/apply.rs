//! Applying one message, in ONE transaction.
//!
//! 1. `BEGIN IMMEDIATE` (waits up to the busy timeout for another writer; readers keep
//!    reading the previous state, WAL).
//! 2. A chain start forgets any sweep an earlier chain left unfinished.
//! 3. Each part's table is created or widened ([`tables::ensure`]).
//! 4. Each part with `sweep.start` begins its sweep: named keys cleared, table marked.
//! 5. Deletes of every part, parts in reverse order (children first). A delete the
//!    replica's own rows forbid (a foreign key) retires the row instead: it stays, and
//!    leaves digests.
//! 6. Upserts of every part, in order (parents first). A successful upsert clears the
//!    row's rejection and retirement.
//! 7. Sweep ends, parts in reverse order: every row no part named since the start is
//!    deleted (or retired, as in 5).
//! 8. The new chain position, then `COMMIT`.
//!
//! Steps 5 to 7 write a part's rows under one savepoint. When a row is refused (a
//! constraint, a trigger's `RAISE`, a type the column cannot take), the part goes back
//! to its savepoint and is redone row by row, each row under its own savepoint: refused
//! rows become rejections and the rest applies. A trigger's `RAISE(ROLLBACK)` ends the
//! whole transaction, savepoints and all; that row is remembered as refused and the
//! message starts again from step 1 (each restart finds one more such row, at most
//! [`ROLLBACK_ROWS_MAX`] of them before a whole part's rows of that kind are refused).
//!
//! Storage failures roll the whole transaction back and return an error: nothing of the
//! message remains, and it is not acknowledged. A crash at any point before the
//! `COMMIT` leaves the same; after it, the whole message.
//!
//! Not handled: a deferred foreign key of the replica's own that fails at `COMMIT`
//! fails the message (a permanent error until the replica's rows change).

use super::{ReplicaError, codec, state, tables};
use crate::value::{Affinity, Value};
use crate::wire::{Column, Down, TablePart};
use rusqlite::{Connection, ErrorCode, params};
use std::borrow::Cow;
use std::collections::HashMap;

/// Rows whose triggers `RAISE(ROLLBACK)` that one message finds one by one (each costs a
/// restart of the message): 64 restarts of a large message is already minutes of work.
/// Past it, the next such row's whole part (its deletes or its upserts) is refused.
pub const ROLLBACK_ROWS_MAX: usize = 64;

/// Applies `down` (which the chain rule and [`tables::check_message`] accepted) and
/// returns the rows each part took.
pub(crate) fn apply(
    conn: &Connection,
    down: &Down,
    start: bool,
    now_ms: u64,
) -> Result<Vec<(String, usize)>, ReplicaError> {
    let mut poisoned = Poisoned::default();
    loop {
        match attempt(conn, down, start, now_ms, &poisoned) {
            Ok(Attempt::Committed(taken)) => return Ok(taken),
            Ok(Attempt::RolledBack(culprit)) => poisoned.add(culprit),
            Err(e) => {
                if !conn.is_autocommit() {
                    // The error is what the caller needs; a failed rollback leaves SQLite
                    // to roll back when the connection closes.
                    let _ = conn.execute_batch("ROLLBACK");
                }
                return Err(e);
            }
        }
    }
}

/// Applies `down` inside a transaction the caller holds, under a savepoint, once: `None`
/// when a row's trigger rolled the transaction back (the caller's transaction is gone;
/// it applies its messages again one transaction each, which finds such rows). An error
/// leaves the caller's transaction for the caller to roll back.
pub(crate) fn apply_nested(
    conn: &Connection,
    down: &Down,
    start: bool,
    now_ms: u64,
) -> Result<Option<Vec<(String, usize)>>, ReplicaError> {
    match attempt_in(conn, down, start, now_ms, &Poisoned::default(), true)? {
        Attempt::Committed(taken) => Ok(Some(taken)),
        Attempt::RolledBack(_) => Ok(None),
    }
}

enum Attempt {
    Committed(Vec<(String, usize)>),
    /// A row's trigger rolled the whole transaction back; nothing remains of it.
    RolledBack(Culprit),
}

/// Steps 1 to 8, once.
fn attempt<'a>(
    conn: &Connection,
    down: &'a Down,
    start: bool,
    now_ms: u64,
    poisoned: &'a Poisoned,
) -> Result<Attempt, ReplicaError> {
    attempt_in(conn, down, start, now_ms, poisoned, false)
}

/// `nested`: under a savepoint of the caller's transaction instead of one of its own.
fn attempt_in<'a>(
    conn: &Connection,
    down: &'a Down,
    start: bool,
    now_ms: u64,
    poisoned: &'a Poisoned,
    nested: bool,
) -> Result<Attempt, ReplicaError> {
    let s = |e| ReplicaError::storage("applying a message", e);
    conn.execute_batch(if nested {
        "SAVEPOINT ferry_message"
    } else {
        "BEGIN IMMEDIATE"
    })
    .map_err(s)?;
    if start {
        conn.execute_batch("DELETE FROM _ferry_sync_sweep; DELETE FROM _ferry_sync_sweeping;")
            .map_err(s)?;
    }
    for part in &down.parts {
        match &part.writes {
            // A table the replica writes: created with the triggers that note the app's
            // writes (docs/sync-up.md §4.1); such a part carries no rows.
            Some(writes) => super::up::announce(conn, part, writes),
            None => tables::ensure(conn, part),
        }
        .map_err(|e| ReplicaError::storage("creating or widening a table", e))?;
    }
    if start {
        // A new chain: settings and answers are stated again (docs/sync-up.md §7).
        for part in &down.parts {
            if let Some(writes) = part.writes.as_ref().filter(|w| w.restate) {
                super::up::restate(conn, part, writes)
                    .map_err(|e| ReplicaError::storage("noting rows to restate", e))?;
            }
        }
    }
    for part in down.parts.iter().filter(|p| p.sweep.start) {
        conn.execute(
            "DELETE FROM _ferry_sync_sweep WHERE tbl = ?1",
            [&part.table],
        )
        .map_err(s)?;
        conn.execute(
            "INSERT OR IGNORE INTO _ferry_sync_sweeping(tbl) VALUES (?1)",
            [&part.table],
        )
        .map_err(s)?;
    }
    let mut taken = vec![0usize; down.parts.len()];
    let job = |part: &'a TablePart, op: Op| Job {
        table: &part.table,
        op,
        seq: down.head.seq,
        now_ms,
        poisoned,
    };
    for (i, part) in down.parts.iter().enumerate().rev() {
        let rows: Vec<Row> = part
            .deletes
            .iter()
            .map(|k| Row::delete(part, Cow::Borrowed(k)))
            .collect();
        let sql = tables::delete_sql(&part.table, &part.columns);
        match write_rows(conn, &job(part, Op::Delete), &sql, &rows)? {
            Flow::Done(n) => taken[i] += n,
            Flow::RolledBack(c) => return Ok(Attempt::RolledBack(c)),
        }
    }
    for (i, part) in down.parts.iter().enumerate() {
        let rows: Vec<Row> = part.upserts.iter().map(|r| Row::upsert(part, r)).collect();
        match write_rows(
            conn,
            &job(part, Op::Upsert),
            &tables::upsert_sql(part),
            &rows,
        )? {
            Flow::Done(n) => taken[i] += n,
            Flow::RolledBack(c) => return Ok(Attempt::RolledBack(c)),
        }
    }
    for (i, part) in down
        .parts
        .iter()
        .enumerate()
        .rev()
        .filter(|(_, p)| p.sweep.end)
    {
        match end_sweep(conn, &job(part, Op::Delete), part)? {
            Flow::Done(n) => taken[i] += n,
            Flow::RolledBack(c) => return Ok(Attempt::RolledBack(c)),
        }
    }
    state::record_applied(conn, down, start, now_ms).map_err(s)?;
    conn.execute_batch(if nested {
        "RELEASE ferry_message"
    } else {
        "COMMIT"
    })
    .map_err(|e| ReplicaError::storage("committing a message", e))?;
    let tables = down
        .parts
        .iter()
        .zip(taken)
        .map(|(p, n)| (p.table.clone(), n))
        .collect();
    Ok(Attempt::Committed(tables))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Op {
    Delete,
    Upsert,
}

/// What one group of rows (a part's deletes, its upserts, its sweep) shares.
struct Job<'a> {
    table: &'a str,
    op: Op,
    seq: u64,
    now_ms: u64,
    poisoned: &'a Poisoned,
}

/// One row to write: its values (the key for a delete) and its key as the engine's
/// tables hold it.
struct Row<'a> {
    values: Cow<'a, [Value]>,
    key: Vec<u8>,
}

impl<'a> Row<'a> {
    fn delete(part: &TablePart, key: Cow<'a, [Value]>) -> Row<'a> {
        let affinities: Vec<Affinity> = tables::key_columns(&part.columns)
            .map(|c| c.affinity)
            .collect();
        let stored: Vec<Value> = key
            .iter()
            .zip(&affinities)
            .map(|(v, a)| affine(v, *a))
            .collect();
        Row {
            key: codec::encode(&stored),
            values: key,
        }
    }

    fn upsert(part: &TablePart, row: &'a [Value]) -> Row<'a> {
        let stored: Vec<Value> = tables::key_positions(&part.columns)
            .into_iter()
            .map(|i| affine(&row[i], part.columns[i].affinity))
            .collect();
        Row {
            key: codec::encode(&stored),
            values: Cow::Borrowed(row),
        }
    }
}

/// A value as a column of this affinity stores it, for the cases a key can meet
/// (numbers in a numeric column, integers in a text one): so a key named in a message
/// and the same key read back from the table encode alike. Other cases stay as they are.
pub(crate) fn affine(v: &Value, affinity: Affinity) -> Value {
    match (affinity, v) {
        (Affinity::Integer, Value::Real(r)) if r.fract() == 0.0 && r.abs() < 9.0e15 => {
            Value::Int(*r as i64)
        }
        (Affinity::Integer, Value::Text(t)) => match t.trim().parse::<i64>() {
            Ok(i) => Value::Int(i),
            Err(_) => v.clone(),
        },
        (Affinity::Real, Value::Int(i)) => Value::Real(*i as f64),
        (Affinity::Text, Value::Int(i)) => Value::Text(i.to_string()),
        _ => v.clone(),
    }
}

enum Flow {
    /// Rows taken (written, or retired).
    Done(usize),
    RolledBack(Culprit),
}

/// A row whose trigger rolled the transaction back.
struct Culprit {
    table: String,
    op: Op,
    key: Vec<u8>,
    reason: String,
}

/// Rows (and, past the limit, whole groups) known to roll the transaction back.
#[derive(Default)]
struct Poisoned {
    rows: HashMap<(String, Op, Vec<u8>), String>,
    groups: HashMap<(String, Op), String>,
}

impl Poisoned {
    fn add(&mut self, c: Culprit) {
        if self.rows.len() < ROLLBACK_ROWS_MAX {
            self.rows.insert((c.table, c.op, c.key), c.reason);
        } else {
            self.groups.insert((c.table, c.op), c.reason);
        }
    }

    fn reason(&self, table: &str, op: Op, key: &[u8]) -> Option<&str> {
        self.groups
            .get(&(table.to_string(), op))
            .or_else(|| self.rows.get(&(table.to_string(), op, key.to_vec())))
            .map(String::as_str)
    }
}

/// Writes a group of rows under one savepoint; on a refusal, again row by row.
fn write_rows(conn: &Connection, job: &Job, sql: &str, rows: &[Row]) -> Result<Flow, ReplicaError> {
    if rows.is_empty() {
        return Ok(Flow::Done(0));
    }
    note_named(conn, job.table, rows)?;
    savepoint(conn, "SAVEPOINT ferry_part")?;
    let mut taken = 0;
    let mut refused = false;
    for row in rows {
        match take(conn, job, sql, row)? {
            Taken::Yes => taken += 1,
            Taken::Refused(r) if conn.is_autocommit() => {
                return Ok(Flow::RolledBack(culprit(job, row, r)));
            }
            Taken::Refused(_) => {
                refused = true;
                break;
            }
        }
    }
    if refused {
        savepoint(conn, "ROLLBACK TO ferry_part")?;
        taken = 0;
        for row in rows {
            savepoint(conn, "SAVEPOINT ferry_row")?;
            match take(conn, job, sql, row)? {
                Taken::Yes => {
                    savepoint(conn, "RELEASE ferry_row")?;
                    taken += 1;
                }
                Taken::Refused(r) if conn.is_autocommit() => {
                    return Ok(Flow::RolledBack(culprit(job, row, r)));
                }
                Taken::Refused(r) => {
                    savepoint(conn, "ROLLBACK TO ferry_row; RELEASE ferry_row")?;
                    if settle_refused(conn, job, row, r)? {
                        taken += 1;
                    }
                }
            }
        }
    }
    savepoint(conn, "RELEASE ferry_part")?;
    Ok(Flow::Done(taken))
}

fn savepoint(conn: &Connection, sql: &str) -> Result<(), ReplicaError> {
    conn.execute_batch(sql)
        .map_err(|e| ReplicaError::storage("writing a savepoint", e))
}

fn culprit(job: &Job, row: &Row, r: Refusal) -> Culprit {
    Culprit {
        table: job.table.to_string(),
        op: job.op,
        key: row.key.clone(),
        reason: r.reason,
    }
}

enum Taken {
    Yes,
    Refused(Refusal),
}

/// Why the replica refused a row: SQLite's words, and whether it was a foreign key.
struct Refusal {
    reason: String,
    foreign_key: bool,
}

/// Runs one row's statement; a success clears the row's rejection and retirement.
fn take(conn: &Connection, job: &Job, sql: &str, row: &Row) -> Result<Taken, ReplicaError> {
    if let Some(reason) = job.poisoned.reason(job.table, job.op, &row.key) {
        return Ok(Taken::Refused(Refusal {
            reason: reason.to_string(),
            foreign_key: false,
        }));
    }
    let s = |e| ReplicaError::storage("writing a synced row", e);
    let mut stmt = conn.prepare_cached(sql).map_err(s)?;
    match stmt.execute(codec::params(&row.values)) {
        Ok(_) => {
            let mut clear = conn
                .prepare_cached("DELETE FROM _ferry_sync_rejections WHERE tbl = ?1 AND key = ?2")
                .map_err(s)?;
            clear.execute(params![job.table, row.key]).map_err(s)?;
            let mut revive = conn
                .prepare_cached("DELETE FROM _ferry_sync_retired WHERE tbl = ?1 AND key = ?2")
                .map_err(s)?;
            revive.execute(params![job.table, row.key]).map_err(s)?;
            Ok(Taken::Yes)
        }
        Err(e) => refusal(&e).map(Taken::Refused).ok_or_else(|| s(e)),
    }
}

/// Errors that refuse a row rather than fail the message: constraints and triggers'
/// `RAISE` (SQLITE_CONSTRAINT), a value the column cannot take (SQLITE_MISMATCH), a row
/// too large (SQLITE_TOOBIG), and errors raised while the statement ran (SQLITE_ERROR:
/// a trigger's own statement or function failed; the statement itself prepared).
fn refusal(e: &rusqlite::Error) -> Option<Refusal> {
    const SQLITE_CONSTRAINT_FOREIGNKEY: i32 = 787;
    match e {
        rusqlite::Error::SqliteFailure(f, _)
            if matches!(
                f.code,
                ErrorCode::ConstraintViolation
                    | ErrorCode::TypeMismatch
                    | ErrorCode::TooBig
                    | ErrorCode::Unknown
            ) =>
        {
            Some(Refusal {
                reason: e.to_string(),
                foreign_key: f.extended_code == SQLITE_CONSTRAINT_FOREIGNKEY,
            })
        }
        _ => None,
    }
}

/// Records a refused row: a delete its own rows forbid is retired (counts as taken), any
/// other refusal is a rejection to report.
fn settle_refused(
    conn: &Connection,
    job: &Job,
    row: &Row,
    r: Refusal,
) -> Result<bool, ReplicaError> {
    let s = |e| ReplicaError::storage("recording a refused row", e);
    if job.op == Op::Delete && r.foreign_key {
        conn.execute(
            "INSERT INTO _ferry_sync_retired(tbl, key, at_ms) VALUES (?1, ?2, ?3) \
             ON CONFLICT(tbl, key) DO NOTHING",
            params![job.table, row.key, job.now_ms as i64],
        )
        .map_err(s)?;
        return Ok(true);
    }
    let reason = match job.op {
        Op::Delete => format!("delete refused: {}", r.reason),
        Op::Upsert => r.reason,
    };
    conn.execute(
        "INSERT INTO _ferry_sync_rejections(tbl, key, reason, seq, reported) VALUES (?1, ?2, ?3, ?4, 0) \
         ON CONFLICT(tbl, key) DO UPDATE SET reason = excluded.reason, seq = excluded.seq, reported = 0",
        params![job.table, row.key, reason, job.seq as i64],
    )
    .map_err(s)?;
    Ok(false)
}

/// While the table is sweeping, remembers the keys the rows name (refused ones too: the
/// server holds them, so the sweep must not remove them).
fn note_named(conn: &Connection, table: &str, rows: &[Row]) -> Result<(), ReplicaError> {
    let s = |e| ReplicaError::storage("recording swept keys", e);
    if !sweeping(conn, table)? {
        return Ok(());
    }
    let mut stmt = conn
        .prepare_cached("INSERT OR IGNORE INTO _ferry_sync_sweep(tbl, key) VALUES (?1, ?2)")
        .map_err(s)?;
    for row in rows {
        stmt.execute(params![table, row.key]).map_err(s)?;
    }
    Ok(())
}

fn sweeping(conn: &Connection, table: &str) -> Result<bool, ReplicaError> {
    conn.prepare_cached("SELECT EXISTS(SELECT 1 FROM _ferry_sync_sweeping WHERE tbl = ?1)")
        .and_then(|mut stmt| stmt.query_row([table], |r| r.get(0)))
        .map_err(|e| ReplicaError::storage("reading sweep state", e))
}

/// Step 7 for one part: deletes (or retires) the rows no part named since the start,
/// then forgets the sweep. A table not sweeping (no start seen in this chain) is left
/// alone: with nothing named, it would lose every row.
fn end_sweep(conn: &Connection, job: &Job, part: &TablePart) -> Result<Flow, ReplicaError> {
    let s = |e| ReplicaError::storage("ending a sweep", e);
    if !sweeping(conn, job.table)? {
        tracing::warn!(
            table = job.table,
            "a sweep ended that never started in this chain; nothing swept"
        );
        return Ok(Flow::Done(0));
    }
    let keys: Vec<&Column> = tables::key_columns(&part.columns).collect();
    let mut unnamed: Vec<Vec<Value>> = Vec::new();
    {
        let mut rows = conn
            .prepare(&tables::select_sql(job.table, &keys))
            .map_err(s)?;
        let mut named = conn
            .prepare_cached(
                "SELECT EXISTS(SELECT 1 FROM _ferry_sync_sweep WHERE tbl = ?1 AND key = ?2)",
            )
            .map_err(s)?;
        let mut cursor = rows.query([]).map_err(s)?;
        while let Some(r) = cursor.next().map_err(s)? {
            let key: Vec<Value> = (0..keys.len())
                .map(|i| r.get_ref(i).map(codec::from_sql))
                .collect::<rusqlite::Result<_>>()
                .map_err(s)?;
            let known: bool = named
                .query_row(params![job.table, codec::encode(&key)], |r| r.get(0))
                .map_err(s)?;
            if !known {
                unnamed.push(key);
            }
        }
    }
    let rows: Vec<Row> = unnamed
        .into_iter()
        .map(|k| Row::delete(part, Cow::Owned(k)))
        .collect();
    let flow = write_rows(
        conn,
        job,
        &tables::delete_sql(job.table, &part.columns),
        &rows,
    )?;
    if matches!(flow, Flow::Done(_)) {
        conn.execute("DELETE FROM _ferry_sync_sweep WHERE tbl = ?1", [job.table])
            .map_err(s)?;
        conn.execute(
            "DELETE FROM _ferry_sync_sweeping WHERE tbl = ?1",
            [job.table],
        )
        .map_err(s)?;
    }
    Ok(flow)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_take_the_column_affinity_they_are_stored_with() {
        assert_eq!(affine(&Value::Real(3.0), Affinity::Integer), Value::Int(3));
        assert_eq!(
            affine(&Value::Text("12".into()), Affinity::Integer),
            Value::Int(12)
        );
        assert_eq!(
            affine(&Value::Text("x".into()), Affinity::Integer),
            Value::Text("x".into())
        );
        assert_eq!(affine(&Value::Int(2), Affinity::Real), Value::Real(2.0));
        assert_eq!(
            affine(&Value::Int(7), Affinity::Text),
            Value::Text("7".into())
        );
        assert_eq!(affine(&Value::Int(7), Affinity::Blob), Value::Int(7));
    }
}
