//! The `ferry_sync` schema and the capture triggers and indexes the rules call for:
//! `check` compares them with the database, `install` makes the database match, `verify`
//! refuses to serve until it does. [`ddl`] derives the statements (pure).
//!
//! `install`, in one transaction (a failure installs nothing):
//! 1. Take `pg_advisory_xact_lock(INSTALL_LOCK_KEY)`: one installer at a time; a second
//!    waits, then finds the first one's work done.
//! 2. Read the schema's state: absent; ferry-sync's, version 1; newer (left alone, with
//!    an error); or a `ferry_sync` schema without a meta row (not ours: an error).
//! 3. Load the catalog ([`crate::catalog`]), which refuses rules the database does not
//!    fit, and derive the statements.
//! 4. Compare each with the database (installed, missing, different) and find what
//!    ferry-sync installed earlier that the rules no longer call for (left over:
//!    triggers named `ferry_sync_%`, trigger functions in `ferry_sync`, indexes named
//!    `ferry_sync_%`).
//! 5. Create the schema if absent, with its meta row: a new epoch (a random uuid) and a
//!    32-byte secret from the operating system's random source.
//! 6. Run each statement that is missing or different; drop what is left over.
//! 7. For each table whose note trigger was missing (mirrored for the first time, or
//!    again), note kind `table`, so the relay sends it whole.
//! 8. Commit. `meta.declared` now holds the rules' digest.
//!
//! What is persisted: the schema, the functions, triggers and indexes, the meta row and
//! the `table` notes, all or none (the transaction).
//!
//! Indexes are built inside the transaction, which blocks writes to their table while
//! they build. For a large table, build an index leading with the same columns
//! beforehand (`CREATE INDEX CONCURRENTLY`, any name): ferry-sync then creates none.

pub mod ddl;

pub use ddl::{Object, SERVER_V1, Statement, VERSION, ddl};

use crate::catalog::error::Doing;
use crate::catalog::{Catalog, CheckError};
use crate::rules::{Relation, Rules, quote_ident};
use serde::Serialize;
use sqlx::{Connection, PgConnection, PgPool};
use std::collections::BTreeSet;
use std::fmt;

/// The advisory lock `install` holds for its transaction: "FERRYSNC" in ASCII.
pub const INSTALL_LOCK_KEY: i64 = 0x4645_5252_5953_4E43;

/// Whether one statement's object is in the database as the rules need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Installed,
    Missing,
    Different,
    /// Installed for rules that no longer call for it; `install` drops it.
    LeftOver,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Installed => "installed",
            State::Missing => "missing",
            State::Different => "different from what the rules need",
            State::LeftOver => "left over from earlier rules",
        }
    }
}

/// One statement and its state.
#[derive(Clone, Debug, Serialize)]
pub struct Item {
    pub what: String,
    pub sql: String,
    pub state: State,
    #[serde(skip)]
    pub object: Option<Object>,
}

/// What `check` found (and `install` found before installing).
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The rules' digest.
    pub digest: String,
    /// In install order; left-over objects last.
    pub items: Vec<Item>,
}

impl Report {
    /// Whether everything is installed and nothing is left over.
    pub fn is_installed(&self) -> bool {
        self.items.iter().all(|i| i.state == State::Installed)
    }

    /// The items that are not installed as the rules need.
    pub fn pending(&self) -> impl Iterator<Item = &Item> {
        self.items.iter().filter(|i| i.state != State::Installed)
    }

    fn count(&self, state: State) -> usize {
        self.items.iter().filter(|i| i.state == state).count()
    }
}

impl fmt::Display for Report {
    /// A summary, then each statement to run with its SQL.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_installed() {
            return writeln!(
                f,
                "ferry-sync is installed as the rules say ({} statements; rules digest {}).",
                self.items.len(),
                self.digest
            );
        }
        writeln!(
            f,
            "ferry-sync: {} statements: {} installed, {} missing, {} different, {} left over (rules digest {}).",
            self.items.len(),
            self.count(State::Installed),
            self.count(State::Missing),
            self.count(State::Different),
            self.count(State::LeftOver),
            self.digest
        )?;
        writeln!(f, "`ferry sync install` would run:")?;
        for item in self.pending() {
            writeln!(
                f,
                "\n-- {}: {}\n{}",
                item.state.as_str(),
                item.what,
                item.sql
            )?;
        }
        Ok(())
    }
}

/// Compares the database with what `rules` need. Reads only.
pub async fn check(conn: &mut PgConnection, rules: &Rules) -> Result<Report, CheckError> {
    let schema = schema_state(conn).await?;
    if schema.is_some() || !rules.has_settings() {
        let catalog = Catalog::load(conn, rules).await?;
        return compare(conn, rules, &catalog, &schema).await;
    }
    // The wishes table the rules mirror is the schema's own: read the catalog with the
    // schema created in a transaction that is rolled back.
    let doing = || "checking ferry-sync".to_string();
    let mut tx = sqlx::Connection::begin(&mut *conn).await.doing(doing)?;
    create_schema(&mut tx).await?;
    let catalog = Catalog::load(&mut tx, rules).await?;
    let report = compare(&mut tx, rules, &catalog, &schema).await;
    tx.rollback().await.doing(doing)?;
    report
}

/// Makes the database match `rules`, in one transaction; returns what it found before.
pub async fn install(pool: &PgPool, rules: &Rules) -> Result<Report, CheckError> {
    let doing = || "installing ferry-sync".to_string();
    let mut conn = pool.acquire().await.doing(doing)?;
    let mut tx = conn.begin().await.doing(doing)?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(INSTALL_LOCK_KEY)
        .execute(&mut *tx)
        .await
        .doing(|| "waiting for the install lock".into())?;
    // `DROP TRIGGER IF EXISTS` on a first install says "does not exist, skipping" once
    // per table; that is expected, not news for the person installing.
    sqlx::query("SET LOCAL client_min_messages = warning")
        .execute(&mut *tx)
        .await
        .doing(doing)?;
    let schema = schema_state(&mut tx).await?;
    if schema.is_none() {
        // First, so the catalog can read the schema's wishes table when the rules
        // mirror it; `compare` still sees the schema as missing.
        create_schema(&mut tx).await?;
    }
    let catalog = Catalog::load(&mut tx, rules).await?;
    let report = compare(&mut tx, rules, &catalog, &schema).await?;
    let (entries_before, shards_before): (Vec<String>, i32) = match schema {
        Some(_) => sqlx::query_as("SELECT entries, shards FROM ferry_sync.meta")
            .fetch_optional(&mut *tx)
            .await
            .doing(doing)?
            .unwrap_or_default(),
        None => (Vec::new(), 1),
    };
    for item in report.pending() {
        if matches!(item.object, Some(Object::Schema)) {
            continue;
        }
        let sql = match &item.object {
            // An index of this name that is not the one needed is rebuilt.
            Some(Object::Index { table, name, .. }) if item.state == State::Different => {
                format!(
                    "DROP INDEX IF EXISTS {}.{};\n{}",
                    quote_ident(&table.schema),
                    quote_ident(name),
                    item.sql
                )
            }
            _ => item.sql.clone(),
        };
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&mut *tx)
            .await
            .doing(|| format!("installing {}", item.what))?;
    }
    for item in report.pending() {
        if let Some(Object::Declared { .. }) = &item.object
            && schema.is_some()
            && (!rules.records.is_empty() || rules.tables.iter().any(|t| t.two_way.is_some()))
        {
            // The rules changed: replicas hear again which tables (and columns) they
            // write, so a record table or column added reaches them without provisioning
            // (docs/sync-up.md §4.1).
            sqlx::query(
                "INSERT INTO ferry_sync.notes (relation, key, kind) VALUES ('', '', 'announce')",
            )
            .execute(&mut *tx)
            .await
            .doing(|| "noting that the tables replicas write are to be announced".to_string())?;
        }
        if let Some(Object::Trigger {
            table,
            notes_table: true,
            ..
        }) = &item.object
            && item.state == State::Missing
        {
            sqlx::query(
                "INSERT INTO ferry_sync.notes (relation, key, kind) VALUES ($1, '', 'table')",
            )
            .bind(table.to_string())
            .execute(&mut *tx)
            .await
            .doing(|| format!("noting that {table} is to be sent whole"))?;
        }
    }
    // An entry new to a table already mirrored (an audience added, or an entry renamed
    // by one) has no held state yet: its rows are sent whole, as a new table's are. A
    // table whose trigger was missing was noted whole above, every entry of it.
    let noted_whole: Vec<&Relation> = report
        .pending()
        .filter_map(|item| match &item.object {
            Some(Object::Trigger {
                table,
                notes_table: true,
                ..
            }) if item.state == State::Missing => Some(table),
            _ => None,
        })
        .collect();
    let entries: Vec<String> = rules.tables.iter().map(|t| t.entry()).collect();
    if schema.is_some() {
        for t in &rules.tables {
            let entry = t.entry();
            if entries_before.contains(&entry) || noted_whole.contains(&&t.relation) {
                continue;
            }
            sqlx::query(
                "INSERT INTO ferry_sync.notes (relation, key, kind) VALUES ($1, '', 'table')",
            )
            .bind(&entry)
            .execute(&mut *tx)
            .await
            .doing(|| format!("noting that {entry} is to be sent whole"))?;
        }
    }
    if schema.is_some() {
        // Entries the rules no longer name leave no state behind. One whose table is
        // still mirrored, by other entries (a table split into audiences, or merged back),
        // held rows the new entries' replicas may not be owed: every replica starts again.
        let removed: Vec<&String> = entries_before
            .iter()
            .filter(|e| !entries.contains(e))
            .collect();
        forget(&mut tx, &removed).await?;
        let reshaped = removed.iter().any(|e| {
            let table = e.split_once('@').map_or(e.as_str(), |(t, _)| t);
            rules.tables.iter().any(|t| t.relation.to_string() == table)
        });
        if shards_before != rules.shards as i32 {
            reshard(&mut tx, rules).await?;
        } else if reshaped {
            provision_all(&mut tx).await?;
        }
    }
    sqlx::query("UPDATE ferry_sync.meta SET entries = $1")
        .bind(&entries)
        .execute(&mut *tx)
        .await
        .doing(|| "recording the entries the rules mirror".to_string())?;
    tx.commit().await.doing(doing)?;
    Ok(report)
}

/// The number of relay shards changed (docs/sync-scale.md §2): replicas belong to other
/// shards now, and a shard's broadcast versions (`rows`) cover only what it planned. So
/// every shard's state starts again, as after a restore: versions are rebuilt from a
/// whole-table note per mirrored table (copied for every shard), and every replica is
/// provisioned again by the shard it now belongs to. Notes for shards that are gone go.
async fn reshard(tx: &mut PgConnection, rules: &Rules) -> Result<(), CheckError> {
    let doing = || format!("spreading the replicas over {} relay shards", rules.shards);
    let tables: Vec<String> = rules
        .tables
        .iter()
        .map(|t| t.relation.to_string())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    // Every shard starts from shard 0's versions (each shard plans every note, so its
    // copy is as complete as any): two-way filing, which reads them, keeps working while
    // the whole-table notes rebuild them.
    for sql in [
        "DELETE FROM ferry_sync.notes WHERE shard >= $1",
        "DELETE FROM ferry_sync.rows WHERE shard <> 0",
        "INSERT INTO ferry_sync.rows (shard, relation, part, key, rv, gone)
         SELECT s, relation, part, key, rv, gone FROM ferry_sync.rows, generate_series(1, $1 - 1) AS s
         WHERE shard = 0",
    ] {
        sqlx::query(sql)
            .bind(rules.shards as i32)
            .execute(&mut *tx)
            .await
            .doing(doing)?;
    }
    sqlx::query(
        "INSERT INTO ferry_sync.notes (relation, key, kind) SELECT t, '', 'table' FROM unnest($1::text[]) AS t",
    )
    .bind(&tables)
    .execute(&mut *tx)
    .await
    .doing(doing)?;
    provision_all(tx).await
}

/// Every replica starts again: no mark, provisioned from nothing by the relay (a
/// `replica` note has running relays look), which rebuilds its held state. Until then
/// the held state stays, so two-way filing keeps finding the rows a replica holds.
async fn provision_all(tx: &mut PgConnection) -> Result<(), CheckError> {
    for sql in [
        "UPDATE ferry_sync.replicas SET standing = 'new', confirmed_pass = 0 WHERE standing <> 'retired'",
        "INSERT INTO ferry_sync.notes (relation, key, kind) VALUES ('', '', 'replica')",
    ] {
        sqlx::query(sql)
            .execute(&mut *tx)
            .await
            .doing(|| "provisioning every replica again".to_string())?;
    }
    Ok(())
}

/// Deletes the server's state of entries the rules no longer name (docs/sync-scale.md §1).
async fn forget(tx: &mut PgConnection, entries: &[&String]) -> Result<(), CheckError> {
    if entries.is_empty() {
        return Ok(());
    }
    for sql in [
        "DELETE FROM ferry_sync.rows WHERE relation = ANY($1)",
        "DELETE FROM ferry_sync.held WHERE relation = ANY($1)",
        "DELETE FROM ferry_sync.points WHERE relation = ANY($1) OR child_relation = ANY($1)",
        "DELETE FROM ferry_sync.quarantine WHERE relation = ANY($1)",
    ] {
        sqlx::query(sql)
            .bind(entries)
            .execute(&mut *tx)
            .await
            .doing(|| "forgetting the tables the rules no longer mirror".to_string())?;
    }
    Ok(())
}

/// What the relay runs at start: refuses (permanently) while anything differs from
/// what `rules` need, naming the first difference.
pub async fn verify(conn: &mut PgConnection, rules: &Rules) -> Result<(), CheckError> {
    let report = check(conn, rules).await?;
    match report.pending().next() {
        None => Ok(()),
        Some(item) => Err(CheckError::NotInstalled {
            what: item.what.clone(),
            state: item.state.as_str(),
            rules: rules.path.display().to_string(),
        }),
    }
}

/// The installed schema version, or `None` when there is no `ferry_sync` schema. A
/// newer version or a schema that is not ferry-sync's is an error.
async fn schema_state(conn: &mut PgConnection) -> Result<Option<i32>, CheckError> {
    let doing = || "reading the ferry_sync schema's version".to_string();
    let (schema, meta): (bool, bool) = sqlx::query_as(
        "SELECT to_regnamespace('ferry_sync') IS NOT NULL, to_regclass('ferry_sync.meta') IS NOT NULL",
    )
    .fetch_one(&mut *conn)
    .await
    .doing(doing)?;
    if !schema {
        return Ok(None);
    }
    if !meta {
        return Err(CheckError::ForeignSchema);
    }
    let version: Option<i32> = sqlx::query_scalar("SELECT version FROM ferry_sync.meta")
        .fetch_optional(&mut *conn)
        .await
        .doing(doing)?;
    match version {
        None => Err(CheckError::ForeignSchema),
        Some(found) if found > VERSION => Err(CheckError::Newer {
            found,
            known: VERSION,
        }),
        Some(found) => Ok(Some(found)),
    }
}

/// Step 5: the schema and its meta row.
async fn create_schema(conn: &mut PgConnection) -> Result<(), CheckError> {
    let doing = || "creating the ferry_sync schema".to_string();
    sqlx::raw_sql(SERVER_V1)
        .execute(&mut *conn)
        .await
        .doing(doing)?;
    let mut epoch = [0u8; 16];
    let mut secret = [0u8; 32];
    getrandom::getrandom(&mut epoch).map_err(CheckError::Entropy)?;
    getrandom::getrandom(&mut secret).map_err(CheckError::Entropy)?;
    let epoch = uuid::Builder::from_random_bytes(epoch).into_uuid();
    sqlx::query("INSERT INTO ferry_sync.meta (version, epoch, secret) VALUES ($1, $2::uuid, $3)")
        .bind(VERSION)
        .bind(epoch.to_string())
        .bind(secret.to_vec())
        .execute(&mut *conn)
        .await
        .doing(doing)?;
    Ok(())
}

/// Step 4: each statement's state, then what is left over.
async fn compare(
    conn: &mut PgConnection,
    rules: &Rules,
    catalog: &Catalog,
    schema: &Option<i32>,
) -> Result<Report, CheckError> {
    let statements = ddl(rules, catalog);
    let mut items = Vec::with_capacity(statements.len());
    for s in &statements {
        let state = match &s.object {
            Object::Schema => match schema {
                Some(_) => State::Installed,
                None => State::Missing,
            },
            Object::Declared { digest } => match schema {
                Some(_) => declared_state(conn, digest).await?,
                None => State::Missing,
            },
            Object::Function { name, body } => function_state(conn, name, body).await?,
            Object::Trigger { .. } => trigger_state(conn, &s.object).await?,
            Object::Index { .. } => index_state(conn, &s.object).await?,
        };
        items.push(Item {
            what: s.what.clone(),
            sql: s.sql.clone(),
            state,
            object: Some(s.object.clone()),
        });
    }
    items.extend(left_over(conn, &statements).await?);
    Ok(Report {
        digest: rules.digest(),
        items,
    })
}

async fn declared_state(conn: &mut PgConnection, digest: &str) -> Result<State, CheckError> {
    let declared: String = sqlx::query_scalar("SELECT declared FROM ferry_sync.meta")
        .fetch_one(&mut *conn)
        .await
        .doing(|| "reading ferry_sync.meta.declared".into())?;
    Ok(if declared == digest {
        State::Installed
    } else {
        State::Different
    })
}

async fn function_state(
    conn: &mut PgConnection,
    name: &str,
    body: &str,
) -> Result<State, CheckError> {
    let source: Option<String> = sqlx::query_scalar(
        "SELECT p.prosrc FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'ferry_sync' AND p.proname = $1 AND p.pronargs = 0
           AND p.prorettype = 'trigger'::regtype",
    )
    .bind(name)
    .fetch_optional(&mut *conn)
    .await
    .doing(|| format!("reading function ferry_sync.{name}"))?;
    Ok(match source {
        None => State::Missing,
        Some(s) if s == body => State::Installed,
        Some(_) => State::Different,
    })
}

async fn trigger_state(conn: &mut PgConnection, object: &Object) -> Result<State, CheckError> {
    let Object::Trigger {
        table,
        name,
        function,
        args,
        tgtype,
        ..
    } = object
    else {
        unreachable!("trigger_state is called for triggers")
    };
    type Found = (i16, String, String, String, Vec<u8>, bool);
    let found: Option<Found> = sqlx::query_as(
        "SELECT t.tgtype, t.tgenabled::text, pn.nspname::text, p.proname::text, t.tgargs,
                cardinality(t.tgattr::int2[]) = 0 AND t.tgqual IS NULL
         FROM pg_trigger t
         JOIN pg_proc p ON p.oid = t.tgfoid
         JOIN pg_namespace pn ON pn.oid = p.pronamespace
         WHERE t.tgrelid = to_regclass($1) AND t.tgname = $2 AND NOT t.tgisinternal",
    )
    .bind(table.quoted())
    .bind(name)
    .fetch_optional(&mut *conn)
    .await
    .doing(|| format!("reading trigger {name} on {table}"))?;
    let Some((found_type, enabled, schema, proname, found_args, plain)) = found else {
        return Ok(State::Missing);
    };
    let found_args: Vec<String> = found_args
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let same = found_type == *tgtype
        && (enabled == "O" || enabled == "A")
        && schema == "ferry_sync"
        && proname == *function
        && found_args == *args
        && plain;
    Ok(if same {
        State::Installed
    } else {
        State::Different
    })
}

async fn index_state(conn: &mut PgConnection, object: &Object) -> Result<State, CheckError> {
    let Object::Index {
        table,
        name,
        columns,
    } = object
    else {
        unreachable!("index_state is called for indexes")
    };
    let quoted = format!("{}.{}", quote_ident(&table.schema), quote_ident(name));
    let found: Option<(bool, Vec<String>, bool)> = sqlx::query_as(
        "SELECT x.indrelid = to_regclass($2),
                ARRAY(SELECT a.attname::text
                      FROM unnest(x.indkey::int2[]) WITH ORDINALITY k(n, i)
                      JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.n
                      ORDER BY k.i),
                x.indisvalid AND x.indexprs IS NULL AND x.indpred IS NULL
         FROM pg_index x WHERE x.indexrelid = to_regclass($1)",
    )
    .bind(&quoted)
    .bind(table.quoted())
    .fetch_optional(&mut *conn)
    .await
    .doing(|| format!("reading index {name} on {table}"))?;
    Ok(match found {
        None => State::Missing,
        Some((true, found_columns, true)) if found_columns == *columns => State::Installed,
        Some(_) => State::Different,
    })
}

/// What ferry-sync installed that `statements` no longer call for.
async fn left_over(
    conn: &mut PgConnection,
    statements: &[Statement],
) -> Result<Vec<Item>, CheckError> {
    let mut triggers = BTreeSet::new();
    let mut functions = BTreeSet::new();
    let mut indexes = BTreeSet::new();
    for s in statements {
        match &s.object {
            Object::Trigger { table, name, .. } => {
                triggers.insert((table.clone(), name.clone()));
            }
            Object::Function { name, .. } => {
                functions.insert(name.clone());
            }
            Object::Index { table, name, .. } => {
                indexes.insert((table.schema.clone(), name.clone()));
            }
            Object::Schema | Object::Declared { .. } => {}
        }
    }
    let mut out = Vec::new();
    let found: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT n.nspname::text, c.relname::text, t.tgname::text
         FROM pg_trigger t
         JOIN pg_class c ON c.oid = t.tgrelid
         JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE t.tgname LIKE 'ferry\\_sync\\_%' AND NOT t.tgisinternal AND t.tgparentid = 0
         ORDER BY 1, 2, 3",
    )
    .fetch_all(&mut *conn)
    .await
    .doing(|| "listing ferry-sync's triggers".into())?;
    for (schema, name, trigger) in found {
        let table = Relation { schema, name };
        if !triggers.contains(&(table.clone(), trigger.clone())) {
            out.push(Item {
                what: format!("the trigger {trigger} on {table}"),
                sql: format!(
                    "DROP TRIGGER IF EXISTS {} ON {};",
                    quote_ident(&trigger),
                    table.quoted()
                ),
                state: State::LeftOver,
                object: None,
            });
        }
    }
    let found: Vec<String> = sqlx::query_scalar(
        "SELECT p.proname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'ferry_sync' AND p.prorettype = 'trigger'::regtype ORDER BY 1",
    )
    .fetch_all(&mut *conn)
    .await
    .doing(|| "listing ferry-sync's functions".into())?;
    for name in found.into_iter().filter(|n| !functions.contains(n)) {
        out.push(Item {
            what: format!("the function ferry_sync.{name}"),
            sql: format!(
                "DROP FUNCTION IF EXISTS ferry_sync.{}();",
                quote_ident(&name)
            ),
            state: State::LeftOver,
            object: None,
        });
    }
    let found: Vec<(String, String)> = sqlx::query_as(
        "SELECT n.nspname::text, c.relname::text
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind IN ('i', 'I') AND c.relname LIKE 'ferry\\_sync\\_%' ORDER BY 1, 2",
    )
    .fetch_all(&mut *conn)
    .await
    .doing(|| "listing ferry-sync's indexes".into())?;
    for (schema, name) in found {
        if !indexes.contains(&(schema.clone(), name.clone())) {
            out.push(Item {
                what: format!("the index {schema}.{name}"),
                sql: format!(
                    "DROP INDEX IF EXISTS {}.{};",
                    quote_ident(&schema),
                    quote_ident(&name)
                ),
                state: State::LeftOver,
                object: None,
            });
        }
    }
    Ok(out)
}
