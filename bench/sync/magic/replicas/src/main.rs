//! `magic-sync-replicas`: one process hosting a magic_sync 0.5.1 replica per store, for
//! the side-by-side sync benchmark (`bench/sync/magic/README.md` has the contract).
//!
//! ```text
//! magic-sync-replicas --server http://127.0.0.1:PORT --stores FILE --dir D
//!                     --products N --orders-per-store K
//! ```
//!
//! Per store (one uuid per line of FILE; more fields after it are ignored):
//!
//! 1. `D/<uuid>.db` is created with the three tables, in WAL with `synchronous=FULL`,
//!    and magic_sync's replica schema and triggers are installed (`replica::install`).
//! 2. A magic_sync `Replica` runs in a task: it sends up, through `POST /up/{uuid}`, what
//!    the server must hear — above all which message it last applied, since the server
//!    counts nothing as held until then.
//! 3. A fetch task long-polls `GET /down/{uuid}?after=K&wait_ms=500` and hands each
//!    message, in order, to `Replica::receive`; K moves past a message once `receive`
//!    answered Ok, whatever it answered, which acknowledges it with the next fetch. An
//!    error leaves K where it was, so the message comes again.
//! 4. After a `receive` that applied rows, the rows it applied are read back: each whose
//!    `at_ns` is new is a lag sample `now - at_ns` (wall clock, ns since the epoch).
//! 5. A writer task, idle until the stdin command `write W S`, then inserts W sales a
//!    second for S seconds into the store's `sales`, one row a transaction, through a
//!    SQLite connection of its own (as an app would). magic_sync's triggers note each
//!    row, and the replica's run loop (2) sends it up when it next looks.
//!
//! Stdout, one JSON object a line: `provisioned` once every store holds N products and
//! its K orders; `mark` on the stdin command `mark`; `written` once every store wrote
//! what a `write` asked; `done` on SIGTERM, SIGINT or stdin's end, after which the
//! process exits 0.

#[path = "../../shop.rs"]
mod shop;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use magic_sync::Error;
use magic_sync::replica::{Applied, Received};
use magic_sync::row::KeyPart;
use magic_sync::run::replica::{Replica, Settings, Uplink};
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Connection, SqliteConnection};
use tokio::io::AsyncBufReadExt;
use tokio::sync::{mpsc, oneshot, watch};
use uuid::Uuid;

/// How long one fetch waits on the server for a message (the contract's `wait_ms`).
const WAIT_MS: u64 = 500;

/// How long a fetch task waits after the server could not be reached or answered
/// otherwise than 200, or after `receive` failed, before it asks again: the failure is
/// transient or the same message fails again, and a loop without a pause would spin.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// Connections per store's pool: `receive` holds one while it applies, the replica's
/// upward lane one while it reads or records what it sends, and the lag reader (in the
/// fetch task, after `receive`) at most one. sqlx runs each SQLite connection on a
/// thread of its own, so this is also threads per store.
const SQLITE_CONNECTIONS: u32 = 3;

/// The driver's tables, on the replica, as magic_sync's check wants them: every column
/// of the row, its nullability and a type its field decodes (a uuid is a BLOB, 16 bytes
/// as sqlx binds a `Uuid` — magic_sync's note trigger refuses a key in any other form).
const TABLES: &str = "
CREATE TABLE IF NOT EXISTS products (id INTEGER PRIMARY KEY NOT NULL, name TEXT NOT NULL,
    price_cents INTEGER NOT NULL, at_ns INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY NOT NULL, store BLOB NOT NULL,
    qty INTEGER NOT NULL, at_ns INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS sales (id BLOB PRIMARY KEY NOT NULL, store BLOB NOT NULL,
    amount INTEGER NOT NULL, at_ns INTEGER NOT NULL);
";

/// A sale, as the writer inserts it: one row, in a transaction of its own.
const INSERT_SALE: &str = "INSERT INTO sales (id, store, amount, at_ns) VALUES (?1, ?2, ?3, ?4)";

/// The two tables lag is measured on, as a `receive` names them, with the query that
/// reads back the `at_ns` of the rows it applied (their ids as a JSON array): the
/// applied rows only, by primary key, so a sample costs what the message carried.
const MEASURED: [(&str, &str); 2] = [
    (
        "products",
        "SELECT id, at_ns FROM products WHERE id IN (SELECT value FROM json_each(?1)) AND at_ns > 0",
    ),
    (
        "orders",
        "SELECT id, at_ns FROM orders WHERE id IN (SELECT value FROM json_each(?1)) AND at_ns > 0",
    ),
];

type Host = Replica<(), Uuid, HttpUp>;

/// What every store's tasks add to.
#[derive(Default)]
struct Totals {
    bytes_down: AtomicU64,
    bytes_up: AtomicU64,
    gaps: AtomicU64,
    malformed: AtomicU64,
    provisioned: AtomicU64,
    /// `(at_ns, lag_ns)` of every row seen with a new `at_ns`, all stores.
    samples: Mutex<Vec<(i64, i64)>>,
}

/// The run's settings, and its totals.
struct Run {
    base: String,
    dir: PathBuf,
    products: u64,
    orders: u64,
    stores: u64,
    started: Instant,
    client: reqwest::Client,
    totals: Totals,
    /// Each store's writer, once its database is set up: where a `write` goes.
    writers: Mutex<Vec<mpsc::UnboundedSender<Write>>>,
}

/// What a `write W S` asks of one store's writer: `count` rows, the k-th (from 0) due
/// at `start + k / per_second` seconds (each store's `start` offset by i/n of an
/// interval); `done` is answered with how many it wrote.
struct Write {
    per_second: u64,
    count: u64,
    start: tokio::time::Instant,
    done: oneshot::Sender<u64>,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail(format!("cannot start the async runtime: {e}")));
    if let Err(e) = runtime.block_on(host(&args)) {
        fail(e);
    }
}

fn fail(e: String) -> ! {
    eprintln!("magic-sync-replicas: {e}");
    std::process::exit(1);
}

async fn host(args: &[String]) -> Result<(), String> {
    let started = Instant::now();
    let base = need(args, "--server")?.trim_end_matches('/').to_string();
    let stores_file = need(args, "--stores")?;
    let dir = PathBuf::from(need(args, "--dir")?);
    let products = number(args, "--products")?;
    let orders = number(args, "--orders-per-store")?;
    let stores = read_stores(Path::new(&stores_file))?;
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let client = reqwest::Client::builder()
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    let run = Arc::new(Run {
        base,
        dir,
        products,
        orders,
        stores: stores.len() as u64,
        started,
        client,
        totals: Totals::default(),
        writers: Mutex::new(Vec::new()),
    });
    let (stop, stopped) = watch::channel(false);
    for store in stores {
        let run = run.clone();
        let stopped = stopped.clone();
        tokio::spawn(async move {
            if let Err(e) = follow(run, store, stopped).await {
                tracing::error!(%store, "this store's replica stopped: {e}");
            }
        });
    }
    tokio::spawn(commands(run.clone(), stop.clone()));
    tokio::spawn(signalled(stop));
    until(stopped).await;
    say(&done(&run.totals));
    std::process::exit(0);
}

/// One store: its database set up, its replica run, and its messages fetched and
/// applied until the host stops.
async fn follow(run: Arc<Run>, store: Uuid, stopped: watch::Receiver<bool>) -> Result<(), String> {
    let path = run.dir.join(format!("{store}.db"));
    let pool = open(&path).await?;
    let uplink = HttpUp {
        url: format!("{}/up/{store}", run.base),
        run: run.clone(),
    };
    let replica = Replica::new(
        pool.clone(),
        shop::codecs(),
        store,
        uplink,
        Settings::default(),
    )
    .await
    .map_err(|e| format!("magic_sync refused the replica database: {e}"))?;
    let replica = Arc::new(replica);
    tokio::spawn({
        let replica = replica.clone();
        let stopped = stopped.clone();
        async move { replica.run(until(stopped)).await }
    });
    let (writes, asked) = mpsc::unbounded_channel();
    tokio::spawn(writer(store, path, asked));
    run.writers
        .lock()
        .expect("no thread panics holding the writers")
        .push(writes);
    let mut held = Held::new(pool);
    held.check_provisioned(&run).await;
    fetch_loop(&run, store, &replica, &mut held, stopped).await;
    Ok(())
}

/// How a store's database is opened, by the pool and by the writer alike: as
/// magic_sync's check requires — `synchronous=FULL` (ferry's replicas use FULL too),
/// WAL, `recursive_triggers` on — with a 30 s busy timeout.
fn options(path: &Path) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .pragma("recursive_triggers", "ON")
        .busy_timeout(Duration::from_secs(30))
}

/// `path` opened ([`options`]) with the tables and magic_sync's replica schema
/// installed.
async fn open(path: &Path) -> Result<SqlitePool, String> {
    let pool = SqlitePoolOptions::new()
        .max_connections(SQLITE_CONNECTIONS)
        .connect_with(options(path))
        .await
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    sqlx::raw_sql(TABLES)
        .execute(&pool)
        .await
        .map_err(|e| format!("cannot create the tables in {}: {e}", path.display()))?;
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    magic_sync::replica::install(&mut conn, &shop::codecs())
        .await
        .map_err(|e| {
            format!(
                "magic_sync's replica install failed on {}: {e}",
                path.display()
            )
        })?;
    Ok(pool)
}

/// One store's writer: for each `write`, its rows at their times, open loop — a row late
/// (the one before it took longer than the interval) goes at once, and the schedule
/// stays where it was. Each row is one transaction on the writer's own connection,
/// opened at the first `write` (a run that never writes holds no more threads than
/// before): `BEGIN IMMEDIATE` (the write lock, which the replica's run loop and
/// `receive` take too), then `at_ns` read off the wall clock, the insert, the commit. So
/// `at_ns` is taken just before the commit, after any wait for the lock; magic_sync's
/// note trigger runs inside it.
async fn writer(store: Uuid, path: PathBuf, mut asked: mpsc::UnboundedReceiver<Write>) {
    let mut conn: Option<SqliteConnection> = None;
    while let Some(job) = asked.recv().await {
        if conn.is_none() {
            match SqliteConnection::connect_with(&options(&path)).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    tracing::error!(%store, "the writer cannot open {}: {e}", path.display());
                    let _ = job.done.send(0);
                    continue;
                }
            }
        }
        let c = conn.as_mut().expect("opened above");
        let mut written = 0u64;
        for k in 0..job.count {
            let due = job.start
                + Duration::from_nanos(
                    (u128::from(k) * 1_000_000_000 / u128::from(job.per_second)) as u64,
                );
            tokio::time::sleep_until(due).await;
            match sale(c, store, k).await {
                Ok(()) => written += 1,
                Err(e) => tracing::error!(%store, k, "a sale was not written: {e}"),
            }
        }
        let _ = job.done.send(written);
    }
}

/// The k-th sale of `store`, in a transaction of its own.
async fn sale(conn: &mut SqliteConnection, store: Uuid, k: u64) -> Result<(), sqlx::Error> {
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    let at_ns = wall_ns();
    sqlx::query(INSERT_SALE)
        .bind(Uuid::new_v4())
        .bind(store)
        .bind(k as i64)
        .bind(at_ns)
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// `write W S`: every store's writer told to write W rows a second for S seconds from
/// now; once all answered, `{"event":"written","rows":N}` with the rows they wrote.
async fn write_all(run: Arc<Run>, per_second: u64, seconds: u64) {
    let count = per_second * seconds;
    let start = tokio::time::Instant::now();
    let writers = run
        .writers
        .lock()
        .expect("no thread panics holding the writers")
        .clone();
    if (writers.len() as u64) < run.stores {
        tracing::warn!(
            ready = writers.len(),
            stores = run.stores,
            "`write` reaches only the stores whose database is set up"
        );
    }
    let mut answers = Vec::new();
    if count > 0 {
        // Stores do not write in step: writer i starts i/n of an interval late, as ferry's
        // host does (bench/sync/harness/src/replicas.rs).
        let n = writers.len().max(1) as u128;
        for (i, w) in writers.iter().enumerate() {
            let (done, answer) = oneshot::channel();
            let offset = i as u128 * 1_000_000_000 / (n * u128::from(per_second.max(1)));
            let job = Write {
                per_second,
                count,
                start: start + Duration::from_nanos(offset as u64),
                done,
            };
            if w.send(job).is_ok() {
                answers.push(answer);
            }
        }
    }
    let mut rows = 0u64;
    for answer in answers {
        rows += answer.await.unwrap_or(0);
    }
    say(&serde_json::json!({"event": "written", "rows": rows}));
}

/// The numbers of `write W S`: W rows a second (at least 1), S whole seconds.
fn write_command(line: &str) -> Option<Result<(u64, u64), String>> {
    let mut words = line.split_whitespace();
    if words.next() != Some("write") {
        return None;
    }
    let parse = |w: Option<&str>, what: &str| {
        w.ok_or_else(|| format!("`write W S`: {what} is missing"))?
            .parse::<u64>()
            .map_err(|e| format!("`write W S`: {what} is not a whole number ({e})"))
    };
    let answer = (|| {
        let per_second = parse(words.next(), "W")?;
        let seconds = parse(words.next(), "S")?;
        if words.next().is_some() {
            return Err("`write W S` takes two numbers".to_owned());
        }
        if per_second == 0 {
            return Err("`write W S`: W is 0 rows a second".to_owned());
        }
        per_second
            .checked_mul(seconds)
            .ok_or_else(|| "`write W S`: W * S overflows".to_owned())?;
        Ok((per_second, seconds))
    })();
    Some(answer)
}

/// Fetches and applies this store's messages until the host stops.
async fn fetch_loop(
    run: &Run,
    store: Uuid,
    replica: &Host,
    held: &mut Held,
    mut stopped: watch::Receiver<bool>,
) {
    let mut after = 0u64;
    loop {
        let url = format!("{}/down/{store}?after={after}&wait_ms={WAIT_MS}", run.base);
        let fetched = tokio::select! {
            _ = stopped.wait_for(|s| *s) => return,
            fetched = fetch(&run.client, &url) => fetched,
        };
        let body = match fetched {
            Ok(body) => body,
            Err(e) => {
                tracing::warn!(%store, "fetch failed, and is asked again: {e}");
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        run.totals
            .bytes_down
            .fetch_add(body.len() as u64, Ordering::Relaxed);
        let messages = match frames(&body) {
            Ok(messages) => messages,
            Err(e) => {
                tracing::warn!(%store, "a fetch's answer does not parse, and is asked again: {e}");
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        for (index, message) in messages {
            if index <= after {
                continue;
            }
            match replica.receive(message).await {
                Ok(received) => {
                    after = index;
                    held.note(run, store, received).await;
                }
                Err(e) => {
                    // Nothing of it was applied: it comes again with the next fetch.
                    tracing::warn!(%store, index, "receive failed, and the message comes again: {e}");
                    tokio::time::sleep(RETRY_PAUSE).await;
                    break;
                }
            }
        }
    }
}

async fn fetch(client: &reqwest::Client, url: &str) -> Result<Vec<u8>, String> {
    let response = client.get(url).send().await.map_err(|e| e.to_string())?;
    let status = response.status();
    let body = response.bytes().await.map_err(|e| e.to_string())?;
    if status != reqwest::StatusCode::OK {
        return Err(format!("HTTP {status}: {}", String::from_utf8_lossy(&body)));
    }
    Ok(body.to_vec())
}

/// The messages of a fetch's answer: `[u64 BE index][u32 BE length][bytes]` each.
fn frames(body: &[u8]) -> Result<Vec<(u64, &[u8])>, String> {
    let mut out = Vec::new();
    let mut rest = body;
    while !rest.is_empty() {
        if rest.len() < 12 {
            return Err(format!(
                "{} bytes left, short of a 12-byte frame head",
                rest.len()
            ));
        }
        let index = u64::from_be_bytes(rest[..8].try_into().expect("8 bytes"));
        let len = u32::from_be_bytes(rest[8..12].try_into().expect("4 bytes")) as usize;
        let Some(message) = rest.get(12..12 + len) else {
            return Err(format!(
                "message {index} says {len} bytes, {} are left",
                rest.len() - 12
            ));
        };
        out.push((index, message));
        rest = &rest[12 + len..];
    }
    Ok(out)
}

/// What the host knows of one store's replica: the `at_ns` it last saw of each row, and
/// until it is provisioned, the keys it saw applied.
struct Held {
    pool: SqlitePool,
    /// `(table, id)` to the `at_ns` last sampled.
    seen: HashMap<(usize, i64), i64>,
    provisioned: bool,
    /// Keys applied per table, kept only until provisioned: a cheap count that asks
    /// the database (`count(*)`) only once it reaches the target.
    applied: [HashSet<i64>; 2],
}

impl Held {
    fn new(pool: SqlitePool) -> Held {
        Held {
            pool,
            seen: HashMap::new(),
            provisioned: false,
            applied: [HashSet::new(), HashSet::new()],
        }
    }

    async fn note(&mut self, run: &Run, store: Uuid, received: Received) {
        match received {
            Received::Applied(applied) => {
                self.sample(run, store, &applied).await;
                if !self.provisioned {
                    for a in &applied {
                        if let Some(t) = MEASURED.iter().position(|(name, _)| *name == a.table) {
                            self.applied[t].extend(ids(a));
                        }
                    }
                    if self.applied[0].len() as u64 >= run.products
                        && self.applied[1].len() as u64 >= run.orders
                    {
                        self.check_provisioned(run).await;
                    }
                }
            }
            Received::Gap => {
                run.totals.gaps.fetch_add(1, Ordering::Relaxed);
            }
            Received::Malformed(why) => {
                tracing::warn!(%store, "magic_sync found a message malformed: {why}");
                run.totals.malformed.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// A sample of every row `applied` carried whose `at_ns` is new.
    async fn sample(&mut self, run: &Run, store: Uuid, applied: &[Applied]) {
        let now = wall_ns();
        let mut fresh = Vec::new();
        for a in applied {
            let Some(t) = MEASURED.iter().position(|(name, _)| *name == a.table) else {
                continue;
            };
            let ids: Vec<i64> = ids(a).collect();
            if ids.is_empty() {
                continue;
            }
            let list = serde_json::to_string(&ids).expect("integers serialize");
            let rows: Vec<(i64, i64)> = match sqlx::query_as(MEASURED[t].1)
                .bind(list)
                .fetch_all(&self.pool)
                .await
            {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::warn!(%store, "reading back applied rows for lag failed: {e}");
                    continue;
                }
            };
            for (id, at_ns) in rows {
                if self.seen.insert((t, id), at_ns) != Some(at_ns) {
                    fresh.push((at_ns, now - at_ns));
                }
            }
        }
        if !fresh.is_empty() {
            run.totals
                .samples
                .lock()
                .expect("no thread panics holding the samples")
                .extend(fresh);
        }
    }

    /// Counts what the replica holds, and once it holds N products and K orders, counts
    /// it provisioned — the last store to get there prints `provisioned`.
    async fn check_provisioned(&mut self, run: &Run) {
        if self.provisioned {
            return;
        }
        let count = |table: &'static str| {
            let pool = self.pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>(&format!("SELECT count(*) FROM {table}"))
                    .fetch_one(&pool)
                    .await
                    .unwrap_or(0)
            }
        };
        if (count("products").await as u64) < run.products
            || (count("orders").await as u64) < run.orders
        {
            return;
        }
        self.provisioned = true;
        self.applied = [HashSet::new(), HashSet::new()];
        let now = run.totals.provisioned.fetch_add(1, Ordering::SeqCst) + 1;
        if now == run.stores {
            say(&serde_json::json!({
                "event": "provisioned",
                "s": run.started.elapsed().as_secs_f64(),
                "bytes_down": run.totals.bytes_down.load(Ordering::Relaxed),
                "bytes_up": run.totals.bytes_up.load(Ordering::Relaxed),
            }));
        }
    }
}

/// The integer ids of the rows an `Applied` names (both tables are keyed by an int8).
fn ids(a: &Applied) -> impl Iterator<Item = i64> + '_ {
    a.keys.iter().filter_map(|key| match key.as_slice() {
        [KeyPart::Int(id)] => Some(*id),
        _ => None,
    })
}

/// The replica's way up: `POST /up/{uuid}`, counted as it is posted.
struct HttpUp {
    url: String,
    run: Arc<Run>,
}

impl Uplink for HttpUp {
    async fn send(
        &self,
        _replica: Uuid,
        _lane: &'static str,
        message: Vec<u8>,
    ) -> Result<(), Error> {
        self.run
            .totals
            .bytes_up
            .fetch_add(message.len() as u64, Ordering::Relaxed);
        let response = self
            .run
            .client
            .post(&self.url)
            .body(message)
            .send()
            .await
            .map_err(|e| Error::transport(true, format!("POST {}: {e}", self.url)))?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let text = response.text().await.unwrap_or_default();
        // The server answers 500 for what magic_sync's `receive` says must come again;
        // anything else it would answer is a request it will never take.
        let transient = status.is_server_error();
        Err(Error::transport(
            transient,
            format!("POST {}: HTTP {status}: {text}", self.url),
        ))
    }
}

/// Stdin: `mark` prints the totals so far; `stats` prints the lag of the samples since
/// the last `stats` and forgets them; `write W S` has every store write W sales a second
/// for S seconds, and prints `written` when all have; the end of stdin stops the host.
async fn commands(run: Arc<Run>, stop: watch::Sender<bool>) {
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    loop {
        match lines.next_line().await {
            Ok(Some(line)) if line.trim() == "mark" => {
                let t = &run.totals;
                say(&serde_json::json!({
                    "event": "mark",
                    "samples": t.samples.lock().expect("no thread panics holding the samples").len(),
                    "bytes_down": t.bytes_down.load(Ordering::Relaxed),
                    "bytes_up": t.bytes_up.load(Ordering::Relaxed),
                    "gaps": t.gaps.load(Ordering::Relaxed),
                }));
            }
            Ok(Some(line)) if line.trim() == "stats" => {
                let t = &run.totals;
                let taken = std::mem::take(
                    &mut *t.samples.lock().expect("no thread panics holding the samples"),
                );
                say(&lag_line("stats", taken, t));
            }
            Ok(Some(line)) if line.trim().is_empty() => {}
            Ok(Some(line)) => match write_command(&line) {
                Some(Ok((per_second, seconds))) => {
                    tokio::spawn(write_all(run.clone(), per_second, seconds));
                }
                Some(Err(e)) => tracing::warn!("{e}: nothing written"),
                None => tracing::warn!(
                    "unknown command {line:?}: only `mark`, `stats` and `write W S` are known"
                ),
            },
            Ok(None) | Err(_) => {
                let _ = stop.send(true);
                return;
            }
        }
    }
}

async fn signalled(stop: watch::Sender<bool>) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot watch SIGTERM or SIGINT: stop the host by closing its stdin");
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    let _ = stop.send(true);
}

/// The `done` line: lag percentiles over every sample of every store not yet taken by
/// `stats`, and the p50 of the first and last third of them by `at_ns` (does lag grow
/// over the run?).
fn done(t: &Totals) -> serde_json::Value {
    let samples = t
        .samples
        .lock()
        .expect("no thread panics holding the samples")
        .clone();
    lag_line("done", samples, t)
}

/// The lag line for `samples` (the `stats` command's and `done`'s).
fn lag_line(event: &str, mut samples: Vec<(i64, i64)>, t: &Totals) -> serde_json::Value {
    samples.sort_unstable();
    let third = samples.len() / 3;
    let p50_of = |part: &[(i64, i64)]| {
        let mut lags: Vec<i64> = part.iter().map(|s| s.1).collect();
        lags.sort_unstable();
        pct(&lags, 0.50)
    };
    let first = p50_of(&samples[..third]);
    let last = p50_of(&samples[samples.len() - third..]);
    let mut lags: Vec<i64> = samples.iter().map(|s| s.1).collect();
    lags.sort_unstable();
    serde_json::json!({
        "event": event,
        "samples": lags.len(),
        "p50_ms": pct(&lags, 0.50),
        "p95_ms": pct(&lags, 0.95),
        "p99_ms": pct(&lags, 0.99),
        "max_ms": lags.last().map(|l| *l as f64 / 1e6),
        "first_third_p50_ms": first,
        "last_third_p50_ms": last,
        "bytes_down": t.bytes_down.load(Ordering::Relaxed),
        "bytes_up": t.bytes_up.load(Ordering::Relaxed),
        "gaps": t.gaps.load(Ordering::Relaxed),
        "malformed": t.malformed.load(Ordering::Relaxed),
    })
}

/// The `p` quantile of `sorted` (nanoseconds) in milliseconds, nearest rank as ferry's
/// arm computes it; `None` (JSON null) with no samples.
fn pct(sorted: &[i64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    Some(sorted[((sorted.len() - 1) as f64 * p).round() as usize] as f64 / 1e6)
}

fn wall_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as i64)
}

/// Resolves once `stopped` turns true (or its sender is gone).
async fn until(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|s| *s).await;
}

/// One JSON line on stdout, flushed: the driver reads it as it comes.
fn say(v: &serde_json::Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn read_stores(path: &Path) -> Result<Vec<Uuid>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut stores = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let Some(first) = line.split_whitespace().next() else {
            continue;
        };
        let store = first.parse::<Uuid>().map_err(|e| {
            format!(
                "{} line {}: {first:?} is not a uuid ({e})",
                path.display(),
                n + 1
            )
        })?;
        stores.push(store);
    }
    if stores.is_empty() {
        return Err(format!("{} names no store", path.display()));
    }
    Ok(stores)
}

fn need(args: &[String], name: &str) -> Result<String, String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .ok_or_else(|| format!("{name} is required (usage: see bench/sync/magic/README.md)"))
}

fn number(args: &[String], name: &str) -> Result<u64, String> {
    let v = need(args, name)?;
    v.parse()
        .map_err(|e| format!("{name} {v}: not a whole number ({e})"))
}
