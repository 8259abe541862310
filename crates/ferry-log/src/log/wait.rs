//! Waiting for durability (docs/log.md §1, guarantee 2; §3, "Calls on durability"):
//! blocking, async, or a call on the writer's thread.
//!
//! 1. A position already durable answers at once, without the lock.
//! 2. Otherwise, under the lock appends take (the writer publishes `durable` under
//!    it): durable by now answers at once; a poisoned log or a position past the end
//!    fails; anything else is queued (`Waiters::insert`) for the writer to release.
//!
//! Nothing is persisted: a crash ends every wait with its process.

use super::state::Inner;
use super::waiters::{Notify, Waiting};
use crate::{Error, Lsn};
use ferry_core::sync::lock;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::oneshot;

/// Block until `lsn` is durable.
pub(super) fn wait_durable(inner: &Inner, lsn: Lsn) -> Result<(), Error> {
    match register(inner, lsn, None)? {
        None => Ok(()),
        Some(rx) => rx.blocking_recv().unwrap_or(Err(Error::Closed)),
    }
}

/// Resolves when `lsn` is durable; `follower` is the `woken` flag of the follower
/// waiting, if one is.
pub(super) fn durable(
    inner: &Inner,
    lsn: Lsn,
    follower: Option<Arc<AtomicBool>>,
) -> impl Future<Output = Result<(), Error>> + Send + 'static {
    let registered = register(inner, lsn, follower);
    async move {
        match registered? {
            None => Ok(()),
            Some(rx) => rx.await.unwrap_or(Err(Error::Closed)),
        }
    }
}

/// See `Log::on_durable`.
pub(super) fn on_durable(
    inner: &Inner,
    lsn: Lsn,
    follower: Option<Arc<AtomicBool>>,
    f: impl FnOnce(Result<(), Error>) + Send + 'static,
) {
    if inner.durable.load(Ordering::SeqCst) >= lsn {
        return f(Ok(()));
    }
    match enqueue(inner, lsn, follower, Notify::Call(Box::new(f))) {
        Ok(None) => {}
        Ok(Some(n)) => n.send(Ok(())),
        Err((e, n)) => n.send(Err(e)),
    }
}

/// A channel the writer answers once `lsn` is durable; None if it already is.
fn register(
    inner: &Inner,
    lsn: Lsn,
    follower: Option<Arc<AtomicBool>>,
) -> Result<Option<oneshot::Receiver<Result<(), Error>>>, Error> {
    if inner.durable.load(Ordering::SeqCst) >= lsn {
        return Ok(None);
    }
    let (tx, rx) = oneshot::channel();
    match enqueue(inner, lsn, follower, Notify::Channel(tx)) {
        Ok(None) => Ok(Some(rx)),
        Ok(Some(_)) => Ok(None),
        Err((e, _)) => Err(e),
    }
}

/// Queue `tx` as the wait for `lsn` (None); or give it back, if `lsn` became
/// durable meanwhile (Some) or cannot become so (Err).
fn enqueue(
    inner: &Inner,
    lsn: Lsn,
    follower: Option<Arc<AtomicBool>>,
    tx: Notify,
) -> Result<Option<Notify>, (Error, Notify)> {
    let mut s = lock(&inner.shared);
    // The writer publishes under this lock: checked again, no wake-up is missed.
    if inner.durable.load(Ordering::SeqCst) >= lsn {
        return Ok(Some(tx));
    }
    if let Some(cause) = &s.poisoned {
        let e = Error::PreviousIo {
            cause: cause.clone(),
        };
        return Err((e, tx));
    }
    let end = s.batches.end();
    if lsn > end {
        let e = Error::Invalid(format!("position {lsn} is past the end of the log ({end})"));
        return Err((e, tx));
    }
    s.waiters.insert(Waiting { lsn, tx, follower });
    Ok(None)
}
