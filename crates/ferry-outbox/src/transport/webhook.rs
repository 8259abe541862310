//! The HTTP webhook transport: one `POST` per message.
//!
//! Headers: `Idempotency-Key` (the message id, the same on every attempt),
//! `Ferry-Topic`, `Ferry-Key` and `Ferry-Seq` when set, `Ferry-Timestamp` (Unix seconds)
//! and, with a secret, `Ferry-Signature: v1=HEX` where HEX is HMAC-SHA256 over
//! `TIMESTAMP "." MESSAGE_ID "." BODY`. The message's own headers are sent as they are.
//!
//! Answers: 2xx confirmed; 408, 429 and 5xx unavailable (429/503 honour `Retry-After`;
//! another 5xx counts against the message when other messages were confirmed just
//! before it);
//! other 4xx and 3xx refused (redirects are not followed: a POST must not turn into a
//! GET); connection refused unavailable; a timeout or cut after the request went out
//! unknown.
//!
//! The HTTP client is ureq (blocking, the project's one HTTP client library): each
//! request runs on tokio's blocking pool, so the relay's publish window (per lane)
//! bounds how many run at once.

use super::{Outcome, PublishFuture, Transport, TransportError, TransportOptions};
use crate::store::Leased;
use ferry_core::ConfigError;
use ferry_core::seams::Clock;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::io::Read;
use std::sync::Arc;
use std::time::Duration;

pub struct Webhook {
    url: String,
    /// `url` without credentials or query, for logs and errors.
    shown: String,
    agent: ureq::Agent,
    secret: Option<Vec<u8>>,
    dedup_window: Duration,
    clock: Arc<dyn Clock>,
}

/// Bytes of a refusal's body kept in `last_error`.
const ERROR_BODY_BYTES_MAX: usize = 512;
/// Bytes of a confirmation's body read (and dropped) so its connection can be reused;
/// a longer body costs a new connection, nothing else.
const OK_BODY_BYTES_MAX: u64 = 64 << 10;
/// Idle connections kept to the endpoint: one per publish in flight, up to a window of
/// 256 (beyond that, connections are opened per request).
const IDLE_CONNECTIONS_MAX: usize = 256;
/// Connecting takes at most this (or the publish timeout, if shorter): a connection
/// that cannot be made within it is unavailable, and nothing was sent.
const CONNECT_TIMEOUT_MAX: Duration = Duration::from_secs(5);

impl Webhook {
    pub fn new(url: &str, options: &TransportOptions) -> Result<Webhook, TransportError> {
        let uri: ureq::http::Uri = url
            .parse()
            .map_err(|e| ConfigError::new("to", url, format!("not a URL: {e}")))?;
        let Some(host) = uri.host() else {
            return Err(ConfigError::new("to", url, "the webhook URL needs a host").into());
        };
        let shown = format!(
            "{}://{host}{}{}",
            uri.scheme_str().unwrap_or("http"),
            uri.port().map(|p| format!(":{p}")).unwrap_or_default(),
            uri.path()
        );
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(options.publish_timeout))
            .timeout_connect(Some(options.publish_timeout.min(CONNECT_TIMEOUT_MAX)))
            .max_redirects(0)
            .max_redirects_will_error(false)
            .http_status_as_error(false)
            .max_idle_connections(IDLE_CONNECTIONS_MAX)
            .max_idle_connections_per_host(IDLE_CONNECTIONS_MAX)
            .build()
            .into();
        Ok(Webhook {
            url: url.to_string(),
            shown,
            agent,
            secret: options.webhook_secret.clone(),
            dedup_window: options.webhook_dedup_window,
            clock: options.clock.clone(),
        })
    }

    async fn post(&self, msg: &Leased) -> Outcome {
        let ts = (self.clock.wall_ms() / 1000).to_string();
        let mut headers: Vec<(String, String)> = vec![
            ("Idempotency-Key".into(), msg.message_id.clone()),
            ("Ferry-Topic".into(), msg.topic.clone()),
            ("Ferry-Timestamp".into(), ts.clone()),
            ("Content-Type".into(), "application/octet-stream".into()),
        ];
        if let Some(k) = &msg.key {
            headers.push(("Ferry-Key".into(), k.clone()));
        }
        if let Some(s) = msg.seq {
            headers.push(("Ferry-Seq".into(), s.to_string()));
        }
        for (k, v) in &msg.headers {
            headers.push((k.clone(), v.clone()));
        }
        if let Some(secret) = &self.secret {
            headers.push((
                "Ferry-Signature".into(),
                format!("v1={}", sign(secret, &ts, &msg.message_id, &msg.payload)),
            ));
        }
        let (agent, url, shown, body) = (
            self.agent.clone(),
            self.url.clone(),
            self.shown.clone(),
            msg.payload.clone(),
        );
        match tokio::task::spawn_blocking(move || send(&agent, &url, &shown, headers, body)).await {
            Ok(o) => o,
            // The blocking task panicked or the runtime is shutting down: the request may
            // have gone out.
            Err(e) => {
                Outcome::Unknown(format!("the request to {} did not finish: {e}", self.shown))
            }
        }
    }
}

/// One blocking POST and what its answer means.
fn send(
    agent: &ureq::Agent,
    url: &str,
    shown: &str,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
) -> Outcome {
    let mut req = agent.post(url);
    for (k, v) in &headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let mut resp = match req.send(&body[..]) {
        Ok(r) => r,
        Err(e) => return failed(shown, e),
    };
    let status = resp.status();
    if status.is_success() {
        let _ = resp
            .body_mut()
            .with_config()
            .limit(OK_BODY_BYTES_MAX)
            .read_to_vec();
        return Outcome::Confirmed { duplicate: false };
    }
    let retry_after = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let mut excerpt = Vec::new();
    let _ = resp
        .body_mut()
        .as_reader()
        .take(ERROR_BODY_BYTES_MAX as u64)
        .read_to_end(&mut excerpt);
    let excerpt = String::from_utf8_lossy(&excerpt).trim().to_string();
    let reason = format!("HTTP {status} from {shown}: {excerpt}");
    match status.as_u16() {
        // The endpoint (or what stands in front of it) says it is away or overloaded.
        408 | 429 | 502..=504 => Outcome::Unavailable {
            reason,
            retry_after,
            server_error: false,
        },
        500..=599 => Outcome::Unavailable {
            reason,
            retry_after,
            server_error: true,
        },
        _ => Outcome::Refused(reason),
    }
}

/// A request that got no answer: unavailable when it surely never left (no
/// connection), refused when it could not be built from the message, otherwise unknown.
fn failed(shown: &str, e: ureq::Error) -> Outcome {
    use std::io::ErrorKind as K;
    use ureq::Error as E;
    use ureq::Timeout as T;
    let not_sent = match &e {
        E::Io(io) => matches!(
            io.kind(),
            K::ConnectionRefused | K::AddrNotAvailable | K::NetworkUnreachable | K::HostUnreachable
        ),
        E::ConnectionFailed | E::HostNotFound | E::Timeout(T::Connect | T::Resolve) => true,
        E::Tls(_) | E::Rustls(_) => true,
        _ => false,
    };
    if not_sent {
        return Outcome::Unavailable {
            reason: format!("cannot connect to {shown}: {e}"),
            retry_after: None,
            server_error: false,
        };
    }
    if matches!(e, E::Http(_) | E::BadUri(_)) {
        return Outcome::Refused(format!("cannot build the request: {e}"));
    }
    Outcome::Unknown(format!("no answer from {shown}: {e}"))
}

impl Transport for Webhook {
    fn publish<'a>(&'a self, msg: &'a Leased) -> PublishFuture<'a> {
        Box::pin(self.post(msg))
    }

    fn describe(&self) -> String {
        self.shown.clone()
    }

    fn dedup_window(&self) -> Option<Duration> {
        Some(self.dedup_window)
    }
}

/// Hex HMAC-SHA256 of `timestamp "." message_id "." body` under `secret`.
pub fn sign(secret: &[u8], timestamp: &str, message_id: &str, body: &[u8]) -> String {
    let mut mac =
        <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(message_id.as_bytes());
    mac.update(b".");
    mac.update(body);
    mac.finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
