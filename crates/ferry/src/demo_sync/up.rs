//! The way up in the sync part of `ferry demo` (docs/sync-up.md): the stores' tills
//! write sales (a record table) into their SQLite files, online or not, and each till
//! keeps a setting row the server may wish values onto.
//!
//! - Every sale a store wrote must be on the server once: none lost (not while the store
//!   was offline, not across a server restored from an older copy), none twice.
//! - A price list wished onto store A's till is carried out there and answered
//!   `applied`.
//! - The server's copy of every till setting is the store's.

use super::*;

pub(super) const SCHEMA_UP: &str = "
CREATE TABLE sales (id uuid PRIMARY KEY, store_id uuid NOT NULL, amount numeric(10,2) NOT NULL,
  sold_at text);
CREATE TABLE tills (store_id uuid PRIMARY KEY, price_list text NOT NULL, rev int8 NOT NULL);
";

pub(super) const RULES_UP: &str = r#"
# What the stores write: their sales, filed once each under the store that sent them...
[tables.sales]
mirror = "record"
replica = "store_id"
lane = "sales"

# ...and their till's settings, which the server may wish values onto.
[tables.tills]
mirror = "setting"
replica = "store_id"
version = "rev"
desired = ["price_list"]
"#;

/// The sales the demo's stores wrote, as their tills would.
#[derive(Default)]
pub(super) struct Sales {
    pub(super) ids: BTreeSet<Uuid>,
    pub(super) offline: usize,
}

impl Sales {
    /// Store `s` sells `n` things in one transaction of its own SQLite file (its replica
    /// process may be running or not: the file is the store's).
    pub(super) fn sell(&mut self, s: &Store, n: usize, offline: bool) -> anyhow::Result<()> {
        let mut conn = store_conn(&s.db)?;
        let tx = conn.transaction()?;
        for i in 0..n {
            let id = Uuid::new_v4();
            tx.execute(
                "INSERT INTO sales (id, store_id, amount, sold_at) VALUES (?1, ?2, ?3, datetime('now'))",
                rusqlite::params![id.to_string(), s.id.to_string(), format!("{}.50", 3 + i)],
            )?;
            self.ids.insert(id);
        }
        tx.commit()?;
        if offline {
            self.offline += n;
        }
        Ok(())
    }
}

fn store_conn(db: &Path) -> anyhow::Result<Connection> {
    let conn = Connection::open(db).with_context(|| format!("opening {}", db.display()))?;
    conn.busy_timeout(Duration::from_secs(10))?;
    Ok(conn)
}

/// Store `s` opens its till at price list `spring`, version 1.
pub(super) fn open_till(s: &Store) -> anyhow::Result<()> {
    store_conn(&s.db)?.execute(
        "INSERT INTO tills (store_id, price_list, rev) VALUES (?1, 'spring', 1)",
        [s.id.to_string()],
    )?;
    Ok(())
}

/// The till's price list and version in store `s`'s file.
pub(super) fn till(s: &Store) -> anyhow::Result<(String, i64)> {
    Ok(store_conn(&s.db)?.query_row(
        "SELECT price_list, rev FROM tills WHERE store_id = ?1",
        [s.id.to_string()],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?)
}

/// Until the server holds exactly the sales the stores wrote; how long it took.
pub(super) async fn wait_filed(
    pool: &PgPool,
    sales: &Sales,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    loop {
        let filed: BTreeSet<Uuid> = sqlx::query_scalar("SELECT id FROM sales")
            .fetch_all(pool)
            .await?
            .into_iter()
            .collect();
        if filed == sales.ids {
            return Ok(start.elapsed());
        }
        if start.elapsed() > limit {
            let missing = sales.ids.difference(&filed).count();
            let extra = filed.difference(&sales.ids).count();
            bail!(
                "after {limit:?} the server holds {} sales: {missing} of the {} the stores wrote are missing, {extra} are not theirs",
                filed.len(),
                sales.ids.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Until the server's copy of every store's till equals the store's.
pub(super) async fn wait_tills(
    pool: &PgPool,
    stores: &[Store],
    limit: Duration,
) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        let mut same = true;
        for s in stores {
            let server: Option<(String, i64)> =
                sqlx::query_as("SELECT price_list, rev FROM tills WHERE store_id = $1")
                    .bind(s.id)
                    .fetch_optional(pool)
                    .await?;
            same &= server == Some(till(s)?);
        }
        if same {
            return Ok(());
        }
        ensure!(
            start.elapsed() < limit,
            "after {limit:?} the server's tills are not the stores'"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wishes price list `price` onto store `s`'s till, in a transaction with another write
/// of the shop's; waits until the store answered (and the answer was filed). Returns the
/// answer and how long it took from the commit.
pub(super) async fn wish_price(
    pool: &PgPool,
    s: &Store,
    price: &str,
    limit: Duration,
) -> anyhow::Result<(String, Duration)> {
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE stores SET name = name WHERE id = $1")
        .bind(s.id)
        .execute(&mut *tx)
        .await?;
    ferry_sync::wish::wish(
        &mut tx,
        s.id,
        "tills",
        &serde_json::json!([s.id]),
        &serde_json::json!({ "price_list": price }),
        None,
        Some("the summer price list"),
    )
    .await?;
    tx.commit().await?;
    let committed = Instant::now();
    loop {
        let mut conn = pool.acquire().await?;
        let state = ferry_sync::wish::wishes(&mut conn, Some(s.id))
            .await?
            .into_iter()
            .next()
            .map(|w| w.state);
        if let Some(state) = state.filter(|s| s != "pending") {
            return Ok((state, committed.elapsed()));
        }
        ensure!(
            committed.elapsed() < limit,
            "store {} did not answer the wish within {limit:?}",
            s.label
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A copy of the demo's database as it is now (`pg_dump`), to restore later.
pub(super) fn backup(url: &str, file: &Path) -> anyhow::Result<()> {
    let out = Command::new(pg_bin("pg_dump"))
        .args(["--format=custom", "--file"])
        .arg(file)
        .arg(url)
        .output()
        .context("running pg_dump (Postgres client binaries: apt install postgresql-client)")?;
    ensure!(
        out.status.success(),
        "pg_dump failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Puts the database back as `file` has it: dropped (its sessions ended), created again
/// and restored, as an operator restoring last night's backup would.
pub(super) async fn restore(
    admin_url: &str,
    name: &str,
    url: &str,
    file: &Path,
) -> anyhow::Result<()> {
    let mut admin = PgConnection::connect(admin_url).await?;
    for sql in [
        format!("DROP DATABASE {name} WITH (FORCE)"),
        format!("CREATE DATABASE {name}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut admin)
            .await?;
    }
    let _ = admin.close().await;
    let out = Command::new(pg_bin("pg_restore"))
        .args(["--exit-on-error", "--dbname"])
        .arg(url)
        .arg(file)
        .output()
        .context("running pg_restore")?;
    ensure!(
        out.status.success(),
        "pg_restore failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
