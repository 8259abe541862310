//! The outbox's status (`ferry outbox status`, docs/outbox.md §8): depth by state, the
//! ages that matter, parked messages, paused topics, and the relays' recorded totals.

use crate::error::{DbContext, DbError, Op};
use crate::store::{Db, ParkedMessage, RowReaders, Store};
use crate::totals::{RelayRow, Totals};
use serde::Serialize;

#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Status {
    pub pending: i64,
    /// Pending messages with an unanswered publish behind them.
    pub uncertain: i64,
    pub leased: i64,
    pub parked: i64,
    /// Age of the oldest message a relay could take right now (not waiting for a retry,
    /// not behind an earlier message of its key, not on a paused topic).
    pub oldest_claimable_secs: Option<f64>,
    pub oldest_uncertain_secs: Option<f64>,
    pub parked_messages: Vec<ParkedMessage>,
    pub paused_topics: Vec<String>,
    /// Every relay's counters summed, since the schema was installed (relays record
    /// theirs every few seconds and when they stop: see [`crate::totals`]).
    pub relay_totals: Totals,
    /// Each relay that recorded its counters, newest first (retired ones summed in one
    /// row named `(retired)`).
    pub relays: Vec<RelayRow>,
}

/// Parked messages listed in a status.
const STATUS_PARKED_MAX: i64 = 20;

impl Store {
    /// Depth by state, ages, parked messages, paused topics and the relays' totals.
    pub async fn status(&self) -> Result<Status, DbError> {
        let (counts, oldest, parked, paused) = match self.db() {
            Db::Pg(p) => {
                let c = sqlx::query(
                    "SELECT count(*) FILTER (WHERE state = 0 AND uncertain_since IS NULL), \
                            count(*) FILTER (WHERE state = 0 AND uncertain_since IS NOT NULL), \
                            count(*) FILTER (WHERE state = 1), count(*) FILTER (WHERE state = 2), \
                            extract(epoch FROM now() - min(uncertain_since) FILTER (WHERE state <> 2))::float8 \
                     FROM ferry_outbox.messages",
                )
                .fetch_one(p)
                .await
                .doing(Op::Status)?;
                let oldest: Option<f64> = sqlx::query_scalar(
                    "SELECT extract(epoch FROM now() - min(m.enqueued_at))::float8 FROM ferry_outbox.messages m \
                     WHERE m.state = 0 AND m.next_attempt_at <= now() \
                       AND NOT EXISTS (SELECT 1 FROM ferry_outbox.paused_topics p WHERE p.topic = m.topic) \
                       AND (NOT m.ordered OR NOT EXISTS (SELECT 1 FROM ferry_outbox.messages e \
                            WHERE e.ordered AND e.key = m.key AND e.seq < m.seq))",
                )
                .fetch_one(p)
                .await
                .doing(Op::Status)?;
                let parked = sqlx::query(
                    "SELECT id, message_id, topic, key, attempts, last_error FROM ferry_outbox.messages \
                     WHERE state = 2 ORDER BY id LIMIT $1",
                )
                .bind(STATUS_PARKED_MAX)
                .fetch_all(p)
                .await
                .doing(Op::Status)?;
                let paused: Vec<String> = sqlx::query_scalar(
                    "SELECT topic FROM ferry_outbox.paused_topics ORDER BY topic",
                )
                .fetch_all(p)
                .await
                .doing(Op::Status)?;
                (
                    c.counts().doing(Op::Status)?,
                    oldest,
                    parked
                        .iter()
                        .map(RowReaders::parked)
                        .collect::<Result<Vec<_>, _>>()
                        .doing(Op::Status)?,
                    paused,
                )
            }
            Db::Sqlite(p) => {
                let now = self.now_ms();
                let c = sqlx::query(
                    "SELECT coalesce(sum(state = 0 AND uncertain_since IS NULL), 0), \
                            coalesce(sum(state = 0 AND uncertain_since IS NOT NULL), 0), \
                            coalesce(sum(state = 1), 0), coalesce(sum(state = 2), 0), \
                            (?1 - min(CASE WHEN state <> 2 THEN uncertain_since END)) / 1000.0 \
                     FROM ferry_outbox_messages",
                )
                .bind(now)
                .fetch_one(p)
                .await
                .doing(Op::Status)?;
                let oldest: Option<f64> = sqlx::query_scalar(
                    "SELECT (?1 - min(m.enqueued_at)) / 1000.0 FROM ferry_outbox_messages m \
                     WHERE m.state = 0 AND m.next_attempt_at <= ?1 \
                       AND NOT EXISTS (SELECT 1 FROM ferry_outbox_paused_topics p WHERE p.topic = m.topic) \
                       AND (NOT m.ordered OR NOT EXISTS (SELECT 1 FROM ferry_outbox_messages e \
                            WHERE e.ordered AND e.key = m.key AND e.seq < m.seq))",
                )
                .bind(now)
                .fetch_one(p)
                .await
                .doing(Op::Status)?;
                let parked = sqlx::query(
                    "SELECT id, message_id, topic, key, attempts, last_error FROM ferry_outbox_messages \
                     WHERE state = 2 ORDER BY id LIMIT ?1",
                )
                .bind(STATUS_PARKED_MAX)
                .fetch_all(p)
                .await
                .doing(Op::Status)?;
                let paused: Vec<String> = sqlx::query_scalar(
                    "SELECT topic FROM ferry_outbox_paused_topics ORDER BY topic",
                )
                .fetch_all(p)
                .await
                .doing(Op::Status)?;
                (
                    c.counts().doing(Op::Status)?,
                    oldest,
                    parked
                        .iter()
                        .map(RowReaders::parked)
                        .collect::<Result<Vec<_>, _>>()
                        .doing(Op::Status)?,
                    paused,
                )
            }
        };
        let (relay_totals, relays) = self.relay_rows().await?;
        Ok(Status {
            pending: counts.pending,
            uncertain: counts.uncertain,
            leased: counts.leased,
            parked: counts.parked,
            oldest_claimable_secs: oldest,
            oldest_uncertain_secs: counts.oldest_uncertain_secs,
            parked_messages: parked,
            paused_topics: paused,
            relay_totals,
            relays,
        })
    }
}
