//! Filing (docs/sync-up.md §5): an upload from a replica, written into the server's
//! record tables in one transaction, and the `Filed` that answers it.
//!
//! 1. Lock the sender's row of `ferry_sync.filings` (its filing count and the newest
//!    upload id filed). An upload older than that newest one arrived out of order: it is
//!    answered stale and files nothing (it would put an older state over a newer one).
//!    An upload whose count is above the server's shows the server lost filings
//!    (restored, or reinstalled): the answer asks for the journal after the server's
//!    count, which becomes the upload's.
//! 2. Take the transaction's shape from the host: `SET LOCAL ROLE` (`--file-role`) and
//!    `ferry_sync.replica`, a setting row-level security can read.
//! 3. Per table part, under a savepoint, one statement for its upserts (`ON CONFLICT`
//!    on the key: do nothing, or take the newer version) and one for its deletes (only of
//!    the sender's rows, only where the table names the replica). A part the database
//!    refuses is redone row by row: each row it refuses goes to the inbox.
//! 4. Count the filing, commit, answer.
//!
//! Everything is in one transaction: a crash or a transient error before the commit
//! leaves nothing filed and nothing counted, and the replica sends the rows again. After
//! it, a lost answer makes the replica send them again too; filing is idempotent by key,
//! so the second filing changes nothing and its `Filed` lets the replica forget them.

use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::catalog::Mapping;
use crate::rules::quote_ident;
use crate::value::{self, Affinity, Value};
use crate::wire::{self, Filed, RefusedRow, TablePart, Upload};

/// Rows one replica may keep in the inbox: at 100 bytes a row, 10,000 are a megabyte,
/// and a replica whose rows the database keeps refusing needs a person, not more room.
/// Past it, uploads from that replica are refused as transient (503): the replica keeps
/// them, and nothing is lost.
pub const INBOX_ROWS_MAX: i64 = 10_000;

/// A record table as filing writes it.
#[derive(Clone, Debug)]
pub struct RecordSpec {
    /// `schema.table`, as the rules name it: how the inbox and messages name it.
    pub relation: String,
    /// Quoted, for SQL.
    pub quoted: String,
    /// The replica-side name: how uploads name it.
    pub name: String,
    pub columns: Vec<FileColumn>,
    /// Indexes into `columns` of the key's parts, in key order.
    pub key: Vec<usize>,
    /// Index of the uuid column filing sets to the sender.
    pub replica: Option<usize>,
    /// Index of the integer column whose newer value wins.
    pub version: Option<usize>,
    pub lane: String,
    /// `Some` for a two-way table: `columns` are its key and the replica's columns, and
    /// filing updates rows the server records the sender holding (docs/sync-up.md §5.1).
    pub two_way: Option<TwoWaySpec>,
    /// Replicas state every row again on a chain start, and filing a restated upload
    /// takes them whatever their version: setting tables and the wishes' answers
    /// (docs/sync-up.md §7).
    pub restate: bool,
}

/// What a two-way table's filing and announcement need beyond a record table's.
#[derive(Clone, Debug)]
pub struct TwoWaySpec {
    /// The columns the server sends, as messages down carry them.
    pub down: Vec<wire::Column>,
    /// The audience whose replicas hold the table (docs/sync-scale.md §1); `None`: every
    /// replica.
    pub audience: Option<String>,
}

/// Why a two-way edit was dropped, as the `Filed` says it.
const DROPPED: &str = "the server deleted this row or no longer sends it to this replica; the edit is dropped (the server's side wins)";

/// One column of a record table.
#[derive(Clone, Debug)]
pub struct FileColumn {
    pub name: String,
    /// The type as Postgres writes it, to cast to: `numeric(10,2)`, `integer[]`.
    pub pg_type: String,
    pub mapping: Mapping,
    pub not_null: bool,
    /// 0, or the column's place in the key.
    pub key_part: u8,
}

impl RecordSpec {
    /// Whether a replica of `audience` holds this table: a record table every replica
    /// does, a two-way table those of its audience.
    pub fn reaches(&self, audience: Option<&str>) -> bool {
        let entry = self.two_way.as_ref().and_then(|t| t.audience.as_deref());
        crate::rules::reaches(entry, audience)
    }

    /// The columns as a message down names them, so the replica creates the table.
    pub fn wire_columns(&self) -> Vec<wire::Column> {
        self.columns
            .iter()
            .map(|c| wire::Column {
                name: c.name.clone(),
                affinity: c.mapping.affinity(),
                not_null: c.not_null,
                key_part: c.key_part,
            })
            .collect()
    }

    /// The empty part a snapshot carries so each replica creates the table and notes
    /// its writes (docs/sync-up.md §4.1): a two-way table's carries the server's columns
    /// and then the replica's.
    pub fn announce(&self) -> TablePart {
        let (columns, owned) = match &self.two_way {
            None => (self.wire_columns(), 0),
            Some(t) => {
                let owned: Vec<wire::Column> = self
                    .wire_columns()
                    .into_iter()
                    .filter(|c| c.key_part == 0)
                    .collect();
                let n = owned.len();
                (t.down.iter().cloned().chain(owned).collect(), n)
            }
        };
        TablePart {
            table: self.name.clone(),
            columns,
            sweep: wire::Sweep::default(),
            deletes: Vec::new(),
            upserts: Vec::new(),
            writes: Some(wire::Writes {
                lane: self.lane.clone(),
                owned,
                restate: self.restate,
            }),
        }
    }
}

/// How a filing ended, for the caller to answer.
#[derive(Debug)]
pub enum Outcome {
    /// Filed (rows refused for good are in it): answer 200 with this.
    Filed(Filed),
    /// The upload names a table the sender does not write, or columns it lacks: not
    /// filed; answer 400 with this.
    Malformed(String),
}

/// Why filing did not happen: every variant leaves nothing filed, and the replica sends
/// the upload again later.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error(
        "the inbox holds {0} rows of this replica that the database refused, the most it keeps ({INBOX_ROWS_MAX}); nothing more is filed for it until they are: see `ferry sync status`, fix the cause, and run `ferry sync refile`"
    )]
    InboxFull(i64),
}

/// What the host lets shape filing's transaction (docs/sync-up.md §5.1).
#[derive(Clone, Debug, Default)]
pub struct Shape {
    /// `SET LOCAL ROLE` to this for the writes into record tables.
    pub role: Option<String>,
}

/// Files `upload` from replica `sender` (the one the transport authenticated).
pub async fn file(
    pool: &PgPool,
    records: &[RecordSpec],
    shape: &Shape,
    sender: Uuid,
    upload: &Upload,
) -> Result<Outcome, FileError> {
    // Every part must name a table the replicas write, with its key: checked before any
    // statement, so a malformed upload costs no transaction.
    if i64::try_from(upload.id).is_err() {
        return Ok(Outcome::Malformed(format!(
            "the upload id {} is above {}: ids are a clock in microseconds, far below it",
            upload.id,
            i64::MAX
        )));
    }
    let mut plans = Vec::with_capacity(upload.parts.len());
    for part in &upload.parts {
        match plan(records, part) {
            Ok(mut plan) => {
                plan.restated = upload.restated && plan.spec.restate;
                plans.push(plan)
            }
            Err(message) => return Ok(Outcome::Malformed(message)),
        }
    }
    // The one-statement way first, where it applies; then the quick way: each part one
    // statement, no savepoints. A part the database refuses aborts that transaction; the
    // careful way then files the upload again from the start, a savepoint per part and,
    // in a part refused, per row.
    if shape.role.is_none()
        && plans.iter().all(|p| p.spec.two_way.is_none())
        && upload.parts.iter().all(|p| p.deletes.is_empty())
    {
        match at_once(pool, sender, upload, &plans).await {
            Ok(Some(outcome)) => return Ok(outcome),
            Ok(None) | Err(Failed::Refused) => {}
            Err(Failed::File(e)) => return Err(e),
        }
    }
    match attempt(pool, shape, sender, upload, &plans, false).await {
        Err(Failed::Refused) => match attempt(pool, shape, sender, upload, &plans, true).await {
            Err(Failed::Refused) => unreachable!("the careful way takes refusals row by row"),
            Err(Failed::File(e)) => Err(e),
            Ok(outcome) => Ok(outcome),
        },
        Err(Failed::File(e)) => Err(e),
        Ok(outcome) => Ok(outcome),
    }
}

/// Why one attempt at filing ended without a commit.
enum Failed {
    /// The quick way met a refusal: file carefully.
    Refused,
    File(FileError),
}

impl From<sqlx::Error> for Failed {
    fn from(e: sqlx::Error) -> Failed {
        Failed::File(FileError::Db(e))
    }
}

/// Steps 1 to 4 in one statement (one round trip, one transaction of its own), for an
/// upload of record rows (no deletes, no two-way part) filed without a role.
///
/// Its first CTE, `s`, sets `ferry_sync.replica` for the session (every filing sets it
/// first, so a pooled connection never carries another's) and counts the sender's inbox.
/// Every other part of the statement reads `s` (`WHERE s.inbox = 0`), so no row is
/// counted or upserted, and no row-level security policy checks one, before the setting
/// is made: the order comes from the data, not from Postgres's choice of when to run a
/// CTE. `Ok(None)`: the inbox holds rows of this replica, and nothing was written; the
/// quick way clears them as it files.
async fn at_once(
    pool: &PgPool,
    sender: Uuid,
    upload: &Upload,
    plans: &[Plan<'_>],
) -> Result<Option<Outcome>, Failed> {
    let mut conn = pool.acquire().await?;
    let told = i64::try_from(upload.filed_n).unwrap_or(i64::MAX);
    let step = i64::from(!upload.parts.is_empty());
    let id = upload_id(upload);
    let mut refused = Vec::new();
    let mut parts = Vec::new();
    // The count moves only for an upload not older than the newest filed (`last_id`);
    // for an older one `f` is empty and the statement fails at its end (a division by
    // zero), so every part rolls back and the quick way answers it stale.
    let mut ctes = vec![
        "s AS MATERIALIZED (SELECT set_config('ferry_sync.replica', $1::text, false) AS v,
              (SELECT count(*) FROM ferry_sync.inbox WHERE replica = $1) AS inbox)"
            .to_string(),
        "f AS (INSERT INTO ferry_sync.filings AS f (replica, n, before, last_id)
              SELECT $1, greatest(0, $2) + $3, 0, $4 FROM s WHERE s.inbox = 0
              ON CONFLICT (replica) DO UPDATE SET before = f.n, n = greatest(f.n, $2) + $3, last_id = $4
              WHERE f.last_id <= $4
              RETURNING before, n)"
            .to_string(),
    ];
    let mut next = 5;
    for (part, plan) in upload.parts.iter().zip(plans) {
        let (rows, mut wrong) = sort_rows(plan, part, sender);
        refused.append(&mut wrong);
        if rows.is_empty() {
            continue;
        }
        let sql = upsert_sql_at(
            plan.spec,
            &plan.present,
            plan.restated,
            next,
            1,
            " CROSS JOIN s WHERE s.inbox = 0",
        );
        ctes.push(format!("p{} AS ({sql})", ctes.len()));
        next += plan.present.len();
        parts.push((plan, rows));
    }
    let sql = format!(
        "WITH {} SELECT before, n, 0::int8 FROM f
         UNION ALL SELECT 0, 0, inbox FROM s WHERE inbox > 0
         UNION ALL SELECT 0, 1 / (SELECT count(*) FROM f), 0
           WHERE NOT EXISTS (SELECT 1 FROM f) AND (SELECT inbox FROM s) = 0",
        ctes.join(
            ",
"
        )
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(sender)
        .bind(told)
        .bind(step)
        .bind(id);
    for (plan, rows) in &parts {
        for &i in &plan.present {
            let c = &plan.spec.columns[i];
            query = bind_column(query, c.mapping, rows.iter().map(|r| &r[i]));
        }
    }
    let row = match query.fetch_one(&mut *conn).await {
        Ok(row) => row,
        Err(e) if refused_by_data(&e) => return Err(Failed::Refused),
        Err(e) => return Err(e.into()),
    };
    if row.get::<i64, _>(2) > 0 {
        return Ok(None);
    }
    let (known, filed_n): (i64, i64) = (row.get(0), row.get(1));
    Ok(Some(Outcome::Filed(Filed {
        id: upload.id,
        filed_n: filed_n as u64,
        refile_after: if told > known { known as u64 } else { 0 },
        refused,
        dropped: Vec::new(),
        stale: None,
    })))
}

/// Steps 1 to 4 once; `careful`: savepoints, and rows the database refuses to the inbox.
async fn attempt(
    pool: &PgPool,
    shape: &Shape,
    sender: Uuid,
    upload: &Upload,
    plans: &[Plan<'_>],
    careful: bool,
) -> Result<Outcome, Failed> {
    let mut tx = pool.begin().await?;
    // Step 1 in one statement: lock the sender's count and take this filing's number
    // (`before` keeps the count it had, for the restore check), count its inbox, and set
    // what row-level security reads.
    let told = i64::try_from(upload.filed_n).unwrap_or(i64::MAX);
    let step = i64::from(!upload.parts.is_empty());
    let id = upload_id(upload);
    let row = sqlx::query(
        "WITH f AS (
            INSERT INTO ferry_sync.filings AS f (replica, n, before, last_id)
            VALUES ($1, greatest(0, $2) + $3, 0, $4)
            ON CONFLICT (replica) DO UPDATE SET before = f.n, n = greatest(f.n, $2) + $3, last_id = $4
            WHERE f.last_id <= $4
            RETURNING before, n)
         SELECT f.before, f.n, (SELECT count(*) FROM ferry_sync.inbox i WHERE i.replica = $1),
                set_config('ferry_sync.replica', $1::text, true)
         FROM f",
    )
    .bind(sender)
    .bind(told)
    .bind(step)
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(row) = row else {
        // An upload older than the newest filed (the conflict's row is locked, and was
        // not updated): nothing is filed and the count does not move.
        let (n, newest): (i64, i64) =
            sqlx::query_as("SELECT n, last_id FROM ferry_sync.filings WHERE replica = $1")
                .bind(sender)
                .fetch_one(&mut *tx)
                .await?;
        tx.rollback().await?;
        return Ok(Outcome::Filed(Filed {
            id: upload.id,
            filed_n: n as u64,
            refile_after: 0,
            refused: Vec::new(),
            dropped: Vec::new(),
            stale: Some(newest as u64),
        }));
    };
    let (known, filed_n, inbox): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    if inbox >= INBOX_ROWS_MAX {
        return Err(Failed::File(FileError::InboxFull(inbox)));
    }
    let refile_after = if told > known { known } else { 0 };
    // A two-way part's rows the sender holds, read before the host's role (which need
    // not read ferry-sync's tables); the others are dropped.
    let mut held = Vec::with_capacity(plans.len());
    for (part, plan) in upload.parts.iter().zip(plans) {
        held.push(match plan.spec.two_way {
            Some(_) => Some(holds(&mut tx, plan, sender, part).await?),
            None => None,
        });
    }
    if let Some(role) = &shape.role {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET LOCAL ROLE {}",
            quote_ident(role)
        )))
        .execute(&mut *tx)
        .await?;
    }
    let mut refused = Vec::new();
    let mut dropped = Vec::new();
    let mut refused_by_db = Vec::new();
    for ((part, plan), held) in upload.parts.iter().zip(plans).zip(held) {
        let (mut rows, mut wrong) = sort_rows(plan, part, sender);
        refused.append(&mut wrong);
        if let Some(held) = held {
            let key = |row: &Vec<Value>| value::key_text(&plan.key_of(row));
            let (keep, gone): (Vec<_>, Vec<_>) =
                rows.into_iter().partition(|row| held.contains(&key(row)));
            rows = keep;
            dropped.extend(gone.iter().map(|row| plan.dropped(row)));
        }
        if careful {
            file_part(
                &mut tx,
                plan,
                sender,
                &rows,
                &part.deletes,
                &mut refused_by_db,
                &mut dropped,
            )
            .await?;
            continue;
        }
        let done = if rows.is_empty() {
            Ok(())
        } else {
            write(&mut tx, plan, sender, &rows)
                .await
                .map(|missed| dropped.extend(missed.iter().map(|&i| plan.dropped(&rows[i]))))
        };
        let done = match (done, plan.spec.replica) {
            (Ok(()), Some(r)) if !part.deletes.is_empty() => {
                delete(&mut tx, plan.spec, r, sender, &part.deletes).await
            }
            (done, _) => done,
        };
        match done {
            Ok(()) => {}
            Err(e) if refused_by_data(&e) => return Err(Failed::Refused),
            Err(e) => return Err(e.into()),
        }
    }
    if shape.role.is_some() {
        sqlx::query("RESET ROLE").execute(&mut *tx).await?;
    }
    for (plan, row, reason) in &refused_by_db {
        to_inbox(&mut tx, sender, plan, row, reason).await?;
    }
    if inbox > 0 {
        clear_inbox(&mut tx, sender, upload, plans).await?;
    }
    tx.commit().await?;
    Ok(Outcome::Filed(Filed {
        stale: None,
        id: upload.id,
        filed_n: filed_n as u64,
        refile_after: refile_after as u64,
        refused,
        dropped,
    }))
}

/// The key texts among `part`'s upserts of rows the server records `sender` holding
/// (docs/sync.md §5.2): held by it, or broadcast to its partition and not quarantined.
async fn holds(
    conn: &mut PgConnection,
    plan: &Plan<'_>,
    sender: Uuid,
    part: &TablePart,
) -> Result<std::collections::HashSet<String>, sqlx::Error> {
    let keys: Vec<String> = part.upserts.iter().map(|u| plan.upsert_key(u)).collect();
    if keys.is_empty() {
        return Ok(Default::default());
    }
    let rows = sqlx::query(
        "SELECT k FROM unnest($3::text[]) AS k
         WHERE EXISTS (SELECT 1 FROM ferry_sync.held h
                       WHERE h.replica = $1 AND h.relation = $2 AND h.key = k)
            OR (EXISTS (SELECT 1 FROM ferry_sync.rows r JOIN ferry_sync.replicas p ON p.id = $1
                        WHERE r.shard = ferry_sync.shard_of(p.id, (SELECT shards FROM ferry_sync.meta))
                          AND r.relation = $2 AND r.part = coalesce(p.partition, '')
                          AND ($4::text IS NULL OR p.audience = $4)
                          AND r.key = k AND NOT r.gone)
                AND NOT EXISTS (SELECT 1 FROM ferry_sync.quarantine q
                                WHERE q.replica = $1 AND q.relation = $2 AND q.key = k))",
    )
    .bind(sender)
    .bind(&plan.spec.relation)
    .bind(&keys)
    .bind(
        plan.spec
            .two_way
            .as_ref()
            .and_then(|t| t.audience.as_deref()),
    )
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// A part matched to its record table: which spec column each of the part's columns is.
struct Plan<'a> {
    spec: &'a RecordSpec,
    /// For each spec column, its index in the part's columns, if the part has it.
    from_part: Vec<Option<usize>>,
    /// The spec columns filing writes: those the part has, and the `replica` column
    /// (which takes the sender). A column the part lacks keeps the table's default.
    present: Vec<usize>,
    /// Rows a replica states again (a restated upload of a table that is restated): they
    /// win whatever their version.
    restated: bool,
}

impl Plan<'_> {
    /// A spec-ordered row's key.
    fn key_of(&self, row: &[Value]) -> Vec<Value> {
        self.spec.key.iter().map(|&k| row[k].clone()).collect()
    }

    /// The key text of one of the part's upserts (in the part's column order).
    fn upsert_key(&self, upsert: &[Value]) -> String {
        let key: Vec<Value> = (self.spec.key.iter())
            .map(|&k| self.from_part[k].map_or(Value::Null, |i| upsert[i].clone()))
            .collect();
        value::key_text(&key)
    }

    /// A spec-ordered row of a two-way table, answered as dropped.
    fn dropped(&self, row: &[Value]) -> RefusedRow {
        RefusedRow {
            table: self.spec.name.clone(),
            key: self.key_of(row),
            reason: DROPPED.to_string(),
        }
    }
}

fn plan<'a>(records: &'a [RecordSpec], part: &TablePart) -> Result<Plan<'a>, String> {
    let spec = records.iter().find(|r| r.name == part.table).ok_or_else(|| {
        format!(
            "table {:?} is not a table this server files (its rules name no record or two-way table by that name); check that the replica and the server run the same rules",
            part.table
        )
    })?;
    let values = part.columns.iter().any(|c| c.key_part == 0);
    if spec.two_way.is_some() && !part.upserts.is_empty() && !values {
        return Err(format!(
            "the upload of two-way table {:?} carries no column the replica writes",
            part.table
        ));
    }
    if spec.two_way.is_some() && !part.deletes.is_empty() {
        return Err(format!(
            "the upload deletes {} rows of two-way table {:?}; a two-way table's rows are the server's to delete, and a replica sends only its columns' values",
            part.deletes.len(),
            part.table
        ));
    }
    let mut from_part = vec![None; spec.columns.len()];
    for (i, c) in part.columns.iter().enumerate() {
        let Some(s) = spec.columns.iter().position(|s| s.name == c.name) else {
            return Err(format!(
                "table {:?} has no column {:?} on the server; check that the replica and the server run the same rules",
                part.table, c.name
            ));
        };
        from_part[s] = Some(i);
    }
    for &k in &spec.key {
        if from_part[k].is_none() {
            return Err(format!(
                "the upload of table {:?} lacks key column {:?}",
                part.table, spec.columns[k].name
            ));
        }
    }
    let present = (0..spec.columns.len())
        .filter(|&i| from_part[i].is_some() || spec.replica == Some(i))
        .collect();
    Ok(Plan {
        spec,
        from_part,
        present,
        restated: false,
    })
}

/// The part's upserts as spec-ordered rows, less those refused for good (a value of the
/// wrong kind, a `replica` column naming another replica), which come back as refusals.
fn sort_rows(
    plan: &Plan<'_>,
    part: &TablePart,
    sender: Uuid,
) -> (Vec<Vec<Value>>, Vec<RefusedRow>) {
    let spec = plan.spec;
    let mut rows = Vec::with_capacity(part.upserts.len());
    let mut refused = Vec::new();
    let sender_text = sender.to_string();
    for upsert in &part.upserts {
        let row: Vec<Value> = plan
            .from_part
            .iter()
            .map(|i| i.map_or(Value::Null, |i| upsert[i].clone()))
            .collect();
        let key: Vec<Value> = spec.key.iter().map(|&k| row[k].clone()).collect();
        let wrong = spec.columns.iter().zip(&row).find_map(|(c, v)| {
            (!fits(c.mapping, v)).then(|| {
                format!(
                    "column {:?} holds {}, but the server's column is {}: the replica wrote a value of the wrong kind",
                    c.name,
                    kind(v),
                    c.pg_type
                )
            })
        });
        let other = spec.replica.and_then(|r| match &row[r] {
            Value::Text(t) if !t.eq_ignore_ascii_case(&sender_text) => Some(format!(
                "column {:?} names replica {t}, but this upload came from replica {sender}: a replica files only its own rows",
                spec.columns[r].name
            )),
            _ => None,
        });
        match wrong.or(other) {
            Some(reason) => refused.push(RefusedRow {
                table: spec.name.clone(),
                key,
                reason,
            }),
            None => rows.push(row),
        }
    }
    (rows, refused)
}

/// Whether a value of this kind can be filed into a column of this mapping (Null always
/// can; the database judges NOT NULL).
fn fits(mapping: Mapping, v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Int(_) => matches!(mapping, Mapping::Integer | Mapping::Bool | Mapping::Float),
        Value::Real(_) => mapping == Mapping::Float,
        Value::Blob(_) => mapping == Mapping::Bytea,
        Value::Text(_) => mapping.affinity() == Affinity::Text,
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Int(_) => "an integer",
        Value::Real(_) => "a real",
        Value::Text(_) => "text",
        Value::Blob(_) => "a blob",
    }
}

async fn shape_transaction(
    conn: &mut PgConnection,
    shape: &Shape,
    sender: Uuid,
) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT set_config('ferry_sync.replica', $1, true)")
        .bind(sender.to_string())
        .execute(&mut *conn)
        .await?;
    if let Some(role) = &shape.role {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET LOCAL ROLE {}",
            quote_ident(role)
        )))
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// One part: all its rows in one statement under a savepoint; if the database refuses
/// it, each row alone, and the rows it refuses are pushed to `refused` for the inbox.
async fn file_part<'a>(
    conn: &mut PgConnection,
    plan: &Plan<'a>,
    sender: Uuid,
    rows: &[Vec<Value>],
    deletes: &[Vec<Value>],
    refused: &mut Vec<(&'a RecordSpec, Vec<Value>, String)>,
    dropped: &mut Vec<RefusedRow>,
) -> Result<(), sqlx::Error> {
    let spec = plan.spec;
    if !rows.is_empty() {
        savepoint(conn).await?;
        let whole = write(conn, plan, sender, rows).await;
        match settle(conn, whole).await? {
            Ok(missed) => dropped.extend(missed.iter().map(|&i| plan.dropped(&rows[i]))),
            Err(e) => {
                tracing::debug!(
                    table = spec.relation,
                    error = e,
                    "filing: a part was refused; filing it row by row"
                );
                for row in rows {
                    savepoint(conn).await?;
                    let one = write(conn, plan, sender, std::slice::from_ref(row)).await;
                    match settle(conn, one).await? {
                        Ok(missed) if !missed.is_empty() => dropped.push(plan.dropped(row)),
                        Ok(_) => {}
                        Err(reason) => refused.push((spec, row.clone(), reason)),
                    }
                }
            }
        }
    }
    if let Some(r) = spec.replica
        && !deletes.is_empty()
    {
        // Deletes are the sender's own history; a delete the database refuses (a row
        // something points at) is logged, and the row stays.
        savepoint(conn).await?;
        let done = delete(conn, spec, r, sender, deletes).await;
        if let Err(e) = settle(conn, done).await? {
            tracing::warn!(
                table = spec.relation,
                error = e,
                "filing: deletes refused; the rows stay"
            );
        }
    }
    Ok(())
}

async fn savepoint(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SAVEPOINT ferry_sync_file")
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Ends the savepoint `work` ran under: `Ok(Err(reason))` when the database refused the
/// rows (rolled back to the savepoint), `Err` when the failure is transient (the whole
/// upload fails, and is sent again).
async fn settle<T>(
    conn: &mut PgConnection,
    work: Result<T, sqlx::Error>,
) -> Result<Result<T, String>, sqlx::Error> {
    match work {
        Ok(done) => {
            sqlx::query("RELEASE SAVEPOINT ferry_sync_file")
                .execute(&mut *conn)
                .await?;
            Ok(Ok(done))
        }
        Err(e) if refused_by_data(&e) => {
            sqlx::query("ROLLBACK TO SAVEPOINT ferry_sync_file")
                .execute(&mut *conn)
                .await?;
            Ok(Err(e.to_string()))
        }
        Err(e) => Err(e),
    }
}

/// The upload's id as Postgres stores it ([`file`] refuses one above `i64::MAX`).
fn upload_id(upload: &Upload) -> i64 {
    i64::try_from(upload.id).unwrap_or(i64::MAX)
}

/// Whether the database refused the rows themselves (a constraint, a trigger, a type, a
/// permission, a table or column missing), which a deploy may fix, rather than failing
/// for a reason a retry fixes (connection, serialization, resources, shutdown).
fn refused_by_data(e: &sqlx::Error) -> bool {
    let Some(db) = e.as_database_error() else {
        return false;
    };
    let code = db.code().unwrap_or_default();
    !["08", "40", "53", "55", "57", "58", "XX"]
        .iter()
        .any(|class| code.starts_with(class))
}

/// Writes `rows` (spec-ordered) into the table: a record table's are upserted; a
/// two-way table's replica columns are set on the rows of those keys. Returns the
/// indexes of the rows no table row took (a two-way row deleted since): dropped.
async fn write(
    conn: &mut PgConnection,
    plan: &Plan<'_>,
    sender: Uuid,
    rows: &[Vec<Value>],
) -> Result<Vec<usize>, sqlx::Error> {
    let spec = plan.spec;
    let two_way = spec.two_way.is_some();
    let sql = if two_way {
        update_sql(spec, &plan.present)
    } else {
        upsert_sql(spec, &plan.present, plan.restated)
    };
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for &i in &plan.present {
        let c = &spec.columns[i];
        query = bind_column(query, c.mapping, rows.iter().map(|r| &r[i]));
    }
    if !two_way {
        query.bind(sender).execute(&mut *conn).await?;
        return Ok(Vec::new());
    }
    let written: std::collections::HashSet<i64> = query
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok((0..rows.len())
        .filter(|&i| !written.contains(&(i as i64 + 1)))
        .collect())
}

/// `UPDATE … SET replica columns FROM unnest(arrays) WITH ORDINALITY … RETURNING` the
/// ordinal: one statement for every row of a two-way part; a key with no row is not
/// returned.
fn update_sql(spec: &RecordSpec, present: &[usize]) -> String {
    let n = present.len();
    let params: Vec<String> = present
        .iter()
        .enumerate()
        .map(|(p, &i)| format!("${}::{}[]", p + 1, bind_type(spec.columns[i].mapping)))
        .collect();
    let mut aliases: Vec<String> = (0..n).map(|p| format!("c{p}")).collect();
    aliases.push("i".into());
    let value = |p: usize, i: usize| cast(&spec.columns[i], &format!("u.c{p}"));
    let sets: Vec<String> = present
        .iter()
        .enumerate()
        .filter(|(_, i)| !spec.key.contains(i))
        .map(|(p, &i)| format!("{} = {}", quote_ident(&spec.columns[i].name), value(p, i)))
        .collect();
    let matches: Vec<String> = present
        .iter()
        .enumerate()
        .filter(|(_, i)| spec.key.contains(i))
        .map(|(p, &i)| format!("t.{} = {}", quote_ident(&spec.columns[i].name), value(p, i)))
        .collect();
    format!(
        "UPDATE {} AS t SET {} FROM unnest({}) WITH ORDINALITY AS u({}) WHERE {} RETURNING u.i",
        spec.quoted,
        sets.join(", "),
        params.join(", "),
        aliases.join(", "),
        matches.join(" AND ")
    )
}

/// Deletes the sender's rows of `keys` (only where `replica`, its column, names it).
async fn delete(
    conn: &mut PgConnection,
    spec: &RecordSpec,
    replica: usize,
    sender: Uuid,
    keys: &[Vec<Value>],
) -> Result<(), sqlx::Error> {
    let columns: Vec<&FileColumn> = spec.key.iter().map(|&k| &spec.columns[k]).collect();
    let params: Vec<String> = columns
        .iter()
        .enumerate()
        .map(|(i, c)| format!("${}::{}[]", i + 1, bind_type(c.mapping)))
        .collect();
    let names: Vec<String> = columns.iter().map(|c| quote_ident(&c.name)).collect();
    let casts: Vec<String> = columns
        .iter()
        .enumerate()
        .map(|(i, c)| cast(c, &format!("u.c{i}")))
        .collect();
    let aliases: Vec<String> = (0..columns.len()).map(|i| format!("c{i}")).collect();
    let sql = format!(
        "DELETE FROM {} WHERE ({}) IN (SELECT {} FROM unnest({}) AS u({})) AND {} = ${}::uuid",
        spec.quoted,
        names.join(", "),
        casts.join(", "),
        params.join(", "),
        aliases.join(", "),
        quote_ident(&spec.columns[replica].name),
        columns.len() + 1
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for (i, c) in columns.iter().enumerate() {
        query = bind_column(query, c.mapping, keys.iter().map(|key| &key[i]));
    }
    query.bind(sender).execute(&mut *conn).await?;
    Ok(())
}

/// `INSERT … SELECT casts FROM unnest(arrays) ON CONFLICT (key) …`: one statement for
/// every row of a part. The replica column takes the sender (the last parameter).
/// `restated`: a newer version does not need to be newer.
fn upsert_sql(spec: &RecordSpec, present: &[usize], restated: bool) -> String {
    upsert_sql_at(spec, present, restated, 1, present.len() + 1, "")
}

/// [`upsert_sql`] with the arrays bound from parameter `first` on and the sender at
/// `sender`, to sit among other statements' parameters.
fn upsert_sql_at(
    spec: &RecordSpec,
    present: &[usize],
    restated: bool,
    first: usize,
    sender: usize,
    gate: &str,
) -> String {
    let n = present.len();
    let names: Vec<String> = present
        .iter()
        .map(|&i| quote_ident(&spec.columns[i].name))
        .collect();
    let params: Vec<String> = present
        .iter()
        .enumerate()
        .map(|(p, &i)| format!("${}::{}[]", first + p, bind_type(spec.columns[i].mapping)))
        .collect();
    let aliases: Vec<String> = (0..n).map(|p| format!("c{p}")).collect();
    let values: Vec<String> = present
        .iter()
        .enumerate()
        .map(|(p, &i)| {
            if spec.replica == Some(i) {
                format!("${sender}::uuid")
            } else {
                cast(&spec.columns[i], &format!("u.c{p}"))
            }
        })
        .collect();
    let key: Vec<String> = spec
        .key
        .iter()
        .map(|&k| quote_ident(&spec.columns[k].name))
        .collect();
    let on_conflict = match spec.version {
        // Without a version the column may be absent from the part: then nothing wins.
        Some(v) if present.contains(&v) => {
            let sets: Vec<String> = present
                .iter()
                .filter(|i| !spec.key.contains(i))
                .map(|&i| {
                    let c = quote_ident(&spec.columns[i].name);
                    format!("{c} = EXCLUDED.{c}")
                })
                .collect();
            let version = quote_ident(&spec.columns[v].name);
            let newer = if restated {
                String::new()
            } else {
                format!(" WHERE {}.{version} < EXCLUDED.{version}", spec.quoted)
            };
            format!("DO UPDATE SET {}{newer}", sets.join(", "))
        }
        _ => "DO NOTHING".to_string(),
    };
    format!(
        "INSERT INTO {} ({}) SELECT {} FROM unnest({}) AS u({}){gate} ON CONFLICT ({}) {}",
        spec.quoted,
        names.join(", "),
        values.join(", "),
        params.join(", "),
        aliases.join(", "),
        key.join(", "),
        on_conflict
    )
}

/// The array type a column's values are bound as.
fn bind_type(mapping: Mapping) -> &'static str {
    match mapping {
        Mapping::Integer | Mapping::Bool => "int8",
        Mapping::Float => "float8",
        Mapping::Bytea => "bytea",
        _ => "text",
    }
}

/// The expression that turns a bound value (`param`) into the column's type: the
/// reverse of the select expressions of docs/sync.md §3.1.
fn cast(c: &FileColumn, param: &str) -> String {
    let ty = &c.pg_type;
    match c.mapping {
        Mapping::Bool => format!("({param} <> 0)::{ty}"),
        // A JSON array back into a Postgres array: its elements as text, cast with it.
        Mapping::Array => format!(
            "(CASE WHEN {param} IS NULL THEN NULL ELSE coalesce((SELECT array_agg(e) FROM json_array_elements_text({param}::json) e), '{{}}') END)::{ty}"
        ),
        _ => format!("{param}::{ty}"),
    }
}

fn bind_column<'q, 'v>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    mapping: Mapping,
    values: impl Iterator<Item = &'v Value>,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    match bind_type(mapping) {
        "int8" => query.bind(
            values
                .map(|v| match v {
                    Value::Int(i) => Some(*i),
                    _ => None,
                })
                .collect::<Vec<_>>(),
        ),
        "float8" => query.bind(
            values
                .map(|v| match v {
                    Value::Int(i) => Some(*i as f64),
                    Value::Real(r) => Some(*r),
                    _ => None,
                })
                .collect::<Vec<_>>(),
        ),
        "bytea" => query.bind(
            values
                .map(|v| match v {
                    Value::Blob(b) => Some(b.clone()),
                    _ => None,
                })
                .collect::<Vec<_>>(),
        ),
        _ => query.bind(
            values
                .map(|v| match v {
                    Value::Text(t) => Some(t.clone()),
                    _ => None,
                })
                .collect::<Vec<_>>(),
        ),
    }
}

/// Keeps a row the database refused, newest per key, to be filed again later.
async fn to_inbox(
    conn: &mut PgConnection,
    sender: Uuid,
    spec: &RecordSpec,
    row: &[Value],
    reason: &str,
) -> Result<(), sqlx::Error> {
    let key: Vec<Value> = spec.key.iter().map(|&k| row[k].clone()).collect();
    // The inbox keeps the row as it came, a Null where the database wants none included
    // (that may be why it was refused): no column is declared not-null here.
    let columns = spec
        .wire_columns()
        .into_iter()
        .map(|mut c| {
            c.not_null = c.key_part > 0;
            c
        })
        .collect();
    let part = TablePart {
        table: spec.name.clone(),
        columns,
        sweep: wire::Sweep::default(),
        deletes: Vec::new(),
        upserts: vec![row.to_vec()],
        writes: None,
    };
    let body = wire::encode_body(&[part]).unwrap_or_default();
    sqlx::query(
        "INSERT INTO ferry_sync.inbox (replica, relation, key, row, reason) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (replica, relation, key) DO UPDATE
         SET row = excluded.row, reason = excluded.reason, tries = ferry_sync.inbox.tries + 1, at = now()",
    )
    .bind(sender)
    .bind(&spec.relation)
    .bind(value::key_text(&key))
    .bind(body)
    .bind(reason)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// A newer send of a row the inbox holds replaces it: filed now, or back in the inbox
/// with the newer content (written after this, in the same transaction).
async fn clear_inbox(
    conn: &mut PgConnection,
    sender: Uuid,
    upload: &Upload,
    plans: &[Plan<'_>],
) -> Result<(), sqlx::Error> {
    let mut relations = Vec::new();
    let mut keys = Vec::new();
    for (part, plan) in upload.parts.iter().zip(plans) {
        for upsert in &part.upserts {
            relations.push(plan.spec.relation.clone());
            keys.push(plan.upsert_key(upsert));
        }
    }
    sqlx::query(
        "DELETE FROM ferry_sync.inbox i USING unnest($2::text[], $3::text[]) AS u(relation, key)
         WHERE i.replica = $1 AND i.relation = u.relation AND i.key = u.key AND i.at < now()",
    )
    .bind(sender)
    .bind(&relations)
    .bind(&keys)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// What one refiling of the inbox did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Refiled {
    pub filed: u64,
    pub still_refused: u64,
}

/// Files the inbox again (docs/sync-up.md §5.2): each row in a transaction of its own,
/// shaped as its replica's filing was; filed rows leave the inbox, refused ones keep
/// their newest reason and count a try. The relay runs this at start and on its retry
/// timer, `ferry sync refile` at once. A row of a table the rules no longer file waits.
pub async fn refile(
    conn: &mut PgConnection,
    records: &[RecordSpec],
    shape: &Shape,
) -> Result<Refiled, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT replica, relation, key, row FROM ferry_sync.inbox ORDER BY at LIMIT $1",
    )
    .bind(INBOX_ROWS_MAX)
    .fetch_all(&mut *conn)
    .await?;
    let mut done = Refiled::default();
    for row in rows {
        let (replica, relation, key, body): (Uuid, String, String, Vec<u8>) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let Some(spec) = records.iter().find(|r| r.relation == relation) else {
            continue;
        };
        let Some(part) = wire::decode_body(&body).ok().and_then(|mut p| p.pop()) else {
            continue;
        };
        let Ok(plan) = plan(std::slice::from_ref(spec), &part) else {
            continue;
        };
        let (mut rows, _) = sort_rows(&plan, &part, replica);
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        if spec.two_way.is_some() {
            // A two-way row the replica no longer holds is dropped: it leaves the inbox.
            let held = holds(&mut tx, &plan, replica, &part).await?;
            rows.retain(|row| held.contains(&value::key_text(&plan.key_of(row))));
        }
        shape_transaction(&mut tx, shape, replica).await?;
        savepoint(&mut tx).await?;
        let attempt = write(&mut tx, &plan, replica, &rows).await;
        let outcome = settle(&mut tx, attempt).await?;
        if shape.role.is_some() {
            sqlx::query("RESET ROLE").execute(&mut *tx).await?;
        }
        match outcome {
            Ok(_) => {
                sqlx::query(
                    "DELETE FROM ferry_sync.inbox WHERE replica = $1 AND relation = $2 AND key = $3",
                )
                .bind(replica)
                .bind(&relation)
                .bind(&key)
                .execute(&mut *tx)
                .await?;
                done.filed += 1;
            }
            Err(reason) => {
                sqlx::query(
                    "UPDATE ferry_sync.inbox SET reason = $4, tries = tries + 1
                     WHERE replica = $1 AND relation = $2 AND key = $3",
                )
                .bind(replica)
                .bind(&relation)
                .bind(&key)
                .bind(&reason)
                .execute(&mut *tx)
                .await?;
                done.still_refused += 1;
            }
        }
        tx.commit().await?;
    }
    Ok(done)
}
