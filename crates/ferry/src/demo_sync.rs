//! The sync part of `ferry demo`: ferry-sync keeps each store's SQLite copy of a shop
//! exactly as its rules say, through the faults a shop meets.
//!
//! 1. On the Postgres `scripts/test` uses (`FERRY_TEST_PG`, by default
//!    postgres://postgres@127.0.0.1:5432), or one the demo starts when none answers, a
//!    database of the demo's own (dropped at the end) gets the shop: products broadcast
//!    to the stores of their region, orders assigned to a store, order lines following
//!    their order, customers pulled in by closure. `install` and three stores enrolled.
//! 2. Two `ferry sync serve` processes (this binary): one holds the relay lock, the other
//!    stands by. Three `ferry sync replica` processes, one per store, reach them through
//!    a TCP proxy in this process (the "network"), which tries the serves in turn.
//! 3. After the first sync one store goes offline (SIGKILL of its replica process); the
//!    shop keeps writing (orders placed, changed, moved, deleted; customers renamed;
//!    prices changed) while the demo measures, for a marked product change, the time
//!    from the commit to the moment the online stores' SQLite files show it.
//! 4. The relay-holding serve is SIGKILLed; the demo measures how long until the
//!    standby holds the lock. Then the network is cut (connections dropped, new ones
//!    refused) for two seconds of writes and restored; an order moves between stores;
//!    the offline store comes back.
//! 5. The way up (`up.rs`) runs through the same story: each store's till opens a
//!    setting row and sells into its own file, and a backup of the database is taken;
//!    store B sells while offline; the server wishes a price list onto store A's till,
//!    which answers; when B is back its sales are filed; then, after more sales, the
//!    database is restored from the backup, and every sale must stand on the server
//!    once and every till be its store's.
//! 6. When every store stands synced, the demo compares each store's SQLite content,
//!    row by row and column by column, with what the rules say it holds, computed in
//!    SQL from Postgres.

mod postgres;
mod processes;
mod proxy;
mod up;
use postgres::*;
use processes::*;
use proxy::*;
use up::*;

use crate::report::{fact, say};
use anyhow::{Context, anyhow, bail, ensure};
use ferry_core::seams::{Rng, SplitMix64};
use rusqlite::{Connection, OpenFlags};
use sqlx::{Connection as _, PgConnection, PgPool, Row};
use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

const SCHEMA: &str = "
CREATE TABLE stores (id uuid PRIMARY KEY, name text NOT NULL, region text NOT NULL, open bool NOT NULL DEFAULT true);
CREATE TABLE products (id int8 PRIMARY KEY, name text NOT NULL, price numeric(10,2), region text NOT NULL);
CREATE TABLE customers (id uuid PRIMARY KEY, name text NOT NULL);
CREATE TABLE orders (id uuid PRIMARY KEY, store_id uuid NOT NULL REFERENCES stores,
  customer_id uuid REFERENCES customers, note text, placed_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE order_lines (order_id uuid REFERENCES orders ON DELETE CASCADE, line int4,
  product_id int8 REFERENCES products, qty int4 NOT NULL, PRIMARY KEY (order_id, line));
";

const RULES: &str = r#"# The demo shop: which relation lists the stores, and how each table reaches them.
[replicas]
relation = "stores"
live = "open"
partition = "region"

[tables.products]
sync = "broadcast"
partition = "region"

[tables.customers]

[tables.orders]
sync = { assigned = "store_id" }

[tables.order_lines]
sync = { follows = "order_id" }
"#;

/// Products 1..=60 are the north's, 61..=120 the south's.
const PRODUCTS: i64 = 120;
const NORTH_MARK: i64 = 1;
const SOUTH_MARK: i64 = 61;
/// A and C in the north, B (the one that goes offline) in the south.
const STORES: [(&str, &str); 3] = [("A", "north"), ("B", "south"), ("C", "north")];
/// Store B goes offline.
const OFFLINE: usize = 1;
/// Lag samples in each of the three calm stretches.
const SAMPLES: [usize; 3] = [20, 20, 10];

pub fn run(root: &Path) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(demo(root))
}

async fn demo(root: &Path) -> anyhow::Result<()> {
    say!();
    say!(
        "ferry demo: ferry-sync keeps each store's SQLite copy of a Postgres shop exactly as its rules say"
    );
    let dir = root.join("sync");
    std::fs::create_dir_all(&dir)?;
    let pg = Postgres::find_or_start(&dir)?;
    say!("  Postgres: {} ({})", pg.base, pg.origin);
    let name = format!(
        "ferry_demo_sync_{}",
        &Uuid::new_v4().simple().to_string()[..10]
    );
    let mut admin = PgConnection::connect(&pg.url("postgres"))
        .await
        .with_context(|| format!("cannot connect to Postgres at {}", pg.base))?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .context("creating the demo's database")?;
    let url = pg.url(&name);
    let mut kids = Kids::default();
    let db = Db {
        admin: pg.url("postgres"),
        name: name.clone(),
        url: url.clone(),
    };
    let result = match PgPool::connect(&url).await {
        Ok(pool) => {
            let r = shop(&dir, &db, &pool, &mut kids).await;
            pool.close().await;
            r
        }
        Err(e) => Err(anyhow!(e).context("connecting to the demo's database")),
    };
    // Every path ends here: the processes first, then the database.
    drop(kids);
    let dropped = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await;
    let _ = admin.close().await;
    drop(pg);
    result?;
    dropped.context("dropping the demo's database")?;
    Ok(())
}

/// The demo's database: where to reach it, and as whom to drop and create it.
struct Db {
    admin: String,
    name: String,
    url: String,
}

async fn shop(dir: &Path, db: &Db, pool: &PgPool, kids: &mut Kids) -> anyhow::Result<()> {
    let started = Instant::now();
    let url = db.url.as_str();
    sqlx::raw_sql(SCHEMA).execute(pool).await?;
    sqlx::raw_sql(SCHEMA_UP).execute(pool).await?;
    let rules_file = dir.join("shop.toml");
    let rules_text = format!("{RULES}{RULES_UP}");
    std::fs::write(&rules_file, &rules_text)?;
    let rules = ferry_sync::rules::Rules::parse(&rules_text, &rules_file)?;
    ferry_sync::schema::install(pool, &rules).await?;

    // The stores, enrolled, each with its token file and its SQLite file.
    let mut stores = Vec::new();
    for (label, region) in STORES {
        let id = Uuid::new_v4();
        sqlx::query("INSERT INTO stores (id, name, region) VALUES ($1, $2, $3)")
            .bind(id)
            .bind(format!("store {label}"))
            .bind(region)
            .execute(pool)
            .await?;
        let token = ferry_sync::enroll::new_token();
        let mut conn = pool.acquire().await?;
        ferry_sync::enroll::enroll(&mut conn, id, &token).await?;
        let token_file = dir.join(format!("store-{label}.token"));
        std::fs::write(&token_file, format!("{token}\n"))?;
        stores.push(Store {
            label,
            region,
            id,
            db: dir.join(format!("store-{label}.db")),
            token_file,
        });
    }
    let mut w = Writer::new(
        pool.clone(),
        stores.iter().map(|s| (s.id, s.region)).collect(),
    );
    w.seed().await?;
    // The order that moves from store A to store C, with a customer of its own.
    let moving = w
        .place_order(stores[0].id, Some("moves from A to C"), true)
        .await?;
    say!(
        "  the shop: {} products (north and south), {} customers, {} orders with lines; stores A and C in the north, B in the south, enrolled; `ferry sync install` done",
        PRODUCTS,
        w.customers.len(),
        w.orders.len()
    );

    // Two serve processes; one takes the relay lock.
    let ports = [free_port()?, free_port()?];
    for (i, port) in ports.iter().enumerate() {
        kids.serve(i, dir, &rules_file, url, *port)?;
    }
    for port in ports {
        wait_healthy(port, dir).await?;
    }
    let holder = wait_holder(&ports, Duration::from_secs(15)).await?;
    let standby = 1 - holder;
    // The network between the stores and the serves: first the holder, else the other.
    let proxy = Proxy::start(vec![
        SocketAddr::from(([127, 0, 0, 1], ports[holder])),
        SocketAddr::from(([127, 0, 0, 1], ports[standby])),
    ])?;
    for (i, s) in stores.iter().enumerate() {
        kids.replica(i, s, &proxy.url(), dir)?;
    }
    let first = Instant::now();
    wait_synced(pool, kids, Duration::from_secs(30)).await?;
    let first_sync = first.elapsed();
    say!(
        "  two `ferry sync serve` processes: serve {} holds the relay lock, serve {} stands by; three `ferry sync replica` processes reach them through a TCP proxy; all three stores synced {} after they started",
        holder + 1,
        standby + 1,
        ms(first_sync)
    );

    // The tills open and sell; then last night's backup is taken.
    let mut sales = Sales::default();
    for s in &stores {
        open_till(s)?;
        sales.sell(s, 5, false)?;
    }
    let filed_in = wait_filed(pool, &sales, Duration::from_secs(30)).await?;
    wait_tills(pool, &stores, Duration::from_secs(30)).await?;
    let backup_file = dir.join("shop.backup");
    backup(url, &backup_file)?;
    say!(
        "  the way up: each store's till opened (a setting row) and sold 5 things into its own SQLite file; all {} sales were on the server {} after the last was written; a backup of the database was taken (pg_dump)",
        sales.ids.len(),
        ms(Some(filed_in))
    );

    // Store B goes offline.
    kids.kill(Kid::Replica(OFFLINE));
    sales.sell(&stores[OFFLINE], 20, true)?;
    let offline_at = Instant::now();
    let changes_before_offline = w.changes;
    let online: Vec<&Store> = stores
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != OFFLINE)
        .map(|(_, s)| s)
        .collect();
    let mut watch = Watch::default();
    let mut lags = Vec::new();
    for _ in 0..SAMPLES[0] {
        w.background().await?;
        lags.push(w.sample(&mut watch, &online, kids).await?);
    }

    // The relay-holding serve dies; the standby takes over while the shop writes.
    kids.kill(Kid::Serve(holder));
    let killed = Instant::now();
    let mark = w.mark().await?;
    let mut takeover = None;
    let mut across = None;
    while takeover.is_none() || across.is_none() {
        ensure!(
            killed.elapsed() < Duration::from_secs(15),
            "after the relay-holding serve was killed: takeover {:?}, change seen {:?} (see {})",
            takeover,
            across,
            dir.display()
        );
        if takeover.is_none() && holding(ports[standby]).await == Some(true) {
            takeover = Some(killed.elapsed());
        }
        if across.is_none() && watch.sees(&online, &mark)? {
            across = Some(mark.committed.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let (takeover, across) = (takeover.unwrap_or_default(), across.unwrap_or_default());
    say!(
        "  store B went offline (its replica SIGKILLed); {} lag samples, then the relay-holding serve was SIGKILLed: serve {} held the lock {} later (--standby-ms 1000); a change committed at the kill reached the online stores in {}",
        SAMPLES[0],
        standby + 1,
        ms(takeover),
        ms(across)
    );
    for _ in 0..SAMPLES[1] {
        w.background().await?;
        lags.push(w.sample(&mut watch, &online, kids).await?);
    }

    // The server wishes a summer price list onto store A's till.
    let (answer, wished_in) =
        wish_price(pool, &stores[0], "summer", Duration::from_secs(30)).await?;
    let a_till = till(&stores[0])?;
    say!(
        "  wished price list \"summer\" onto store A's till (in a transaction of the shop's own): A carried it out and its answer \"{answer}\" was filed {} after the commit; A's till reads {:?} at version {}",
        ms(Some(wished_in)),
        a_till.0,
        a_till.1
    );
    ensure!(
        answer == "applied" && a_till == ("summer".to_string(), 2),
        "store A answered {answer:?} and its till reads {a_till:?}"
    );

    // The network is cut for two seconds of writes, then restored.
    proxy.cut();
    let cut_at = Instant::now();
    let before_cut = w.changes;
    while cut_at.elapsed() < Duration::from_secs(2) {
        w.background().await?;
        w.mark().await?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let last = w.mark().await?;
    let during_cut = w.changes - before_cut;
    proxy.restore();
    let restored = Instant::now();
    wait_until(
        Duration::from_secs(30),
        "the stores to see the writes made while the network was cut",
        || watch.sees(&online, &last),
    )
    .await?;
    let after_cut = restored.elapsed();
    say!(
        "  cut the network (connections dropped, new ones refused) for {:.1} s while {} changes were written; the online stores showed the last one {} after it was restored (the replicas retry on a jittered exponential backoff from 200 ms)",
        restored.duration_since(cut_at).as_secs_f64(),
        during_cut,
        ms(after_cut)
    );

    // An order moves from store A to store C.
    let moved = w.reassign(moving, stores[2].id).await?;
    let (a, c) = (&stores[0], &stores[2]);
    wait_until(
        Duration::from_secs(30),
        "the moved order to leave A and reach C",
        || moved_over(&a.db, &c.db, moving.0, moving.1),
    )
    .await?;
    let move_secs = moved.elapsed();
    say!(
        "  moved an order (2 lines, a customer no other order of A names) from store A to store C: C held it, its lines and its customer, and A none of them, {} after the commit",
        ms(Some(move_secs))
    );
    for _ in 0..SAMPLES[2] {
        w.background().await?;
        lags.push(w.sample(&mut watch, &online, kids).await?);
    }

    // Store B comes back.
    let offline_for = offline_at.elapsed();
    let missed = w.changes - changes_before_offline;
    kids.replica(OFFLINE, &stores[OFFLINE], &proxy.url(), dir)?;
    let back = Instant::now();
    wait_synced(pool, kids, Duration::from_secs(30)).await?;
    let caught_up = back.elapsed();
    let offline_filed = wait_filed(pool, &sales, Duration::from_secs(30)).await?;
    say!(
        "  store B's {} sales written while it was offline were filed once each when it came back (all {} sales on the server {} after it synced)",
        sales.offline,
        sales.ids.len(),
        ms(Some(offline_filed))
    );
    let st = ferry_sync::status::read(pool, None).await?;
    let quarantined: i64 = st.replicas.iter().map(|r| r.quarantined).sum();
    say!(
        "  store B came back after {:.1} s offline ({missed} changes written meanwhile) and all three stores stood synced {} later; {} changes written in all; rows quarantined: {quarantined}, notes parked: {}",
        offline_for.as_secs_f64(),
        ms(Some(caught_up)),
        w.changes,
        st.notes_parked
    );

    // The stores sell more, filed; then the database is restored from last night's backup,
    // which has none of the sales since, nor the wish.
    for s in &stores {
        sales.sell(s, 5, false)?;
    }
    wait_filed(pool, &sales, Duration::from_secs(30)).await?;
    let before_restore: i64 = sqlx::query_scalar("SELECT count(*) FROM sales")
        .fetch_one(pool)
        .await?;
    kids.kill(Kid::Serve(0));
    kids.kill(Kid::Serve(1));
    restore(&db.admin, &db.name, url, &backup_file).await?;
    let restored_at = Instant::now();
    let after_restore: i64 = sqlx::query_scalar("SELECT count(*) FROM sales")
        .fetch_one(pool)
        .await?;
    for (i, port) in ports.iter().enumerate() {
        kids.serve(i, dir, &rules_file, url, *port)?;
    }
    for port in ports {
        wait_healthy(port, dir).await?;
    }
    // The restored database says every store is synced, at the backup's epoch: wait for
    // the relay to find out from the stores' reports and take a new one.
    let old_epoch: Uuid = sqlx::query_scalar("SELECT epoch FROM ferry_sync.meta")
        .fetch_one(pool)
        .await?;
    loop {
        let epoch: Uuid = sqlx::query_scalar("SELECT epoch FROM ferry_sync.meta")
            .fetch_one(pool)
            .await?;
        if epoch != old_epoch {
            break;
        }
        ensure!(
            restored_at.elapsed() < Duration::from_secs(60),
            "the relay took no new epoch within 60 s of the restore"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    wait_synced(pool, kids, Duration::from_secs(60)).await?;
    wait_filed(pool, &sales, Duration::from_secs(60)).await?;
    let refiled_in = restored_at.elapsed();
    wait_tills(pool, &stores, Duration::from_secs(30)).await?;
    say!(
        "  restored the database from the backup (serves stopped, dropped, pg_restore, serves started): it held {after_restore} of the {before_restore} sales; the stores were provisioned under a new epoch, sent their journals again, and all {} sales stood on the server once each {} after the restore; every till setting on the server is its store's again",
        sales.ids.len(),
        ms(Some(refiled_in))
    );
    fact("sync", "sales", sales.ids.len());
    fact("sync", "sales_written_offline", sales.offline);
    fact(
        "sync",
        "sales_lost_by_the_restore",
        before_restore - after_restore,
    );
    fact("sync", "wish_answer", answer.as_str());
    fact("sync", "wish_answered_ms", msf(wished_in));

    // The check: every store's content against what the rules say.
    let mut rows = Vec::new();
    let mut differ = Vec::new();
    let mut per_store = Vec::new();
    for s in &stores {
        let want = expected(pool, s.id).await?;
        let got = held(&s.db)?;
        let same = want == got;
        let mut row = vec![s.label.to_string(), s.region.to_string()];
        for t in TABLES {
            let (h, e) = (got[t.0].len(), want[t.0].len());
            row.push(if h == e {
                h.to_string()
            } else {
                format!("{h} (want {e})")
            });
        }
        row.push(if same { "yes" } else { "NO" }.to_string());
        rows.push(row);
        per_store.push(serde_json::json!({
            "store": s.label,
            "region": s.region,
            "rows": TABLES.iter().map(|t| (t.0, got[t.0].len())).collect::<BTreeMap<_, _>>(),
            "matches": same,
        }));
        if !same {
            for t in TABLES {
                for r in got[t.0].difference(&want[t.0]).take(3) {
                    differ.push(format!(
                        "store {}: {} holds {r} (the rules say not)",
                        s.label, t.0
                    ));
                }
                for r in want[t.0].difference(&got[t.0]).take(3) {
                    differ.push(format!("store {}: {} lacks {r}", s.label, t.0));
                }
            }
        }
    }
    let table = crate::table::render(
        &[
            "store",
            "region",
            "products",
            "customers",
            "orders",
            "order_lines",
            "matches the rules (content)",
        ],
        &rows,
    );
    for line in table.lines() {
        say!("    {line}");
    }
    for d in &differ {
        say!("    {d}");
    }
    let mut sorted = lags.clone();
    sorted.sort();
    say!(
        "  lag from commit to visible in the online stores' SQLite files: p50 {}, p99 {}, max {} ({} samples outside the faults)",
        ms(percentile(&sorted, 50.0)),
        ms(percentile(&sorted, 99.0)),
        ms(sorted.last().copied()),
        sorted.len()
    );
    let all_match = differ.is_empty();
    say!(
        "  every store holds exactly what the rules say, in content: {} ({:.1} s for the part)",
        if all_match { "yes" } else { "NO" },
        started.elapsed().as_secs_f64()
    );
    fact("sync", "stores", per_store);
    fact("sync", "changes", w.changes);
    fact("sync", "first_sync_ms", first_sync.as_secs_f64() * 1e3);
    fact("sync", "lag_samples", sorted.len());
    fact("sync", "lag_p50_ms", percentile(&sorted, 50.0).map(msf));
    fact("sync", "lag_p99_ms", percentile(&sorted, 99.0).map(msf));
    fact("sync", "lag_max_ms", sorted.last().copied().map(msf));
    fact("sync", "takeover_ms", msf(takeover));
    fact("sync", "lag_across_takeover_ms", msf(across));
    fact(
        "sync",
        "network_cut_ms",
        msf(restored.duration_since(cut_at)),
    );
    fact("sync", "seen_after_restore_ms", msf(after_cut));
    fact("sync", "reassign_ms", msf(move_secs));
    fact("sync", "offline_ms", msf(offline_for));
    fact("sync", "offline_store_synced_ms", msf(caught_up));
    fact("sync", "quarantined", quarantined);
    fact("sync", "all_match", all_match);
    ensure!(quarantined == 0, "{quarantined} rows were quarantined");
    ensure!(
        all_match,
        "a store holds something other than its rules say: {}",
        differ.join("; ")
    );
    Ok(())
}

/// The tables compared, with the columns compared.
const TABLES: [(&str, &str); 4] = [
    ("products", "id, name, price, region"),
    ("customers", "id, name"),
    ("orders", "id, store_id, customer_id, note"),
    ("order_lines", "order_id, line, product_id, qty"),
];

/// What the rules say store `id` holds, read from Postgres in the replica's text form:
/// the products of its region and those its order lines name (closure); its orders;
/// their lines; the customers its orders name (closure).
async fn expected(
    pool: &PgPool,
    id: Uuid,
) -> anyhow::Result<BTreeMap<&'static str, BTreeSet<String>>> {
    let queries: [(&str, &str); 4] = [
        (
            "products",
            "SELECT p.id::text || '|' || p.name || '|' || coalesce(p.price::text, 'NULL') || '|' || p.region FROM products p
             WHERE p.region = (SELECT region FROM stores WHERE id = $1 AND open)
                OR p.id IN (SELECT l.product_id FROM order_lines l JOIN orders o ON o.id = l.order_id
                            JOIN stores s ON s.id = o.store_id WHERE s.id = $1 AND s.open)",
        ),
        (
            "customers",
            "SELECT DISTINCT c.id::text || '|' || c.name FROM customers c JOIN orders o ON o.customer_id = c.id
             JOIN stores s ON s.id = o.store_id WHERE s.id = $1 AND s.open",
        ),
        (
            "orders",
            "SELECT o.id::text || '|' || o.store_id::text || '|' || coalesce(o.customer_id::text, 'NULL') || '|' || coalesce(o.note, 'NULL')
             FROM orders o JOIN stores s ON s.id = o.store_id WHERE s.id = $1 AND s.open",
        ),
        (
            "order_lines",
            "SELECT l.order_id::text || '|' || l.line || '|' || coalesce(l.product_id::text, 'NULL') || '|' || l.qty
             FROM order_lines l JOIN orders o ON o.id = l.order_id JOIN stores s ON s.id = o.store_id WHERE s.id = $1 AND s.open",
        ),
    ];
    let mut out = BTreeMap::new();
    for (table, sql) in queries {
        let rows = sqlx::query(sql).bind(id).fetch_all(pool).await?;
        out.insert(table, rows.iter().map(|r| r.get::<String, _>(0)).collect());
    }
    Ok(out)
}

/// What a store's SQLite file holds, in the same text form.
fn held(db: &Path) -> anyhow::Result<BTreeMap<&'static str, BTreeSet<String>>> {
    let conn = Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .with_context(|| format!("opening {}", db.display()))?;
    let mut out = BTreeMap::new();
    for (table, cols) in TABLES {
        let exists: bool = conn.query_row(
            "SELECT count(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = ?1",
            [table],
            |r| r.get(0),
        )?;
        let mut rows = BTreeSet::new();
        if exists {
            let mut stmt = conn.prepare(&format!("SELECT {cols} FROM \"{table}\""))?;
            let n = cols.split(',').count();
            let mut q = stmt.query([])?;
            while let Some(row) = q.next()? {
                let mut parts = Vec::with_capacity(n);
                for i in 0..n {
                    parts.push(match row.get_ref(i)? {
                        rusqlite::types::ValueRef::Null => "NULL".to_string(),
                        rusqlite::types::ValueRef::Integer(v) => v.to_string(),
                        rusqlite::types::ValueRef::Real(v) => v.to_string(),
                        rusqlite::types::ValueRef::Text(t) => {
                            String::from_utf8_lossy(t).into_owned()
                        }
                        rusqlite::types::ValueRef::Blob(b) => format!("{b:?}"),
                    });
                }
                rows.insert(parts.join("|"));
            }
        }
        out.insert(table, rows);
    }
    Ok(out)
}

/// Store `to` holds the order, its lines and its customer; store `from` none of them.
fn moved_over(from: &Path, to: &Path, order: Uuid, customer: Uuid) -> anyhow::Result<bool> {
    let count = |db: &Path| -> anyhow::Result<(i64, i64, i64)> {
        let c = Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY)?;
        let one = |sql: &str, key: String| -> rusqlite::Result<i64> {
            c.query_row(sql, [key], |r| r.get(0))
        };
        Ok((
            one(
                "SELECT count(*) FROM orders WHERE id = ?1",
                order.to_string(),
            )?,
            one(
                "SELECT count(*) FROM order_lines WHERE order_id = ?1",
                order.to_string(),
            )?,
            one(
                "SELECT count(*) FROM customers WHERE id = ?1",
                customer.to_string(),
            )?,
        ))
    };
    Ok(count(from)? == (0, 0, 0) && count(to)? == (1, 2, 1))
}

struct Store {
    label: &'static str,
    region: &'static str,
    id: Uuid,
    db: PathBuf,
    token_file: PathBuf,
}

/// A marked change: products NORTH_MARK and SOUTH_MARK renamed to `name`.
struct Mark {
    name: String,
    committed: Instant,
}

/// The shop's app: writes changes and remembers what exists.
struct Writer {
    pool: PgPool,
    stores: Vec<(Uuid, &'static str)>,
    rng: SplitMix64,
    customers: Vec<Uuid>,
    /// (order, store, lines).
    orders: Vec<(Uuid, Uuid, i32)>,
    /// Orders background changes leave alone.
    pinned: Vec<Uuid>,
    next_product: i64,
    marks: u64,
    changes: u64,
}

impl Writer {
    fn new(pool: PgPool, stores: Vec<(Uuid, &'static str)>) -> Writer {
        Writer {
            pool,
            stores,
            rng: SplitMix64::from_entropy(),
            customers: Vec::new(),
            orders: Vec::new(),
            pinned: Vec::new(),
            next_product: PRODUCTS + 1,
            marks: 0,
            changes: 0,
        }
    }

    async fn seed(&mut self) -> anyhow::Result<()> {
        sqlx::query(
            "INSERT INTO products (id, name, price, region)
             SELECT g, 'product ' || g, CASE WHEN g % 17 = 0 THEN NULL ELSE (g * 1.25)::numeric(10,2) END,
                    CASE WHEN g <= $1 / 2 THEN 'north' ELSE 'south' END
             FROM generate_series(1, $1) g",
        )
        .bind(PRODUCTS)
        .execute(&self.pool)
        .await?;
        for i in 0..40 {
            let id = Uuid::new_v4();
            sqlx::query("INSERT INTO customers (id, name) VALUES ($1, $2)")
                .bind(id)
                .bind(format!("customer {i}"))
                .execute(&self.pool)
                .await?;
            self.customers.push(id);
        }
        for i in 0..60 {
            let store = self.stores[i % self.stores.len()].0;
            self.place_order(store, None, false).await?;
        }
        self.changes = 0;
        Ok(())
    }

    /// A product of `region` (not a marked one: those change all the time).
    fn product(&mut self, region: &str) -> i64 {
        let half = PRODUCTS / 2;
        let n = 2 + self.rng.below(half as u64 - 1) as i64;
        if region == "north" { n } else { n + half }
    }

    /// An order at `store` with 1 to 3 lines (`fresh`: exactly 2, and a new customer of
    /// its own). Returns (order, customer).
    async fn place_order(
        &mut self,
        store: Uuid,
        note: Option<&str>,
        fresh: bool,
    ) -> anyhow::Result<(Uuid, Uuid)> {
        let region = self
            .stores
            .iter()
            .find(|s| s.0 == store)
            .map_or("north", |s| s.1);
        let mut tx = self.pool.begin().await?;
        let customer = if fresh {
            let c = Uuid::new_v4();
            sqlx::query(
                "INSERT INTO customers (id, name) VALUES ($1, 'a customer of the moving order')",
            )
            .bind(c)
            .execute(&mut *tx)
            .await?;
            Some(c)
        } else if self.rng.below(8) == 0 {
            None
        } else {
            Some(self.customers[self.rng.below(self.customers.len() as u64) as usize])
        };
        let id = Uuid::new_v4();
        let note = note
            .map(str::to_string)
            .or_else(|| (self.rng.below(3) > 0).then(|| format!("note {}", self.rng.below(1000))));
        sqlx::query("INSERT INTO orders (id, store_id, customer_id, note) VALUES ($1, $2, $3, $4)")
            .bind(id)
            .bind(store)
            .bind(customer)
            .bind(note)
            .execute(&mut *tx)
            .await?;
        let lines = if fresh {
            2
        } else {
            1 + self.rng.below(3) as i32
        };
        for line in 1..=lines {
            let product = if fresh {
                2 + line as i64
            } else {
                self.product(region)
            };
            sqlx::query(
                "INSERT INTO order_lines (order_id, line, product_id, qty) VALUES ($1, $2, $3, $4)",
            )
            .bind(id)
            .bind(line)
            .bind(product)
            .bind(1 + self.rng.below(5) as i32)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        self.changes += 1;
        if fresh {
            self.pinned.push(id);
        } else {
            self.orders.push((id, store, lines));
        }
        Ok((id, customer.unwrap_or_default()))
    }

    /// One change of the shop's ordinary day, in its own transaction.
    async fn background(&mut self) -> anyhow::Result<()> {
        let pick = self.rng.below(11);
        if pick == 10 {
            // A new product, in either region.
            let region = if self.rng.below(2) == 0 {
                "north"
            } else {
                "south"
            };
            sqlx::query(
                "INSERT INTO products (id, name, price, region) VALUES ($1, $2, $3::numeric, $4)",
            )
            .bind(self.next_product)
            .bind(format!("new product {}", self.next_product))
            .bind(format!(
                "{}.{:02}",
                self.rng.below(100),
                self.rng.below(100)
            ))
            .bind(region)
            .execute(&self.pool)
            .await?;
            self.next_product += 1;
            self.changes += 1;
            return Ok(());
        }
        if self.orders.is_empty() || pick < 4 {
            let store = self.stores[self.rng.below(self.stores.len() as u64) as usize].0;
            self.place_order(store, None, false).await?;
            return Ok(());
        }
        let i = self.rng.below(self.orders.len() as u64) as usize;
        let (order, store, lines) = self.orders[i];
        match pick {
            4 | 5 => {
                sqlx::query("UPDATE orders SET note = $2 WHERE id = $1")
                    .bind(order)
                    .bind(format!("changed {}", self.rng.below(1_000_000)))
                    .execute(&self.pool)
                    .await?;
            }
            6 => {
                sqlx::query("DELETE FROM orders WHERE id = $1")
                    .bind(order)
                    .execute(&self.pool)
                    .await?;
                self.orders.swap_remove(i);
            }
            7 => {
                let c = self.customers[self.rng.below(self.customers.len() as u64) as usize];
                sqlx::query("UPDATE customers SET name = $2 WHERE id = $1")
                    .bind(c)
                    .bind(format!("customer renamed {}", self.rng.below(1_000_000)))
                    .execute(&self.pool)
                    .await?;
            }
            8 => {
                // A move to another store of the region (its lines name the region's
                // products), or a note where the region has one store.
                let region = self.stores.iter().find(|s| s.0 == store).map(|s| s.1);
                let others: Vec<Uuid> = self
                    .stores
                    .iter()
                    .filter(|s| s.0 != store && Some(s.1) == region)
                    .map(|s| s.0)
                    .collect();
                let to = if others.is_empty() {
                    store
                } else {
                    others[self.rng.below(others.len() as u64) as usize]
                };
                sqlx::query("UPDATE orders SET store_id = $2 WHERE id = $1")
                    .bind(order)
                    .bind(to)
                    .execute(&self.pool)
                    .await?;
                self.orders[i].1 = to;
            }
            _ => {
                sqlx::query(
                    "UPDATE order_lines SET qty = qty + 1 WHERE order_id = $1 AND line = $2",
                )
                .bind(order)
                .bind(1 + self.rng.below(lines as u64) as i32)
                .execute(&self.pool)
                .await?;
            }
        }
        self.changes += 1;
        Ok(())
    }

    /// Rename and reprice the two marked products in one transaction.
    async fn mark(&mut self) -> anyhow::Result<Mark> {
        self.marks += 1;
        let name = format!("marked product, change {}", self.marks);
        sqlx::query(
            "UPDATE products SET name = $1, price = coalesce(price, 0) + 0.01 WHERE id IN ($2, $3)",
        )
        .bind(&name)
        .bind(NORTH_MARK)
        .bind(SOUTH_MARK)
        .execute(&self.pool)
        .await?;
        self.changes += 1;
        Ok(Mark {
            name,
            committed: Instant::now(),
        })
    }

    /// A marked change and the time until every online store shows it.
    async fn sample(
        &mut self,
        watch: &mut Watch,
        online: &[&Store],
        kids: &mut Kids,
    ) -> anyhow::Result<Duration> {
        let mark = self.mark().await?;
        let limit = Duration::from_secs(15);
        loop {
            if watch.sees(online, &mark)? {
                return Ok(mark.committed.elapsed());
            }
            kids.check()?;
            ensure!(
                mark.committed.elapsed() < limit,
                "the online stores did not show a change within {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    async fn reassign(&mut self, order: (Uuid, Uuid), to: Uuid) -> anyhow::Result<Instant> {
        sqlx::query("UPDATE orders SET store_id = $2, note = 'moved from A to C' WHERE id = $1")
            .bind(order.0)
            .bind(to)
            .execute(&self.pool)
            .await?;
        self.changes += 1;
        Ok(Instant::now())
    }
}

/// Read connections on the stores' SQLite files.
#[derive(Default)]
struct Watch {
    conns: BTreeMap<PathBuf, Connection>,
}

impl Watch {
    /// Every store in `stores` shows the marked name on its region's marked product.
    fn sees(&mut self, stores: &[&Store], mark: &Mark) -> anyhow::Result<bool> {
        for s in stores {
            if !self.conns.contains_key(&s.db) {
                let c = Connection::open_with_flags(&s.db, OpenFlags::SQLITE_OPEN_READ_ONLY)
                    .with_context(|| format!("opening {}", s.db.display()))?;
                self.conns.insert(s.db.clone(), c);
            }
            let c = &self.conns[&s.db];
            let product = if s.region == "north" {
                NORTH_MARK
            } else {
                SOUTH_MARK
            };
            let name: Option<String> = c
                .query_row("SELECT name FROM products WHERE id = ?1", [product], |r| {
                    r.get(0)
                })
                .ok();
            if name.as_deref() != Some(mark.name.as_str()) {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// Where Postgres is: the one `scripts/test` uses, or one started for the demo.
fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    Some(sorted[i])
}

fn msf(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ms(d: impl Into<Option<Duration>>) -> String {
    d.into().map_or("-".into(), |d| {
        format!("{:.1} ms", d.as_secs_f64() * 1000.0)
    })
}
