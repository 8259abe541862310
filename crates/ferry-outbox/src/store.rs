//! The relay's side of the outbox tables (docs/outbox.md §3.3, §4): lease, extend,
//! settle, reclaim expired leases, and what operators do (status, requeue, discard,
//! pause). Each function is one statement on Postgres; on SQLite, where statements cost
//! no round trip, a settle is one short write transaction of per-row statements.
//!
//! Every write a relay makes after its lease requires the generation it leased with, its
//! own name as the lease owner and an unexpired lease; rows that fail that are reported
//! back as fenced, untouched, with how their generation compares now ([`Fence`]).
//!
//! Time: Postgres statements use the server's `now()`; SQLite has no server, so its
//! times are the store's [`Clock`] (`wall_ms`), the system clock unless a test sets one.

use crate::error::{ConnectError, DbContext, DbError, Op, schema_missing};
use ferry_core::ConfigError;
use ferry_core::epoch::{Epoch, Fence};
use ferry_core::seams::{Clock, SystemClock};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{PgPool, Row, SqlitePool};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// Where the outbox lives, and the clock SQLite's times come from.
#[derive(Clone)]
pub struct Store {
    db: Db,
    clock: Arc<dyn Clock>,
}

/// The database behind a [`Store`].
#[derive(Clone, Debug)]
pub enum Db {
    Pg(PgPool),
    Sqlite(SqlitePool),
}

/// A message held by a relay under `generation`.
#[derive(Clone, Debug)]
pub struct Leased {
    pub id: i64,
    /// The lease's fencing token: bumped by every lease, required by every later write.
    pub generation: Epoch,
    pub message_id: String,
    pub topic: String,
    pub key: Option<String>,
    pub seq: Option<i64>,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
    /// Message-attributable refusals so far (never negative: the schema's default is 0 and
    /// only a settle adds to it).
    pub attempts: i32,
    /// An earlier presentation may have reached the transport.
    pub uncertain: bool,
    /// Why this row cannot be published as it is (its stored headers do not read back as
    /// a JSON object of strings: written around the enqueue checks). The relay parks it.
    pub defect: Option<String>,
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
    /// Attempts are spent (or the message can never be published): parked until an
    /// operator requeues or discards it. Spends one attempt.
    Park { error: String },
}

impl Settle {
    /// Attempts this settle adds to the row.
    pub fn attempts_spent(&self) -> i32 {
        match self {
            Settle::Confirmed => 0,
            Settle::Retry { attempt, .. } => i32::from(*attempt),
            Settle::Park { .. } => 1,
        }
    }
}

/// One row of a settle: the lease it was taken under and what to write.
#[derive(Clone, Debug)]
pub struct SettleRow {
    pub id: i64,
    pub generation: Epoch,
    /// The attempts the row had when leased: the settle checks it writes exactly these
    /// plus [`Settle::attempts_spent`] (attempts only rise, one per refusal).
    pub attempts: i32,
    pub settle: Settle,
}

impl SettleRow {
    pub fn new(m: &Leased, settle: Settle) -> SettleRow {
        SettleRow {
            id: m.id,
            generation: m.generation,
            attempts: m.attempts,
            settle,
        }
    }
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

/// What a settle achieved. Every row of the batch is counted once: deleted, returned or
/// parked if written, listed in `fenced` if not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settled {
    pub deleted: u64,
    pub returned: u64,
    pub parked: u64,
    /// Of the rows returned, those that spent an attempt (the message's own refusal).
    pub retried: u64,
    /// Rows this relay no longer held: not written.
    pub fenced: Vec<FencedRow>,
}

/// A row a relay wrote nothing to because it no longer held it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FencedRow {
    pub id: i64,
    /// The relay's generation against the row's now: `Stale { held }` when another
    /// lease took it since; `Current` when the lease ran out (or was reclaimed) and no
    /// one leased it again yet. None when the row is gone (settled by a later holder, or
    /// discarded).
    pub fence: Option<Fence>,
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

impl Store {
    /// Connect to `url`: `postgres://…` or `sqlite:PATH` (a bare path is SQLite too).
    pub async fn connect(url: &str) -> Result<Store, ConnectError> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let opts = PgConnectOptions::from_str(url).map_err(|e| {
                ConfigError::new("db", redact(url), format!("not a Postgres URL: {e}"))
            })?;
            let user = opts.get_username().to_string();
            // One direct connection first: a pool would report an unreachable server as
            // "pool timed out", hiding the reason.
            let first = <sqlx::PgConnection as sqlx::Connection>::connect_with(&opts)
                .await
                .map_err(|e| ConnectError::postgres(redact(url), user, e))?;
            let _ = sqlx::Connection::close(first).await;
            let pool = PgPoolOptions::new()
                .max_connections(POOL_CONNECTIONS_MAX)
                .acquire_timeout(Duration::from_secs(10))
                .connect_lazy_with(opts);
            return Ok(Store::from_db(Db::Pg(pool)));
        }
        let path = url
            .strip_prefix("sqlite://")
            .or_else(|| url.strip_prefix("sqlite:"))
            .unwrap_or(url);
        if path.contains("://") {
            return Err(ConfigError::new(
                "db",
                redact(url),
                "use postgres://USER@HOST/DB or sqlite:PATH",
            )
            .into());
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
            .map_err(|e| ConnectError::sqlite(path.to_string(), e))?;
        Ok(Store::from_db(Db::Sqlite(pool)))
    }

    /// A store over a pool the caller already has, on the system clock.
    pub fn from_db(db: Db) -> Store {
        Store {
            db,
            clock: Arc::new(SystemClock),
        }
    }

    /// The same store reading SQLite's times from `clock` (tests drive time with it).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Store {
        self.clock = clock;
        self
    }

    pub fn db(&self) -> &Db {
        &self.db
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Milliseconds since the Unix epoch by the store's clock: SQLite's times.
    pub(crate) fn now_ms(&self) -> i64 {
        i64::try_from(self.clock.wall_ms()).expect("wall-clock milliseconds fit an i64")
    }

    /// Create or upgrade the schema.
    pub async fn install(&self) -> Result<crate::schema::Installed, crate::schema::InstallError> {
        match &self.db {
            Db::Pg(p) => {
                let mut c = p.acquire().await.doing(Op::Install)?;
                crate::schema::install_pg(&mut c).await
            }
            Db::Sqlite(p) => {
                let mut c = p.acquire().await.doing(Op::Install)?;
                crate::schema::install_sqlite(&mut c).await
            }
        }
    }

    /// The installed schema version, or None when there is none.
    pub async fn schema_version(&self) -> Result<Option<i32>, DbError> {
        let r = match &self.db {
            Db::Pg(p) => {
                sqlx::query_scalar::<_, Option<i32>>(
                    "SELECT max(version) FROM ferry_outbox.schema_version \
                     WHERE to_regclass('ferry_outbox.schema_version') IS NOT NULL",
                )
                .fetch_one(p)
                .await
            }
            Db::Sqlite(p) => {
                sqlx::query_scalar::<_, Option<i32>>(
                    "SELECT max(version) FROM ferry_outbox_schema_version",
                )
                .fetch_one(p)
                .await
            }
        };
        match r {
            Ok(v) => Ok(v),
            Err(e) if schema_missing(&e, &["42P01"]) => Ok(None),
            Err(e) => Err(DbError::new(Op::SchemaVersion, e)),
        }
    }

    /// Lease up to `batch` claimable messages for `owner` for `lease`.
    pub async fn lease(
        &self,
        owner: &str,
        batch: u32,
        lease: Duration,
    ) -> Result<Vec<Leased>, DbError> {
        let lease_ms = millis(lease);
        match &self.db {
            Db::Pg(p) => {
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
                .bind(i64::from(batch))
                .bind(owner)
                .bind(lease_ms)
                .fetch_all(p)
                .await
                .doing(Op::Lease)?;
                rows.iter()
                    .map(RowReaders::leased)
                    .collect::<Result<_, _>>()
                    .doing(Op::Lease)
            }
            Db::Sqlite(p) => {
                let now = self.now_ms();
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
                .bind(now.saturating_add(lease_ms))
                .bind(now)
                .bind(i64::from(batch))
                .fetch_all(p)
                .await
                .doing(Op::Lease)?;
                let mut out: Vec<Leased> = rows
                    .iter()
                    .map(RowReaders::leased)
                    .collect::<Result<_, _>>()
                    .doing(Op::Lease)?;
                // RETURNING order is unspecified in SQLite; keep the claim order.
                out.sort_by_key(|m| m.id);
                Ok(out)
            }
        }
    }

    /// Extend the lease of `held` (id, generation), leased by `owner`, by `lease`;
    /// returns the ids still held. Rows not returned are fenced: see [`Store::fences`].
    pub async fn extend(
        &self,
        owner: &str,
        held: &[(i64, Epoch)],
        lease: Duration,
    ) -> Result<Vec<i64>, DbError> {
        let (ids, gens): (Vec<i64>, Vec<i64>) =
            held.iter().map(|(id, g)| (*id, epoch_to_sql(*g))).unzip();
        let lease_ms = millis(lease);
        match &self.db {
            Db::Pg(p) => {
                sqlx::query_scalar(
                    "UPDATE ferry_outbox.messages m SET lease_until = now() + $3 * interval '1 millisecond' \
                     FROM unnest($1::bigint[], $2::bigint[]) AS s(id, generation) \
                     WHERE m.id = s.id AND m.generation = s.generation AND m.state = 1 \
                       AND m.lease_owner = $4 AND m.lease_until > now() \
                     RETURNING m.id",
                )
                .bind(&ids)
                .bind(&gens)
                .bind(lease_ms)
                .bind(owner)
                .fetch_all(p)
                .await
                .doing(Op::Extend)
            }
            Db::Sqlite(p) => {
                let now = self.now_ms();
                let mut tx = p.begin().await.doing(Op::Extend)?;
                let mut kept = Vec::new();
                for (id, generation) in ids.iter().zip(&gens) {
                    let n = sqlx::query(
                        "UPDATE ferry_outbox_messages SET lease_until = ?1 \
                         WHERE id = ?2 AND generation = ?3 AND state = 1 AND lease_owner = ?5 \
                           AND lease_until > ?4",
                    )
                    .bind(now.saturating_add(lease_ms))
                    .bind(id)
                    .bind(generation)
                    .bind(now)
                    .bind(owner)
                    .execute(&mut *tx)
                    .await
                    .doing(Op::Extend)?
                    .rows_affected();
                    if n == 1 {
                        kept.push(*id);
                    }
                }
                tx.commit().await.doing(Op::Extend)?;
                Ok(kept)
            }
        }
    }

    /// Write back the outcome of each row leased by `owner`, in one transaction.
    ///
    /// Panics (an invariant of this code, not of the data) when the statement reports a
    /// write it was not asked for: a row outside the batch, under another generation,
    /// or with attempts other than the leased ones plus those spent.
    pub async fn settle(&self, owner: &str, rows: &[SettleRow]) -> Result<Settled, DbError> {
        if rows.is_empty() {
            return Ok(Settled::default());
        }
        let mut cols = SettleColumns::default();
        for r in rows {
            cols.push(r);
        }
        let written: Vec<Written> = match &self.db {
            Db::Pg(p) => settle_pg(p, owner, &cols).await.doing(Op::Settle)?,
            Db::Sqlite(p) => settle_sqlite(p, owner, &cols, self.now_ms())
                .await
                .doing(Op::Settle)?,
        };
        let (mut settled, lost) = account(rows, &written);
        if !lost.is_empty() {
            // Only for the report: a failure to read them leaves them fenced, reason unknown.
            if let Ok(f) = self.fences(&lost).await {
                settled.fenced = f;
            }
        }
        Ok(settled)
    }

    /// How each of `rows` (id, the generation a relay held) compares with the row now.
    pub async fn fences(&self, rows: &[(i64, Epoch)]) -> Result<Vec<FencedRow>, DbError> {
        let ids: Vec<i64> = rows.iter().map(|(id, _)| *id).collect();
        let current: Vec<(i64, i64)> = match &self.db {
            Db::Pg(p) => sqlx::query_as(
                "SELECT id, generation FROM ferry_outbox.messages WHERE id = ANY($1)",
            )
            .bind(&ids)
            .fetch_all(p)
            .await
            .doing(Op::Settle)?,
            Db::Sqlite(p) => sqlx::query_as(
                "SELECT id, generation FROM ferry_outbox_messages \
                 WHERE id IN (SELECT value FROM json_each(?1))",
            )
            .bind(serde_json::to_string(&ids).expect("integers serialise"))
            .fetch_all(p)
            .await
            .doing(Op::Settle)?,
        };
        let current: HashMap<i64, i64> = current.into_iter().collect();
        Ok(rows
            .iter()
            .map(|(id, mine)| FencedRow {
                id: *id,
                fence: current
                    .get(id)
                    .map(|g| Fence::check(*mine, epoch_from_sql(*g).unwrap_or(Epoch(0)))),
            })
            .collect())
    }

    /// Put messages whose lease ran out back to pending, marked uncertain (their holder
    /// may have published them). Returns how many.
    pub async fn reclaim_expired(&self) -> Result<u64, DbError> {
        let r = match &self.db {
            Db::Pg(p) => sqlx::query(
                "UPDATE ferry_outbox.messages SET state = 0, lease_owner = NULL, lease_until = NULL, \
                   next_attempt_at = now(), uncertain_since = coalesce(uncertain_since, now()) \
                 WHERE state = 1 AND lease_until <= now()",
            )
            .execute(p)
            .await
            .map(|r| r.rows_affected()),
            Db::Sqlite(p) => sqlx::query(
                "UPDATE ferry_outbox_messages SET state = 0, lease_owner = NULL, lease_until = NULL, \
                   next_attempt_at = ?1, uncertain_since = coalesce(uncertain_since, ?1) \
                 WHERE state = 1 AND lease_until <= ?1",
            )
            .bind(self.now_ms())
            .execute(p)
            .await
            .map(|r| r.rows_affected()),
        };
        r.doing(Op::Reclaim)
    }

    /// Put parked messages back to pending with their attempts reset. Returns how many.
    pub async fn requeue(&self, which: &Select) -> Result<u64, DbError> {
        self.operate(which, false).await.doing(Op::Requeue)
    }

    /// Delete parked messages for good. Returns how many.
    pub async fn discard(&self, which: &Select) -> Result<u64, DbError> {
        self.operate(which, true).await.doing(Op::Discard)
    }

    async fn operate(&self, which: &Select, delete: bool) -> Result<u64, sqlx::Error> {
        let (ids, message_ids, topic, all) = which.columns();
        Ok(match &self.db {
            Db::Pg(p) => {
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
            Db::Sqlite(p) => {
                let head = if delete {
                    "DELETE FROM ferry_outbox_messages WHERE state = 2"
                } else {
                    "UPDATE ferry_outbox_messages SET state = 0, attempts = 0, next_attempt_at = ?5, \
                     last_error = NULL WHERE state = 2"
                };
                // `head` is one of two literals above; everything else is bound.
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "{head} AND (?4 OR id IN (SELECT value FROM json_each(?1)) \
                     OR message_id IN (SELECT value FROM json_each(?2)) OR topic = ?3)"
                )))
                .bind(serde_json::to_string(&ids).expect("ids serialise"))
                .bind(serde_json::to_string(&message_ids).expect("ids serialise"))
                .bind(&topic)
                .bind(all)
                .bind(self.now_ms())
                .execute(p)
                .await?
                .rows_affected()
            }
        })
    }

    /// Stop relays taking messages of `topic` (those already leased finish).
    pub async fn pause(&self, topic: &str) -> Result<(), DbError> {
        match &self.db {
            Db::Pg(p) => sqlx::query(
                "INSERT INTO ferry_outbox.paused_topics (topic) VALUES ($1) ON CONFLICT DO NOTHING",
            )
            .bind(topic)
            .execute(p)
            .await
            .map(|_| ()),
            Db::Sqlite(p) => sqlx::query(
                "INSERT OR IGNORE INTO ferry_outbox_paused_topics (topic, paused_at) VALUES (?, ?)",
            )
            .bind(topic)
            .bind(self.now_ms())
            .execute(p)
            .await
            .map(|_| ()),
        }
        .doing(Op::Pause)
    }

    pub async fn resume(&self, topic: &str) -> Result<(), DbError> {
        match &self.db {
            Db::Pg(p) => sqlx::query("DELETE FROM ferry_outbox.paused_topics WHERE topic = $1")
                .bind(topic)
                .execute(p)
                .await
                .map(|_| ()),
            Db::Sqlite(p) => sqlx::query("DELETE FROM ferry_outbox_paused_topics WHERE topic = ?")
                .bind(topic)
                .execute(p)
                .await
                .map(|_| ()),
        }
        .doing(Op::Resume)
    }

    pub async fn close(&self) {
        match &self.db {
            Db::Pg(p) => p.close().await,
            Db::Sqlite(p) => p.close().await,
        }
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("db", &self.db).finish()
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

/// A row a settle statement wrote: its id, generation, state and attempts afterwards
/// (a deleted row's as they were).
#[derive(Debug)]
struct Written {
    id: i64,
    generation: i64,
    state: i16,
    attempts: i32,
}

impl From<(i64, i64, i16, i32)> for Written {
    fn from((id, generation, state, attempts): (i64, i64, i16, i32)) -> Written {
        Written {
            id,
            generation,
            state,
            attempts,
        }
    }
}

/// Postgres: the whole batch in one statement.
///
/// A row going back with no delay (caught by an outage) keeps its `next_attempt_at`:
/// due already, and in its place in the claim order (`next_attempt_at, id`). Moved to
/// now, the heads of a few hundred keys would queue behind every other key's backlog,
/// and their keys would drain one message per lease at the end.
async fn settle_pg(
    p: &PgPool,
    owner: &str,
    cols: &SettleColumns,
) -> Result<Vec<Written>, sqlx::Error> {
    let rows: Vec<(i64, i64, i16, i32)> = sqlx::query_as(
        "WITH s AS ( \
           SELECT * FROM unnest($1::bigint[], $2::bigint[], $3::smallint[], $4::int[], \
                                $5::bigint[], $6::smallint[], $7::text[]) \
             AS s(id, generation, action, attempt, delay_ms, uncertain, error)), \
         gone AS ( \
           DELETE FROM ferry_outbox.messages m USING s \
           WHERE m.id = s.id AND s.action = 0 AND m.generation = s.generation \
             AND m.state = 1 AND m.lease_owner = $8 AND m.lease_until > now() \
           RETURNING m.id, m.generation, m.attempts), \
         back AS ( \
           UPDATE ferry_outbox.messages m SET \
             state = CASE WHEN s.action = 2 THEN 2 ELSE 0 END, \
             attempts = m.attempts + s.attempt, \
             next_attempt_at = CASE WHEN s.delay_ms = 0 THEN least(m.next_attempt_at, now()) \
               ELSE now() + s.delay_ms * interval '1 millisecond' END, \
             uncertain_since = CASE s.uncertain WHEN 0 THEN NULL \
               WHEN 1 THEN coalesce(m.uncertain_since, now()) ELSE m.uncertain_since END, \
             last_error = coalesce(s.error, m.last_error), \
             lease_owner = NULL, lease_until = NULL \
           FROM s \
           WHERE m.id = s.id AND s.action <> 0 AND m.generation = s.generation \
             AND m.state = 1 AND m.lease_owner = $8 AND m.lease_until > now() \
           RETURNING m.id, m.generation, m.state, m.attempts) \
         SELECT id, generation, 0::smallint AS state, attempts FROM gone \
         UNION ALL SELECT id, generation, state, attempts FROM back",
    )
    .bind(&cols.ids)
    .bind(&cols.generations)
    .bind(&cols.actions)
    .bind(&cols.attempts)
    .bind(&cols.delays_ms)
    .bind(&cols.uncertain)
    .bind(&cols.errors)
    .bind(owner)
    .fetch_all(p)
    .await?;
    Ok(rows.into_iter().map(Written::from).collect())
}

/// SQLite: one short write transaction; confirmed rows (nearly all of them) in one
/// statement, the rest one statement each.
async fn settle_sqlite(
    p: &SqlitePool,
    owner: &str,
    cols: &SettleColumns,
    now: i64,
) -> Result<Vec<Written>, sqlx::Error> {
    let mut tx = p.begin().await?;
    let mut written: Vec<Written> = Vec::new();
    let confirmed: Vec<[i64; 2]> = (0..cols.ids.len())
        .filter(|&i| cols.actions[i] == 0)
        .map(|i| [cols.ids[i], cols.generations[i]])
        .collect();
    if !confirmed.is_empty() {
        let gone: Vec<(i64, i64, i16, i32)> = sqlx::query_as(
            "DELETE FROM ferry_outbox_messages \
             WHERE (id, generation) IN (SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') \
                                        FROM json_each(?1)) \
               AND state = 1 AND lease_owner = ?3 AND lease_until > ?2 \
             RETURNING id, generation, 0 AS state, attempts",
        )
        .bind(serde_json::to_string(&confirmed).expect("integers serialise"))
        .bind(now)
        .bind(owner)
        .fetch_all(&mut *tx)
        .await?;
        written.extend(gone.into_iter().map(Written::from));
    }
    for i in (0..cols.ids.len()).filter(|&i| cols.actions[i] != 0) {
        let back: Option<(i64, i64, i16, i32)> = sqlx::query_as(
            "UPDATE ferry_outbox_messages SET \
               state = CASE WHEN ?4 = 2 THEN 2 ELSE 0 END, \
               attempts = attempts + ?5, \
               next_attempt_at = CASE WHEN ?6 = 0 THEN min(next_attempt_at, ?3) ELSE ?3 + ?6 END, \
               uncertain_since = CASE ?7 WHEN 0 THEN NULL \
                 WHEN 1 THEN coalesce(uncertain_since, ?3) ELSE uncertain_since END, \
               last_error = coalesce(?8, last_error), \
               lease_owner = NULL, lease_until = NULL \
             WHERE id = ?1 AND generation = ?2 AND state = 1 AND lease_owner = ?9 \
               AND lease_until > ?3 \
             RETURNING id, generation, state, attempts",
        )
        .bind(cols.ids[i])
        .bind(cols.generations[i])
        .bind(now)
        .bind(cols.actions[i])
        .bind(cols.attempts[i])
        .bind(cols.delays_ms[i])
        .bind(cols.uncertain[i])
        .bind(&cols.errors[i])
        .bind(owner)
        .fetch_optional(&mut *tx)
        .await?;
        written.extend(back.map(Written::from));
    }
    tx.commit().await?;
    Ok(written)
}

/// Count what a settle wrote, checking the settle path's invariants on the way: cheap
/// (a lookup per row), so they stay on in release builds. Returns the counts, with each
/// row not written as fenced (reason unknown yet), and those rows with the generation
/// they were held under, for [`Store::fences`]. Every row of the batch ends up in exactly
/// one count or in `fenced`: rows are unique, and each write is of a row of the batch,
/// once (asserted below).
fn account(rows: &[SettleRow], written: &[Written]) -> (Settled, Vec<(i64, Epoch)>) {
    let asked: HashMap<i64, &SettleRow> = rows.iter().map(|r| (r.id, r)).collect();
    assert_eq!(
        asked.len(),
        rows.len(),
        "settle invariant: a batch holds each row once"
    );
    let mut done: HashSet<i64> = HashSet::with_capacity(written.len());
    let mut settled = Settled::default();
    for w in written {
        let r = asked.get(&w.id).unwrap_or_else(|| {
            panic!(
                "settle invariant: a settle writes only rows of its own batch, yet row {} was written",
                w.id
            )
        });
        assert!(
            done.insert(w.id),
            "settle invariant: a settle writes each row once, yet row {} was written twice",
            w.id
        );
        assert_eq!(
            epoch_from_sql(w.generation).ok(),
            Some(r.generation),
            "settle invariant: a settle writes only rows of its own lease (row {})",
            w.id
        );
        let want = r
            .attempts
            .checked_add(r.settle.attempts_spent())
            .expect("settle invariant: attempts never wrap");
        let want = if r.settle == Settle::Confirmed {
            r.attempts
        } else {
            want
        };
        assert_eq!(
            w.attempts, want,
            "settle invariant: attempts only rise, by one per refusal (row {}: leased with {}, {:?})",
            w.id, r.attempts, r.settle
        );
        let counter = match (&r.settle, w.state) {
            (Settle::Confirmed, _) => &mut settled.deleted,
            (_, 2) => &mut settled.parked,
            _ => &mut settled.returned,
        };
        *counter = counter
            .checked_add(1)
            .expect("settle invariant: counts never wrap");
        if matches!(r.settle, Settle::Retry { attempt: true, .. }) {
            settled.retried = settled
                .retried
                .checked_add(1)
                .expect("settle invariant: counts never wrap");
        }
    }
    let lost: Vec<(i64, Epoch)> = rows
        .iter()
        .filter(|r| !done.contains(&r.id))
        .map(|r| (r.id, r.generation))
        .collect();
    settled.fenced = lost
        .iter()
        .map(|&(id, _)| FencedRow { id, fence: None })
        .collect();
    (settled, lost)
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
    fn push(&mut self, r: &SettleRow) {
        let (action, delay, uncertain, error) = match &r.settle {
            Settle::Confirmed => (0, 0, 0, None),
            Settle::Retry {
                retry_in,
                uncertain,
                error,
                ..
            } => (
                1,
                millis(*retry_in),
                match uncertain {
                    Uncertain::Clear => 0,
                    Uncertain::Mark => 1,
                    Uncertain::Keep => 2,
                },
                Some(error.clone()),
            ),
            Settle::Park { error } => (2, 0, 0, Some(error.clone())),
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
        self.ids.push(r.id);
        self.generations.push(epoch_to_sql(r.generation));
        self.actions.push(action);
        self.attempts.push(r.settle.attempts_spent());
        self.delays_ms.push(delay);
        self.uncertain.push(uncertain);
        self.errors.push(error);
    }
}

/// A generation as stored (bigint). Generations come from the database and rise by one
/// per lease, so they never reach i64::MAX.
fn epoch_to_sql(e: Epoch) -> i64 {
    i64::try_from(e.0).expect("a generation read from the database fits its bigint column")
}

/// A stored generation; negative ones were written around the relay and fail validation.
fn epoch_from_sql(g: i64) -> Result<Epoch, sqlx::Error> {
    u64::try_from(g)
        .map(Epoch)
        .map_err(|_| sqlx::Error::Decode(format!("outbox generation {g} is negative").into()))
}

/// A duration in whole milliseconds for SQL; saturating (a lease of 292 million years).
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Readers of the rows the status and lease statements return, for both stores' row
/// types (the column types are the same; sqlx's row types are not).
macro_rules! row_readers {
    ($row:ty) => {
        impl RowReaders for $row {
            fn leased(&self) -> Result<Leased, sqlx::Error> {
                let headers: String = self.try_get("headers")?;
                let (headers, defect) = match parse_headers(&headers) {
                    Ok(h) => (h, None),
                    Err(e) => (BTreeMap::new(), Some(e)),
                };
                Ok(Leased {
                    id: self.try_get("id")?,
                    generation: epoch_from_sql(self.try_get("generation")?)?,
                    message_id: self.try_get("message_id")?,
                    topic: self.try_get("topic")?,
                    key: self.try_get("key")?,
                    seq: self.try_get("seq")?,
                    payload: self.try_get("payload")?,
                    headers,
                    attempts: self.try_get("attempts")?,
                    uncertain: self.try_get("uncertain")?,
                    defect,
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

            fn depth(&self) -> Result<crate::status::Depth, sqlx::Error> {
                Ok(crate::status::Depth {
                    pending: self.try_get(0)?,
                    uncertain: self.try_get(1)?,
                    leased: self.try_get(2)?,
                    parked: self.try_get(3)?,
                    oldest_uncertain_secs: self.try_get(4)?,
                    oldest_claimable_secs: self.try_get(5)?,
                })
            }
        }
    };
}

pub(crate) trait RowReaders {
    fn leased(&self) -> Result<Leased, sqlx::Error>;
    fn parked(&self) -> Result<ParkedMessage, sqlx::Error>;
    fn depth(&self) -> Result<crate::status::Depth, sqlx::Error>;
}

row_readers!(sqlx::postgres::PgRow);
row_readers!(sqlx::sqlite::SqliteRow);

/// Headers as stored: a JSON object of strings (the enqueue paths check it). A row
/// written around them with other JSON values keeps them as their JSON text; anything
/// but an object is the row's defect (the relay parks it, naming this).
fn parse_headers(s: &str) -> Result<BTreeMap<String, String>, String> {
    let v: serde_json::Value = serde_json::from_str(s).map_err(|e| {
        format!("its headers {s:?} are not JSON ({e}); fix the row's headers, then requeue it")
    })?;
    let serde_json::Value::Object(map) = v else {
        return Err(format!(
            "its headers {s:?} are not a JSON object; fix the row's headers, then requeue it"
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, settle: Settle) -> SettleRow {
        SettleRow {
            id,
            generation: Epoch(7),
            attempts: 1,
            settle,
        }
    }

    fn retry(attempt: bool) -> Settle {
        Settle::Retry {
            retry_in: Duration::ZERO,
            attempt,
            uncertain: Uncertain::Keep,
            error: "away".into(),
        }
    }

    // Guards the settle's bookkeeping that the relay's counters rest on: each row of a
    // batch is counted once, as written (deleted, returned, parked; attempts spent
    // among the returned) or as fenced, and the fenced ones come back with the
    // generation they were held under.
    #[test]
    fn account_counts_each_row_once_as_written_or_fenced() {
        let rows = [
            row(1, Settle::Confirmed),
            row(2, retry(true)),
            row(3, retry(false)),
            row(
                4,
                Settle::Park {
                    error: "refused".into(),
                },
            ),
            row(5, retry(true)),
        ];
        let written = [
            Written::from((1, 7, 0, 1)),
            Written::from((2, 7, 0, 2)),
            Written::from((3, 7, 0, 1)),
            Written::from((4, 7, 2, 2)),
        ];
        let (settled, lost) = account(&rows, &written);
        assert_eq!(
            (settled.deleted, settled.returned, settled.parked),
            (1, 2, 1)
        );
        assert_eq!(settled.retried, 1, "row 5 spent no attempt: it was fenced");
        assert_eq!(settled.fenced, [FencedRow { id: 5, fence: None }]);
        assert_eq!(lost, [(5, Epoch(7))]);
    }

    // A statement that wrote a row under another generation broke the fence: the relay
    // stops rather than count it.
    #[test]
    #[should_panic(expected = "a settle writes only rows of its own lease")]
    fn account_refuses_a_write_under_another_lease() {
        account(&[row(1, Settle::Confirmed)], &[Written::from((1, 8, 0, 1))]);
    }
}
