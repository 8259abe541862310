//! The outbox's status (`ferry outbox status`, docs/outbox.md §8): depth by state, the
//! ages that matter, parked messages, paused topics, and the relays' recorded totals.
//! What is read often reads less: [`Store::depth`] (a metrics scrape, a drain loop) is
//! one statement, and the relay's dedup-window alarm reads one age.

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

/// The outbox's depth: messages by state and the ages that matter. One statement, for
/// whatever asks often (a `/metrics` scrape, a loop waiting for the outbox to drain);
/// [`Status`] adds what only a person reads.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Depth {
    pub pending: i64,
    /// Pending messages with an unanswered publish behind them.
    pub uncertain: i64,
    pub leased: i64,
    pub parked: i64,
    /// Age of the oldest message a relay could take right now (not waiting for a retry,
    /// not behind an earlier message of its key, not on a paused topic).
    pub oldest_claimable_secs: Option<f64>,
    /// Age of the oldest unanswered publish not yet resolved (parked messages aside).
    pub oldest_uncertain_secs: Option<f64>,
}

/// Parked messages listed in a status.
const STATUS_PARKED_MAX: i64 = 20;

impl Store {
    /// Depth by state, ages, parked messages, paused topics and the relays' totals.
    pub async fn status(&self) -> Result<Status, DbError> {
        let depth = self.depth().await?;
        let (parked, paused) = match self.db() {
            Db::Pg(p) => {
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
                    parked
                        .iter()
                        .map(RowReaders::parked)
                        .collect::<Result<Vec<_>, _>>()
                        .doing(Op::Status)?,
                    paused,
                )
            }
            Db::Sqlite(p) => {
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
            pending: depth.pending,
            uncertain: depth.uncertain,
            leased: depth.leased,
            parked: depth.parked,
            oldest_claimable_secs: depth.oldest_claimable_secs,
            oldest_uncertain_secs: depth.oldest_uncertain_secs,
            parked_messages: parked,
            paused_topics: paused,
            relay_totals,
            relays,
        })
    }

    /// Messages by state, the oldest claimable message's age and the oldest uncertain
    /// one's, in one statement.
    pub async fn depth(&self) -> Result<Depth, DbError> {
        let row = match self.db() {
            Db::Pg(p) => sqlx::query(
                "SELECT count(*) FILTER (WHERE state = 0 AND uncertain_since IS NULL), \
                        count(*) FILTER (WHERE state = 0 AND uncertain_since IS NOT NULL), \
                        count(*) FILTER (WHERE state = 1), count(*) FILTER (WHERE state = 2), \
                        extract(epoch FROM now() - min(uncertain_since) FILTER (WHERE state <> 2))::float8, \
                        (SELECT extract(epoch FROM now() - min(m.enqueued_at))::float8 FROM ferry_outbox.messages m \
                         WHERE m.state = 0 AND m.next_attempt_at <= now() \
                           AND NOT EXISTS (SELECT 1 FROM ferry_outbox.paused_topics p WHERE p.topic = m.topic) \
                           AND (NOT m.ordered OR NOT EXISTS (SELECT 1 FROM ferry_outbox.messages e \
                                WHERE e.ordered AND e.key = m.key AND e.seq < m.seq))) \
                 FROM ferry_outbox.messages",
            )
            .fetch_one(p)
            .await
            .doing(Op::Status)?
            .depth(),
            Db::Sqlite(p) => sqlx::query(
                "SELECT coalesce(sum(state = 0 AND uncertain_since IS NULL), 0), \
                        coalesce(sum(state = 0 AND uncertain_since IS NOT NULL), 0), \
                        coalesce(sum(state = 1), 0), coalesce(sum(state = 2), 0), \
                        (?1 - min(CASE WHEN state <> 2 THEN uncertain_since END)) / 1000.0, \
                        (SELECT (?1 - min(m.enqueued_at)) / 1000.0 FROM ferry_outbox_messages m \
                         WHERE m.state = 0 AND m.next_attempt_at <= ?1 \
                           AND NOT EXISTS (SELECT 1 FROM ferry_outbox_paused_topics p WHERE p.topic = m.topic) \
                           AND (NOT m.ordered OR NOT EXISTS (SELECT 1 FROM ferry_outbox_messages e \
                                WHERE e.ordered AND e.key = m.key AND e.seq < m.seq))) \
                 FROM ferry_outbox_messages",
            )
            .bind(self.now_ms())
            .fetch_one(p)
            .await
            .doing(Op::Status)?
            .depth(),
        };
        row.doing(Op::Status)
    }

    /// Age of the oldest unanswered publish not yet resolved (parked messages aside), for
    /// the relay's dedup-window alarm: one aggregate, none of the rest of a depth.
    pub async fn oldest_uncertain_secs(&self) -> Result<Option<f64>, DbError> {
        match self.db() {
            Db::Pg(p) => {
                sqlx::query_scalar(
                    "SELECT extract(epoch FROM now() - min(uncertain_since))::float8 \
                 FROM ferry_outbox.messages WHERE state <> 2",
                )
                .fetch_one(p)
                .await
            }
            Db::Sqlite(p) => {
                sqlx::query_scalar(
                    "SELECT (?1 - min(uncertain_since)) / 1000.0 \
                 FROM ferry_outbox_messages WHERE state <> 2",
                )
                .bind(self.now_ms())
                .fetch_one(p)
                .await
            }
        }
        .doing(Op::Status)
    }
}
