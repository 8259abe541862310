//! The benchmark harness for ferry-ship (bench/ship/run drives it):
//!
//! - `write`: the workload, the same for every system: one row of 1 KiB of random bytes
//!   per transaction, at a fixed rate or as fast as it goes, recording each commit's
//!   CLOCK_MONOTONIC time and latency. With `--ship PEER` it ships in-process with
//!   ferry-ship (a prepared connection wakes the shipper on commit).
//! - `poll`: reads `max(id)` of a replica every millisecond and records when it changes.
//! - `proxy`: forwards TCP and counts the bytes each way (bytes on the wire).
//!
//! Outputs are plain text files the Python side reads.

use rusqlite::{Connection, OpenFlags};
use std::io::{BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let r = match args.get(1).map(String::as_str) {
        Some("write") => write(&args[2..]),
        Some("poll") => poll(&args[2..]),
        Some("proxy") => proxy(&args[2..]),
        _ => Err("usage: ferry-bench-ship write|poll|proxy [--flags]".to_string()),
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn need(args: &[String], name: &str) -> Result<String, String> {
    flag(args, name).ok_or_else(|| format!("missing {name}"))
}

/// CLOCK_MONOTONIC in nanoseconds, comparable across processes (and with Python's
/// time.monotonic_ns()).
fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass; CLOCK_MONOTONIC always exists.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPU seconds (user + system) of this process's threads whose names start with any of
/// `prefixes`.
fn thread_cpu(prefixes: &[&str]) -> f64 {
    let ticks = 100.0; // sysconf(_SC_CLK_TCK) on Linux
    let mut total = 0u64;
    for e in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        if !prefixes.iter().any(|p| comm.trim().starts_with(p)) {
            continue;
        }
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let after = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
        let f: Vec<&str> = after.split_whitespace().collect();
        total += f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        total += f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    }
    total as f64 / ticks
}

fn write(args: &[String]) -> Result<(), String> {
    let db = PathBuf::from(need(args, "--db")?);
    let rate: u64 = flag(args, "--rate")
        .map_or(Ok(0), |v| v.parse())
        .map_err(|e| format!("--rate: {e}"))?;
    let seconds: f64 = need(args, "--seconds")?
        .parse()
        .map_err(|e| format!("--seconds: {e}"))?;
    let out = flag(args, "--out").map(PathBuf::from);
    let pragmas = flag(args, "--pragmas").unwrap_or_else(|| "prepared".into());
    let ship = flag(args, "--ship");
    let payload: usize = flag(args, "--payload")
        .map_or(Ok(1024), |v| v.parse())
        .map_err(|e| format!("--payload: {e}"))?;
    let mut conn = Connection::open(&db).map_err(|e| e.to_string())?;
    conn.busy_timeout(Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    match pragmas.as_str() {
        "prepared" => ferry_ship::prepare_connection(&mut conn).map_err(|e| e.to_string())?,
        "default" => {
            conn.query_row("PRAGMA journal_mode=WAL", [], |_| Ok(()))
                .map_err(|e| e.to_string())?;
        }
        other => return Err(format!("--pragmas {other}: prepared or default")),
    }
    if let Some(s) = flag(args, "--synchronous") {
        conn.pragma_update(None, "synchronous", s)
            .map_err(|e| e.to_string())?;
    }
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, payload BLOB NOT NULL)",
    )
    .map_err(|e| e.to_string())?;
    let shipper = match &ship {
        Some(peer) => {
            let dir = db.parent().unwrap_or(Path::new("."));
            Some(ferry_ship::Shipper::start(ferry_ship::ShipperConfig::new(
                dir,
                peer.clone(),
            ))?)
        }
        None => None,
    };
    let mut lines = out
        .map(|p| std::fs::File::create(p).map(BufWriter::new))
        .transpose()
        .map_err(|e| e.to_string())?;
    let mut insert = conn
        .prepare("INSERT INTO t(payload) VALUES (randomblob(?1))")
        .map_err(|e| e.to_string())?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let mut latencies = Vec::new();
    let mut n = 0u64;
    while Instant::now() < deadline {
        if rate > 0 {
            let due = start + Duration::from_secs_f64(n as f64 / rate as f64);
            if let Some(w) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(w);
            }
        }
        let t0 = mono_ns();
        insert
            .execute([payload as i64])
            .map_err(|e| e.to_string())?;
        let t1 = mono_ns();
        n += 1;
        latencies.push(t1 - t0);
        if let Some(l) = &mut lines {
            writeln!(l, "{} {}", conn.last_insert_rowid(), t1).map_err(|e| e.to_string())?;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    drop(insert);
    if let Some(l) = &mut lines {
        l.flush().map_err(|e| e.to_string())?;
    }
    // Let an in-process shipper finish: wait until it has nothing outstanding.
    let mut shipped = serde_json::Value::Null;
    if let Some(s) = &shipper {
        // Idle twice in a row, 50 ms apart: a status taken right after the last commit can
        // predate the shipper seeing it.
        let wait = Instant::now();
        let mut idle_in_a_row = 0;
        while wait.elapsed() < Duration::from_secs(120) && idle_in_a_row < 2 {
            std::thread::sleep(Duration::from_millis(50));
            let st = s.status();
            let idle = st
                .databases
                .iter()
                .all(|d| d.lag_transactions == 0 && d.state == "idle");
            idle_in_a_row = if idle { idle_in_a_row + 1 } else { 0 };
        }
        shipped = serde_json::to_value(s.status()).unwrap_or_default();
    }
    let cpu = thread_cpu(&["ferry-ship"]);
    latencies.sort_unstable();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len().max(1) - 1) as f64 * p) as usize)
            .copied()
            .unwrap_or(0)
    };
    let summary = serde_json::json!({
        "transactions": n,
        "seconds": elapsed,
        "tps": n as f64 / elapsed,
        "commit_p50_us": pct(0.50) as f64 / 1000.0,
        "commit_p99_us": pct(0.99) as f64 / 1000.0,
        "commit_max_us": latencies.last().copied().unwrap_or(0) as f64 / 1000.0,
        "shipper_cpu_secs": cpu,
        "shipper": shipped,
        "sqlite": rusqlite::version(),
    });
    println!("{summary}");
    drop(shipper);
    Ok(())
}

fn poll(args: &[String]) -> Result<(), String> {
    let db = PathBuf::from(need(args, "--db")?);
    let seconds: f64 = need(args, "--seconds")?
        .parse()
        .map_err(|e| format!("--seconds: {e}"))?;
    let out = PathBuf::from(need(args, "--out")?);
    let interval = Duration::from_micros(
        flag(args, "--interval-us")
            .map_or(Ok(1000), |v| v.parse())
            .map_err(|e| format!("{e}"))?,
    );
    let mut f = BufWriter::new(std::fs::File::create(&out).map_err(|e| e.to_string())?);
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let mut conn: Option<Connection> = None;
    let mut last = -1i64;
    let mut reopen_at = Instant::now();
    while Instant::now() < deadline {
        if conn.is_none() || reopen_at.elapsed() > Duration::from_secs(2) {
            // Reopen now and then: a replaced replica file is only seen by a new handle.
            conn = Connection::open_with_flags(&db, OpenFlags::SQLITE_OPEN_READ_ONLY)
                .ok()
                .and_then(|c| c.busy_timeout(Duration::from_millis(50)).ok().map(|_| c));
            reopen_at = Instant::now();
        }
        if let Some(c) = &conn {
            match c.query_row("SELECT max(id) FROM t", [], |r| r.get::<_, Option<i64>>(0)) {
                Ok(Some(m)) if m != last => {
                    // Flushed at once: the poller is stopped with a signal.
                    writeln!(f, "{} {m}", mono_ns())
                        .and_then(|_| f.flush())
                        .map_err(|e| e.to_string())?;
                    last = m;
                }
                Ok(_) => {}
                Err(_) => conn = None,
            }
        }
        std::thread::sleep(interval);
    }
    f.flush().map_err(|e| e.to_string())
}

fn proxy(args: &[String]) -> Result<(), String> {
    let listen = need(args, "--listen")?;
    let to = need(args, "--to")?;
    let stats = PathBuf::from(need(args, "--stats")?);
    let listener = TcpListener::bind(&listen).map_err(|e| format!("{listen}: {e}"))?;
    let up = Arc::new(AtomicU64::new(0));
    let down = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    {
        let (up, down, stats) = (up.clone(), down.clone(), stats.clone());
        // Written aside and renamed over: a reader never sees the file empty between a
        // truncation and the write.
        let staged = stats.with_extension("next");
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(200));
                let line = format!(
                    "{} {}\n",
                    up.load(Ordering::Relaxed),
                    down.load(Ordering::Relaxed)
                );
                if std::fs::write(&staged, line).is_ok() {
                    let _ = std::fs::rename(&staged, &stats);
                }
            }
        });
    }
    for conn in listener.incoming() {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let Ok(client) = conn else { continue };
        let Ok(server) = TcpStream::connect(&to) else {
            continue;
        };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (c2, s2) = (
            client.try_clone().map_err(|e| e.to_string())?,
            server.try_clone().map_err(|e| e.to_string())?,
        );
        let (u, d) = (up.clone(), down.clone());
        std::thread::spawn(move || pipe(client, server, &u));
        std::thread::spawn(move || pipe(s2, c2, &d));
    }
    Ok(())
}

fn pipe(mut from: TcpStream, mut to: TcpStream, count: &AtomicU64) {
    let mut buf = vec![0u8; 256 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
                count.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}
