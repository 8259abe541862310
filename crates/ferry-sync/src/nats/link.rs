//! The replica's side of the JetStream transport (docs/sync-nats.md).
//!
//! - **Fetching** pulls from the replica's durable consumer of its down subject. What
//!   the replica took is acknowledged (with everything before it in the stream:
//!   `AckPolicy::All`) when it next asks, by its position: the newest frame handed at or
//!   before it. A frame handed and not taken stays unacknowledged. A replica that
//!   stopped finds, when it starts, every frame after the last it took read back from
//!   the stream before anything newer, so neither a crash nor a frame it could not take
//!   then costs a gap the relay would leave to it (docs/sync-protocol.md §1.6 step 5).
//! - **Never backwards.** The stream holds a replica's frames in the order the server
//!   issued them, across chains and epochs, so nothing before the newest frame the
//!   replica took can be of use to it, and an older epoch's snapshot handed again would
//!   roll it back (a chain start is taken from any epoch). The link hands nothing from
//!   before that point, whether the consumer redelivers it or a reading again finds it.
//! - **Fetching honours the position**, as over HTTP: the relay counts on a replica
//!   that saw a gap the outbox can fill to fetch it again from where it stands
//!   (docs/sync-protocol.md §1.6 step 5). When the replica asks from before a frame it was
//!   handed (it did not take it: cut short, out of order, refused), the frames from
//!   there are read again from the stream. A reading again that moved the replica
//!   nowhere gives the next fetch to the consumer, so frames it can never take (an
//!   abandoned chain's) cannot keep a new chain from it.
//! - **Reporting** publishes to the report subject; `Ok` once JetStream stored it.
//! - **Uploading** publishes under `Nats-Msg-Id` = the upload's id (a publish repeated
//!   after a lost acknowledgement is dropped by JetStream), then waits for the `Filed`
//!   naming that id on the replica's filed subject. No answer within [`FILED_WAIT`] is a
//!   failure that passes: the uploader sends its rows again under a new id, and the
//!   server's stale check answers the older one if it is filed later.
//!
//! The link runs its own small Tokio runtime, so the replica's loops stay plain threads.
//! Its methods block: call them from a thread, not from async code.

use std::collections::VecDeque;
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use uuid::Uuid;

use super::{Assembler, Names};
use crate::replica::{Downlink, Position, TransportError, Uplink};
use crate::wire;

/// How long an upload waits for its `Filed`.
pub const FILED_WAIT: Duration = Duration::from_secs(30);
/// A delivered frame not acknowledged within this comes again.
const ACK_WAIT: Duration = Duration::from_secs(30);
/// Messages delivered and not yet acknowledged, at most: above what the stream keeps
/// for one replica, so frames a replica cannot take (an abandoned chain's) never stop
/// the consumer before the new chain that follows them.
const ACK_PENDING_MAX: i64 = super::DOWN_KEPT_PER_REPLICA + 1_000;
/// Frames handed out that the link remembers (to read them again).
const HANDED_KEPT: usize = 4_096;
/// How long a pull of what is there stays open for more.
const PULL_AT_ONCE: Duration = Duration::from_millis(20);
/// How long past its own wait a pull is given before it is given up on.
const PULL_SLACK: Duration = Duration::from_secs(2);
/// How long a fetch, report or upload waits for a connection under way.
const CONNECT_WAIT: Duration = Duration::from_secs(2);
/// How long a publish waits for JetStream's acknowledgement.
const PUBLISH_WAIT: Duration = Duration::from_secs(10);

/// One replica's link to NATS: its durable consumer, and its subjects up.
pub struct NatsLink {
    /// `Some` until dropped: see [`Drop`], which may run in async code.
    rt: Option<tokio::runtime::Runtime>,
    url: String,
    names: Names,
    id: Uuid,
    token: String,
    client: async_nats::Client,
    js: jetstream::Context,
    down: Option<(stream::Stream, consumer::PullConsumer)>,
    /// Frames delivered to an earlier run and never acknowledged, read back at start.
    recovered: VecDeque<Vec<u8>>,
    parts: Assembler,
    /// The stream sequence of the first part of the frame being put together.
    first_part: u64,
    /// Frames handed out and not yet known applied, oldest first.
    handed: VecDeque<Handed>,
    /// The stream sequence of the newest frame the replica took (at start: the
    /// consumer's acknowledgement floor): nothing before it is handed.
    taken_at: u64,
    /// At start: the consumer's acknowledgement floor, checked against the replica's
    /// position at the first fetch (a replica restored from an older copy stands before
    /// it).
    floor: Option<u64>,
    /// Where the replica stood at the last reading again: standing there still, it goes
    /// to the consumer instead.
    replayed_at: Option<(Option<[u8; 16]>, u64)>,
    filed: Option<async_nats::Subscriber>,
}

/// A frame handed to the replica: which, where its first part is in the stream, and the
/// consumer's message of its last part (none when read from the stream directly).
struct Handed {
    epoch: Uuid,
    seq: u64,
    at: u64,
    msg: Option<jetstream::Message>,
}

impl NatsLink {
    /// `url`: `nats://HOST:PORT` (or `tls://`); `token`: the replica's token from
    /// `ferry sync enroll`. Connects in the background: a server away now is a failure
    /// that passes, at the first fetch or upload.
    pub fn new(
        url: &str,
        names: Names,
        id: Uuid,
        token: &str,
    ) -> Result<NatsLink, ferry_core::ConfigError> {
        if !(url.starts_with("nats://") || url.starts_with("tls://")) {
            return Err(ferry_core::ConfigError::new(
                "server",
                url,
                "a NATS server must be given as nats://HOST:PORT or tls://HOST:PORT",
            ));
        }
        crate::client::check_token_text(token)?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("ferry-sync-nats")
            .enable_all()
            .build()
            .map_err(|e| ferry_core::ConfigError::new("runtime", "", e.to_string()))?;
        let client = rt
            .block_on(super::connect(url, "ferry sync replica"))
            .map_err(|e| ferry_core::ConfigError::new("server", url, e))?;
        let mut js = {
            let _in = rt.enter();
            jetstream::new(client.clone())
        };
        js.set_timeout(PUBLISH_WAIT);
        Ok(NatsLink {
            rt: Some(rt),
            url: url.to_string(),
            names,
            id,
            token: token.to_string(),
            client,
            js,
            down: None,
            recovered: VecDeque::new(),
            parts: Assembler::default(),
            first_part: 0,
            handed: VecDeque::new(),
            replayed_at: None,
            taken_at: 0,
            floor: None,
            filed: None,
        })
    }

    fn away(&self, what: impl std::fmt::Display) -> TransportError {
        TransportError::Unavailable(format!("NATS at {}: {what}", self.url))
    }

    /// Waits a little for a connection under way (the first, or a reconnection), so a
    /// link just made or a server just back is not taken for one away.
    async fn connected(&self) -> Result<(), TransportError> {
        let up = || self.client.connection_state() == async_nats::connection::State::Connected;
        let deadline = tokio::time::Instant::now() + CONNECT_WAIT;
        while !up() {
            if tokio::time::Instant::now() >= deadline {
                return Err(self.away("not connected"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(())
    }

    /// The replica's consumer, made the first time; frames an earlier run was given and
    /// never acknowledged are read back then.
    async fn consumer(&mut self) -> Result<consumer::PullConsumer, TransportError> {
        if let Some((_, c)) = &self.down {
            return Ok(c.clone());
        }
        let stream = self
            .js
            .get_stream(self.names.down_stream())
            .await
            .map_err(|e| {
                self.away(format!(
                    "no stream {} ({e}); is `ferry sync serve --nats` running?",
                    self.names.down_stream()
                ))
            })?;
        let name = self.names.consumer(self.id);
        let mut consumer: consumer::PullConsumer = stream
            .get_or_create_consumer(
                &name,
                consumer::pull::Config {
                    durable_name: Some(name.clone()),
                    filter_subject: self.names.down(self.id),
                    ack_policy: consumer::AckPolicy::All,
                    ack_wait: ACK_WAIT,
                    max_ack_pending: ACK_PENDING_MAX,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| self.away(format!("cannot make the consumer {name}: {e}")))?;
        let info = consumer
            .info()
            .await
            .map_err(|e| self.away(format!("cannot read the consumer {name}: {e}")))?
            .clone();
        self.taken_at = self.taken_at.max(info.ack_floor.stream_sequence);
        self.floor = Some(info.ack_floor.stream_sequence);
        if info.num_ack_pending > 0 {
            let subject = self.names.down(self.id);
            let from = info.ack_floor.stream_sequence + 1;
            let to = info.delivered.stream_sequence;
            for f in read_frames(&stream, &subject, from, to, usize::MAX).await {
                if self.hand(Some(&f.headers), f.at, None) {
                    self.recovered.push_back(f.frame);
                }
            }
            tracing::info!(replica = %self.id, frames = self.recovered.len(), "nats: frames delivered to an earlier run and never acknowledged, read back");
        }
        self.down = Some((stream, consumer.clone()));
        Ok(consumer)
    }

    async fn fetch_async(
        &mut self,
        position: Position,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        self.connected().await?;
        let consumer = self.consumer().await?;
        if let Some(floor) = self.floor.take() {
            self.rewind(position, floor).await;
        }
        self.took(position).await;
        if !self.recovered.is_empty() {
            let n = max.min(self.recovered.len());
            return Ok(self.recovered.drain(..n).collect());
        }
        let again = self.replay(position, max).await;
        if !again.is_empty() {
            return Ok(again);
        }
        // What is there now, without waiting; with nothing there, a long poll that ends
        // at the first message (as HTTP's does), then whatever followed it. A pull asking
        // for a whole window would wait out `wait` unless the window filled.
        let mut frames = self.pull(&consumer, max, None).await?;
        if frames.is_empty() && wait >= Duration::from_millis(10) {
            frames = self.pull(&consumer, 1, Some(wait)).await?;
            if !frames.is_empty() && frames.len() < max {
                let more = self.pull(&consumer, max - frames.len(), None).await?;
                frames.extend(more);
            }
        }
        Ok(frames)
    }

    /// Up to `max` messages from the consumer: at once (`wait` None: what is there), or
    /// waiting up to `wait` for them; the frames they complete.
    async fn pull(
        &mut self,
        consumer: &consumer::PullConsumer,
        max: usize,
        wait: Option<Duration>,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let batch = match wait {
            // "No wait" only means "say so at once when there is nothing": with fewer
            // messages than asked for, nats-server keeps the pull open until more come
            // or it expires, so it is given a short expiry.
            None => {
                consumer
                    .fetch()
                    .max_messages(max)
                    .expires(PULL_AT_ONCE)
                    .messages()
                    .await
            }
            Some(wait) => {
                consumer
                    .batch()
                    .max_messages(max)
                    .expires(wait)
                    .messages()
                    .await
            }
        };
        let mut batch = match batch {
            Ok(batch) => batch,
            Err(e) => {
                // Made again at the next fetch (deleted, or its stream made again).
                self.down = None;
                return Err(self.away(format!("fetching: {e}")));
            }
        };
        let mut frames = Vec::new();
        // The pull ends when the server ends it; a request the server never ends (seen
        // here: a pull hanging past its expiry) is given up on after this, keeping what
        // came. A message on its way then comes again after the acknowledgement wait.
        let deadline = tokio::time::Instant::now() + wait.unwrap_or(PULL_AT_ONCE) + PULL_SLACK;
        while let Ok(Some(m)) = tokio::time::timeout_at(deadline, batch.next()).await {
            let m = match m {
                Ok(m) => m,
                Err(e) => {
                    if frames.is_empty() {
                        return Err(self.away(format!("fetching: {e}")));
                    }
                    break;
                }
            };
            let at = m.info().map(|i| i.stream_sequence).unwrap_or(0);
            if super::chunk_of(m.headers.as_ref()).is_some_and(|(i, _)| i == 1) {
                self.first_part = at;
            }
            if let Some(frame) = assemble(&mut self.parts, m.headers.as_ref(), &m.payload) {
                if self.first_part <= self.taken_at {
                    // Delivered again, from before what the replica took: acknowledged so
                    // it stops coming, and not handed.
                    let _ = m.ack().await;
                    continue;
                }
                let headers = m.headers.clone();
                if self.hand(headers.as_ref(), self.first_part, Some(m)) {
                    frames.push(frame);
                }
            }
        }
        Ok(frames)
    }

    /// What the replica standing at `position` took: acknowledged (the newest such frame
    /// the consumer delivered, and with it everything before it), and forgotten.
    async fn took(&mut self, position: Position) {
        let taken =
            |h: &Handed| Some(*h.epoch.as_bytes()) == position.epoch && h.seq <= position.seq;
        if let Some(at) = self.handed.iter().filter(|h| taken(h)).map(|h| h.at).max() {
            self.taken_at = self.taken_at.max(at);
        }
        let newest = self
            .handed
            .iter()
            .filter(|h| taken(h) && h.msg.is_some())
            .max_by_key(|h| h.at)
            .and_then(|h| h.msg.as_ref());
        if let Some(m) = newest
            && let Err(e) = m.ack().await
        {
            // Not acknowledged: it comes again after ACK_WAIT, and the replica takes it
            // as already applied.
            tracing::debug!(error = %e, "nats: acknowledging frames");
        }
        // Whatever its epoch, nothing at or before the newest frame taken is of use.
        let taken_at = self.taken_at;
        self.handed.retain(|h| !taken(h) && h.at > taken_at);
    }

    /// A replica standing before the frame at the acknowledgement floor (its file was
    /// restored from an older copy) is handed, first, the frames of its epoch after its
    /// position still in the stream: the relay leaves such a gap to it when its outbox
    /// still holds them (docs/sync-protocol.md §1.6 step 5). Otherwise nothing changes.
    async fn rewind(&mut self, position: Position, floor: u64) {
        let (Some(epoch), Some((stream, _))) = (position.epoch, &self.down) else {
            return;
        };
        let stream = stream.clone();
        let Ok(at_floor) = stream.get_raw_message(floor).await else {
            return; // gone (an abandoned chain's, or expired): the relay catches it up
        };
        // Of the replica's epoch, and after its position.
        let lacking = |h: &async_nats::HeaderMap| {
            let header = |name| h.get(name).map(|v| v.as_str().to_string());
            header(super::EPOCH_HEADER).and_then(|e| e.parse::<Uuid>().ok())
                == Some(Uuid::from_bytes(epoch))
                && header(super::SEQ_HEADER)
                    .and_then(|s| s.parse::<u64>().ok())
                    .is_some_and(|s| s > position.seq)
        };
        if !lacking(&at_floor.headers) {
            return;
        }
        let subject = self.names.down(self.id);
        let behind: Vec<Read> = read_frames(&stream, &subject, 1, floor, usize::MAX)
            .await
            .into_iter()
            .filter(|f| lacking(&f.headers))
            .collect();
        tracing::info!(replica = %self.id, frames = behind.len(), "nats: the replica stands before what its consumer acknowledged (restored from an older copy?): its frames from there are read again");
        self.taken_at = 0;
        let recovered = std::mem::take(&mut self.recovered);
        for f in behind {
            self.hand(Some(&f.headers), f.at, None);
            self.recovered.push_back(f.frame);
        }
        self.recovered.extend(recovered);
    }

    /// Remembers a frame about to be handed out, by the headers of its last part; `false`:
    /// it is from before what the replica took, and is not handed.
    fn hand(
        &mut self,
        headers: Option<&async_nats::HeaderMap>,
        at: u64,
        msg: Option<jetstream::Message>,
    ) -> bool {
        if at <= self.taken_at {
            return false;
        }
        let header = |name| {
            headers
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_string())
        };
        let (Some(epoch), Some(seq)) = (
            header(super::EPOCH_HEADER).and_then(|e| e.parse::<Uuid>().ok()),
            header(super::SEQ_HEADER).and_then(|s| s.parse::<u64>().ok()),
        ) else {
            return true; // not a frame ferry published: the replica refuses it itself
        };
        if let Some(h) = self
            .handed
            .iter_mut()
            .find(|h| h.epoch == epoch && h.seq == seq)
        {
            h.at = at;
            if msg.is_some() {
                h.msg = msg;
            }
            return true;
        }
        if self.handed.len() == HANDED_KEPT {
            self.handed.pop_front();
        }
        self.handed.push_back(Handed {
            epoch,
            seq,
            at,
            msg,
        });
        true
    }

    /// Frames handed out that the replica, standing at `position`, did not take, read
    /// again from the stream (with whatever follows them there), up to `max`.
    async fn replay(&mut self, position: Position, max: usize) -> Vec<Vec<u8>> {
        let here = (position.epoch, position.seq);
        if self.replayed_at.take() == Some(here) {
            return Vec::new(); // the last reading again moved nothing: the consumer's turn
        }
        let Some(start) = self.handed.iter().map(|h| h.at).min() else {
            return Vec::new();
        };
        let Some((stream, _)) = &self.down else {
            return Vec::new();
        };
        let stream = stream.clone();
        self.replayed_at = Some(here);
        let subject = self.names.down(self.id);
        let mut frames = Vec::new();
        for f in read_frames(&stream, &subject, start, u64::MAX, max).await {
            if self.hand(Some(&f.headers), f.at, None) {
                frames.push(f.frame);
            }
        }
        frames
    }

    /// Publishes `payload` up on `subject` with the replica's token; `Ok` once stored.
    async fn publish_up(
        &self,
        subject: String,
        mut headers: async_nats::HeaderMap,
        payload: &[u8],
        what: &str,
    ) -> Result<(), TransportError> {
        let max = self.client.server_info().max_payload;
        if payload.len() + super::HEADROOM > max {
            // An upload refused is halved until the row that makes it large is set
            // aside; a report cannot be, so it waits for the operator (and the replica
            // keeps running, saying why).
            let refusal = match what {
                "upload" => TransportError::Refused,
                _ => TransportError::Unavailable,
            };
            return Err(refusal(format!(
                "the {what} of {} bytes is over what NATS at {} takes in one message (max_payload {max} bytes, less {} for headers); nothing was sent: raise max_payload on the server (8 MiB carries everything a replica sends)",
                payload.len(),
                self.url,
                super::HEADROOM
            )));
        }
        headers.insert(super::TOKEN_HEADER, self.token.as_str());
        let ack = self
            .js
            .publish_with_headers(subject, headers, bytes::Bytes::copy_from_slice(payload))
            .await
            .map_err(|e| self.away(format!("publishing the {what}: {e}")))?;
        ack.await
            .map_err(|e| self.away(format!("publishing the {what}: {e}")))?;
        Ok(())
    }

    async fn upload_async(&mut self, upload: &[u8]) -> Result<Vec<u8>, TransportError> {
        self.connected().await?;
        let upload_id = wire::decode_upload(upload)
            .map_err(|e| TransportError::Refused(format!("the upload does not decode: {e}")))?
            .id;
        if self.filed.is_none() {
            let sub = self
                .client
                .subscribe(self.names.filed(self.id))
                .await
                .map_err(|e| self.away(format!("subscribing to the answers: {e}")))?;
            self.client
                .flush()
                .await
                .map_err(|e| self.away(format!("subscribing to the answers: {e}")))?;
            self.filed = Some(sub);
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            "Nats-Msg-Id",
            format!("{}.up.{upload_id}", self.id).as_str(),
        );
        headers.insert(super::UPLOAD_HEADER, upload_id.to_string().as_str());
        self.publish_up(self.names.upload(self.id), headers, upload, "upload")
            .await?;
        let deadline = tokio::time::Instant::now() + FILED_WAIT;
        let want = upload_id.to_string();
        let mut parts = Assembler::default();
        let sub = self.filed.as_mut().expect("subscribed above");
        loop {
            let m = match tokio::time::timeout_at(deadline, sub.next()).await {
                Ok(Some(m)) => m,
                Ok(None) => {
                    self.filed = None;
                    return Err(self.away("the answers' subscription ended"));
                }
                Err(_) => {
                    return Err(self.away(format!(
                        "no answer to upload {upload_id} within {FILED_WAIT:?}; it may still be filed: its rows go again under a new id"
                    )));
                }
            };
            let header = |name: &str| {
                m.headers
                    .as_ref()
                    .and_then(|h| h.get(name))
                    .map(|v| v.as_str().to_string())
            };
            if header(super::UPLOAD_HEADER).as_deref() != Some(want.as_str()) {
                continue; // the answer to an earlier send, given up on
            }
            if let Some(why) = header(super::REFUSED_HEADER) {
                return Err(TransportError::Refused(why));
            }
            if let Some(filed) = assemble(&mut parts, m.headers.as_ref(), &m.payload) {
                return Ok(filed);
            }
        }
    }
}

impl NatsLink {
    fn handle(&self) -> tokio::runtime::Handle {
        self.rt
            .as_ref()
            .expect("only Drop takes it")
            .handle()
            .clone()
    }
}

impl Drop for NatsLink {
    /// Without waiting for the link's tasks, so a link may be dropped anywhere (dropping
    /// a runtime the usual way inside async code panics).
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// A frame read from the stream directly: its bytes, the stream sequence of its first
/// part, and its last part's headers.
struct Read {
    frame: Vec<u8>,
    at: u64,
    headers: async_nats::HeaderMap,
}

/// Up to `max` frames on `subject` whose parts lie in the stream sequences `from..=to`,
/// in order (the stream away, or nothing more: fewer).
async fn read_frames(
    stream: &stream::Stream,
    subject: &str,
    from: u64,
    to: u64,
    max: usize,
) -> Vec<Read> {
    let mut parts = Assembler::default();
    let (mut seq, mut first) = (from, from);
    let mut frames = Vec::new();
    while seq <= to && frames.len() < max {
        let Ok(m) = stream
            .raw_message_builder()
            .sequence(seq)
            .next_by_subject(subject.to_string())
            .send()
            .await
        else {
            break;
        };
        if m.sequence > to {
            break;
        }
        seq = m.sequence + 1;
        if super::chunk_of(Some(&m.headers)).is_some_and(|(i, _)| i == 1) {
            first = m.sequence;
        }
        if let Some(frame) = assemble(&mut parts, Some(&m.headers), &m.payload) {
            frames.push(Read {
                frame,
                at: first,
                headers: m.headers,
            });
        }
    }
    frames
}

/// Adds one message to `parts`; the whole frame or answer once complete.
fn assemble(
    parts: &mut Assembler,
    headers: Option<&async_nats::HeaderMap>,
    payload: &[u8],
) -> Option<Vec<u8>> {
    let chunk = super::chunk_of(headers)?;
    let key = headers
        .and_then(|h| {
            Some(format!(
                "{}.{}",
                h.get(super::EPOCH_HEADER).or(h.get(super::UPLOAD_HEADER))?,
                h.get(super::SEQ_HEADER).map(|v| v.as_str()).unwrap_or("")
            ))
        })
        .unwrap_or_default();
    parts.push(&key, chunk, payload)
}

impl Downlink for NatsLink {
    /// The frames after what the consumer delivered, unless the replica stands before a
    /// frame it was handed: then those are read again first (see the module's doc).
    fn fetch(
        &mut self,
        position: Position,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let rt = self.handle();
        rt.block_on(self.fetch_async(position, max, wait))
    }

    fn report(&mut self, up: &[u8]) -> Result<(), TransportError> {
        let rt = self.handle();
        rt.block_on(async {
            self.connected().await?;
            self.publish_up(
                self.names.report(self.id),
                async_nats::HeaderMap::new(),
                up,
                "report",
            )
            .await
        })
    }
}

impl Uplink for NatsLink {
    fn upload(&mut self, upload: &[u8]) -> Result<Vec<u8>, TransportError> {
        let rt = self.handle();
        rt.block_on(self.upload_async(upload))
    }
}
