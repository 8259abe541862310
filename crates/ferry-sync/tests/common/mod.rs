//! What the relay tests share: a database of their own on the machine's Postgres, the
//! shop schema of docs/sync.md's examples, replicas as SQLite files, and a delivery loop
//! that moves frames down and reports up the way the HTTP transport does, in-process.
#![allow(dead_code)]

pub mod up;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use ferry_sync::catalog::Catalog;
use ferry_sync::relay::spec::Spec;
use ferry_sync::relay::{Relay, RelaySettings, Step};
use ferry_sync::replica::{Received, Replica};
use ferry_sync::rules::Rules;
use ferry_sync::value::Value;
use ferry_sync::{enroll, wire};
use sqlx::{Connection, PgConnection, PgPool, Row};
use uuid::Uuid;

pub fn admin_url() -> String {
    let base = std::env::var("FERRY_TEST_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
    format!("{}/postgres", base.trim_end_matches('/'))
}

/// A database of the test's own, dropped at the end.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub pool: PgPool,
}

impl TestDb {
    pub async fn new(prefix: &str) -> TestDb {
        let name = format!(
            "ferry_sync_{prefix}_{}",
            &Uuid::new_v4().simple().to_string()[..10]
        );
        let mut admin = PgConnection::connect(&admin_url())
            .await
            .expect("the test Postgres is up (scripts/test starts it)");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let url = admin_url()
            .rsplit_once('/')
            .map(|(base, _)| format!("{base}/{name}"))
            .unwrap();
        let pool = PgPool::connect(&url).await.unwrap();
        TestDb { name, url, pool }
    }

    pub async fn drop_db(self) {
        self.pool.close().await;
        let mut admin = PgConnection::connect(&admin_url()).await.unwrap();
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            self.name
        )))
        .execute(&mut admin)
        .await;
    }

    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string()))
            .execute(&self.pool)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
}

pub const SHOP_SCHEMA: &str = "
CREATE TABLE stores (id uuid PRIMARY KEY, region text NOT NULL, open bool NOT NULL DEFAULT true);
CREATE TABLE products (id int8 PRIMARY KEY, name text NOT NULL, price numeric(10,2), region text NOT NULL);
CREATE TABLE customers (id uuid PRIMARY KEY, name text NOT NULL);
CREATE TABLE orders (id uuid PRIMARY KEY, store_id uuid NOT NULL REFERENCES stores,
  customer_id uuid REFERENCES customers, note text, placed_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE order_lines (order_id uuid REFERENCES orders ON DELETE CASCADE, line int4,
  product_id int8 REFERENCES products, qty int4 NOT NULL, PRIMARY KEY (order_id, line));
";

pub const SHOP_RULES: &str = r#"
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

/// The shop, installed, with a relay that runs passes on a connection holding the lock.
pub struct Shop {
    pub db: TestDb,
    pub spec: Arc<Spec>,
    /// The relay of shard 0 (the only one, unless the rules name `[relay] shards`).
    pub relay: Relay,
    pub lock: PgConnection,
    /// Relay shards 1.. (docs/sync-scale.md §2), each with a connection holding its lock.
    pub shards: Vec<(Relay, PgConnection)>,
    pub dir: PathBuf,
    pub replicas: BTreeMap<Uuid, Replica>,
    /// Each replica's seal key, kept so a killed replica can be opened again.
    pub seal_keys: BTreeMap<Uuid, [u8; 32]>,
    /// Each replica's token, for transports that carry it (NATS).
    pub tokens: BTreeMap<Uuid, String>,
}

impl Shop {
    pub async fn new(prefix: &str) -> Shop {
        Shop::new_with(prefix, SHOP_SCHEMA, SHOP_RULES).await
    }

    /// Another schema and rules; `expected`/`held`/`assert_converged` are the shop's, so a
    /// test of other rules checks what it expects itself.
    pub async fn new_with(prefix: &str, schema: &str, rules_text: &str) -> Shop {
        let db = TestDb::new(prefix).await;
        db.exec(schema).await;
        let rules = Rules::parse(rules_text, "rules.toml").expect("the rules parse");
        ferry_sync::schema::install(&db.pool, &rules)
            .await
            .expect("install");
        let mut conn = db.pool.acquire().await.unwrap();
        let catalog = Catalog::load(&mut conn, &rules).await.expect("catalog");
        drop(conn);
        let spec = Arc::new(Spec::build(&rules, &catalog).expect("spec"));
        let mut lock = PgConnection::connect(&db.url).await.unwrap();
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(ferry_sync::relay::LOCK_KEY)
            .fetch_one(&mut lock)
            .await
            .unwrap();
        assert!(got);
        let relay = Relay::new(spec.clone(), RelaySettings::default());
        let mut shards = Vec::new();
        for shard in 1..spec.shards {
            let mut lock = PgConnection::connect(&db.url).await.unwrap();
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                .bind(ferry_sync::relay::lock_key(shard))
                .fetch_one(&mut lock)
                .await
                .unwrap();
            assert!(got);
            let settings = RelaySettings {
                shard,
                ..RelaySettings::default()
            };
            shards.push((Relay::new(spec.clone(), settings), lock));
        }
        let dir = std::env::temp_dir().join(format!("ferry-sync-{}", db.name));
        std::fs::create_dir_all(&dir).unwrap();
        Shop {
            db,
            spec,
            relay,
            lock,
            shards,
            dir,
            replicas: BTreeMap::new(),
            seal_keys: BTreeMap::new(),
            tokens: BTreeMap::new(),
        }
    }

    /// Installs other rules over the shop's (as `ferry sync install` would) and returns
    /// the spec a relay runs them with; the shop's relays are left as they are.
    pub async fn install(&self, rules_text: &str) -> Arc<Spec> {
        let rules = Rules::parse(rules_text, "rules.toml").expect("the rules parse");
        ferry_sync::schema::install(&self.db.pool, &rules)
            .await
            .expect("install");
        let mut conn = self.db.pool.acquire().await.unwrap();
        let catalog = Catalog::load(&mut conn, &rules).await.expect("catalog");
        Arc::new(Spec::build(&rules, &catalog).expect("spec"))
    }

    /// A store (a replica) in `region`, enrolled, with its SQLite file.
    pub async fn store(&mut self, region: &str) -> Uuid {
        self.store_as(Uuid::new_v4(), region).await
    }

    /// As [`Shop::store`], under a chosen id (a seeded walk names its stores).
    pub async fn store_as(&mut self, id: Uuid, region: &str) -> Uuid {
        sqlx::query("INSERT INTO stores (id, region) VALUES ($1, $2)")
            .bind(id)
            .bind(region)
            .execute(&self.db.pool)
            .await
            .unwrap();
        let token = enroll::new_token();
        let mut conn = self.db.pool.acquire().await.unwrap();
        enroll::enroll(&mut conn, id, &token).await.unwrap();
        let seal_key = wire::seal_key(token.as_bytes());
        self.seal_keys.insert(id, seal_key);
        self.tokens.insert(id, token);
        self.replicas.insert(id, self.open_replica(id));
        id
    }

    /// Kills store `id`'s replica (drops it, with its connection) and opens the same
    /// file again, as a restarted process would.
    pub fn reopen(&mut self, id: Uuid) {
        drop(self.replicas.remove(&id));
        let replica = self.open_replica(id);
        self.replicas.insert(id, replica);
    }

    fn open_replica(&self, id: Uuid) -> Replica {
        Replica::open(&self.dir.join(format!("{id}.db")), self.seal_keys[&id]).unwrap()
    }

    /// Runs passes (of every relay shard) until no note is left.
    pub async fn passes(&mut self) {
        for _ in 0..100 {
            let report = self.relay.pass(&mut self.lock).await.expect("pass");
            let mut left = report.more || report.notes > 0;
            for (relay, lock) in &mut self.shards {
                let report = relay.pass(lock).await.expect("pass");
                left |= report.more || report.notes > 0;
            }
            if !left {
                return;
            }
        }
        panic!("notes never ran out");
    }

    /// Tables healed by a digest, over every relay shard.
    pub fn heals(&self) -> u64 {
        use std::sync::atomic::Ordering::Relaxed;
        self.relay.stats.heals.load(Relaxed)
            + self
                .shards
                .iter()
                .map(|(r, _)| r.stats.heals.load(Relaxed))
                .sum::<u64>()
    }

    /// As [`Shop::passes`], through the relay's own answer to a pass that fails on a
    /// note's data (`Relay::step`): the batch is halved until that note is parked, as a
    /// running relay does. Returns the ids of the notes parked.
    pub async fn steps(&mut self) -> Vec<i64> {
        let mut parked = Vec::new();
        let mut done = vec![false; 1 + self.shards.len()];
        for _ in 0..1000 {
            for (i, flag) in done.iter_mut().enumerate() {
                let (relay, lock) = match i {
                    0 => (&mut self.relay, &mut self.lock),
                    _ => {
                        let (r, l) = &mut self.shards[i - 1];
                        (r, l)
                    }
                };
                *flag = match relay.step(lock).await.expect("step") {
                    Step::Passed(report) => !report.more && report.notes == 0,
                    Step::Narrowed { .. } => false,
                    Step::Parked(Some(id)) => {
                        parked.push(id);
                        false
                    }
                    Step::Parked(None) => panic!("a pass failed on data with no note to park"),
                };
            }
            if done.iter().all(|d| *d) {
                return parked;
            }
        }
        panic!("notes never ran out");
    }

    /// Delivers every replica's outbox, reports, and runs passes, until nothing moves.
    pub async fn settle(&mut self) {
        self.settle_by(false).await;
    }

    /// As [`Shop::settle`], with passes that narrow and park ([`Shop::steps`]); returns
    /// the ids of the notes parked.
    pub async fn settle_parking(&mut self) -> Vec<i64> {
        self.settle_by(true).await
    }

    async fn settle_by(&mut self, parking: bool) -> Vec<i64> {
        let mut parked = Vec::new();
        for _ in 0..50 {
            if parking {
                parked.extend(self.steps().await);
            } else {
                self.passes().await;
            }
            let mut moved = false;
            let ids: Vec<Uuid> = self.replicas.keys().copied().collect();
            for id in ids {
                moved |= self.deliver(id).await;
            }
            if parking {
                parked.extend(self.steps().await);
            } else {
                self.passes().await;
            }
            // The last passes may have recorded more (a heal, a catch-up): settled means
            // nothing moved and nothing waits in any outbox.
            let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry_sync.outbox")
                .fetch_one(&self.db.pool)
                .await
                .unwrap();
            if !moved && waiting == 0 {
                return parked;
            }
        }
        panic!("delivery never settled");
    }

    /// Fetches and applies one replica's frames after its position, then reports.
    pub async fn deliver(&mut self, id: Uuid) -> bool {
        let replica = self.replicas.get_mut(&id).unwrap();
        let status = replica.status().unwrap();
        let frames = ferry_sync::serve::frames_after(
            &self.db.pool,
            id,
            status
                .epoch
                .as_deref()
                .and_then(|h| Uuid::parse_str(h).ok()),
            status.seq,
            64,
        )
        .await
        .unwrap();
        let mut applied = false;
        for frame in &frames {
            match replica.receive(frame).unwrap() {
                Received::Applied { .. } => applied = true,
                Received::AlreadyApplied { .. } => {}
                other => panic!("replica {id}: {other:?}"),
            }
        }
        let up = replica.up().unwrap();
        ferry_sync::serve::store_report(&self.db.pool, id, &wire::encode_up(&up))
            .await
            .unwrap();
        applied
    }

    /// What the rules say store `id` holds, from Postgres, written from docs/sync.md:
    /// products of its region; its orders; their lines; the customers its orders name.
    pub async fn expected(&self, id: Uuid) -> BTreeMap<String, BTreeSet<String>> {
        let pool = &self.db.pool;
        let mut out = BTreeMap::new();
        let q = |sql: &'static str| sqlx::query(sql).bind(id);
        // Products of its region, and products its order lines name (closure, whatever
        // their region).
        let rows = q("SELECT p.id::text || '|' || p.name || '|' || coalesce(p.price::text, 'NULL') || '|' || p.region
                      FROM products p JOIN stores s ON s.id = $1 AND s.open
                      WHERE p.region = s.region OR p.id IN (SELECT l.product_id FROM order_lines l
                        JOIN orders o ON o.id = l.order_id WHERE o.store_id = s.id)")
            .fetch_all(pool).await.unwrap();
        out.insert(
            "products".into(),
            rows.iter().map(|r| r.get::<String, _>(0)).collect(),
        );
        let rows = q("SELECT o.id::text || '|' || o.store_id::text || '|' || coalesce(o.customer_id::text, 'NULL') || '|' || coalesce(o.note, 'NULL')
                      FROM orders o JOIN stores s ON s.id = o.store_id WHERE s.id = $1 AND s.open")
            .fetch_all(pool).await.unwrap();
        out.insert(
            "orders".into(),
            rows.iter().map(|r| r.get::<String, _>(0)).collect(),
        );
        let rows = q("SELECT l.order_id::text || '|' || l.line || '|' || coalesce(l.product_id::text, 'NULL') || '|' || l.qty
                      FROM order_lines l JOIN orders o ON o.id = l.order_id JOIN stores s ON s.id = o.store_id WHERE s.id = $1 AND s.open")
            .fetch_all(pool).await.unwrap();
        out.insert(
            "order_lines".into(),
            rows.iter().map(|r| r.get::<String, _>(0)).collect(),
        );
        let rows = q("SELECT DISTINCT c.id::text || '|' || c.name FROM customers c JOIN orders o ON o.customer_id = c.id
                      JOIN stores s ON s.id = o.store_id WHERE s.id = $1 AND s.open")
            .fetch_all(pool).await.unwrap();
        out.insert(
            "customers".into(),
            rows.iter().map(|r| r.get::<String, _>(0)).collect(),
        );
        out
    }

    /// What store `id`'s SQLite file holds, in the same text form.
    pub fn held(&self, id: Uuid) -> BTreeMap<String, BTreeSet<String>> {
        let conn = self.replicas[&id].conn();
        let mut out = BTreeMap::new();
        for (table, cols) in [
            ("products", "id, name, price, region"),
            ("orders", "id, store_id, customer_id, note"),
            ("order_lines", "order_id, line, product_id, qty"),
            ("customers", "id, name"),
        ] {
            let exists: bool = conn
                .query_row(
                    "SELECT count(*) > 0 FROM sqlite_master WHERE name = ?1",
                    [table],
                    |r| r.get(0),
                )
                .unwrap();
            let mut rows = BTreeSet::new();
            if exists {
                let mut stmt = conn
                    .prepare(&format!("SELECT {cols} FROM \"{table}\""))
                    .unwrap();
                let n = cols.split(',').count();
                let mut q = stmt.query([]).unwrap();
                while let Some(row) = q.next().unwrap() {
                    let parts: Vec<String> = (0..n)
                        .map(|i| match row.get_ref(i).unwrap() {
                            rusqlite::types::ValueRef::Null => "NULL".to_string(),
                            rusqlite::types::ValueRef::Integer(v) => v.to_string(),
                            rusqlite::types::ValueRef::Real(v) => v.to_string(),
                            rusqlite::types::ValueRef::Text(t) => {
                                String::from_utf8_lossy(t).into_owned()
                            }
                            rusqlite::types::ValueRef::Blob(b) => format!("{b:?}"),
                        })
                        .collect();
                    rows.insert(parts.join("|"));
                }
            }
            out.insert(table.to_string(), rows);
        }
        out
    }

    /// Every replica holds exactly what its rules say, in content.
    pub async fn assert_converged(&self) {
        for id in self.replicas.keys() {
            let expected = self.expected(*id).await;
            let held = self.held(*id);
            assert_eq!(
                held, expected,
                "store {id} holds something other than its rules say"
            );
        }
    }

    pub async fn finish(self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        drop(self.lock);
        self.db.drop_db().await;
    }
}

/// Unused values keep the import list honest across test files.
pub fn _values(_: &[Value]) {}

/// A directory copied whole (`cp -a`), replacing `to`: a data directory's backup.
pub fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    let _ = std::fs::remove_dir_all(to);
    let ok = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap()
        .success();
    assert!(ok, "copying {} to {}", from.display(), to.display());
}
