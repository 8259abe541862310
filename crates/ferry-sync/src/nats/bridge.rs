//! The server's side of the JetStream transport (docs/sync-nats.md), run by
//! `ferry sync serve --nats URL` beside HTTP:
//!
//! - **Down.** Each replica's committed outbox frames are published to its down subject,
//!   in chain order, each under a stable id (`Nats-Msg-Id`: replica, epoch, seq, nonce,
//!   part) and with `Nats-Expected-Last-Subject-Sequence` naming the subject's last
//!   message as this bridge knows it: two bridges publishing the same replica's frames
//!   cannot interleave them (the loser reads the stream again), and a publish repeated
//!   after a lost acknowledgement is dropped by JetStream. Where to go on from is read
//!   from the stream itself (the subject's last message carries its frame's epoch and
//!   seq), so a bridge keeps no state of its own. A wake-up comes with the relay's
//!   `NOTIFY ferry_sync_outbox`; a sweep every [`SWEEP_EVERY`] catches a lost one.
//!   Publishing a chain start drops the subject's earlier messages: the stream holds
//!   one chain per replica, as the outbox does.
//! - **Up.** Reports and uploads are taken from the up stream through one durable
//!   consumer the bridges share. Each is checked against the token it carries for the
//!   replica its subject names, then stored (a report) or filed (an upload) exactly as
//!   HTTP would, and the upload's sealed `Filed` is published to the replica's filed
//!   subject. A database that does not answer leaves the message to come again.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer, stream};
use futures_util::StreamExt;
use sqlx::Row;
use tokio::sync::watch;
use uuid::Uuid;

use super::{Names, Up};
use crate::serve::{Ask, Serve, TokenRefused};
use crate::wire;

/// How often every replica's outbox is compared with what was published, whatever the
/// notifications said.
pub const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// Replicas whose frames are published at once.
const PUBLISH_AT_ONCE: usize = 32;
/// Frames read from the outbox per look while publishing.
const LOOK_FRAMES: usize = 64;
/// The least `max_payload` a NATS server must take: a report, an upload or a frame
/// larger than one message is carried in parts, but parts this small would be absurd.
const MAX_PAYLOAD_LEAST: usize = 64 * 1024;

/// Why a bridge could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// NATS or the database is away, or failed in a way that passes: start again later.
    #[error("{0}")]
    Unavailable(String),
    /// The NATS server is set up in a way ferry cannot use (its `max_payload`, a stream
    /// that does not take the subjects): the message says what to change.
    #[error("{0}")]
    Unsuitable(String),
}

impl ferry_core::Classify for BridgeError {
    fn class(&self) -> ferry_core::Class {
        match self {
            BridgeError::Unavailable(_) => ferry_core::Class::Transient,
            BridgeError::Unsuitable(_) => ferry_core::Class::Permanent,
        }
    }
}

/// What the bridge did, for `/metrics`.
#[derive(Debug, Default)]
pub struct BridgeStats {
    /// Frames published down, and the messages they took.
    pub frames: AtomicU64,
    pub messages: AtomicU64,
    /// Reports stored, uploads filed.
    pub reports: AtomicU64,
    pub uploads: AtomicU64,
    /// Messages up refused: a wrong or missing token, malformed, over the limits.
    pub refused: AtomicU64,
    /// Failures that pass (NATS or the database away), retried.
    pub errors: AtomicU64,
}

impl BridgeStats {
    /// Prometheus text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (name, help, value) in [
            (
                "ferry_sync_nats_frames_total",
                "Frames published to replicas' down subjects.",
                &self.frames,
            ),
            (
                "ferry_sync_nats_messages_total",
                "NATS messages those frames took (a frame over max_payload goes in parts).",
                &self.messages,
            ),
            (
                "ferry_sync_nats_reports_total",
                "Reports taken from NATS and stored.",
                &self.reports,
            ),
            (
                "ferry_sync_nats_uploads_total",
                "Uploads taken from NATS and filed.",
                &self.uploads,
            ),
            (
                "ferry_sync_nats_refused_total",
                "Messages up refused (token, form, size); nothing was filed or stored.",
                &self.refused,
            ),
            (
                "ferry_sync_nats_errors_total",
                "Failures that pass (NATS or the database away), retried.",
                &self.errors,
            ),
        ] {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}\n",
                value.load(Relaxed)
            ));
        }
        out
    }
}

/// One serve process's JetStream transport.
pub struct Bridge {
    serve: Serve,
    names: Names,
    url: String,
    client: async_nats::Client,
    js: jetstream::Context,
    down: stream::Stream,
    up: stream::Stream,
    reports: stream::Stream,
    /// The most one message carries; a frame or `Filed` over it goes in parts.
    part_max: usize,
    /// Counted into the serve process's own (its /metrics shows them).
    pub stats: Arc<BridgeStats>,
}

/// Where a replica's down subject stands: the last frame published (its epoch and seq;
/// `None`: nothing, so from the start of the current epoch) and the subject's last
/// stream sequence (0: none), which the next publish expects.
#[derive(Clone, Copy, Debug, Default)]
struct Published {
    epoch: Option<Uuid>,
    after: u64,
    last: u64,
}

impl Bridge {
    /// Connects, and makes the two streams where they are missing. An existing stream is
    /// used as its operator set it, as long as it takes the subjects.
    pub async fn connect(serve: Serve, url: &str, names: Names) -> Result<Bridge, BridgeError> {
        let client = super::connect(url, "ferry sync serve")
            .await
            .map_err(BridgeError::Unavailable)?;
        // retry_on_initial_connect: wait for the first connection here, so a wrong
        // address is said at start-up rather than as silence.
        tokio::time::timeout(Duration::from_secs(10), async {
            while client.connection_state() != async_nats::connection::State::Connected {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .map_err(|_| BridgeError::Unavailable(format!("no connection to NATS at {url} within 10 s: is nats-server running there (with -js)?")))?;
        let max_payload = client.server_info().max_payload;
        if max_payload < MAX_PAYLOAD_LEAST {
            return Err(BridgeError::Unsuitable(format!(
                "NATS at {url} takes messages of at most {max_payload} bytes (max_payload); ferry sync needs {MAX_PAYLOAD_LEAST} at least: raise max_payload (1 MiB, the default, is fine)"
            )));
        }
        let js = jetstream::new(client.clone());
        let down = ensure_stream(
            &js,
            url,
            stream::Config {
                name: names.down_stream(),
                subjects: vec![names.down_subjects()],
                retention: stream::RetentionPolicy::Limits,
                max_messages_per_subject: super::DOWN_KEPT_PER_REPLICA,
                max_age: super::KEPT_FOR,
                discard: stream::DiscardPolicy::Old,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            },
        )
        .await?;
        let up = ensure_stream(
            &js,
            url,
            stream::Config {
                name: names.up_stream(),
                subjects: vec![names.up_subjects()],
                retention: stream::RetentionPolicy::WorkQueue,
                max_age: super::KEPT_FOR,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            },
        )
        .await?;
        let reports = ensure_stream(
            &js,
            url,
            stream::Config {
                name: names.reports_stream(),
                subjects: vec![names.report_subjects()],
                retention: stream::RetentionPolicy::WorkQueue,
                max_messages_per_subject: 1,
                discard: stream::DiscardPolicy::Old,
                max_age: super::KEPT_FOR,
                ..Default::default()
            },
        )
        .await?;
        Ok(Bridge {
            stats: serve.nats_stats(),
            serve,
            names,
            url: url.to_string(),
            client,
            js,
            down,
            up,
            reports,
            part_max: max_payload - super::HEADROOM.min(max_payload / 2),
        })
    }

    /// Publishes and files until `stop` turns true.
    pub async fn run(self, stop: watch::Receiver<bool>) -> Result<(), BridgeError> {
        self.run_loops(stop).await.map_err(BridgeError::Unavailable)
    }

    async fn run_loops(self, stop: watch::Receiver<bool>) -> Result<(), String> {
        let this = Arc::new(self);
        let mut down = tokio::spawn({
            let (this, stop) = (this.clone(), stop.clone());
            async move { this.publish_loop(stop).await }
        });
        let mut up = tokio::spawn({
            let (this, stop) = (this.clone(), stop.clone());
            async move {
                let reports = tokio::spawn({
                    let (this, stop) = (this.clone(), stop.clone());
                    async move { this.take_loop(Up::Report, stop).await }
                });
                let uploads = this.take_loop(Up::Upload, stop).await;
                reports.await.map_err(|e| format!("panicked: {e}"))??;
                uploads
            }
        });
        // Either half failing ends the bridge at once, with its error: a bridge that
        // files but no longer publishes (or the other way) must not pass for one that runs.
        let panicked = |e: tokio::task::JoinError| format!("the bridge panicked: {e}");
        tokio::select! {
            r = &mut down => {
                r.map_err(panicked)?.map_err(|e| format!("publishing frames: {e}"))?;
                up.await.map_err(panicked)?.map_err(|e| format!("filing: {e}"))
            }
            r = &mut up => {
                r.map_err(panicked)?.map_err(|e| format!("filing: {e}"))?;
                down.await.map_err(panicked)?.map_err(|e| format!("publishing frames: {e}"))
            }
        }
    }

    async fn publish_loop(&self, mut stop: watch::Receiver<bool>) -> Result<(), String> {
        let mut listener = sqlx::postgres::PgListener::connect_with(&self.serve.pool)
            .await
            .map_err(|e| format!("cannot listen for the relay's outbox notifications: {e}"))?;
        listener
            .listen("ferry_sync_outbox")
            .await
            .map_err(|e| format!("cannot listen for the relay's outbox notifications: {e}"))?;
        let mut known: HashMap<Uuid, Published> = HashMap::new();
        let mut due: BTreeSet<Uuid> = BTreeSet::new();
        let mut sweep = tokio::time::interval(SWEEP_EVERY);
        loop {
            // A replica whose publishing failed stays due, for the next sweep's turn.
            // Replicas go at once (each one's frames in order): one publish waits for
            // its acknowledgement, and a snapshot to many replicas would queue behind it.
            let mut failed = BTreeSet::new();
            if *stop.borrow() {
                return Ok(());
            }
            let batch: Vec<(Uuid, Option<Published>)> = std::mem::take(&mut due)
                .into_iter()
                .map(|id| (id, known.remove(&id)))
                .collect();
            let done: Vec<_> = futures_util::stream::iter(batch)
                .map(|(id, from)| async move { (id, self.publish(id, from).await) })
                .buffer_unordered(PUBLISH_AT_ONCE)
                .collect()
                .await;
            for (id, result) in done {
                match result {
                    Ok(Some(at)) => {
                        known.insert(id, at);
                    }
                    Ok(None) => {}
                    Err(e) => {
                        self.stats.errors.fetch_add(1, Relaxed);
                        tracing::warn!(replica = %id, error = %e, "nats: publishing frames failed; trying again at the next sweep");
                        failed.insert(id);
                    }
                }
            }
            tokio::select! {
                n = listener.recv() => match n {
                    // An empty payload names every replica (too many for one notification).
                    Ok(n) if n.payload().is_empty() => due.extend(self.behind(&known).await.unwrap_or_default()),
                    Ok(n) => due.extend(n.payload().split(',').filter_map(|s| s.parse::<Uuid>().ok())),
                    Err(e) => {
                        tracing::warn!(error = %e, "nats: lost the outbox notifications; sweeping until they are back");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        due.extend(self.behind(&known).await.unwrap_or_default());
                    }
                },
                _ = sweep.tick() => {
                    due.extend(failed);
                    match self.behind(&known).await {
                        Ok(ids) => due.extend(ids),
                        Err(e) => tracing::warn!(error = %e, "nats: the sweep could not read the outbox"),
                    }
                }
                _ = stopped(&mut stop) => return Ok(()),
            }
        }
    }

    /// The replicas whose outbox holds a frame past what this bridge published.
    async fn behind(&self, known: &HashMap<Uuid, Published>) -> Result<Vec<Uuid>, sqlx::Error> {
        let rows = sqlx::query(
            "SELECT o.replica, max(o.seq), (SELECT epoch FROM ferry_sync.meta)
             FROM ferry_sync.outbox o GROUP BY o.replica",
        )
        .fetch_all(&self.serve.pool)
        .await?;
        Ok(rows
            .iter()
            .filter(|row| {
                let id: Uuid = row.get(0);
                let max: i64 = row.get(1);
                let epoch: Uuid = row.get(2);
                known
                    .get(&id)
                    .is_none_or(|p| p.epoch != Some(epoch) || p.after < max as u64)
            })
            .map(|row| row.get(0))
            .collect())
    }

    /// Where replica `id`'s down subject stands, read from the stream.
    async fn read_published(&self, id: Uuid) -> Result<Published, String> {
        match self
            .down
            .get_last_raw_message_by_subject(&self.names.down(id))
            .await
        {
            Ok(m) => {
                let header = |name: &str| {
                    m.headers
                        .get(name)
                        .map(|v| v.as_str().to_string())
                        .unwrap_or_default()
                };
                let epoch = header(super::EPOCH_HEADER).parse::<Uuid>().ok();
                let seq = header(super::SEQ_HEADER).parse::<u64>().unwrap_or(0);
                let (i, n) = super::chunk_of(Some(&m.headers)).unwrap_or((1, 1));
                Ok(Published {
                    epoch,
                    // A frame whose last part never went is published again, whole.
                    after: if i < n { seq.saturating_sub(1) } else { seq },
                    last: m.sequence,
                })
            }
            Err(e) if e.kind() == jetstream::stream::LastRawMessageErrorKind::NoMessageFound => {
                Ok(Published::default())
            }
            Err(e) => Err(format!("reading the last frame published: {e}")),
        }
    }

    /// Publishes every frame of replica `id`'s outbox past what its subject holds (from
    /// `from` when this bridge knows it). `Ok(Some)`: where the subject stands now;
    /// `Ok(None)`: read it from the stream next time (another bridge published).
    async fn publish(
        &self,
        id: Uuid,
        from: Option<Published>,
    ) -> Result<Option<Published>, String> {
        let mut at = match from {
            Some(p) => p,
            None => self.read_published(id).await?,
        };
        loop {
            let ask = Ask {
                replica: id,
                epoch: at.epoch,
                after: at.after,
                max: LOOK_FRAMES,
            };
            let found = crate::serve::look(&self.serve.pool, &[ask])
                .await
                .map_err(|e| format!("database: {e}"))?
                .pop()
                .unwrap_or_default();
            if found.token_hash.is_none() {
                return Ok(None); // not enrolled (any more): nothing to publish
            }
            if found.frames.is_empty() {
                if at.epoch != Some(found.epoch) {
                    // A new epoch numbers from 1 again: nothing of it is published yet.
                    at.epoch = Some(found.epoch);
                    at.after = 0;
                }
                return Ok(Some(at));
            }
            let more = found.frames.len() == LOOK_FRAMES || found.cut;
            for frame in &found.frames {
                let Some((epoch, seq, nonce, prev)) = head_fields(frame) else {
                    return Err("an outbox frame is shorter than its head".into());
                };
                let (mut first_part, mut fresh) = (0, false);
                for (i, n, part) in super::chunks(frame, self.part_max) {
                    let mut headers = async_nats::HeaderMap::new();
                    headers.insert(
                        "Nats-Msg-Id",
                        format!("{id}.{epoch}.{seq}.{nonce}.{i}").as_str(),
                    );
                    headers.insert(
                        "Nats-Expected-Last-Subject-Sequence",
                        at.last.to_string().as_str(),
                    );
                    headers.insert(super::EPOCH_HEADER, epoch.to_string().as_str());
                    headers.insert(super::SEQ_HEADER, seq.to_string().as_str());
                    if n > 1 {
                        headers.insert(super::CHUNK_HEADER, format!("{i}/{n}").as_str());
                    }
                    let ack = match self
                        .js
                        .publish_with_headers(
                            self.names.down(id),
                            headers,
                            bytes::Bytes::copy_from_slice(part),
                        )
                        .await
                    {
                        Ok(ack) => ack.await,
                        Err(e) => Err(e),
                    };
                    match ack {
                        Ok(ack) if ack.duplicate => {
                            // This part went before (its acknowledgement lost, a frame cut
                            // short published again, or another bridge was first): go on
                            // after the subject's last message.
                            at.last = self.read_published(id).await?.last;
                            if i == 1 {
                                first_part = ack.sequence;
                            }
                            continue;
                        }
                        Ok(ack) => {
                            at.last = ack.sequence;
                            fresh = true;
                            if i == 1 {
                                first_part = ack.sequence;
                            }
                        }
                        Err(e)
                            if e.kind()
                                == jetstream::context::PublishErrorKind::WrongLastSequence =>
                        {
                            // Another bridge published meanwhile; its frames are there.
                            return Ok(None);
                        }
                        Err(e) => {
                            return Err(format!("publishing to NATS at {}: {e}", self.url));
                        }
                    }
                    self.stats.messages.fetch_add(1, Relaxed);
                }
                if fresh {
                    self.stats.frames.fetch_add(1, Relaxed);
                }
                at.epoch = Some(epoch);
                at.after = seq;
                if prev == 0 {
                    self.drop_before(id, first_part).await;
                }
            }
            if !more {
                return Ok(Some(at));
            }
        }
    }

    /// A chain start was published at stream sequence `from`: every earlier message of
    /// replica `id`'s subject belongs to a chain the server abandoned, and goes, as over
    /// HTTP the outbox holds only the current chain. (A replica takes any chain start,
    /// so an older one read again would roll it back until the newer came.)
    async fn drop_before(&self, id: Uuid, from: u64) {
        if from <= 1 {
            return;
        }
        if let Err(e) = self
            .down
            .purge()
            .filter(self.names.down(id))
            .sequence(from)
            .await
        {
            self.stats.errors.fetch_add(1, Relaxed);
            tracing::warn!(replica = %id, error = %e, "nats: could not drop an abandoned chain's frames; the replica's link skips them");
        }
    }

    /// Takes one kind of message up until `stop`: through the bridges' shared durable
    /// consumer, made again whenever it fails (deleted, the stream made again).
    async fn take_loop(
        self: Arc<Self>,
        kind: Up,
        mut stop: watch::Receiver<bool>,
    ) -> Result<(), String> {
        let (stream, name) = match kind {
            Up::Upload => (&self.up, self.names.filer()),
            Up::Report => (&self.reports, self.names.reporter()),
        };
        loop {
            let messages = match stream
                .get_or_create_consumer::<consumer::pull::Config>(
                    &name,
                    consumer::pull::Config {
                        durable_name: Some(name.clone()),
                        ack_policy: consumer::AckPolicy::Explicit,
                        ack_wait: Duration::from_secs(30),
                        max_ack_pending: 10_000,
                        ..Default::default()
                    },
                )
                .await
            {
                Ok(consumer) => consumer.messages().await.map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let mut messages = match messages {
                Ok(m) => m,
                Err(e) => {
                    self.stats.errors.fetch_add(1, Relaxed);
                    tracing::warn!(consumer = %name, nats = %self.url, error = %e, "nats: cannot take messages up; trying again in 1 s");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                        _ = stopped(&mut stop) => return Ok(()),
                    }
                }
            };
            loop {
                tokio::select! {
                    m = messages.next() => match m {
                        Some(Ok(m)) => self.take_up(m).await,
                        Some(Err(e)) => {
                            self.stats.errors.fetch_add(1, Relaxed);
                            tracing::warn!(consumer = %name, error = %e, "nats: taking messages up failed; starting again");
                            break;
                        }
                        None => break,
                    },
                    _ = stopped(&mut stop) => return Ok(()),
                }
            }
        }
    }

    /// One message up: checked, stored or filed, answered, acknowledged.
    async fn take_up(&self, m: jetstream::Message) {
        let ack = |kind| acknowledge(&m, kind);
        let Some((id, kind)) = self.names.parse_up(&m.subject) else {
            self.stats.refused.fetch_add(1, Relaxed);
            tracing::warn!(subject = %m.subject, "nats: a message up on a subject that names no replica; dropped");
            return ack(AckKind::Term).await;
        };
        let header = |name: &str| {
            m.headers
                .as_ref()
                .and_then(|h| h.get(name))
                .map(|v| v.as_str().to_string())
        };
        let upload_id = header(super::UPLOAD_HEADER);
        let token = header(super::TOKEN_HEADER).unwrap_or_default();
        let seal_key = match self.serve.check_token(id, &token).await {
            Ok(key) => key,
            Err(TokenRefused::Wrong) => {
                // Not answered on the replica's subject: whoever sent it is not known to
                // be the replica, and an answer could make it set rows aside.
                self.refuse_as(
                    id,
                    kind,
                    upload_id.as_deref(),
                    format!(
                        "wrong {} header for replica {id}, or no such replica enrolled; nothing was filed or stored: use the token `ferry sync enroll --replica {id}` gave this replica",
                        super::TOKEN_HEADER
                    ),
                    false,
                )
                .await;
                return ack(AckKind::Term).await;
            }
            Err(TokenRefused::Db(e)) => {
                self.stats.errors.fetch_add(1, Relaxed);
                tracing::warn!(replica = %id, error = %e, "nats: the database did not answer a token check; the message comes again");
                return ack(AckKind::Nak(Some(Duration::from_secs(1)))).await;
            }
        };
        if kind == Up::Report && !self.latest_report(&m).await {
            // A newer report of this replica came meanwhile (the stream keeps one each):
            // storing this one late would put an older position over a newer one.
            return ack(AckKind::Ack).await;
        }
        match kind {
            Up::Report => {
                match crate::serve::store_report(&self.serve.pool, id, &m.payload).await {
                    Ok(()) => {
                        self.stats.reports.fetch_add(1, Relaxed);
                        ack(AckKind::Ack).await
                    }
                    Err(crate::serve::ReportError::Malformed(e)) => {
                        self.refuse(id, kind, None, format!("the report was not stored: {e}"))
                            .await;
                        ack(AckKind::Term).await
                    }
                    Err(crate::serve::ReportError::Db(e)) => {
                        self.stats.errors.fetch_add(1, Relaxed);
                        tracing::warn!(replica = %id, error = %e, "nats: storing a report failed; it comes again");
                        ack(AckKind::Nak(Some(Duration::from_secs(1)))).await
                    }
                }
            }
            Up::Upload => {
                let nak = match self
                    .file(id, &seal_key, upload_id.as_deref(), &m.payload)
                    .await
                {
                    Ok(()) => false,
                    Err(e) => {
                        self.stats.errors.fetch_add(1, Relaxed);
                        tracing::warn!(replica = %id, error = %e, "nats: filing an upload failed; it comes again");
                        true
                    }
                };
                ack(if nak {
                    AckKind::Nak(Some(Duration::from_secs(1)))
                } else {
                    AckKind::Ack
                })
                .await
            }
        }
    }

    /// Whether report `m` is still its replica's latest: the reports stream keeps one
    /// per replica, so a newer one removed it.
    async fn latest_report(&self, m: &jetstream::Message) -> bool {
        let Ok(info) = m.info() else {
            return true;
        };
        match self.reports.get_raw_message(info.stream_sequence).await {
            Ok(_) => true,
            Err(e) => e.kind() != jetstream::stream::LastRawMessageErrorKind::NoMessageFound,
        }
    }

    /// Files one upload and publishes its answer (a `Filed`, or why not). `Err`: it
    /// passes (the database, NATS); the upload should come again.
    async fn file(
        &self,
        id: Uuid,
        seal_key: &[u8],
        upload_id: Option<&str>,
        payload: &[u8],
    ) -> Result<(), String> {
        if payload.len() > wire::UPLOAD_BYTES_MAX {
            let why = format!(
                "the upload is over {} bytes, the most an upload may be; nothing was filed",
                wire::UPLOAD_BYTES_MAX
            );
            self.refuse(id, Up::Upload, upload_id, why).await;
            return Ok(());
        }
        let upload = match wire::decode_upload(payload) {
            Ok(upload) => upload,
            Err(e) => {
                let why = format!("the upload was not filed: {e}");
                self.refuse(id, Up::Upload, upload_id, why).await;
                return Ok(());
            }
        };
        let Ok(seal_key) = <[u8; 32]>::try_from(seal_key) else {
            let why = format!(
                "replica {id} has no seal key; nothing was filed: enroll it again with `ferry sync enroll --replica {id}`"
            );
            // Not answered: the answer could not be sealed for it anyway.
            self.refuse_as(id, Up::Upload, upload_id, why, false).await;
            return Ok(());
        };
        let (records, shape) = self.serve.filing();
        let filed = match crate::file::file(&self.serve.pool, records, shape, id, &upload).await {
            Ok(crate::file::Outcome::Filed(filed)) => filed,
            Ok(crate::file::Outcome::Malformed(why)) => {
                let id_text = upload.id.to_string();
                self.refuse(
                    id,
                    Up::Upload,
                    Some(&id_text),
                    format!("the upload was not filed: {why}"),
                )
                .await;
                return Ok(());
            }
            Err(e) => return Err(e.to_string()),
        };
        self.stats.uploads.fetch_add(1, Relaxed);
        let answer = wire::encode_filed(&filed, &seal_key, id.as_bytes());
        for (i, n, part) in super::chunks(&answer, self.part_max) {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(super::UPLOAD_HEADER, upload.id.to_string().as_str());
            if n > 1 {
                headers.insert(super::CHUNK_HEADER, format!("{i}/{n}").as_str());
            }
            // Filed now: an answer that does not reach the replica is like one lost over
            // HTTP; the replica sends its rows again under a new id.
            if let Err(e) = self
                .client
                .publish_with_headers(
                    self.names.filed(id),
                    headers,
                    bytes::Bytes::copy_from_slice(part),
                )
                .await
            {
                tracing::warn!(replica = %id, error = %e, "nats: the answer to an upload was not sent; the replica sends its rows again");
            }
        }
        Ok(())
    }

    /// Says why a message up was refused: in the log and the count, and, for an upload
    /// whose token matched (`kind` Upload), to its replica on its filed subject.
    async fn refuse(&self, id: Uuid, kind: Up, upload_id: Option<&str>, why: String) {
        self.refuse_as(id, kind, upload_id, why, kind == Up::Upload)
            .await
    }

    async fn refuse_as(
        &self,
        id: Uuid,
        kind: Up,
        upload_id: Option<&str>,
        why: String,
        answer: bool,
    ) {
        self.stats.refused.fetch_add(1, Relaxed);
        tracing::warn!(replica = %id, ?kind, reason = %why, "nats: refused a message up");
        if !answer {
            return;
        }
        let mut headers = async_nats::HeaderMap::new();
        if let Some(upload_id) = upload_id {
            headers.insert(super::UPLOAD_HEADER, upload_id);
        }
        let one_line: String = why
            .chars()
            .filter(|c| !c.is_control())
            .take(1_000)
            .collect();
        headers.insert(super::REFUSED_HEADER, one_line.as_str());
        let _ = self
            .client
            .publish_with_headers(self.names.filed(id), headers, bytes::Bytes::new())
            .await;
    }
}

async fn acknowledge(m: &jetstream::Message, kind: AckKind) {
    if let Err(e) = m.ack_with(kind).await {
        // Not acknowledged: it comes again, and is stored or filed again, harmlessly.
        tracing::debug!(error = %e, "nats: acknowledging a message up");
    }
}

async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// A frame's epoch, seq, nonce and prev, from its head (docs/sync-protocol.md §1.1).
fn head_fields(frame: &[u8]) -> Option<(Uuid, u64, u64, u64)> {
    let epoch = Uuid::from_bytes(frame.get(24..40)?.try_into().ok()?);
    let seq = u64::from_be_bytes(frame.get(40..48)?.try_into().ok()?);
    let nonce = u64::from_be_bytes(frame.get(48..56)?.try_into().ok()?);
    let prev = u64::from_be_bytes(frame.get(56..64)?.try_into().ok()?);
    Some((epoch, seq, nonce, prev))
}

/// The stream `config` names, made if missing; an existing one must take its subjects.
async fn ensure_stream(
    js: &jetstream::Context,
    url: &str,
    config: stream::Config,
) -> Result<stream::Stream, BridgeError> {
    use BridgeError::{Unavailable, Unsuitable};
    match js.get_stream(&config.name).await {
        Ok(mut existing) => {
            let info = existing.info().await.map_err(|e| {
                Unavailable(format!(
                    "reading stream {} on NATS at {url}: {e}",
                    config.name
                ))
            })?;
            let missing: Vec<&String> = config
                .subjects
                .iter()
                .filter(|s| !info.config.subjects.contains(s))
                .collect();
            if !missing.is_empty() {
                return Err(Unsuitable(format!(
                    "stream {} on NATS at {url} does not take {missing:?} (its subjects: {:?}); add them, or delete the stream for ferry to make it",
                    config.name, info.config.subjects
                )));
            }
            Ok(existing)
        }
        Err(e)
            if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(j)
                if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
        {
            let name = config.name.clone();
            js.create_stream(config).await.map_err(|e| {
                Unavailable(format!("cannot make stream {name} on NATS at {url}: {e}"))
            })
        }
        Err(e) => Err(Unavailable(format!(
            "cannot read stream {} on NATS at {url}: {e} (is JetStream on? start nats-server with -js)",
            config.name
        ))),
    }
}
