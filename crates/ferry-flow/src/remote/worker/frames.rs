//! The worker's side of each frame the server sends (`handle`): grants, revokes,
//! drains, acknowledgements, pongs, pages and answers, applied to the connection's
//! streams and requests in flight.

use super::*;

/// One frame from the server; true: ping at once (new grants want a deadline).
#[allow(clippy::too_many_arguments)]
pub(super) fn handle(
    conn: &Arc<Conn>,
    f: Frame,
    appends: &mut BTreeMap<u64, (u32, u64, u64)>,
    reads: &mut BTreeMap<u64, ReadReply>,
    pings: &mut BTreeMap<u64, Duration>,
    calls: &mut BTreeMap<u64, (Call, CallReply)>,
    lease: Duration,
    ping_every: Duration,
) -> bool {
    match f.body {
        Body::Grant(grants) => {
            for g in grants {
                let mut slots = lock(&conn.slots);
                let Some(slot) = slots.get_mut(g.shard as usize) else {
                    continue;
                };
                let old = slot.take();
                let stream = Arc::new(ShardStream {
                    shard: g.shard,
                    epoch: g.epoch,
                    conn: Arc::downgrade(conn),
                    state: Arc::new(Mutex::new(StreamState {
                        next: g.end,
                        acked: g.end,
                        ..StreamState::default()
                    })),
                    turns: AtomicU64::new(0),
                    clock: conn.clock,
                });
                *slot = Some(stream);
                drop(slots);
                if let Some(old) = old {
                    conn.lose(&old, "granted again at a newer epoch");
                }
                conn.emit(Event::Granted {
                    shard: g.shard,
                    epoch: g.epoch,
                });
            }
            return true;
        }
        Body::Durable(ps) => {
            for p in ps {
                if let Some(s) = conn.current(p.shard)
                    && s.epoch == p.epoch
                {
                    s.ack(p.position);
                }
                appends.retain(|_, &mut (shard, epoch, end)| {
                    !(shard == p.shard && epoch == p.epoch && end <= p.position)
                });
            }
        }
        Body::Pong(held) => {
            let Some(sent) = pings.remove(&f.id) else {
                return false;
            };
            // Older pings' answers are superseded by this one.
            pings.retain(|&id, _| id > f.id);
            let margin = lease.mul_f64(conn.settings.drift) + ping_every / 4;
            let deadline = sent + lease.saturating_sub(margin);
            let now = (conn.clock)();
            for s in conn.streams() {
                let listed = held
                    .iter()
                    .any(|h| h.shard == s.shard && h.epoch == s.epoch);
                let mut st = lock(&s.state);
                let passed = st.deadline.is_some_and(|d| now >= d);
                let confirmed_before = st.deadline.is_some();
                if listed && !passed {
                    st.deadline = Some(deadline);
                } else if passed || confirmed_before {
                    // A deadline once passed stays passed; a shard confirmed before and
                    // not now is no longer ours.
                    drop(st);
                    conn.lose(
                        &s,
                        "the server no longer confirms it, or its deadline passed",
                    );
                }
            }
        }
        Body::Revoke { shard, epoch, .. } => {
            if let Some(s) = conn.current(shard)
                && s.epoch == epoch
            {
                conn.lose(&s, "revoked by the server");
            }
        }
        Body::Drain { shard, epoch } => conn.emit(Event::Drain { shard, epoch }),
        body @ (Body::Records(_) | Body::Checkpoint { .. }) => {
            if let Some(reply) = reads.remove(&f.id) {
                let _ = reply.send(Ok(body));
            }
        }
        Body::Call(call) => {
            let _ = conn.calls_in.send((f.id, call));
        }
        Body::Answer { call, outcome } => {
            if let Some((_, reply)) = calls.remove(&call) {
                let _ = reply.send(Ok(outcome));
            }
        }
        Body::Refused { to, refused } => {
            if let Some((_, reply)) = calls.remove(&to) {
                let _ = reply.send(Err(refused.clone()));
            }
            if let Some(reply) = reads.remove(&to) {
                let _ = reply.send(Err(refused_error(&refused)));
            }
            if let Some((shard, epoch, _)) = appends.remove(&to)
                && let Some(s) = conn.current(shard)
                && s.epoch == epoch
            {
                conn.lose(&s, &refused.to_string());
            }
        }
        _ => {}
    }
    false
}

fn refused_error(r: &Refused) -> Error {
    if r.is_fenced() {
        Error::Fenced(r.to_string())
    } else {
        Error::Invalid(r.to_string())
    }
}
