//! Where every replica stands, read in one REPEATABLE READ snapshot
//! (`ferry sync status`, `GET /status`). docs/sync.md §12.
//!
//! A replica is:
//! - `synced`: it confirmed everything recorded for it;
//! - `catching_up`: messages wait for it and it was heard from within `HEARD_RECENTLY`;
//! - `unreachable`: messages wait, and it was heard from, but not recently;
//! - `silent`: it was never heard from;
//! - `unenrolled`: live in the rules but without a token (`ferry sync enroll`);
//! - `retired`: no longer live.

use std::time::Duration;

use serde::Serialize;
use sqlx::{PgPool, Row};

/// Heard from within this long: a replica with messages waiting is catching up, not
/// unreachable. Three report intervals of the replica's keepalive (30 s) would be 90 s;
/// 60 s says "away" sooner for a shop's dashboard.
pub const HEARD_RECENTLY: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, Serialize)]
pub struct Status {
    pub epoch: String,
    /// New epochs taken because the server was restored from an older copy (an alarm).
    pub restores: i32,
    pub notes_pending: i64,
    pub notes_parked: i64,
    pub oldest_pending_ms: Option<i64>,
    pub replicas: Vec<ReplicaStanding>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ReplicaStanding {
    pub id: String,
    pub partition: Option<String>,
    pub standing: &'static str,
    pub last_seq: i64,
    pub confirmed_seq: i64,
    pub outbox_messages: i64,
    pub outbox_bytes: i64,
    pub oldest_unconfirmed_ms: Option<i64>,
    pub heard_ago_ms: Option<i64>,
    pub held_rows: i64,
    pub quarantined: i64,
    /// Outboxes dropped past their bound (an alarm).
    pub dropped: i32,
}

/// Reads the status, for every replica or one partition's.
pub async fn read(pool: &PgPool, partition: Option<&str>) -> Result<Status, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .execute(&mut *tx)
        .await?;
    let meta = sqlx::query("SELECT epoch::text, restores FROM ferry_sync.meta")
        .fetch_one(&mut *tx)
        .await?;
    let notes = sqlx::query(
        "SELECT count(*) FILTER (WHERE parked_at IS NULL), count(*) FILTER (WHERE parked_at IS NOT NULL),
         (extract(epoch FROM now() - min(noted_at) FILTER (WHERE parked_at IS NULL)) * 1000)::int8
         FROM ferry_sync.notes",
    )
    .fetch_one(&mut *tx)
    .await?;
    let rows = sqlx::query(
        "SELECT c.id::text, c.partition, c.standing, c.seal_key IS NOT NULL, c.last_seq, c.confirmed_seq, c.dropped,
           (SELECT count(*) FROM ferry_sync.outbox o WHERE o.replica = c.id),
           (SELECT coalesce(sum(bytes), 0)::int8 FROM ferry_sync.outbox o WHERE o.replica = c.id),
           (SELECT (extract(epoch FROM now() - min(recorded_at)) * 1000)::int8 FROM ferry_sync.outbox o WHERE o.replica = c.id),
           (SELECT (extract(epoch FROM now() - received_at) * 1000)::int8 FROM ferry_sync.reports r WHERE r.replica = c.id),
           (SELECT count(*) FROM ferry_sync.held h WHERE h.replica = c.id),
           (SELECT count(*) FROM ferry_sync.quarantine q WHERE q.replica = c.id)
         FROM ferry_sync.replicas c WHERE $1::text IS NULL OR c.partition = $1 ORDER BY c.id",
    )
    .bind(partition)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    let replicas = rows
        .iter()
        .map(|r| {
            let standing: String = r.get(2);
            let enrolled: bool = r.get(3);
            let outbox: i64 = r.get(7);
            let heard: Option<i64> = r.get(10);
            ReplicaStanding {
                id: r.get(0),
                partition: r.get(1),
                standing: judge(&standing, enrolled, outbox, heard),
                last_seq: r.get(4),
                confirmed_seq: r.get(5),
                dropped: r.get(6),
                outbox_messages: outbox,
                outbox_bytes: r.get(8),
                oldest_unconfirmed_ms: r.get(9),
                heard_ago_ms: heard,
                held_rows: r.get(11),
                quarantined: r.get(12),
            }
        })
        .collect();
    Ok(Status {
        epoch: meta.get(0),
        restores: meta.get(1),
        notes_pending: notes.get(0),
        notes_parked: notes.get(1),
        oldest_pending_ms: notes.get(2),
        replicas,
    })
}

fn judge(standing: &str, enrolled: bool, outbox: i64, heard_ago_ms: Option<i64>) -> &'static str {
    if standing == "retired" {
        return "retired";
    }
    if !enrolled {
        return "unenrolled";
    }
    match heard_ago_ms {
        None => "silent",
        Some(_) if outbox == 0 && standing == "following" => "synced",
        Some(ms) if ms <= HEARD_RECENTLY.as_millis() as i64 => "catching_up",
        Some(_) => "unreachable",
    }
}
