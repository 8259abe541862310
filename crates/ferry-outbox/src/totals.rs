//! Relay totals that outlive the relay (docs/outbox.md §8): what each relay counted
//! (published, duplicates, unavailable, database errors …), so that `ferry outbox
//! status` can show them for every relay, across restarts, without asking the relays.
//!
//! 1. A relay counts in memory ([`crate::relay::Stats`]).
//! 2. Before its first record, it retires rows of relays not seen for [`RETIRE_AFTER`],
//!    and an earlier row under its own name: their counters are added to one row named
//!    [`RETIRED`] and the rows deleted, in one statement (or transaction), so the table
//!    stays small and no count is lost or counted twice. Until that has succeeded it
//!    records nothing (it would overwrite the earlier row's counters).
//! 3. Every [`crate::relay::TOTALS_EVERY`] and when it stops, it upserts its row
//!    (`ferry_outbox.relays`, keyed by its owner name) with its counters so far.
//!
//! A relay killed between two upserts loses at most that interval's counts from these
//! totals (the messages themselves are unaffected: this is a report, not a ledger).

use crate::error::{DbContext, DbError, Op};
use crate::store::{Db, Store};
use serde::Serialize;
use std::time::Duration;

/// The name of the row that sums retired relays.
pub const RETIRED: &str = "(retired)";
/// A relay row not updated for this long belongs to a relay that died; it is folded
/// into [`RETIRED`] when another relay starts.
pub const RETIRE_AFTER: Duration = Duration::from_secs(24 * 3600);
/// Relay rows listed in a status (their totals are summed whatever the count).
const STATUS_RELAYS_MAX: i64 = 50;

/// Every counter a relay keeps, written once, in the order of the relays table's
/// columns. `$then` names a macro that receives the list and generates what its module
/// needs: [`Totals`] and its column conversions here; [`crate::relay::Stats`] and
/// [`crate::relay::RelayStatus`] in relay::stats. The relay counts the `relay:` ones
/// itself; the `breaker:` one is its breaker's. A counter added here is a column the
/// relays table (crate::schema) must have, or every record fails.
macro_rules! counters {
    ($then:ident) => {
        $then! {
            relay: leased, published, duplicates, settled, fenced, retried, unavailable,
                uncertain, reconciled, parked, db_errors;
            breaker: breaker_openings
        }
    };
}
pub(crate) use counters;

/// [`Totals`], its column names and the conversions to and from a row.
macro_rules! define_totals {
    (relay: $($relay:ident),+; breaker: $breaker:ident) => {
        /// Cumulative counters of one relay, or of all of them.
        #[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
        pub struct Totals {
            $(pub $relay: u64,)+
            pub $breaker: u64,
        }

        impl Totals {
            /// The counters' columns, in order.
            const COLUMNS: &'static [&'static str] = &[$(stringify!($relay),)+ stringify!($breaker)];
            /// How many counters there are: columns of the relays table.
            pub const N: usize = Totals::COLUMNS.len();

            fn columns(&self) -> [i64; Totals::N] {
                // Counters count events of one relay process; none reaches i64::MAX.
                [$(self.$relay,)+ self.$breaker].map(|v| i64::try_from(v).unwrap_or(i64::MAX))
            }

            fn from_columns(c: [i64; Totals::N]) -> Totals {
                let [$($relay,)+ $breaker] = c.map(|v| u64::try_from(v).unwrap_or(0));
                Totals {
                    $($relay,)+
                    $breaker,
                }
            }
        }
    };
}

counters!(define_totals);

/// One relay's row.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct RelayRow {
    pub owner: String,
    pub transport: String,
    /// Seconds since it last recorded its counters.
    pub seen_secs_ago: f64,
    /// It recorded them when it stopped (a relay that died did not).
    pub stopped: bool,
    pub breaker_open: bool,
    pub last_error: Option<String>,
    #[serde(flatten)]
    pub totals: Totals,
}

/// What a relay records about itself.
#[derive(Clone, Debug)]
pub struct RelayRecord {
    pub owner: String,
    pub transport: String,
    pub stopped: bool,
    pub breaker_open: bool,
    pub last_error: Option<String>,
    pub totals: Totals,
}

impl Store {
    /// Upsert this relay's row.
    pub async fn record_totals(&self, r: &RelayRecord) -> Result<(), DbError> {
        let c = r.totals.columns();
        let counters = Totals::COLUMNS.join(", ");
        let res = match self.db() {
            Db::Pg(p) => {
                let q = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO ferry_outbox.relays (owner, transport, stopped, breaker_open, \
                       last_error, {counters}) \
                     VALUES ($1, $2, $3, $4, $5, {}) \
                     ON CONFLICT (owner) DO UPDATE SET transport = excluded.transport, \
                       seen_at = now(), stopped = excluded.stopped, \
                       breaker_open = excluded.breaker_open, last_error = excluded.last_error, \
                       {}",
                    placeholders('$', 6),
                    set_excluded()
                )))
                .bind(&r.owner)
                .bind(&r.transport)
                .bind(r.stopped)
                .bind(r.breaker_open)
                .bind(&r.last_error);
                c.iter()
                    .fold(q, |q, v| q.bind(*v))
                    .execute(p)
                    .await
                    .map(|_| ())
            }
            Db::Sqlite(p) => {
                let now = self.now_ms();
                let q = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO ferry_outbox_relays (owner, transport, stopped, breaker_open, \
                       last_error, started_at, seen_at, {counters}) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, {}) \
                     ON CONFLICT (owner) DO UPDATE SET transport = excluded.transport, \
                       seen_at = excluded.seen_at, stopped = excluded.stopped, \
                       breaker_open = excluded.breaker_open, last_error = excluded.last_error, \
                       {}",
                    placeholders('?', 7),
                    set_excluded()
                )))
                .bind(&r.owner)
                .bind(&r.transport)
                .bind(r.stopped)
                .bind(r.breaker_open)
                .bind(&r.last_error)
                .bind(now);
                c.iter()
                    .fold(q, |q, v| q.bind(*v))
                    .execute(p)
                    .await
                    .map(|_| ())
            }
        };
        res.doing(Op::RecordTotals)
    }

    /// Fold the rows of relays not seen for `after`, and any earlier row named `owner`,
    /// into the [`RETIRED`] row. Returns how many rows were folded.
    pub async fn retire_relays(&self, owner: &str, after: Duration) -> Result<u64, DbError> {
        let after_ms = i64::try_from(after.as_millis()).unwrap_or(i64::MAX);
        let counters = Totals::COLUMNS.join(", ");
        let res = match self.db() {
            Db::Pg(p) => sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "WITH old AS ( \
                   DELETE FROM ferry_outbox.relays \
                   WHERE owner <> '{RETIRED}' \
                     AND (owner = $1 OR seen_at < now() - $2 * interval '1 millisecond') \
                   RETURNING *), \
                 folded AS ( \
                   INSERT INTO ferry_outbox.relays AS r (owner, stopped, {counters}) \
                   SELECT '{RETIRED}', true, {} FROM old HAVING count(*) > 0 \
                   ON CONFLICT (owner) DO UPDATE SET seen_at = now(), {} \
                   RETURNING 1) \
                 SELECT count(*) FROM old",
                sums("::bigint"),
                set_added("r")
            )))
            .bind(owner)
            .bind(after_ms)
            .fetch_one(p)
            .await
            .map(|n| n as u64),
            Db::Sqlite(p) => {
                let now = self.now_ms();
                let cutoff = now.saturating_sub(after_ms);
                // Write first: a deferred transaction that read first could not upgrade
                // its lock while an app writes (SQLITE_BUSY), and would fold nothing.
                async {
                    let mut tx = p.begin().await?;
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "INSERT INTO ferry_outbox_relays AS r (owner, stopped, started_at, seen_at, {counters}) \
                         SELECT '{RETIRED}', 1, ?3, ?3, {} FROM ferry_outbox_relays \
                         WHERE owner <> '{RETIRED}' AND (owner = ?1 OR seen_at < ?2) \
                         HAVING count(*) > 0 \
                         ON CONFLICT (owner) DO UPDATE SET seen_at = ?3, {}",
                        sums(""),
                        set_added("r")
                    )))
                    .bind(owner)
                    .bind(cutoff)
                    .bind(now)
                    .execute(&mut *tx)
                    .await?;
                    let n = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DELETE FROM ferry_outbox_relays \
                         WHERE owner <> '{RETIRED}' AND (owner = ?1 OR seen_at < ?2)"
                    )))
                    .bind(owner)
                    .bind(cutoff)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                    tx.commit().await?;
                    Ok(n)
                }
                .await
            }
        };
        res.doing(Op::RecordTotals)
    }

    /// Every relay's totals summed, and the rows, newest first (at most
    /// [`STATUS_RELAYS_MAX`]).
    pub async fn relay_rows(&self) -> Result<(Totals, Vec<RelayRow>), DbError> {
        // In the order relay_row reads them.
        let cols = format!(
            "owner, transport, stopped, breaker_open, last_error, {}, seen_secs_ago",
            Totals::COLUMNS.join(", ")
        );
        let (sum, rows) = match self.db() {
            Db::Pg(p) => {
                let sum = {
                    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "SELECT {} FROM ferry_outbox.relays",
                        sums("::bigint")
                    )))
                    .fetch_one(p)
                    .await
                    .doing(Op::Status)?;
                    read_counters(&row, 0).doing(Op::Status)?
                };
                let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT {} FROM (SELECT *, extract(epoch FROM now() - seen_at)::float8 AS seen_secs_ago \
                     FROM ferry_outbox.relays) r ORDER BY seen_secs_ago, owner LIMIT $1",
                    cols
                )))
                .bind(STATUS_RELAYS_MAX)
                .fetch_all(p)
                .await
                .doing(Op::Status)?;
                let rows = rows
                    .iter()
                    .map(relay_row)
                    .collect::<Result<Vec<_>, _>>()
                    .doing(Op::Status)?;
                (sum, rows)
            }
            Db::Sqlite(p) => {
                let sum = {
                    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "SELECT {} FROM ferry_outbox_relays",
                        sums("")
                    )))
                    .fetch_one(p)
                    .await
                    .doing(Op::Status)?;
                    read_counters(&row, 0).doing(Op::Status)?
                };
                let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
                    "SELECT {} FROM (SELECT *, (?1 - seen_at) / 1000.0 AS seen_secs_ago \
                     FROM ferry_outbox_relays) r ORDER BY seen_secs_ago, owner LIMIT ?2",
                    cols
                )))
                .bind(self.now_ms())
                .bind(STATUS_RELAYS_MAX)
                .fetch_all(p)
                .await
                .doing(Op::Status)?;
                let rows = rows
                    .iter()
                    .map(relay_row)
                    .collect::<Result<Vec<_>, _>>()
                    .doing(Op::Status)?;
                (sum, rows)
            }
        };
        Ok((Totals::from_columns(sum), rows))
    }
}

/// `coalesce(sum(c)CAST, 0)` for every counter (Postgres sums bigints as numeric: CAST
/// takes them back).
fn sums(cast: &str) -> String {
    each_counter(|c| format!("coalesce(sum({c}){cast}, 0)"))
}

/// `c = excluded.c` for every counter.
fn set_excluded() -> String {
    each_counter(|c| format!("{c} = excluded.{c}"))
}

/// `c = t.c + excluded.c` for every counter.
fn set_added(t: &str) -> String {
    each_counter(|c| format!("{c} = {t}.{c} + excluded.{c}"))
}

/// One placeholder per counter, numbered from `from`: `$6, $7, …` or `?7, ?8, …`.
fn placeholders(sigil: char, from: usize) -> String {
    (from..from + Totals::N)
        .map(|i| format!("{sigil}{i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn each_counter(f: impl Fn(&str) -> String) -> String {
    Totals::COLUMNS
        .iter()
        .map(|c| f(c))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The counters of a row, from column `from` on.
fn read_counters<R: sqlx::Row>(row: &R, from: usize) -> Result<[i64; Totals::N], sqlx::Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let mut counters = [0; Totals::N];
    for (i, c) in counters.iter_mut().enumerate() {
        *c = row.try_get(from + i)?;
    }
    Ok(counters)
}

/// Where a relay row's counters begin (after owner, transport, stopped, breaker_open and
/// last_error); `seen_secs_ago` follows them.
const ROW_COUNTERS_AT: usize = 5;

fn relay_row<R: sqlx::Row>(row: &R) -> Result<RelayRow, sqlx::Error>
where
    usize: sqlx::ColumnIndex<R>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> f64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> bool: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Option<String>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    Ok(RelayRow {
        owner: row.try_get(0)?,
        transport: row.try_get(1)?,
        stopped: row.try_get(2)?,
        breaker_open: row.try_get(3)?,
        last_error: row.try_get(4)?,
        totals: Totals::from_columns(read_counters(row, ROW_COUNTERS_AT)?),
        seen_secs_ago: row.try_get::<f64, _>(ROW_COUNTERS_AT + Totals::N)?.max(0.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // Guards the one list of counters: each goes to its own column and comes back as
    // the same counter, and each is a column of the relays table on both stores.
    #[test]
    fn every_counter_has_its_own_column_and_comes_back_from_it() {
        let columns: [i64; Totals::N] = std::array::from_fn(|i| i as i64 + 1);
        let totals = Totals::from_columns(columns);
        assert_eq!(totals.columns(), columns);
        assert_eq!(totals.published, 2, "columns are read in the listed order");
        assert_eq!(totals.breaker_openings, Totals::N as u64);
        let mut names = Totals::COLUMNS.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Totals::N, "a counter is listed twice");
        for c in Totals::COLUMNS {
            for (store, ddl) in [
                ("Postgres", crate::schema::PG_V2),
                ("SQLite", crate::schema::SQLITE_V2),
            ] {
                assert!(
                    ddl.lines().any(|l| l.split_whitespace().next() == Some(c)),
                    "{store}'s relays table lacks the column {c}"
                );
            }
        }
    }
}
