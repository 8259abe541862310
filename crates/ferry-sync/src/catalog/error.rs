//! Why the database and the rules do not fit, or why reading the database failed. Every
//! error says what, where, and what to do; [`ferry_core::Classify`] says whether to retry:
//! only a database that is away or busy is transient, everything else needs a person.

use ferry_core::{Class, Classify};

/// The database and the rules do not fit, ferry-sync is not installed as the rules say,
/// or a statement failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// A statement failed: what ferry-sync was doing, and the database's words.
    #[error("{doing} failed: {detail}{}", advice.as_ref().map(|a| format!(" — {a}")).unwrap_or_default())]
    Db {
        doing: String,
        class: Class,
        detail: String,
        advice: Option<String>,
        /// Not `source`: the message above carries its words already.
        error: sqlx::Error,
    },
    /// What the rules name is not in the database, or does not have the shape the rules
    /// need (a missing column, a wrong type, no primary key, an unmappable type).
    #[error("{0}")]
    Mismatch(String),
    /// Foreign keys among mirrored tables form a cycle; ferry-sync orders rows parents
    /// first and cannot order these.
    #[error(
        "the foreign keys among mirrored tables form a cycle ({}); ferry-sync sends parents before children and cannot order a cycle yet: leave one foreign key column out with `columns = [...]`, or one table out of the rules",
        cycle.join(" -> ")
    )]
    Cycle { cycle: Vec<String> },
    /// A schema `ferry_sync` that ferry-sync did not create (no `meta` row).
    #[error(
        "schema ferry_sync exists but holds no ferry_sync.meta row, so it is not ferry-sync's: rename or drop that schema, then run `ferry sync install`"
    )]
    ForeignSchema,
    /// The installed schema is newer than this build.
    #[error(
        "the ferry_sync schema in this database is version {found}, newer than this ferry ({known}); it was left alone: upgrade ferry"
    )]
    Newer { found: i32, known: i32 },
    /// The operating system's random source failed (the epoch and secret come from it).
    #[error(
        "reading the operating system's random source failed: {0}; nothing was installed, try again"
    )]
    Entropy(getrandom::Error),
    /// `verify`: something the rules need is not installed, or differs.
    #[error("{what} is {state}; run `ferry sync install --rules {rules} --db URL`")]
    NotInstalled {
        what: String,
        state: &'static str,
        rules: String,
    },
}

impl Classify for CheckError {
    fn class(&self) -> Class {
        match self {
            CheckError::Db { class, .. } => *class,
            CheckError::Entropy(_) => Class::Transient,
            _ => Class::Permanent,
        }
    }
}

impl CheckError {
    pub(crate) fn db(doing: impl Into<String>, error: sqlx::Error) -> CheckError {
        let class = classify(&error);
        let (detail, code) = describe(&error);
        let advice = match code.as_deref() {
            Some("42501") => Some(
                "the database user lacks a privilege: ferry-sync reads the catalog and, to install, owns the mirrored tables and creates schema ferry_sync".to_string(),
            ),
            Some(c) if c.starts_with("28") => {
                Some("check the user and password in the database URL".into())
            }
            Some("3D000") => Some("check the database name in the database URL".into()),
            _ => None,
        };
        CheckError::Db {
            doing: doing.into(),
            class,
            detail,
            advice,
            error,
        }
    }

    /// The underlying sqlx error, for a database error.
    pub fn sqlx(&self) -> Option<&sqlx::Error> {
        match self {
            CheckError::Db { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// Attach what ferry-sync was doing to a sqlx result.
pub(crate) trait Doing<T> {
    fn doing(self, what: impl FnOnce() -> String) -> Result<T, CheckError>;
}

impl<T> Doing<T> for Result<T, sqlx::Error> {
    fn doing(self, what: impl FnOnce() -> String) -> Result<T, CheckError> {
        self.map_err(|e| CheckError::db(what(), e))
    }
}

/// Transient when the server is away, busy or restarting; otherwise a person acts.
fn classify(e: &sqlx::Error) -> Class {
    use sqlx::Error as E;
    match e {
        E::Io(io) => io.class(),
        E::PoolTimedOut | E::Protocol(_) | E::WorkerCrashed | E::BeginFailed => Class::Transient,
        E::Database(d) => match d.code() {
            Some(code) => classify_sqlstate(&code),
            None => Class::Permanent,
        },
        E::Decode(_) | E::ColumnDecode { .. } => Class::Corrupted,
        _ => Class::Permanent,
    }
}

/// Postgres SQLSTATEs: connection exceptions, rollbacks (serialization, deadlock),
/// insufficient resources, shutdown or startup, a lock not available, a cancelled
/// statement are transient.
fn classify_sqlstate(code: &str) -> Class {
    match code {
        c if c.starts_with("08") || c.starts_with("40") || c.starts_with("53") => Class::Transient,
        "57P01" | "57P02" | "57P03" | "57P05" | "55P03" | "57014" => Class::Transient,
        "XX001" | "XX002" => Class::Corrupted,
        _ => Class::Permanent,
    }
}

/// The database's words (message, SQLSTATE, hint) and its SQLSTATE.
fn describe(e: &sqlx::Error) -> (String, Option<String>) {
    let sqlx::Error::Database(d) = e else {
        return (e.to_string(), None);
    };
    match d.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        Some(pg) => {
            let mut s = format!("{} (SQLSTATE {})", pg.message(), pg.code());
            if let Some(h) = pg.hint() {
                s.push_str(&format!("; hint: {h}"));
            }
            (s, Some(pg.code().to_string()))
        }
        None => (d.message().to_string(), d.code().map(|c| c.into_owned())),
    }
}
