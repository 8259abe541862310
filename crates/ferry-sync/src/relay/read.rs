//! Reading rows and replicas from Postgres, inside the pass's REPEATABLE READ snapshot.
//! Every value is read through its column's canonical expression and cast once more to
//! the type its affinity decodes from, so a value reads the same in every pass and in
//! every digest.

use std::sync::Arc;

use sqlx::{PgConnection, Row};

use super::spec::{KeyColumn, RouteSpec, Spec, TableSpec, key_text, split_key_text};
use crate::value::{Affinity, Value};

/// One row as the planner sees it.
#[derive(Clone, Debug)]
pub struct Fetched {
    pub key: String,
    /// One value per column, in the table's column order.
    pub values: Arc<Vec<Value>>,
    /// The broadcast partition's value as text (`""` when unpartitioned).
    pub partition: String,
    /// The replica an `assigned` column names, as text.
    pub assigned: Option<String>,
    /// Per parent slot, the parent's key text, or `None` when a referencing column is null.
    pub parents: Vec<Option<String>>,
    /// Whether the `active` view shows it (true without one).
    pub shown: bool,
}

/// Which rows of a table to read.
pub enum Filter<'a> {
    /// These keys (canonical key texts); keys that do not parse are skipped.
    Keys(&'a [String]),
    /// Every row.
    All,
    /// Rows of one broadcast partition.
    Partition(&'a str),
    /// Rows an `assigned` column gives to one replica.
    Assigned(&'a str),
    /// Rows whose parent (slot) is one of these keys.
    Parents(usize, &'a [String]),
}

/// Reads rows of `table`. `spec` resolves parents' key types.
pub async fn rows(
    conn: &mut PgConnection,
    spec: &Spec,
    table: &TableSpec,
    filter: Filter<'_>,
) -> Result<Vec<Fetched>, sqlx::Error> {
    let mut select: Vec<String> = table
        .key
        .iter()
        .map(|k| format!("t.{}::text", k.column))
        .collect();
    let partition = match &table.route {
        RouteSpec::Broadcast { partition: Some(c) } => Some(c.clone()),
        _ => None,
    };
    select.push(
        partition
            .as_ref()
            .map_or("''".to_string(), |c| format!("coalesce(t.{c}::text, '')")),
    );
    select.push(match &table.route {
        RouteSpec::Assigned { column } => format!("t.{column}::text"),
        _ => "NULL::text".to_string(),
    });
    for p in &table.parents {
        for c in &p.columns {
            select.push(format!("t.{c}::text"));
        }
    }
    select.push(match &table.active {
        Some(view) => format!(
            "EXISTS (SELECT 1 FROM {view} a WHERE {})",
            table
                .key
                .iter()
                .map(|k| format!("a.{0} = t.{0}", k.column))
                .collect::<Vec<_>>()
                .join(" AND ")
        ),
        None => "true".to_string(),
    });
    for c in &table.columns {
        select.push(format!("({})::{}", c.select, cast_of(c.affinity)));
    }
    let mut sql = format!("SELECT {} FROM {} t", select.join(", "), table.source);
    let mut binds: Vec<Vec<String>> = Vec::new();
    match filter {
        Filter::All => {}
        Filter::Keys(keys) => {
            join_keys(
                &mut sql,
                &mut binds,
                &table.key,
                &table
                    .key
                    .iter()
                    .map(|k| k.column.clone())
                    .collect::<Vec<_>>(),
                keys,
            );
        }
        Filter::Partition(p) => {
            let c = partition.as_deref().unwrap_or("NULL");
            sql.push_str(&format!(" WHERE coalesce(t.{c}::text, '') = $1"));
            binds.push(vec![p.to_string()]);
        }
        Filter::Assigned(r) => {
            let RouteSpec::Assigned { column } = &table.route else {
                return Ok(Vec::new());
            };
            sql.push_str(&format!(" WHERE t.{column} = $1::text::uuid"));
            binds.push(vec![r.to_string()]);
        }
        Filter::Parents(slot, keys) => {
            let parent = &spec.tables[table.parents[slot].table];
            join_keys(
                &mut sql,
                &mut binds,
                &parent.key,
                &table.parents[slot].columns,
                keys,
            );
        }
    }
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
    let scalar = matches!(filter, Filter::Partition(_) | Filter::Assigned(_));
    for b in binds {
        if scalar {
            query = query.bind(b.into_iter().next().unwrap_or_default());
        } else {
            query = query.bind(b);
        }
    }
    let fetched = query.fetch_all(&mut *conn).await?;
    let mut out = Vec::with_capacity(fetched.len());
    for row in fetched {
        out.push(decode(&row, table)?);
    }
    Ok(out)
}

/// Adds `JOIN unnest($1::text[], …) k ON t.col_i = k.p_i::type` for `keys`.
fn join_keys(
    sql: &mut String,
    binds: &mut Vec<Vec<String>>,
    types: &[KeyColumn],
    columns: &[String],
    keys: &[String],
) {
    let n = types.len();
    let mut per_part: Vec<Vec<String>> = vec![Vec::with_capacity(keys.len()); n];
    for key in keys {
        if let Some(parts) = split_key_text(key, n) {
            for (i, p) in parts.into_iter().enumerate() {
                per_part[i].push(p);
            }
        }
    }
    let first = binds.len() + 1;
    let params: Vec<String> = (0..n).map(|i| format!("${}::text[]", first + i)).collect();
    let names: Vec<String> = (0..n).map(|i| format!("p{i}")).collect();
    let on: Vec<String> = (0..n)
        .map(|i| format!("t.{} = k.p{i}::{}", columns[i], types[i].pg_type))
        .collect();
    sql.push_str(&format!(
        " JOIN unnest({}) AS k({}) ON {}",
        params.join(", "),
        names.join(", "),
        on.join(" AND ")
    ));
    binds.extend(per_part);
}

fn cast_of(affinity: Affinity) -> &'static str {
    match affinity {
        Affinity::Integer => "int8",
        Affinity::Real => "float8",
        Affinity::Text => "text",
        Affinity::Blob => "bytea",
    }
}

fn decode(row: &sqlx::postgres::PgRow, table: &TableSpec) -> Result<Fetched, sqlx::Error> {
    let mut i = 0;
    let mut key_parts = Vec::with_capacity(table.key.len());
    for _ in &table.key {
        key_parts.push(row.try_get::<String, _>(i)?);
        i += 1;
    }
    let partition: String = row.try_get(i)?;
    let assigned: Option<String> = row.try_get(i + 1)?;
    i += 2;
    let mut parents = Vec::with_capacity(table.parents.len());
    for p in &table.parents {
        let mut parts = Vec::with_capacity(p.columns.len());
        let mut null = false;
        for _ in &p.columns {
            match row.try_get::<Option<String>, _>(i)? {
                Some(s) => parts.push(s),
                None => null = true,
            }
            i += 1;
        }
        parents.push((!null).then(|| key_text(&parts)));
    }
    let shown: bool = row.try_get(i)?;
    i += 1;
    let mut values = Vec::with_capacity(table.columns.len());
    for c in &table.columns {
        let v = match c.affinity {
            Affinity::Integer => row.try_get::<Option<i64>, _>(i)?.map(Value::Int),
            Affinity::Real => row.try_get::<Option<f64>, _>(i)?.map(Value::Real),
            Affinity::Text => row.try_get::<Option<String>, _>(i)?.map(Value::Text),
            Affinity::Blob => row.try_get::<Option<Vec<u8>>, _>(i)?.map(Value::Blob),
        };
        values.push(v.unwrap_or(Value::Null));
        i += 1;
    }
    Ok(Fetched {
        key: key_text(&key_parts),
        values: Arc::new(values),
        partition,
        assigned,
        parents,
        shown,
    })
}

/// The replicas the rules call live now: id (text), partition (text, `""` when none) and
/// audience (none when the rules name no audiences or the replica's is null).
pub async fn live_replicas(
    conn: &mut PgConnection,
    spec: &Spec,
) -> Result<Vec<(String, String, Option<String>)>, sqlx::Error> {
    let r = &spec.replicas;
    let sql = format!(
        "SELECT t.{}::text, {}, {} FROM {} t{}",
        r.id,
        r.partition
            .as_ref()
            .map_or("''".to_string(), |c| format!("coalesce(t.{c}::text, '')")),
        r.audience
            .as_ref()
            .map_or("NULL::text".to_string(), |c| format!("t.{c}::text")),
        r.relation,
        r.live
            .as_ref()
            .map_or(String::new(), |l| format!(" WHERE ({l})")),
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .fetch_all(&mut *conn)
        .await?;
    rows.iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))
        .collect()
}
