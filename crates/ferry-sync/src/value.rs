//! The values rows are made of, on the wire and in SQLite.
//!
//! Postgres types are mapped to these five by [`crate::catalog`] (the table is in
//! `docs/sync.md`, "Types"). A value is encoded one way everywhere: on the wire, in the
//! digests both sides compute, and in the canonical key text the capture triggers write.
//! Two encodings of one row must be byte-equal, or digests would disagree on equal rows.

/// One column's value. `Real` never holds NaN (refused at encode: NaN is not equal to
/// itself, so a digest over it could never match).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

/// The SQLite column affinity a replica declares a column with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Affinity {
    Integer = 1,
    Real = 2,
    Text = 3,
    Blob = 4,
}

impl Affinity {
    pub fn sql(self) -> &'static str {
        match self {
            Affinity::Integer => "INTEGER",
            Affinity::Real => "REAL",
            Affinity::Text => "TEXT",
            Affinity::Blob => "BLOB",
        }
    }

    pub fn from_u8(byte: u8) -> Option<Affinity> {
        match byte {
            1 => Some(Affinity::Integer),
            2 => Some(Affinity::Real),
            3 => Some(Affinity::Text),
            4 => Some(Affinity::Blob),
            _ => None,
        }
    }
}
