//! The engine's tables in the replica's file, the chain position, and the chain rule.
//!
//! `install` creates, in one transaction:
//! - `_ferry_sync_state`: one row; the schema version, the last applied message (epoch,
//!   seq, nonce, body hash, stamp), the gap, when it applied and when it heard last;
//! - `_ferry_sync_tables`: the synced tables, each with the columns of the last part that
//!   named it (JSON), in the order they first came;
//! - `_ferry_sync_sweep` / `_ferry_sync_sweeping`: the keys a sweep has named so far, and
//!   the tables being swept;
//! - `_ferry_sync_rejections`: rows the replica refused, until reported and cleared;
//! - `_ferry_sync_retired`: rows the server deleted that the replica's own rows still
//!   reference; kept, and left out of digests.
//!
//! A crash during `install` leaves no engine table (one transaction), so the next open
//! installs again.

use super::ReplicaError;
use crate::wire::ChainHead;
use rusqlite::{Connection, OptionalExtension, params};

/// The version of the engine's tables this build writes. A later one is refused
/// (`ReplicaError::LaterSchema`): a newer ferry may keep state this one would lose.
pub const SCHEMA_VERSION: i64 = 1;

const TABLES_V1: &str = "
CREATE TABLE IF NOT EXISTS _ferry_sync_state(
    one INTEGER PRIMARY KEY CHECK(one = 1),
    version INTEGER NOT NULL,
    epoch BLOB,
    seq INTEGER NOT NULL DEFAULT 0,
    nonce INTEGER NOT NULL DEFAULT 0,
    body_hash BLOB,
    stamp BLOB,
    gap INTEGER NOT NULL DEFAULT 0,
    applied_at_ms INTEGER,
    heard_at_ms INTEGER);
CREATE TABLE IF NOT EXISTS _ferry_sync_tables(
    name TEXT PRIMARY KEY,
    columns TEXT NOT NULL,
    ord INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS _ferry_sync_sweep(
    tbl TEXT,
    key BLOB,
    PRIMARY KEY(tbl, key)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS _ferry_sync_sweeping(tbl TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS _ferry_sync_rejections(
    tbl TEXT,
    key BLOB,
    reason TEXT,
    seq INTEGER,
    reported INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY(tbl, key));
CREATE TABLE IF NOT EXISTS _ferry_sync_retired(
    tbl TEXT,
    key BLOB,
    at_ms INTEGER,
    PRIMARY KEY(tbl, key));
INSERT OR IGNORE INTO _ferry_sync_state(one, version) VALUES (1, 1);
";

/// Creates the engine's tables if they are missing; refuses a file a later build wrote.
pub fn install(conn: &Connection) -> Result<(), ReplicaError> {
    let e = |e| ReplicaError::storage("installing the engine's tables", e);
    conn.execute_batch("BEGIN IMMEDIATE").map_err(e)?;
    let result = install_in_tx(conn);
    let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
    let ended = conn.execute_batch(end).map_err(e);
    result.and(ended)
}

fn install_in_tx(conn: &Connection) -> Result<(), ReplicaError> {
    let e = |e| ReplicaError::storage("installing the engine's tables", e);
    let exists: bool = conn
        .query_row(
            "SELECT EXISTS(SELECT 1 FROM sqlite_schema WHERE name = '_ferry_sync_state')",
            [],
            |r| r.get(0),
        )
        .map_err(e)?;
    if exists {
        let found: Option<i64> = conn
            .query_row(
                "SELECT version FROM _ferry_sync_state WHERE one = 1",
                [],
                |r| r.get(0),
            )
            .optional()
            .map_err(e)?;
        if let Some(found) = found
            && found > SCHEMA_VERSION
        {
            return Err(ReplicaError::LaterSchema {
                found,
                known: SCHEMA_VERSION,
            });
        }
    }
    conn.execute_batch(TABLES_V1).map_err(e)?;
    conn.execute_batch(super::up::TABLES).map_err(e)
}

/// The replica's place in its chain, as `_ferry_sync_state` holds it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct State {
    /// `None` until a message applied.
    pub epoch: Option<[u8; 16]>,
    /// Seqs and nonces are u64 on the wire and stored as their i64 bit pattern (SQLite
    /// has no u64); they are only compared here, in Rust.
    pub seq: u64,
    pub nonce: u64,
    pub body_hash: Option<[u8; 32]>,
    pub stamp: Option<[u8; 16]>,
    /// The seq of the first message that did not follow; 0 when none.
    pub gap: u64,
    pub applied_at_ms: Option<u64>,
    pub heard_at_ms: Option<u64>,
}

impl State {
    pub fn read(conn: &Connection) -> Result<State, ReplicaError> {
        let row = conn
            .query_row(
                "SELECT epoch, seq, nonce, body_hash, stamp, gap, applied_at_ms, heard_at_ms \
                 FROM _ferry_sync_state WHERE one = 1",
                [],
                |r| {
                    Ok((
                        r.get::<_, Option<Vec<u8>>>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get::<_, i64>(2)?,
                        r.get::<_, Option<Vec<u8>>>(3)?,
                        r.get::<_, Option<Vec<u8>>>(4)?,
                        r.get::<_, i64>(5)?,
                        r.get::<_, Option<i64>>(6)?,
                        r.get::<_, Option<i64>>(7)?,
                    ))
                },
            )
            .map_err(|e| ReplicaError::storage("reading the chain position", e))?;
        let (epoch, seq, nonce, body_hash, stamp, gap, applied, heard) = row;
        Ok(State {
            epoch: fixed(epoch, "epoch")?,
            seq: seq as u64,
            nonce: nonce as u64,
            body_hash: fixed(body_hash, "body_hash")?,
            stamp: fixed(stamp, "stamp")?,
            gap: gap as u64,
            applied_at_ms: applied.map(|v| v as u64),
            heard_at_ms: heard.map(|v| v as u64),
        })
    }
}

fn fixed<const N: usize>(
    bytes: Option<Vec<u8>>,
    what: &str,
) -> Result<Option<[u8; N]>, ReplicaError> {
    bytes
        .map(|b| {
            <[u8; N]>::try_from(b.as_slice()).map_err(|_| {
                ReplicaError::Damaged(format!(
                    "_ferry_sync_state.{what} holds {} bytes, not {N}",
                    b.len()
                ))
            })
        })
        .transpose()
}

/// What to do with a message, by the chain rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Apply; `start`: it starts a chain (resets the position and the gap).
    Apply {
        start: bool,
    },
    AlreadyApplied,
    Gap,
}

/// The chain rule, with (E, S, N) the last applied epoch, seq and nonce:
/// 1. same epoch and `seq <= S`: already applied (a redelivery, or an older message; a
///    different nonce at S is a renumbering, and still not applied: the server learns
///    from the stamp in the next report). This comes first, even for a chain start: an
///    old snapshot delivered again must not roll the replica back.
/// 2. `prev == 0`: a chain start, always applicable.
/// 3. same epoch, `prev == S` and `prev_nonce == N`: it follows; apply (and forget any
///    gap recorded: the chain continues from where the replica stands, docs/sync-protocol.md §1.2).
/// 4. anything else is a gap: nothing applies, and the next report says so; the server
///    resends from the replica's position, or starts a new chain.
pub(crate) fn follow(state: &State, head: &ChainHead) -> Step {
    let same_epoch = state.epoch == Some(head.epoch);
    if same_epoch && head.seq <= state.seq {
        Step::AlreadyApplied
    } else if head.prev == 0 {
        Step::Apply { start: true }
    } else if same_epoch && head.prev == state.seq && head.prev_nonce == state.nonce {
        Step::Apply { start: false }
    } else {
        Step::Gap
    }
}

/// Records a gap at `seq` unless one is recorded already (the first gap is the one the
/// server needs to hear about). One small transaction of its own.
pub(crate) fn record_gap(conn: &Connection, seq: u64) -> Result<(), ReplicaError> {
    conn.execute(
        "UPDATE _ferry_sync_state SET gap = ?1 WHERE one = 1 AND gap = 0",
        params![seq.max(1) as i64],
    )
    .map_err(|e| ReplicaError::storage("recording a gap", e))?;
    Ok(())
}

pub(crate) fn record_heard(conn: &Connection, at_ms: u64) -> Result<(), ReplicaError> {
    conn.prepare_cached("UPDATE _ferry_sync_state SET heard_at_ms = ?1 WHERE one = 1")
        .and_then(|mut stmt| stmt.execute(params![at_ms as i64]))
        .map_err(|e| ReplicaError::storage("recording when the server was heard", e))?;
    Ok(())
}

/// The new position after applying `head` (inside the apply transaction).
pub(crate) fn record_applied(
    conn: &Connection,
    down: &crate::wire::Down,
    _start: bool,
    now_ms: u64,
) -> rusqlite::Result<()> {
    // Any applied message forgets a recorded gap: it followed the chain (or started one).
    let h = &down.head;
    conn.prepare_cached(
        "UPDATE _ferry_sync_state SET epoch = ?1, seq = ?2, nonce = ?3, body_hash = ?4, \
         stamp = ?5, gap = 0, applied_at_ms = ?6 WHERE one = 1",
    )?
    .execute(params![
        &h.epoch[..],
        h.seq as i64,
        h.nonce as i64,
        &down.body_hash[..],
        &down.stamp[..],
        now_ms as i64
    ])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(epoch: u8, seq: u64, nonce: u64, prev: u64, prev_nonce: u64) -> ChainHead {
        ChainHead {
            replica: [0; 16],
            epoch: [epoch; 16],
            seq,
            nonce,
            prev,
            prev_nonce,
        }
    }

    fn at(epoch: u8, seq: u64, nonce: u64, gap: u64) -> State {
        State {
            epoch: Some([epoch; 16]),
            seq,
            nonce,
            gap,
            ..State::default()
        }
    }

    #[test]
    fn the_chain_rule_in_each_case() {
        let fresh = State::default();
        assert_eq!(
            follow(&fresh, &head(1, 1, 11, 0, 0)),
            Step::Apply { start: true }
        );
        assert_eq!(follow(&fresh, &head(1, 2, 12, 1, 11)), Step::Gap);
        let s = at(1, 5, 55, 0);
        assert_eq!(
            follow(&s, &head(1, 6, 66, 5, 55)),
            Step::Apply { start: false }
        );
        assert_eq!(follow(&s, &head(1, 5, 55, 4, 44)), Step::AlreadyApplied);
        assert_eq!(follow(&s, &head(1, 5, 99, 4, 44)), Step::AlreadyApplied);
        assert_eq!(follow(&s, &head(1, 3, 33, 0, 0)), Step::AlreadyApplied);
        assert_eq!(follow(&s, &head(1, 7, 77, 6, 66)), Step::Gap);
        assert_eq!(follow(&s, &head(1, 6, 66, 5, 54)), Step::Gap);
        assert_eq!(follow(&s, &head(2, 6, 66, 5, 55)), Step::Gap);
        assert_eq!(
            follow(&s, &head(2, 1, 1, 0, 0)),
            Step::Apply { start: true }
        );
        let gapped = at(1, 5, 55, 7);
        assert_eq!(
            follow(&gapped, &head(1, 6, 66, 5, 55)),
            Step::Apply { start: false },
            "the message that follows still applies after a gap"
        );
        assert_eq!(
            follow(&gapped, &head(1, 4, 44, 3, 33)),
            Step::AlreadyApplied
        );
        assert_eq!(
            follow(&gapped, &head(1, 8, 88, 0, 0)),
            Step::Apply { start: true }
        );
    }
}
