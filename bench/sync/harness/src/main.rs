//! ferry-sync's own figures (bench/sync/run calls this; results in bench/results/sync.md):
//!
//! - `held --rows N --replicas R`: provision a broadcast table of N rows to R replicas,
//!   confirm everything, and measure the server's held state (bytes of `ferry_sync`'s
//!   tables without the outbox) against one row per replica per row, the shape
//!   magic_sync keeps (measured on R0 replicas and scaled), plus the relay's time.
//! - `replicas ...`: the replica host of the side-by-side run with magic_sync
//!   (bench/sync/side.py; see `replicas.rs`).
//!
//! Every line printed is one JSON object.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use ferry_sync::catalog::Catalog;
use ferry_sync::relay::spec::Spec;
use ferry_sync::relay::{LOCK_KEY, Relay, RelaySettings};
use ferry_sync::rules::Rules;
use ferry_sync::{enroll, serve, wire};
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

mod replicas;
mod shards;

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

pub(crate) fn wall_ns() -> i64 {
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
        Bench::with(SCHEMA, RULES).await
    }

    async fn with(schema: &str, rules: &str) -> Bench {
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
        sqlx::raw_sql(sqlx::AssertSqlSafe(schema.to_string()))
            .execute(&pool)
            .await
            .unwrap();
        let rules = Rules::parse(rules, "bench.toml").unwrap();
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

fn main() {
    // Two workers, like the peers' harnesses; relay shards get one per CPU, since each
    // shard is meant to be a process of its own.
    let workers = match std::env::args().nth(1).as_deref() {
        Some("shards") => std::thread::available_parallelism().map_or(2, |n| n.get().max(2)),
        _ => 2,
    };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(run());
}

async fn run() {
    match std::env::args().nth(1).as_deref() {
        Some("held") => {
            held(
                arg("--rows", 10_000),
                arg("--replicas", 1_000),
                arg("--sample-replicas", 20),
            )
            .await
        }
        Some("replicas") => replicas::main().await,
        Some("shards") => {
            shards::main(
                arg("--shards", 1) as u32,
                arg("--replicas", 400),
                arg("--changes", 20_000),
                std::env::args().any(|a| a == "--broadcast"),
            )
            .await
        }
        _ => eprintln!(
            "usage: ferry-bench-sync held [--rows N] [--replicas R] | shards --shards N [--replicas R] [--changes C] [--broadcast] | replicas --server URL --stores FILE --dir D --products N --orders-per-store K"
        ),
    }
}
