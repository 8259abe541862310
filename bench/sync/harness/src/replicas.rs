//! `replicas`: ferry's replica host for the side-by-side run (bench/sync/side), the
//! same contract as magic_sync's (`bench/sync/magic/README.md`):
//!
//! `ferry-bench-sync replicas --server URL --stores FILE --dir D --products N --orders-per-store K`
//!
//! One thread per replica runs ferry's own replica loop ([`Replica::run`], default
//! settings but a 1 s long poll so a stop is quick) over the built-in HTTP transport
//! (or NATS JetStream when `URL` is `nats://…`, prefix `ferry.sync`),
//! through a [`Downlink`] that counts bytes and measures lag when the loop fetches
//! again (right after each applied batch): every product or order row whose `at_ns` is new is a
//! sample `now - at_ns`. `FILE` has `uuid token` per line. Prints one JSON object per
//! line: `provisioned` once every replica holds N products and its K orders; on stdin
//! `mark`, the totals so far; `stats`, the lag of the samples since the last `stats`; `lose-next` makes the next fetched batch vanish (the
//! replica asks again from its position); `write W S`, each replica's app writes W sales
//! a second for S seconds (the way up; `written` when done); SIGTERM or stdin's end
//! prints `done`. Each replica runs ferry's uploader beside its loop.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_sync::client::Link;
use ferry_sync::nats::PREFIX_DEFAULT;
use ferry_sync::replica::{
    Downlink, Position, Replica, RunSettings, TransportError, UpSettings, Uploader,
};
use uuid::Uuid;

use crate::wall_ns;

/// What every replica thread adds to.
#[derive(Default)]
struct Totals {
    bytes_down: AtomicU64,
    bytes_up: AtomicU64,
    provisioned: AtomicU64,
    lose_next: AtomicBool,
    lost: AtomicU64,
    samples: Mutex<Vec<(i64, i64)>>,
}

/// A replica's link, by its server's scheme (subjects under the default prefix).
fn open_link(base: &str, id: Uuid, token: &str) -> Link {
    Link::new(base, PREFIX_DEFAULT, id, token).expect("a link")
}

/// The link, counting and measuring.
struct Measured {
    inner: Link,
    db: rusqlite::Connection,
    seen: HashMap<(u8, i64), i64>,
    provisioned: bool,
    products: i64,
    orders: i64,
    totals: Arc<Totals>,
}

impl Measured {
    fn count(&self, table: &str) -> i64 {
        self.db
            .query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
            .unwrap_or(0)
    }

    /// Called right after each applied batch (before the next fetch; also after an
    /// empty long poll, which finds nothing new). Until the replica holds all its rows,
    /// only counts (a count walks the table: about a millisecond at 100,000 rows); then
    /// samples the rows
    /// the writer touches: products 1 to 100 (its hot set, a key range) and the
    /// replica's own orders, which the driver's writer stamps with `at_ns`.
    fn sample(&mut self) {
        if !self.provisioned {
            if self.count("products") >= self.products && self.count("orders") >= self.orders {
                self.provisioned = true;
                self.totals.provisioned.fetch_add(1, Ordering::SeqCst);
            }
            return;
        }
        let now = wall_ns();
        let mut fresh = Vec::new();
        for (t, sql) in [
            (
                0u8,
                "SELECT id, at_ns FROM products WHERE id <= 100 AND at_ns > 0",
            ),
            (1u8, "SELECT id, at_ns FROM orders WHERE at_ns > 0"),
        ] {
            let Ok(mut stmt) = self.db.prepare_cached(sql) else {
                continue; // the table has not arrived yet
            };
            let rows: Vec<(i64, i64)> = stmt
                .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .map(|it| it.filter_map(Result::ok).collect())
                .unwrap_or_default();
            for (k, at_ns) in rows {
                if self.seen.insert((t, k), at_ns) != Some(at_ns) {
                    fresh.push((at_ns, now - at_ns));
                }
            }
        }
        if !fresh.is_empty() {
            self.totals.samples.lock().unwrap().extend(fresh);
        }
    }
}

impl Downlink for Measured {
    fn fetch(
        &mut self,
        position: Position,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        // The loop fetches right after applying a batch (reports go at most once a
        // second): the rows that batch brought are sampled here.
        self.sample();
        let frames = self.inner.fetch(position, max, wait)?;
        let bytes: usize = frames.iter().map(|f| f.len() + 4).sum();
        self.totals
            .bytes_down
            .fetch_add(bytes as u64, Ordering::Relaxed);
        if !frames.is_empty() && self.totals.lose_next.swap(false, Ordering::SeqCst) {
            self.totals.lost.fetch_add(1, Ordering::SeqCst);
            return Ok(Vec::new());
        }
        Ok(frames)
    }

    fn report(&mut self, up: &[u8]) -> Result<(), TransportError> {
        self.totals
            .bytes_up
            .fetch_add(up.len() as u64, Ordering::Relaxed);
        self.inner.report(up)
    }
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn pct(sorted: &[i64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize] as f64 / 1e6
}

/// Lag percentiles over `samples` (at_ns, lag), and the p50 of their first and last
/// third by `at_ns`: does lag grow over the run?
fn lag_stats(mut all: Vec<(i64, i64)>) -> serde_json::Value {
    all.sort();
    let third = all.len() / 3;
    let mut first: Vec<i64> = all[..third].iter().map(|s| s.1).collect();
    let mut last: Vec<i64> = all[all.len() - third..].iter().map(|s| s.1).collect();
    first.sort();
    last.sort();
    let mut lags: Vec<i64> = all.iter().map(|s| s.1).collect();
    lags.sort();
    serde_json::json!({
        "samples": lags.len(),
        "p50_ms": pct(&lags, 0.5), "p95_ms": pct(&lags, 0.95), "p99_ms": pct(&lags, 0.99),
        "max_ms": pct(&lags, 1.0),
        "first_third_p50_ms": pct(&first, 0.5), "last_third_p50_ms": pct(&last, 0.5),
    })
}

fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
    for (k, v) in from.as_object().into_iter().flatten() {
        into[k] = v.clone();
    }
}

fn follow(
    base: String,
    id: Uuid,
    token: String,
    dir: &Path,
    (products, orders): (i64, i64),
    totals: Arc<Totals>,
    stop: Arc<AtomicBool>,
) -> u64 {
    let file = dir.join(format!("{id}.db"));
    let mut replica = Replica::open(&file, ferry_sync::wire::seal_key(token.as_bytes()))
        .expect("the replica's file opens");
    let db = rusqlite::Connection::open(&file).expect("a reader opens the replica's file");
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    let mut link = Measured {
        inner: open_link(&base, id, &token),
        db,
        seen: HashMap::new(),
        provisioned: false,
        products,
        orders,
        totals,
    };
    let settings = RunSettings {
        wait: Duration::from_secs(1),
        ..RunSettings::default()
    };
    // The way up beside the loop, as `ferry sync replica` runs it: its own connection
    // and link, default settings.
    let mut uploader = Uploader::open(&file, ferry_sync::wire::seal_key(token.as_bytes()), id)
        .expect("the uploader opens the replica's file");
    let mut uplink = open_link(&base, id, &token);
    let link_back = Arc::new(ferry_sync::replica::LinkBack::default());
    uploader.set_link_back(link_back.clone());
    replica.set_link_back(link_back);
    let up_stop = stop.clone();
    let up = std::thread::spawn(move || {
        if let Err(e) = uploader.run(&mut uplink, &up_stop, &UpSettings::default()) {
            eprintln!("replica {id}'s uploader stopped: {e}");
        }
    });
    if let Err(e) = replica.run(&mut link, &stop, &settings) {
        eprintln!("replica {id} stopped: {e}");
    }
    let _ = up.join();
    // A gap left standing at the end (the replica's file records the last one).
    replica.status().map_or(0, |s| u64::from(s.gap != 0))
}

pub async fn main() {
    let base = arg("--server").expect("--server URL");
    let stores = arg("--stores").expect("--stores FILE");
    let dir = PathBuf::from(arg("--dir").expect("--dir D"));
    let products: i64 = arg("--products").and_then(|v| v.parse().ok()).unwrap_or(0);
    let orders: i64 = arg("--orders-per-store")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    std::fs::create_dir_all(&dir).unwrap();
    let list = std::fs::read_to_string(&stores).expect("the stores file reads");
    let totals = Arc::new(Totals::default());
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut threads = Vec::new();
    let mut files = Vec::new();
    for line in list.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split_whitespace();
        let id: Uuid = f.next().unwrap().parse().expect("a uuid");
        let token = f.next().expect("a token after the uuid").to_string();
        files.push((id, dir.join(format!("{id}.db"))));
        let (base, dir, totals, stop) = (base.clone(), dir.clone(), totals.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            follow(base, id, token, &dir, (products, orders), totals, stop)
        }));
    }
    let n = threads.len() as u64;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line.trim().to_string()).is_err() {
                return;
            }
        }
        let _ = tx.send("eof".into());
    });
    let mut term =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
    let mut announced = false;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    let line = |event: &str| {
        serde_json::json!({
            "event": event,
            "s": started.elapsed().as_secs_f64(),
            "samples": totals.samples.lock().unwrap().len(),
            "bytes_down": totals.bytes_down.load(Ordering::SeqCst),
            "bytes_up": totals.bytes_up.load(Ordering::SeqCst),
            "lost": totals.lost.load(Ordering::SeqCst),
        })
    };
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if !announced && totals.provisioned.load(Ordering::SeqCst) >= n {
                    announced = true;
                    println!("{}", line("provisioned"));
                }
            }
            cmd = rx.recv() => match cmd.as_deref() {
                Some("mark") => println!("{}", line("mark")),
                Some("stats") => {
                    let taken = std::mem::take(&mut *totals.samples.lock().unwrap());
                    let mut stats = line("stats");
                    merge(&mut stats, lag_stats(taken));
                    println!("{stats}");
                }
                Some("lose-next") => totals.lose_next.store(true, Ordering::SeqCst),
                Some(cmd) if cmd.starts_with("write ") => {
                    let mut f = cmd.split_whitespace().skip(1).map(|v| v.parse::<u64>().unwrap_or(0));
                    let (rate, seconds) = (f.next().unwrap_or(0), f.next().unwrap_or(0));
                    write_sales(&files, rate, seconds);
                }
                Some("eof") | None => break,
                Some(other) => eprintln!("unknown command {other:?} (mark, stats, lose-next)"),
            },
            _ = term.recv() => break,
        }
    }
    stop.store(true, Ordering::SeqCst);
    let gaps: u64 = threads.into_iter().map(|t| t.join().unwrap_or(0)).sum();
    let all = std::mem::take(&mut *totals.samples.lock().unwrap());
    let mut done = line("done");
    merge(&mut done, lag_stats(all));
    done["gaps"] = gaps.into();
    done["malformed"] = 0.into();
    println!("{done}");
}

/// `write W S`: each replica's app writes W sales a second for S seconds into its file
/// (open loop: replica i's k-th at start + (k + i/R)/W s), one row per transaction, `at_ns` the wall clock
/// right before the commit; then prints `written` with the rows written in all. The
/// uploaders beside the replica loops send them; the driver reads what was filed when.
fn write_sales(files: &[(Uuid, PathBuf)], rate: u64, seconds: u64) {
    let files = files.to_vec();
    let replicas = files.len().max(1);
    std::thread::spawn(move || {
        let start = Instant::now();
        let writers: Vec<_> = files
            .into_iter()
            .enumerate()
            .map(|(i, (id, file))| {
                // Stores do not write in step: replica i's writes are offset by i/R of
                // the interval.
                let offset = i as f64 / replicas as f64;
                std::thread::spawn(move || {
                    let app = rusqlite::Connection::open(&file).expect("the app opens the file");
                    app.busy_timeout(Duration::from_secs(30)).unwrap();
                    app.execute_batch("PRAGMA synchronous=FULL").unwrap();
                    let n = rate * seconds;
                    for k in 0..n {
                        let due = start
                            + Duration::from_secs_f64((k as f64 + offset) / rate.max(1) as f64);
                        if let Some(wait) = due.checked_duration_since(Instant::now()) {
                            std::thread::sleep(wait);
                        }
                        app.execute(
                            "INSERT INTO sales (id, store, amount, at_ns) VALUES (?1, ?2, ?3, ?4)",
                            rusqlite::params![
                                Uuid::new_v4().to_string(),
                                id.to_string(),
                                k as i64,
                                wall_ns()
                            ],
                        )
                        .expect("the app writes a sale");
                    }
                    n
                })
            })
            .collect();
        let rows: u64 = writers.into_iter().map(|w| w.join().unwrap_or(0)).sum();
        println!("{}", serde_json::json!({"event": "written", "rows": rows}));
    });
}
