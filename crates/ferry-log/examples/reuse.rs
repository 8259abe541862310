//! What reusing retired segments (docs/log.md §3) saves each sync, on this machine's
//! disk. One appender writes batches of a given size through the log and waits for each
//! to be durable, twice per size over 256 MiB of 16 MiB segments:
//!
//! - `fresh`: nothing is retired, so every segment is a new file and the writer keeps
//!   zeroes written ahead of its end (top-ups that extend the file, in some syncs);
//! - `reused`: every segment is retired as soon as the next one holds a durable batch,
//!   as compaction does, so from the third segment on each is made from a spare.
//!
//! The figures are the latencies of the syncs (append to durable) after the first two
//! segments, p50/p99/max in µs, and how many segments were reused.
//!
//! `cargo run --release -p ferry-log --example reuse [DIR]` (DIR must be on the disk to
//! measure, not tmpfs; defaults to a new directory under the system temp dir).

use ferry_log::{Config, Log};
use std::path::PathBuf;
use std::time::Instant;

const SEGMENT: u64 = 16 << 20;
const TOTAL: u64 = 256 << 20;
const RECORD: usize = 1000;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn run(dir: &std::path::Path, batch: usize, reuse: bool) -> (Vec<f64>, u64) {
    let _ = std::fs::remove_dir_all(dir);
    let config = Config {
        segment_bytes: SEGMENT,
        ..Config::default()
    };
    let (log, _) = Log::open_dir(dir, config).unwrap();
    let record = vec![7u8; RECORD];
    let per_batch = (batch / (RECORD + 9)).max(1);
    let mut lat = Vec::new();
    let mut segments = log.stats().segments;
    while log.end_lsn() < TOTAL {
        let t = Instant::now();
        for _ in 0..per_batch {
            log.append(1, &record).unwrap();
        }
        log.flush().unwrap();
        if log.end_lsn() > 2 * SEGMENT {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let now = log.stats().segments;
        if reuse && now != segments {
            log.retire_below(log.durable_lsn()).unwrap();
        }
        segments = log.stats().segments;
    }
    let reused = log.stats().segments_reused;
    log.close().unwrap();
    (lat, reused)
}

fn main() {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("ferry-log-reuse-{}", std::process::id()))
        });
    let dir = dir.join("log");
    println!("batch KiB  segments  syncs   p50 µs   p99 µs   max µs  reused");
    for batch in [16 << 10, 64 << 10, 128 << 10] {
        for reuse in [false, true] {
            let (mut lat, reused) = run(&dir, batch, reuse);
            let n = lat.len();
            println!(
                "{:>9}  {:<8}  {n:>5}  {:>7.0}  {:>7.0}  {:>7.0}  {reused:>6}",
                batch >> 10,
                if reuse { "reused" } else { "fresh" },
                pct(&mut lat, 0.5),
                pct(&mut lat, 0.99),
                pct(&mut lat, 1.0),
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
