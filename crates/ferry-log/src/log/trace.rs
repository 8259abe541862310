//! A trace of the writer's cycles (`Log::trace_cycles`), for finding where a record's
//! latency goes: which cycle took it, how long that cycle waited for its followers,
//! synced and woke its waiters. Off unless asked for; on, the writer keeps the last
//! cycles up to a bound, at one short lock per cycle.

use ferry_core::sync::lock;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use crate::Lsn;

/// One cycle of the writer, its moments in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cycle {
    /// The cycle began: the previous one had woken its waiters.
    pub began: Instant,
    /// The wait for followers ended (at once without followers to wait for).
    pub followed: Instant,
    /// The batches were taken: a record appended after this rides a later cycle. When
    /// nothing had been appended, the writer slept until an append woke it, in between.
    pub taken: Instant,
    /// The write and its `fdatasync` returned.
    pub synced: Instant,
    /// The durable position was published and every wait it covers woken.
    pub woke: Instant,
    /// The durable position it published.
    pub end: Lsn,
    pub batches: u32,
}

/// The moments a cycle had before its write (a driven log's caller has none: all are
/// the moment it wrote).
#[derive(Clone, Copy, Debug)]
pub(super) struct Marks {
    pub(super) began: Instant,
    pub(super) followed: Instant,
    pub(super) taken: Instant,
}

impl Marks {
    pub(super) fn now() -> Marks {
        let t = Instant::now();
        Marks {
            began: t,
            followed: t,
            taken: t,
        }
    }
}

#[derive(Default)]
pub(super) struct Trace {
    capacity: AtomicUsize,
    cycles: Mutex<VecDeque<Cycle>>,
}

impl Trace {
    /// Keep the last `capacity` cycles from now on (0: none), forgetting those kept.
    /// The room is made and touched now, not by the writer as it goes (a page fault on
    /// its thread is a stall of every record in flight).
    pub(super) fn set(&self, capacity: usize) {
        let mut c = lock(&self.cycles);
        c.clear();
        c.reserve_exact(capacity);
        let t = Instant::now();
        c.resize(
            capacity,
            Cycle {
                began: t,
                followed: t,
                taken: t,
                synced: t,
                woke: t,
                end: 0,
                batches: 0,
            },
        );
        c.clear();
        self.capacity.store(capacity, Ordering::Relaxed);
    }

    pub(super) fn on(&self) -> bool {
        self.capacity.load(Ordering::Relaxed) > 0
    }

    pub(super) fn record(&self, cycle: Cycle) {
        let mut c = lock(&self.cycles);
        // Read under the lock `set` takes: a trace turned off keeps nothing after.
        let capacity = self.capacity.load(Ordering::Relaxed);
        if capacity == 0 {
            return;
        }
        if c.len() >= capacity {
            c.pop_front();
        }
        c.push_back(cycle);
    }

    /// The cycles kept, in their own allocation (handed over, not copied: a caller that
    /// must not free megabytes at a given moment decides when they go). Keeping goes on
    /// from scratch, with no room made.
    pub(super) fn take(&self) -> Vec<Cycle> {
        Vec::from(std::mem::take(&mut *lock(&self.cycles)))
    }
}
