//! The writer's wait for its followers (docs/log.md §3, "Followers").
//!
//! 1. As the writer wakes a follower's wait, it marks the follower woken and counts
//!    it working (`Follow::woke`), before the wake, so that its next look counts it.
//! 2. Before it takes the next batch, the writer waits (`wait_for_followers`), up to
//!    `Config::follow`, until every woken follower has called `Follower::idle`, or
//!    the log closes.
//! 3. The last follower to go idle wakes the writer, under the lock it waits with.
//!
//! Nothing here is persisted; the wait only decides which sync a follower's reply
//! rides.

use ferry_core::sync::lock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// A thread that replies to syncs with appends of its own (an executor running what
/// waited for durability): after a sync that woke it, the writer waits up to
/// [`Config::follow`](crate::Config::follow) for it to call [`Follower::idle`] before
/// it takes the next batch, so that what it appends in reply rides the next sync, not
/// the one after. Its waits go through [`Log::durable_following`](crate::Log::durable_following).
#[derive(Clone)]
pub struct Follower {
    pub(super) follow: Arc<Follow>,
    /// Set by the writer as it wakes this follower's wait (before the wake, so that
    /// the writer's next look counts it); cleared by `idle`.
    pub(super) woken: Arc<AtomicBool>,
}

impl Follower {
    /// Nothing more to append for now: the thread is about to sleep.
    pub fn idle(&self) {
        if !self.woken.swap(false, Ordering::SeqCst) {
            return;
        }
        let f = &*self.follow;
        // SeqCst on both sides: either the writer sees the count at zero, or this sees
        // it following and wakes it, under the lock it waits with.
        if f.working.fetch_sub(1, Ordering::SeqCst) == 1 && f.following.load(Ordering::SeqCst) {
            let _g = lock(&f.lock);
            f.cv.notify_one();
        }
    }
}

/// What followers share with the writer (not the log itself: a follower left over
/// keeps no file or lock open).
#[derive(Default)]
pub(super) struct Follow {
    /// Followers woken by a sync and not idle since.
    working: AtomicUsize,
    /// The writer waits on `cv` for `working` to reach zero: the last `idle` wakes it.
    following: AtomicBool,
    /// The log is closing: the writer waits no more.
    closing: AtomicBool,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Follow {
    /// The writer is about to wake a wait of the follower whose flag is `woken`: count
    /// it working, unless it is already.
    pub(super) fn woke(&self, woken: &AtomicBool) {
        if !woken.swap(true, Ordering::SeqCst) {
            self.working.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The log is closing: end the writer's wait, and any later one.
    pub(super) fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
        drop(lock(&self.lock));
        self.cv.notify_all();
    }
}

/// Wait up to `limit` (`Config::follow`) for the followers the last sync woke to go
/// idle.
pub(super) fn wait_for_followers(f: &Follow, limit: Duration) {
    if limit.is_zero() || f.working.load(Ordering::SeqCst) == 0 {
        return;
    }
    let until = Instant::now() + limit;
    let mut g = lock(&f.lock);
    f.following.store(true, Ordering::SeqCst);
    while f.working.load(Ordering::SeqCst) > 0 && !f.closing.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now >= until {
            break;
        }
        g =
            f.cv.wait_timeout(g, until - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
    }
    f.following.store(false, Ordering::SeqCst);
}
