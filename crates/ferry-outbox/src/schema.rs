//! The outbox schema (docs/outbox.md §3), versioned. `install` creates it or upgrades it
//! in one transaction and is safe to run any number of times, from several processes at
//! once (Postgres: under an advisory lock; SQLite: under the write lock).

use crate::error::{DbError, Op};
use ferry_core::{Class, Classify};
use sqlx::{Connection, PgConnection, SqliteConnection};

/// The schema version this build writes and reads. Version 2 added the relays' totals
/// (`relays`, crate::totals); nothing else changed.
pub const VERSION: i32 = 2;

/// Postgres, version 1. `ferry_outbox.enqueue` is the SQL way to enqueue, for apps in any
/// language; it checks the same limits as the Rust API (payload from
/// `ferry_outbox.settings`).
const PG_V1: &str = r#"
CREATE TABLE ferry_outbox.settings (
    payload_bytes_max int NOT NULL
);
INSERT INTO ferry_outbox.settings VALUES (1000000);

CREATE TABLE ferry_outbox.messages (
    id              bigserial PRIMARY KEY,
    message_id      text NOT NULL UNIQUE,
    topic           text NOT NULL,
    key             text,
    ordered         boolean NOT NULL DEFAULT false,
    seq             bigint,
    payload         bytea NOT NULL,
    headers         jsonb NOT NULL DEFAULT '{}'::jsonb,
    state           smallint NOT NULL DEFAULT 0,
    generation      bigint NOT NULL DEFAULT 0,
    lease_owner     text,
    lease_until     timestamptz,
    attempts        int NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    uncertain_since timestamptz,
    last_error      text,
    enqueued_at     timestamptz NOT NULL DEFAULT now(),
    CHECK (NOT ordered OR (key IS NOT NULL AND seq IS NOT NULL)),
    CHECK (state IN (0, 1, 2))
);
CREATE INDEX messages_head ON ferry_outbox.messages (key, seq) WHERE ordered;
CREATE INDEX messages_claim ON ferry_outbox.messages (next_attempt_at, id) WHERE state = 0;
CREATE INDEX messages_leased ON ferry_outbox.messages (lease_until) WHERE state = 1;
CREATE INDEX messages_parked ON ferry_outbox.messages (id) WHERE state = 2;

CREATE TABLE ferry_outbox.key_seqs (
    key      text PRIMARY KEY,
    last_seq bigint NOT NULL
);

CREATE TABLE ferry_outbox.paused_topics (
    topic     text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION ferry_outbox.enqueue(
    p_message_id text, p_topic text, p_key text, p_ordered boolean, p_payload bytea,
    p_headers jsonb DEFAULT '{}'::jsonb
) RETURNS bigint LANGUAGE plpgsql AS $fn$
DECLARE
    v_max int;
    v_seq bigint;
    v_id bigint;
BEGIN
    SELECT payload_bytes_max INTO v_max FROM ferry_outbox.settings;
    IF octet_length(p_payload) > v_max THEN
        RAISE EXCEPTION 'ferry_outbox: message %: payload is % bytes, over the limit of % bytes',
            p_message_id, octet_length(p_payload), v_max
            USING ERRCODE = '22023',
                  HINT = 'send a reference to the data instead, or raise ferry_outbox.settings.payload_bytes_max';
    END IF;
    IF p_topic IS NULL OR p_topic = '' OR octet_length(p_topic) > 255 OR p_topic !~ '^[!-~]+$'
       OR p_topic ~ '(^\.|\.$|\.\.|\*|>)' THEN
        RAISE EXCEPTION 'ferry_outbox: message %: topic % is not a valid subject', p_message_id, p_topic
            USING ERRCODE = '22023';
    END IF;
    IF p_message_id IS NULL OR p_message_id = '' OR octet_length(p_message_id) > 255
       OR p_message_id !~ '^[!-~]+$' THEN
        RAISE EXCEPTION 'ferry_outbox: message id % must be 1 to 255 bytes of printable ASCII', p_message_id
            USING ERRCODE = '22023';
    END IF;
    IF p_key IS NOT NULL AND (p_key = '' OR octet_length(p_key) > 255 OR p_key !~ '^[!-~]+$') THEN
        RAISE EXCEPTION 'ferry_outbox: message %: key % must be 1 to 255 bytes of printable ASCII', p_message_id, p_key
            USING ERRCODE = '22023';
    END IF;
    IF p_headers IS NOT NULL AND (jsonb_typeof(p_headers) <> 'object'
       OR EXISTS (SELECT 1 FROM jsonb_each(p_headers) e WHERE jsonb_typeof(e.value) <> 'string')
       OR (SELECT count(*) FROM jsonb_object_keys(p_headers)) > 32
       OR octet_length(p_headers::text) > 8192) THEN
        RAISE EXCEPTION 'ferry_outbox: message %: headers must be a JSON object of at most 32 string values, 4 KiB in all', p_message_id
            USING ERRCODE = '22023';
    END IF;
    IF p_ordered AND p_key IS NULL THEN
        RAISE EXCEPTION 'ferry_outbox: message %: ordered messages need a key', p_message_id
            USING ERRCODE = '22023';
    END IF;
    IF p_ordered THEN
        -- The row lock taken here is held until the caller's transaction ends: the next
        -- enqueue on this key waits for it, so seq order is commit order.
        INSERT INTO ferry_outbox.key_seqs AS k (key, last_seq) VALUES (p_key, 1)
        ON CONFLICT (key) DO UPDATE SET last_seq = k.last_seq + 1
        RETURNING last_seq INTO v_seq;
    END IF;
    INSERT INTO ferry_outbox.messages (message_id, topic, key, ordered, seq, payload, headers)
    VALUES (p_message_id, p_topic, p_key, p_ordered, v_seq, p_payload, coalesce(p_headers, '{}'::jsonb))
    ON CONFLICT (message_id) DO NOTHING
    RETURNING id INTO v_id;
    PERFORM pg_notify('ferry_outbox', '');
    RETURN v_id;
END
$fn$;
"#;

/// SQLite, version 1: the same tables with a `ferry_outbox_` prefix. Times are integer
/// milliseconds since the Unix epoch, set by the caller (SQLite has one clock: the
/// machine's).
const SQLITE_V1: &str = r#"
CREATE TABLE ferry_outbox_settings (payload_bytes_max INTEGER NOT NULL);
INSERT INTO ferry_outbox_settings VALUES (1000000);

CREATE TABLE ferry_outbox_messages (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id      TEXT NOT NULL UNIQUE,
    topic           TEXT NOT NULL,
    key             TEXT,
    ordered         INTEGER NOT NULL DEFAULT 0,
    seq             INTEGER,
    payload         BLOB NOT NULL,
    headers         TEXT NOT NULL DEFAULT '{}',
    state           INTEGER NOT NULL DEFAULT 0,
    generation      INTEGER NOT NULL DEFAULT 0,
    lease_owner     TEXT,
    lease_until     INTEGER,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at INTEGER NOT NULL,
    uncertain_since INTEGER,
    last_error      TEXT,
    enqueued_at     INTEGER NOT NULL,
    CHECK (NOT ordered OR (key IS NOT NULL AND seq IS NOT NULL)),
    CHECK (state IN (0, 1, 2))
);
CREATE INDEX ferry_outbox_messages_head ON ferry_outbox_messages (key, seq) WHERE ordered;
CREATE INDEX ferry_outbox_messages_claim ON ferry_outbox_messages (next_attempt_at, id) WHERE state = 0;
CREATE INDEX ferry_outbox_messages_leased ON ferry_outbox_messages (lease_until) WHERE state = 1;

CREATE TABLE ferry_outbox_key_seqs (key TEXT PRIMARY KEY, last_seq INTEGER NOT NULL);
CREATE TABLE ferry_outbox_paused_topics (topic TEXT PRIMARY KEY, paused_at INTEGER NOT NULL);
"#;

/// Postgres, version 2: each relay's cumulative counters (crate::totals), so that
/// `ferry outbox status` shows them across relay restarts.
pub(crate) const PG_V2: &str = r#"
CREATE TABLE ferry_outbox.relays (
    owner            text PRIMARY KEY,
    transport        text NOT NULL DEFAULT '',
    started_at       timestamptz NOT NULL DEFAULT now(),
    seen_at          timestamptz NOT NULL DEFAULT now(),
    stopped          boolean NOT NULL DEFAULT false,
    breaker_open     boolean NOT NULL DEFAULT false,
    last_error       text,
    leased           bigint NOT NULL DEFAULT 0,
    published        bigint NOT NULL DEFAULT 0,
    duplicates       bigint NOT NULL DEFAULT 0,
    settled          bigint NOT NULL DEFAULT 0,
    fenced           bigint NOT NULL DEFAULT 0,
    retried          bigint NOT NULL DEFAULT 0,
    unavailable      bigint NOT NULL DEFAULT 0,
    uncertain        bigint NOT NULL DEFAULT 0,
    reconciled       bigint NOT NULL DEFAULT 0,
    parked           bigint NOT NULL DEFAULT 0,
    db_errors        bigint NOT NULL DEFAULT 0,
    breaker_openings bigint NOT NULL DEFAULT 0
);
"#;

/// SQLite, version 2: the same table (times in ms since the Unix epoch).
pub(crate) const SQLITE_V2: &str = r#"
CREATE TABLE ferry_outbox_relays (
    owner            TEXT PRIMARY KEY,
    transport        TEXT NOT NULL DEFAULT '',
    started_at       INTEGER NOT NULL,
    seen_at          INTEGER NOT NULL,
    stopped          INTEGER NOT NULL DEFAULT 0,
    breaker_open     INTEGER NOT NULL DEFAULT 0,
    last_error       TEXT,
    leased           INTEGER NOT NULL DEFAULT 0,
    published        INTEGER NOT NULL DEFAULT 0,
    duplicates       INTEGER NOT NULL DEFAULT 0,
    settled          INTEGER NOT NULL DEFAULT 0,
    fenced           INTEGER NOT NULL DEFAULT 0,
    retried          INTEGER NOT NULL DEFAULT 0,
    unavailable      INTEGER NOT NULL DEFAULT 0,
    uncertain        INTEGER NOT NULL DEFAULT 0,
    reconciled       INTEGER NOT NULL DEFAULT 0,
    parked           INTEGER NOT NULL DEFAULT 0,
    db_errors        INTEGER NOT NULL DEFAULT 0,
    breaker_openings INTEGER NOT NULL DEFAULT 0
);
"#;

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error(
        "the outbox schema in this database is version {found}, newer than this ferry ({VERSION}); upgrade ferry"
    )]
    Newer { found: i32 },
    #[error(transparent)]
    Db(#[from] DbError),
}

impl From<sqlx::Error> for InstallError {
    fn from(e: sqlx::Error) -> InstallError {
        InstallError::Db(DbError::new(Op::Install, e))
    }
}

impl Classify for InstallError {
    fn class(&self) -> Class {
        match self {
            InstallError::Newer { .. } => Class::Permanent,
            InstallError::Db(e) => e.class(),
        }
    }
}

/// What `install` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installed {
    Created,
    Upgraded { from: i32 },
    AlreadyCurrent,
}

/// Create or upgrade the schema on Postgres.
pub async fn install_pg(conn: &mut PgConnection) -> Result<Installed, InstallError> {
    let mut tx = conn.begin().await?;
    // One installer at a time; the lock ends with the transaction.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('ferry_outbox.install'))")
        .execute(&mut *tx)
        .await?;
    sqlx::query("CREATE SCHEMA IF NOT EXISTS ferry_outbox")
        .execute(&mut *tx)
        .await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS ferry_outbox.schema_version (version int NOT NULL)")
        .execute(&mut *tx)
        .await?;
    let found: Option<i32> =
        sqlx::query_scalar("SELECT max(version) FROM ferry_outbox.schema_version")
            .fetch_one(&mut *tx)
            .await?;
    let outcome = match found {
        Some(v) if v > VERSION => return Err(InstallError::Newer { found: v }),
        Some(v) if v == VERSION => Installed::AlreadyCurrent,
        found => {
            let from = found.unwrap_or(0);
            if from < 1 {
                sqlx::raw_sql(PG_V1).execute(&mut *tx).await?;
            }
            if from < 2 {
                sqlx::raw_sql(PG_V2).execute(&mut *tx).await?;
            }
            sqlx::query("DELETE FROM ferry_outbox.schema_version")
                .execute(&mut *tx)
                .await?;
            sqlx::query("INSERT INTO ferry_outbox.schema_version VALUES ($1)")
                .bind(VERSION)
                .execute(&mut *tx)
                .await?;
            if from == 0 {
                Installed::Created
            } else {
                Installed::Upgraded { from }
            }
        }
    };
    tx.commit().await?;
    Ok(outcome)
}

/// Create or upgrade the schema on SQLite (and switch the database to WAL mode, which
/// relays reading beside a writing app need).
pub async fn install_sqlite(conn: &mut SqliteConnection) -> Result<Installed, InstallError> {
    sqlx::query("PRAGMA journal_mode=WAL")
        .execute(&mut *conn)
        .await?;
    sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await?;
    let result = async {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS ferry_outbox_schema_version (version INTEGER NOT NULL)",
        )
        .execute(&mut *conn)
        .await?;
        let found: Option<i32> =
            sqlx::query_scalar("SELECT max(version) FROM ferry_outbox_schema_version")
                .fetch_one(&mut *conn)
                .await?;
        Ok::<_, InstallError>(match found {
            Some(v) if v > VERSION => return Err(InstallError::Newer { found: v }),
            Some(v) if v == VERSION => Installed::AlreadyCurrent,
            found => {
                let from = found.unwrap_or(0);
                if from < 1 {
                    sqlx::raw_sql(SQLITE_V1).execute(&mut *conn).await?;
                }
                if from < 2 {
                    sqlx::raw_sql(SQLITE_V2).execute(&mut *conn).await?;
                }
                sqlx::query("DELETE FROM ferry_outbox_schema_version")
                    .execute(&mut *conn)
                    .await?;
                sqlx::query("INSERT INTO ferry_outbox_schema_version VALUES (?)")
                    .bind(VERSION)
                    .execute(&mut *conn)
                    .await?;
                if from == 0 {
                    Installed::Created
                } else {
                    Installed::Upgraded { from }
                }
            }
        })
    }
    .await;
    match result {
        Ok(outcome) => {
            sqlx::query("COMMIT").execute(&mut *conn).await?;
            Ok(outcome)
        }
        Err(e) => {
            let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
            Err(e)
        }
    }
}
