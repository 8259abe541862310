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
    #[inline]
    pub(super) fn abandoned(&self) -> bool {
        match self {
            Notify::Channel(tx) => tx.is_closed(),
            Notify::Call(_) => false,
        }
    }

    #[inline]
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
    /// Queue a wait in position order: after every wait at or below its position,
    /// before every one above it (so, by induction, the queue stays sorted).
    #[inline]
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
    #[inline]
    pub(super) fn release(&mut self, durable: Lsn) -> Vec<Waiting> {
        // A binary search: `insert` keeps the queue in position order.
        let n = self.queue.partition_point(|w| w.lsn <= durable);
        self.queue.drain(..n).collect()
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.queue.len()
    }

    /// Every wait, to be failed.
    pub(super) fn take_all(&mut self) -> VecDeque<Waiting> {
        std::mem::take(&mut self.queue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::seams::{Rng, SplitMix64};
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    /// A wait for `lsn` that records, in `woken`, its id once it is answered.
    fn wait(lsn: Lsn, id: u64, woken: &Arc<Mutex<Vec<(u64, bool)>>>) -> Waiting {
        let woken = woken.clone();
        Waiting {
            lsn,
            tx: Notify::Call(Box::new(move |r| {
                woken.lock().unwrap().push((id, r.is_ok()))
            })),
            follower: None,
        }
    }

    #[test]
    fn each_sync_releases_exactly_the_waits_it_covers_in_position_order() {
        // Against a reference model (a BTreeMap of position to waits): waits arrive
        // out of order, as shards wait on what they appended earlier; each sync moves
        // `durable` on by a random step and must release exactly the model's waits at
        // or below it, lowest position first, and nothing twice.
        let mut rng = SplitMix64::seeded(11);
        let woken = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Waiters::default();
        let mut model: BTreeMap<Lsn, Vec<u64>> = BTreeMap::new();
        let (mut durable, mut end, mut id) = (0, 0, 0);
        for _ in 0..2000 {
            end += 1 + rng.below(50);
            for _ in 0..rng.below(4) {
                let lsn = durable + 1 + rng.below(end - durable);
                waiters.insert(wait(lsn, id, &woken));
                model.entry(lsn).or_default().push(id);
                id += 1;
            }
            durable += rng.below(end - durable + 1);
            let released: Vec<Lsn> = waiters.release(durable).iter().map(|w| w.lsn).collect();
            let mut expected = Vec::new();
            while let Some(e) = model.first_entry() {
                if *e.key() > durable {
                    break;
                }
                let (lsn, ids) = e.remove_entry();
                expected.extend(ids.iter().map(|_| lsn));
            }
            assert_eq!(released, expected, "durable {durable}");
            assert_eq!(waiters.len(), model.values().map(Vec::len).sum::<usize>());
        }
    }

    #[test]
    fn waits_for_one_position_are_answered_in_the_order_they_came() {
        let woken = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Waiters::default();
        for (lsn, id) in [(30, 0), (10, 1), (30, 2), (20, 3), (10, 4)] {
            waiters.insert(wait(lsn, id, &woken));
        }
        for w in waiters.release(25) {
            w.tx.send(Ok(()));
        }
        assert_eq!(
            *woken.lock().unwrap(),
            vec![(1, true), (4, true), (3, true)]
        );
        for w in waiters.take_all() {
            w.tx.send(Err(Error::Closed));
        }
        assert_eq!(woken.lock().unwrap()[3..], [(0, false), (2, false)]);
        assert_eq!(waiters.len(), 0);
    }

    #[test]
    fn a_wait_whose_receiver_is_gone_is_abandoned() {
        let (tx, rx) = oneshot::channel();
        let n = Notify::Channel(tx);
        assert!(!n.abandoned());
        drop(rx);
        assert!(n.abandoned());
        assert!(!Notify::Call(Box::new(|_| {})).abandoned());
    }
}
