//! Waiting for durability: the one way. Anything that must not leave the process before
//! its records are durable (a step body's start, a run's result, the answer to `start`,
//! `signal` or `cancel`) awaits [`durable`] for the end of its own last record.
//!
//! On a shard's thread, many tasks wait at once. Registered with the log one by one,
//! each wait would take the log's lock, allocate a channel, and be woken by the log
//! writer from its own thread, through the shard's cross-thread queue. A shard instead
//! keeps its waiting tasks in a list of its own, and one task of the shard (the
//! watcher) waits on the log for the lowest position among them: the log wakes one task
//! per shard per sync, and the watcher wakes the rest on the shard's thread. Off a
//! shard's thread, [`durable`] waits on the log directly.
//!
//! (The one other use of the log's durability is not a wait: a shard's intake,
//! `job::Starts`, asks the log's writer to hand over runs whose start records a sync
//! made durable.)

use crate::journal_log::JournalLog;
use ferry_log::{Follower, Lsn};
use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Poll, Waker};
use tokio::sync::Notify;

/// The tasks of one shard that wait for durability.
pub(crate) struct Waits {
    log: Arc<dyn JournalLog>,
    /// The shard's thread, as the log's writer sees it (the watcher's waits), if the
    /// log has a use for it.
    follower: Option<Follower>,
    list: RefCell<Vec<(Lsn, Waker)>>,
    /// The position the watcher waits on the log for (`Lsn::MAX`: none).
    watching: Cell<Lsn>,
    /// Wakes the watcher: the list was empty, or holds a position below `watching`.
    kick: Notify,
    /// The log failed: every wait ends, and the caller asks the log for the error.
    failed: Cell<bool>,
}

thread_local! {
    /// The shard running on this thread, if any.
    static SHARD: RefCell<Option<Rc<Waits>>> = const { RefCell::new(None) };
}

impl Waits {
    /// Make this thread a shard's, for `log`: call once, on the shard's thread, and
    /// spawn the returned watcher on its `LocalSet`.
    pub(crate) fn install(
        log: Arc<dyn JournalLog>,
        follower: Option<Follower>,
    ) -> impl std::future::Future<Output = ()> {
        let waits = Rc::new(Waits {
            log,
            follower,
            list: RefCell::new(Vec::new()),
            watching: Cell::new(Lsn::MAX),
            kick: Notify::new(),
            failed: Cell::new(false),
        });
        SHARD.with(|s| *s.borrow_mut() = Some(waits.clone()));
        watch(waits)
    }

    fn poll_wait(&self, lsn: Lsn, waker: &Waker) -> Poll<()> {
        if self.failed.get() || self.log.durable_lsn() >= lsn {
            return Poll::Ready(());
        }
        // A task polled again before its position is durable (it is not, but for a
        // spurious wake-up) is listed twice, and woken twice: harmless.
        self.list.borrow_mut().push((lsn, waker.clone()));
        if lsn < self.watching.get() {
            self.kick.notify_one();
        }
        Poll::Pending
    }
}

/// Resolves when `lsn` is durable in `log`, or with the error that stopped it.
pub(crate) async fn durable(log: &Arc<dyn JournalLog>, lsn: Lsn) -> Result<(), ferry_log::Error> {
    if log.durable_lsn() >= lsn {
        return Ok(());
    }
    let shard = SHARD.with(|s| s.borrow().clone());
    if let Some(w) = shard.filter(|w| Arc::ptr_eq(&w.log, log)) {
        poll_fn(|cx| w.poll_wait(lsn, cx.waker())).await;
        if log.durable_lsn() >= lsn {
            return Ok(());
        }
    }
    log.durable(lsn, None).await
}

/// The watcher: wait on the log for the lowest listed position, then wake every task
/// whose position is durable; again when the list holds a lower one.
async fn watch(waits: Rc<Waits>) {
    loop {
        let lowest = waits.list.borrow().iter().map(|(l, _)| *l).min();
        let Some(lowest) = lowest else {
            waits.watching.set(Lsn::MAX);
            waits.kick.notified().await;
            continue;
        };
        waits.watching.set(lowest);
        tokio::select! {
            biased;
            r = waits.log.durable(lowest, waits.follower.as_ref()) => {
                if r.is_err() {
                    waits.failed.set(true);
                }
            }
            _ = waits.kick.notified() => {}
        }
        let durable = waits.log.durable_lsn();
        let failed = waits.failed.get();
        let ready: Vec<(Lsn, Waker)> = waits
            .list
            .borrow_mut()
            .extract_if(.., |(l, _)| failed || *l <= durable)
            .collect();
        for (_, w) in ready {
            w.wake();
        }
        if failed {
            // Every later wait returns at once (see `poll_wait`).
            return;
        }
    }
}
