//! The relay's errors, classified by what the relay does next.

use ferry_core::{Class, Classify};

#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// Postgres refused or went away.
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    /// The lock check failed inside a recording transaction: another relay may hold it,
    /// or a pooler gave this transaction another backend.
    #[error(
        "this relay no longer holds the ferry-sync relay lock on its connection (another relay may hold it now, or a pooler in transaction mode runs its transactions elsewhere: use a direct or session-pooled connection)"
    )]
    LockLost,
    /// The schema or the rules do not fit: the operator must act.
    #[error("{0}")]
    Setup(String),
}

impl Classify for RelayError {
    fn class(&self) -> Class {
        match self {
            RelayError::Db(e) => db_class(e),
            RelayError::LockLost => Class::Transient,
            RelayError::Setup(_) => Class::Permanent,
        }
    }
}

/// A database error is permanent for one note only when it is about data (SQLSTATE
/// classes 22 and 23, and P0001, an exception a view's function raised); anything else
/// (the server away, a serialization failure, a view that no longer exists) is retried,
/// since parking would set aside every note for a cause that is not theirs.
pub fn db_class(e: &sqlx::Error) -> Class {
    match e {
        sqlx::Error::Database(d) => match d.code().as_deref() {
            Some(code) if code.starts_with("22") || code.starts_with("23") || code == "P0001" => {
                Class::Permanent
            }
            _ => Class::Transient,
        },
        sqlx::Error::ColumnDecode { .. } | sqlx::Error::Decode(_) => Class::Permanent,
        _ => Class::Transient,
    }
}
