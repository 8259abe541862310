//! Where relays publish (docs/outbox.md §5). A transport answers each publish with an
//! [`Outcome`] that says whose fault a failure is, because the relay treats them
//! differently: a message's own refusal spends one of its attempts; a transport that is
//! away spends none and pauses publishing; an unanswered publish leaves the message
//! uncertain, to be presented again under the same id.

pub mod nats;
pub mod webhook;

use crate::store::Leased;
use ferry_core::seams::{Clock, SystemClock};
use ferry_core::{Class, Classify, ConfigError};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// The answer to one publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The transport holds the message. `duplicate`: it already did (an earlier
    /// presentation under the same id got through).
    Confirmed { duplicate: bool },
    /// The transport refused this message for the message's own sake (too large, a 4xx,
    /// no JetStream stream takes its subject): spends an attempt.
    Refused(String),
    /// The transport is away or refusing everything (connection refused, JetStream not
    /// answering, stream full, 429, 5xx): spends no attempt, counts toward opening the
    /// breaker.
    /// `server_error`: a 5xx, which spends an attempt when other messages are confirmed
    /// meanwhile (the endpoint fails for this message only).
    Unavailable {
        reason: String,
        retry_after: Option<Duration>,
        server_error: bool,
    },
    /// Sent, but no answer came (timeout, connection cut): the transport may hold it.
    Unknown(String),
}

pub type PublishFuture<'a> = Pin<Box<dyn Future<Output = Outcome> + Send + 'a>>;

/// A place relays publish to. Implement it to publish anywhere else; present
/// `msg.message_id` as the transport's dedup key on every attempt.
pub trait Transport: Send + Sync + 'static {
    fn publish<'a>(&'a self, msg: &'a Leased) -> PublishFuture<'a>;
    /// For logs and status: where this publishes, without secrets.
    fn describe(&self) -> String;
    /// How long the transport recognises a repeated message id, if it does.
    fn dedup_window(&self) -> Option<Duration>;
    /// The transport's own word that it is connected (again), if it has one: a count
    /// that rises at every (re)connection. A relay whose breaker is open probes as soon
    /// as it rises instead of waiting out the pause. None (the default): the pause runs
    /// its course.
    fn connections(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }
}

/// Connect to `to` (setting `to`): `nats://HOST:PORT` (JetStream) or `http(s)://…`
/// (webhook).
pub async fn connect(
    to: &str,
    options: &TransportOptions,
) -> Result<Box<dyn Transport>, TransportError> {
    if to.starts_with("nats://") || to.starts_with("tls://") {
        return Ok(Box::new(nats::JetStream::connect(to, options).await?));
    }
    if to.starts_with("http://") || to.starts_with("https://") {
        return Ok(Box::new(webhook::Webhook::new(to, options)?));
    }
    Err(ConfigError::new(
        "to",
        to,
        "use nats://HOST:PORT for NATS JetStream or http(s)://HOST/PATH for a webhook",
    )
    .into())
}

/// Why a transport could not be set up at start-up.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A setting is unusable (`to`, `stream`, `publish_timeout`).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The server did not answer (yet): transient.
    #[error("cannot connect to {what}: {detail}; is it running and reachable from here?")]
    Unreachable { what: String, detail: String },
    /// The server answers but lacks what the outbox needs, or refuses it: a person
    /// changes the server or the outbox's settings.
    #[error("{what}: {detail}")]
    Unsuitable { what: String, detail: String },
}

impl Classify for TransportError {
    fn class(&self) -> Class {
        match self {
            TransportError::Unreachable { .. } => Class::Transient,
            TransportError::Config(_) | TransportError::Unsuitable { .. } => Class::Permanent,
        }
    }
}

/// Settings shared by the transports.
#[derive(Clone)]
pub struct TransportOptions {
    /// Time to wait for an answer to one publish; past it the outcome is unknown.
    pub publish_timeout: Duration,
    /// Webhook: HMAC-SHA256 key for the `Ferry-Signature` header.
    pub webhook_secret: Option<Vec<u8>>,
    /// Webhook: how long the receiver keeps idempotency keys (it cannot be asked).
    pub webhook_dedup_window: Duration,
    /// NATS: the stream that must cover every topic published (checked at start-up);
    /// None looks the stream up per subject.
    pub nats_stream: Option<String>,
    /// Largest payload the relay will be asked to publish; start-up fails when the
    /// transport accepts less.
    pub payload_bytes_max: usize,
    /// Where the webhook's `Ferry-Timestamp` comes from (tests set their own).
    pub clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for TransportOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportOptions")
            .field("publish_timeout", &self.publish_timeout)
            .field(
                "webhook_secret",
                &self.webhook_secret.as_ref().map(|_| "***"),
            )
            .field("webhook_dedup_window", &self.webhook_dedup_window)
            .field("nats_stream", &self.nats_stream)
            .field("payload_bytes_max", &self.payload_bytes_max)
            .finish()
    }
}

impl Default for TransportOptions {
    fn default() -> Self {
        TransportOptions {
            publish_timeout: Duration::from_secs(10),
            webhook_secret: None,
            webhook_dedup_window: Duration::from_secs(24 * 3600),
            nats_stream: None,
            payload_bytes_max: crate::message::PAYLOAD_BYTES_MAX,
            clock: Arc::new(SystemClock),
        }
    }
}
