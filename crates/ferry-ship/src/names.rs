//! Database names. A name is what both sides call one database: the primary's file is
//! `NAME.db` in the shipper's directory and the replica's is `NAME.db` in the receiver's.
//! Names travel in URLs and become file names, so they keep to a safe alphabet. Both
//! sides derive their files' paths from names here ([`sidecar`]).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// Longest name, in bytes: well under any file system's 255-byte name limit once
/// `.db-wal` and the `.ferry/` suffixes are added.
pub const NAME_BYTES_MAX: usize = 128;

/// A name that cannot be used, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("database name {name:?} {problem}")]
pub struct NameError {
    pub name: String,
    pub problem: NameProblem,
}

/// What is wrong with a name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NameProblem {
    #[error("must be 1 to {NAME_BYTES_MAX} bytes long")]
    Length,
    #[error("must not start with '.'")]
    LeadingDot,
    #[error("contains {0:?}; use letters, digits, '_', '-' and '.'")]
    Character(char),
}

impl ferry_core::Classify for NameError {
    /// The same name fails the same way every time: a person must pick another.
    fn class(&self) -> ferry_core::Class {
        ferry_core::Class::Permanent
    }
}

/// Check a name: 1 to 128 bytes of `A-Z a-z 0-9 _ - .`, not starting with `.`.
pub fn validate(name: &str) -> Result<(), NameError> {
    let problem = if name.is_empty() || name.len() > NAME_BYTES_MAX {
        NameProblem::Length
    } else if name.starts_with('.') {
        NameProblem::LeadingDot
    } else if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        NameProblem::Character(c)
    } else {
        return Ok(());
    };
    Err(NameError {
        name: name.to_string(),
        problem,
    })
}

/// The name of a database file `NAME.db`, if it is one ferry ships.
pub fn from_file_name(file: &OsStr) -> Option<String> {
    let s = file.to_str()?;
    let name = s.strip_suffix(".db")?;
    validate(name).ok()?;
    Some(name.to_string())
}

/// Accept `NAME` or `NAME.db` from a person.
pub fn from_argument(arg: &str) -> Result<String, NameError> {
    let name = arg.strip_suffix(".db").unwrap_or(arg);
    validate(name)?;
    Ok(name.to_string())
}

/// `path` with a suffix appended to its file name (`x.db` → `x.db-wal`): SQLite's
/// sidecar files, and ferry's own files beside a database.
pub fn sidecar(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_keep_to_a_safe_alphabet() {
        assert!(validate("orders-2026_v1.x").is_ok());
        for bad in ["", ".hidden", "a/b", "../x", "a b", &"x".repeat(129)] {
            assert!(validate(bad).is_err(), "{bad:?}");
        }
        assert_eq!(from_file_name(OsStr::new("a.db")), Some("a".into()));
        assert_eq!(from_file_name(OsStr::new("a.db-wal")), None);
        assert_eq!(from_file_name(OsStr::new(".a.db")), None);
        assert_eq!(from_argument("a.db").unwrap(), "a");
        assert_eq!(
            validate("a/b").unwrap_err().to_string(),
            "database name \"a/b\" contains '/'; use letters, digits, '_', '-' and '.'"
        );
        assert_eq!(validate(".x").unwrap_err().problem, NameProblem::LeadingDot);
        assert_eq!(
            sidecar(Path::new("d/a.db"), "-wal"),
            Path::new("d/a.db-wal")
        );
    }
}
