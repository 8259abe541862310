//! The built-in transport, server side (docs/sync-protocol.md §2.1): every `ferry sync serve`
//! process answers replicas from the committed outbox, relay or not.
//!
//! 1. A replica authenticates with its own bearer token: its SHA-256 must equal
//!    `replicas.token_hash` for the id in the path (constant-time compare). A wrong token,
//!    an unknown replica or another replica's id is 401 and serves nothing.
//! 2. `GET …/messages` returns up to `max` frames after the replica's position, in order,
//!    each prefixed with its length (u32, big-endian). With none, it waits up to
//!    `wait_ms` for `NOTIFY ferry_sync_outbox` and looks again. The looks of all the
//!    polls a notification wakes go to Postgres together, one statement for the batch
//!    that also reads each replica's token hash ([`look`]), so a message to 100 replicas
//!    costs one statement, not 300, and its shared body is read once.
//! 3. `POST …/reports` checks that the report decodes, stores it as the replica's latest
//!    (`ferry_sync.reports`) and wakes the relay (`NOTIFY ferry_sync`). A report over
//!    [`REPORT_BYTES_MAX`] is 413 and one that does not decode 400; neither is stored.
//!
//! 4. `POST …/uploads` files an upload from the replica (`file.rs`, docs/sync-up.md §5)
//!    and answers its sealed `Filed`; over [`wire::UPLOAD_BYTES_MAX`] is 413, one that
//!    does not decode or names a table nobody files 400; nothing is filed then.
//!
//! Every refusal is JSON, `{"error": "..."}`, saying what was refused and what to do; the
//! replica's client shows it (`client.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
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
use tokio::sync::{oneshot, watch};
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

/// How long a replica's slot outlives its last long poll; a replica polls again well
/// within this, so what its slot knows (below) survives between polls.
const SLOT_IDLE_MAX: Duration = Duration::from_secs(60);

/// The long polls waiting, by replica: each waits on its replica's counter, which a
/// notification naming the replica (or naming none: every replica) bumps. A counter, not
/// a one-shot wake-up, so a notification between a poll's look and its wait is not lost.
#[derive(Default)]
struct Wakes {
    slots: std::sync::Mutex<Slots>,
}

#[derive(Default)]
struct Slots {
    by_replica: std::collections::HashMap<Uuid, Slot>,
    pruned_at: Option<std::time::Instant>,
}

struct Slot {
    wakes: watch::Sender<u64>,
    used_at: std::time::Instant,
    known: Option<Known>,
}

/// What the replica's last look found: nothing after `(epoch, after)`, as of wake count
/// `wakes` (read before that look). While the count stands, no pass has recorded a message
/// for the replica since that look's snapshot (its notification would have bumped the
/// count), so a poll from that position need not look before it waits: at 100 replicas
/// this halves the looks, since each poll after an apply would otherwise find nothing.
struct Known {
    epoch: Uuid,
    after: u64,
    wakes: u64,
    /// The token hash the look read: a skipped look still checks the token.
    token_hash: Vec<u8>,
}

impl Wakes {
    fn subscribe(&self, id: Uuid) -> watch::Receiver<u64> {
        let mut slots = ferry_core::sync::lock(&self.slots);
        let slot = slots.by_replica.entry(id).or_insert_with(|| Slot {
            wakes: watch::channel(0).0,
            used_at: std::time::Instant::now(),
            known: None,
        });
        slot.used_at = std::time::Instant::now();
        slot.wakes.subscribe()
    }

    /// Whether a look for `ask` would find nothing, as of wake count `wakes`, by a token
    /// hashing to `given`.
    fn nothing_for(&self, ask: &Ask, wakes: u64, given: &[u8]) -> bool {
        let slots = ferry_core::sync::lock(&self.slots);
        slots
            .by_replica
            .get(&ask.replica)
            .and_then(|slot| slot.known.as_ref())
            .is_some_and(|k| {
                ask.epoch == Some(k.epoch)
                    && ask.after == k.after
                    && wakes == k.wakes
                    && constant_time_eq(&k.token_hash, given)
            })
    }

    fn learn(&self, id: Uuid, known: Option<Known>) {
        if let Some(slot) = ferry_core::sync::lock(&self.slots).by_replica.get_mut(&id) {
            slot.known = known;
        }
    }

    /// `payload`: uuids joined by commas (`relay::wake_payload`), or empty for every one.
    fn wake(&self, payload: &str) {
        let mut slots = ferry_core::sync::lock(&self.slots);
        let now = std::time::Instant::now();
        if slots
            .pruned_at
            .is_none_or(|at| now.duration_since(at) >= SLOT_IDLE_MAX / 6)
        {
            slots.by_replica.retain(|_, slot| {
                slot.wakes.receiver_count() > 0 || now.duration_since(slot.used_at) < SLOT_IDLE_MAX
            });
            slots.pruned_at = Some(now);
        }
        if payload.is_empty() {
            for slot in slots.by_replica.values() {
                slot.wakes.send_modify(|n| *n += 1);
            }
            return;
        }
        for id in payload.split(',').filter_map(|s| s.parse::<Uuid>().ok()) {
            if let Some(slot) = slots.by_replica.get(&id) {
                slot.wakes.send_modify(|n| *n += 1);
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
    /// Takes the long polls' looks at the outbox together.
    fetcher: Arc<Fetcher>,
    /// Extra routes' data: the relay's counters, for /metrics and /status.
    pub stats: Arc<crate::relay::RelayStats>,
    /// Turns true when the process stops: open long polls answer at once (empty), so a
    /// graceful shutdown does not wait out their 30 s.
    pub stopping: Option<watch::Receiver<bool>>,
    /// The tables replicas write, and how filing's transaction is shaped (step 4).
    records: Arc<Vec<crate::file::RecordSpec>>,
    shape: Arc<crate::file::Shape>,
    /// Tokens checked lately: replica → (SHA-256 of the token, seal key, when checked).
    checked: Arc<std::sync::Mutex<HashMap<Uuid, Checked>>>,
    /// The NATS bridge's counters, on /metrics (zero when there is no bridge).
    nats: Arc<crate::nats::bridge::BridgeStats>,
}

/// A token that matched the replica's hash, and when: good for [`CHECKED_FOR`].
struct Checked {
    token_sha: [u8; 32],
    seal_key: Vec<u8>,
    at: std::time::Instant,
}

/// How long a token that matched is taken without asking the database again. Every
/// request (a long poll each wait, an upload each write) would otherwise cost a query;
/// a token `ferry sync enroll` replaced stops working within this.
pub const CHECKED_FOR: Duration = Duration::from_secs(5);

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
            fetcher: Arc::new(Fetcher::start(pool.clone())),
            pool,
            wakes,
            stats,
            stopping: None,
            records: Arc::default(),
            shape: Arc::default(),
            checked: Arc::default(),
            nats: Arc::default(),
        })
    }

    /// Files uploads into `records` (the rules' record tables), in transactions shaped by
    /// `shape`. Without it, every upload is refused as naming a table nobody files.
    pub fn file_into(
        mut self,
        records: Vec<crate::file::RecordSpec>,
        shape: crate::file::Shape,
    ) -> Serve {
        self.records = Arc::new(records);
        self.shape = Arc::new(shape);
        self
    }

    /// The counters a NATS bridge of this process counts into, served on /metrics.
    pub fn nats_stats(&self) -> Arc<crate::nats::bridge::BridgeStats> {
        self.nats.clone()
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
            .route("/v1/replicas/{id}/uploads", post(uploads))
            .route("/metrics", get(metrics))
            .route("/status", get(status))
            .route("/", get(status_page))
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

/// Step 1: the bearer token the request carries (no database needed to refuse none).
fn bearer(headers: &HeaderMap) -> Option<String> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .filter(|given| !given.is_empty())
        .map(str::to_string)
}

fn no_token(id: Uuid) -> Response {
    unauthorized(format!(
        "no bearer token for replica {id}: send `Authorization: Bearer TOKEN` with the \
         token `ferry sync enroll --replica {id}` gave it"
    ))
}

/// Whether the given token's hash is the stored one (`None`: no such replica).
fn token_matches(stored: Option<&[u8]>, given: &[u8]) -> bool {
    stored.is_some_and(|h| constant_time_eq(h, given))
}

/// Whether the id is enrolled at all is not told apart from a wrong token, so a caller
/// without a token learns nothing about which replicas exist.
fn wrong_token(id: Uuid) -> Response {
    unauthorized(format!(
        "wrong bearer token for replica {id}, or no such replica enrolled; nothing was \
         served or stored: use the token `ferry sync enroll --replica {id}` gave this \
         replica (enrolling again replaces it)"
    ))
}

/// Step 1 for a report or an upload: the token against the replica's row. Answers the
/// replica's seal key (`Filed` is sealed with it).
async fn authorize(serve: &Serve, id: Uuid, headers: &HeaderMap) -> Result<Vec<u8>, Response> {
    let given = bearer(headers).ok_or_else(|| no_token(id))?;
    match serve.check_token(id, &given).await {
        Ok(seal_key) => Ok(seal_key),
        Err(TokenRefused::Wrong) => Err(wrong_token(id)),
        Err(TokenRefused::Db(e)) => Err(refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("database: {e}"),
        )),
    }
}

/// Why a replica's token was not taken.
#[derive(Debug)]
pub(crate) enum TokenRefused {
    /// Not the replica's token, or no such replica enrolled (not told apart).
    Wrong,
    /// The database did not answer: try again.
    Db(sqlx::Error),
}

impl Serve {
    /// Replica `id`'s seal key if `given` is its token: a token that matched within
    /// [`CHECKED_FOR`] is taken without reading the database again.
    pub(crate) async fn check_token(&self, id: Uuid, given: &str) -> Result<Vec<u8>, TokenRefused> {
        let sha: [u8; 32] = Sha256::digest(given.as_bytes()).into();
        {
            let checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = checked.get(&id)
                && c.at.elapsed() < CHECKED_FOR
                && constant_time_eq(&c.token_sha, &sha)
            {
                return Ok(c.seal_key.clone());
            }
        }
        let stored =
            sqlx::query("SELECT token_hash, seal_key FROM ferry_sync.replicas WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await
                .map_err(TokenRefused::Db)?;
        let (token_hash, seal_key): (Option<Vec<u8>>, Option<Vec<u8>>) = stored
            .map(|row| (row.get(0), row.get(1)))
            .unwrap_or_default();
        let mut checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
        if token_matches(token_hash.as_deref(), &sha) {
            let seal_key = seal_key.unwrap_or_default();
            checked.retain(|_, c| c.at.elapsed() < CHECKED_FOR);
            checked.insert(
                id,
                Checked {
                    token_sha: sha,
                    seal_key: seal_key.clone(),
                    at: std::time::Instant::now(),
                },
            );
            Ok(seal_key)
        } else {
            checked.remove(&id);
            Err(TokenRefused::Wrong)
        }
    }

    /// The tables replicas write, and how filing's transaction is shaped.
    pub(crate) fn filing(&self) -> (&[crate::file::RecordSpec], &crate::file::Shape) {
        (&self.records, &self.shape)
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
    let Some(given) = bearer(&headers) else {
        return no_token(id);
    };
    let ask = Ask {
        replica: id,
        epoch: q.epoch,
        after: q.after,
        max: q.max.clamp(1, FETCH_FRAMES_MAX),
    };
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(q.wait_ms).min(FETCH_WAIT_MAX);
    let given = Sha256::digest(given.as_bytes()).to_vec();
    let mut outbox = serve.wakes.subscribe(id);
    let mut stopping = serve.stopping.clone();
    let mut first = true;
    loop {
        let wakes = *outbox.borrow_and_update();
        if first && serve.wakes.nothing_for(&ask, wakes, &given) {
            serve.fetcher.counts.skipped.fetch_add(1, Relaxed);
        } else {
            // The token is checked on every look, against the row the frames were read
            // with, so enrolling the replica again refuses its old token at the next look.
            let found = match serve.fetcher.fetch(ask.clone()).await {
                Ok(found) => found,
                Err(e) => {
                    return refuse(StatusCode::SERVICE_UNAVAILABLE, format!("database: {e}"));
                }
            };
            if !token_matches(found.token_hash.as_deref(), &given) {
                serve.wakes.learn(id, None);
                return wrong_token(id);
            }
            let known = |after| Known {
                epoch: found.epoch,
                after,
                wakes,
                token_hash: given.clone(),
            };
            let end = match found.last_seq {
                Some(seq) if !found.cut && found.frames.len() < ask.max => Some(known(seq)),
                None if ask.epoch == Some(found.epoch) => Some(known(ask.after)),
                _ => None,
            };
            serve.wakes.learn(id, end);
            if !found.frames.is_empty() {
                let mut body = Vec::with_capacity(found.frames.iter().map(|f| f.len() + 4).sum());
                for frame in &found.frames {
                    body.extend_from_slice(&(frame.len() as u32).to_be_bytes());
                    body.extend_from_slice(frame);
                }
                return (
                    [(header::CONTENT_TYPE, "application/x-ferry-sync-frames")],
                    body,
                )
                    .into_response();
            }
        }
        first = false;
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

/// One replica's look at the outbox: up to `max` frames after position `after` of
/// `epoch`. A position in another epoch than the current one means "from the start".
#[derive(Clone, Debug)]
pub struct Ask {
    pub replica: Uuid,
    pub epoch: Option<Uuid>,
    pub after: u64,
    pub max: usize,
}

/// What one look found.
#[derive(Debug, Default)]
pub struct Found {
    /// The replica's `token_hash` as the frames were read; `None`: not enrolled.
    pub token_hash: Option<Vec<u8>>,
    /// Its frames (head then body), in chain order.
    pub frames: Vec<Vec<u8>>,
    /// The seq of the last frame.
    pub last_seq: Option<u64>,
    /// The answer stopped early at [`FETCH_ANSWER_BYTES_MAX`]: more frames follow.
    pub cut: bool,
    /// The installation's epoch as the frames were read.
    pub epoch: Uuid,
}

/// Bytes of frames one answer carries before it stops early (at least one frame goes):
/// what `client.rs` reads at most, less room.
pub const FETCH_ANSWER_BYTES_MAX: usize = 64 << 20;

/// Looks a batch of replicas take at once: a body shared by all of them (a broadcast
/// change) is read once per batch, and the statement's fixed cost is paid once.
const ASKS_PER_BATCH: usize = 128;
/// Batches read at once per serve process; further looks queue and go in the next one.
const BATCHES_AT_ONCE: usize = 2;

/// Takes the looks of every waiting long poll together: at 100 replicas, a message to
/// each is one statement for all of them instead of three per replica.
struct Fetcher {
    asks: tokio::sync::mpsc::UnboundedSender<(Ask, oneshot::Sender<Result<Found, sqlx::Error>>)>,
    counts: Arc<LookCounts>,
}

/// For /metrics: looks taken, the statements that took them, and looks a poll skipped
/// because its slot knew they would find nothing.
#[derive(Default)]
struct LookCounts {
    looks: AtomicU64,
    batches: AtomicU64,
    skipped: AtomicU64,
}

impl Fetcher {
    fn start(pool: PgPool) -> Fetcher {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(
            Ask,
            oneshot::Sender<Result<Found, sqlx::Error>>,
        )>();
        let permits = Arc::new(tokio::sync::Semaphore::new(BATCHES_AT_ONCE));
        let counts = Arc::new(LookCounts::default());
        let counting = counts.clone();
        tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let Some(first) = rx.recv().await else {
                    return; // every Serve clone is gone
                };
                // The polls one notification wakes send their looks within this turn of
                // the scheduler: let them, then take them all.
                tokio::task::yield_now().await;
                let mut batch = vec![first];
                while batch.len() < ASKS_PER_BATCH {
                    match rx.try_recv() {
                        Ok(next) => batch.push(next),
                        Err(_) => break,
                    }
                }
                counting.batches.fetch_add(1, Relaxed);
                counting.looks.fetch_add(batch.len() as u64, Relaxed);
                let pool = pool.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    let (asks, replies): (Vec<Ask>, Vec<_>) = batch.into_iter().unzip();
                    match look(&pool, &asks).await {
                        Ok(found) => {
                            for (reply, found) in replies.into_iter().zip(found) {
                                let _ = reply.send(Ok(found)); // the poll may have ended
                            }
                        }
                        Err(e) => {
                            let message = e.to_string();
                            for reply in replies {
                                let _ = reply.send(Err(sqlx::Error::Protocol(message.clone())));
                            }
                        }
                    }
                });
            }
        });
        Fetcher { asks: tx, counts }
    }

    async fn fetch(&self, ask: Ask) -> Result<Found, sqlx::Error> {
        let (tx, rx) = oneshot::channel();
        self.asks
            .send((ask, tx))
            .map_err(|_| sqlx::Error::PoolClosed)?;
        rx.await.map_err(|_| sqlx::Error::PoolClosed)?
    }
}

/// Every ask's frames and token hash, in one statement (one snapshot): the current epoch,
/// each replica's row and its next frames; a body several frames share comes once.
pub async fn look(pool: &PgPool, asks: &[Ask]) -> Result<Vec<Found>, sqlx::Error> {
    let ids: Vec<Uuid> = asks.iter().map(|a| a.replica).collect();
    // The nil uuid is never an epoch (epochs are random), so it reads as "from the start".
    let epochs: Vec<Uuid> = asks
        .iter()
        .map(|a| a.epoch.unwrap_or(Uuid::nil()))
        .collect();
    let afters: Vec<i64> = asks
        .iter()
        .map(|a| i64::try_from(a.after).unwrap_or(i64::MAX))
        .collect();
    let maxes: Vec<i32> = asks
        .iter()
        .map(|a| a.max.min(FETCH_FRAMES_MAX) as i32)
        .collect();
    // A custom plan for this statement cost 350 µs a batch, more than running it, and
    // the plan does not depend on the arrays' contents: a generic one, and no JIT. Set
    // for this transaction only, so a pooler's other clients never see them.
    let mut tx = pool.begin().await?;
    sqlx::raw_sql("SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL jit = off")
        .execute(&mut *tx)
        .await?;
    // The epoch is a scalar subquery, not a join with `meta`: the planner's guess for an
    // unanalyzed one-row table (hundreds of rows) once priced this statement past
    // `jit_above_cost`, and compiling it cost 240 ms a batch.
    let rows = sqlx::query(
        "SELECT q.i, r.token_hash, o.seq, o.head, o.body_hash,
                CASE WHEN row_number() OVER (PARTITION BY o.body_hash ORDER BY q.i, o.seq) = 1
                     THEN o.body END AS body,
                (SELECT epoch FROM ferry_sync.meta)
         FROM unnest($1::uuid[], $2::uuid[], $3::int8[], $4::int4[])
                  WITH ORDINALITY AS q(replica, epoch, after, max, i)
         LEFT JOIN ferry_sync.replicas r ON r.id = q.replica
         LEFT JOIN LATERAL (
             SELECT o.seq, o.head, o.body_hash, b.body
             FROM ferry_sync.outbox o
             -- One copy of the body: each relay shard keeps its own (docs/sync-scale.md §2).
             JOIN LATERAL (SELECT body FROM ferry_sync.bodies WHERE hash = o.body_hash LIMIT 1) b ON true
             WHERE o.replica = q.replica
               AND o.seq > CASE WHEN q.epoch = (SELECT epoch FROM ferry_sync.meta)
                                THEN q.after ELSE 0 END
             ORDER BY o.seq LIMIT q.max) o ON true
         ORDER BY q.i, o.seq",
    )
    .bind(&ids)
    .bind(&epochs)
    .bind(&afters)
    .bind(&maxes)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    let mut found: Vec<Found> = asks.iter().map(|_| Found::default()).collect();
    let mut bytes = vec![0usize; asks.len()];
    let mut bodies: std::collections::HashMap<Vec<u8>, Vec<u8>> = Default::default();
    for row in &rows {
        let i = usize::try_from(row.get::<i64, _>(0) - 1).expect("ordinality starts at 1");
        let f = &mut found[i];
        f.token_hash = row.get(1);
        f.epoch = row.get(6);
        let Some(mut frame) = row.get::<Option<Vec<u8>>, _>(3) else {
            continue; // no frames for this ask
        };
        if f.cut {
            continue;
        }
        let hash: Vec<u8> = row.get(4);
        let body: Option<Vec<u8>> = row.get(5);
        let body: &[u8] = match body {
            Some(body) => bodies.entry(hash).or_insert(body),
            None => bodies
                .get(&hash)
                .expect("a shared body comes with its first frame"),
        };
        if !f.frames.is_empty() && bytes[i] + frame.len() + body.len() > FETCH_ANSWER_BYTES_MAX {
            f.cut = true;
            continue;
        }
        frame.extend_from_slice(body);
        bytes[i] += frame.len();
        f.frames.push(frame);
        f.last_seq = Some(row.get::<i64, _>(2) as u64);
    }
    Ok(found)
}

/// Up to `max` frames of replica `id` after position `after` of `epoch`, in order: one
/// [`look`], for callers that carry frames their own way (the tests' loopback).
pub async fn frames_after(
    pool: &PgPool,
    id: Uuid,
    epoch: Option<Uuid>,
    after: u64,
    max: usize,
) -> Result<Vec<Vec<u8>>, sqlx::Error> {
    let ask = Ask {
        replica: id,
        epoch,
        after,
        max,
    };
    Ok(look(pool, &[ask]).await?.pop().unwrap_or_default().frames)
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
    let decoded = wire::decode_up(up, &wire::Limits::default())?;
    // What the relay must act on soon (a replica with nothing applied, to provision; a
    // gap, to heal; rejections) wakes it at once; mere confirmations are gathered.
    let urgent = decoded.applied.is_none() || decoded.gap != 0 || !decoded.rejections.is_empty();
    sqlx::query(
        "INSERT INTO ferry_sync.reports (replica, up, received_at) VALUES ($1, $2, now())
         ON CONFLICT (replica) DO UPDATE SET up = excluded.up, received_at = excluded.received_at, n = ferry_sync.reports.n + 1",
    )
    .bind(id)
    .bind(up)
    .execute(pool)
    .await?;
    sqlx::query("SELECT pg_notify('ferry_sync', $1)")
        .bind(if urgent { "report-now" } else { "report" })
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

/// Step 4: an upload, filed (`file.rs`) under the replica the token names; the answer is
/// its sealed `Filed`. The token is checked before the body's size.
async fn uploads(
    State(serve): State<Serve>,
    Path(id): Path<Uuid>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let seal_key = match authorize(&serve, id, &headers).await {
        Ok(key) => key,
        Err(r) => return r,
    };
    let too_large = || {
        refuse(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the upload is over {} bytes, the most an upload may be; nothing was filed: \
                 a ferry replica keeps its uploads within this, so check that the replica \
                 runs the same ferry as this server",
                wire::UPLOAD_BYTES_MAX
            ),
        )
    };
    let body = match body {
        Ok(body) if body.len() > wire::UPLOAD_BYTES_MAX => return too_large(),
        Ok(body) => body,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => return too_large(),
        Err(e) => {
            return refuse(
                e.status(),
                format!("the upload could not be read ({e}); nothing was filed: send it again"),
            );
        }
    };
    let upload = match wire::decode_upload(&body) {
        Ok(upload) => upload,
        Err(e) => {
            return refuse(
                StatusCode::BAD_REQUEST,
                format!(
                    "the upload was not filed: {e}. A ferry replica sends well-formed uploads: \
                     check that the replica runs the same ferry as this server, and that \
                     nothing between them changes request bodies"
                ),
            );
        }
    };
    let Ok(seal_key) = <[u8; 32]>::try_from(seal_key.as_slice()) else {
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "replica {id} has no seal key; enroll it again with `ferry sync enroll --replica {id}`"
            ),
        );
    };
    match crate::file::file(&serve.pool, &serve.records, &serve.shape, id, &upload).await {
        Ok(crate::file::Outcome::Filed(filed)) => (
            [(header::CONTENT_TYPE, "application/x-ferry-sync-filed")],
            wire::encode_filed(&filed, &seal_key, id.as_bytes()),
        )
            .into_response(),
        Ok(crate::file::Outcome::Malformed(message)) => refuse(
            StatusCode::BAD_REQUEST,
            format!("the upload was not filed: {message}"),
        ),
        Err(e) => refuse(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn metrics(State(serve): State<Serve>) -> Response {
    let s = &serve.stats;
    let looks = &serve.fetcher.counts;
    let text = format!(
        "# HELP ferry_sync_relay_holding Whether this serve's relay holds its shard's lock (1) or stands by.\n\
         # TYPE ferry_sync_relay_holding gauge\nferry_sync_relay_holding{{shard=\"{}\"}} {}\n\
         # TYPE ferry_sync_passes_total counter\nferry_sync_passes_total {}\n\
         # TYPE ferry_sync_notes_total counter\nferry_sync_notes_total {}\n\
         # TYPE ferry_sync_messages_total counter\nferry_sync_messages_total {}\n\
         # TYPE ferry_sync_message_bytes_total counter\nferry_sync_message_bytes_total {}\n\
         # TYPE ferry_sync_parked_total counter\nferry_sync_parked_total {}\n\
         # TYPE ferry_sync_pass_errors_total counter\nferry_sync_pass_errors_total {}\n\
         # TYPE ferry_sync_new_epochs_total counter\nferry_sync_new_epochs_total {}\n\
         # TYPE ferry_sync_heals_total counter\nferry_sync_heals_total {}\n\
         # HELP ferry_sync_serve_looks_total Long polls' looks at the outbox.\n\
         # TYPE ferry_sync_serve_looks_total counter\nferry_sync_serve_looks_total {}\n\
         # HELP ferry_sync_serve_look_statements_total Statements those looks took, batched.\n\
         # TYPE ferry_sync_serve_look_statements_total counter\nferry_sync_serve_look_statements_total {}\n\
         # HELP ferry_sync_serve_looks_skipped_total Looks skipped: the poll's position was known to be the newest.\n\
         # TYPE ferry_sync_serve_looks_skipped_total counter\nferry_sync_serve_looks_skipped_total {}\n",
        s.shard.load(Relaxed),
        s.holding.load(Relaxed) as u8,
        s.passes.load(Relaxed),
        s.notes.load(Relaxed),
        s.messages.load(Relaxed),
        s.bytes.load(Relaxed),
        s.parked.load(Relaxed),
        s.errors.load(Relaxed),
        s.new_epochs.load(Relaxed),
        s.heals.load(Relaxed),
        looks.looks.load(Relaxed),
        looks.batches.load(Relaxed),
        looks.skipped.load(Relaxed),
    );
    let text = text + &serve.nats.render();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

#[derive(Debug, Deserialize)]
struct StatusQuery {
    /// Only this partition's replicas, as `ferry sync status --partition`.
    partition: Option<String>,
}

/// The status document (docs/sync.md §12), version [`crate::status::STATUS_VERSION`].
async fn status(State(serve): State<Serve>, Query(q): Query<StatusQuery>) -> Response {
    match crate::status::read(&serve.pool, q.partition.as_deref()).await {
        Ok(s) => Json(s).into_response(),
        Err(e) => refuse(StatusCode::SERVICE_UNAVAILABLE, format!("database: {e}")),
    }
}

/// The status page for people: one static page that reads the status document with its
/// own query (`/?partition=north`) every two seconds.
async fn status_page() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("status_page.html"),
    )
        .into_response()
}

/// Compares in time that depends only on the lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff);
    }
    diff == 0
}
