//! Carrying out the server's wishes (docs/sync-up.md §7). A wish arrives as a row of
//! `ferry_wishes`, a two-way table: the server's columns say which setting row should take
//! which values; the replica's columns (`answered`, `outcome`, `reason`, `answered_at`)
//! are its answer, which goes up like any two-way edit.
//!
//! After messages commit (never inside the apply transaction), and while no snapshot is
//! being swept in, each wish not yet finally answered is offered to the host's
//! [`CarryOut`] handler, read again just before:
//!
//! 1. Read the wish and its setting row. A table this replica does not write, a column it
//!    lacks or a key that is not a JSON array: `refused`. A row that does not exist yet:
//!    `waiting`. `if_version` given and the row's version moved: `superseded`.
//! 2. Offer it to the handler (outside any transaction: it may act on the world). A
//!    handler that panics leaves the wish `waiting`.
//! 3. In one transaction, with the wish still the row's current one and the row's version
//!    still what step 1 read: on `applied`, write the wished columns and raise the
//!    version; record the answer. Either changed: nothing is written, and the next round
//!    reads it afresh.
//!
//! A crash between steps 2 and 3 offers the wish again: carrying a wish out must be
//! idempotent. `waiting` is offered again every round; the answer is rewritten only when
//! it changes, so a waiting wish does not go up each round.

use std::collections::BTreeMap;

use rusqlite::{Connection, OptionalExtension, params};

use super::{ReplicaError, codec, tables};
use crate::rules::WISHES_TABLE;
use crate::value::Value;

/// A wish as the handler sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct Wish {
    /// The setting table (its name on the replica).
    pub setting: String,
    /// The row's key values, in key order.
    pub key: Vec<Value>,
    /// The wish's number: a newer wish of the same row has another.
    pub number: i64,
    /// The desired columns and their wished values.
    pub values: BTreeMap<String, Value>,
    /// The row's version as the handler is offered it.
    pub version: i64,
    pub note: Option<String>,
}

/// A handler's answer to a wish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done: the engine writes the wished columns, raises the version and answers
    /// `applied`, in one transaction.
    Applied,
    /// Never: a final answer.
    Refused(String),
    /// Not now: offered again next round.
    Waiting(String),
}

/// What carries a wish out on the replica's side of the world (a till's price list, a
/// device's volume). It must be idempotent: a crash after it acted and before the answer
/// is recorded offers the same wish again.
pub trait CarryOut {
    fn carry_out(&mut self, wish: &Wish) -> Outcome;
}

/// Writes the columns and nothing else: for settings the app reads from its table.
pub struct Direct;

impl CarryOut for Direct {
    fn carry_out(&mut self, _wish: &Wish) -> Outcome {
        Outcome::Applied
    }
}

/// What one round did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Round {
    pub applied: usize,
    pub refused: usize,
    pub superseded: usize,
    pub waiting: usize,
}

/// One wish's row in `ferry_wishes`, as read.
struct Row {
    setting: String,
    key: String,
    number: i64,
    vals: String,
    if_version: Option<i64>,
    note: Option<String>,
    version_column: String,
    /// The wish number the recorded answer is for.
    answered: Option<i64>,
    outcome: Option<String>,
    reason: Option<String>,
}

/// Offers every wish not finally answered to `handler` (see the module doc).
pub fn carry_out(
    conn: &Connection,
    handler: &mut dyn CarryOut,
    now_ms: u64,
) -> Result<Round, ReplicaError> {
    let s = |e| ReplicaError::storage("reading wishes", e);
    let exists: bool = conn
        .query_row(
            "SELECT EXISTS(SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = ?1)",
            [WISHES_TABLE],
            |r| r.get(0),
        )
        .map_err(s)?;
    let sweeping: bool = conn
        .query_row(
            "SELECT EXISTS(SELECT 1 FROM _ferry_sync_sweeping)",
            [],
            |r| r.get(0),
        )
        .map_err(s)?;
    let mut round = Round::default();
    if !exists || sweeping {
        return Ok(round);
    }
    for row in open_wishes(conn, None)? {
        let answer = offer(conn, handler, &row, now_ms)?;
        let Some((outcome, reason)) = answer else {
            continue; // changed under us: the next round reads it afresh
        };
        match outcome {
            "applied" => round.applied += 1,
            "refused" => round.refused += 1,
            "superseded" => round.superseded += 1,
            _ => round.waiting += 1,
        }
        tracing::debug!(
            setting = row.setting,
            key = row.key,
            wish = row.number,
            outcome,
            reason,
            "a wish was answered"
        );
    }
    Ok(round)
}

/// The wishes not finally answered (unanswered, answered for an older wish, or waiting);
/// `one`: only that row (setting, key).
fn open_wishes(conn: &Connection, one: Option<(&str, &str)>) -> Result<Vec<Row>, ReplicaError> {
    let s = |e| ReplicaError::storage("reading wishes", e);
    let mut stmt = conn
        .prepare_cached(&format!(
            "SELECT setting, key, wish, vals, if_version, note, version, answered, outcome, reason
             FROM {} WHERE (answered IS NOT wish OR outcome = 'waiting')
             AND (?1 IS NULL OR (setting = ?1 AND key = ?2))
             ORDER BY setting, key",
            tables::quote(WISHES_TABLE)
        ))
        .map_err(s)?;
    let (setting, key) = one.unzip();
    stmt.query_map(params![setting, key], |r| {
        Ok(Row {
            setting: r.get(0)?,
            key: r.get(1)?,
            number: r.get(2)?,
            vals: r.get(3)?,
            if_version: r.get(4)?,
            note: r.get(5)?,
            version_column: r.get(6)?,
            answered: r.get(7)?,
            outcome: r.get(8)?,
            reason: r.get(9)?,
        })
    })
    .and_then(|rows| rows.collect())
    .map_err(s)
}

/// Steps 1 to 3 for one wish, the answer recorded; `None` when it changed between reads.
fn offer(
    conn: &Connection,
    handler: &mut dyn CarryOut,
    row: &Row,
    now_ms: u64,
) -> Result<Option<Answer>, ReplicaError> {
    let target = match resolve(conn, row)? {
        Ok(target) => target,
        Err((outcome, reason)) => {
            answer_wish(conn, row, outcome, &reason, now_ms)?;
            return Ok(Some((outcome, reason)));
        }
    };
    let wish = Wish {
        setting: row.setting.clone(),
        key: target.key.clone(),
        number: row.number,
        values: target.values.clone(),
        version: target.version,
        note: row.note.clone(),
    };
    let outcome =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.carry_out(&wish)))
            .unwrap_or_else(|_| Outcome::Waiting("the handler panicked".into()));
    let (outcome, reason) = match outcome {
        Outcome::Applied => ("applied", String::new()),
        Outcome::Refused(reason) => ("refused", reason),
        Outcome::Waiting(reason) => ("waiting", reason),
    };
    // Step 3: in one transaction, if nothing moved since step 1: the values, the raised
    // version and the answer, so a crash cannot leave the values written unanswered.
    let s = |e| ReplicaError::storage("carrying a wish out", e);
    conn.execute_batch("BEGIN IMMEDIATE").map_err(s)?;
    let result = (|| -> Result<bool, ReplicaError> {
        let still = open_wishes(conn, Some((&row.setting, &row.key)))?
            .first()
            .is_some_and(|now| now.number == row.number);
        let version = current_version(conn, row, &target)?;
        if !still || version != Some(target.version) {
            return Ok(false);
        }
        if outcome == "applied" {
            write_values(conn, row, &target)?;
        }
        answer_wish(conn, row, outcome, &reason, now_ms)?;
        Ok(true)
    })();
    let end = if matches!(result, Ok(true)) {
        "COMMIT"
    } else {
        "ROLLBACK"
    };
    conn.execute_batch(end).map_err(s)?;
    Ok(result?.then_some((outcome, reason)))
}

/// The setting row a wish names, read and checked (step 1).
struct Target {
    key_columns: Vec<String>,
    key: Vec<Value>,
    values: BTreeMap<String, Value>,
    version: i64,
}

/// An answer: the outcome and its reason (empty for none).
type Answer = (&'static str, String);

/// Step 1: `Err(answer)` answers the wish without offering it.
fn resolve(conn: &Connection, row: &Row) -> Result<Result<Target, Answer>, ReplicaError> {
    let refused = |reason: String| Ok(Err(("refused", reason)));
    let written: bool = conn
        .query_row(
            "SELECT EXISTS(SELECT 1 FROM _ferry_sync_writes WHERE tbl = ?1)
                AND NOT EXISTS(SELECT 1 FROM _ferry_sync_two_way WHERE tbl = ?1)",
            [&row.setting],
            |r| r.get(0),
        )
        .map_err(|e| ReplicaError::storage("reading the tables written", e))?;
    let columns = tables::recorded(conn)?
        .into_iter()
        .find(|(t, _)| *t == row.setting)
        .map(|(_, c)| c);
    let (true, Some(columns)) = (written, columns) else {
        return refused(format!(
            "{:?} is not a table this replica writes",
            row.setting
        ));
    };
    let key_columns: Vec<String> = tables::key_columns(&columns)
        .map(|c| c.name.clone())
        .collect();
    let key = match json_values(&row.key) {
        Some(serde_json::Value::Array(parts)) if parts.len() == key_columns.len() => {
            parts.into_iter().map(codec::from_json).collect::<Vec<_>>()
        }
        _ => {
            return refused(format!(
                "the key {} is not a JSON array of the {} key values of {:?}",
                row.key,
                key_columns.len(),
                row.setting
            ));
        }
    };
    let values: BTreeMap<String, Value> = match json_values(&row.vals) {
        Some(serde_json::Value::Object(map)) if !map.is_empty() => map
            .into_iter()
            .map(|(k, v)| (k, codec::from_json(v)))
            .collect(),
        _ => return refused(format!("the values {} are not a JSON object", row.vals)),
    };
    let names: Vec<&str> = columns.iter().map(|c| c.name.as_str()).collect();
    for c in values.keys().chain(std::iter::once(&row.version_column)) {
        if !names.contains(&c.as_str()) || key_columns.contains(c) {
            return refused(format!(
                "{:?} has no column {c:?} a wish may set",
                row.setting
            ));
        }
    }
    let mut target = Target {
        key_columns,
        key,
        values,
        version: 0,
    };
    let Some(version) = current_version(conn, row, &target)? else {
        return Ok(Err(("waiting", "the row does not exist yet".into())));
    };
    target.version = version;
    if row.if_version.is_some_and(|v| v != version) {
        return Ok(Err((
            "superseded",
            format!(
                "the row's version is {version}, not {} as the wish required",
                row.if_version.unwrap_or_default()
            ),
        )));
    }
    Ok(Ok(target))
}

/// The setting row's version, `None` if the row is gone (a NULL version reads as 0).
fn current_version(
    conn: &Connection,
    row: &Row,
    target: &Target,
) -> Result<Option<i64>, ReplicaError> {
    let sql = format!(
        "SELECT coalesce({}, 0) FROM {} WHERE {}",
        tables::quote(&row.version_column),
        tables::quote(&row.setting),
        key_match(&target.key_columns, 1)
    );
    conn.query_row(
        &sql,
        rusqlite::params_from_iter(target.key.iter().map(codec::to_sql)),
        |r| r.get(0),
    )
    .optional()
    .map_err(|e| ReplicaError::storage("reading a setting row", e))
}

/// Writes the wished values and raises the version: the row's own capture trigger notes
/// it, and it goes up as any write of the replica's.
fn write_values(conn: &Connection, row: &Row, target: &Target) -> Result<(), ReplicaError> {
    let version = tables::quote(&row.version_column);
    let sets: Vec<String> = target
        .values
        .keys()
        .enumerate()
        .map(|(i, c)| format!("{} = ?{}", tables::quote(c), i + 1))
        .collect();
    let sql = format!(
        "UPDATE {} SET {}, {version} = coalesce({version}, 0) + 1 WHERE {}",
        tables::quote(&row.setting),
        sets.join(", "),
        key_match(&target.key_columns, target.values.len() + 1)
    );
    let params = target.values.values().chain(&target.key).map(codec::to_sql);
    conn.execute(&sql, rusqlite::params_from_iter(params))
        .map_err(|e| ReplicaError::storage("writing a wish's values", e))?;
    Ok(())
}

/// Records the answer for the wish's number, unless that very answer is recorded for it
/// already (a waiting wish answered waiting again writes nothing, so it does not go up
/// each round). An answer recorded for an older wish of the row is no answer to this one.
fn answer_wish(
    conn: &Connection,
    row: &Row,
    outcome: &str,
    reason: &str,
    now_ms: u64,
) -> Result<(), ReplicaError> {
    let reason = (!reason.is_empty()).then_some(reason);
    if row.answered == Some(row.number)
        && row.outcome.as_deref() == Some(outcome)
        && row.reason.as_deref() == reason
    {
        return Ok(());
    }
    conn.execute(
        &format!(
            "UPDATE {} SET answered = wish, outcome = ?3, reason = ?4, answered_at = ?5
             WHERE setting = ?1 AND key = ?2 AND wish = ?6",
            tables::quote(WISHES_TABLE)
        ),
        params![
            row.setting,
            row.key,
            outcome,
            reason,
            now_ms as i64,
            row.number
        ],
    )
    .map_err(|e| ReplicaError::storage("answering a wish", e))?;
    Ok(())
}

fn key_match(columns: &[String], first: usize) -> String {
    tables::key_match(columns.iter().map(String::as_str), first)
}

fn json_values(text: &str) -> Option<serde_json::Value> {
    serde_json::from_str(text).ok()
}
