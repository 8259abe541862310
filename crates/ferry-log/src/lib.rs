//! ferry-log: an append-only, segmented log of checksummed records with group commit.
//!
//! `append` copies a record into the open batch and returns at once with the position
//! just past it (code runs ahead of the disk). One writer thread takes whatever batch
//! has filled, writes it with one `write`, makes it durable with one `fdatasync`, then
//! publishes the durable position and wakes exactly the waiters it covers. Recovery
//! tells a torn tail (cut) from damage before the tail (an error). The contract is
//! `docs/log.md`.

mod format;
mod log;
pub mod sim;
mod storage;

pub use crate::log::{
    Config, Cycle, Follower, Log, Record, Recovery, Stats, WRITE_BUCKETS, WriteHistogram,
};
pub use crate::storage::{FileStorage, Storage};

use ferry_core::ConfigError;
use ferry_core::error::{Class, Classify};
use std::io;
use std::sync::Arc;

/// A position in the log: a byte offset in the log as a whole.
pub type Lsn = u64;

#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    #[error("the log could not {what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: Arc<io::Error>,
    },
    #[error(
        "the log refuses writes since an earlier write or sync failed ({cause}); the kernel may \
         have dropped what that sync covered, so reopen the log to recover what is durable"
    )]
    PreviousIo { cause: Arc<io::Error> },
    #[error(
        "the log is damaged: {segment} at byte {offset}: {reason}; records after this point \
         were made durable, so this is not a torn write: restore the log from a copy, or \
         move it aside and start a new one"
    )]
    Corrupted {
        segment: String,
        offset: u64,
        reason: String,
    },
    #[error("a record of {len} bytes exceeds the log's limit of {max} bytes")]
    TooLarge { len: usize, max: u32 },
    /// A request the log refuses (a reserved kind, a position past the end or
    /// retired); nothing changed.
    #[error("{0}")]
    Invalid(String),
    /// A setting of [`Config`] the log cannot use, named with its value; the log was
    /// not opened and nothing on disk changed.
    #[error("the log cannot open with this configuration: {0}")]
    Config(#[from] ConfigError),
    #[error("the log is closed")]
    Closed,
    /// A log held under a lease (a ferry-flow shard on a server) that this writer no
    /// longer holds: it must append nothing more, and nothing it appended after the
    /// last acknowledgement counts. What, and why, in words.
    #[error("fenced: {0}")]
    Fenced(String),
}

impl Error {
    pub(crate) fn io(what: &'static str, source: io::Error) -> Error {
        Error::Io {
            what,
            source: Arc::new(source),
        }
    }
}

impl Classify for Error {
    fn class(&self) -> Class {
        match self {
            // A log that failed a write or sync refuses everything until reopened: a
            // retry on the same handle cannot succeed.
            Error::Io { .. } | Error::PreviousIo { .. } => Class::Permanent,
            Error::Corrupted { .. } => Class::Corrupted,
            Error::TooLarge { .. } | Error::Invalid(_) | Error::Closed | Error::Fenced(_) => {
                Class::Permanent
            }
            Error::Config(e) => e.class(),
        }
    }
}
