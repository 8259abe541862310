//! Filing (docs/sync-up.md §5): an upload from a replica, written into the server's
//! record tables in one transaction, and the `Filed` that answers it.
//!
//! 1. Lock the sender's row of `ferry_sync.filings` (its filing count). An upload whose
//!    count is above it shows the server lost filings (restored, or reinstalled): the
//!    answer asks for the journal after the server's count, which becomes the upload's.
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
}

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
    /// its writes (docs/sync-up.md §4.1).
    pub fn announce(&self) -> TablePart {
        TablePart {
            table: self.name.clone(),
            columns: self.wire_columns(),
            sweep: wire::Sweep::default(),
            deletes: Vec::new(),
            upserts: Vec::new(),
            writes: Some(self.lane.clone()),
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
    let mut plans = Vec::with_capacity(upload.parts.len());
    for part in &upload.parts {
        match plan(records, part) {
            Ok(plan) => plans.push(plan),
            Err(message) => return Ok(Outcome::Malformed(message)),
        }
    }
    // The quick way first: each part one statement, no savepoints. A part the database
    // refuses aborts that transaction; the careful way then files the upload again from
    // the start, a savepoint per part and, in a part refused, per row.
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
    let row = sqlx::query(
        "WITH f AS (
            INSERT INTO ferry_sync.filings AS f (replica, n, before) VALUES ($1, greatest(0, $2) + $3, 0)
            ON CONFLICT (replica) DO UPDATE SET before = f.n, n = greatest(f.n, $2) + $3
            RETURNING before, n)
         SELECT f.before, f.n, (SELECT count(*) FROM ferry_sync.inbox i WHERE i.replica = $1),
                set_config('ferry_sync.replica', $1::text, true)
         FROM f",
    )
    .bind(sender)
    .bind(told)
    .bind(step)
    .fetch_one(&mut *tx)
    .await?;
    let (known, filed_n, inbox): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    if inbox >= INBOX_ROWS_MAX {
        return Err(Failed::File(FileError::InboxFull(inbox)));
    }
    let refile_after = if told > known { known } else { 0 };
    if let Some(role) = &shape.role {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SET LOCAL ROLE {}",
            quote_ident(role)
        )))
        .execute(&mut *tx)
        .await?;
    }
    let mut refused = Vec::new();
    let mut refused_by_db = Vec::new();
    for (part, plan) in upload.parts.iter().zip(plans) {
        let (rows, mut wrong) = sort_rows(plan, part, sender);
        refused.append(&mut wrong);
        if careful {
            file_part(
                &mut tx,
                plan,
                sender,
                &rows,
                &part.deletes,
                &mut refused_by_db,
            )
            .await?;
            continue;
        }
        let done = if rows.is_empty() {
            Ok(())
        } else {
            upsert(&mut tx, plan, sender, &rows).await
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
        id: upload.id,
        filed_n: filed_n as u64,
        refile_after: refile_after as u64,
        refused,
    }))
}

/// A part matched to its record table: which spec column each of the part's columns is.
struct Plan<'a> {
    spec: &'a RecordSpec,
    /// For each spec column, its index in the part's columns, if the part has it.
    from_part: Vec<Option<usize>>,
    /// The spec columns filing writes: those the part has, and the `replica` column
    /// (which takes the sender). A column the part lacks keeps the table's default.
    present: Vec<usize>,
}

fn plan<'a>(records: &'a [RecordSpec], part: &TablePart) -> Result<Plan<'a>, String> {
    let spec = records.iter().find(|r| r.name == part.table).ok_or_else(|| {
        format!(
            "table {:?} is not a table this server files (its rules name no record table by that name); check that the replica and the server run the same rules",
            part.table
        )
    })?;
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
) -> Result<(), sqlx::Error> {
    let spec = plan.spec;
    if !rows.is_empty() {
        savepoint(conn).await?;
        let whole = upsert(conn, plan, sender, rows).await;
        if let Err(e) = settle(conn, whole).await? {
            tracing::debug!(
                table = spec.relation,
                error = e,
                "filing: a part was refused; filing it row by row"
            );
            for row in rows {
                savepoint(conn).await?;
                let one = upsert(conn, plan, sender, std::slice::from_ref(row)).await;
                if let Err(reason) = settle(conn, one).await? {
                    refused.push((spec, row.clone(), reason));
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
async fn settle(
    conn: &mut PgConnection,
    work: Result<(), sqlx::Error>,
) -> Result<Result<(), String>, sqlx::Error> {
    match work {
        Ok(()) => {
            sqlx::query("RELEASE SAVEPOINT ferry_sync_file")
                .execute(&mut *conn)
                .await?;
            Ok(Ok(()))
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

async fn upsert(
    conn: &mut PgConnection,
    plan: &Plan<'_>,
    sender: Uuid,
    rows: &[Vec<Value>],
) -> Result<(), sqlx::Error> {
    let spec = plan.spec;
    let sql = upsert_sql(spec, &plan.present);
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    for &i in &plan.present {
        let c = &spec.columns[i];
        query = bind_column(query, c.mapping, rows.iter().map(|r| &r[i]));
    }
    query.bind(sender).execute(&mut *conn).await?;
    Ok(())
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
fn upsert_sql(spec: &RecordSpec, present: &[usize]) -> String {
    let n = present.len();
    let names: Vec<String> = present
        .iter()
        .map(|&i| quote_ident(&spec.columns[i].name))
        .collect();
    let params: Vec<String> = present
        .iter()
        .enumerate()
        .map(|(p, &i)| format!("${}::{}[]", p + 1, bind_type(spec.columns[i].mapping)))
        .collect();
    let aliases: Vec<String> = (0..n).map(|p| format!("c{p}")).collect();
    let values: Vec<String> = present
        .iter()
        .enumerate()
        .map(|(p, &i)| {
            if spec.replica == Some(i) {
                format!("${}::uuid", n + 1)
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
            format!(
                "DO UPDATE SET {} WHERE {}.{version} < EXCLUDED.{version}",
                sets.join(", "),
                spec.quoted,
            )
        }
        _ => "DO NOTHING".to_string(),
    };
    format!(
        "INSERT INTO {} ({}) SELECT {} FROM unnest({}) AS u({}) ON CONFLICT ({}) {}",
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
            let key: Vec<Value> = plan
                .spec
                .key
                .iter()
                .map(|&k| plan.from_part[k].map_or(Value::Null, |i| upsert[i].clone()))
                .collect();
            relations.push(plan.spec.relation.clone());
            keys.push(value::key_text(&key));
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
        let (rows, _) = sort_rows(&plan, &part, replica);
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        shape_transaction(&mut tx, shape, replica).await?;
        savepoint(&mut tx).await?;
        let attempt = upsert(&mut tx, &plan, replica, &rows).await;
        let outcome = settle(&mut tx, attempt).await?;
        if shape.role.is_some() {
            sqlx::query("RESET ROLE").execute(&mut *tx).await?;
        }
        match outcome {
            Ok(()) => {
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
