//! Wishes, server side (docs/sync-up.md §7): values the server wants a replica's setting
//! row to take. Each call runs on the caller's connection, so a wish commits or rolls back
//! with the caller's own transaction; the SQL functions `ferry_sync.wish` and
//! `ferry_sync.withdraw` do the same for code that is not Rust.
//!
//! A wish replaces the row's earlier one (a newer number), travels to the replica in the
//! wishes table, and is answered there: `applied`, `refused`, `superseded` or `waiting`.
//! Until the answer for its number is filed it stands `pending`.

use serde::Serialize;
use sqlx::{PgConnection, Row};
use uuid::Uuid;

/// Wishes `values` (a JSON object: desired column to value) onto replica `replica`'s row
/// `key` (a JSON array of its key values) of setting table `setting` (its name on the
/// replicas). With `if_version`, the replica carries it out only while the row's version
/// is that. Returns the wish's number. Refused (SQLSTATE 22023, nothing written) for a
/// table that is not a setting, a key of the wrong length, or a column a wish may not set.
pub async fn wish(
    conn: &mut PgConnection,
    replica: Uuid,
    setting: &str,
    key: &serde_json::Value,
    values: &serde_json::Value,
    if_version: Option<i64>,
    note: Option<&str>,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT ferry_sync.wish($1, $2, $3, $4, $5, $6)")
        .bind(replica)
        .bind(setting)
        .bind(key)
        .bind(values)
        .bind(if_version)
        .bind(note)
        .fetch_one(conn)
        .await
}

/// Withdraws the wish for a row: the replica's copy goes with the next message, and an
/// answer it sends after is dropped. `false` if there was none.
pub async fn withdraw(
    conn: &mut PgConnection,
    replica: Uuid,
    setting: &str,
    key: &serde_json::Value,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT ferry_sync.withdraw($1, $2, $3)")
        .bind(replica)
        .bind(setting)
        .bind(key)
        .fetch_one(conn)
        .await
}

/// A wish and where it stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WishState {
    pub replica: Uuid,
    pub setting: String,
    /// The row's key, as a JSON array.
    pub key: String,
    pub wish: i64,
    /// The wished values, as a JSON object.
    pub values: String,
    pub if_version: Option<i64>,
    pub note: Option<String>,
    /// `pending` (no answer for this wish filed yet), `waiting`, `applied`, `refused` or
    /// `superseded`.
    pub state: String,
    pub reason: Option<String>,
    /// When the replica answered, ms since 1970 by its clock.
    pub answered_at_ms: Option<i64>,
}

/// The wishes, of one replica or all, by replica, table and key.
pub async fn wishes(
    conn: &mut PgConnection,
    replica: Option<Uuid>,
) -> Result<Vec<WishState>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT replica, setting, key, wish, vals, if_version, note,
                CASE WHEN answered = wish THEN outcome ELSE 'pending' END,
                CASE WHEN answered = wish THEN reason END,
                CASE WHEN answered = wish THEN answered_at END
         FROM ferry_sync.wishes WHERE $1::uuid IS NULL OR replica = $1
         ORDER BY replica, setting, key",
    )
    .bind(replica)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .iter()
        .map(|r| WishState {
            replica: r.get(0),
            setting: r.get(1),
            key: r.get(2),
            wish: r.get(3),
            values: r.get(4),
            if_version: r.get(5),
            note: r.get(6),
            state: r.get(7),
            reason: r.get(8),
            answered_at_ms: r.get(9),
        })
        .collect())
}
