//! Where relays publish (docs/outbox.md §5). A transport answers each publish with an
//! [`Outcome`] that says whose fault a failure is, because the relay treats them
//! differently: a message's own refusal spends one of its attempts; a transport that is
//! away spends none and pauses publishing; an unanswered publish leaves the message
//! uncertain, to be presented again under the same id.

pub mod nats;
pub mod webhook;

use crate::store::Leased;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// The answer to one publish.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The transport holds the message. `duplicate`: it already did (an earlier
    /// presentation under the same id got through).
    Confirmed { duplicate: bool },
    /// The transport refused this message for the message's own sake (too large, a 4xx):
    /// spends an attempt.
    Refused(String),
    /// The transport is away or refusing everything (connection refused, no responders,
    /// stream full, 429, 5xx): spends no attempt, counts toward opening the breaker.
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
}

/// Parse `--to`: `nats://HOST:PORT` (JetStream) or `http(s)://…` (webhook).
pub async fn connect(to: &str, options: &TransportOptions) -> Result<Box<dyn Transport>, String> {
    if to.starts_with("nats://") || to.starts_with("tls://") {
        return Ok(Box::new(nats::JetStream::connect(to, options).await?));
    }
    if to.starts_with("http://") || to.starts_with("https://") {
        return Ok(Box::new(webhook::Webhook::new(to, options)?));
    }
    Err(format!(
        "--to {to}: use nats://HOST:PORT for NATS JetStream or http(s)://HOST/PATH for a webhook"
    ))
}

/// Settings shared by the transports.
#[derive(Clone, Debug)]
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
}

impl Default for TransportOptions {
    fn default() -> Self {
        TransportOptions {
            publish_timeout: Duration::from_secs(10),
            webhook_secret: None,
            webhook_dedup_window: Duration::from_secs(24 * 3600),
            nats_stream: None,
            payload_bytes_max: crate::message::PAYLOAD_BYTES_MAX,
        }
    }
}
