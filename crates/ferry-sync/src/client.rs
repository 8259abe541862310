//! The built-in transport, replica side: fetches frames after the replica's position
//! and posts reports (docs/sync-protocol.md §2.1), over HTTP with ureq on the replica's thread.

use std::time::Duration;

use crate::replica::{Downlink, Position, TransportError};

/// A connect is answered well within this on any network a replica can sync over.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// A read waits for the long poll, plus this much for the server and the network.
const READ_SLACK: Duration = Duration::from_secs(15);
/// The most a fetch's answer may hold: 64 frames of at most 16 MiB each would be 1 GiB;
/// the server stops a fetch's answer early past 64 MiB, so this bounds memory with room.
const FETCH_BYTES_MAX: u64 = 80 << 20;

/// One replica's link to a `ferry sync serve` process.
pub struct HttpLink {
    agent: ureq::Agent,
    base: String,
    id: uuid::Uuid,
    auth: String,
}

impl HttpLink {
    /// `base` is `http(s)://HOST:PORT`; `token` the replica's bearer token.
    pub fn new(
        base: &str,
        id: uuid::Uuid,
        token: &str,
    ) -> Result<HttpLink, ferry_core::ConfigError> {
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(ferry_core::ConfigError::new(
                "server",
                base,
                "must start with http:// or https://",
            ));
        }
        check_token_text(token)?;
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(CONNECT_TIMEOUT))
            .timeout_per_read(Some(crate::serve::FETCH_WAIT_MAX + READ_SLACK))
            .timeout_per_write(Some(READ_SLACK))
            .build()
            .new_agent();
        Ok(HttpLink {
            agent,
            base: base.trim_end_matches('/').to_string(),
            id,
            auth: format!("Bearer {token}"),
        })
    }
}

/// A token a transport can carry: not empty, no spaces or control characters.
pub(crate) fn check_token_text(token: &str) -> Result<(), ferry_core::ConfigError> {
    if token.is_empty() || token.chars().any(|c| c.is_control() || c == ' ') {
        return Err(ferry_core::ConfigError::new(
            "token",
            "(not shown)",
            "is empty or holds spaces or control characters",
        ));
    }
    Ok(())
}

fn status_error(status: u16, text: &str) -> TransportError {
    let message = serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or_else(|| text.chars().take(300).collect());
    match status {
        401 | 403 | 404 | 413 | 400 => TransportError::Refused(format!("HTTP {status}: {message}")),
        _ => TransportError::Unavailable(format!("HTTP {status}: {message}")),
    }
}

impl Downlink for HttpLink {
    fn fetch(
        &mut self,
        position: Position,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let after_seq = position.seq;
        let mut url = format!(
            "{}/v1/replicas/{}/messages?after={after_seq}&max={max}&wait_ms={}",
            self.base,
            self.id,
            wait.as_millis()
        );
        if let Some(e) = position.epoch {
            url.push_str(&format!("&epoch={}", uuid::Uuid::from_bytes(e)));
        }
        let mut resp = self
            .agent
            .get(&url)
            .header("authorization", &self.auth)
            .call()
            .map_err(|e| {
                TransportError::Unavailable(format!("no answer from {}: {e}", self.base))
            })?;
        let status = resp.status().as_u16();
        if status == 204 {
            return Ok(Vec::new());
        }
        let body = resp
            .body_mut()
            .with_config()
            .limit(FETCH_BYTES_MAX)
            .read_to_vec()
            .map_err(|e| {
                TransportError::Unavailable(format!("the answer from {} was cut: {e}", self.base))
            })?;
        if status != 200 {
            return Err(status_error(status, &String::from_utf8_lossy(&body)));
        }
        let mut frames = Vec::new();
        let mut at = 0usize;
        while at < body.len() {
            let Some(len) = body.get(at..at + 4) else {
                return Err(TransportError::Unavailable(
                    "a frame's length was cut".into(),
                ));
            };
            let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
            let Some(frame) = body.get(at + 4..at + 4 + len) else {
                return Err(TransportError::Unavailable("a frame was cut".into()));
            };
            frames.push(frame.to_vec());
            at += 4 + len;
        }
        Ok(frames)
    }

    fn report(&mut self, up: &[u8]) -> Result<(), TransportError> {
        let url = format!("{}/v1/replicas/{}/reports", self.base, self.id);
        let mut resp = self
            .agent
            .post(&url)
            .header("authorization", &self.auth)
            .header("content-type", "application/x-ferry-sync-report")
            .send(up)
            .map_err(|e| {
                TransportError::Unavailable(format!("no answer from {}: {e}", self.base))
            })?;
        let status = resp.status().as_u16();
        if status == 204 || status == 200 {
            return Ok(());
        }
        let text = resp
            .body_mut()
            .with_config()
            .limit(1 << 20)
            .read_to_string()
            .unwrap_or_default();
        Err(status_error(status, &text))
    }
}

/// The most a `Filed` answer may hold: refusals of at most every row of an upload
/// (1,000), each a few hundred bytes, with room.
const FILED_BYTES_MAX: u64 = 4 << 20;

impl crate::replica::Uplink for HttpLink {
    fn upload(&mut self, upload: &[u8]) -> Result<Vec<u8>, TransportError> {
        let url = format!("{}/v1/replicas/{}/uploads", self.base, self.id);
        let mut resp = self
            .agent
            .post(&url)
            .header("authorization", &self.auth)
            .header("content-type", "application/x-ferry-sync-upload")
            .send(upload)
            .map_err(|e| {
                TransportError::Unavailable(format!("no answer from {}: {e}", self.base))
            })?;
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(FILED_BYTES_MAX)
            .read_to_vec()
            .map_err(|e| {
                TransportError::Unavailable(format!("the answer from {} broke off: {e}", self.base))
            })?;
        if status == 200 {
            return Ok(body);
        }
        Err(status_error(status, &String::from_utf8_lossy(&body)))
    }
}

/// A replica's link by its server's scheme: `http(s)://` a `ferry sync serve`,
/// `nats://` or `tls://` the NATS server a `ferry sync serve --nats` bridges to
/// (subjects under `prefix`; docs/sync-nats.md).
pub enum Link {
    Http(HttpLink),
    Nats(Box<crate::nats::link::NatsLink>),
}

impl Link {
    pub fn new(
        server: &str,
        prefix: &str,
        id: uuid::Uuid,
        token: &str,
    ) -> Result<Link, ferry_core::ConfigError> {
        if server.starts_with("nats://") || server.starts_with("tls://") {
            let names = crate::nats::Names::new(prefix)?;
            let link = crate::nats::link::NatsLink::new(server, names, id, token)?;
            return Ok(Link::Nats(Box::new(link)));
        }
        Ok(Link::Http(HttpLink::new(server, id, token)?))
    }
}

impl Downlink for Link {
    fn fetch(
        &mut self,
        position: Position,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        match self {
            Link::Http(l) => l.fetch(position, max, wait),
            Link::Nats(l) => l.fetch(position, max, wait),
        }
    }

    fn report(&mut self, up: &[u8]) -> Result<(), TransportError> {
        match self {
            Link::Http(l) => l.report(up),
            Link::Nats(l) => l.report(up),
        }
    }
}

impl crate::replica::Uplink for Link {
    fn upload(&mut self, upload: &[u8]) -> Result<Vec<u8>, TransportError> {
        match self {
            Link::Http(l) => l.upload(upload),
            Link::Nats(l) => l.upload(upload),
        }
    }
}
