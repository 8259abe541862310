//! The receiver's errors, each classified by what its caller does next.
//!
//! - [`Refused`]: what goes back to a shipper, an HTTP status and a JSON sentence; its code
//!   says whether the shipper retries (busy, disk full), sends a base, or stops (fenced).
//! - [`SlotError`]: an operation on one name failed; it becomes a [`Refused`] on the wire.
//! - [`OpenError`]: [`super::Receiver::open`] refused its configuration or directory.
//! - [`PromoteError`]: `ferry promote` could not promote, and says what to do.
//! - [`OfflineError`]: a directory holds no receiver state to show.

use super::replica::ReplicaError;
use crate::names::NameError;
use crate::proto::{Code, Position, Refusal};
use crate::sqlite::LibraryError;
use ferry_core::epoch::Epoch;
use ferry_core::fs::LockError;
use ferry_core::{Class, Classify, ConfigError};
use std::io;
use std::path::PathBuf;

/// A refusal to send back: an HTTP status and its JSON body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused(pub Refusal);

impl Refused {
    pub fn new(code: Code, error: impl Into<String>) -> Self {
        Refused(Refusal {
            error: error.into(),
            code,
            position: None,
        })
    }

    pub(super) fn at(mut self, pos: Position) -> Self {
        self.0.position = Some(pos);
        self
    }

    pub fn status(&self) -> u16 {
        status_of(self.0.code)
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.error)
    }
}

impl std::error::Error for Refused {}

impl Classify for Refused {
    fn class(&self) -> Class {
        match self.0.code {
            Code::Busy | Code::StorageFull | Code::Internal => Class::Transient,
            Code::Corrupt => Class::Corrupted,
            _ => Class::Permanent,
        }
    }
}

/// The HTTP status of each refusal code.
pub fn status_of(code: Code) -> u16 {
    match code {
        Code::Fenced | Code::NeedsBase | Code::Behind => 409,
        Code::BadRequest | Code::Corrupt => 400,
        Code::TooLarge => 413,
        Code::Unauthorized => 401,
        Code::NotFound => 404,
        Code::Busy => 503,
        Code::StorageFull => 507,
        Code::Internal => 500,
    }
}

/// Why an operation on a slot failed.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("{0}")]
    Refused(Refused),
    #[error("{name}: {source}")]
    Replica { name: String, source: ReplicaError },
    #[error("{name}: {what}: {source}")]
    Io {
        name: String,
        what: &'static str,
        source: io::Error,
    },
    #[error(
        "{name}: the replica was changed by something other than ferry (its witness page matches neither \
         side of the last transaction); it cannot be trusted. Move {path} away and let the shipper send a base"
    )]
    Foreign { name: String, path: String },
}

/// What a shipper is told when an operation on a slot fails.
impl From<SlotError> for Refused {
    fn from(e: SlotError) -> Refused {
        match e {
            SlotError::Refused(r) => r,
            SlotError::Replica {
                name,
                source: ReplicaError::Invalid(what),
            } => Refused::new(
                Code::BadRequest,
                format!("{name}: {what}; the replica is unchanged"),
            ),
            SlotError::Replica {
                name,
                source: ReplicaError::Sqlite(e),
            } => sqlite_refusal(&name, &e),
            SlotError::Replica {
                name,
                source: ReplicaError::Io(e) | ReplicaError::State(e),
            }
            | SlotError::Io {
                name, source: e, ..
            } => {
                if e.kind() == io::ErrorKind::StorageFull {
                    Refused::new(
                        Code::StorageFull,
                        format!(
                            "{name}: the receiver's disk is full ({e}); free space, it retries"
                        ),
                    )
                } else {
                    Refused::new(
                        Code::Internal,
                        format!("{name}: I/O error on the receiver: {e}"),
                    )
                }
            }
            e @ SlotError::Foreign { .. } => Refused::new(Code::Internal, e.to_string()),
        }
    }
}

impl Classify for SlotError {
    fn class(&self) -> Class {
        match self {
            SlotError::Refused(r) => r.class(),
            SlotError::Replica {
                source: ReplicaError::Invalid(_),
                ..
            } => Class::Permanent,
            SlotError::Replica {
                name,
                source: ReplicaError::Sqlite(e),
            } => sqlite_refusal(name, e).class(),
            SlotError::Replica {
                source: ReplicaError::Io(e) | ReplicaError::State(e),
                ..
            }
            | SlotError::Io { source: e, .. } => e.class(),
            SlotError::Foreign { .. } => Class::Corrupted,
        }
    }
}

fn sqlite_refusal(name: &str, e: &rusqlite::Error) -> Refused {
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DiskFull) => Refused::new(
            Code::StorageFull,
            format!("{name}: the receiver's disk is full ({e}); free space, it retries"),
        ),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
            Refused::new(
                Code::Busy,
                format!("{name}: the replica is locked ({e}); retry"),
            )
        }
        _ => Refused::new(
            Code::Internal,
            format!("{name}: SQLite error on the replica: {e}"),
        ),
    }
}

/// Why a receiver did not open.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Library(#[from] LibraryError),
    #[error("cannot open SQLite to check it: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// A setting cannot be used; `setting` names it as `ReceiverConfig` spells it.
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot create the receiver directory {}: {source}", path.display())]
    Dir { path: PathBuf, source: io::Error },
    /// Another receiver holds the directory.
    #[error(transparent)]
    Locked(#[from] LockError),
}

impl Classify for OpenError {
    fn class(&self) -> Class {
        match self {
            OpenError::Library(e) => e.class(),
            OpenError::Sqlite(_) => Class::Permanent,
            OpenError::Config(e) => e.class(),
            OpenError::Dir { source, .. } => source.class(),
            OpenError::Locked(e) => e.class(),
        }
    }
}

/// Why a promotion did not happen (or did not finish: rerun it, it is idempotent).
#[derive(Debug, thiserror::Error)]
pub enum PromoteError {
    #[error(transparent)]
    Library(#[from] LibraryError),
    #[error(transparent)]
    Name(#[from] NameError),
    /// A setting cannot be used: `dest` (where the promoted database goes).
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{}: no replica named {name} in {} (the receiver's status lists its replicas)", dir.display(), dir.display())]
    NoSuchReplica { name: String, dir: PathBuf },
    #[error(
        "{name} was already promoted at epoch {epoch}; its replica was moved out then (see the first promote's report)"
    )]
    AlreadyPromoted { name: String, epoch: Epoch },
    #[error("{name} has no replica to promote (no base was ever received)")]
    NeverReceived { name: String },
    #[error("{name}: the replica could not be opened")]
    NotOpen { name: String },
    #[error(
        "{} already exists; promote will not overwrite a database. Move it away and rerun",
        dest.display()
    )]
    Exists { dest: PathBuf },
    #[error(transparent)]
    Slot(#[from] SlotError),
    #[error("copying {name} to {}: {source}", path.display())]
    Copy {
        name: String,
        path: PathBuf,
        source: ReplicaError,
    },
    #[error("reading {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

impl Classify for PromoteError {
    fn class(&self) -> Class {
        match self {
            PromoteError::Library(e) => e.class(),
            PromoteError::Name(e) => e.class(),
            PromoteError::Config(e) => e.class(),
            PromoteError::Slot(e) => e.class(),
            PromoteError::Copy {
                source: ReplicaError::Io(e) | ReplicaError::State(e),
                ..
            }
            | PromoteError::Io { source: e, .. } => e.class(),
            PromoteError::Copy {
                source: ReplicaError::Sqlite(e),
                ..
            }
            | PromoteError::Read { source: e, .. } => {
                if crate::sqlite::waiting_cures(e) {
                    Class::Transient
                } else {
                    Class::Permanent
                }
            }
            PromoteError::Copy { .. } => Class::Permanent,
            PromoteError::NoSuchReplica { .. }
            | PromoteError::AlreadyPromoted { .. }
            | PromoteError::NeverReceived { .. }
            | PromoteError::NotOpen { .. }
            | PromoteError::Exists { .. } => Class::Permanent,
        }
    }
}

/// A directory holds no receiver state to show.
#[derive(Debug, thiserror::Error)]
#[error("{} holds no replicas ({source}); has a receiver run there?", dir.display())]
pub struct OfflineError {
    pub dir: PathBuf,
    pub source: io::Error,
}

impl Classify for OfflineError {
    fn class(&self) -> Class {
        Class::Permanent
    }
}
