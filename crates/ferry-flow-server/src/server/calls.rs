//! Calls across shards on the server (docs/flow-server.md §9): each waits for the holder
//! of its run's shard, goes to it, and goes again to the next holder if the one it went
//! to let go before answering; a result is answered from the index.

use super::{Inner, Settings, State, now};
use crate::lease::SessionId;
use ferry_flow::remote::proto::{Body, Call, CallKind, Frame, Outcome, Refused};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Notify, oneshot};

/// The most calls one shard may have in flight on the server (docs/flow-server.md §14).
pub const CALLS_MAX: usize = 4096;

/// A call on its way to the holder of its run's shard (docs/flow-server.md §9).
pub(super) struct Forward {
    call: Call,
    shard: u32,
    /// The session and epoch it was sent to; none while it waits for a holder.
    sent: Option<(SessionId, u64)>,
    /// Not sent again before this (the holder was still recovering the shard).
    not_before: Instant,
    /// Unsent: refused as `NoHolder` if it found no holder by then. Sent: refused as
    /// `Unavailable` if its holder has not answered by then (its key makes the
    /// caller's retry safe).
    until: Instant,
    reply: oneshot::Sender<Result<Outcome, Refused>>,
}

/// A call arrives (from a connection or the HTTP API): a result is answered from the
/// index; the rest are forwarded to the run's holder.
pub(super) async fn call_in(inner: Arc<Inner>, call: Call) -> Result<Outcome, Refused> {
    if let CallKind::Result { id, wait_ms } = &call.kind {
        return result(&inner, id, Duration::from_millis(u64::from(*wait_ms))).await;
    }
    let shard = ferry_flow::shard_of(call.kind.run(), inner.settings.shards);
    let (tx, rx) = oneshot::channel();
    {
        let mut state = ferry_core::sync::lock(&inner.state);
        let now = now();
        // A stopping server takes no call (`stop_calls` answered those it had).
        let stopping = inner.stop.is_set();
        if stopping || state.calls.values().filter(|f| f.shard == shard).count() >= CALLS_MAX {
            return Err(UNAVAILABLE);
        }
        state.next_call += 1;
        let id = state.next_call;
        state.calls.insert(
            id,
            Forward {
                call,
                shard,
                sent: None,
                not_before: now,
                until: now + inner.settings.call_wait,
                reply: tx,
            },
        );
        route(&mut state, now, &inner.settings);
    }
    rx.await.unwrap_or(Err(UNAVAILABLE))
}

const UNAVAILABLE: Refused = Refused::Unavailable {
    retry_after_ms: 1000,
};

/// The server stops: every call in flight is answered `Unavailable` (a caller tries
/// again once the server is back; the keys make that safe).
pub(super) fn stop_calls(state: &mut State) {
    for (_, f) in std::mem::take(&mut state.calls) {
        let _ = f.reply.send(Err(UNAVAILABLE));
    }
}

/// Run `id`'s outcome from the index, once it ended (waiting up to `wait`): the run's
/// summary as JSON, state running if it had not ended by then.
async fn result(inner: &Inner, id: &str, wait: Duration) -> Result<Outcome, Refused> {
    let until = tokio::time::Instant::now() + wait.min(Duration::from_secs(60));
    let waiting = Waiting::new(inner, id);
    loop {
        let ended = waiting.notify.notified();
        tokio::pin!(ended);
        ended.as_mut().enable();
        let run = ferry_core::sync::lock(&inner.index).get(id).cloned();
        let Some(run) = run else {
            return Ok(Outcome::Err {
                kind: "unknown_run".into(),
                message: format!("no run {id:?}: it was never started (durably) on this server"),
            });
        };
        let past = tokio::time::Instant::now() >= until;
        if run.settled() || past {
            let json = serde_json::to_vec(&run).expect("a summary serializes");
            return Ok(Outcome::Ok(json));
        }
        tokio::select! {
            biased;
            _ = inner.stop.wait() => return Err(UNAVAILABLE),
            _ = ended => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
}

/// A long-poll's place among the result waiters of its run (`Inner::ended`): the entry
/// is shared by every waiter of the run and removed with the last.
struct Waiting<'a> {
    inner: &'a Inner,
    id: &'a str,
    notify: Arc<Notify>,
}

impl<'a> Waiting<'a> {
    fn new(inner: &'a Inner, id: &'a str) -> Waiting<'a> {
        let mut waiting = ferry_core::sync::lock(&inner.ended);
        let (count, notify) = waiting.entry(id.to_string()).or_default();
        *count += 1;
        let notify = notify.clone();
        Waiting { inner, id, notify }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut waiting = ferry_core::sync::lock(&self.inner.ended);
        if let Some((count, _)) = waiting.get_mut(self.id) {
            *count -= 1;
            if *count == 0 {
                waiting.remove(self.id);
            }
        }
    }
}

/// Send each waiting call to its shard's holder, once it has one whose grant went out;
/// take back calls whose holder lost the shard (they go to the next one: their keys make
/// a second delivery a no-op); refuse those that waited `call_wait` for a holder, or a
/// lease past that for its answer.
pub(super) fn route(state: &mut State, now: Instant, settings: &Settings) {
    let call_wait = settings.call_wait;
    let State {
        calls,
        table,
        conns,
        grants,
        unsent,
        ..
    } = state;
    for (&id, f) in calls.iter_mut() {
        let (epoch, holder) = table.holder(f.shard);
        let ready = holder.filter(|h| {
            conns.contains_key(h)
                && !unsent.contains(&f.shard)
                && !grants.iter().any(|g| g.2 == f.shard)
        });
        if let Some(sent) = f.sent
            && (Some(sent.0), sent.1) != (ready, epoch)
        {
            // Its holder let go before answering: the next one gets as long.
            f.sent = None;
            f.until = now + call_wait;
        }
        if f.sent.is_none()
            && let Some(h) = ready
            && now >= f.not_before
        {
            let (_, tx) = &conns[&h];
            let _ = tx.send(Frame {
                id,
                body: Body::Call(f.call.clone()),
            });
            f.sent = Some((h, epoch));
            f.until = now + call_wait + settings.lease;
        }
    }
    for (_, f) in calls.extract_if(.., |_, f| now >= f.until) {
        let _ = f.reply.send(Err(match f.sent {
            None => Refused::NoHolder { shard: f.shard },
            Some(_) => UNAVAILABLE,
        }));
    }
}

/// `session`'s connection went: the calls sent on it go again (to whichever holder).
pub(super) fn unsend(state: &mut State, session: SessionId) {
    for f in state.calls.values_mut() {
        if f.sent.is_some_and(|(h, _)| h == session) {
            f.sent = None;
        }
    }
}

/// The holder `session` answered call `id`. A holder still recovering the shard answers
/// `not_held`: the call is sent again shortly.
pub(super) fn answered(
    state: &mut State,
    session: SessionId,
    id: u64,
    outcome: Outcome,
    now: Instant,
    call_wait: Duration,
) {
    let Some(f) = state.calls.get_mut(&id) else {
        return;
    };
    // Only from whom it was sent to, still holding the shard at that epoch.
    let Some((to, epoch)) = f.sent else { return };
    if to != session || state.table.holder(f.shard) != (epoch, Some(session)) {
        return;
    }
    if matches!(&outcome, Outcome::Err { kind, .. } if kind == "not_held") {
        f.sent = None;
        f.not_before = now + Duration::from_millis(20);
        f.until = now + call_wait;
        return;
    }
    let f = state.calls.remove(&id).expect("looked at it");
    let _ = f.reply.send(Ok(outcome));
}
