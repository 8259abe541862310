//! The server's log beyond its machine (docs/flow-server-replica.md): every record the
//! local log makes durable is also published to a NATS JetStream stream (three replicas
//! in production), and counts as durable only once the stream has it. A standby server
//! takes a lock, rebuilds its directory from the stream, and fences the server before
//! it with a takeover message: every publish names the stream sequence it follows, so a
//! server that is not the newest writer fails its next one and stops.
//!
//! A message is `type u8 ‖ writer u128 ‖ bytes`, `writer` the id of the server that
//! published it:
//! - `PART` (1) and `LAST` (2): a batch of records, `kind u8 ‖ len u32 ‖ payload` each,
//!   cut into parts of at most the server's message size; a batch counts once its
//!   `LAST` part is in the stream;
//! - `TAKEOVER` (3), no bytes: `writer` writes from here on; an unfinished batch before
//!   it is void, and so is any part of another writer's after it (a deposed server's
//!   part can still land if it names the takeover's sequence).

use async_nats::jetstream::{self, message::PublishMessage, stream};
use bytes::Bytes;
use ferry_core::sync::lock;
use ferry_flow::log::{Config as LogConfig, Error as LogError, Log, Lsn};
use futures_util::StreamExt;
use std::future::{Future, IntoFuture};
use std::path::Path;
use std::time::{Duration, Instant};

const PART: u8 = 1;
const LAST: u8 = 2;
const TAKEOVER: u8 = 3;
/// The most records one batch carries, in bytes (it may be cut into several parts).
pub const BATCH_MAX: usize = 1 << 20;
/// Room kept in a message for its headers.
const HEADROOM: usize = 1024;

/// Where the stream is and how it is shaped (`ferry flow serve --replicate`).
#[derive(Clone, Debug)]
pub struct ReplicaSettings {
    /// NATS servers, comma-separated (`nats://a:4222,nats://b:4222`).
    pub url: String,
    /// The stream's name; its subject is `ferry.flow.<name>`, its lock's stream
    /// `<name>_LOCK`.
    pub stream: String,
    /// Replicas of the stream and the lock, when this server creates them.
    pub replicas: usize,
    /// A lock that stands still this long is taken over by a standby; its holder
    /// renews it every third of it, and stops once it could not for two thirds (the
    /// server's lease).
    pub lease: Duration,
}

/// Why the stream could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("NATS at {url}: {detail}")]
    Nats { url: String, detail: String },
    #[error(
        "stream {stream} on NATS at {url}, message {seq}: {reason} (it is not a ferry flow server's log, or it was damaged)"
    )]
    Corrupted {
        url: String,
        stream: String,
        seq: u64,
        reason: String,
    },
    #[error(
        "another server wrote to stream {stream} after this one (at message {seq}): it took over, and this server stops"
    )]
    Deposed { stream: String, seq: u64 },
    #[error("rebuilding the server's directory from the stream: {0}")]
    Log(#[from] LogError),
    #[error("rebuilding the server's directory from the stream: {0}")]
    Dir(String),
    #[error("{0}")]
    Unsuitable(String),
}

impl ReplicaError {
    /// Whether trying again later may succeed (NATS away, a timeout).
    pub fn transient(&self) -> bool {
        matches!(self, ReplicaError::Nats { .. })
    }
}

/// This server's hold on the stream (module doc).
pub struct Replica {
    url: String,
    name: String,
    subject: String,
    js: jetstream::Context,
    lock: stream::Stream,
    lock_subject: String,
    /// This server, as its lock and its takeover name it.
    id: u128,
    /// The most bytes of records one message carries.
    part_max: usize,
    lease: Duration,
    /// The lock's revision while held.
    revision: u64,
    /// The stream's last sequence as this server knows it (read or written).
    last: u64,
    /// Messages queued and not yet acknowledged, oldest first: the one at `i` follows
    /// sequence `last + i`. The first `acks.len()` of them are in flight.
    outbox: std::collections::VecDeque<Out>,
    /// Behind a mutex only to be `Sync` (the futures are not); never held across an
    /// await.
    acks: std::sync::Mutex<std::collections::VecDeque<Ack>>,
    /// Once the lock is held: its keeper (stopped by `release`), and why the lock was
    /// lost, once it was.
    keeper: Option<(
        tokio::sync::watch::Sender<bool>,
        tokio::task::JoinHandle<()>,
    )>,
    lost: tokio::sync::watch::Receiver<Option<String>>,
    lost_tx: std::sync::Arc<tokio::sync::watch::Sender<Option<String>>>,
    /// The shard count this server is started with, if told (`expect_shards`).
    shards: Option<u32>,
}

impl Replica {
    /// Connect, and create the stream and its lock's stream if they are missing.
    pub async fn connect(settings: &ReplicaSettings) -> Result<Replica, ReplicaError> {
        let url = settings.url.clone();
        let nats = |detail: String| ReplicaError::Nats {
            url: url.clone(),
            detail,
        };
        let addrs = settings
            .url
            .split(',')
            .map(|u| u.trim().parse::<async_nats::ServerAddr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| nats(format!("not a NATS address: {e}")))?;
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .max_reconnects(None)
            .connect(addrs.as_slice())
            .await
            .map_err(|e| nats(format!("cannot connect: {e}")))?;
        let max_payload = client.server_info().max_payload;
        if max_payload < 64 << 10 {
            return Err(nats(format!(
                "it takes messages of at most {max_payload} bytes (max_payload); the flow server needs 64 KiB: raise max_payload in the NATS servers' configuration"
            )));
        }
        let mut js = jetstream::new(client);
        // An acknowledgement not back by then: the batch is read back and sent again.
        js.set_timeout((settings.lease / 2).clamp(Duration::from_secs(1), Duration::from_secs(5)));
        let subject = format!("ferry.flow.{}", settings.stream);
        let stream = open_stream(
            &js,
            stream::Config {
                name: settings.stream.clone(),
                subjects: vec![subject.clone()],
                num_replicas: settings.replicas,
                storage: stream::StorageType::File,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| {
            nats(format!(
                "cannot open or create stream {}: {e}",
                settings.stream
            ))
        })?;
        let c = &stream.cached_info().config;
        if !c.subjects.contains(&subject) {
            return Err(ReplicaError::Unsuitable(format!(
                "stream {} on NATS at {url} does not take subject {subject} (its subjects: {:?}): name another stream with --stream",
                settings.stream, c.subjects
            )));
        }
        if c.max_message_size > 0 && (c.max_message_size as usize) < 64 << 10 {
            return Err(ReplicaError::Unsuitable(format!(
                "stream {} on NATS at {url} takes messages of at most {} bytes (max_msg_size); the flow server needs 64 KiB",
                settings.stream, c.max_message_size
            )));
        }
        let message_max = match c.max_message_size {
            n if n > 0 => (n as usize).min(max_payload),
            _ => max_payload,
        };
        if !c.max_age.is_zero()
            || c.max_messages > 0
            || c.max_bytes > 0
            || c.max_messages_per_subject > 0
            || c.retention != stream::RetentionPolicy::Limits
        {
            return Err(ReplicaError::Unsuitable(format!(
                "stream {} on NATS at {url} would drop the log's messages (max_age {:?}, max_msgs {}, max_bytes {}, max_msgs_per_subject {}, retention {:?}): remove its limits, or name another stream with --stream",
                settings.stream,
                c.max_age,
                c.max_messages,
                c.max_bytes,
                c.max_messages_per_subject,
                c.retention
            )));
        }
        let replicas = c.num_replicas;
        if replicas != settings.replicas {
            tracing::warn!(
                stream = settings.stream,
                replicas,
                asked = settings.replicas,
                "ferry flow server: the stream exists with another number of replicas; it is used as it is"
            );
        }
        // The lock is a stream of one message: the holder's id, renewed by publishing
        // after its own (see `acquire`).
        let lock_name = format!("{}_LOCK", settings.stream);
        let lock_subject = format!("ferry.flow.{}.lock", settings.stream);
        let lock = open_stream(
            &js,
            stream::Config {
                name: lock_name.clone(),
                subjects: vec![lock_subject.clone()],
                max_messages_per_subject: 1,
                num_replicas: settings.replicas,
                storage: stream::StorageType::File,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| {
            nats(format!(
                "cannot open or create the lock stream {lock_name}: {e}"
            ))
        })?;
        let lost_tx = tokio::sync::watch::channel(None).0;
        let mut id = [0u8; 16];
        getrandom::getrandom(&mut id).map_err(|e| nats(format!("no randomness for an id: {e}")))?;
        Ok(Replica {
            url,
            name: settings.stream.clone(),
            subject,
            js,
            lock,
            lock_subject,
            id: u128::from_be_bytes(id),
            part_max: message_max - HEADROOM,
            lease: settings.lease,
            revision: 0,
            last: 0,
            outbox: Default::default(),
            acks: Default::default(),
            keeper: None,
            lost: lost_tx.subscribe(),
            lost_tx: std::sync::Arc::new(lost_tx),
            shards: None,
        })
    }

    fn nats(&self, detail: impl std::fmt::Display) -> ReplicaError {
        ReplicaError::Nats {
            url: self.url.clone(),
            detail: detail.to_string(),
        }
    }

    /// This server's id (its lock's value), as hex.
    pub fn id(&self) -> String {
        format!("{:032x}", self.id)
    }

    /// Take the lock, waiting (as a standby) while another server holds it. A holder
    /// renews it every third of a lease; one whose lock stood still for a whole lease
    /// (by this server's clock, from when it first saw it) is taken as gone. No clocks
    /// are compared across machines, and none of the lock's messages expire.
    pub async fn acquire(&mut self) -> Result<(), ReplicaError> {
        let mut said = false;
        // The holder's last renewal, and when this server first saw it.
        let mut seen: Option<(u64, Instant)> = None;
        // When this server first tried to take the lock: a take of its own found
        // landed was sent no earlier.
        let mut tried: Option<Instant> = None;
        loop {
            let last = match self
                .lock
                .get_last_raw_message_by_subject(&self.lock_subject)
                .await
            {
                Ok(m) => Some(m),
                Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => None,
                Err(e) => {
                    tracing::warn!(stream = self.name, error = %e, "ferry flow server: cannot read the stream's lock yet");
                    tokio::time::sleep(self.lease / 4).await;
                    continue;
                }
            };
            let after = match &last {
                None => Some(0),
                // This server's own (its take landed; the answer did not come back).
                Some(m) if m.payload.as_ref() == self.id().as_bytes() => {
                    self.revision = m.sequence;
                    self.keep(tried.unwrap_or_else(Instant::now));
                    return Ok(());
                }
                Some(m) => match seen {
                    Some((seq, at)) if seq == m.sequence && at.elapsed() >= self.lease => {
                        tracing::info!(stream = self.name, holder = %String::from_utf8_lossy(&m.payload), "ferry flow server: the stream's lock was not renewed for a lease: taking it over");
                        Some(m.sequence)
                    }
                    Some((seq, _)) if seq == m.sequence => None,
                    _ => {
                        seen = Some((m.sequence, Instant::now()));
                        if !said {
                            tracing::info!(stream = self.name, holder = %String::from_utf8_lossy(&m.payload), "ferry flow server: standing by while another server holds the stream's lock");
                            said = true;
                        }
                        None
                    }
                },
            };
            if let Some(after) = after {
                let now = Instant::now();
                tried.get_or_insert(now);
                match lock_publish(&self.js, &self.lock_subject, self.id(), after).await {
                    Ok(revision) => {
                        self.revision = revision;
                        tracing::info!(
                            stream = self.name,
                            server = self.id(),
                            "ferry flow server: holds the stream's lock"
                        );
                        self.keep(now);
                        return Ok(());
                    }
                    // Another server renewed or took it meanwhile.
                    Err(e)
                        if e.kind() == jetstream::context::PublishErrorKind::WrongLastSequence => {}
                    Err(e) => {
                        tracing::warn!(stream = self.name, error = %e, "ferry flow server: cannot take the stream's lock yet");
                    }
                }
            }
            tokio::time::sleep(self.lease / 4).await;
        }
    }

    /// Refuse to take over a stream whose log was made for another shard count (checked
    /// by [`Replica::restore`] before its takeover).
    pub fn expect_shards(&mut self, shards: u32) {
        self.shards = Some(shards);
    }

    /// Start renewing the lock (until [`Replica::release`]).
    /// `sent`: when the message that took the lock was sent, at the earliest.
    fn keep(&mut self, sent: Instant) {
        let keeper = Keeper {
            js: self.js.clone(),
            lock: self.lock.clone(),
            subject: self.lock_subject.clone(),
            value: self.id(),
            revision: self.revision,
            lease: self.lease,
            sent,
        };
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let lost = self.lost_tx.clone();
        let task = tokio::spawn(async move {
            if let Some(why) = keeper.keep(stopped).await {
                tracing::error!(error = why, "ferry flow server: the stream's lock is lost");
                let _ = lost.send(Some(why));
            }
        });
        self.keeper = Some((stop, task));
    }

    /// Resolves once the lock is lost (taken over, or not renewed in time), with why:
    /// the server must stop.
    pub fn lost(&self) -> impl std::future::Future<Output = String> + Send + 'static {
        let mut lost = self.lost.clone();
        async move {
            match lost.wait_for(|l| l.is_some()).await {
                Ok(why) => why.clone().unwrap_or_default(),
                Err(_) => "the lock's keeper ended".into(),
            }
        }
    }

    /// Stop renewing the lock and give it up, so that a standby takes over at once.
    pub async fn release(&mut self) {
        if let Some((stop, task)) = self.keeper.take() {
            let _ = stop.send(true);
            let _ = task.await;
        }
    }

    /// Rebuild `dir`'s log from the stream (the directory is a copy of the stream: what
    /// it held is removed), then publish the takeover.
    pub async fn restore(&mut self, dir: &Path, config: LogConfig) -> Result<(), ReplicaError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| ReplicaError::Dir(format!("cannot create {}: {e}", dir.display())))?;
        // NATS may still be electing the stream's leader (a node lost with the server
        // before): transient failures are tried again while the lock is held.
        let (first, last) = loop {
            match self.sequences().await {
                Ok(s) => break s,
                Err(e) if e.transient() => {
                    if let Some(why) = self.lost.borrow().clone() {
                        return Err(ReplicaError::Dir(format!(
                            "the stream's lock was lost while rebuilding: {why}"
                        )));
                    }
                    tracing::warn!(stream = self.name, error = %e, "ferry flow server: rebuilding from the stream: trying again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        };
        if last > 0 && first != 1 {
            return Err(ReplicaError::Unsuitable(format!(
                "stream {} on NATS at {} starts at message {first}: its first messages were removed (purged or trimmed), and the log cannot be rebuilt without them",
                self.name, self.url
            )));
        }
        // A directory a server used without --replicate holds a log the stream lacks:
        // refused, not removed.
        if last == 0 && (dir.join("log").exists() || dir.join("shards").exists()) {
            let (path, c) = (dir.join("log"), config.clone());
            let records = tokio::task::spawn_blocking(move || {
                Log::open_dir(&path, c).map(|(log, found)| {
                    let _ = log.close();
                    found.records
                })
            })
            .await
            .map_err(|e| ReplicaError::Dir(format!("reading {} panicked: {e}", dir.display())))??;
            if records > 0 || dir.join("shards").exists() {
                return Err(ReplicaError::Unsuitable(format!(
                    "{} holds a flow server's log and stream {} is empty: with --replicate the directory is a copy of the stream, and this one would be removed. Start the server without --replicate, or move the directory away to start afresh",
                    dir.display(),
                    self.name
                )));
            }
        }
        for sub in ["log", "shards"] {
            let path = dir.join(sub);
            if path.exists() {
                tracing::info!(path = %path.display(), "ferry flow server: removed, to be rebuilt from the stream");
                std::fs::remove_dir_all(&path).map_err(|e| {
                    ReplicaError::Dir(format!("cannot remove {}: {e}", path.display()))
                })?;
            }
        }
        let (log, _) = Log::open_dir(&dir.join("log"), config)?;
        let log = std::sync::Arc::new(log);
        let started = Instant::now();
        let mut reading = Reading::default();
        let mut read = 0u64;
        let mut records = 0u64;
        let mut lost = self.lost.clone();
        loop {
            let step = async {
                let last = self.last_sequence().await?;
                if last > read {
                    records += self.read_into(&log, &mut read, last, &mut reading).await?;
                }
                // Refused before taking over: a server that cannot open the log must not
                // depose the one before it.
                if let (Some(want), Some(has)) = (self.shards, reading.shards)
                    && want != has
                {
                    return Err(ReplicaError::Unsuitable(format!(
                        "stream {}'s log was made for {has} shards, not {want}: start the server with --shards {has} (runs are placed by shard, so the count cannot change)",
                        self.name
                    )));
                }
                // An unfinished batch is void: the takeover says so to every later
                // reader.
                self.publish_takeover(read).await
            };
            let step = tokio::select! {
                biased;
                why = lost.wait_for(|l| l.is_some()) => {
                    let why = why.ok().and_then(|w| w.clone()).unwrap_or_default();
                    return Err(ReplicaError::Dir(format!("the stream's lock was lost while rebuilding: {why}")));
                }
                step = step => step,
            };
            match step {
                Ok(seq) => {
                    self.last = seq;
                    break;
                }
                // Written to after it was read (the last batch of the server before):
                // read on.
                Err(ReplicaError::Deposed { .. }) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) if e.transient() => {
                    tracing::warn!(stream = self.name, error = %e, "ferry flow server: rebuilding from the stream: trying again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        }
        let end = log.end_lsn();
        log.durable(end).await?;
        if let Some(log) = std::sync::Arc::into_inner(log) {
            tokio::task::spawn_blocking(move || log.close())
                .await
                .map_err(|e| ReplicaError::Dir(format!("closing the log panicked: {e}")))??;
        }
        tracing::info!(
            stream = self.name,
            messages = read,
            records,
            bytes = end,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "ferry flow server: the log rebuilt from the stream"
        );
        Ok(())
    }

    async fn last_sequence(&self) -> Result<u64, ReplicaError> {
        Ok(self.sequences().await?.1)
    }

    /// The stream's first and last sequences.
    async fn sequences(&self) -> Result<(u64, u64), ReplicaError> {
        let mut stream = self
            .js
            .get_stream(&self.name)
            .await
            .map_err(|e| self.nats(format!("stream {}: {e}", self.name)))?;
        let info = stream
            .info()
            .await
            .map_err(|e| self.nats(format!("stream {}: {e}", self.name)))?;
        Ok((info.state.first_sequence, info.state.last_sequence))
    }

    /// Read messages `read + 1 ..= to` into `log`, moving `read` on with each;
    /// `reading` carries the writer and its unfinished batch from one call to the next.
    /// Returns how many records were appended.
    async fn read_into(
        &self,
        log: &std::sync::Arc<Log>,
        read: &mut u64,
        to: u64,
        reading: &mut Reading,
    ) -> Result<u64, ReplicaError> {
        let from = *read;
        let stream = self
            .js
            .get_stream(&self.name)
            .await
            .map_err(|e| self.nats(format!("stream {}: {e}", self.name)))?;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: self.subject.clone(),
                deliver_policy: jetstream::consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: from + 1,
                },
                ..Default::default()
            })
            .await
            .map_err(|e| self.nats(format!("reading stream {}: {e}", self.name)))?;
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| self.nats(format!("reading stream {}: {e}", self.name)))?;
        let mut records = 0;
        let mut seq = from;
        while seq < to {
            let m = match tokio::time::timeout(Duration::from_secs(30), messages.next()).await {
                Ok(Some(Ok(m))) => m,
                Ok(Some(Err(e))) => {
                    return Err(self.nats(format!("reading stream {}: {e}", self.name)));
                }
                Ok(None) | Err(_) => {
                    return Err(self.nats(format!(
                        "reading stream {}: no message {} within 30 s",
                        self.name,
                        seq + 1
                    )));
                }
            };
            seq = m
                .info()
                .map_err(|e| self.nats(format!("reading stream {}: {e}", self.name)))?
                .stream_sequence;
            let corrupted = |reason: String| ReplicaError::Corrupted {
                url: self.url.clone(),
                stream: self.name.clone(),
                seq,
                reason,
            };
            let p = &m.payload;
            let Some(writer) = writer_of(p) else {
                return Err(corrupted(format!("a message of {} bytes", p.len())));
            };
            match p[0] {
                TAKEOVER => {
                    reading.writer = Some(writer);
                    reading.batch.clear();
                }
                // A part of a writer deposed by the newest takeover: void.
                PART | LAST if reading.writer != Some(writer) => {}
                PART => reading.batch.extend_from_slice(&p[17..]),
                LAST => {
                    reading.batch.extend_from_slice(&p[17..]);
                    // Off the runtime's threads: an append may wait for the log's writer.
                    let (l, b) = (log.clone(), std::mem::take(&mut reading.batch));
                    let applied = tokio::task::spawn_blocking(move || apply(&l, &b))
                        .await
                        .map_err(|e| {
                            ReplicaError::Dir(format!("applying a batch panicked: {e}"))
                        })?;
                    let (n, shape) = applied.map_err(|e| match e {
                        Applied::Bad(reason) => corrupted(reason),
                        Applied::Log(e) => ReplicaError::Log(e),
                    })?;
                    records += n;
                    reading.shards = shape.or(reading.shards);
                }
                kind => {
                    return Err(corrupted(format!("a message of unknown type {kind}")));
                }
            }
            *read = seq;
        }
        Ok(records)
    }

    /// Publish this server's takeover after sequence `after`; its sequence.
    async fn publish_takeover(&self, after: u64) -> Result<u64, ReplicaError> {
        let mut payload = Vec::with_capacity(17);
        payload.push(TAKEOVER);
        payload.extend_from_slice(&self.id.to_be_bytes());
        let ack = self
            .publish_at(Bytes::from(payload), after)
            .await?
            .await
            .map_err(|e| self.refused(e, after))?;
        self.check_sequence(ack.sequence, after)?;
        Ok(ack.sequence)
    }

    /// An acknowledgement must name the sequence after the one its message followed
    /// (some servers answer a duplicate still being committed with 0): anything else
    /// is read back from the stream.
    fn check_sequence(&self, sequence: u64, after: u64) -> Result<(), ReplicaError> {
        if sequence == after + 1 {
            Ok(())
        } else {
            Err(self.nats(format!(
                "stream {} acknowledged a message as number {sequence}, where {} was due",
                self.name,
                after + 1
            )))
        }
    }

    async fn publish_at(
        &self,
        payload: Bytes,
        after: u64,
    ) -> Result<jetstream::context::PublishAckFuture, ReplicaError> {
        self.js
            .send_publish(
                self.subject.clone(),
                PublishMessage::build()
                    .payload(payload)
                    .expected_last_sequence(after)
                    .message_id(format!("{}-{}", self.id(), after + 1)),
            )
            .await
            .map_err(|e| self.refused(e, after))
    }

    fn refused(&self, e: jetstream::context::PublishError, after: u64) -> ReplicaError {
        if e.kind() == jetstream::context::PublishErrorKind::WrongLastSequence {
            ReplicaError::Deposed {
                stream: self.name.clone(),
                seq: after + 1,
            }
        } else if e.kind() == jetstream::context::PublishErrorKind::MaxPayloadExceeded {
            ReplicaError::Corrupted {
                url: self.url.clone(),
                stream: self.name.clone(),
                seq: after + 1,
                reason: format!(
                    "NATS refuses the message as too large ({e}): raise max_payload in the NATS servers' configuration to at least 1 MiB"
                ),
            }
        } else {
            self.nats(format!("publishing to stream {}: {e}", self.name))
        }
    }

    /// Queue a batch of records (`kind u8 ‖ len u32 ‖ payload` each) that ends at `end`
    /// in the log, cut into parts; [`Replica::send`] publishes them.
    pub fn queue(&mut self, batch: &[u8], end: Lsn) {
        let parts: Vec<&[u8]> = batch.chunks(self.part_max - 17).collect();
        for (i, part) in parts.iter().enumerate() {
            let last = i + 1 == parts.len();
            let mut payload = Vec::with_capacity(17 + part.len());
            payload.push(if last { LAST } else { PART });
            payload.extend_from_slice(&self.id.to_be_bytes());
            payload.extend_from_slice(part);
            self.outbox.push_back(Out {
                payload: Bytes::from(payload),
                end: last.then_some(end),
            });
        }
    }

    /// Messages queued and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.outbox.len()
    }

    /// Publish the oldest queued message, if none is in flight: it names the sequence
    /// before it. One at a time, so that a message of this server's found in the stream
    /// past the last acknowledged one is always the oldest queued (a deposed server's
    /// part may land between two of its parts, shifting the second). After an Err, call
    /// [`Replica::recover`].
    pub async fn send(&mut self) -> Result<(), ReplicaError> {
        if !lock(&self.acks).is_empty() || self.outbox.is_empty() {
            return Ok(());
        }
        let after = self.last;
        let ack = self
            .publish_at(self.outbox[0].payload.clone(), after)
            .await?;
        lock(&self.acks).push_back((after, Box::pin(ack.into_future())));
        Ok(())
    }

    /// The next acknowledgement, oldest first (pending while nothing is in flight; safe
    /// to cancel): where the log is in the stream up to, if that message ended a
    /// batch. After an Err, call [`Replica::recover`].
    pub async fn acked(&mut self) -> Result<Option<Lsn>, ReplicaError> {
        let (after, acked) = std::future::poll_fn(|cx| match lock(&self.acks).front_mut() {
            // Nothing in flight: pending until cancelled.
            None => std::task::Poll::Pending,
            Some((after, ack)) => ack.as_mut().poll(cx).map(|r| (*after, r)),
        })
        .await;
        match acked {
            Ok(ack) if ack.sequence != after + 1 => {
                lock(&self.acks).pop_front();
                Err(self
                    .check_sequence(ack.sequence, after)
                    .expect_err("a wrong sequence"))
            }
            Ok(ack) => {
                lock(&self.acks).pop_front();
                let out = self.outbox.pop_front().expect("an acknowledged message");
                self.last = ack.sequence;
                Ok(out.end)
            }
            Err(e) => Err(self.refused(e, after)),
        }
    }

    /// After a failed send or acknowledgement: forget what is in flight, count the
    /// messages past the last acknowledged one that are this server's (by their ids:
    /// they landed), and leave the rest to be sent again. Returns where the log is in
    /// the stream up to, if a landed message ended a batch; `Deposed` if another
    /// server's message is there.
    pub async fn recover(&mut self) -> Result<Option<Lsn>, ReplicaError> {
        lock(&self.acks).clear();
        let last = self.last_sequence().await?;
        if last < self.last {
            return Err(ReplicaError::Corrupted {
                url: self.url.clone(),
                stream: self.name.clone(),
                seq: last,
                reason: format!(
                    "it ends before message {}, which it acknowledged to this server: it was deleted or purged under it. Stop every server of the stream; the servers' directories are copies of what it held",
                    self.last
                ),
            });
        }
        let stream = self
            .js
            .get_stream(&self.name)
            .await
            .map_err(|e| self.nats(format!("stream {}: {e}", self.name)))?;
        let mut end = None;
        while self.last < last {
            let seq = self.last + 1;
            let m = stream.get_raw_message(seq).await.map_err(|e| {
                self.nats(format!(
                    "reading message {seq} of stream {}: {e}",
                    self.name
                ))
            })?;
            let ours = format!("{}-{seq}", self.id());
            let id = m
                .headers
                .get(async_nats::header::NATS_MESSAGE_ID)
                .map(|v| v.as_str());
            if id == Some(ours.as_str())
                && let Some(out) = self.outbox.pop_front()
            {
                // This server's, sent before: it landed.
                end = out.end.or(end);
                self.last = seq;
                continue;
            }
            match (m.payload.first(), writer_of(&m.payload)) {
                // A part of a server deposed before this one took over: void (readers
                // skip it too).
                (Some(&(PART | LAST)), Some(w)) if w != self.id => self.last = seq,
                _ => {
                    return Err(ReplicaError::Deposed {
                        stream: self.name.clone(),
                        seq,
                    });
                }
            }
        }
        Ok(end)
    }
}

/// The server that published a message (module doc).
fn writer_of(payload: &[u8]) -> Option<u128> {
    payload
        .get(1..17)
        .map(|w| u128::from_be_bytes(w.try_into().expect("16 bytes")))
}

/// What reading the stream carries from one message to the next: the writer of the
/// newest takeover, and its unfinished batch.
#[derive(Default)]
struct Reading {
    writer: Option<u128>,
    batch: Vec<u8>,
    /// From the log's shape record.
    shards: Option<u32>,
}

/// A message queued for the stream.
struct Out {
    payload: Bytes,
    /// Where the log is in the stream up to once this message is: set on a batch's last
    /// part.
    end: Option<Lsn>,
}

/// An acknowledgement awaited, with the sequence its message named.
type Ack = (
    u64,
    std::pin::Pin<
        Box<
            dyn Future<
                    Output = Result<
                        jetstream::publish::PublishAck,
                        jetstream::context::PublishError,
                    >,
                > + Send,
        >,
    >,
);

/// Open a stream, creating it if missing; a cluster still electing its leaders is
/// waited for (up to 30 s).
async fn open_stream(
    js: &jetstream::Context,
    config: stream::Config,
) -> Result<stream::Stream, jetstream::context::CreateStreamError> {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        match js.get_or_create_stream(config.clone()).await {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < until => {
                tracing::info!(stream = config.name, error = %e, "ferry flow server: the stream cannot be opened yet; trying again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Publish this server's id to the lock, after the lock's message `after` (0: when it
/// holds none); the new message's sequence.
async fn lock_publish(
    js: &jetstream::Context,
    subject: &str,
    id: String,
    after: u64,
) -> Result<u64, jetstream::context::PublishError> {
    let ack = js
        .send_publish(
            subject.to_string(),
            PublishMessage::build()
                .payload(Bytes::from(id.into_bytes()))
                .expected_last_subject_sequence(after),
        )
        .await?
        .await?;
    Ok(ack.sequence)
}

/// Renews the lock while the server serves (see [`Replica::keeper`]).
pub struct Keeper {
    js: jetstream::Context,
    lock: stream::Stream,
    subject: String,
    value: String,
    revision: u64,
    lease: Duration,
    /// When the last renewal that landed (or the take) was sent.
    sent: Instant,
}

impl Keeper {
    /// Renew every third of the lease until `stop`; returns why the server must stop:
    /// another server holds the lock, or two thirds of a lease passed since the last
    /// renewal that landed was sent (a standby takes the lock only a whole lease after
    /// it saw that renewal, so the server stops first). On `stop`, gives the lock up,
    /// so a standby takes over at once.
    pub async fn keep(mut self, mut stop: tokio::sync::watch::Receiver<bool>) -> Option<String> {
        let mut sent = self.sent;
        let mut wait = (sent + self.lease / 3).saturating_duration_since(Instant::now());
        loop {
            let stopped = tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => true,
                _ = tokio::time::sleep(wait) => false,
            };
            if stopped {
                let _ = self.lock.delete_message(self.revision).await;
                return None;
            }
            let now = Instant::now();
            let deadline = sent + self.lease * 2 / 3;
            if now >= deadline {
                return Some(format!(
                    "the stream's lock could not be renewed for {:?}: a standby may take it",
                    now - sent
                ));
            }
            let renewal = tokio::time::timeout(
                (deadline - now).min(self.lease / 3),
                lock_publish(&self.js, &self.subject, self.value.clone(), self.revision),
            );
            let renewal = match renewal.await {
                Ok(r) => r.map_err(|e| (e.kind(), e.to_string())),
                Err(_) => Err((
                    jetstream::context::PublishErrorKind::TimedOut,
                    "no answer in time".into(),
                )),
            };
            match renewal {
                Ok(revision) => {
                    self.revision = revision;
                    sent = now;
                    // A third of a lease after this one was sent.
                    wait = (sent + self.lease / 3).saturating_duration_since(Instant::now());
                    continue;
                }
                Err((jetstream::context::PublishErrorKind::WrongLastSequence, e)) => {
                    // A renewal whose answer was lost landed: the lock is still this
                    // server's.
                    match self
                        .lock
                        .get_last_raw_message_by_subject(&self.subject)
                        .await
                    {
                        Ok(m) if m.payload.as_ref() == self.value.as_bytes() => {
                            self.revision = m.sequence;
                            wait = Duration::ZERO;
                            continue;
                        }
                        Ok(m) => {
                            return Some(format!(
                                "the stream's lock was taken over by server {} ({e})",
                                String::from_utf8_lossy(&m.payload)
                            ));
                        }
                        Err(r) => {
                            tracing::warn!(error = %r, "ferry flow server: the stream's lock was refused and cannot be read; trying again")
                        }
                    }
                }
                Err((_, e)) => {
                    tracing::warn!(error = %e, "ferry flow server: renewing the stream's lock failed; trying again");
                }
            }
            // Soon again, within the deadline.
            wait = (self.lease / 12).min(deadline.saturating_duration_since(Instant::now()));
        }
    }
}

enum Applied {
    Bad(String),
    Log(LogError),
}

/// Append a whole batch's records to `log`; how many, and the shard count its shape
/// record says, if it holds one.
fn apply(log: &Log, mut batch: &[u8]) -> Result<(u64, Option<u32>), Applied> {
    let mut n = 0;
    let mut shape = None;
    while !batch.is_empty() {
        if batch.len() < 5 {
            return Err(Applied::Bad(format!(
                "a batch ends in {} stray bytes",
                batch.len()
            )));
        }
        let kind = batch[0];
        let len = u32::from_be_bytes(batch[1..5].try_into().expect("4 bytes")) as usize;
        if kind == 0 || batch.len() < 5 + len {
            return Err(Applied::Bad(format!(
                "a record of kind {kind} and {len} bytes, cut short"
            )));
        }
        let payload = &batch[5..5 + len];
        if kind == crate::store::SHAPE_RECORD && len == 4 {
            shape = Some(u32::from_be_bytes(payload.try_into().expect("4 bytes")));
        }
        log.append(kind, payload).map_err(Applied::Log)?;
        batch = &batch[5 + len..];
        n += 1;
    }
    Ok((n, shape))
}

/// The records of `log` from `from` that are durable, up to about [`BATCH_MAX`] bytes,
/// as a batch; and where the last of them ends.
pub fn read_batch(log: &Log, from: Lsn) -> Result<(Vec<u8>, Lsn), LogError> {
    let mut batch = Vec::new();
    let mut end = from;
    let durable = log.durable_lsn();
    log.read_while(from, |r| {
        if r.end > durable {
            return false;
        }
        batch.push(r.kind);
        batch.extend_from_slice(&(r.payload.len() as u32).to_be_bytes());
        batch.extend_from_slice(r.payload);
        end = r.end;
        batch.len() < BATCH_MAX
    })?;
    Ok((batch, end))
}
