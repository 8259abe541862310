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

use ferry_core::seams::Clock;
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
        let working = f.working.fetch_sub(1, Ordering::SeqCst);
        // One idle per wake (`woken` went from set to clear): a count wrapped below
        // zero would make the writer wait out `follow` after every sync, for ever.
        assert!(working > 0, "followers working never falls below zero");
        if working == 1 && f.following.load(Ordering::SeqCst) {
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
    #[inline]
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

/// Why the writer's wait for its followers ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Followed {
    /// No wait: `follow` is zero, or the last sync woke no follower.
    Off,
    /// Every follower woken went idle.
    Idle,
    /// The log is closing.
    Closing,
    /// `follow` ran out with a follower still working.
    TimedOut,
}

/// What the writer does next in its wait for followers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Next {
    Stop(Followed),
    /// Sleep on the condition variable this long at most, then look again.
    Sleep(Duration),
}

/// One look at the followers: `working` of them not idle yet, the log `closing`, the
/// clock at `now`, the wait ending at `until`. Idle and closing end the wait even past
/// the deadline.
pub(super) fn next(working: usize, closing: bool, now: Instant, until: Instant) -> Next {
    if working == 0 {
        Next::Stop(Followed::Idle)
    } else if closing {
        Next::Stop(Followed::Closing)
    } else if now >= until {
        Next::Stop(Followed::TimedOut)
    } else {
        Next::Sleep(until - now)
    }
}

/// Wait up to `limit` (`Config::follow`), by `clock`, for the followers the last sync
/// woke to go idle. The clock is read only if a follower is working.
pub(super) fn wait_for_followers(f: &Follow, limit: Duration, clock: &dyn Clock) -> Followed {
    if limit.is_zero() || f.working.load(Ordering::SeqCst) == 0 {
        return Followed::Off;
    }
    let until = clock.now() + limit;
    let mut g = lock(&f.lock);
    f.following.store(true, Ordering::SeqCst);
    let followed = loop {
        let working = f.working.load(Ordering::SeqCst);
        let closing = f.closing.load(Ordering::SeqCst);
        match next(working, closing, clock.now(), until) {
            Next::Stop(why) => break why,
            Next::Sleep(d) => {
                g = ferry_core::sync::wait_timeout(&f.cv, g, d);
            }
        }
    };
    f.following.store(false, Ordering::SeqCst);
    followed
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::seams::{SteppingClock, StillClock};

    #[test]
    fn idle_and_closing_end_the_wait_even_past_its_deadline() {
        let t = Instant::now();
        let until = t + Duration::from_micros(25);
        assert_eq!(next(0, false, t, until), Next::Stop(Followed::Idle));
        assert_eq!(next(0, true, until, until), Next::Stop(Followed::Idle));
        assert_eq!(next(2, true, t, until), Next::Stop(Followed::Closing));
        assert_eq!(next(1, false, until, until), Next::Stop(Followed::TimedOut));
        let later = t + Duration::from_micros(10);
        assert_eq!(
            next(1, false, later, until),
            Next::Sleep(Duration::from_micros(15))
        );
    }

    fn follower(follow: &Arc<Follow>) -> Follower {
        Follower {
            follow: follow.clone(),
            woken: Arc::new(AtomicBool::new(false)),
        }
    }

    #[test]
    fn the_deadline_is_read_from_the_clock_given() {
        // With the system clock this wait would last an hour: a follower that never
        // goes idle is waited for until the clock given says `follow` has passed.
        let f = Arc::new(Follow::default());
        // An hour later at every read.
        let clock = SteppingClock::new(Instant::now(), Duration::from_secs(3600));
        let hour = Duration::from_secs(3600);
        assert_eq!(wait_for_followers(&f, hour, &clock), Followed::Off);
        assert_eq!(
            clock.reads.load(Ordering::SeqCst),
            0,
            "no follower, no clock"
        );
        let a = follower(&f);
        f.woke(&a.woken);
        assert_eq!(wait_for_followers(&f, hour, &clock), Followed::TimedOut);
        assert_eq!(
            wait_for_followers(&f, Duration::ZERO, &clock),
            Followed::Off
        );
        a.idle();
        assert_eq!(wait_for_followers(&f, hour, &clock), Followed::Off);
    }

    #[test]
    fn the_last_follower_to_go_idle_or_closing_wakes_the_writer() {
        // A clock that never moves: only an idle or a close can end these waits.
        let clock = StillClock {
            at: Instant::now(),
            wall_ms: 0,
        };
        let f = Arc::new(Follow::default());
        let (a, b) = (follower(&f), follower(&f));
        f.woke(&a.woken);
        f.woke(&b.woken);
        f.woke(&b.woken); // woken twice before going idle: counted once
        let idle = std::thread::spawn(move || {
            a.idle();
            b.idle();
            b.idle(); // idle again without a wake: nothing to count
        });
        let hour = Duration::from_secs(3600);
        let followed = wait_for_followers(&f, hour, &clock);
        assert!(
            matches!(followed, Followed::Idle | Followed::Off),
            "{followed:?}"
        );
        idle.join().unwrap();
        assert_eq!(f.working.load(Ordering::SeqCst), 0);

        let c = follower(&f);
        f.woke(&c.woken);
        let closer = f.clone();
        let close = std::thread::spawn(move || closer.close());
        assert_eq!(wait_for_followers(&f, hour, &clock), Followed::Closing);
        close.join().unwrap();
    }
}
