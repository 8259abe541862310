//! Who waits for which position, and which of them a sync releases (docs/log.md §1,
//! guarantee 2). Pure: no I/O, no locks (the caller holds the lock appends take).
//!
//! 1. A wait goes into the queue in position order (`insert`).
//! 2. After a sync makes everything before `durable` durable, `release` hands back
//!    exactly the waits at or below it, in order; the rest stay.
//! 3. After a failed write or sync, `take_all` hands back every wait, to be failed.
//!
//! Nothing here is persisted: a crash ends every wait with its process.

use crate::{Error, Lsn};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use tokio::sync::oneshot;

pub(super) type Waiter = oneshot::Sender<Result<(), Error>>;

/// What a wait does once its position is durable, or cannot become so.
pub(super) enum Notify {
    /// Answer a task or thread waiting on the channel.
    Channel(Waiter),
    /// Call this on the writer's thread (`Log::on_durable`).
    Call(Box<dyn FnOnce(Result<(), Error>) + Send>),
}

impl Notify {
    /// Nobody is left to hear it (a channel whose receiver was dropped).
    pub(super) fn abandoned(&self) -> bool {
        match self {
            Notify::Channel(tx) => tx.is_closed(),
            Notify::Call(_) => false,
        }
    }

    pub(super) fn send(self, r: Result<(), Error>) {
        match self {
            Notify::Channel(tx) => {
                let _ = tx.send(r);
            }
            Notify::Call(f) => f(r),
        }
    }
}

/// One wait for a position.
pub(super) struct Waiting {
    pub(super) lsn: Lsn,
    pub(super) tx: Notify,
    /// The follower's `woken` flag (see `Follower`).
    pub(super) follower: Option<Arc<AtomicBool>>,
}

/// Who waits for which position, ascending. Records are appended in order, so a
/// waiter almost always goes at the back: no allocation per waiter but its channel.
#[derive(Default)]
pub(super) struct Waiters {
    queue: VecDeque<Waiting>,
}

impl Waiters {
    /// Queue a wait in position order.
    pub(super) fn insert(&mut self, w: Waiting) {
        // From the back: a new record's waiter goes last, and one for an older record
        // (a shard waiting on what it appended before) a few places from the end.
        let at = self
            .queue
            .iter()
            .rposition(|q| q.lsn <= w.lsn)
            .map_or(0, |i| i + 1);
        self.queue.insert(at, w);
    }

    /// The waits a sync that made everything before `durable` durable releases: those
    /// at or below it, in order.
    pub(super) fn release(&mut self, durable: Lsn) -> Vec<Waiting> {
        let n = self.queue.partition_point(|w| w.lsn <= durable);
        self.queue.drain(..n).collect()
    }

    /// Every wait, to be failed.
    pub(super) fn take_all(&mut self) -> VecDeque<Waiting> {
        std::mem::take(&mut self.queue)
    }
}
