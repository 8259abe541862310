//! HTTP to the receiver (docs/ship-protocol.md §1), blocking, on the shipper's worker
//! threads: over [`Http1`] for an `http://` peer (the common case, and the hot path: a
//! request per step), over `ureq` for `https://`.

use super::http1::{Body, Http1, REPLY_BYTES_MAX};
use crate::proto::{EpochQuery, Position, Refusal, TxnsQuery};
use ferry_core::{Class, Classify, ConfigError};
use std::io::Read;
use std::sync::Arc;
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
    via: Via,
    base_url: String,
    auth: Option<String>,
}

#[derive(Clone)]
enum Via {
    /// `http://`: the path prefix of the peer's URL (empty, or starting with `/`).
    Plain(Arc<Http1>, String),
    Tls(ureq::Agent),
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
        if rest.contains(['@', '?', '#']) {
            let shown = if rest.contains('@') {
                "(not shown)"
            } else {
                peer
            };
            return Err(ConfigError::new(
                "peer",
                shown,
                "holds a user, a query or a fragment: write http://HOST:PORT (a token goes in --token)",
            ));
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
        let via = match base_url.strip_prefix("http://") {
            Some(rest) => {
                let (authority, prefix) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
                let authority = if authority
                    .rsplit_once(':')
                    .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
                {
                    authority.to_string()
                } else {
                    format!("{authority}:80")
                };
                Via::Plain(
                    Arc::new(Http1::new(&authority, CONNECT_TIMEOUT, IO_TIMEOUT)),
                    prefix.to_string(),
                )
            }
            None => Via::Tls(
                ureq::Agent::config_builder()
                    .http_status_as_error(false)
                    .timeout_connect(Some(CONNECT_TIMEOUT))
                    .timeout_per_read(Some(IO_TIMEOUT))
                    .timeout_per_write(Some(IO_TIMEOUT))
                    .max_idle_connections_per_host(4)
                    .build()
                    .new_agent(),
            ),
        };
        Ok(Client {
            via,
            base_url,
            auth: token.map(|t| format!("Bearer {t}")),
        })
    }

    pub fn peer(&self) -> &str {
        &self.base_url
    }

    fn path(name: &str, tail: &str) -> String {
        format!("/v1/replicas/{name}{tail}")
    }

    /// Send one request; `content_type` goes with a body.
    fn call(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: Body<'_>,
    ) -> Result<Reply, TransportError> {
        let no_reply =
            |e: &dyn std::fmt::Display| TransportError(format!("no reply from the receiver: {e}"));
        match &self.via {
            Via::Plain(http, prefix) => {
                let mut headers = Vec::with_capacity(2);
                if let Some(t) = content_type {
                    headers.push(("Content-Type", t));
                }
                if let Some(a) = &self.auth {
                    headers.push(("Authorization", a.as_str()));
                }
                let r = http
                    .request(method, &format!("{prefix}{path}"), &headers, body)
                    .map_err(|e| no_reply(&e))?;
                reply(r.status, &String::from_utf8_lossy(&r.body))
            }
            Via::Tls(agent) => {
                let url = format!("{}{path}", self.base_url);
                let mut req = ureq::http::Request::builder().method(method).uri(&url);
                if let Some(t) = content_type {
                    req = req.header("content-type", t);
                }
                if let Some(a) = &self.auth {
                    req = req.header("authorization", a.as_str());
                }
                let bad = |e: ureq::http::Error| TransportError(format!("a request to {url}: {e}"));
                let sent = match body {
                    Body::None => agent.run(req.body(()).map_err(bad)?),
                    Body::Bytes(b) => agent.run(req.body(b).map_err(bad)?),
                    Body::Reader(len, r) => agent.run(
                        req.header("content-length", len.to_string())
                            .body(ureq::SendBody::from_reader(r))
                            .map_err(bad)?,
                    ),
                };
                let mut resp = sent.map_err(|e| no_reply(&e))?;
                let status = resp.status().as_u16();
                let text = resp
                    .body_mut()
                    .with_config()
                    .limit(REPLY_BYTES_MAX as u64)
                    .read_to_string()
                    .map_err(|e| {
                        TransportError(format!("the receiver's reply (HTTP {status}) was cut: {e}"))
                    })?;
                reply(status, &text)
            }
        }
    }

    /// Post records.
    pub fn send_txns(
        &self,
        name: &str,
        q: TxnsQuery,
        body: &[u8],
    ) -> Result<Reply, TransportError> {
        let path = Self::path(
            name,
            &format!(
                "/txns?epoch={}&generation={}&page_size={}",
                q.epoch, q.generation, q.page_size
            ),
        );
        self.call(
            "POST",
            &path,
            Some("application/x-ferry-records"),
            Body::Bytes(body),
        )
    }

    /// Stream a base of `len` bytes.
    pub fn send_base(
        &self,
        name: &str,
        q: EpochQuery,
        len: u64,
        body: &mut dyn Read,
    ) -> Result<Reply, TransportError> {
        let path = Self::path(
            name,
            &format!("/base?epoch={}&generation={}", q.epoch, q.generation),
        );
        self.call(
            "POST",
            &path,
            Some("application/x-ferry-base"),
            Body::Reader(len, body),
        )
    }

    /// The receiver's position for `name`: Ok(None) if it has none.
    pub fn position(&self, name: &str) -> Result<Reply, TransportError> {
        self.call("GET", &Self::path(name, ""), None, Body::None)
    }
}

fn reply(status: u16, text: &str) -> Result<Reply, TransportError> {
    if status == 200 {
        let p: Position = serde_json::from_str(text).map_err(|e| {
            TransportError(format!(
                "the receiver's reply is not a position ({e}): {text:.200}"
            ))
        })?;
        return Ok(Reply::Ok(p));
    }
    let refusal = serde_json::from_str::<Refusal>(text).unwrap_or_else(|_| Refusal {
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
        assert!(Client::new("http://[::1]:7350/prefix", None).is_ok());
        for bad in ["http://u:p@h:1", "http://h:1/?x=1", "http://h:1#f"] {
            let e = Client::new(bad, None).err().unwrap();
            assert!(e.reason.contains("HOST:PORT"), "{bad}: {e}");
        }
        let e = Client::new("http://x:1", Some("a b".into())).err().unwrap();
        assert_eq!(e.setting, "token");
        assert!(!e.to_string().contains("a b"), "the token leaked: {e}");
    }
}
