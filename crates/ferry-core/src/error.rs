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

/// A setting that cannot be used: which one (the library's name for it, such as
/// `lease` or `batch`), the value given, and why. Checked once, when a component is
/// built, before it touches anything; retrying with the same setting fails the same way.
///
/// Library messages name settings, never command-line flags: a CLI maps `setting` to its
/// own flag (or environment variable) when it reports one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{setting} = {value}: {reason}")]
pub struct ConfigError {
    pub setting: &'static str,
    pub value: String,
    pub reason: String,
}

impl ConfigError {
    pub fn new(
        setting: &'static str,
        value: impl std::fmt::Display,
        reason: impl Into<String>,
    ) -> ConfigError {
        ConfigError {
            setting,
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

impl Classify for ConfigError {
    fn class(&self) -> Class {
        Class::Permanent
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

    #[test]
    fn a_config_error_names_the_setting_and_is_permanent() {
        let e = ConfigError::new("lease", "500ms", "must be at least 1 s");
        assert_eq!(e.to_string(), "lease = 500ms: must be at least 1 s");
        assert_eq!(e.class(), Class::Permanent);
    }
}
