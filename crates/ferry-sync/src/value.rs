//! The values rows are made of, on the wire and in SQLite.
//!
//! Postgres types are mapped to these five by [`crate::catalog`] (the table is in
//! `docs/sync.md`, "Types"). A value is encoded one way everywhere: on the wire, in the
//! digests both sides compute, and in the canonical key text the capture triggers write.
//! Two encodings of one row must be byte-equal, or digests would disagree on equal rows.
//!
//! A value on the wire (protocol v1) is one tag byte and what the tag says follows:
//! 1. `0` Null: nothing.
//! 2. `1` Int: the zigzag of the `i64` (0, -1, 1, -2, … as 0, 1, 2, 3, …) as a varint.
//! 3. `2` Real: the `f64`'s bits, 8 bytes big-endian. NaN is refused ([`EncodeError`]).
//! 4. `3` Text: the byte length as a varint, then that many bytes of UTF-8.
//! 5. `4` Blob: the byte length as a varint, then the bytes.
//!
//! A varint is unsigned LEB128: 7 bits a byte, lowest first, the high bit set on every
//! byte but the last; at most [`VARINT_BYTES_MAX`] bytes. The decoder refuses an overlong
//! varint (a last byte of 0 after the first byte) and one past `u64::MAX`, so every value
//! has exactly one encoding and equal rows hash equal.
//!
//! Built on the encoding:
//! - [`row_hash`]: FNV-1a 64 over the concatenated encodings of a row's values in column
//!   order; [`Fingerprint`]: a table's row count and the wrapping sum of its row hashes,
//!   so the server and a replica agree whatever order they read rows in.
//! - [`key_text`] and [`parse_key_text`]: the canonical text of a key, which the Postgres
//!   capture triggers write (parts as text, `\` and `|` escaped, joined by `|`).
//! - [`value_len`] and [`row_len`]: encoded sizes, for the server's packing estimates.
//!
//! Everything here is pure and never panics on input: decoding validates into a
//! [`DecodeError`] that names the problem and the byte offset.

use std::fmt::Write as _;

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

/// The most bytes a varint takes: 64 bits at 7 a byte is 9.14, so 10, the last holding
/// only bit 63. A longer run of continuation bytes is refused before it is read further.
pub const VARINT_BYTES_MAX: usize = 10;

/// The value tags, in wire order.
const TAG_NULL: u8 = 0;
const TAG_INT: u8 = 1;
const TAG_REAL: u8 = 2;
const TAG_TEXT: u8 = 3;
const TAG_BLOB: u8 = 4;

/// FNV-1a 64's offset basis and prime (Fowler, Noll, Vo; the published constants).
const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Why something could not be encoded. Nothing was written that a peer would read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A `Real` held NaN, which `Value` never should: NaN is not equal to itself, so a
    /// digest over it could never match. Whoever built the value broke that invariant.
    #[error(
        "cannot encode {at}: the real value is NaN, which never equals itself, so digests \
         could not match; store NULL for it instead"
    )]
    NotANumber { at: String },
    /// A part or row breaks a rule of the body (the decoder would refuse it), named by
    /// `rule` as in the refusal kinds of the wire module.
    #[error("cannot encode {detail} [{rule}]; fix the part before sending it")]
    Invalid { rule: &'static str, detail: String },
}

/// What was wrong with encoded bytes, at which byte offset of the bytes given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{problem} at byte {offset}")]
pub struct DecodeError {
    pub problem: DecodeProblem,
    /// Offset of the byte where the problem was found.
    pub offset: usize,
}

/// The ways encoded values can be malformed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeProblem {
    #[error("the bytes end inside it")]
    Truncated,
    #[error("an overlong varint (a last byte of 0 after the first byte)")]
    VarintOverlong,
    #[error("a varint longer than 10 bytes or past u64::MAX")]
    VarintOverflow,
    #[error("an unknown value tag {0} (tags are 0 Null, 1 Int, 2 Real, 3 Text, 4 Blob)")]
    UnknownTag(u8),
    #[error("text that is not UTF-8")]
    NotUtf8,
    #[error("a real value that is NaN")]
    NotANumber,
}

/// Appends the encoding of `v` to `out`. Refuses NaN (and then appends nothing).
pub fn encode_value(v: &Value, out: &mut Vec<u8>) -> Result<(), EncodeError> {
    if let Value::Real(r) = v
        && r.is_nan()
    {
        return Err(EncodeError::NotANumber {
            at: "a value".to_string(),
        });
    }
    write_value(v, out);
    Ok(())
}

/// Decodes one value starting at `*at`, and moves `*at` past it. On error `*at` is left
/// where it was and the error's offset names the offending byte.
pub fn decode_value(bytes: &[u8], at: &mut usize) -> Result<Value, DecodeError> {
    let mut cursor = *at;
    let tag = *bytes.get(cursor).ok_or(DecodeError {
        problem: DecodeProblem::Truncated,
        offset: cursor,
    })?;
    cursor += 1;
    let value = match tag {
        TAG_NULL => Value::Null,
        TAG_INT => Value::Int(unzigzag(decode_varint(bytes, &mut cursor)?)),
        TAG_REAL => {
            let bits = take(bytes, &mut cursor, 8)?;
            let real = f64::from_bits(u64::from_be_bytes(bits.try_into().expect("took 8 bytes")));
            if real.is_nan() {
                return Err(DecodeError {
                    problem: DecodeProblem::NotANumber,
                    offset: *at,
                });
            }
            Value::Real(real)
        }
        TAG_TEXT => {
            let start = cursor;
            let text = take_counted(bytes, &mut cursor)?;
            let text = std::str::from_utf8(text).map_err(|_| DecodeError {
                problem: DecodeProblem::NotUtf8,
                offset: start,
            })?;
            Value::Text(text.to_string())
        }
        TAG_BLOB => Value::Blob(take_counted(bytes, &mut cursor)?.to_vec()),
        other => {
            return Err(DecodeError {
                problem: DecodeProblem::UnknownTag(other),
                offset: *at,
            });
        }
    };
    *at = cursor;
    Ok(value)
}

/// Appends `n` as an unsigned LEB128 varint.
pub fn encode_varint(mut n: u64, out: &mut Vec<u8>) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// Decodes a varint starting at `*at` and moves `*at` past it; refuses overlong and
/// overflowing encodings (see the module doc). On error `*at` is unchanged.
pub fn decode_varint(bytes: &[u8], at: &mut usize) -> Result<u64, DecodeError> {
    let mut n: u64 = 0;
    for i in 0..VARINT_BYTES_MAX {
        let offset = *at + i;
        let byte = *bytes.get(offset).ok_or(DecodeError {
            problem: DecodeProblem::Truncated,
            offset,
        })?;
        let last = byte & 0x80 == 0;
        // The tenth byte holds bit 63 only: anything more is past u64::MAX.
        if i == VARINT_BYTES_MAX - 1 && byte > 1 {
            return Err(DecodeError {
                problem: DecodeProblem::VarintOverflow,
                offset,
            });
        }
        n |= u64::from(byte & 0x7f) << (7 * i);
        if last {
            if byte == 0 && i > 0 {
                return Err(DecodeError {
                    problem: DecodeProblem::VarintOverlong,
                    offset,
                });
            }
            *at = offset + 1;
            return Ok(n);
        }
    }
    // Not reached: the tenth byte either ends the varint or is refused above.
    Err(DecodeError {
        problem: DecodeProblem::VarintOverflow,
        offset: *at + VARINT_BYTES_MAX - 1,
    })
}

/// The number of bytes [`encode_varint`] writes for `n`.
pub fn varint_len(n: u64) -> usize {
    let bits = 64 - n.leading_zeros() as usize;
    bits.div_ceil(7).max(1)
}

/// The number of bytes [`encode_value`] writes for `v`.
pub fn value_len(v: &Value) -> usize {
    1 + match v {
        Value::Null => 0,
        Value::Int(n) => varint_len(zigzag(*n)),
        Value::Real(_) => 8,
        Value::Text(text) => varint_len(text.len() as u64) + text.len(),
        Value::Blob(blob) => varint_len(blob.len() as u64) + blob.len(),
    }
}

/// The number of bytes a row's values take on the wire (no count prefix: a row's width
/// is its table's column count).
pub fn row_len(values: &[Value]) -> usize {
    values.iter().map(value_len).sum()
}

/// FNV-1a 64 over the concatenated encodings of `values`, in the order given (column
/// order). Infallible: a NaN (which `Value` never holds) is hashed by its bits.
pub fn row_hash(values: &[Value]) -> u64 {
    let mut hash = FNV_OFFSET;
    let mut encoded = Vec::with_capacity(64);
    for value in values {
        encoded.clear();
        write_value(value, &mut encoded);
        for byte in &encoded {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(FNV_PRIME);
        }
    }
    hash
}

/// A table's digest: how many rows, and the wrapping sum of their [`row_hash`]es. Adding
/// is commutative, so the server (reading Postgres) and a replica (reading SQLite) agree
/// on equal contents whatever order each reads rows in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    pub rows: u64,
    pub sum: u64,
}

impl Fingerprint {
    /// Counts one row (all its columns, in column order).
    pub fn add(&mut self, values: &[Value]) {
        self.add_hash(row_hash(values));
    }

    /// Counts one row by its [`row_hash`], for a caller that has it already.
    pub fn add_hash(&mut self, row_hash: u64) {
        self.rows = self.rows.wrapping_add(1);
        self.sum = self.sum.wrapping_add(row_hash);
    }
}

/// The canonical text of a key, as the Postgres capture triggers write it: each part as
/// text, joined by `|`, with `\` written `\\` and `|` written `\|` inside a part.
///
/// Int is written in decimal; Text as itself; Null as nothing (keys are never null in
/// practice). Real and Blob keys are written as Postgres renders them (`float8` as
/// shortest round-trip text, exponent form outside 1e-4..1e15, `Infinity`; `bytea` as
/// `\x` and lowercase hex, escaped like any text), but [`parse_key_text`] reads keys back
/// only as Int or Text.
pub fn key_text(parts: &[Value]) -> String {
    let mut text = String::new();
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            text.push('|');
        }
        match part {
            Value::Null => {}
            Value::Int(n) => write!(text, "{n}").expect("writing to a String cannot fail"),
            Value::Real(r) => text.push_str(&postgres_float8_text(*r)),
            Value::Text(part) => escape_into(&mut text, part),
            Value::Blob(blob) => {
                text.push_str("\\\\x");
                for byte in blob {
                    write!(text, "{byte:02x}").expect("writing to a String cannot fail");
                }
            }
        }
    }
    text
}

/// A key text [`parse_key_text`] could not read, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "key text {text:?} cannot be read: {problem}; the capture trigger and this key's columns disagree, check the table's key"
)]
pub struct KeyTextError {
    /// The text as given, cut to its first 200 characters.
    pub text: String,
    pub problem: String,
}

/// Reads a key text back into values: one part per entry of `affinities` (the key
/// columns' affinities, in key order); a part of an Integer column becomes Int (it must be
/// canonical decimal, as [`key_text`] writes it), any other part becomes Text.
pub fn parse_key_text(text: &str, affinities: &[Affinity]) -> Result<Vec<Value>, KeyTextError> {
    let refuse = |problem: String| KeyTextError {
        text: text.chars().take(200).collect(),
        problem,
    };
    let parts = split_key_text(text, affinities.len()).map_err(refuse)?;
    let mut values = Vec::with_capacity(parts.len());
    for (i, (part, affinity)) in parts.into_iter().zip(affinities).enumerate() {
        if *affinity != Affinity::Integer {
            values.push(Value::Text(part));
            continue;
        }
        match part.parse::<i64>() {
            Ok(n) if n.to_string() == part => values.push(Value::Int(n)),
            _ => {
                return Err(refuse(format!(
                    "part {} is {part:?}, not an integer in canonical decimal",
                    i + 1
                )));
            }
        }
    }
    Ok(values)
}

/// Splits key text on unescaped `|` and unescapes each part; refuses a text with other
/// than `expected` parts (without collecting more than that many).
fn split_key_text(text: &str, expected: usize) -> Result<Vec<String>, String> {
    if expected == 0 {
        return if text.is_empty() {
            Ok(Vec::new())
        } else {
            Err("the key has no parts, but the text is not empty".to_string())
        };
    }
    let mut parts = Vec::with_capacity(expected);
    let mut part = String::new();
    let mut chars = text.char_indices();
    while let Some((at, c)) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some((_, escaped @ ('\\' | '|'))) => part.push(escaped),
                Some((_, other)) => {
                    return Err(format!(
                        "the backslash at byte {at} escapes {other:?}; only '\\' and '|' are escaped"
                    ));
                }
                None => return Err(format!("the text ends in a lone backslash at byte {at}")),
            },
            '|' => {
                parts.push(std::mem::take(&mut part));
                if parts.len() == expected {
                    return Err(format!("it has more than the key's {expected} parts"));
                }
            }
            c => part.push(c),
        }
    }
    parts.push(part);
    if parts.len() != expected {
        return Err(format!(
            "it has {} parts, the key has {expected}",
            parts.len()
        ));
    }
    Ok(parts)
}

fn escape_into(text: &mut String, part: &str) {
    for c in part.chars() {
        if c == '\\' || c == '|' {
            text.push('\\');
        }
        text.push(c);
    }
}

/// `f64` as Postgres (12 and later) writes `float8`: the shortest text that reads back
/// to the same bits, in exponent form (`1e+20`, `1.5e-05`) when the decimal exponent is
/// below -4 or at least 15, else plain; `Infinity`, `-Infinity`.
fn postgres_float8_text(r: f64) -> String {
    if r.is_infinite() {
        return if r > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if r.is_nan() {
        return "NaN".into();
    }
    let scientific = format!("{r:e}");
    let (mantissa, exponent) = scientific.split_once('e').expect("{:e} writes an exponent");
    let exponent: i32 = exponent.parse().expect("{:e} writes a decimal exponent");
    if (-4..15).contains(&exponent) {
        return format!("{r}");
    }
    let sign = if exponent < 0 { '-' } else { '+' };
    format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs())
}

/// Appends the encoding of `v`; NaN is written by its bits (callers that must refuse it
/// use [`encode_value`]).
pub(crate) fn write_value(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Null => out.push(TAG_NULL),
        Value::Int(n) => {
            out.push(TAG_INT);
            encode_varint(zigzag(*n), out);
        }
        Value::Real(r) => {
            out.push(TAG_REAL);
            out.extend_from_slice(&r.to_bits().to_be_bytes());
        }
        Value::Text(text) => {
            out.push(TAG_TEXT);
            encode_varint(text.len() as u64, out);
            out.extend_from_slice(text.as_bytes());
        }
        Value::Blob(blob) => {
            out.push(TAG_BLOB);
            encode_varint(blob.len() as u64, out);
            out.extend_from_slice(blob);
        }
    }
}

fn zigzag(n: i64) -> u64 {
    ((n << 1) ^ (n >> 63)) as u64
}

fn unzigzag(z: u64) -> i64 {
    ((z >> 1) as i64) ^ -((z & 1) as i64)
}

/// Takes `len` bytes at `*cursor`, refusing (before any allocation) when fewer remain.
fn take<'a>(bytes: &'a [u8], cursor: &mut usize, len: usize) -> Result<&'a [u8], DecodeError> {
    let end = cursor
        .checked_add(len)
        .filter(|end| *end <= bytes.len())
        .ok_or(DecodeError {
            problem: DecodeProblem::Truncated,
            offset: bytes.len(),
        })?;
    let taken = &bytes[*cursor..end];
    *cursor = end;
    Ok(taken)
}

/// Takes a varint length and that many bytes.
fn take_counted<'a>(bytes: &'a [u8], cursor: &mut usize) -> Result<&'a [u8], DecodeError> {
    let len = decode_varint(bytes, cursor)?;
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    take(bytes, cursor, len)
}
