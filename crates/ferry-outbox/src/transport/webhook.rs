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

use super::{Outcome, PublishFuture, Transport, TransportOptions};
use crate::store::Leased;
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub struct Webhook {
    url: reqwest::Url,
    client: reqwest::Client,
    secret: Option<Vec<u8>>,
    dedup_window: Duration,
}

/// Bytes of a refusal's body kept in `last_error`.
const ERROR_BODY_BYTES_MAX: usize = 512;

impl Webhook {
    pub fn new(url: &str, options: &TransportOptions) -> Result<Webhook, String> {
        let url = reqwest::Url::parse(url).map_err(|e| format!("--to {url}: {e}"))?;
        if url.host_str().is_none() {
            return Err(format!("--to {url}: the webhook URL needs a host"));
        }
        let client = reqwest::Client::builder()
            .timeout(options.publish_timeout)
            .connect_timeout(options.publish_timeout.min(Duration::from_secs(5)))
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(256)
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        Ok(Webhook {
            url,
            client,
            secret: options.webhook_secret.clone(),
            dedup_window: options.webhook_dedup_window,
        })
    }

    async fn post(&self, msg: &Leased) -> Outcome {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
            .to_string();
        let mut req = self
            .client
            .post(self.url.clone())
            .header("Idempotency-Key", &msg.message_id)
            .header("Ferry-Topic", &msg.topic)
            .header("Ferry-Timestamp", &ts)
            .header("Content-Type", "application/octet-stream");
        if let Some(k) = &msg.key {
            req = req.header("Ferry-Key", k);
        }
        if let Some(s) = msg.seq {
            req = req.header("Ferry-Seq", s.to_string());
        }
        for (k, v) in &msg.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        if let Some(secret) = &self.secret {
            req = req.header(
                "Ferry-Signature",
                format!("v1={}", sign(secret, &ts, &msg.message_id, &msg.payload)),
            );
        }
        let resp = match req.body(msg.payload.clone()).send().await {
            Ok(r) => r,
            Err(e) if e.is_connect() => {
                return Outcome::Unavailable {
                    reason: format!("cannot connect to {}: {e}", self.describe()),
                    retry_after: None,
                    server_error: false,
                };
            }
            Err(e) if e.is_builder() => {
                return Outcome::Refused(format!("cannot build the request: {e}"));
            }
            Err(e) => return Outcome::Unknown(format!("no answer from {}: {e}", self.describe())),
        };
        let status = resp.status();
        if status.is_success() {
            return Outcome::Confirmed { duplicate: false };
        }
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let body = resp.bytes().await.unwrap_or_default();
        let excerpt = String::from_utf8_lossy(&body[..body.len().min(ERROR_BODY_BYTES_MAX)])
            .trim()
            .to_string();
        let reason = format!("HTTP {status} from {}: {excerpt}", self.describe());
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
}

impl Transport for Webhook {
    fn publish<'a>(&'a self, msg: &'a Leased) -> PublishFuture<'a> {
        Box::pin(self.post(msg))
    }

    fn describe(&self) -> String {
        let mut u = self.url.clone();
        let _ = u.set_password(None);
        u.set_query(None);
        u.to_string()
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
