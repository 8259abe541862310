//! The receiver's HTTP face (docs/ship-protocol.md §1): axum routes over a [`Receiver`], which
//! does all the work on blocking threads (SQLite never runs on an async task).

use super::{Receiver, Refused};
use crate::proto::{Code, EpochQuery, ReplicaList, TxnsQuery};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ferry_core::epoch::Epoch;
use futures_util::StreamExt;
use std::io::{self, Read};
use std::sync::Arc;

/// Chunks of a streamed base in flight between the socket and the applying thread:
/// 16 chunks of at most a few hundred KiB keeps memory bounded and the disk busy.
const BASE_CHUNKS_IN_FLIGHT: usize = 16;

/// The router for a receiver.
pub fn router(receiver: Arc<Receiver>) -> Router {
    Router::new()
        .route("/v1/replicas", get(list))
        .route("/v1/replicas/{name}", get(position).delete(delete))
        .route("/v1/replicas/{name}/txns", post(txns))
        .route("/v1/replicas/{name}/base", post(base))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(receiver.clone(), authorize))
        .route("/healthz", get(|| async { "ok\n" }))
        .layer(DefaultBodyLimit::disable())
        .with_state(receiver)
}

/// Serve `receiver` on `listener` until `shutdown` completes; in-flight requests finish.
pub async fn serve(
    receiver: Arc<Receiver>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    axum::serve(listener, router(receiver))
        .with_graceful_shutdown(shutdown)
        .await
}

fn refusal(r: Refused) -> Response {
    let status = StatusCode::from_u16(r.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(r.0)).into_response()
}

async fn authorize(State(r): State<Arc<Receiver>>, req: Request, next: Next) -> Response {
    if let Some(token) = &r.config().token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !constant_time_eq(given.as_bytes(), token.as_bytes()) {
            return refusal(Refused::new(
                Code::Unauthorized,
                "missing or wrong bearer token: the shipper's token must be the receiver's",
            ));
        }
    }
    next.run(req).await
}

/// Compare in time that depends only on the lengths, so the token cannot be guessed byte
/// by byte from response times.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | ((a.len() ^ b.len()) >> 8) as u8;
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff);
    }
    diff == 0
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Refused> + Send + 'static,
) -> Result<T, Refused> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(Refused::new(
            Code::Internal,
            format!("the receiver's worker failed: {e}"),
        ))
    })
}

async fn list(State(r): State<Arc<Receiver>>) -> Response {
    match blocking(move || Ok(r.list())).await {
        Ok(replicas) => Json(ReplicaList { replicas }).into_response(),
        Err(e) => refusal(e),
    }
}

async fn position(State(r): State<Arc<Receiver>>, Path(name): Path<String>) -> Response {
    let n = name.clone();
    match blocking(move || r.position(&n)).await {
        Ok(Some(p)) => Json(p).into_response(),
        Ok(None) => refusal(Refused::new(
            Code::NotFound,
            format!("no replica named {name}"),
        )),
        Err(e) => refusal(e),
    }
}

async fn delete(
    State(r): State<Arc<Receiver>>,
    Path(name): Path<String>,
    q: Result<Query<EpochQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = q else {
        return refusal(Refused::new(Code::BadRequest, "DELETE needs ?epoch=N"));
    };
    match blocking(move || r.delete(&name, Epoch(q.epoch))).await {
        Ok(deleted) => Json(serde_json::json!({ "deleted": deleted })).into_response(),
        Err(e) => refusal(e),
    }
}

async fn txns(
    State(r): State<Arc<Receiver>>,
    Path(name): Path<String>,
    q: Result<Query<TxnsQuery>, axum::extract::rejection::QueryRejection>,
    body: Body,
) -> Response {
    let Ok(Query(q)) = q else {
        return refusal(Refused::new(
            Code::BadRequest,
            "txns needs ?epoch=N&generation=G&page_size=P",
        ));
    };
    let limit = r.config().max_body_bytes as usize;
    let bytes = match read_body(body, limit).await {
        Ok(b) => b,
        Err(BodyRead::TooLarge) => {
            return refusal(Refused::new(
                Code::TooLarge,
                format!(
                    "{name}: the body is over this receiver's limit of {limit} bytes; send smaller batches"
                ),
            ));
        }
        Err(BodyRead::Cut(e)) => {
            return refusal(Refused::new(
                Code::Corrupt,
                format!("{name}: the body could not be read in full ({e}); resend it"),
            ));
        }
    };
    match blocking(move || r.apply_txns(&name, q, &bytes)).await {
        Ok(p) => Json(p).into_response(),
        Err(e) => refusal(e),
    }
}

async fn base(
    State(r): State<Arc<Receiver>>,
    Path(name): Path<String>,
    q: Result<Query<EpochQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let Ok(Query(q)) = q else {
        return refusal(Refused::new(
            Code::BadRequest,
            "base needs ?epoch=N&generation=G",
        ));
    };
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        && let Err(e) = r.check_base_size(&name, len.saturating_sub(72))
    {
        return refusal(e);
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<io::Result<Bytes>>(BASE_CHUNKS_IN_FLIGHT);
    let mut stream = body.into_data_stream();
    tokio::spawn(async move {
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| io::Error::new(io::ErrorKind::UnexpectedEof, e.to_string()));
            let failed = chunk.is_err();
            if tx.send(chunk).await.is_err() || failed {
                break;
            }
        }
    });
    match blocking(move || {
        r.apply_base(
            &name,
            Epoch(q.epoch),
            q.generation,
            &mut ChannelReader {
                rx,
                chunk: Bytes::new(),
            },
        )
    })
    .await
    {
        Ok(p) => Json(p).into_response(),
        Err(e) => refusal(e),
    }
}

async fn status(State(r): State<Arc<Receiver>>) -> Response {
    match blocking(move || Ok(r.status())).await {
        Ok(s) => Json(s).into_response(),
        Err(e) => refusal(e),
    }
}

async fn metrics(State(r): State<Arc<Receiver>>) -> Response {
    match blocking(move || Ok(r.metrics())).await {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
        Err(e) => refusal(e),
    }
}

/// Why a `txns` body was not read.
enum BodyRead {
    TooLarge,
    Cut(axum::Error),
}

/// Read a body of at most `limit` bytes. One over it is read on, and dropped, for up to
/// `DRAIN_BYTES_MAX` more before the 413 goes out: a refusal sent while the client is
/// still writing, and the connection closed with its bytes unread, resets the connection
/// under the client (seen in a test about once in a hundred), which then never reads the
/// 413 that tells it to send smaller batches.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, BodyRead> {
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    let mut over = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(BodyRead::Cut)?;
        if over > 0 || buf.len() + chunk.len() > limit {
            over += chunk.len();
            if over > DRAIN_BYTES_MAX {
                break;
            }
            continue;
        }
        buf.extend_from_slice(&chunk);
    }
    if over > 0 {
        return Err(BodyRead::TooLarge);
    }
    Ok(Bytes::from(buf))
}

/// Bytes of a body over the limit read and dropped before the refusal: a shipper's batch
/// is at most 8 MiB (`BATCH_BYTES_MAX`), so one configured larger than a receiver
/// allows overshoots by about that much; past this the connection is closed anyway.
const DRAIN_BYTES_MAX: usize = 64 << 20;

/// A blocking `Read` over body chunks arriving on a channel.
struct ChannelReader {
    rx: tokio::sync::mpsc::Receiver<io::Result<Bytes>>,
    chunk: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.chunk.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(c)) => self.chunk = c,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len());
        buf[..n].copy_from_slice(&self.chunk[..n]);
        self.chunk = self.chunk.slice(n..);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_must_match_in_length_and_content() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret1"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }
}
