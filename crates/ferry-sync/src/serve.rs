//! The built-in transport, server side (docs/sync.md §8.1): every `ferry sync serve`
//! process answers replicas from the committed outbox, relay or not.
//!
//! 1. A replica authenticates with its own bearer token: its SHA-256 must equal
//!    `replicas.token_hash` for the id in the path (constant-time compare). A wrong token,
//!    an unknown replica or another replica's id is 401 and serves nothing.
//! 2. `GET …/messages` returns up to `max` frames after the replica's position, in order,
//!    each prefixed with its length (u32, big-endian). With none, it waits up to
//!    `wait_ms` for `NOTIFY ferry_sync_outbox` and looks again.
//! 3. `POST …/reports` checks that the report decodes, stores it as the replica's latest
//!    (`ferry_sync.reports`) and wakes the relay (`NOTIFY ferry_sync`). A report over
//!    [`REPORT_BYTES_MAX`] is 413 and one that does not decode 400; neither is stored.
//!
//! Every refusal is JSON, `{"error": "..."}`, saying what was refused and what to do; the
//! replica's client shows it (`client.rs`).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use sqlx::{PgPool, Row};
use tokio::sync::watch;
use uuid::Uuid;

use crate::wire;

/// Frames one fetch returns at most.
pub const FETCH_FRAMES_MAX: usize = 64;
/// The longest a fetch waits for a frame.
pub const FETCH_WAIT_MAX: Duration = Duration::from_secs(30);
/// The largest report a replica may send (`wire`'s limit for an `Up`).
pub const REPORT_BYTES_MAX: usize = 4 * 1024 * 1024;

/// How often a waiting long poll looks at the outbox without a notification.
const LOOK_ANYWAY: Duration = Duration::from_secs(5);

/// The long polls waiting, by replica: each waits on its replica's counter, which a
/// notification naming the replica (or naming none: every replica) bumps. A counter, not
/// a one-shot wake-up, so a notification between a poll's look and its wait is not lost.
#[derive(Default)]
struct Wakes {
    by_replica: std::sync::Mutex<std::collections::HashMap<Uuid, watch::Sender<u64>>>,
}

impl Wakes {
    fn subscribe(&self, id: Uuid) -> watch::Receiver<u64> {
        ferry_core::sync::lock(&self.by_replica)
            .entry(id)
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    /// `payload`: uuids joined by commas (`relay::wake_payload`), or empty for every one.
    fn wake(&self, payload: &str) {
        let mut by_replica = ferry_core::sync::lock(&self.by_replica);
        by_replica.retain(|_, tx| tx.receiver_count() > 0);
        if payload.is_empty() {
            for tx in by_replica.values() {
                tx.send_modify(|n| *n += 1);
            }
            return;
        }
        for id in payload.split(',').filter_map(|s| s.parse::<Uuid>().ok()) {
            if let Some(tx) = by_replica.get(&id) {
                tx.send_modify(|n| *n += 1);
            }
        }
    }
}

/// What the routes share.
#[derive(Clone)]
pub struct Serve {
    pub pool: PgPool,
    /// The long polls waiting, by replica; `NOTIFY ferry_sync_outbox` wakes the ones it
    /// names.
    wakes: Arc<Wakes>,
    /// Extra routes' data: the relay's counters, for /metrics and /status.
    pub stats: Arc<crate::relay::RelayStats>,
    /// Turns true when the process stops: open long polls answer at once (empty), so a
    /// graceful shutdown does not wait out their 30 s.
    pub stopping: Option<watch::Receiver<bool>>,
}

impl Serve {
    /// Listens for outbox notifications on a connection of its own.
    pub async fn new(
        pool: PgPool,
        stats: Arc<crate::relay::RelayStats>,
    ) -> Result<Serve, sqlx::Error> {
        let wakes = Arc::new(Wakes::default());
        let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
        listener.listen("ferry_sync_outbox").await?;
        let weak = Arc::downgrade(&wakes);
        tokio::spawn(async move {
            loop {
                let received = listener.recv().await;
                let Some(wakes) = weak.upgrade() else {
                    return; // every Serve clone is gone
                };
                match received {
                    Ok(n) => wakes.wake(n.payload()),
                    Err(e) => {
                        tracing::warn!(error = %e, "serve: lost the outbox notifications; waking every long poll each second until they are back");
                        wakes.wake("");
                        drop(wakes);
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        });
        Ok(Serve {
            pool,
            wakes,
            stats,
            stopping: None,
        })
    }

    /// Long polls end, empty, once `stop` turns true (see [`Serve::stopping`]).
    pub fn stop_on(mut self, stop: watch::Receiver<bool>) -> Serve {
        self.stopping = Some(stop);
        self
    }

    pub fn router(self) -> Router {
        Router::new()
            .route("/v1/replicas/{id}/messages", get(messages))
            .route("/v1/replicas/{id}/reports", post(reports))
            .route("/metrics", get(metrics))
            .route("/status", get(status))
            .route("/healthz", get(|| async { "ok\n" }))
            .layer(DefaultBodyLimit::max(REPORT_BYTES_MAX))
            .with_state(self)
    }
}

#[derive(Debug, Deserialize)]
pub struct FetchQuery {
    #[serde(default)]
    pub after: u64,
    /// The epoch of the replica's position (hex uuid); another epoch's position means
    /// "from the start".
    #[serde(default)]
    pub epoch: Option<Uuid>,
    #[serde(default = "default_max")]
    pub max: usize,
    #[serde(default)]
    pub wait_ms: u64,
}

fn default_max() -> usize {
    16
}

fn refuse(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

/// Step 1. Whether the id is enrolled at all is not told apart from a wrong token, so a
/// caller without a token learns nothing about which replicas exist.
async fn authorize(serve: &Serve, id: Uuid, headers: &HeaderMap) -> Result<(), Response> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if given.is_empty() {
        return Err(unauthorized(format!(
            "no bearer token for replica {id}: send `Authorization: Bearer TOKEN` with the \
             token `ferry sync enroll --replica {id}` gave it"
        )));
    }
    let stored: Option<Option<Vec<u8>>> =
        sqlx::query_scalar("SELECT token_hash FROM ferry_sync.replicas WHERE id = $1")
            .bind(id)
            .fetch_optional(&serve.pool)
            .await
            .map_err(|e| refuse(StatusCode::SERVICE_UNAVAILABLE, format!("database: {e}")))?;
    let hash = Sha256::digest(given.as_bytes());
    match stored.flatten() {
        Some(h) if constant_time_eq(&h, &hash) => Ok(()),
        _ => Err(unauthorized(format!(
            "wrong bearer token for replica {id}, or no such replica enrolled; nothing was \
             served or stored: use the token `ferry sync enroll --replica {id}` gave this \
             replica (enrolling again replaces it)"
        ))),
    }
}

fn unauthorized(message: String) -> Response {
    let mut response = refuse(StatusCode::UNAUTHORIZED, message);
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    response
}

/// Step 2.
async fn messages(
    State(serve): State<Serve>,
    Path(id): Path<Uuid>,
    Query(q): Query<FetchQuery>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = authorize(&serve, id, &headers).await {
        return r;
    }
    let max = q.max.clamp(1, FETCH_FRAMES_MAX);
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(q.wait_ms).min(FETCH_WAIT_MAX);
    let mut outbox = serve.wakes.subscribe(id);
    let mut stopping = serve.stopping.clone();
    loop {
        outbox.borrow_and_update();
        match frames(&serve.pool, id, &q, max).await {
            Ok(body) if !body.is_empty() => {
                return (
                    [(header::CONTENT_TYPE, "application/x-ferry-sync-frames")],
                    body,
                )
                    .into_response();
            }
            Ok(_) => {}
            Err(e) => return refuse(StatusCode::SERVICE_UNAVAILABLE, format!("database: {e}")),
        }
        // Wake on a notification naming this replica, and look anyway every few seconds
        // in case one was lost (while the listener reconnects, every poll is woken).
        let wait = deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .min(LOOK_ANYWAY);
        if wait.is_zero() || stopping.as_ref().is_some_and(|s| *s.borrow()) {
            return StatusCode::NO_CONTENT.into_response();
        }
        tokio::select! {
            _ = tokio::time::timeout(wait, outbox.changed()) => {}
            _ = async {
                match stopping.as_mut() {
                    Some(s) => drop(s.wait_for(|stop| *stop).await),
                    None => std::future::pending().await,
                }
            } => return StatusCode::NO_CONTENT.into_response(),
        }
    }
}

async fn frames(
    pool: &PgPool,
    id: Uuid,
    q: &FetchQuery,
    max: usize,
) -> Result<Vec<u8>, sqlx::Error> {
    let mut out = Vec::new();
    for frame in frames_after(pool, id, q.epoch, q.after, max).await? {
        out.extend_from_slice(&(frame.len() as u32).to_be_bytes());
        out.extend_from_slice(&frame);
    }
    Ok(out)
}

/// Up to `max` frames of replica `id` after position `after` of `epoch`, in order. A
/// position in another epoch than the current one means "from the start".
pub async fn frames_after(
    pool: &PgPool,
    id: Uuid,
    epoch: Option<Uuid>,
    after: u64,
    max: usize,
) -> Result<Vec<Vec<u8>>, sqlx::Error> {
    let current: Uuid = sqlx::query_scalar("SELECT epoch FROM ferry_sync.meta")
        .fetch_one(pool)
        .await?;
    let after = if epoch == Some(current) {
        after as i64
    } else {
        0
    };
    let rows = sqlx::query(
        "SELECT o.head, b.body FROM ferry_sync.outbox o JOIN ferry_sync.bodies b ON b.hash = o.body_hash
         WHERE o.replica = $1 AND o.seq > $2 ORDER BY o.seq LIMIT $3",
    )
    .bind(id)
    .bind(after)
    .bind(max as i64)
    .fetch_all(pool)
    .await?;
    Ok(rows
        .iter()
        .map(|row| {
            let mut frame: Vec<u8> = row.get(0);
            frame.extend_from_slice(row.get::<&[u8], _>(1));
            frame
        })
        .collect())
}

/// Why a report was not stored.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{0}")]
    Malformed(#[from] wire::Refused),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
}

/// Checks that a report decodes, stores it as replica `id`'s latest, and wakes the relay.
pub async fn store_report(pool: &PgPool, id: Uuid, up: &[u8]) -> Result<(), ReportError> {
    wire::decode_up(up, &wire::Limits::default())?;
    sqlx::query(
        "INSERT INTO ferry_sync.reports (replica, up, received_at) VALUES ($1, $2, now())
         ON CONFLICT (replica) DO UPDATE SET up = excluded.up, received_at = excluded.received_at, n = ferry_sync.reports.n + 1",
    )
    .bind(id)
    .bind(up)
    .execute(pool)
    .await?;
    sqlx::query("SELECT pg_notify('ferry_sync', 'report')")
        .execute(pool)
        .await?;
    Ok(())
}

/// Step 3. The token is checked before the body's size, so a caller without one learns
/// only that.
async fn reports(
    State(serve): State<Serve>,
    Path(id): Path<Uuid>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if let Err(r) = authorize(&serve, id, &headers).await {
        return r;
    }
    let body = match body {
        Ok(body) => body,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the report is over {REPORT_BYTES_MAX} bytes (4 MiB), the most a report \
                     may be; nothing was stored: a ferry replica keeps its reports within \
                     this, so check that the replica runs the same ferry as this server"
                ),
            );
        }
        Err(e) => {
            return refuse(
                e.status(),
                format!("the report could not be read ({e}); nothing was stored: send it again"),
            );
        }
    };
    match store_report(&serve.pool, id, &body).await {
        Ok(()) => {}
        Err(ReportError::Malformed(e)) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!(
                    "the report was not stored: {e}. A ferry replica sends well-formed \
                     reports: check that the replica runs the same ferry as this server, and \
                     that nothing between them changes request bodies"
                ),
            );
        }
        Err(ReportError::Db(e)) => {
            return refuse(StatusCode::SERVICE_UNAVAILABLE, format!("database: {e}"));
        }
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn metrics(State(serve): State<Serve>) -> Response {
    use std::sync::atomic::Ordering::Relaxed;
    let s = &serve.stats;
    let text = format!(
        "# TYPE ferry_sync_relay_holding gauge\nferry_sync_relay_holding {}\n\
         # TYPE ferry_sync_passes_total counter\nferry_sync_passes_total {}\n\
         # TYPE ferry_sync_notes_total counter\nferry_sync_notes_total {}\n\
         # TYPE ferry_sync_messages_total counter\nferry_sync_messages_total {}\n\
         # TYPE ferry_sync_message_bytes_total counter\nferry_sync_message_bytes_total {}\n\
         # TYPE ferry_sync_parked_total counter\nferry_sync_parked_total {}\n\
         # TYPE ferry_sync_pass_errors_total counter\nferry_sync_pass_errors_total {}\n\
         # TYPE ferry_sync_new_epochs_total counter\nferry_sync_new_epochs_total {}\n\
         # TYPE ferry_sync_heals_total counter\nferry_sync_heals_total {}\n",
        s.holding.load(Relaxed) as u8,
        s.passes.load(Relaxed),
        s.notes.load(Relaxed),
        s.messages.load(Relaxed),
        s.bytes.load(Relaxed),
        s.parked.load(Relaxed),
        s.errors.load(Relaxed),
        s.new_epochs.load(Relaxed),
        s.heals.load(Relaxed),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn status(State(serve): State<Serve>) -> Response {
    match crate::status::read(&serve.pool, None).await {
        Ok(s) => Json(s).into_response(),
        Err(e) => refuse(StatusCode::SERVICE_UNAVAILABLE, format!("database: {e}")),
    }
}

/// Compares in time that depends only on the lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff);
    }
    diff == 0
}
