//! The outbox's errors, each classified by what the caller does next
//! ([`ferry_core::Classify`]):
//!
//! - transient: retry the same work after a backoff (Postgres restarting, a connection
//!   cut, a serialization failure, SQLite busy);
//! - permanent: a person must act (a wrong password, a missing privilege, the schema not
//!   installed, a setting out of range); the relay stops with the message rather than
//!   retrying forever;
//! - corrupted: data failed validation (SQLite says its file is damaged).
//!
//! Every message says what the outbox was doing, to what, and what to do.

use ferry_core::{Class, Classify, ConfigError};

/// What the outbox was doing when a statement failed: names the work and the privileges
/// it needs, so a permission error can say which grant is missing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    SchemaVersion,
    Install,
    Lease,
    Extend,
    Settle,
    Reclaim,
    Status,
    Requeue,
    Discard,
    Pause,
    Resume,
    RecordTotals,
}

impl Op {
    /// The work, as a phrase ("leasing messages").
    pub fn doing(self) -> &'static str {
        match self {
            Op::SchemaVersion => "reading the outbox schema version",
            Op::Install => "installing the outbox schema",
            Op::Lease => "leasing messages",
            Op::Extend => "extending a lease",
            Op::Settle => "settling a batch",
            Op::Reclaim => "reclaiming expired leases",
            Op::Status => "reading the outbox status",
            Op::Requeue => "requeueing parked messages",
            Op::Discard => "discarding parked messages",
            Op::Pause => "pausing a topic",
            Op::Resume => "resuming a topic",
            Op::RecordTotals => "recording the relay's totals",
        }
    }

    /// The privileges the work needs (Postgres names; SQLite has only file permissions).
    pub fn needs(self) -> &'static str {
        match self {
            Op::SchemaVersion => {
                "USAGE on schema ferry_outbox and SELECT on ferry_outbox.schema_version"
            }
            Op::Install => {
                "CREATE on the database (the first install) or ownership of schema ferry_outbox"
            }
            Op::Lease => {
                "SELECT and UPDATE on ferry_outbox.messages, SELECT on ferry_outbox.paused_topics"
            }
            Op::Extend | Op::Reclaim => "SELECT and UPDATE on ferry_outbox.messages",
            Op::Settle => "SELECT, UPDATE and DELETE on ferry_outbox.messages",
            Op::Status => {
                "SELECT on ferry_outbox.messages, ferry_outbox.paused_topics and ferry_outbox.relays"
            }
            Op::Requeue => "SELECT and UPDATE on ferry_outbox.messages",
            Op::Discard => "SELECT and DELETE on ferry_outbox.messages",
            Op::Pause | Op::Resume => "SELECT, INSERT and DELETE on ferry_outbox.paused_topics",
            Op::RecordTotals => "SELECT, INSERT, UPDATE and DELETE on ferry_outbox.relays",
        }
    }
}

/// A database statement of the outbox failed.
#[derive(Debug, thiserror::Error)]
#[error("{} failed: {detail}{}", op.doing(), advice.as_ref().map(|a| format!(" — {a}")).unwrap_or_default())]
pub struct DbError {
    pub op: Op,
    class: Class,
    /// The database's own words (its message, SQLSTATE and hint), without source lines.
    detail: String,
    advice: Option<String>,
    /// Not reported as `source()` (so not named `source`): the message above already
    /// carries its words, a chain would print them twice; [`DbError::sqlx`] gives it to
    /// code.
    error: sqlx::Error,
}

impl DbError {
    pub fn new(op: Op, source: sqlx::Error) -> DbError {
        let class = classify(&source);
        let advice = advise(op, &source, class);
        DbError {
            op,
            class,
            detail: describe(&source),
            advice,
            error: source,
        }
    }

    /// The underlying sqlx error.
    pub fn sqlx(&self) -> &sqlx::Error {
        &self.error
    }

    /// The SQLSTATE (Postgres) or extended result code (SQLite), when the database gave one.
    pub fn code(&self) -> Option<String> {
        match &self.error {
            sqlx::Error::Database(d) => d.code().map(|c| c.into_owned()),
            _ => None,
        }
    }
}

impl Classify for DbError {
    fn class(&self) -> Class {
        self.class
    }
}

/// Attach the work being done to a sqlx result.
pub(crate) trait DbContext<T> {
    fn doing(self, op: Op) -> Result<T, DbError>;
}

impl<T> DbContext<T> for Result<T, sqlx::Error> {
    fn doing(self, op: Op) -> Result<T, DbError> {
        self.map_err(|e| DbError::new(op, e))
    }
}

/// Classify a sqlx error by what a caller does next (docs/outbox.md §6 "How failures are
/// told apart").
pub fn classify(e: &sqlx::Error) -> Class {
    use sqlx::Error as E;
    match e {
        E::Io(io) => io.class(),
        // The pool found no connection in time, or a connection broke mid-message: the
        // server is away or overloaded.
        E::PoolTimedOut | E::Protocol(_) | E::WorkerCrashed | E::BeginFailed => Class::Transient,
        E::Database(d) => match d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
            Some(pg) => classify_sqlstate(pg.code()),
            None => match d.code() {
                Some(code) => classify_sqlite(code.parse().unwrap_or(1)),
                None => Class::Permanent,
            },
        },
        // Data that does not read back as written.
        E::Decode(_) | E::ColumnDecode { .. } => Class::Corrupted,
        // Settings, TLS, a closed pool, a schema that lacks a column this build reads:
        // retrying changes none of them.
        _ => Class::Permanent,
    }
}

/// Postgres SQLSTATEs (Appendix A of the Postgres manual).
pub fn classify_sqlstate(code: &str) -> Class {
    match code {
        // Connection exceptions; transaction rollbacks (serialization failures,
        // deadlocks); insufficient resources (too many connections, disk full); the
        // server shutting down, crashed or starting up; a lock not available; a
        // statement cancelled (a timeout).
        c if c.starts_with("08") || c.starts_with("40") || c.starts_with("53") => Class::Transient,
        "57P01" | "57P02" | "57P03" | "57P05" | "55P03" | "57014" => Class::Transient,
        // Internal errors that say data is damaged.
        "XX001" | "XX002" => Class::Corrupted,
        // Authentication, a missing database, privileges, a missing table or column
        // (the schema not installed or older), and everything else: a person acts.
        _ => Class::Permanent,
    }
}

/// SQLite result codes (<https://sqlite.org/rescode.html>); `code` may be extended.
pub fn classify_sqlite(code: i32) -> Class {
    const BUSY: i32 = 5;
    const LOCKED: i32 = 6;
    const NOMEM: i32 = 7;
    const INTERRUPT: i32 = 9;
    const CORRUPT: i32 = 11;
    const FULL: i32 = 13;
    const PROTOCOL: i32 = 15;
    const SCHEMA: i32 = 17;
    const NOTADB: i32 = 26;
    match code & 0xff {
        BUSY | LOCKED | NOMEM | INTERRUPT | FULL | PROTOCOL | SCHEMA => Class::Transient,
        CORRUPT | NOTADB => Class::Corrupted,
        // READONLY, PERM, CANTOPEN, AUTH, IOERR, a missing table (ERROR), constraints.
        _ => Class::Permanent,
    }
}

/// The database's words: the message with its SQLSTATE and hint, not the Postgres source
/// line that sqlx's Display appends.
fn describe(e: &sqlx::Error) -> String {
    let sqlx::Error::Database(d) = e else {
        return e.to_string();
    };
    match d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        Some(pg) => {
            let mut s = format!("{} (SQLSTATE {})", pg.message(), pg.code());
            if let Some(h) = pg.hint() {
                s.push_str(&format!("; hint: {h}"));
            }
            s
        }
        None => match d.code() {
            Some(c) => format!("{} (SQLite code {c})", d.message()),
            None => d.message().to_string(),
        },
    }
}

/// What a person does when the outbox schema is missing or older than this build.
const SCHEMA_MISSING_ADVICE: &str = "the outbox schema is missing or older than this ferry: install or upgrade it (`ferry outbox install`, or Store::install)";

/// How SQLite says an outbox table is missing (it has no SQLSTATE: a missing table is
/// its generic error).
const SQLITE_NO_OUTBOX_TABLE: &str = "no such table: ferry_outbox_";

/// Does `e` say the outbox schema, or part of it, is not there? On Postgres when its
/// SQLSTATE is one of `sqlstates` (each caller names those its statements can meet: a
/// missing schema, table, column or function); on SQLite when it names a missing outbox
/// table.
pub(crate) fn schema_missing(e: &sqlx::Error, sqlstates: &[&str]) -> bool {
    let sqlx::Error::Database(d) = e else {
        return false;
    };
    d.code().is_some_and(|c| sqlstates.contains(&c.as_ref()))
        || d.message().contains(SQLITE_NO_OUTBOX_TABLE)
}

/// What to do, when there is something better to say than "retrying".
fn advise(op: Op, e: &sqlx::Error, class: Class) -> Option<String> {
    if class == Class::Corrupted {
        return Some(
            "the database file or a row failed validation; restore it from a backup or repair it before relaying again"
                .into(),
        );
    }
    let code = match e {
        sqlx::Error::Database(d) => d.code().map(|c| c.into_owned()).unwrap_or_default(),
        _ => return None,
    };
    let code = code.as_str();
    Some(match code {
        "42501" => format!(
            "the database user lacks a privilege: {} needs {}; grant it (docs/outbox.md §8)",
            op.doing(),
            op.needs()
        ),
        _ if schema_missing(e, &["42P01", "42703", "3F000", "42883"]) => {
            SCHEMA_MISSING_ADVICE.into()
        }
        c if c.starts_with("28") => "check the user and password in the database URL".into(),
        "3D000" => "check the database name in the database URL".into(),
        _ if class == Class::Transient => return None,
        _ => match e {
            sqlx::Error::Database(d)
                if d.message().contains("readonly") || d.message().contains("read-only") =>
            {
                "the SQLite file (or its directory, for the -wal and -shm files) is not writable by this process".into()
            }
            _ => return None,
        },
    })
}

/// Why a store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The database URL itself is unusable (setting `db`).
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot connect to Postgres at {url} as {user}: {detail} — {advice}")]
    Postgres {
        /// The URL without its password.
        url: String,
        user: String,
        detail: String,
        advice: String,
        class: Class,
        /// The message carries its words; not chained as `source()`.
        error: sqlx::Error,
    },
    #[error("cannot open the SQLite database {path}: {detail} — {advice}")]
    Sqlite {
        path: String,
        detail: String,
        advice: String,
        class: Class,
        /// The message carries its words; not chained as `source()`.
        error: sqlx::Error,
    },
}

impl ConnectError {
    pub(crate) fn postgres(url: String, user: String, source: sqlx::Error) -> ConnectError {
        let class = classify(&source);
        let code = match &source {
            sqlx::Error::Database(d) => d.code().map(|c| c.into_owned()).unwrap_or_default(),
            _ => String::new(),
        };
        let advice = match code.as_str() {
            "28000" | "28P01" => "check the user and password in the database URL".to_string(),
            "3D000" => "check the database name in the database URL, or create it".into(),
            "42501" => format!("grant {user} CONNECT on the database"),
            c if c.starts_with("53") => {
                "the server has no room for another connection; retrying".into()
            }
            _ if class == Class::Transient => {
                "is Postgres running there and reachable from here?".into()
            }
            _ => "check the database URL".into(),
        };
        ConnectError::Postgres {
            url,
            user,
            detail: describe(&source),
            advice,
            class,
            error: source,
        }
    }

    pub(crate) fn sqlite(path: String, source: sqlx::Error) -> ConnectError {
        let class = classify(&source);
        let advice = match class {
            Class::Corrupted => "the file is not a SQLite database or is damaged".to_string(),
            Class::Transient => "another process holds it locked; retrying may succeed".into(),
            Class::Permanent => {
                "check that the path exists and that this process may read and write it and its directory".into()
            }
        };
        ConnectError::Sqlite {
            path,
            detail: describe(&source),
            advice,
            class,
            error: source,
        }
    }
}

impl Classify for ConnectError {
    fn class(&self) -> Class {
        match self {
            ConnectError::Config(e) => e.class(),
            ConnectError::Postgres { class, .. } | ConnectError::Sqlite { class, .. } => *class,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_classified_by_what_a_retry_can_do() {
        for c in [
            "08006", "40001", "40P01", "53300", "57P01", "57P03", "55P03",
        ] {
            assert_eq!(classify_sqlstate(c), Class::Transient, "{c}");
        }
        for c in [
            "28P01", "28000", "3D000", "42501", "42P01", "42703", "23505",
        ] {
            assert_eq!(classify_sqlstate(c), Class::Permanent, "{c}");
        }
        assert_eq!(classify_sqlstate("XX001"), Class::Corrupted);
    }

    #[test]
    fn sqlite_codes_are_classified_by_their_primary_code() {
        assert_eq!(classify_sqlite(5), Class::Transient); // BUSY
        assert_eq!(classify_sqlite(5 | (1 << 8)), Class::Transient); // BUSY_RECOVERY
        assert_eq!(classify_sqlite(6), Class::Transient); // LOCKED
        assert_eq!(classify_sqlite(8), Class::Permanent); // READONLY
        assert_eq!(classify_sqlite(3), Class::Permanent); // PERM
        assert_eq!(classify_sqlite(14), Class::Permanent); // CANTOPEN
        assert_eq!(classify_sqlite(11), Class::Corrupted); // CORRUPT
        assert_eq!(classify_sqlite(26), Class::Corrupted); // NOTADB
    }

    // Guards the one check for a missing schema on SQLite, which has no SQLSTATE for it:
    // a statement on an outbox table that is not there is told apart, and its error says
    // to install the schema.
    #[tokio::test]
    async fn a_missing_outbox_table_on_sqlite_says_to_install_the_schema() {
        use sqlx::Connection;
        let mut c = sqlx::SqliteConnection::connect("sqlite::memory:")
            .await
            .unwrap();
        let e = sqlx::query("SELECT 1 FROM ferry_outbox_messages")
            .execute(&mut c)
            .await
            .unwrap_err();
        assert!(schema_missing(&e, &[]), "{e}");
        let text = DbError::new(Op::Lease, e).to_string();
        assert!(text.contains(SCHEMA_MISSING_ADVICE), "{text}");
    }

    #[test]
    fn connection_level_failures_are_transient() {
        assert_eq!(classify(&sqlx::Error::PoolTimedOut), Class::Transient);
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(classify(&sqlx::Error::Io(refused)), Class::Transient);
        assert_eq!(classify(&sqlx::Error::PoolClosed), Class::Permanent);
    }
}
