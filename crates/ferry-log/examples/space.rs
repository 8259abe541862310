//! What the file space under a batch costs its sync, on this machine's disk. The writer's
//! pattern (write a batch after the last, fdatasync), batch after batch through 256 MiB,
//! over space prepared three ways:
//!
//! - `append`: nothing prepared; every batch extends the file;
//! - `ahead`: what ferry-log does (docs/log.md §3): zeroes kept up to 1 MiB ahead of
//!   the end, topped up by 64-128 KiB inside the same sync once 64 KiB of them is used;
//! - `prezeroed`: the whole file zero-filled and synced before the first batch (what a
//!   segment prepared in advance, or recycled, would give).
//!
//! `cargo run --release -p ferry-log --example space [DIR]` (DIR must be on the disk to
//! measure, not tmpfs; defaults to a new directory under the system temp dir).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

const TOTAL: u64 = 256 << 20;
const AHEAD: u64 = 1 << 20;
const STEP: u64 = 64 << 10;

fn pct(v: &[f64], p: f64) -> f64 {
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Sync latencies (µs) of batches of `batch` bytes through TOTAL bytes of a new file.
fn run(path: &Path, how: &str, batch: u64) -> Vec<f64> {
    let f: File = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)
        .unwrap();
    let zeroes = vec![0u8; 1 << 20];
    if how == "prezeroed" {
        for at in (0..TOTAL).step_by(zeroes.len()) {
            f.write_all_at(&zeroes, at).unwrap();
        }
        f.sync_all().unwrap();
    }
    let data = vec![0xa5u8; batch as usize];
    let (mut at, mut filled) = (0u64, 0u64);
    let mut lat = Vec::new();
    while at + batch + AHEAD <= TOTAL {
        let t = Instant::now();
        f.write_all_at(&data, at).unwrap();
        at += batch;
        filled = filled.max(at);
        if how == "ahead" && filled + STEP <= at + AHEAD {
            let upto = (at + AHEAD).min(filled + 2 * STEP);
            f.write_all_at(&zeroes[..(upto - filled) as usize], filled)
                .unwrap();
            filled = upto;
        }
        f.sync_data().unwrap();
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(f);
    std::fs::remove_file(path).unwrap();
    lat.sort_by(|a, b| a.total_cmp(b));
    lat
}

fn main() {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::temp_dir().join(format!("ferry-log-space-{}", std::process::id()))
        });
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("space");
    println!("batch KiB  space      syncs   p50 µs   p99 µs   max µs");
    for batch in [4u64 << 10, 16 << 10, 64 << 10, 128 << 10] {
        for how in ["append", "ahead", "prezeroed"] {
            let lat = run(&path, how, batch);
            println!(
                "{:>9}  {how:<9} {:>6} {:>8.0} {:>8.0} {:>8.0}",
                batch >> 10,
                lat.len(),
                pct(&lat, 0.5),
                pct(&lat, 0.99),
                pct(&lat, 1.0)
            );
        }
    }
    let _ = std::fs::remove_dir(&dir);
}
