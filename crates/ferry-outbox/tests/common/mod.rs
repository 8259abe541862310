//! What the outbox tests share: a Postgres database of their own (dropped afterwards), a
//! JetStream stream of their own, a reference webhook sink on a free port, and the ledger
//! check every scenario ends with.
#![allow(dead_code)]

use ferry_outbox::relay::{Relay, RelayConfig};
use ferry_outbox::sink::{Received, Sink};
use ferry_outbox::transport::{self, TransportOptions};
use ferry_outbox::{Db, Message, Store};
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// The server tests create their databases on: `FERRY_TEST_PG`, by default the local
/// Postgres with trust authentication.
pub fn pg_admin_url() -> String {
    std::env::var("FERRY_TEST_PG").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into())
}

pub fn nats_url() -> String {
    std::env::var("FERRY_TEST_NATS").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

static N: AtomicU32 = AtomicU32::new(0);

/// A unique name for this test's database, stream or topic.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst),
        ferry_core::seams::random_nonzero_u64() % 100_000
    )
}

/// A Postgres database of the test's own, dropped (with its connections) on drop.
pub struct TestDb {
    pub name: String,
    pub url: String,
}

impl TestDb {
    pub async fn create() -> TestDb {
        let name = unique("ferry_t");
        let admin = format!("{}/postgres", pg_admin_url());
        let mut c = <sqlx::PgConnection as sqlx::Connection>::connect(&admin)
            .await
            .unwrap_or_else(|e| {
                panic!("cannot reach Postgres at {admin} (run scripts/test, which starts one): {e}")
            });
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut c)
            .await
            .unwrap();
        TestDb {
            url: format!("{}/{name}", pg_admin_url()),
            name,
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let admin = format!("{}/postgres", pg_admin_url());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut c) = <sqlx::PgConnection as sqlx::Connection>::connect(&admin).await {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut c)
                    .await;
                }
            })
        })
        .join();
    }
}

/// A webhook sink serving on a free port until dropped.
pub struct RunningSink {
    pub sink: Sink,
    pub url: String,
    pub port: u16,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl RunningSink {
    pub async fn start(secret: Option<Vec<u8>>) -> RunningSink {
        Self::start_on(0, Sink::new(secret)).await
    }

    pub async fn start_on(port: u16, sink: Sink) -> RunningSink {
        let l = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        let port = l.local_addr().unwrap().port();
        let task = tokio::spawn(sink.clone().serve(l));
        RunningSink {
            sink,
            url: format!("http://127.0.0.1:{port}/hook"),
            port,
            task,
        }
    }

    /// Stop serving (the port closes; connections in flight are cut).
    pub async fn stop(self) -> (Sink, u16) {
        self.task.abort();
        let _ = self.task.await;
        (self.sink, self.port)
    }
}

/// What the app committed, to check the transport against.
#[derive(Default, Debug)]
pub struct Ledger {
    pub committed: Vec<Message>,
    pub rolled_back: Vec<Message>,
}

impl Ledger {
    /// Every committed message arrived exactly once, nothing rolled back arrived, and
    /// each ordered key arrived in commit (seq) order, consecutive from 1.
    pub fn check(&self, got: &[Received]) {
        let ids: Vec<&str> = got.iter().map(|r| r.message_id.as_str()).collect();
        let unique: HashSet<&str> = ids.iter().copied().collect();
        assert_eq!(
            unique.len(),
            ids.len(),
            "the transport stored a message twice"
        );
        let committed: HashSet<&str> = self
            .committed
            .iter()
            .map(|m| m.message_id.as_str())
            .collect();
        for m in &self.rolled_back {
            assert!(
                !unique.contains(m.message_id.as_str()),
                "rolled-back message {} was published",
                m.message_id
            );
        }
        let missing: Vec<&&str> = committed
            .iter()
            .filter(|id| !unique.contains(**id))
            .collect();
        assert!(
            missing.is_empty(),
            "{} committed messages never arrived, e.g. {:?}",
            missing.len(),
            missing.iter().take(5).collect::<Vec<_>>()
        );
        assert_eq!(
            unique.len(),
            committed.len(),
            "messages arrived that were never committed"
        );
        // Per key: the order received is the order committed.
        let mut by_key: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for r in got {
            if let Some(k) = &r.key {
                by_key.entry(k).or_default().push(r.message_id.as_str());
            }
        }
        let mut want: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for m in &self.committed {
            if m.ordered {
                want.entry(m.key.as_deref().unwrap())
                    .or_default()
                    .push(m.message_id.as_str());
            }
        }
        for (k, w) in &want {
            assert_eq!(
                by_key.get(k),
                Some(w),
                "key {k} arrived out of commit order"
            );
        }
    }
}

/// A store on `url` (`postgres://…` or `sqlite:PATH`) with the outbox schema installed.
pub async fn install(url: &str) -> Store {
    let store = Store::connect(url).await.unwrap();
    store.install().await.unwrap();
    store
}

pub async fn sqlite_store(dir: &ferry_testkit::Scratch) -> Store {
    install(&format!("sqlite:{}", dir.path().join("app.db").display())).await
}

pub async fn pg_store(db: &TestDb) -> Store {
    install(&db.url).await
}

pub fn fast_config() -> RelayConfig {
    RelayConfig {
        batch: 64,
        window: 16,
        poll: Duration::from_millis(200),
        ..RelayConfig::default()
    }
}

/// Start a relay on `store` to `to`.
pub async fn start_relay(
    store: &Store,
    to: &str,
    config: RelayConfig,
    options: TransportOptions,
) -> (Arc<Relay>, ferry_outbox::relay::Running) {
    let t = transport::connect(to, &options).await.unwrap();
    let relay = Relay::new(store.clone(), Arc::from(t), config).unwrap();
    let running = relay.spawn();
    (relay, running)
}

/// Wait until nothing is pending, uncertain or leased; false at the deadline. A depth
/// that cannot be read counts as not drained yet: some tests take the database away
/// on purpose.
pub async fn drained(store: &Store, limit: Duration) -> bool {
    let end = tokio::time::Instant::now() + limit;
    loop {
        let depth = store.depth().await;
        if let Ok(d) = &depth
            && d.pending + d.uncertain + d.leased == 0
        {
            return true;
        }
        if tokio::time::Instant::now() >= end {
            eprintln!("not drained: {depth:?}");
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Wait until `f` holds, polling; false at the deadline.
pub async fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < end {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}

pub async fn status(store: &Store) -> ferry_outbox::status::Status {
    store.status().await.unwrap()
}

/// The app side: its own pool, its own table, and messages enqueued in the same
/// transaction as its rows.
pub enum App {
    Pg(sqlx::PgPool),
    Sqlite(sqlx::SqlitePool),
}

impl App {
    pub async fn open(store: &Store) -> App {
        let app = match store.db() {
            Db::Pg(p) => App::Pg(p.clone()),
            Db::Sqlite(p) => App::Sqlite(p.clone()),
        };
        let ddl = "CREATE TABLE IF NOT EXISTS orders (message_id TEXT PRIMARY KEY, key TEXT)";
        match &app {
            App::Pg(p) => sqlx::query(ddl).execute(p).await.map(|_| ()),
            App::Sqlite(p) => sqlx::query(ddl).execute(p).await.map(|_| ()),
        }
        .unwrap();
        app
    }

    /// One app transaction: an order row and its message per entry; committed or rolled
    /// back.
    pub async fn write(
        &self,
        msgs: &[Message],
        commit: bool,
    ) -> Result<(), ferry_outbox::EnqueueError> {
        match self {
            App::Pg(p) => {
                let mut tx = p.begin().await?;
                for m in msgs {
                    sqlx::query("INSERT INTO orders VALUES ($1, $2)")
                        .bind(&m.message_id)
                        .bind(&m.key)
                        .execute(&mut *tx)
                        .await?;
                }
                ferry_outbox::enqueue_many(&mut *tx, msgs).await?;
                if commit {
                    tx.commit().await?
                } else {
                    tx.rollback().await?
                }
            }
            App::Sqlite(p) => {
                let mut tx = p.begin().await?;
                for m in msgs {
                    sqlx::query("INSERT INTO orders VALUES (?, ?)")
                        .bind(&m.message_id)
                        .bind(&m.key)
                        .execute(&mut *tx)
                        .await?;
                }
                ferry_outbox::enqueue_many(&mut *tx, msgs).await?;
                if commit {
                    tx.commit().await?
                } else {
                    tx.rollback().await?
                }
            }
        }
        Ok(())
    }
}

/// Write `txns` transactions of 1–3 messages over `keys` ordered keys (plus some
/// unordered messages), rolling back every seventh; returns the ledger.
pub async fn write_workload(app: &App, txns: usize, keys: usize, seed: u64) -> Ledger {
    let mut rng = ferry_core::seams::SplitMix64::seeded(seed);
    use ferry_core::seams::Rng;
    let mut ledger = Ledger::default();
    for t in 0..txns {
        let n = 1 + rng.below(3) as usize;
        let msgs: Vec<Message> = (0..n)
            .map(|i| {
                let body = format!("txn {t} msg {i}").into_bytes();
                if rng.below(5) == 0 {
                    Message::new("orders.audit", body)
                } else {
                    Message::new("orders.created", body)
                        .ordered_by(format!("k{}", rng.below(keys as u64)))
                }
            })
            .collect();
        let commit = t % 7 != 6;
        app.write(&msgs, commit).await.unwrap();
        if commit {
            // enqueue_many takes keys in sorted order, which is also their commit order
            // within the transaction.
            let mut sorted = msgs.clone();
            sorted.sort_by(|a, b| match (a.ordered, b.ordered) {
                (true, true) => a.key.cmp(&b.key),
                (true, false) => std::cmp::Ordering::Less,
                (false, true) => std::cmp::Ordering::Greater,
                _ => std::cmp::Ordering::Equal,
            });
            ledger.committed.extend(sorted);
        } else {
            ledger.rolled_back.extend(msgs);
        }
    }
    ledger
}

/// What a JetStream stream holds, in stream order, as the sink would have received it.
pub async fn stream_contents(js: &async_nats::jetstream::Context, name: &str) -> Vec<Received> {
    let mut stream = js.get_stream(name).await.unwrap();
    let info = stream.info().await.unwrap();
    let mut got = Vec::new();
    for seq in 1..=info.state.last_sequence {
        let m = stream.get_raw_message(seq).await.unwrap();
        let h = m.headers;
        got.push(Received {
            message_id: h.get("Nats-Msg-Id").unwrap().to_string(),
            topic: m.subject.to_string(),
            key: h.get("Ferry-Key").map(|v| v.to_string()),
            seq: h.get("Ferry-Seq").and_then(|v| v.as_str().parse().ok()),
            body: m.payload.to_vec(),
        });
    }
    got
}

/// A JetStream stream of the test's own on `SUBJECT_PREFIX.>`, named like its subjects.
pub async fn create_stream(js: &async_nats::jetstream::Context, prefix: &str) -> String {
    let name = unique(prefix);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.>")],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .unwrap();
    name
}

/// A Postgres outbox of the test's own with the app on it, and a JetStream stream of its
/// own that covers `topic`. [`JetStreamOutbox::finish`] deletes the stream (the database
/// goes when the fixture is dropped).
pub struct JetStreamOutbox {
    pub store: Store,
    pub app: App,
    pub js: async_nats::jetstream::Context,
    pub stream: String,
    /// `STREAM.orders`: a topic the stream covers.
    pub topic: String,
    /// Last: dropping it drops the database, after the store's connections.
    pub db: TestDb,
}

impl JetStreamOutbox {
    /// A fresh database and a fresh stream named `PREFIX_…`.
    pub async fn start(prefix: &str) -> JetStreamOutbox {
        let db = TestDb::create().await;
        let store = pg_store(&db).await;
        let app = App::open(&store).await;
        let client = async_nats::connect(nats_url())
            .await
            .expect("NATS with JetStream on FERRY_TEST_NATS (scripts/test starts one)");
        let js = async_nats::jetstream::new(client);
        let stream = create_stream(&js, prefix).await;
        JetStreamOutbox {
            topic: format!("{stream}.orders"),
            store,
            app,
            js,
            stream,
            db,
        }
    }

    /// Transport options that publish to this stream (checked at start-up).
    pub fn options(&self) -> TransportOptions {
        TransportOptions {
            nats_stream: Some(self.stream.clone()),
            ..TransportOptions::default()
        }
    }

    /// What the stream holds, in stream order.
    pub async fn received(&self) -> Vec<Received> {
        stream_contents(&self.js, &self.stream).await
    }

    /// Delete the stream.
    pub async fn finish(self) {
        self.js.delete_stream(&self.stream).await.unwrap();
    }
}

/// Write `n` messages to `topic` over `keys` ordered keys, `per_txn` per transaction
/// (every seventh transaction rolled back); returns the ledger.
pub async fn write_to(app: &App, topic: &str, n: usize, keys: usize, per_txn: usize) -> Ledger {
    let mut l = Ledger::default();
    let mut i = 0;
    let mut t = 0;
    while i < n {
        let msgs: Vec<Message> = (i..(i + per_txn).min(n))
            .map(|j| {
                Message::new(topic, format!("{j}").into_bytes())
                    .ordered_by(format!("k{}", j % keys))
            })
            .collect();
        i += msgs.len();
        let commit = t % 7 != 6;
        t += 1;
        app.write(&msgs, commit).await.unwrap();
        let mut sorted = msgs;
        sorted.sort_by(|a, b| a.key.cmp(&b.key));
        if commit {
            l.committed.extend(sorted);
        } else {
            l.rolled_back.extend(sorted);
        }
    }
    l
}
