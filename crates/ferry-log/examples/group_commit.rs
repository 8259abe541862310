//! How close ferry-log's durable appends come to the disk's own floor, on this machine:
//!
//! 1. the floor: 200-byte appends to a preallocated file, each followed by fdatasync
//!    (what one durable record costs with nothing else in the way);
//! 2. one appender: append, wait until durable, repeat (a sequential workflow's steps);
//! 3. many appenders, each append-and-wait in a loop: records per second and records per
//!    sync (the group commit).
//!
//! `cargo run --release -p ferry-log --example group_commit [DIR]` (DIR defaults to a new
//! directory under the system temp dir, which must be on a real disk, not tmpfs).

use ferry_log::{Config, Log};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const RECORD: usize = 200;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("ferry-log-bench-{}", std::process::id()))
        });
    std::fs::create_dir_all(&dir).unwrap();

    // 1. The floor.
    let floor_file = dir.join("floor");
    let f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&floor_file)
        .unwrap();
    f.write_all_at(&vec![0u8; 16 << 20], 0).unwrap();
    f.sync_all().unwrap();
    let mut floor = Vec::new();
    let rec = vec![7u8; RECORD];
    for i in 0..2000u64 {
        let t = Instant::now();
        f.write_all_at(&rec, i * RECORD as u64).unwrap();
        f.sync_data().unwrap();
        floor.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(f);
    std::fs::remove_file(&floor_file).unwrap();
    let (floor_p50, floor_p99) = (pct(&mut floor, 0.5), pct(&mut floor, 0.99));
    println!(
        "fdatasync floor ({RECORD} B writes, preallocated): p50 {floor_p50:.0} µs, p99 {floor_p99:.0} µs"
    );

    // 2. One appender.
    let log_dir = dir.join("log");
    let _ = std::fs::remove_dir_all(&log_dir);
    let (log, _) = Log::open_dir(&log_dir, Config::default()).unwrap();
    let mut seq = Vec::new();
    for _ in 0..2000 {
        let t = Instant::now();
        let end = log.append(1, &rec).unwrap();
        log.wait_durable(end).unwrap();
        seq.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let (seq_p50, seq_p99) = (pct(&mut seq, 0.5), pct(&mut seq, 0.99));
    println!(
        "one appender, append + wait: p50 {seq_p50:.0} µs ({:.2}× the floor p50), p99 {seq_p99:.0} µs",
        seq_p50 / floor_p50
    );

    // 3. Many appenders.
    let log = Arc::new(log);
    for threads in [8usize, 64, 256] {
        let before = log.stats();
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (log, stop, done) = (log.clone(), stop.clone(), done.clone());
                std::thread::spawn(move || {
                    let rec = vec![7u8; RECORD];
                    while !stop.load(Ordering::Relaxed) {
                        let end = log.append(1, &rec).unwrap();
                        log.wait_durable(end).unwrap();
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(3));
        stop.store(true, Ordering::Relaxed);
        for h in handles {
            h.join().unwrap();
        }
        let secs = started.elapsed().as_secs_f64();
        let after = log.stats();
        let records = after.records - before.records;
        let syncs = after.syncs - before.syncs;
        println!(
            "{threads} appenders: {:.0} durable records/s, {:.1} records per sync",
            done.load(Ordering::Relaxed) as f64 / secs,
            records as f64 / syncs.max(1) as f64
        );
    }
    drop(log);
    let _ = std::fs::remove_dir_all(&dir);
}
