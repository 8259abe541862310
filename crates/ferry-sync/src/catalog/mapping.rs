//! How a Postgres column becomes a SQLite column: its affinity, and the expression the
//! relay selects it with, so that every value arrives in one canonical form (the same
//! text for the same value, whatever the session's settings). Pure.
//!
//! | Postgres type | SQLite affinity | Select expression |
//! |---|---|---|
//! | `int2`, `int4`, `int8` | INTEGER | `col::int8` |
//! | `float4`, `float8` | REAL | `col::float8` |
//! | `numeric` | TEXT (exact) | `col::text` |
//! | `text`, `varchar` | TEXT | `col` |
//! | `bpchar`, `name`, `citext` | TEXT | `col::text` (char(n) loses its trailing blanks, which Postgres ignores too) |
//! | `uuid` | TEXT | `col::text` (lower-case, hyphenated) |
//! | `bool` | INTEGER (0/1) | `col::int4` |
//! | `bytea` | BLOB | `col` |
//! | `timestamptz` | TEXT | `to_char(col AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')` |
//! | `timestamp` | TEXT | `to_char(col, 'YYYY-MM-DD"T"HH24:MI:SS.US')` |
//! | `date` | TEXT | `to_char(col, 'YYYY-MM-DD')` |
//! | `time` | TEXT | `col::text` |
//! | `json`, `jsonb` | TEXT | `col::text` |
//! | an enum | TEXT | `col::text` |
//! | an array of any type above | TEXT (JSON) | `array_to_json(col)::text` |
//! | a domain | as its base type | as its base type |
//!
//! Anything else (`geometry`, `interval`, `timetz`, `money`, `inet`, a composite, …) is
//! refused at start, naming the column: leave it out with `columns = [...]`, or cast it
//! in a `from` view.
//!
//! Key columns (the primary key's parts) must be `uuid`, `int2`, `int4`, `int8`, `text`
//! or `varchar`: those have one text form, which the capture triggers write as the key.

use crate::value::Affinity;
use serde::Serialize;

/// How one column is read. The variant decides both the affinity and the expression.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mapping {
    Integer,
    Float,
    Numeric,
    /// `text`, `varchar`: read as they are.
    Text,
    /// `bpchar`, `name`, `citext`, `time`, `json`, `jsonb`, enums: read through `::text`.
    TextCast,
    Uuid,
    Bool,
    Bytea,
    Timestamptz,
    Timestamp,
    Date,
    Array,
}

/// What the catalog says about a column's type, enough to map it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgType<'a> {
    /// `pg_type.typname` of the type (of the base type, for a domain).
    pub name: &'a str,
    /// `pg_type.typtype`: `b` base, `e` enum, `d` domain (resolved already), `c` composite…
    pub kind: &'a str,
    /// For an array: its element type.
    pub element: Option<(&'a str, &'a str)>,
}

impl Mapping {
    /// The mapping of a type, or `None` when ferry-sync cannot map it.
    pub fn of(ty: &PgType<'_>) -> Option<Mapping> {
        if let Some((name, kind)) = ty.element {
            return scalar(name, kind).map(|_| Mapping::Array);
        }
        scalar(ty.name, ty.kind)
    }

    pub fn affinity(self) -> Affinity {
        match self {
            Mapping::Integer | Mapping::Bool => Affinity::Integer,
            Mapping::Float => Affinity::Real,
            Mapping::Bytea => Affinity::Blob,
            Mapping::Numeric
            | Mapping::Text
            | Mapping::TextCast
            | Mapping::Uuid
            | Mapping::Timestamptz
            | Mapping::Timestamp
            | Mapping::Date
            | Mapping::Array => Affinity::Text,
        }
    }

    /// The select expression over `col`, a column reference already quoted (`"price"`,
    /// `OLD."price"`).
    pub fn expr(self, col: &str) -> String {
        match self {
            Mapping::Integer => format!("{col}::int8"),
            Mapping::Float => format!("{col}::float8"),
            Mapping::Numeric | Mapping::TextCast | Mapping::Uuid => format!("{col}::text"),
            Mapping::Text | Mapping::Bytea => col.to_string(),
            Mapping::Bool => format!("{col}::int4"),
            Mapping::Timestamptz => {
                format!("to_char({col} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')")
            }
            Mapping::Timestamp => format!("to_char({col}, 'YYYY-MM-DD\"T\"HH24:MI:SS.US')"),
            Mapping::Date => format!("to_char({col}, 'YYYY-MM-DD')"),
            Mapping::Array => format!("array_to_json({col})::text"),
        }
    }
}

fn scalar(name: &str, kind: &str) -> Option<Mapping> {
    if kind == "e" {
        return Some(Mapping::TextCast);
    }
    Some(match name {
        "int2" | "int4" | "int8" => Mapping::Integer,
        "float4" | "float8" => Mapping::Float,
        "numeric" => Mapping::Numeric,
        "text" | "varchar" => Mapping::Text,
        "bpchar" | "name" | "citext" | "time" | "json" | "jsonb" => Mapping::TextCast,
        "uuid" => Mapping::Uuid,
        "bool" => Mapping::Bool,
        "bytea" => Mapping::Bytea,
        "timestamptz" => Mapping::Timestamptz,
        "timestamp" => Mapping::Timestamp,
        "date" => Mapping::Date,
        _ => return None,
    })
}

/// How a key part is written in the canonical key text (`docs/sync.md`, "Keys").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyKind {
    /// int2/int4/int8: decimal.
    Int,
    /// uuid: lower-case hyphenated.
    Uuid,
    /// text/varchar: `\` doubled, `|` escaped as `\|`.
    Text,
}

impl KeyKind {
    /// The key kind of a type (`pg_type.typname` of the base type), or `None` when it
    /// cannot be a key part.
    pub fn of(type_name: &str) -> Option<KeyKind> {
        match type_name {
            "int2" | "int4" | "int8" => Some(KeyKind::Int),
            "uuid" => Some(KeyKind::Uuid),
            "text" | "varchar" => Some(KeyKind::Text),
            _ => None,
        }
    }

    /// SQL for this part's text in the canonical key, over `col` (quoted, qualified).
    pub fn text_expr(self, col: &str) -> String {
        match self {
            KeyKind::Int | KeyKind::Uuid => format!("{col}::text"),
            KeyKind::Text => {
                format!("replace(replace({col}::text, E'\\\\', E'\\\\\\\\'), '|', E'\\\\|')")
            }
        }
    }
}

/// SQL for the canonical key text of parts `(kind, column reference)`: each part's text,
/// joined by `|`.
pub fn key_text_expr(parts: &[(KeyKind, String)]) -> String {
    parts
        .iter()
        .map(|(kind, col)| kind.text_expr(col))
        .collect::<Vec<_>>()
        .join(" || '|' || ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ty<'a>(name: &'a str) -> PgType<'a> {
        PgType {
            name,
            kind: "b",
            element: None,
        }
    }

    #[test]
    fn every_listed_type_maps_and_others_do_not() {
        let cases = [
            ("int2", Affinity::Integer, "\"c\"::int8"),
            ("int8", Affinity::Integer, "\"c\"::int8"),
            ("float4", Affinity::Real, "\"c\"::float8"),
            ("numeric", Affinity::Text, "\"c\"::text"),
            ("varchar", Affinity::Text, "\"c\""),
            ("citext", Affinity::Text, "\"c\"::text"),
            ("bool", Affinity::Integer, "\"c\"::int4"),
            ("bytea", Affinity::Blob, "\"c\""),
            ("date", Affinity::Text, "to_char(\"c\", 'YYYY-MM-DD')"),
            ("jsonb", Affinity::Text, "\"c\"::text"),
        ];
        for (name, affinity, expr) in cases {
            let m = Mapping::of(&ty(name)).unwrap_or_else(|| panic!("{name} maps"));
            assert_eq!(
                (m.affinity(), m.expr("\"c\"").as_str()),
                (affinity, expr),
                "{name}"
            );
        }
        for name in ["geometry", "interval", "timetz", "money", "inet", "point"] {
            assert_eq!(Mapping::of(&ty(name)), None, "{name}");
        }
        let enum_ty = PgType {
            name: "mood",
            kind: "e",
            element: None,
        };
        assert_eq!(Mapping::of(&enum_ty), Some(Mapping::TextCast));
        let array = PgType {
            name: "_mood",
            kind: "b",
            element: Some(("mood", "e")),
        };
        assert_eq!(Mapping::of(&array), Some(Mapping::Array));
        let bad_array = PgType {
            name: "_interval",
            kind: "b",
            element: Some(("interval", "b")),
        };
        assert_eq!(Mapping::of(&bad_array), None);
    }

    #[test]
    fn key_text_escapes_text_parts_only() {
        let sql = key_text_expr(&[
            (KeyKind::Int, "NEW.\"a\"".into()),
            (KeyKind::Text, "NEW.\"b\"".into()),
        ]);
        assert_eq!(
            sql,
            "NEW.\"a\"::text || '|' || replace(replace(NEW.\"b\"::text, E'\\\\', E'\\\\\\\\'), '|', E'\\\\|')"
        );
    }
}
