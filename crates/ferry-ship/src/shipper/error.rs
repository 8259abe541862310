//! The shipper's errors, each classified by what its caller does next:
//!
//! - [`StartError`]: [`super::Shipper::start`] refused its configuration or its directory.
//!   Nothing was started; fix what it names and start again.
//! - [`StepError`]: one step of one database failed. The step is retried after a backoff,
//!   and status shows the message; the class says whether waiting can cure it.
//! - [`OfflineError`]: `offline_status` found no shipper state to read.

use crate::sqlite::LibraryError;
use ferry_core::fs::LockError;
use ferry_core::{Class, Classify, ConfigError};
use std::io;
use std::path::PathBuf;

/// Why a shipper did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Library(#[from] LibraryError),
    /// A setting cannot be used; `setting` names it as `ShipperConfig` spells it.
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot create the shipper's state directory {}: {source}", path.display())]
    StateDir { path: PathBuf, source: io::Error },
    /// Another shipper holds the directory.
    #[error(transparent)]
    Locked(#[from] LockError),
}

impl Classify for StartError {
    fn class(&self) -> Class {
        match self {
            StartError::Library(e) => e.class(),
            StartError::Config(e) => e.class(),
            StartError::StateDir { source, .. } => source.class(),
            StartError::Locked(e) => e.class(),
        }
    }
}

/// Kept for callers that report errors as text (the ship benchmark's harness does
/// `Shipper::start(..)?` in a function returning `Result<_, String>`).
impl From<StartError> for String {
    fn from(e: StartError) -> String {
        e.to_string()
    }
}

/// A failed step. All are retried after a backoff; the message goes to status.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("SQLite: {0}{code}", code = extended_code(.0))]
    Sqlite(#[from] rusqlite::Error),
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Peer(String),
}

/// SQLite's extended result code when it says more than the message (which names only
/// the primary one: "disk I/O error" is any of some thirty).
fn extended_code(e: &rusqlite::Error) -> String {
    match e {
        rusqlite::Error::SqliteFailure(f, _) if f.extended_code > 0xff => {
            format!(" (extended code {})", f.extended_code)
        }
        _ => String::new(),
    }
}

impl Classify for StepError {
    /// Everything a step meets is retried after a backoff, but the class says whether
    /// waiting can cure it: a busy lock or an unreachable peer can, a corrupt database
    /// file or a permission cannot (the step keeps failing and status says why).
    fn class(&self) -> Class {
        match self {
            StepError::Sqlite(e) if crate::sqlite::waiting_cures(e) => Class::Transient,
            StepError::Sqlite(e) => match e.sqlite_error_code() {
                Some(rusqlite::ErrorCode::DatabaseCorrupt | rusqlite::ErrorCode::NotADatabase) => {
                    Class::Corrupted
                }
                _ => Class::Permanent,
            },
            StepError::Io(e) => e.class(),
            StepError::Peer(_) => Class::Transient,
        }
    }
}

/// A directory holds no shipper state to show.
#[derive(Debug, thiserror::Error)]
#[error("{} has no shipper state ({source}); has a shipper run there?", dir.display())]
pub struct OfflineError {
    pub dir: PathBuf,
    pub source: io::Error,
}

impl Classify for OfflineError {
    fn class(&self) -> Class {
        Class::Permanent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_error_says_whether_waiting_can_cure_it() {
        let busy = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_BUSY),
            None,
        );
        assert!(StepError::Sqlite(busy).is_transient());
        let corrupt = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CORRUPT),
            None,
        );
        assert_eq!(StepError::Sqlite(corrupt).class(), Class::Corrupted);
        assert!(StepError::Peer("no reply".into()).is_transient());
        let ioerr = rusqlite::Error::SqliteFailure(
            rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_IOERR_SHMMAP),
            Some("disk I/O error".into()),
        );
        assert!(
            StepError::Sqlite(ioerr)
                .to_string()
                .contains("extended code 5386"),
            "status must show which of SQLite's I/O errors it was"
        );
    }
}
