//! One connection, from its Hello to its close: who it is, and each frame it sends.

use super::calls::{answered, call_in, unsend};
use super::{Inner, PAGE_MAX, authorized, carry_out, now, refused, replied};
use crate::lease::{Action, SessionId};
use crate::store::AppendError;
use ferry_flow::remote::io::{FrameReader, ReadError, write_frame};
use ferry_flow::remote::proto::{
    self, Body, Frame, Granted, Hello, PROTOCOL, Refused, Role, ShardPos, Welcome,
};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// How long a connection may take to say hello, and the most its frames may hold
/// until it has.
const HELLO_WITHIN: Duration = Duration::from_secs(10);
const HELLO_FRAME_MAX: usize = 64 << 10;
/// A peer that does not take a frame within this is cut off (it would hold the
/// server's shutdown, and its queue, forever).
const WRITE_WITHIN: Duration = Duration::from_secs(10);

/// Who a connection is, once it said hello.
#[derive(Clone, Copy)]
enum Peer {
    Worker(SessionId),
    Client,
}

pub(super) async fn connection<S>(inner: Arc<Inner>, stream: S)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut reader, mut writer) = tokio::io::split(stream);
    let (tx, mut rx) = mpsc::unbounded_channel::<Frame>();
    let write = tokio::spawn(async move {
        while let Some(frame) = rx.recv().await {
            let close = matches!(frame.body, Body::Refused { ref refused, .. } if closes(refused));
            let wrote = tokio::time::timeout(WRITE_WITHIN, write_frame(&mut writer, &frame)).await;
            if !matches!(wrote, Ok(Ok(()))) || close {
                break;
            }
        }
        let _ = tokio::time::timeout(WRITE_WITHIN, writer.shutdown()).await;
    });
    let conn_no = {
        let mut state = ferry_core::sync::lock(&inner.state);
        state.next_conn += 1;
        state.next_conn
    };
    let mut frames = FrameReader::default();
    frames.limit(HELLO_FRAME_MAX);
    let hello_by = tokio::time::Instant::now() + HELLO_WITHIN;
    let mut peer: Option<Peer> = None;
    loop {
        let read = tokio::select! {
            biased;
            _ = inner.stop.wait() => break,
            _ = tokio::time::sleep_until(hello_by), if peer.is_none() => {
                let _ = tx.send(refused(0, Refused::Malformed { what: format!("no Hello within {HELLO_WITHIN:?}") }));
                break;
            }
            read = frames.next(&mut reader) => read,
        };
        let frame = match read {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(ReadError::Io(e)) => {
                tracing::debug!(error = %e, "ferry flow server: a connection broke");
                break;
            }
            Err(ReadError::Malformed(e)) => {
                let _ = tx.send(refused(0, e.into()));
                break;
            }
        };
        let id = frame.id;
        let answer = match (peer, frame.body) {
            (None, Body::Hello(hello)) => match hello_in(&inner, &tx, conn_no, id, hello) {
                Ok(p) => {
                    peer = Some(p);
                    frames.limit(proto::FRAME_MAX);
                    None
                }
                Err(r) => Some(refused(id, r)),
            },
            (None, _) => Some(refused(
                id,
                Refused::Malformed {
                    what: "the first frame must be a Hello".into(),
                },
            )),
            (Some(_), Body::Call(call)) => {
                let answer = call_in(inner.clone(), call);
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _ = tx.send(match answer.await {
                        Ok(outcome) => Frame {
                            id: 0,
                            body: Body::Answer { call: id, outcome },
                        },
                        Err(r) => refused(id, r),
                    });
                });
                None
            }
            (Some(Peer::Client), _) => Some(refused(
                id,
                Refused::Malformed {
                    what: "a client holds no shards: only calls come from a client".into(),
                },
            )),
            (Some(Peer::Worker(s)), body) => handle(&inner, &tx, s, conn_no, id, body),
        };
        if let Some(answer) = answer {
            let close = matches!(&answer.body, Body::Refused { refused, .. } if closes(refused));
            if let Body::Refused { refused, .. } = &answer.body {
                let c = &inner.counts;
                if refused.is_fenced() {
                    &c.refused_fenced
                } else {
                    &c.refused_other
                }
                .fetch_add(1, Relaxed);
            }
            let _ = tx.send(answer);
            // Nothing after a frame refused as malformed is applied.
            if close {
                break;
            }
        }
    }
    if let Some(Peer::Worker(s)) = peer {
        let mut state = ferry_core::sync::lock(&inner.state);
        // Only if this connection is still the session's (a reconnect replaces it).
        if state.conns.get(&s).is_some_and(|(n, _)| *n == conn_no) {
            state.conns.remove(&s);
            unsend(&mut state, s);
            let actions = state.table.disconnect(s, now());
            carry_out(&inner, &mut state, actions);
            // No reply will come from it.
            replied(&inner, &mut state, s);
        }
    }
    drop(tx);
    // A peer that does not read is cut off by the write timeout; past that, let go.
    if tokio::time::timeout(WRITE_WITHIN * 2, write).await.is_err() {
        tracing::warn!("ferry flow server: a connection's writer did not finish");
    }
}

/// Refusals after which the connection closes.
fn closes(r: &Refused) -> bool {
    matches!(
        r,
        Refused::Malformed { .. } | Refused::Unauthorized | Refused::Version { .. }
    )
}

/// A session's id as logs and status show it: enough to tell workers apart, not enough
/// to speak as one.
pub fn session_tag(id: SessionId) -> String {
    format!("{:08x}", (id >> 96) as u32)
}

fn hello_in(
    inner: &Inner,
    tx: &mpsc::UnboundedSender<Frame>,
    conn_no: u64,
    id: u64,
    hello: Hello,
) -> Result<Peer, Refused> {
    if hello.version != PROTOCOL {
        return Err(Refused::Version {
            supported: PROTOCOL,
        });
    }
    let settings = &inner.settings;
    if !authorized(settings, Some(&hello.token)) {
        return Err(Refused::Unauthorized);
    }
    let mut state = ferry_core::sync::lock(&inner.state);
    let state = &mut *state;
    let welcome = |grants| Frame {
        id,
        body: Body::Welcome(Welcome {
            version: PROTOCOL,
            session: hello.session,
            shards: settings.shards,
            lease_ms: settings.lease.as_millis() as u32,
            ping_ms: settings.ping_every.as_millis() as u32,
            stuck_ms: settings.stuck_after.as_millis() as u32,
            record_max: settings.record_max,
            grants,
        }),
    };
    if hello.role == Role::Client {
        let _ = tx.send(welcome(Vec::new()));
        return Ok(Peer::Client);
    }
    // A reconnect replaces the session's old connection (which is closed); a Hello on
    // a connection older than the session's current one is stale.
    if let Some((n, old)) = state.conns.get(&hello.session) {
        if *n > conn_no {
            return Err(Refused::Malformed {
                what: "a Hello on a connection older than this session's current one".into(),
            });
        }
        let _ = old.send(refused(
            0,
            Refused::Malformed {
                what: "this session connected again: this connection is replaced".into(),
            },
        ));
    }
    state.conns.insert(hello.session, (conn_no, tx.clone()));
    // Answers to calls sent on the old connection may never come: they go again.
    unsend(state, hello.session);
    state.names.insert(hello.session, hello.name.clone());
    // A shard whose acknowledged records the server no longer has durable is not
    // resumed: that would build on a hole (the server lost what it acknowledged, which
    // only a restore from an older copy does).
    let resume: Vec<(u32, u64)> = hello
        .resume
        .iter()
        .filter(|r| {
            let ok = r.shard < settings.shards && r.acked <= state.store.durable(r.shard);
            if !ok && r.shard < settings.shards {
                tracing::error!(
                    shard = r.shard,
                    acknowledged = r.acked,
                    durable = state.store.durable(r.shard),
                    "ferry flow server: a worker resumes past what this server holds durably; \
                     was the server's directory restored from an older copy?"
                );
            }
            ok
        })
        .map(|r| (r.shard, r.epoch))
        .collect();
    let actions = state
        .table
        .connect(hello.session, hello.max_shards, &resume, now());
    let resumed: Vec<Granted> = actions
        .iter()
        .filter_map(|a| match *a {
            Action::Resumed { shard, epoch, .. } => Some(Granted {
                shard,
                epoch,
                checkpoint: state.store.base(shard),
                end: state.store.durable(shard),
            }),
            _ => None,
        })
        .collect();
    let _ = tx.send(welcome(resumed));
    carry_out(inner, state, actions);
    tracing::info!(session = %session_tag(hello.session), name = %hello.name, max_shards = hello.max_shards, "ferry flow server: a worker connected");
    Ok(Peer::Worker(hello.session))
}

/// One frame from a session that said hello; its answer, if it has one now.
fn handle(
    inner: &Inner,
    tx: &mpsc::UnboundedSender<Frame>,
    session: SessionId,
    conn_no: u64,
    id: u64,
    body: Body,
) -> Option<Frame> {
    // What an append's records do to the index, read before the lock.
    let mut updates = match &body {
        Body::Append(a) => crate::index::updates_of(&a.records),
        _ => Vec::new(),
    };
    let mut state = ferry_core::sync::lock(&inner.state);
    let state = &mut *state;
    // A connection its session replaced speaks no more.
    if state.conns.get(&session).is_none_or(|(n, _)| *n != conn_no) {
        return Some(refused(
            id,
            Refused::Malformed {
                what: "this connection was replaced by a newer one of its session".into(),
            },
        ));
    }
    let now = now();
    let answer = |body| Some(Frame { id, body });
    match body {
        Body::Ping(turns) => {
            let turns: Vec<(u32, u64, u64)> =
                turns.iter().map(|t| (t.shard, t.epoch, t.turns)).collect();
            let held = state.table.ping(session, &turns, now);
            answer(Body::Pong(held))
        }
        Body::Append(a) => {
            if let Err(r) = state.table.check(session, a.shard, a.epoch) {
                return Some(refused(id, r));
            }
            if state.failed {
                return Some(refused(
                    id,
                    Refused::Unavailable {
                        retry_after_ms: 1000,
                    },
                ));
            }
            if a.records
                .iter()
                .any(|r| r.bytes.len() + 1 > inner.settings.record_max as usize)
            {
                return Some(refused(
                    id,
                    Refused::TooLarge {
                        limit: u64::from(inner.settings.record_max),
                    },
                ));
            }
            let count = a.records.len() as u64;
            let before = state.store.end(a.shard);
            let appended = state.store.append(a.shard, a.epoch, a.first, &a.records);
            // A reply from a worker the last round acknowledged, whatever it held: once
            // it is in the log, the writer need not wait for it.
            replied(inner, state, session);
            let new = state.store.end(a.shard) - before;
            let skip = before.saturating_sub(a.first) as usize;
            let moving: Vec<(u64, crate::index::Update)> = updates
                .drain(..)
                .enumerate()
                .skip(skip)
                .take(new as usize)
                .filter_map(|(i, u)| Some((a.first + i as u64 + 1, u?)))
                .collect();
            if !moving.is_empty() {
                let mut index = ferry_core::sync::lock(&inner.index);
                for (position, u) in moving {
                    index.appended(a.shard, position, u);
                }
            }
            inner.counts.records.fetch_add(new, Relaxed);
            inner
                .counts
                .records_again
                .fetch_add(count.saturating_sub(new), Relaxed);
            match appended {
                Ok(Some(_)) => {
                    inner.appended.notify_one();
                    None
                }
                // Every record was there already: acknowledge what of it is durable now;
                // the rest is acknowledged when the sync that covers it comes.
                Ok(None) => {
                    let durable = state.store.durable(a.shard);
                    (durable >= a.first + count && count > 0).then(|| Frame {
                        id: 0,
                        body: Body::Durable(vec![ShardPos {
                            shard: a.shard,
                            epoch: a.epoch,
                            position: durable,
                        }]),
                    })
                }
                Err(AppendError::Refused(r)) => Some(refused(id, r)),
                Err(AppendError::Log(e)) => {
                    tracing::error!(error = %e, "ferry flow server: the log failed; the server stops, and recovers when started again");
                    state.failed = true;
                    inner.stop.set();
                    Some(refused(
                        id,
                        Refused::Unavailable {
                            retry_after_ms: 1000,
                        },
                    ))
                }
            }
        }
        Body::Release { shard, epoch, end } => {
            if let Err(r) = state.table.check(session, shard, epoch) {
                return Some(refused(id, r));
            }
            // Everything up to `end` must be here: a worker releases only what it has
            // seen acknowledged.
            if state.store.end(shard) < end {
                return Some(refused(
                    id,
                    Refused::PositionGap {
                        shard,
                        expected: state.store.end(shard),
                    },
                ));
            }
            match state.table.release(session, shard, epoch, now) {
                Ok(actions) => {
                    inner.counts.releases.fetch_add(1, Relaxed);
                    carry_out(inner, state, actions);
                    answer(Body::Released { shard, epoch })
                }
                Err(r) => Some(refused(id, r)),
            }
        }
        Body::Recover {
            shard,
            epoch,
            from,
            max_bytes,
        } => {
            if let Err(r) = state.table.check(session, shard, epoch) {
                return Some(refused(id, r));
            }
            // Read without the lock (a page is up to 1 MiB, and the read passes other
            // shards' records): every other connection's pings and appends go on. A
            // read from before the shard's checkpoint (a newer one than the reader
            // fetched) is refused: the reader starts again from the checkpoint.
            let Some(page) = state.store.page(shard, from) else {
                return Some(refused(id, UNAVAILABLE));
            };
            let tx = tx.clone();
            inner.read_off(move || {
                let answer = match page.read(max_bytes.clamp(1, PAGE_MAX)) {
                    Ok((records, last)) => Frame {
                        id,
                        body: Body::Records(proto::Records {
                            shard,
                            epoch,
                            first: from,
                            records,
                            last,
                        }),
                    },
                    Err(e) => {
                        tracing::error!(error = %e, shard, "ferry flow server: a shard's records could not be read");
                        refused(
                            id,
                            Refused::Unavailable {
                                retry_after_ms: 1000,
                            },
                        )
                    }
                };
                let _ = tx.send(answer);
            });
            None
        }
        Body::Fetch {
            shard,
            epoch,
            position,
            offset,
            max_bytes,
        } => {
            if let Err(r) = state.table.check(session, shard, epoch) {
                return Some(refused(id, r));
            }
            let position = match position {
                0 => state.store.base(shard),
                p => p,
            };
            let chunk = move |bytes, last| Frame {
                id,
                body: Body::Checkpoint {
                    shard,
                    epoch,
                    position,
                    offset,
                    bytes,
                    last,
                },
            };
            if position == 0 {
                return Some(chunk(Vec::new(), true));
            }
            let path = crate::checkpoints::path(&inner.shards_dir, shard, position);
            let tx = tx.clone();
            inner.read_off(move || {
                let answer = match read_chunk(&path, offset, max_bytes.clamp(1, PAGE_MAX)) {
                    Ok((bytes, last)) => chunk(bytes, last),
                    // Replaced by a newer one meanwhile: the reader starts again.
                    Err(e) => {
                        tracing::info!(error = %e, shard, "ferry flow server: a checkpoint could not be read");
                        refused(id, UNAVAILABLE)
                    }
                };
                let _ = tx.send(answer);
            });
            None
        }
        Body::Answer { call, outcome } => {
            answered(state, session, call, outcome, now, inner.settings.call_wait);
            None
        }
        Body::Parked {
            shard,
            epoch,
            run,
            reason,
        } => {
            // From a holder the shard has moved from: nothing to show.
            if state.table.check(session, shard, epoch).is_ok()
                && ferry_core::sync::lock(&inner.index).parked(shard, &run, reason)
            {
                inner.run_settled(&run);
            }
            None
        }
        Body::Hello(_) => Some(refused(
            id,
            Refused::Malformed {
                what: "a second Hello on one connection".into(),
            },
        )),
        // Frames only the server sends.
        _ => Some(refused(
            id,
            Refused::Malformed {
                what: "a frame only the server sends".into(),
            },
        )),
    }
}

const UNAVAILABLE: Refused = Refused::Unavailable {
    retry_after_ms: 1000,
};

/// Up to `max` bytes of the file at `path` from `offset`; whether they reach its end.
fn read_chunk(path: &std::path::Path, offset: u64, max: u32) -> std::io::Result<(Vec<u8>, bool)> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    f.seek(SeekFrom::Start(offset))?;
    let mut bytes = Vec::new();
    f.take(u64::from(max)).read_to_end(&mut bytes)?;
    let last = offset + bytes.len() as u64 >= len;
    Ok((bytes, last))
}
