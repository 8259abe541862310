//! What the appenders, the writer, the waiters, readers and retirement share: one lock
//! over the batches and the waits (`Shared`), the durable position, and the condition
//! variables the writer and blocked appends sleep on.

use super::batch::Batches;
use super::config::Config;
use super::follow::Follow;
use super::stats::Stats;
use super::waiters::Waiters;
use crate::Lsn;
use crate::storage::Storage;
use ferry_core::seams::Clock;
use std::io;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};

/// What the lock appends take guards.
pub(super) struct Shared {
    pub(super) batches: Batches,
    /// First positions of the segments, ascending (the newest may not exist yet).
    pub(super) segments: Vec<Lsn>,
    /// Why the log refuses writes: an earlier write or sync failed (docs/log.md §1,
    /// guarantee 4). Never cleared: the log must be reopened.
    pub(super) poisoned: Option<Arc<io::Error>>,
    pub(super) closing: bool,
    /// The writer sleeps on `work`: an append must wake it. While it writes, appends
    /// leave it be (a notify is a syscall even with no one waiting), and it looks for
    /// more before it sleeps again.
    pub(super) writer_asleep: bool,
    pub(super) waiters: Waiters,
    pub(super) stats: Stats,
}

pub(super) struct Inner {
    pub(super) storage: Arc<dyn Storage>,
    pub(super) config: Config,
    pub(super) log_id: u64,
    pub(super) shared: CacheLine<Mutex<Shared>>,
    /// The writer waits here for work.
    pub(super) work: Condvar,
    /// Appenders wait here for `pending_bytes` to fall.
    pub(super) space: Condvar,
    /// Everything before it is durable. Published by the writer under `shared`'s lock,
    /// so that a wait registered under that lock misses no wake-up.
    pub(super) durable: CacheLine<AtomicU64>,
    /// No writer thread: whoever holds the log calls `Log::write_pending`.
    pub(super) driven: bool,
    /// What followers share with the writer (not the log itself: a follower left
    /// over keeps no file or lock open).
    pub(super) follow: Arc<Follow>,
    /// Retired segments kept for the next segments, oldest first (at most
    /// `Config::spare_segments`): a segment made from one is written over space the
    /// disk already holds, so its syncs write data alone (docs/log.md §3).
    pub(super) spares: Mutex<Vec<String>>,
    /// What the writer's wait for its followers reads the time from (a decision:
    /// tests drive it). The writer's cycle durations in `Stats` and the recovery
    /// time are measurements, and read `Instant` directly.
    pub(super) clock: Arc<dyn Clock>,
    /// The writer's last cycles, when asked for (`Log::trace_cycles`).
    pub(super) trace: super::trace::Trace,
}

/// A value alone on its cache lines (two, for the adjacent-line prefetcher).
#[repr(align(128))]
pub(super) struct CacheLine<T>(pub(super) T);

impl<T> std::ops::Deref for CacheLine<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}
