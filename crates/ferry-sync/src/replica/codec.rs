//! Values to and from the engine's tables and SQLite.
//!
//! Keys in the engine's tables (`_ferry_sync_sweep`, `_ferry_sync_rejections`,
//! `_ferry_sync_retired`) are the key parts' wire encodings ([`crate::value`])
//! concatenated: one encoding per value, so equal keys are equal bytes. Decoding reads
//! back only what `encode` wrote; a key that does not decode is reported as damage, never
//! a panic.

use crate::value::{self, Value};
use rusqlite::types::{ToSqlOutput, ValueRef};

/// The encoding of a key (or any list of values), as stored in the engine's tables.
pub(crate) fn encode(values: &[Value]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 9);
    for v in values {
        // Infallible: a NaN (which neither the wire decoder nor SQLite lets through) is
        // written by its bits.
        value::write_value(v, &mut out);
    }
    out
}

/// The values `encode` wrote, or `None` when `bytes` is not such an encoding.
pub(crate) fn decode(bytes: &[u8]) -> Option<Vec<Value>> {
    let mut at = 0;
    let mut values = Vec::new();
    while at < bytes.len() {
        values.push(value::decode_value(bytes, &mut at).ok()?);
    }
    Some(values)
}

/// A value read back from SQLite, by its storage class.
pub(crate) fn from_sql(v: ValueRef<'_>) -> Value {
    match v {
        ValueRef::Null => Value::Null,
        ValueRef::Integer(i) => Value::Int(i),
        ValueRef::Real(r) => Value::Real(r),
        ValueRef::Text(t) => Value::Text(String::from_utf8_lossy(t).into_owned()),
        ValueRef::Blob(b) => Value::Blob(b.to_vec()),
    }
}

/// A value as a statement parameter.
/// A JSON value as a SQLite value: numbers as integers where they are, booleans as 0/1,
/// arrays and objects as their JSON text (a key the triggers wrote with `json_array`, a
/// wish's values).
pub(crate) fn from_json(v: serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::Null,
        serde_json::Value::Bool(b) => Value::Int(i64::from(b)),
        serde_json::Value::Number(n) => n
            .as_i64()
            .map(Value::Int)
            .unwrap_or_else(|| Value::Real(n.as_f64().unwrap_or(0.0))),
        serde_json::Value::String(s) => Value::Text(s),
        other => Value::Text(other.to_string()),
    }
}

pub(crate) fn to_sql(v: &Value) -> ToSqlOutput<'_> {
    match v {
        Value::Null => ToSqlOutput::Borrowed(ValueRef::Null),
        Value::Int(i) => ToSqlOutput::Borrowed(ValueRef::Integer(*i)),
        Value::Real(r) => ToSqlOutput::Borrowed(ValueRef::Real(*r)),
        Value::Text(t) => ToSqlOutput::Borrowed(ValueRef::Text(t.as_bytes())),
        Value::Blob(b) => ToSqlOutput::Borrowed(ValueRef::Blob(b)),
    }
}

/// Values as a statement's parameters, in order.
pub(crate) fn params(values: &[Value]) -> impl rusqlite::Params + '_ {
    rusqlite::params_from_iter(values.iter().map(to_sql))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_damage_is_refused() {
        let key = vec![
            Value::Int(-7),
            Value::Text("é|x".into()),
            Value::Blob(vec![0, 1]),
            Value::Null,
            Value::Real(1.5),
        ];
        assert_eq!(decode(&encode(&key)), Some(key.clone()));
        let bytes = encode(&key);
        assert_eq!(decode(&bytes[..bytes.len() - 1]), None);
        assert_eq!(decode(&[9]), None);
    }
}
