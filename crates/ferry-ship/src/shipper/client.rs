//! HTTP to the receiver (docs/ship-protocol.md §1), blocking, on the shipper's worker threads.

use crate::proto::{EpochQuery, Position, Refusal, TxnsQuery};
use ferry_core::{Class, Classify, ConfigError};
use std::io::Read;
use std::time::Duration;

/// Connect timeout: a receiver on the other side of a network answers a SYN well within it.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// No progress on a socket for this long is a stuck peer. Per read and write, not per
/// request: a base of many GiB takes as long as it takes while bytes flow. (No overall
/// timeout on purpose: with one, ureq resolves the host name on a new thread for every
/// request, which cost more CPU than everything else the shipper does.)
const IO_TIMEOUT: Duration = Duration::from_secs(60);

/// A reply the shipper must act on.
#[derive(Debug)]
pub enum Reply {
    Ok(Position),
    Refused { status: u16, refusal: Refusal },
}

/// The request did not get a reply.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct TransportError(pub String);

impl Classify for TransportError {
    fn class(&self) -> Class {
        Class::Transient
    }
}

/// A client for one receiver.
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
    base_url: String,
    auth: Option<String>,
}

impl Client {
    /// `peer` must be an `http://` or `https://` URL. A bad one is a [`ConfigError`] for
    /// the setting `peer` (or `token`, whose value it never repeats).
    pub fn new(peer: &str, token: Option<String>) -> Result<Client, ConfigError> {
        let base_url = peer.trim_end_matches('/').to_string();
        let rest = base_url
            .strip_prefix("http://")
            .or_else(|| base_url.strip_prefix("https://"))
            .ok_or_else(|| {
                ConfigError::new(
                    "peer",
                    peer,
                    "needs a scheme: write http://HOST:PORT or https://HOST:PORT",
                )
            })?;
        if rest.is_empty() || rest.starts_with('/') {
            return Err(ConfigError::new("peer", peer, "names no host"));
        }
        if let Some(t) = &token
            && (t.is_empty() || t.chars().any(|c| c.is_control() || c == ' '))
        {
            return Err(ConfigError::new(
                "token",
                "(not shown)",
                "is empty or holds spaces or control characters",
            ));
        }
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(CONNECT_TIMEOUT))
            .timeout_per_read(Some(IO_TIMEOUT))
            .timeout_per_write(Some(IO_TIMEOUT))
            .max_idle_connections_per_host(4)
            .build()
            .new_agent();
        Ok(Client {
            agent,
            base_url,
            auth: token.map(|t| format!("Bearer {t}")),
        })
    }

    pub fn peer(&self) -> &str {
        &self.base_url
    }

    fn url(&self, name: &str, tail: &str) -> String {
        format!("{}/v1/replicas/{name}{tail}", self.base_url)
    }

    /// Post records.
    pub fn send_txns(
        &self,
        name: &str,
        q: TxnsQuery,
        body: &[u8],
    ) -> Result<Reply, TransportError> {
        let url = self.url(
            name,
            &format!(
                "/txns?epoch={}&generation={}&page_size={}",
                q.epoch, q.generation, q.page_size
            ),
        );
        let mut req = self
            .agent
            .post(&url)
            .header("content-type", "application/x-ferry-records");
        if let Some(a) = &self.auth {
            req = req.header("authorization", a);
        }
        reply(req.send(body))
    }

    /// Stream a base of `len` bytes.
    pub fn send_base(
        &self,
        name: &str,
        q: EpochQuery,
        len: u64,
        body: &mut dyn Read,
    ) -> Result<Reply, TransportError> {
        let url = self.url(
            name,
            &format!("/base?epoch={}&generation={}", q.epoch, q.generation),
        );
        let mut req = self
            .agent
            .post(&url)
            .header("content-type", "application/x-ferry-base")
            .header("content-length", len.to_string());
        if let Some(a) = &self.auth {
            req = req.header("authorization", a);
        }
        reply(req.send(ureq::SendBody::from_reader(body)))
    }

    /// The receiver's position for `name`: Ok(None) if it has none.
    pub fn position(&self, name: &str) -> Result<Reply, TransportError> {
        let mut req = self.agent.get(&self.url(name, ""));
        if let Some(a) = &self.auth {
            req = req.header("authorization", a);
        }
        reply(req.call())
    }
}

fn reply(
    r: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
) -> Result<Reply, TransportError> {
    let mut resp = r.map_err(|e| TransportError(format!("no reply from the receiver: {e}")))?;
    let status = resp.status().as_u16();
    let text = resp
        .body_mut()
        .with_config()
        .limit(1 << 20)
        .read_to_string()
        .map_err(|e| {
            TransportError(format!("the receiver's reply (HTTP {status}) was cut: {e}"))
        })?;
    if status == 200 {
        let p: Position = serde_json::from_str(&text).map_err(|e| {
            TransportError(format!(
                "the receiver's reply is not a position ({e}): {text:.200}"
            ))
        })?;
        return Ok(Reply::Ok(p));
    }
    let refusal = serde_json::from_str::<Refusal>(&text).unwrap_or_else(|_| Refusal {
        error: format!(
            "HTTP {status}: {}",
            text.trim().chars().take(300).collect::<String>()
        ),
        code: match status {
            401 => crate::proto::Code::Unauthorized,
            404 => crate::proto::Code::NotFound,
            413 => crate::proto::Code::TooLarge,
            503 => crate::proto::Code::Busy,
            507 => crate::proto::Code::StorageFull,
            400 => crate::proto::Code::BadRequest,
            _ => crate::proto::Code::Internal,
        },
        position: None,
    });
    Ok(Reply::Refused { status, refusal })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_url_without_a_scheme_is_refused_with_the_fix() {
        let e = Client::new("127.0.0.1:7350", None).err().unwrap();
        assert_eq!(e.setting, "peer");
        assert!(e.reason.contains("http://"), "{e}");
        assert!(Client::new("http://", None).is_err());
        assert!(Client::new("http://127.0.0.1:1/", None).is_ok());
        assert!(Client::new("https://standby.example:443", Some("t0k".into())).is_ok());
        let e = Client::new("http://x:1", Some("a b".into())).err().unwrap();
        assert_eq!(e.setting, "token");
        assert!(!e.to_string().contains("a b"), "the token leaked: {e}");
    }
}
