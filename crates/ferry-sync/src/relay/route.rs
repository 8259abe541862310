//! The routes whose placement lives in other relations: `grouped` (a members table and
//! an assignment table) and `routed` (a view pairing rows with replicas). Reads only,
//! inside the pass's snapshot. Keys come back as canonical key texts.

use sqlx::{PgConnection, Row};
use uuid::Uuid;

use super::spec::{RouteSpec, Spec, key_text, split_key_text};

/// The replicas the route gives the row `key` of table `t` to now.
pub async fn replicas_of(
    conn: &mut PgConnection,
    spec: &Spec,
    t: usize,
    key: &str,
) -> Result<Vec<Uuid>, sqlx::Error> {
    let table = &spec.tables[t];
    let Some(parts) = split_key_text(key, table.key.len()) else {
        return Ok(Vec::new());
    };
    match &table.route {
        RouteSpec::Grouped {
            members,
            row,
            group,
            assigned,
            replica,
        } => {
            let sql = format!(
                "SELECT DISTINCT a.{replica} FROM {members} m JOIN {assigned} a ON a.{group} = m.{group}
                 WHERE m.{row} = $1::text::{} AND a.{replica} IS NOT NULL",
                table.key[0].pg_type
            );
            sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                .bind(&parts[0])
                .fetch_all(&mut *conn)
                .await
        }
        RouteSpec::Routed { view, row, replica } => {
            let conds: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(i, c)| format!("v.{c} = ${}::text::{}", i + 1, table.key[i].pg_type))
                .collect();
            let sql = format!(
                "SELECT DISTINCT v.{replica} FROM {view} v WHERE {} AND v.{replica} IS NOT NULL",
                conds.join(" AND ")
            );
            let mut q = sqlx::query_scalar(sqlx::AssertSqlSafe(sql));
            for p in &parts {
                q = q.bind(p);
            }
            q.fetch_all(&mut *conn).await
        }
        _ => Ok(Vec::new()),
    }
}

/// Every row of table `t` the route gives to replica `r` (provisioning).
pub async fn keys_for(
    conn: &mut PgConnection,
    spec: &Spec,
    t: usize,
    r: Uuid,
) -> Result<Vec<String>, sqlx::Error> {
    let table = &spec.tables[t];
    let sql = match &table.route {
        RouteSpec::Grouped {
            members,
            row,
            group,
            assigned,
            replica,
        } => format!(
            "SELECT DISTINCT m.{row}::text FROM {members} m JOIN {assigned} a ON a.{group} = m.{group} WHERE a.{replica} = $1"
        ),
        RouteSpec::Routed { view, row, replica } => format!(
            "SELECT DISTINCT {} FROM {view} v WHERE v.{replica} = $1",
            row.iter()
                .map(|c| format!("v.{c}::text"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        _ => return Ok(Vec::new()),
    };
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(r)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows.iter().filter_map(key_of).collect())
}

/// The rows of grouped table `t` in group `group` (a `group` note: its assignment changed).
pub async fn keys_in_group(
    conn: &mut PgConnection,
    spec: &Spec,
    t: usize,
    group_value: &str,
) -> Result<Vec<String>, sqlx::Error> {
    let RouteSpec::Grouped {
        members,
        row,
        group,
        ..
    } = &spec.tables[t].route
    else {
        return Ok(Vec::new());
    };
    let sql = format!("SELECT DISTINCT m.{row}::text FROM {members} m WHERE m.{group}::text = $1");
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(group_value)
        .fetch_all(&mut *conn)
        .await?;
    Ok(rows.iter().filter_map(key_of).collect())
}

/// Every row routed table `t`'s view pairs with anyone, and every row held of it (a
/// `routed` note: something the view reads changed).
pub async fn keys_routed(
    conn: &mut PgConnection,
    spec: &Spec,
    t: usize,
) -> Result<Vec<String>, sqlx::Error> {
    let table = &spec.tables[t];
    let RouteSpec::Routed { view, row, .. } = &table.route else {
        return Ok(Vec::new());
    };
    let sql = format!(
        "SELECT DISTINCT {} FROM {view} v",
        row.iter()
            .map(|c| format!("v.{c}::text"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .fetch_all(&mut *conn)
        .await?;
    let mut keys: Vec<String> = rows.iter().filter_map(key_of).collect();
    let held: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT key FROM ferry_sync.held WHERE relation = $1")
            .bind(&table.relation)
            .fetch_all(&mut *conn)
            .await?;
    keys.extend(held);
    keys.sort();
    keys.dedup();
    Ok(keys)
}

/// The canonical key text of a row of text columns; `None` if any is null.
fn key_of(row: &sqlx::postgres::PgRow) -> Option<String> {
    let parts: Option<Vec<String>> = (0..row.len())
        .map(|i| row.try_get::<Option<String>, _>(i).ok().flatten())
        .collect();
    parts.map(|p| key_text(&p))
}
