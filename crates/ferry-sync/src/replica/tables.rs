//! The synced tables: checking a message against them, creating and widening them, and
//! the statements that write them.
//!
//! A replica needs no code for its tables: every part carries its columns, so the first
//! part creates the table (affinities, NOT NULL, the primary key) and a later part with
//! a new column adds it (nullable, since existing rows have no value for it). Columns the
//! replica added itself are never written. `_ferry_sync_tables` records the columns of
//! the last part, in its order: the order digests read rows in.

use super::ReplicaError;
use crate::value::Affinity;
use crate::wire::{Column, Down, TablePart};
use rusqlite::{Connection, params};
use std::collections::HashSet;

/// Checks what the wire decoder cannot know: that each part is well formed and fits the
/// table the replica already has. `Ok(Err(reason))` refuses the message; nothing is
/// written either way.
pub(crate) fn check_message(
    conn: &Connection,
    down: &Down,
) -> Result<Result<(), String>, ReplicaError> {
    for part in &down.parts {
        if let Err(reason) = check_part(part) {
            return Ok(Err(format!("table {:?}: {reason}", part.table)));
        }
        let existing = primary_key(conn, &part.table)?;
        if let Some(existing) = existing {
            let wanted: Vec<String> = key_columns(&part.columns)
                .map(|c| c.name.to_lowercase())
                .collect();
            let have: Vec<String> = existing.iter().map(|c| c.to_lowercase()).collect();
            if have != wanted {
                return Ok(Err(format!(
                    "table {:?} is keyed by ({}) on the replica but by ({}) in the message; \
                     drop the replica's table or change the rules so they agree",
                    part.table,
                    have.join(", "),
                    wanted.join(", ")
                )));
            }
        }
    }
    Ok(Ok(()))
}

/// The part's own consistency: names, key parts, row widths.
fn check_part(part: &TablePart) -> Result<(), String> {
    check_name(&part.table)?;
    if part.columns.is_empty() {
        return Err("no columns".into());
    }
    let mut seen = HashSet::new();
    for c in &part.columns {
        if c.name.is_empty() || c.name.contains('\0') {
            return Err(format!("column name {:?} is not usable", c.name));
        }
        if !seen.insert(c.name.to_lowercase()) {
            return Err(format!("column {:?} appears twice", c.name));
        }
    }
    let mut parts: Vec<u8> = part
        .columns
        .iter()
        .map(|c| c.key_part)
        .filter(|&p| p > 0)
        .collect();
    parts.sort_unstable();
    if parts.is_empty()
        || parts
            .iter()
            .enumerate()
            .any(|(i, &p)| usize::from(p) != i + 1)
    {
        return Err(format!("key parts {parts:?} are not 1, 2, … without gaps"));
    }
    if let Some(row) = part.upserts.iter().find(|r| r.len() != part.columns.len()) {
        return Err(format!(
            "an upsert has {} values for {} columns",
            row.len(),
            part.columns.len()
        ));
    }
    if let Some(key) = part.deletes.iter().find(|k| k.len() != parts.len()) {
        return Err(format!(
            "a delete has {} values for a key of {}",
            key.len(),
            parts.len()
        ));
    }
    Ok(())
}

/// Names the engine keeps for itself and SQLite's own are refused.
fn check_name(name: &str) -> Result<(), String> {
    let lower = name.to_lowercase();
    let reserved = crate::wire::RESERVED_TABLE_PREFIXES
        .iter()
        .any(|p| lower.starts_with(p));
    if name.is_empty() || name.contains('\0') || reserved {
        return Err("the name is reserved or not usable".into());
    }
    Ok(())
}

/// The primary key columns of an existing table, in key order; `None` if no such table.
fn primary_key(conn: &Connection, table: &str) -> Result<Option<Vec<String>>, ReplicaError> {
    let mut stmt = conn
        .prepare_cached("SELECT name, pk FROM pragma_table_info(?1)")
        .map_err(|e| ReplicaError::storage("reading a table's columns", e))?;
    let mut cols: Vec<(i64, String)> = Vec::new();
    let mut any = false;
    let rows = stmt
        .query_map([table], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?))
        })
        .map_err(|e| ReplicaError::storage("reading a table's columns", e))?;
    for row in rows {
        let (name, pk) = row.map_err(|e| ReplicaError::storage("reading a table's columns", e))?;
        any = true;
        if pk > 0 {
            cols.push((pk, name));
        }
    }
    cols.sort();
    Ok(any.then(|| cols.into_iter().map(|(_, n)| n).collect()))
}

/// The key columns of a part, in key order.
pub(crate) fn key_columns(columns: &[Column]) -> impl Iterator<Item = &Column> {
    let mut keys: Vec<&Column> = columns.iter().filter(|c| c.key_part > 0).collect();
    keys.sort_by_key(|c| c.key_part);
    keys.into_iter()
}

/// Positions of the key columns in `columns`, in key order.
pub(crate) fn key_positions(columns: &[Column]) -> Vec<usize> {
    let mut keys: Vec<(u8, usize)> = columns
        .iter()
        .enumerate()
        .filter(|(_, c)| c.key_part > 0)
        .map(|(i, c)| (c.key_part, i))
        .collect();
    keys.sort_unstable();
    keys.into_iter().map(|(_, i)| i).collect()
}

/// Creates the table, adds the columns it lacks, records the part's columns. Inside the
/// apply transaction: a crash leaves the table as it was.
pub(crate) fn ensure(conn: &Connection, part: &TablePart) -> rusqlite::Result<()> {
    shed(conn, part)?;
    ensure_with(conn, part, part.columns.len())
}

/// [`ensure`] for a part whose first `recorded` columns are the ones to record (a two-way
/// table's announcement: the server's columns, then the replica's).
pub(crate) fn ensure_with(
    conn: &Connection,
    part: &TablePart,
    recorded: usize,
) -> rusqlite::Result<()> {
    let defs: Vec<String> = part
        .columns
        .iter()
        .map(|c| {
            let null = if c.not_null { " NOT NULL" } else { "" };
            format!("{} {}{null}", quote(&c.name), c.affinity.sql())
        })
        .collect();
    let keys: Vec<String> = key_columns(&part.columns).map(|c| quote(&c.name)).collect();
    conn.execute_batch(&format!(
        "CREATE TABLE IF NOT EXISTS {} ({}, PRIMARY KEY({}))",
        quote(&part.table),
        defs.join(", "),
        keys.join(", ")
    ))?;
    let have: HashSet<String> = {
        let mut stmt = conn.prepare_cached("SELECT name FROM pragma_table_info(?1)")?;
        let names = stmt.query_map([&part.table], |r| r.get::<_, String>(0))?;
        names
            .map(|n| n.map(|n| n.to_lowercase()))
            .collect::<rusqlite::Result<_>>()?
    };
    for c in part
        .columns
        .iter()
        .filter(|c| !have.contains(&c.name.to_lowercase()))
    {
        conn.execute_batch(&format!(
            "ALTER TABLE {} ADD COLUMN {} {}",
            quote(&part.table),
            quote(&c.name),
            c.affinity.sql()
        ))?;
    }
    conn.execute(
        "INSERT INTO _ferry_sync_tables(name, columns, ord) VALUES (?1, ?2, \
         (SELECT COALESCE(MAX(ord), 0) + 1 FROM _ferry_sync_tables)) \
         ON CONFLICT(name) DO UPDATE SET columns = excluded.columns",
        params![part.table, columns_json(&part.columns[..recorded])],
    )?;
    Ok(())
}

/// Drops the server's columns a table the server sends had in its last part and `part`
/// lacks: the rules stopped sending them (a column left out, or the replica moved to an
/// audience that holds the table in another shape, docs/sync-scale.md §1), and the values
/// they hold are the server's from before, which nothing would ever correct. A column
/// SQLite will not drop (an index or a view of the app's names it) is emptied instead,
/// and one that cannot be emptied either (NOT NULL) is left as it is. Columns the replica
/// added itself were never recorded and stay; tables the replica writes are announced,
/// never sent, so their columns are never shed.
fn shed(conn: &Connection, part: &TablePart) -> rusqlite::Result<()> {
    let recorded: Option<String> = conn
        .query_row(
            "SELECT columns FROM _ferry_sync_tables WHERE name = ?1",
            [&part.table],
            |r| r.get(0),
        )
        .map(Some)
        .or_else(|e| match e {
            rusqlite::Error::QueryReturnedNoRows => Ok(None),
            e => Err(e),
        })?;
    let Some(recorded) = recorded.as_deref().and_then(parse_columns) else {
        return Ok(());
    };
    let now: HashSet<String> = part.columns.iter().map(|c| c.name.to_lowercase()).collect();
    for c in recorded
        .iter()
        .filter(|c| c.key_part == 0 && !now.contains(&c.name.to_lowercase()))
    {
        let drop = format!(
            "ALTER TABLE {} DROP COLUMN {}",
            quote(&part.table),
            quote(&c.name)
        );
        if conn.execute_batch(&drop).is_ok() {
            continue;
        }
        let empty = format!(
            "UPDATE {} SET {} = NULL",
            quote(&part.table),
            quote(&c.name)
        );
        if let Err(e) = conn.execute_batch(&empty) {
            tracing::warn!(table = %part.table, column = %c.name, error = %e,
                "replica: a column the server no longer sends can be neither dropped nor emptied; its old values stay (drop the app's index or view that holds it)");
        }
    }
    Ok(())
}

/// The statement that inserts or overwrites one row of `part`: parameters are the row's
/// values in column order.
pub(crate) fn upsert_sql(part: &TablePart) -> String {
    let names: Vec<String> = part.columns.iter().map(|c| quote(&c.name)).collect();
    let marks: Vec<String> = (1..=names.len()).map(|i| format!("?{i}")).collect();
    let keys: Vec<String> = key_columns(&part.columns).map(|c| quote(&c.name)).collect();
    let sets: Vec<String> = part
        .columns
        .iter()
        .filter(|c| c.key_part == 0)
        .map(|c| format!("{0} = excluded.{0}", quote(&c.name)))
        .collect();
    let action = if sets.is_empty() {
        "NOTHING".to_string()
    } else {
        format!("UPDATE SET {}", sets.join(", "))
    };
    format!(
        "INSERT INTO {}({}) VALUES ({}) ON CONFLICT({}) DO {action}",
        quote(&part.table),
        names.join(", "),
        marks.join(", "),
        keys.join(", ")
    )
}

/// The statement that deletes one row by key: parameters are the key's values.
pub(crate) fn delete_sql(table: &str, columns: &[Column]) -> String {
    let names = key_columns(columns).map(|c| c.name.as_str());
    format!("DELETE FROM {} WHERE {}", quote(table), key_match(names, 1))
}

/// `"k1" IS ?n AND "k2" IS ?n+1`, parameters from `first`: `IS`, so a NULL key part
/// (SQLite allows one outside INTEGER keys) still matches its row.
pub(crate) fn key_match<'a>(names: impl Iterator<Item = &'a str>, first: usize) -> String {
    let parts: Vec<String> = names
        .enumerate()
        .map(|(i, c)| format!("{} IS ?{}", quote(c), first + i))
        .collect();
    parts.join(" AND ")
}

/// `SELECT` of the given columns of a table, in order.
pub(crate) fn select_sql(table: &str, columns: &[&Column]) -> String {
    let names: Vec<String> = columns.iter().map(|c| quote(&c.name)).collect();
    format!("SELECT {} FROM {}", names.join(", "), quote(table))
}

/// An identifier quoted for SQLite: a name from the server can be any text.
pub(crate) fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ColumnJson {
    name: String,
    affinity: u8,
    not_null: bool,
    key_part: u8,
}

pub(crate) fn columns_json(columns: &[Column]) -> String {
    let list: Vec<ColumnJson> = columns
        .iter()
        .map(|c| ColumnJson {
            name: c.name.clone(),
            affinity: c.affinity as u8,
            not_null: c.not_null,
            key_part: c.key_part,
        })
        .collect();
    serde_json::to_string(&list).expect("a list of plain structs always serialises")
}

/// The synced tables and their recorded columns, in the order they first came.
pub(crate) fn recorded(conn: &Connection) -> Result<Vec<(String, Vec<Column>)>, ReplicaError> {
    let e = |e| ReplicaError::storage("reading the synced tables", e);
    let mut stmt = conn
        .prepare_cached("SELECT name, columns FROM _ferry_sync_tables ORDER BY ord")
        .map_err(e)?;
    let rows = stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
        .map_err(e)?;
    let mut out = Vec::new();
    for row in rows {
        let (name, json) = row.map_err(e)?;
        let columns = parse_columns(&json).ok_or_else(|| {
            ReplicaError::Damaged(format!(
                "_ferry_sync_tables.columns of {name:?} does not parse"
            ))
        })?;
        out.push((name, columns));
    }
    Ok(out)
}

/// Columns as [`columns_json`] wrote them; `None` if they do not parse.
pub(crate) fn parse_columns(json: &str) -> Option<Vec<Column>> {
    let list: Vec<ColumnJson> = serde_json::from_str(json).ok()?;
    list.into_iter()
        .map(|c| {
            Some(Column {
                name: c.name,
                affinity: Affinity::from_u8(c.affinity)?,
                not_null: c.not_null,
                key_part: c.key_part,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Sweep;

    fn col(name: &str, key_part: u8) -> Column {
        Column {
            name: name.into(),
            affinity: Affinity::Integer,
            not_null: false,
            key_part,
        }
    }

    fn part(table: &str, columns: Vec<Column>) -> TablePart {
        TablePart {
            table: table.into(),
            columns,
            sweep: Sweep::default(),
            deletes: vec![],
            upserts: vec![],
            writes: None,
        }
    }

    #[test]
    fn malformed_parts_are_refused_with_a_reason() {
        assert!(check_part(&part("t", vec![col("a", 1), col("b", 0)])).is_ok());
        assert!(check_part(&part("sqlite_x", vec![col("a", 1)])).is_err());
        assert!(check_part(&part("_ferry_sync_state", vec![col("a", 1)])).is_err());
        assert!(check_part(&part("t", vec![col("a", 0)])).is_err());
        assert!(check_part(&part("t", vec![col("a", 2)])).is_err());
        assert!(check_part(&part("t", vec![col("a", 1), col("A", 0)])).is_err());
        let mut p = part("t", vec![col("a", 1), col("b", 0)]);
        p.deletes.push(vec![]);
        assert!(check_part(&p).is_err());
    }

    #[test]
    fn statements_quote_names_and_key_by_the_key_parts() {
        let p = part("we\"ird", vec![col("v", 0), col("k2", 2), col("k1", 1)]);
        assert_eq!(
            upsert_sql(&p),
            "INSERT INTO \"we\"\"ird\"(\"v\", \"k2\", \"k1\") VALUES (?1, ?2, ?3) \
             ON CONFLICT(\"k1\", \"k2\") DO UPDATE SET \"v\" = excluded.\"v\""
        );
        assert_eq!(
            delete_sql("t", &p.columns),
            "DELETE FROM \"t\" WHERE \"k1\" IS ?1 AND \"k2\" IS ?2"
        );
        assert_eq!(key_positions(&p.columns), vec![2, 1]);
    }
}
