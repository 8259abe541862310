//! ferry-sync's own figures (bench/sync/run calls this; results in bench/results/sync.md):
//!
//! - `held --rows N --replicas R`: provision a broadcast table of N rows to R replicas,
//!   confirm everything, and measure the server's held state (bytes of `ferry_sync`'s
//!   tables without the outbox) against one row per replica per row, the shape
//!   magic_sync keeps (measured on R0 replicas and scaled), plus the relay's time.
//! - `lag --rows N --replicas R --rate M --seconds S`: R replicas follow a `serve` over
//!   HTTP (real relay loop, NOTIFY wake-ups, long polls); first the time to provision N
//!   rows to all of them, then M changes a second to a broadcast table, and the time from
//!   each change's commit to its apply on each replica (p50, p99, max), and whether lag
//!   grows (the last third's p50 against the first third's).
//!
//! Every line printed is one JSON object.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ferry_sync::catalog::Catalog;
use ferry_sync::relay::spec::Spec;
use ferry_sync::relay::{LOCK_KEY, Relay, RelaySettings};
use ferry_sync::replica::{Downlink, Position, Received, Replica};
use ferry_sync::rules::Rules;
use ferry_sync::{enroll, serve, wire};
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

const SCHEMA: &str = "
CREATE TABLE stores (id uuid PRIMARY KEY);
CREATE TABLE products (id int8 PRIMARY KEY, name text NOT NULL, price numeric(10,2), at_ns int8);
";
const RULES: &str = r#"
[replicas]
relation = "stores"
[tables.products]
sync = "broadcast"
"#;

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn wall_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos() as i64
}

struct Bench {
    name: String,
    url: String,
    admin: String,
    pool: PgPool,
    spec: Arc<Spec>,
}

impl Bench {
    async fn new() -> Bench {
        let base = std::env::var("FERRY_TEST_PG")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
        let base = base.trim_end_matches('/').to_string();
        let admin = format!("{base}/postgres");
        let name = format!(
            "ferry_bench_sync_{}",
            &Uuid::new_v4().simple().to_string()[..8]
        );
        let mut c = PgConnection::connect(&admin)
            .await
            .expect("Postgres answers on FERRY_TEST_PG");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut c)
            .await
            .unwrap();
        let url = format!("{base}/{name}");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect(&url)
            .await
            .unwrap();
        sqlx::raw_sql(SCHEMA).execute(&pool).await.unwrap();
        let rules = Rules::parse(RULES, "bench.toml").unwrap();
        ferry_sync::schema::install(&pool, &rules).await.unwrap();
        let mut conn = pool.acquire().await.unwrap();
        let catalog = Catalog::load(&mut conn, &rules).await.unwrap();
        drop(conn);
        let spec = Arc::new(Spec::build(&rules, &catalog).unwrap());
        Bench {
            name,
            url,
            admin,
            pool,
            spec,
        }
    }

    async fn stores(&self, n: u64) -> Vec<(Uuid, [u8; 32], String)> {
        let mut out = Vec::new();
        let mut conn = self.pool.acquire().await.unwrap();
        for _ in 0..n {
            let id = Uuid::new_v4();
            sqlx::query("INSERT INTO stores VALUES ($1)")
                .bind(id)
                .execute(&mut *conn)
                .await
                .unwrap();
            let token = enroll::new_token();
            enroll::enroll(&mut conn, id, &token).await.unwrap();
            out.push((id, wire::seal_key(token.as_bytes()), token));
        }
        out
    }

    async fn bytes(&self, tables: &[&str]) -> i64 {
        let mut total = 0;
        for t in tables {
            let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT pg_total_relation_size('{t}')"
            )))
            .fetch_one(&self.pool)
            .await
            .unwrap();
            total += n;
        }
        total
    }

    async fn drop_db(self) {
        // Not `pool.close()`: a serve's notification listener holds one of the pool's
        // connections for good, and close would wait for it. FORCE ends the sessions.
        let mut c = PgConnection::connect(&self.admin).await.unwrap();
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&mut c)
        .await;
    }
}

async fn lock(url: &str) -> PgConnection {
    let mut c = PgConnection::connect(url).await.unwrap();
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(LOCK_KEY)
        .fetch_one(&mut c)
        .await
        .unwrap();
    assert!(got);
    c
}

/// Confirms every replica's outbox as if each had applied it: a report naming its last
/// message's stamp (read from the stored head).
async fn confirm_all(pool: &PgPool) {
    let heads: Vec<(Uuid, Vec<u8>)> = sqlx::query_as(
        "SELECT DISTINCT ON (replica) replica, head FROM ferry_sync.outbox ORDER BY replica, seq DESC",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    for (r, h) in heads {
        let applied = wire::Applied {
            epoch: h[24..40].try_into().unwrap(),
            seq: u64::from_be_bytes(h[40..48].try_into().unwrap()),
            nonce: u64::from_be_bytes(h[48..56].try_into().unwrap()),
            body_hash: h[76..108].try_into().unwrap(),
            stamp: h[108..124].try_into().unwrap(),
        };
        let up = wire::Up {
            applied: Some(applied),
            ..wire::Up::default()
        };
        serve::store_report(pool, r, &wire::encode_up(&up))
            .await
            .unwrap();
    }
}

async fn held(rows: u64, replicas: u64, sample_replicas: u64) {
    let b = Bench::new().await;
    sqlx::query("INSERT INTO products SELECT g, 'product ' || g, g / 100.0, 0 FROM generate_series(1, $1) g")
        .bind(rows as i64)
        .execute(&b.pool)
        .await
        .unwrap();
    b.stores(replicas).await;
    let mut conn = lock(&b.url).await;
    let mut relay = Relay::new(b.spec.clone(), RelaySettings::default());
    let started = Instant::now();
    loop {
        let r = relay.pass(&mut conn).await.unwrap();
        if !r.more && r.notes == 0 {
            break;
        }
    }
    let provision_s = started.elapsed().as_secs_f64();
    let outbox_bytes = b.bytes(&["ferry_sync.outbox", "ferry_sync.bodies"]).await;
    confirm_all(&b.pool).await;
    relay.pass(&mut conn).await.unwrap();
    for t in [
        "ferry_sync.rows",
        "ferry_sync.replicas",
        "ferry_sync.held",
        "ferry_sync.points",
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("VACUUM FULL {t}")))
            .execute(&b.pool)
            .await
            .unwrap();
    }
    let held = b
        .bytes(&[
            "ferry_sync.rows",
            "ferry_sync.replicas",
            "ferry_sync.held",
            "ferry_sync.points",
        ])
        .await;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry_sync.outbox")
        .fetch_one(&b.pool)
        .await
        .unwrap();
    // One row per replica per row, as magic_sync's sync.held keeps it (replica, relation,
    // key, sequence, noted, refused, sent_at, with its primary key), measured on a sample
    // of replicas and scaled to R.
    sqlx::raw_sql(
        "CREATE TABLE per_row_held (replica uuid, relation text, row_key text, noted bigint, sequence bigint,
         refused boolean, sent_at timestamptz, PRIMARY KEY (replica, relation, row_key))",
    )
    .execute(&b.pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO per_row_held SELECT r, 'public.products', p.id::text, 1, 1, false, now()
         FROM (SELECT gen_random_uuid() AS r FROM generate_series(1, $1)) s, products p",
    )
    .bind(sample_replicas as i64)
    .execute(&b.pool)
    .await
    .unwrap();
    let per_row_sample = b.bytes(&["per_row_held"]).await;
    let per_row = per_row_sample as f64 * replicas as f64 / sample_replicas as f64;
    println!(
        "{}",
        serde_json::json!({
            "bench": "held", "rows": rows, "replicas": replicas,
            "provision_pass_s": provision_s, "outbox_bytes_before_confirm": outbox_bytes,
            "outbox_left": left, "held_bytes": held, "per_row_held_bytes_estimate": per_row as i64,
            "ratio_pct": 100.0 * held as f64 / per_row,
        })
    );
    drop(conn);
    b.drop_db().await;
}

/// A replica following over HTTP, recording the lag of every change it applies.
#[allow(clippy::too_many_arguments)]
fn follow(
    base: String,
    id: Uuid,
    token: String,
    seal: [u8; 32],
    dir: std::path::PathBuf,
    stop: Arc<AtomicBool>,
    ready: Arc<std::sync::atomic::AtomicU64>,
    target: u64,
) -> Vec<(i64, i64)> {
    let mut replica = Replica::open(&dir.join(format!("{id}.db")), seal).unwrap();
    let mut link = ferry_sync::client::HttpLink::new(&base, id, &token).unwrap();
    let mut seen: HashMap<i64, i64> = HashMap::new();
    let mut samples = Vec::new();
    let mut counted = false;
    let mut last_report = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let st = replica.status().unwrap();
        let at = Position {
            epoch: st
                .epoch
                .as_deref()
                .and_then(|h| Uuid::parse_str(h).ok())
                .map(|u| *u.as_bytes()),
            seq: st.seq,
            nonce: 0,
        };
        let frames = match link.fetch(at, 64, Duration::from_millis(500)) {
            Ok(f) => f,
            Err(_) => {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let mut applied = false;
        for f in &frames {
            if let Ok(Received::Applied { .. }) = replica.receive(f) {
                applied = true;
            }
        }
        if applied {
            let now = wall_ns();
            let mut stmt = replica
                .conn()
                .prepare_cached("SELECT id, at_ns FROM products WHERE at_ns > 0")
                .unwrap();
            let rows: Vec<(i64, i64)> = stmt
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            for (k, at_ns) in rows {
                if seen.insert(k, at_ns) != Some(at_ns) {
                    samples.push((at_ns, now - at_ns));
                }
            }
            if !counted {
                let n: i64 = replica
                    .conn()
                    .query_row("SELECT count(*) FROM products", [], |r| r.get(0))
                    .unwrap();
                if n as u64 >= target {
                    counted = true;
                    ready.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // Like the replica's run loop: a report after applying, at most once a second
        // (and at once while provisioning, so the relay hears the snapshot confirmed).
        if applied && (!counted || last_report.elapsed() >= Duration::from_secs(1)) {
            if let Ok(up) = replica.up_without_digests() {
                let _ = link.report(&wire::encode_up(&up));
            }
            last_report = Instant::now();
        }
    }
    samples
}

fn pct(sorted: &[i64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize] as f64 / 1e6
}

async fn lag(rows: u64, replicas: u64, rate: u64, seconds: u64) {
    let b = Bench::new().await;
    sqlx::query("INSERT INTO products SELECT g, 'product ' || g, g / 100.0, 0 FROM generate_series(1, $1) g")
        .bind(rows as i64)
        .execute(&b.pool)
        .await
        .unwrap();
    // The table is mirrored before any replica joins: its rows' notes are planned first
    // (nobody to send them to), so provisioning is measured alone.
    let drain_started = Instant::now();
    {
        let mut conn = lock(&b.url).await;
        if std::env::var("FERRY_BENCH_LOG_SLOW").is_ok() {
            sqlx::query("SET log_min_duration_statement = 20")
                .execute(&mut conn)
                .await
                .unwrap();
        }
        let mut relay = Relay::new(b.spec.clone(), RelaySettings::default());
        loop {
            let r = relay.pass(&mut conn).await.unwrap();
            if !r.more && r.notes == 0 {
                break;
            }
        }
    }
    let notes_drain_s = drain_started.elapsed().as_secs_f64();
    let stores = b.stores(replicas).await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut relay = Relay::new(
        b.spec.clone(),
        RelaySettings {
            idle: Duration::from_millis(100),
            ..RelaySettings::default()
        },
    );
    let url = b.url.clone();
    let relay_task = tokio::spawn(async move { relay.run(&url, stop_rx).await });
    let serve = serve::Serve::new(b.pool.clone(), Arc::default())
        .await
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, serve.router()).await });
    let dir = std::env::temp_dir().join(&b.name);
    std::fs::create_dir_all(&dir).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();
    let mut threads = Vec::new();
    for (id, seal, token) in stores {
        let (base, dir, stop, ready) = (base.clone(), dir.clone(), stop.clone(), ready.clone());
        threads.push(std::thread::spawn(move || {
            follow(base, id, token, seal, dir, stop, ready, rows)
        }));
    }
    while ready.load(Ordering::Relaxed) < replicas {
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "provisioning took over 10 minutes"
        );
    }
    let provision_s = started.elapsed().as_secs_f64();
    let cpu_before = cpu_s();
    let wal = "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8";
    let wal_before: i64 = sqlx::query_scalar(wal).fetch_one(&b.pool).await.unwrap();
    let tick = Duration::from_secs_f64(1.0 / rate as f64);
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed() < Duration::from_secs(seconds) {
        n += 1;
        let id = (n % 100 + 1) as i64;
        sqlx::query("UPDATE products SET at_ns = $2, price = price + 0.01 WHERE id = $1")
            .bind(id)
            .bind(wall_ns())
            .execute(&b.pool)
            .await
            .unwrap();
        let next = t0 + tick * n as u32;
        if let Some(w) = next.checked_duration_since(Instant::now()) {
            tokio::time::sleep(w).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu = cpu_s() - cpu_before;
    let wal_after: i64 = sqlx::query_scalar(wal).fetch_one(&b.pool).await.unwrap();
    stop.store(true, Ordering::Relaxed);
    let mut all: Vec<(i64, i64)> = Vec::new();
    for t in threads {
        all.extend(t.join().unwrap());
    }
    let _ = stop_tx.send(true);
    let _ = relay_task.await;
    all.sort();
    let third = all.len() / 3;
    let mut first: Vec<i64> = all[..third].iter().map(|s| s.1).collect();
    let mut last: Vec<i64> = all[all.len() - third..].iter().map(|s| s.1).collect();
    first.sort();
    last.sort();
    let mut lags: Vec<i64> = all.iter().map(|s| s.1).collect();
    lags.sort();
    println!(
        "{}",
        serde_json::json!({
            "bench": "lag", "rows": rows, "replicas": replicas, "rate": rate, "seconds": seconds,
            "provision_s": provision_s, "notes_planned_per_s_with_no_replica": rows as f64 / notes_drain_s, "changes": n, "samples": lags.len(),
            "p50_ms": pct(&lags, 0.5), "p99_ms": pct(&lags, 0.99), "max_ms": pct(&lags, 1.0),
            "first_third_p50_ms": pct(&first, 0.5), "last_third_p50_ms": pct(&last, 0.5),
            "harness_cpu_ms_per_1000_changes": cpu * 1e6 / n as f64,
            "wal_bytes_per_change": (wal_after - wal_before) as f64 / n as f64,
        })
    );
    let _ = std::fs::remove_dir_all(&dir);
    b.drop_db().await;
}

/// This process's CPU seconds (user + system), from /proc.
fn cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks: f64 = fields
        .get(11)
        .and_then(|u| u.parse::<f64>().ok())
        .unwrap_or(0.0)
        + fields
            .get(12)
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or(0.0);
    ticks / 100.0
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("held") => {
            held(
                arg("--rows", 10_000),
                arg("--replicas", 1_000),
                arg("--sample-replicas", 20),
            )
            .await
        }
        Some("lag") => {
            lag(
                arg("--rows", 10_000),
                arg("--replicas", 10),
                arg("--rate", 100),
                arg("--seconds", 20),
            )
            .await
        }
        _ => eprintln!(
            "usage: ferry-bench-sync held|lag [--rows N] [--replicas R] [--rate M] [--seconds S]"
        ),
    }
}
