//! The relay's side of the outbox tables (docs/outbox.md §3.3, §4): lease, extend,
//! settle, reclaim expired leases, and what operators do (status, requeue, discard,
//! pause). Each function is one statement on Postgres; on SQLite, where statements cost
//! no round trip, a settle is one short write transaction of per-row statements.
//!
//! Every write a relay makes after its lease requires the generation it leased with and
//! an unexpired lease; rows that fail that are reported back as fenced, untouched.

use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{PgPool, Row, SqlitePool};
use std::collections::BTreeMap;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch: SQLite's clock for the outbox.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Where the outbox lives.
#[derive(Clone, Debug)]
pub enum Store {
    Pg(PgPool),
    Sqlite(SqlitePool),
}

/// A message held by a relay under `generation`.
#[derive(Clone, Debug)]
pub struct Leased {
    pub id: i64,
    pub generation: i64,
    pub message_id: String,
    pub topic: String,
    pub key: Option<String>,
    pub seq: Option<i64>,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
    /// Message-attributable refusals so far.
    pub attempts: i32,
    /// An earlier presentation may have reached the transport.
    pub uncertain: bool,
}

/// What the relay writes back for one leased message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settle {
    /// The transport confirmed it: delete.
    Confirmed,
    /// Back to pending after `retry_in`. `attempt`: the failure was the message's own.
    /// `uncertain`: the transport may hold it (an unanswered publish).
    Retry {
        retry_in: Duration,
        attempt: bool,
        uncertain: Uncertain,
        error: String,
    },
    /// Attempts are spent: parked until an operator requeues or discards it.
    Park { error: String },
}

/// What a settle does to a message's uncertain mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Uncertain {
    /// The transport answered: it does not hold the message.
    Clear,
    /// Sent without an answer: mark it (keeping the first time it happened).
    Mark,
    /// Not sent this time: leave the mark as it is.
    Keep,
}

/// What a settle achieved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settled {
    pub deleted: u64,
    pub returned: u64,
    pub parked: u64,
    /// Rows this relay no longer held (re-leased, or its lease ran out): not written.
    pub fenced: Vec<i64>,
}

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
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ParkedMessage {
    pub id: i64,
    pub message_id: String,
    pub topic: String,
    pub key: Option<String>,
    pub attempts: i32,
    pub last_error: Option<String>,
}

/// Which parked messages an operator command applies to.
#[derive(Clone, Debug)]
pub enum Select {
    Ids(Vec<i64>),
    MessageIds(Vec<String>),
    Topic(String),
    AllParked,
}

/// Connections a store keeps: enough for every relay loop plus a listener and status.
const POOL_CONNECTIONS_MAX: u32 = 16;
/// Characters of a message's `last_error` kept.
const ERROR_CHARS_MAX: usize = 1000;
/// Parked messages listed in a status.
const STATUS_PARKED_MAX: i64 = 20;

impl Store {
    /// Connect to `url`: `postgres://…` or `sqlite:PATH` (a bare path is SQLite too).
    pub async fn connect(url: &str) -> Result<Store, String> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let opts = PgConnectOptions::from_str(url)
                .map_err(|e| format!("--db {}: not a Postgres URL: {e}", redact(url)))?;
            // One direct connection first: a pool would report an unreachable server as
            // "pool timed out", hiding the reason.
            let first = <sqlx::PgConnection as sqlx::Connection>::connect_with(&opts)
                .await
                .map_err(|e| format!("cannot reach the database at {}: {e}", redact(url)))?;
            let _ = sqlx::Connection::close(first).await;
            let pool = PgPoolOptions::new()
                .max_connections(POOL_CONNECTIONS_MAX)
                .acquire_timeout(Duration::from_secs(10))
                .connect_lazy_with(opts);
            return Ok(Store::Pg(pool));
        }
        let path = url
            .strip_prefix("sqlite://")
            .or_else(|| url.strip_prefix("sqlite:"))
            .unwrap_or(url);
        if path.contains("://") {
            return Err(format!(
                "--db {}: use postgres://USER@HOST/DB or sqlite:PATH",
                redact(url)
            ));
        }
        let opts = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(POOL_CONNECTIONS_MAX)
            .connect_with(opts)
            .await
            .map_err(|e| format!("cannot open the SQLite database {path}: {e}"))?;
        Ok(Store::Sqlite(pool))
    }

    /// Create or upgrade the schema.
    pub async fn install(&self) -> Result<crate::schema::Installed, crate::schema::InstallError> {
        match self {
            Store::Pg(p) => crate::schema::install_pg(&mut *p.acquire().await?).await,
            Store::Sqlite(p) => crate::schema::install_sqlite(&mut *p.acquire().await?).await,
        }
    }

    /// The installed schema version, or None when there is none.
    pub async fn schema_version(&self) -> Result<Option<i32>, sqlx::Error> {
        let q = match self {
            Store::Pg(_) => {
                "SELECT max(version) FROM ferry_outbox.schema_version \
                 WHERE to_regclass('ferry_outbox.schema_version') IS NOT NULL"
            }
            Store::Sqlite(_) => "SELECT max(version) FROM ferry_outbox_schema_version",
        };
        let r = match self {
            Store::Pg(p) => sqlx::query_scalar::<_, Option<i32>>(q).fetch_one(p).await,
            Store::Sqlite(p) => sqlx::query_scalar::<_, Option<i32>>(q).fetch_one(p).await,
        };
        match r {
            Ok(v) => Ok(v),
            Err(sqlx::Error::Database(d))
                if d.code().as_deref() == Some("42P01")
                    || d.message().contains("no such table") =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Lease up to `batch` claimable messages for `owner` for `lease`.
    pub async fn lease(
        &self,
        owner: &str,
        batch: u32,
        lease: Duration,
    ) -> Result<Vec<Leased>, sqlx::Error> {
        match self {
            Store::Pg(p) => {
                let rows = sqlx::query(
                    "WITH c AS ( \
                       SELECT m.id FROM ferry_outbox.messages m \
                       WHERE m.state = 0 AND m.next_attempt_at <= now() \
                         AND NOT EXISTS (SELECT 1 FROM ferry_outbox.paused_topics p WHERE p.topic = m.topic) \
                         AND (NOT m.ordered OR NOT EXISTS ( \
                           SELECT 1 FROM ferry_outbox.messages e \
                           WHERE e.ordered AND e.key = m.key AND e.seq < m.seq)) \
                       ORDER BY m.next_attempt_at, m.id LIMIT $1 \
                       FOR UPDATE OF m SKIP LOCKED) \
                     UPDATE ferry_outbox.messages m \
                     SET state = 1, generation = m.generation + 1, lease_owner = $2, \
                         lease_until = now() + $3 * interval '1 millisecond' \
                     FROM c WHERE m.id = c.id \
                     RETURNING m.id, m.generation, m.message_id, m.topic, m.key, m.seq, m.payload, \
                               m.headers::text AS headers, m.attempts, m.uncertain_since IS NOT NULL AS uncertain",
                )
                .bind(batch as i64)
                .bind(owner)
                .bind(lease.as_millis() as i64)
                .fetch_all(p)
                .await?;
                rows.iter().map(RowReaders::leased).collect()
            }
            Store::Sqlite(p) => {
                let now = now_ms();
                let rows = sqlx::query(
                    "UPDATE ferry_outbox_messages \
                     SET state = 1, generation = generation + 1, lease_owner = ?1, lease_until = ?2 \
                     WHERE id IN ( \
                       SELECT m.id FROM ferry_outbox_messages m \
                       WHERE m.state = 0 AND m.next_attempt_at <= ?3 \
                         AND NOT EXISTS (SELECT 1 FROM ferry_outbox_paused_topics p WHERE p.topic = m.topic) \
                         AND (NOT m.ordered OR NOT EXISTS ( \
                           SELECT 1 FROM ferry_outbox_messages e \
                           WHERE e.ordered AND e.key = m.key AND e.seq < m.seq)) \
                       ORDER BY m.next_attempt_at, m.id LIMIT ?4) \
                     RETURNING id, generation, message_id, topic, key, seq, payload, headers, attempts, \
                               uncertain_since IS NOT NULL AS uncertain",
                )
                .bind(owner)
                .bind(now + lease.as_millis() as i64)
                .bind(now)
                .bind(batch as i64)
                .fetch_all(p)
                .await?;
                let mut out: Vec<Leased> = rows
                    .iter()
                    .map(RowReaders::leased)
                    .collect::<Result<_, _>>()?;
                // RETURNING order is unspecified in SQLite; keep the claim order.
                out.sort_by_key(|m| m.id);
                Ok(out)
            }
        }
    }

    /// Extend the lease of `held` (id, generation) by `lease`; returns the ids still held.
    pub async fn extend(
        &self,
        held: &[(i64, i64)],
        lease: Duration,
    ) -> Result<Vec<i64>, sqlx::Error> {
        let (ids, gens): (Vec<i64>, Vec<i64>) = held.iter().copied().unzip();
        match self {
            Store::Pg(p) => {
                sqlx::query_scalar(
                    "UPDATE ferry_outbox.messages m SET lease_until = now() + $3 * interval '1 millisecond' \
                     FROM unnest($1::bigint[], $2::bigint[]) AS s(id, generation) \
                     WHERE m.id = s.id AND m.generation = s.generation AND m.state = 1 \
                       AND m.lease_until > now() \
                     RETURNING m.id",
                )
                .bind(&ids)
                .bind(&gens)
                .bind(lease.as_millis() as i64)
                .fetch_all(p)
                .await
            }
            Store::Sqlite(p) => {
                let now = now_ms();
                let mut tx = p.begin().await?;
                let mut kept = Vec::new();
                for (id, generation) in held {
                    let n = sqlx::query(
                        "UPDATE ferry_outbox_messages SET lease_until = ?1 \
                         WHERE id = ?2 AND generation = ?3 AND state = 1 AND lease_until > ?4",
                    )
                    .bind(now + lease.as_millis() as i64)
                    .bind(id)
                    .bind(generation)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                    if n == 1 {
                        kept.push(*id);
                    }
                }
                tx.commit().await?;
                Ok(kept)
            }
        }
    }

    /// Write back the outcome of each leased message, in one transaction.
    pub async fn settle(&self, outcomes: &[(i64, i64, Settle)]) -> Result<Settled, sqlx::Error> {
        let mut settled = Settled::default();
        if outcomes.is_empty() {
            return Ok(settled);
        }
        let mut cols = SettleColumns::default();
        for (id, generation, s) in outcomes {
            cols.push(*id, *generation, s);
        }
        let written: Vec<(i64, i16)> = match self {
            Store::Pg(p) => {
                sqlx::query_as(
                    "WITH s AS ( \
                   SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::smallint[], $4::int[], \
                                        $5::bigint[], $6::smallint[], $7::text[]) \
                     AS s(id, generation, action, attempt, delay_ms, uncertain, error)), \
                 gone AS ( \
                   DELETE FROM ferry_outbox.messages m USING s \
                   WHERE m.id = s.id AND s.action = 0 AND m.generation = s.generation \
                     AND m.state = 1 AND m.lease_until > now() \
                   RETURNING m.id), \
                 back AS ( \
                   UPDATE ferry_outbox.messages m SET \
                     state = CASE WHEN s.action = 2 THEN 2 ELSE 0 END, \
                     attempts = m.attempts + s.attempt, \
                     next_attempt_at = now() + s.delay_ms * interval '1 millisecond', \
                     uncertain_since = CASE s.uncertain WHEN 0 THEN NULL \
                       WHEN 1 THEN coalesce(m.uncertain_since, now()) ELSE m.uncertain_since END, \
                     last_error = coalesce(s.error, m.last_error), \
                     lease_owner = NULL, lease_until = NULL \
                   FROM s \
                   WHERE m.id = s.id AND s.action <> 0 AND m.generation = s.generation \
                     AND m.state = 1 AND m.lease_until > now() \
                   RETURNING m.id, m.state) \
                 SELECT id, 0::smallint FROM gone UNION ALL SELECT id, state FROM back",
                )
                .bind(&cols.ids)
                .bind(&cols.generations)
                .bind(&cols.actions)
                .bind(&cols.attempts)
                .bind(&cols.delays_ms)
                .bind(&cols.uncertain)
                .bind(&cols.errors)
                .fetch_all(p)
                .await?
            }
            Store::Sqlite(p) => {
                let now = now_ms();
                let mut tx = p.begin().await?;
                let mut written = Vec::new();
                // Confirmed rows (nearly all of them) go in one statement.
                let confirmed: Vec<[i64; 2]> = (0..cols.ids.len())
                    .filter(|&i| cols.actions[i] == 0)
                    .map(|i| [cols.ids[i], cols.generations[i]])
                    .collect();
                if !confirmed.is_empty() {
                    let gone: Vec<i64> = sqlx::query_scalar(
                        "DELETE FROM ferry_outbox_messages \
                         WHERE (id, generation) IN (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') \
                                                    FROM json_each(?1)) \
                           AND state = 1 AND lease_until > ?2 RETURNING id",
                    )
                    .bind(serde_json::to_string(&confirmed).expect("integers serialise"))
                    .bind(now)
                    .fetch_all(&mut *tx)
                    .await?;
                    written.extend(gone.into_iter().map(|id| (id, 0i16)));
                }
                for i in (0..cols.ids.len()).filter(|&i| cols.actions[i] != 0) {
                    let n = {
                        sqlx::query(
                            "UPDATE ferry_outbox_messages SET \
                               state = CASE WHEN ?4 = 2 THEN 2 ELSE 0 END, \
                               attempts = attempts + ?5, \
                               next_attempt_at = ?3 + ?6, \
                               uncertain_since = CASE ?7 WHEN 0 THEN NULL \
                                 WHEN 1 THEN coalesce(uncertain_since, ?3) ELSE uncertain_since END, \
                               last_error = coalesce(?8, last_error), \
                               lease_owner = NULL, lease_until = NULL \
                             WHERE id = ?1 AND generation = ?2 AND state = 1 AND lease_until > ?3",
                        )
                        .bind(cols.ids[i])
                        .bind(cols.generations[i])
                        .bind(now)
                        .bind(cols.actions[i])
                        .bind(cols.attempts[i])
                        .bind(cols.delays_ms[i])
                        .bind(cols.uncertain[i])
                        .bind(&cols.errors[i])
                        .execute(&mut *tx)
                        .await?
                        .rows_affected()
                    };
                    if n == 1 {
                        written.push((cols.ids[i], if cols.actions[i] == 2 { 2 } else { 0 }));
                    }
                }
                tx.commit().await?;
                written
            }
        };
        let actions: std::collections::HashMap<i64, i16> = cols
            .ids
            .iter()
            .copied()
            .zip(cols.actions.iter().copied())
            .collect();
        let mut done = std::collections::HashSet::new();
        for (id, state) in &written {
            done.insert(*id);
            match (actions.get(id).copied().unwrap_or(1), state) {
                (0, _) => settled.deleted += 1,
                (_, 2) => settled.parked += 1,
                _ => settled.returned += 1,
            }
        }
        settled.fenced = cols
            .ids
            .iter()
            .copied()
            .filter(|id| !done.contains(id))
            .collect();
        Ok(settled)
    }

    /// Put messages whose lease ran out back to pending, marked uncertain (their holder
    /// may have published them). Returns how many.
    pub async fn reclaim_expired(&self) -> Result<u64, sqlx::Error> {
        Ok(match self {
            Store::Pg(p) => sqlx::query(
                "UPDATE ferry_outbox.messages SET state = 0, lease_owner = NULL, lease_until = NULL, \
                   next_attempt_at = now(), uncertain_since = coalesce(uncertain_since, now()) \
                 WHERE state = 1 AND lease_until <= now()",
            )
            .execute(p)
            .await?
            .rows_affected(),
            Store::Sqlite(p) => {
                let now = now_ms();
                sqlx::query(
                    "UPDATE ferry_outbox_messages SET state = 0, lease_owner = NULL, lease_until = NULL, \
                       next_attempt_at = ?1, uncertain_since = coalesce(uncertain_since, ?1) \
                     WHERE state = 1 AND lease_until <= ?1",
                )
                .bind(now)
                .execute(p)
                .await?
                .rows_affected()
            }
        })
    }

    /// Depth by state, ages, parked messages and paused topics.
    pub async fn status(&self) -> Result<Status, sqlx::Error> {
        match self {
            Store::Pg(p) => {
                let c = sqlx::query(
                    "SELECT count(*) FILTER (WHERE state = 0 AND uncertain_since IS NULL), \
                            count(*) FILTER (WHERE state = 0 AND uncertain_since IS NOT NULL), \
                            count(*) FILTER (WHERE state = 1), count(*) FILTER (WHERE state = 2), \
                            extract(epoch FROM now() - min(uncertain_since) FILTER (WHERE state <> 2))::float8 \
                     FROM ferry_outbox.messages",
                )
                .fetch_one(p)
                .await?;
                let oldest: Option<f64> = sqlx::query_scalar(
                    "SELECT extract(epoch FROM now() - min(m.enqueued_at))::float8 FROM ferry_outbox.messages m \
                     WHERE m.state = 0 AND m.next_attempt_at <= now() \
                       AND NOT EXISTS (SELECT 1 FROM ferry_outbox.paused_topics p WHERE p.topic = m.topic) \
                       AND (NOT m.ordered OR NOT EXISTS (SELECT 1 FROM ferry_outbox.messages e \
                            WHERE e.ordered AND e.key = m.key AND e.seq < m.seq))",
                )
                .fetch_one(p)
                .await?;
                let parked = sqlx::query(
                    "SELECT id, message_id, topic, key, attempts, last_error FROM ferry_outbox.messages \
                     WHERE state = 2 ORDER BY id LIMIT $1",
                )
                .bind(STATUS_PARKED_MAX)
                .fetch_all(p)
                .await?;
                let paused = sqlx::query_scalar(
                    "SELECT topic FROM ferry_outbox.paused_topics ORDER BY topic",
                )
                .fetch_all(p)
                .await?;
                Ok(status_from(
                    c.counts()?,
                    oldest,
                    parked
                        .iter()
                        .map(RowReaders::parked)
                        .collect::<Result<_, _>>()?,
                    paused,
                ))
            }
            Store::Sqlite(p) => {
                let now = now_ms();
                let c = sqlx::query(
                    "SELECT coalesce(sum(state = 0 AND uncertain_since IS NULL), 0), \
                            coalesce(sum(state = 0 AND uncertain_since IS NOT NULL), 0), \
                            coalesce(sum(state = 1), 0), coalesce(sum(state = 2), 0), \
                            (?1 - min(CASE WHEN state <> 2 THEN uncertain_since END)) / 1000.0 \
                     FROM ferry_outbox_messages",
                )
                .bind(now)
                .fetch_one(p)
                .await?;
                let oldest: Option<f64> = sqlx::query_scalar(
                    "SELECT (?1 - min(m.enqueued_at)) / 1000.0 FROM ferry_outbox_messages m \
                     WHERE m.state = 0 AND m.next_attempt_at <= ?1 \
                       AND NOT EXISTS (SELECT 1 FROM ferry_outbox_paused_topics p WHERE p.topic = m.topic) \
                       AND (NOT m.ordered OR NOT EXISTS (SELECT 1 FROM ferry_outbox_messages e \
                            WHERE e.ordered AND e.key = m.key AND e.seq < m.seq))",
                )
                .bind(now)
                .fetch_one(p)
                .await?;
                let parked = sqlx::query(
                    "SELECT id, message_id, topic, key, attempts, last_error FROM ferry_outbox_messages \
                     WHERE state = 2 ORDER BY id LIMIT ?1",
                )
                .bind(STATUS_PARKED_MAX)
                .fetch_all(p)
                .await?;
                let paused = sqlx::query_scalar(
                    "SELECT topic FROM ferry_outbox_paused_topics ORDER BY topic",
                )
                .fetch_all(p)
                .await?;
                Ok(status_from(
                    c.counts()?,
                    oldest,
                    parked
                        .iter()
                        .map(RowReaders::parked)
                        .collect::<Result<_, _>>()?,
                    paused,
                ))
            }
        }
    }

    /// Put parked messages back to pending with their attempts reset. Returns how many.
    pub async fn requeue(&self, which: &Select) -> Result<u64, sqlx::Error> {
        self.operate(which, false).await
    }

    /// Delete parked messages for good. Returns how many.
    pub async fn discard(&self, which: &Select) -> Result<u64, sqlx::Error> {
        self.operate(which, true).await
    }

    async fn operate(&self, which: &Select, delete: bool) -> Result<u64, sqlx::Error> {
        let (ids, message_ids, topic, all) = which.columns();
        Ok(match self {
            Store::Pg(p) => {
                let head = if delete {
                    "DELETE FROM ferry_outbox.messages WHERE state = 2"
                } else {
                    "UPDATE ferry_outbox.messages SET state = 0, attempts = 0, next_attempt_at = now(), \
                     last_error = NULL WHERE state = 2"
                };
                // `head` is one of two literals above; everything else is bound.
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "{head} AND ($4 OR id = ANY($1) OR message_id = ANY($2) OR topic = $3)"
                )))
                .bind(&ids)
                .bind(&message_ids)
                .bind(&topic)
                .bind(all)
                .execute(p)
                .await?
                .rows_affected()
            }
            Store::Sqlite(p) => {
                let head = if delete {
                    "DELETE FROM ferry_outbox_messages WHERE state = 2".to_string()
                } else {
                    format!(
                        "UPDATE ferry_outbox_messages SET state = 0, attempts = 0, next_attempt_at = {}, \
                         last_error = NULL WHERE state = 2",
                        now_ms()
                    )
                };
                // `head` is one of two statements above (a number at most); the rest is bound.
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "{head} AND (?4 OR id IN (SELECT value FROM json_each(?1)) \
                     OR message_id IN (SELECT value FROM json_each(?2)) OR topic = ?3)"
                )))
                .bind(serde_json::to_string(&ids).expect("ids serialise"))
                .bind(serde_json::to_string(&message_ids).expect("ids serialise"))
                .bind(&topic)
                .bind(all)
                .execute(p)
                .await?
                .rows_affected()
            }
        })
    }

    /// Stop relays taking messages of `topic` (those already leased finish).
    pub async fn pause(&self, topic: &str) -> Result<(), sqlx::Error> {
        match self {
            Store::Pg(p) => {
                sqlx::query("INSERT INTO ferry_outbox.paused_topics (topic) VALUES ($1) ON CONFLICT DO NOTHING")
                    .bind(topic)
                    .execute(p)
                    .await?;
            }
            Store::Sqlite(p) => {
                sqlx::query("INSERT OR IGNORE INTO ferry_outbox_paused_topics (topic, paused_at) VALUES (?, ?)")
                    .bind(topic)
                    .bind(now_ms())
                    .execute(p)
                    .await?;
            }
        }
        Ok(())
    }

    pub async fn resume(&self, topic: &str) -> Result<(), sqlx::Error> {
        let q = match self {
            Store::Pg(_) => "DELETE FROM ferry_outbox.paused_topics WHERE topic = $1",
            Store::Sqlite(_) => "DELETE FROM ferry_outbox_paused_topics WHERE topic = ?",
        };
        match self {
            Store::Pg(p) => {
                sqlx::query(q).bind(topic).execute(p).await?;
            }
            Store::Sqlite(p) => {
                sqlx::query(q).bind(topic).execute(p).await?;
            }
        }
        Ok(())
    }

    pub async fn close(&self) {
        match self {
            Store::Pg(p) => p.close().await,
            Store::Sqlite(p) => p.close().await,
        }
    }
}

impl Select {
    fn columns(&self) -> (Vec<i64>, Vec<String>, Option<String>, bool) {
        match self {
            Select::Ids(ids) => (ids.clone(), vec![], None, false),
            Select::MessageIds(m) => (vec![], m.clone(), None, false),
            Select::Topic(t) => (vec![], vec![], Some(t.clone()), false),
            Select::AllParked => (vec![], vec![], None, true),
        }
    }
}

/// Settle outcomes as columns, for `unnest` on Postgres and a loop on SQLite.
#[derive(Default)]
struct SettleColumns {
    ids: Vec<i64>,
    generations: Vec<i64>,
    /// 0 delete, 1 back to pending, 2 park.
    actions: Vec<i16>,
    attempts: Vec<i32>,
    delays_ms: Vec<i64>,
    /// 0 clear, 1 mark, 2 keep.
    uncertain: Vec<i16>,
    errors: Vec<Option<String>>,
}

impl SettleColumns {
    fn push(&mut self, id: i64, generation: i64, s: &Settle) {
        let (action, attempt, delay, uncertain, error) = match s {
            Settle::Confirmed => (0, 0, 0, 0, None),
            Settle::Retry {
                retry_in,
                attempt,
                uncertain,
                error,
            } => (
                1,
                *attempt as i32,
                retry_in.as_millis() as i64,
                match uncertain {
                    Uncertain::Clear => 0,
                    Uncertain::Mark => 1,
                    Uncertain::Keep => 2,
                },
                Some(error.clone()),
            ),
            Settle::Park { error } => (2, 1, 0, 0, Some(error.clone())),
        };
        // Error texts come from transports (response bodies): no NUL (Postgres text
        // refuses it, failing the whole batch's settle) and no unbounded length.
        let error = error.map(|e: String| {
            let clean: String = e
                .chars()
                .map(|c| if c.is_control() && c != '\t' { ' ' } else { c })
                .collect();
            match clean.char_indices().nth(ERROR_CHARS_MAX) {
                Some((at, _)) => format!("{}…", &clean[..at]),
                None => clean,
            }
        });
        self.ids.push(id);
        self.generations.push(generation);
        self.actions.push(action);
        self.attempts.push(attempt);
        self.delays_ms.push(delay);
        self.uncertain.push(uncertain);
        self.errors.push(error);
    }
}

/// Readers of the rows the status and lease statements return, for both stores' row
/// types (the column types are the same; sqlx's row types are not).
macro_rules! row_readers {
    ($row:ty) => {
        impl RowReaders for $row {
            fn leased(&self) -> Result<Leased, sqlx::Error> {
                let headers: String = self.try_get("headers")?;
                Ok(Leased {
                    id: self.try_get("id")?,
                    generation: self.try_get("generation")?,
                    message_id: self.try_get("message_id")?,
                    topic: self.try_get("topic")?,
                    key: self.try_get("key")?,
                    seq: self.try_get("seq")?,
                    payload: self.try_get("payload")?,
                    headers: parse_headers(&headers)?,
                    attempts: self.try_get("attempts")?,
                    uncertain: self.try_get("uncertain")?,
                })
            }

            fn parked(&self) -> Result<ParkedMessage, sqlx::Error> {
                Ok(ParkedMessage {
                    id: self.try_get(0)?,
                    message_id: self.try_get(1)?,
                    topic: self.try_get(2)?,
                    key: self.try_get(3)?,
                    attempts: self.try_get(4)?,
                    last_error: self.try_get(5)?,
                })
            }

            fn counts(&self) -> Result<Counts, sqlx::Error> {
                Ok(Counts {
                    pending: self.try_get(0)?,
                    uncertain: self.try_get(1)?,
                    leased: self.try_get(2)?,
                    parked: self.try_get(3)?,
                    oldest_uncertain_secs: self.try_get(4)?,
                })
            }
        }
    };
}

trait RowReaders {
    fn leased(&self) -> Result<Leased, sqlx::Error>;
    fn parked(&self) -> Result<ParkedMessage, sqlx::Error>;
    fn counts(&self) -> Result<Counts, sqlx::Error>;
}

row_readers!(sqlx::postgres::PgRow);
row_readers!(sqlx::sqlite::SqliteRow);

/// The depth counts of a status.
struct Counts {
    pending: i64,
    uncertain: i64,
    leased: i64,
    parked: i64,
    oldest_uncertain_secs: Option<f64>,
}

fn status_from(
    c: Counts,
    oldest_claimable_secs: Option<f64>,
    parked_messages: Vec<ParkedMessage>,
    paused_topics: Vec<String>,
) -> Status {
    Status {
        pending: c.pending,
        uncertain: c.uncertain,
        leased: c.leased,
        parked: c.parked,
        oldest_claimable_secs,
        oldest_uncertain_secs: c.oldest_uncertain_secs,
        parked_messages,
        paused_topics,
    }
}

/// Headers as stored: a JSON object of strings (the enqueue paths check it). A row
/// written around them with other JSON values keeps them as their JSON text rather than
/// failing the whole lease; anything but an object is reported.
fn parse_headers(s: &str) -> Result<BTreeMap<String, String>, sqlx::Error> {
    let v: serde_json::Value = serde_json::from_str(s).map_err(|e| {
        sqlx::Error::Decode(format!("outbox headers {s:?} are not JSON: {e}").into())
    })?;
    let serde_json::Value::Object(map) = v else {
        return Err(sqlx::Error::Decode(
            format!("outbox headers {s:?} are not an object").into(),
        ));
    };
    Ok(map
        .into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => (k, s),
            other => (k, other.to_string()),
        })
        .collect())
}

/// `url` without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..scheme + 3],
                    &userinfo[..colon],
                    &url[at..]
                ),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}
