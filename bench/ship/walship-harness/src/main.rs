//! The walship arm of bench/ship, mirroring ferry-bench-ship's `write` and adding a
//! `receive` subcommand: the same workload (one row of 1 KiB random bytes per
//! transaction), written through libSQL (walship's hard requirement: every SQLite access
//! in the process goes through the same libSQL build), shipped in-process by walship with
//! `wake()` after each commit, as its README recommends.

use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let r = match args.get(1).map(String::as_str) {
        Some("write") => write(&args[2..]),
        Some("receive") => receive(&args[2..]),
        _ => Err("usage: walship-bench-harness write|receive [--flags]".to_string()),
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn need(args: &[String], name: &str) -> Result<String, String> {
    flag(args, name).ok_or_else(|| format!("missing {name}"))
}

fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec we pass; CLOCK_MONOTONIC always exists.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn thread_cpu(prefixes: &[&str]) -> f64 {
    let mut total = 0u64;
    for e in std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten() {
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
    total as f64 / 100.0
}

fn write(args: &[String]) -> Result<(), String> {
    let db = PathBuf::from(need(args, "--db")?);
    let rate: u64 = flag(args, "--rate").map_or(Ok(0), |v| v.parse()).map_err(|e| format!("--rate: {e}"))?;
    let seconds: f64 = need(args, "--seconds")?.parse().map_err(|e| format!("--seconds: {e}"))?;
    let out = flag(args, "--out").map(PathBuf::from);
    let peer = need(args, "--peer")?;
    let payload: usize = flag(args, "--payload").map_or(Ok(1024), |v| v.parse()).map_err(|e| format!("{e}"))?;
    let dir = db.parent().ok_or("--db has no directory")?.to_path_buf();
    let name = db.file_stem().and_then(|s| s.to_str()).ok_or("--db has no name")?.to_string();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("walship-rt")
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let conn = walship::RawDb::open(&db, Duration::from_secs(10)).map_err(|e| e.to_string())?;
    conn.disable_checkpoint().map_err(|e| e.to_string())?;
    conn.exec("PRAGMA journal_mode=WAL").map_err(|e| e.to_string())?;
    conn.exec("CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, payload BLOB NOT NULL)").map_err(|e| e.to_string())?;
    let shipper = walship::Shipper::builder(&dir, peer).start(rt.handle().clone()).map_err(|e| e.to_string())?;
    shipper.track(&name);
    let mut lines = out.map(|p| std::fs::File::create(p).map(BufWriter::new)).transpose().map_err(|e| e.to_string())?;
    let sql = format!("INSERT INTO t(payload) VALUES (randomblob({payload}))");
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
        conn.exec(&sql).map_err(|e| e.to_string())?;
        let t1 = mono_ns();
        shipper.wake(&name);
        n += 1;
        latencies.push(t1 - t0);
        if let Some(l) = &mut lines {
            // The table starts empty and only this loop inserts: ids are 1, 2, 3, …
            writeln!(l, "{n} {t1}").map_err(|e| e.to_string())?;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    if let Some(l) = &mut lines {
        l.flush().map_err(|e| e.to_string())?;
    }
    let wait = Instant::now();
    while wait.elapsed() < Duration::from_secs(120) {
        shipper.wake(&name);
        if shipper.status().databases.iter().all(|d| d.pending == 0 && !d.needs_base && d.failures == 0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = serde_json::to_value(shipper.status()).unwrap_or_default();
    let cpu = thread_cpu(&["walship"]);
    latencies.sort_unstable();
    let pct = |p: f64| latencies.get(((latencies.len().max(1) - 1) as f64 * p) as usize).copied().unwrap_or(0);
    println!(
        "{}",
        serde_json::json!({
            "transactions": n,
            "seconds": elapsed,
            "tps": n as f64 / elapsed,
            "commit_p50_us": pct(0.50) as f64 / 1000.0,
            "commit_p99_us": pct(0.99) as f64 / 1000.0,
            "commit_max_us": latencies.last().copied().unwrap_or(0) as f64 / 1000.0,
            "shipper_cpu_secs": cpu,
            "shipper": status,
            "sqlite": conn.query_text("SELECT sqlite_version()").unwrap_or_default(),
        })
    );
    drop(conn);
    shipper.shutdown();
    Ok(())
}

fn receive(args: &[String]) -> Result<(), String> {
    let dir = PathBuf::from(need(args, "--dir")?);
    let listen = need(args, "--listen")?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().map_err(|e| e.to_string())?;
    let receiver = Arc::new(walship::Receiver::new(&dir).map_err(|e| e.to_string())?);
    let app = walship::server::Routes::new(receiver).into_router();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&listen).await.map_err(|e| e.to_string())?;
        eprintln!("walship receiver on {listen}");
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .map_err(|e| e.to_string())
    })
}
