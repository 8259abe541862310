//! `ferry demo`: ferry-ship's main job on embedded defaults, end to end, with a report.
//!
//! 1. Start a receiver (a child `ferry receive` process) on a temporary directory.
//! 2. An app writes orders to `primary/orders.db`, one transaction each, at a steady rate,
//!    through a connection prepared with `prepare_connection`; an in-process shipper ships.
//! 3. A reader polls the standby replica and measures the lag from each commit to the
//!    moment the row is visible there.
//! 4. Mid-way the receiver is killed with SIGKILL and restarted a second later.
//! 5. After the writes, wait for the shipper to catch up, then promote the replica (with
//!    the old shipper still running), check the promoted copy equals the primary and
//!    passes integrity_check, and show that the old primary is now fenced.
//! 6. The outbox part (`demo_outbox`): orders and their events in one SQLite transaction,
//!    relayed to a webhook endpoint that goes down and comes back mid-way.
//! 7. The flow part (`demo_flow`): order workflows through an engine SIGKILLed mid-way;
//!    then (`demo_flow_server`) on a flow server with two workers, through a worker's
//!    SIGKILL and the server's.
//! 8. The sync part (`demo_sync`): a Postgres shop kept on three stores' SQLite replicas
//!    through a relay SIGKILL, a network cut and a store offline, checked in content.

use crate::report::{fact, say};
use anyhow::{Context, anyhow, bail, ensure};
use clap::Args;
use ferry_ship::{Shipper, ShipperConfig};
use rusqlite::{Connection, OpenFlags};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct DemoArgs {
    /// Work in this directory (kept afterwards) instead of a temporary one.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// How long the app writes, in milliseconds.
    #[arg(long, default_value_t = 6_000)]
    write_ms: u64,
    /// The same in seconds: the spelling before durations were milliseconds everywhere.
    #[arg(long, hide = true, conflicts_with = "write_ms")]
    seconds: Option<f64>,
    /// Orders (transactions) per second.
    #[arg(long, default_value_t = 500)]
    rate: u32,
    /// Keep the temporary directory.
    #[arg(long)]
    keep: bool,
    /// Orders the outbox part writes.
    #[arg(long, default_value_t = 3000)]
    outbox_orders: u64,
    /// Print JSON: the figures of each part and whether every check held (the
    /// sentences go to stderr).
    #[arg(long)]
    json: bool,
    /// Order workflows the flow part runs.
    #[arg(long, default_value_t = 200)]
    flow_orders: u32,
}

impl DemoArgs {
    /// How long the app writes, in ms, by whichever spelling was given.
    fn write_ms(&self) -> u64 {
        match self.seconds {
            Some(secs) => (secs * 1e3) as u64,
            None => self.write_ms,
        }
    }
}

pub fn run(a: DemoArgs) -> anyhow::Result<()> {
    let write_ms = a.write_ms();
    ensure!(
        (2_000..=600_000).contains(&write_ms),
        "--write-ms {write_ms} must be between 2000 and 600000"
    );
    ensure!(
        a.rate >= 1 && a.rate <= 20_000,
        "--rate must be between 1 and 20000"
    );
    ensure!(
        a.outbox_orders >= 30 && a.outbox_orders <= 1_000_000,
        "--outbox-orders must be between 30 and 1000000"
    );
    ensure!(
        a.flow_orders >= 2 && a.flow_orders <= 10_000,
        "--flow-orders must be between 2 and 10000"
    );
    let (root, temporary) = match &a.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("ferry-demo-{}", std::process::id())),
            true,
        ),
    };
    let _ = std::fs::remove_dir_all(&root);
    crate::report::json(a.json);
    let result = demo(&root, &a);
    if temporary && !a.keep {
        let _ = std::fs::remove_dir_all(&root);
    } else {
        say!("  files kept in {}", root.display());
    }
    crate::report::finish(&result);
    if a.json && result.is_err() {
        // The document says what failed; the exit status must too.
        std::process::exit(1);
    }
    result
}

fn demo(root: &Path, a: &DemoArgs) -> anyhow::Result<()> {
    let primary = root.join("primary");
    let standby = root.join("standby");
    std::fs::create_dir_all(&primary)?;
    std::fs::create_dir_all(&standby)?;
    say!("ferry demo: ferry-ship keeps a warm standby of a live SQLite database");
    say!(
        "  SQLite {} (bundled), working in {}",
        rusqlite::version(),
        root.display()
    );

    let port = free_port()?;
    let peer = format!("http://127.0.0.1:{port}");
    let mut receiver = Receiver::start(&standby, port, root)?;

    let db = primary.join("orders.db");
    let mut app = Connection::open(&db)?;
    ferry_ship::prepare_connection(&mut app)?;
    app.execute_batch(
        "CREATE TABLE IF NOT EXISTS orders(id INTEGER PRIMARY KEY, customer TEXT NOT NULL, amount INTEGER NOT NULL, note BLOB)",
    )?;
    let shipper = Shipper::start(ShipperConfig::new(&primary, &peer)).map_err(|e| anyhow!(e))?;

    let commits: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (commits, stop, replica) = (commits.clone(), stop.clone(), standby.join("orders.db"));
        std::thread::spawn(move || poll_replica(&replica, &commits, &stop))
    };

    let total = a.write_ms() * u64::from(a.rate) / 1000;
    let interval = Duration::from_secs_f64(1.0 / a.rate as f64);
    let kill_at = total * 2 / 5;
    let restart_after = Duration::from_secs(1);
    let started = Instant::now();
    let mut outage: Option<(Instant, Option<Instant>)> = None;
    let mut rng = ferry_core::seams::SplitMix64::from_entropy();
    for i in 0..total {
        let due = started + interval * i as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        use ferry_core::seams::Rng;
        let note = vec![b'x'; 200 + rng.below(600) as usize];
        app.execute(
            "INSERT INTO orders(customer, amount, note) VALUES (?1, ?2, ?3)",
            rusqlite::params![
                format!("customer-{}", rng.below(1000)),
                rng.below(100_000) as i64,
                note
            ],
        )?;
        commits.lock().expect("commits lock").push(Instant::now());
        if i == kill_at {
            receiver.kill()?;
            outage = Some((Instant::now(), None));
        }
        if let Some((down, None)) = outage
            && down.elapsed() >= restart_after
        {
            receiver = Receiver::start(&standby, port, root)?;
            outage = Some((down, Some(Instant::now())));
        }
    }
    let wrote_secs = started.elapsed().as_secs_f64();
    let caught_up = wait_caught_up(&standby.join("orders.db"), total, Duration::from_secs(60))?;
    stop.store(true, Ordering::SeqCst);
    let seen = reader
        .join()
        .map_err(|_| anyhow!("the replica reader panicked"))??;

    // Promote with the old shipper still running.
    let promoted = root.join("promoted").join("orders.db");
    let p = ferry_ship::promote(&standby, "orders", &promoted, &mut |_, _| {})
        .map_err(|e| anyhow!(e))?;
    let primary_digest = ferry_ship::sqlite::digest(&app)?;
    let copy = Connection::open_with_flags(&promoted, OpenFlags::SQLITE_OPEN_READ_WRITE)?;
    let copy_digest = ferry_ship::sqlite::digest(&copy)?;
    let integrity: String = copy.query_row("PRAGMA integrity_check", [], |r| r.get(0))?;
    copy.execute(
        "INSERT INTO orders(customer, amount) VALUES ('written on the new primary', 1)",
        [],
    )?;
    drop(copy);

    // The old primary keeps writing; its shipper must be refused.
    app.execute(
        "INSERT INTO orders(customer, amount) VALUES ('written on the old primary', 1)",
        [],
    )?;
    let fenced = wait_for(Duration::from_secs(10), || {
        shipper
            .status()
            .databases
            .iter()
            .any(|d| d.name == "orders" && d.state == "fenced")
    });
    let status = shipper.status();
    let d = status
        .databases
        .iter()
        .find(|d| d.name == "orders")
        .ok_or_else(|| anyhow!("orders not tracked"))?;
    drop(shipper);
    receiver.stop();

    let (lags, outage_lags) = split_lags(&commits.lock().expect("commits lock"), &seen, outage);
    fact("ship", "orders", total);
    fact("ship", "orders_per_sec", total as f64 / wrote_secs);
    fact(
        "ship",
        "lag_p50_ms",
        percentile(&lags, 50.0).map(|d| d.as_secs_f64() * 1e3),
    );
    fact(
        "ship",
        "lag_p99_ms",
        percentile(&lags, 99.0).map(|d| d.as_secs_f64() * 1e3),
    );
    fact(
        "ship",
        "lag_max_ms",
        lags.last().map(|d| d.as_secs_f64() * 1e3),
    );
    fact("ship", "outage_orders", outage_lags.len());
    fact("ship", "bases", d.bases.values().sum::<u64>());
    fact("ship", "caught_up_secs", caught_up.as_secs_f64());
    fact("ship", "promoted_epoch", p.epoch);
    fact("ship", "promoted_equal", copy_digest == primary_digest);
    fact("ship", "promoted_integrity", &integrity);
    fact("ship", "old_primary_fenced", fenced);
    say!(
        "  wrote {total} orders, one transaction each, in {wrote_secs:.1} s ({:.0}/s)",
        total as f64 / wrote_secs
    );
    if let Some((down, Some(up))) = outage {
        say!(
            "  killed the receiver with SIGKILL after order {kill_at}, restarted it {:.1} s later",
            up.duration_since(down).as_secs_f64()
        );
    }
    say!(
        "  lag from commit to visible on the standby: p50 {}, p99 {}, max {} ({} orders outside the outage)",
        ms(percentile(&lags, 50.0)),
        ms(percentile(&lags, 99.0)),
        ms(lags.last().copied()),
        lags.len()
    );
    say!(
        "  {} orders waited across the outage (until the standby held everything committed before the restart); the longest reached the standby {} after its commit",
        outage_lags.len(),
        ms(outage_lags.last().copied())
    );
    let bases: Vec<String> = d.bases.iter().map(|(k, v)| format!("{k}={v}")).collect();
    say!(
        "  the standby showed the last order {:.3} s after the app stopped writing; bases sent: {} (the first copy only: the outage healed from the WAL)",
        caught_up.as_secs_f64(),
        bases.join(", ")
    );
    say!(
        "  promoted standby/orders.db to promoted/orders.db at epoch {}: {} rows, digest {:016x} {} the primary's; integrity_check: {integrity}",
        p.epoch,
        copy_digest.rows,
        copy_digest.hash,
        if copy_digest == primary_digest {
            "equal to"
        } else {
            "DIFFERENT FROM"
        }
    );
    say!(
        "  the old primary's shipper after promotion: {}",
        if fenced {
            "fenced (the receiver refuses its epoch)"
        } else {
            "NOT FENCED"
        }
    );
    ensure!(
        copy_digest == primary_digest,
        "the promoted copy differs from the primary"
    );
    ensure!(
        integrity == "ok",
        "the promoted copy failed integrity_check: {integrity}"
    );
    ensure!(fenced, "the old primary was not fenced after promotion");
    ensure!(
        d.bases.values().sum::<u64>() == 1,
        "expected exactly one base, got {bases:?}"
    );
    crate::demo_outbox::run(root, a.outbox_orders)?;
    crate::demo_flow::run(root, a.flow_orders)?;
    crate::demo_flow_server::run(root, a.flow_orders)?;
    crate::demo_sync::run(root)?;
    say!("OK");
    Ok(())
}

/// The receiver as a child process.
struct Receiver {
    child: Child,
}

impl Receiver {
    fn start(dir: &Path, port: u16, root: &Path) -> anyhow::Result<Receiver> {
        let listen = format!("127.0.0.1:{port}");
        let args = [
            "ship".as_ref(),
            "receive".as_ref(),
            "--dir".as_ref(),
            dir.as_os_str(),
            "--listen".as_ref(),
            listen.as_ref(),
        ];
        let child = spawn_ferry::<&std::ffi::OsStr>("receiver", &args, &root.join("receiver.log"))?;
        let r = Receiver { child };
        if !wait_for(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        }) {
            bail!(
                "the receiver did not start listening on port {port}; see {}",
                root.join("receiver.log").display()
            );
        }
        Ok(r)
    }

    fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    fn stop(mut self) {
        // SAFETY: kill(2) on our own child's pid, which we have not waited for yet.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let _ = self.child.wait();
    }
}

impl Drop for Receiver {
    /// A demo that fails half-way must not leave its receiver running.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Start this executable as a child of the demo with `args`, its stderr appended to
/// `log` (its logs at warn, or at `FERRY_DEMO_CHILD_LOG` to look into a run).
pub(crate) fn spawn_ferry<S: AsRef<std::ffi::OsStr>>(
    what: &str,
    args: &[S],
    log: &Path,
) -> anyhow::Result<Child> {
    let exe = std::env::current_exe().context("finding the ferry executable")?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    Command::new(exe)
        .args(args)
        .env(
            "FERRY_LOG",
            std::env::var("FERRY_DEMO_CHILD_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting the {what}"))
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn wait_for(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

/// Wait until the standby shows the last order, read on a connection of our own.
fn wait_caught_up(replica: &Path, total: u64, limit: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let ok = wait_for(limit, || {
        Connection::open_with_flags(replica, OpenFlags::SQLITE_OPEN_READ_ONLY)
            .and_then(|c| {
                c.query_row("SELECT max(id) FROM orders", [], |r| {
                    r.get::<_, Option<i64>>(0)
                })
            })
            .is_ok_and(|m| m == Some(total as i64))
    });
    ensure!(
        ok,
        "the standby did not catch up within {limit:?} ({total} orders written)"
    );
    Ok(start.elapsed())
}

/// Poll the replica every 2 ms; return, for each order id, when it was first seen.
fn poll_replica(
    replica: &Path,
    commits: &Mutex<Vec<Instant>>,
    stop: &AtomicBool,
) -> anyhow::Result<Vec<Option<Instant>>> {
    let mut seen: Vec<Option<Instant>> = Vec::new();
    let mut conn: Option<Connection> = None;
    loop {
        let done = stop.load(Ordering::SeqCst);
        if conn.is_none() && replica.exists() {
            conn = Connection::open_with_flags(replica, OpenFlags::SQLITE_OPEN_READ_ONLY).ok();
        }
        if let Some(c) = &conn {
            let max: Option<i64> = c
                .query_row("SELECT max(id) FROM orders", [], |r| r.get(0))
                .unwrap_or(None);
            let now = Instant::now();
            let max = max.unwrap_or(0).max(0) as usize;
            let committed = commits.lock().expect("commits lock").len();
            if seen.len() < max.min(committed) {
                seen.resize(max.min(committed), Some(now));
            }
        }
        if done {
            return Ok(seen);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Lags of orders committed outside and inside the outage, each sorted.
fn split_lags(
    commits: &[Instant],
    seen: &[Option<Instant>],
    outage: Option<(Instant, Option<Instant>)>,
) -> (Vec<Duration>, Vec<Duration>) {
    let (mut normal, mut during) = (Vec::new(), Vec::new());
    // The outage lasts until everything committed before the receiver came back is on
    // the standby: the shipper reconnects after its backoff and ships that backlog
    // first, and orders committed meanwhile wait behind it.
    let healed = outage.and_then(|(_, up)| {
        let up = up?;
        commits
            .iter()
            .zip(seen)
            .filter(|(c, _)| **c <= up)
            .filter_map(|(_, s)| *s)
            .max()
    });
    for (i, c) in commits.iter().enumerate() {
        let Some(Some(s)) = seen.get(i) else { continue };
        let lag = s.saturating_duration_since(*c);
        // Waiting across the outage: committed before it healed and seen after the
        // receiver went down.
        let in_outage = match (outage, healed) {
            (Some((down, _)), Some(healed)) => *c <= healed && *s >= down,
            _ => false,
        };
        if in_outage {
            during.push(lag)
        } else {
            normal.push(lag)
        }
    }
    normal.sort();
    during.sort();
    (normal, during)
}

fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    Some(sorted[i])
}

fn ms(d: Option<Duration>) -> String {
    d.map_or("-".into(), |d| {
        format!("{:.1} ms", d.as_secs_f64() * 1000.0)
    })
}
