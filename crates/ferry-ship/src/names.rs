//! Database names. A name is what both sides call one database: the primary's file is
//! `NAME.db` in the shipper's directory and the replica's is `NAME.db` in the receiver's.
//! Names travel in URLs and become file names, so they keep to a safe alphabet. Both
//! sides derive their files' paths from names here ([`sidecar`]).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// Longest name, in bytes: well under any file system's 255-byte name limit once
/// `.db-wal` and the `.ferry/` suffixes are added.
pub const NAME_BYTES_MAX: usize = 128;

/// Check a name: 1 to 128 bytes of `A-Z a-z 0-9 _ - .`, not starting with `.`.
pub fn validate(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > NAME_BYTES_MAX {
        return Err(format!(
            "database name {name:?} must be 1 to {NAME_BYTES_MAX} bytes long"
        ));
    }
    if name.starts_with('.') {
        return Err(format!("database name {name:?} must not start with '.'"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(format!(
            "database name {name:?} contains {c:?}; use letters, digits, '_', '-' and '.'"
        ));
    }
    Ok(())
}

/// The name of a database file `NAME.db`, if it is one ferry ships.
pub fn from_file_name(file: &OsStr) -> Option<String> {
    let s = file.to_str()?;
    let name = s.strip_suffix(".db")?;
    validate(name).ok()?;
    Some(name.to_string())
}

/// Accept `NAME` or `NAME.db` from a person.
pub fn from_argument(arg: &str) -> Result<String, String> {
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
            sidecar(Path::new("d/a.db"), "-wal"),
            Path::new("d/a.db-wal")
        );
    }
}
