//! The error taxonomy. Every error says what the caller does next:
//!
//! - [`Class::Transient`]: retry the same work after a backoff (a peer away, a busy lock,
//!   a full disk that may drain).
//! - [`Class::Permanent`]: retrying the same work will fail the same way; narrow it down,
//!   park it, tell a person (a wrong token, a malformed config, an oversized payload).
//! - [`Class::Corrupted`]: data failed validation (a checksum, a format); never retry it
//!   blindly, never apply it.
//!
//! One question, [`Classify::is_transient`], is answered the same way everywhere.

/// What a caller does next with an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    Transient,
    Permanent,
    Corrupted,
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Transient => "transient",
            Class::Permanent => "permanent",
            Class::Corrupted => "corrupted",
        }
    }
}

/// Implemented by every error type of every engine.
pub trait Classify {
    fn class(&self) -> Class;

    /// Retry the same work after a backoff?
    fn is_transient(&self) -> bool {
        self.class() == Class::Transient
    }
}

impl Classify for std::io::Error {
    /// I/O errors a retry can cure: interruptions, timeouts, a peer that went away, a
    /// full disk (space may be freed). Everything else, such as a missing file or a
    /// permission, needs a person.
    fn class(&self) -> Class {
        use std::io::ErrorKind as K;
        match self.kind() {
            K::Interrupted
            | K::WouldBlock
            | K::TimedOut
            | K::ConnectionRefused
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::NotConnected
            | K::BrokenPipe
            | K::UnexpectedEof
            | K::StorageFull
            | K::ResourceBusy
            | K::AddrInUse => Class::Transient,
            K::InvalidData => Class::Corrupted,
            _ => Class::Permanent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_are_classified_by_what_a_retry_can_do() {
        let e = |k| std::io::Error::from(k);
        assert!(e(std::io::ErrorKind::ConnectionRefused).is_transient());
        assert!(e(std::io::ErrorKind::StorageFull).is_transient());
        assert_eq!(e(std::io::ErrorKind::NotFound).class(), Class::Permanent);
        assert_eq!(e(std::io::ErrorKind::InvalidData).class(), Class::Corrupted);
    }
}
