//! Server mode (docs/flow-server.md): the frames a worker and the server exchange
//! (`proto`, pure), how they travel over a stream (`io`), reaching a server or its
//! standbys (`dial`), and the worker's connection with each shard's journal stream
//! (`worker`).

mod dial;
pub mod io;
pub mod proto;
pub mod worker;

/// A key for a call whose caller gave none (a signal, a cancel): unique in this process
/// and, by 128 random bits drawn once, across processes; so a call sent again (to the
/// next holder, after a broken connection) is still delivered once (docs/flow-server.md
/// §9).
pub fn fresh_key(prefix: &str) -> String {
    use ferry_core::seams::{Rng, SplitMix64};
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static PROCESS: OnceLock<(u64, u64)> = OnceLock::new();
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let (a, b) = *PROCESS.get_or_init(|| {
        let mut r = SplitMix64::from_entropy();
        (r.next_u64(), r.next_u64())
    });
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}/{a:016x}{b:016x}/{n}")
}
