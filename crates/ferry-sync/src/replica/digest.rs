//! The report up: the last applied message, the gap, the rejections still standing
//! (those not yet reported first), and digests of the synced tables. The server keeps
//! only each replica's latest report, so every report says everything that still holds.
//!
//! A digest is a table's row count and the wrapping sum of its rows' hashes, each row
//! read in the column order of the last part that named the table, leaving out retired
//! rows (the server deleted them) and rejected ones (the server holds them quarantined). Digests are sent only when the replica is at the end
//! of its chain as far as it knows: no gap, no sweep under way (mid-sweep the table
//! holds rows the server already dropped).
//!
//! Reporting is two steps: [`up`] reads, the transport takes the report, then
//! [`reported`] marks its rejections. A crash between them reports them again.

use super::{ReplicaError, codec, state::State, tables};
use crate::value::{Fingerprint, Value};
use crate::wire::{
    Applied, Column, DIGESTS_MAX, Digest, REASON_BYTES_MAX, REJECTIONS_MAX, Rejection, Up,
};
use rusqlite::{Connection, ErrorCode, params};
use std::collections::HashSet;

/// Rejections one report carries: 1,000 with reasons cut to `REASON_BYTES_MAX` (1 KiB)
/// and small keys keep an `Up` near 1 MiB, a quarter of `UP_BYTES_MAX`; the rest go in
/// the next reports (the rows stay refused meanwhile).
pub const REJECTIONS_PER_UP_MAX: usize = 1000;
const _: () = assert!(REJECTIONS_PER_UP_MAX <= REJECTIONS_MAX);

pub(crate) fn up(conn: &Connection, with_digests: bool) -> Result<Up, ReplicaError> {
    let state = State::read(conn)?;
    let applied = match (state.epoch, state.body_hash, state.stamp) {
        (Some(epoch), Some(body_hash), Some(stamp)) => Some(Applied {
            epoch,
            seq: state.seq,
            nonce: state.nonce,
            body_hash,
            stamp,
        }),
        _ => None,
    };
    let digests = if with_digests && state.gap == 0 && !any_sweeping(conn)? {
        digests(conn)?
    } else {
        Vec::new()
    };
    Ok(Up {
        applied,
        gap: state.gap,
        rejections: unreported(conn)?,
        digests,
    })
}

/// Marks the report's rejections reported, each only if it is still the same refusal
/// (same seq): one refused again since must be reported again.
pub(crate) fn reported(conn: &Connection, up: &Up) -> Result<(), ReplicaError> {
    let s = |e| ReplicaError::storage("marking rejections reported", e);
    conn.execute_batch("BEGIN IMMEDIATE").map_err(s)?;
    let result = (|| {
        let mut stmt = conn.prepare_cached(
            "UPDATE _ferry_sync_rejections SET reported = 1 WHERE tbl = ?1 AND key = ?2 AND seq = ?3",
        )?;
        for r in &up.rejections {
            stmt.execute(params![r.table, codec::encode(&r.key), r.seq as i64])?;
        }
        conn.execute_batch("COMMIT")
    })();
    if result.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    result.map_err(s)
}

fn any_sweeping(conn: &Connection) -> Result<bool, ReplicaError> {
    conn.query_row(
        "SELECT EXISTS(SELECT 1 FROM _ferry_sync_sweeping)",
        [],
        |r| r.get(0),
    )
    .map_err(|e| ReplicaError::storage("reading sweep state", e))
}

fn unreported(conn: &Connection) -> Result<Vec<Rejection>, ReplicaError> {
    let s = |e| ReplicaError::storage("reading rejections", e);
    let mut stmt = conn
        .prepare_cached(
            "SELECT tbl, key, reason, seq FROM _ferry_sync_rejections \
             ORDER BY reported, seq, tbl, key LIMIT ?1",
        )
        .map_err(s)?;
    let rows = stmt
        .query_map([REJECTIONS_PER_UP_MAX as i64], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, Vec<u8>>(1)?,
                r.get::<_, Option<String>>(2)?,
                r.get::<_, i64>(3)?,
            ))
        })
        .map_err(s)?;
    let mut out = Vec::new();
    for row in rows {
        let (table, key, reason, seq) = row.map_err(s)?;
        let key = codec::decode(&key).ok_or_else(|| {
            ReplicaError::Damaged(format!(
                "a rejection's key in table {table:?} does not decode"
            ))
        })?;
        out.push(Rejection {
            table,
            key,
            reason: cut(reason.unwrap_or_default(), REASON_BYTES_MAX),
            seq: seq as u64,
        });
    }
    Ok(out)
}

/// `text` cut to at most `max` bytes, on a character boundary.
fn cut(mut text: String, max: usize) -> String {
    if text.len() > max {
        let mut end = max;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
    }
    text
}

/// Digests of the synced tables, the first `DIGESTS_MAX` in the order they came (the
/// server compares those it gets). Tables the replica writes are the replica's, not
/// the server's copy: left out. A two-way table is the server's copy in the columns the
/// server sends, which are the ones `_ferry_sync_tables` records: digested by those.
fn digests(conn: &Connection) -> Result<Vec<Digest>, ReplicaError> {
    let written: HashSet<String> = {
        let mut stmt = conn
            .prepare_cached(
                "SELECT tbl FROM _ferry_sync_writes
                 WHERE tbl NOT IN (SELECT tbl FROM _ferry_sync_two_way)",
            )
            .map_err(|e| ReplicaError::storage("reading the tables written", e))?;
        stmt.query_map([], |r| r.get(0))
            .and_then(|rows| rows.collect::<rusqlite::Result<_>>())
            .map_err(|e| ReplicaError::storage("reading the tables written", e))?
    };
    let mut out = Vec::new();
    let synced = tables::recorded(conn)?
        .into_iter()
        .filter(|(table, _)| !written.contains(table));
    for (table, columns) in synced.take(DIGESTS_MAX) {
        let (rows, fingerprint) = fingerprint(conn, &table, &columns)?;
        out.push(Digest {
            table,
            rows,
            fingerprint,
        });
    }
    Ok(out)
}

/// One table's count and fingerprint. A table or column the host dropped reads as empty,
/// so the digest disagrees with the server's and the server reprovisions (which
/// recreates what is missing).
fn fingerprint(
    conn: &Connection,
    table: &str,
    columns: &[Column],
) -> Result<(u64, u64), ReplicaError> {
    let s = |e| ReplicaError::storage("reading a table for its digest", e);
    let retired = retired_keys(conn, table)?;
    let all: Vec<&Column> = columns.iter().collect();
    let keys = tables::key_positions(columns);
    let mut stmt = match conn.prepare(&tables::select_sql(table, &all)) {
        Ok(stmt) => stmt,
        Err(e) if e.sqlite_error_code() == Some(ErrorCode::Unknown) => return Ok((0, 0)),
        Err(e) => return Err(s(e)),
    };
    let mut cursor = stmt.query([]).map_err(s)?;
    let mut print = Fingerprint::default();
    while let Some(r) = cursor.next().map_err(s)? {
        let values: Vec<Value> = (0..all.len())
            .map(|i| r.get_ref(i).map(codec::from_sql))
            .collect::<rusqlite::Result<_>>()
            .map_err(s)?;
        if !retired.is_empty() {
            let key: Vec<Value> = keys.iter().map(|&i| values[i].clone()).collect();
            if retired.contains(&codec::encode(&key)) {
                continue;
            }
        }
        print.add(&values);
    }
    Ok((print.rows, print.sum))
}

fn retired_keys(conn: &Connection, table: &str) -> Result<HashSet<Vec<u8>>, ReplicaError> {
    let s = |e| ReplicaError::storage("reading retired rows", e);
    let mut stmt = conn
        // Rejected rows are left out too: the server leaves out the rows it holds
        // quarantined for this replica, so both sides count what both agree on.
        .prepare_cached(
            "SELECT key FROM _ferry_sync_retired WHERE tbl = ?1 \
             UNION SELECT key FROM _ferry_sync_rejections WHERE tbl = ?1",
        )
        .map_err(s)?;
    let keys = stmt
        .query_map([table], |r| r.get::<_, Vec<u8>>(0))
        .map_err(s)?;
    keys.collect::<rusqlite::Result<_>>().map_err(s)
}
