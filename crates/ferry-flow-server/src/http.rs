//! The server's HTTP/JSON API (docs/flow-server.md §10), for other languages and the
//! CLI: starts, signals, cancels and queries go to the run's holder as calls (§9);
//! list, show and result answer from the server's index of durable records, with or
//! without workers.

use crate::index::RunSummary;
use crate::server::Server;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use ferry_flow::remote::proto::{Call, CallKind, Outcome, Refused};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::{Arc, Weak};

/// The most a list answers at once.
pub const LIST_MAX: usize = 1000;

/// The API's routes under `/v1`, for `server` (held weakly: a request after the server
/// stopped is answered 503).
pub fn router(server: &Arc<Server>) -> Router {
    let body_max = server.record_max() as usize + 4096;
    Router::new()
        .route("/v1/runs", post(start).get(list))
        .route("/v1/runs/{id}", get(show))
        .route("/v1/runs/{id}/signals/{name}", post(signal))
        .route("/v1/runs/{id}/cancel", post(cancel))
        .route("/v1/runs/{id}/query", get(query))
        .route("/v1/runs/{id}/result", get(result))
        .layer(axum::extract::DefaultBodyLimit::max(body_max))
        .with_state(Arc::downgrade(server))
}

type Api = State<Weak<Server>>;

/// An answer that is not a success: `{"error", "kind"}` with its status.
struct Failure {
    status: StatusCode,
    kind: String,
    message: String,
    retry_after_s: Option<u32>,
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let body = Json(json!({ "error": self.message, "kind": self.kind }));
        let mut r = (self.status, body).into_response();
        if let Some(s) = self.retry_after_s {
            r.headers_mut()
                .insert(header::RETRY_AFTER, s.to_string().parse().expect("digits"));
        }
        r
    }
}

fn failure(status: StatusCode, kind: &str, message: impl Into<String>) -> Failure {
    Failure {
        status,
        kind: kind.into(),
        message: message.into(),
        retry_after_s: None,
    }
}

/// The server, if the request may use it: running, and the bearer token one of its
/// tokens (when it has any).
fn open(api: &Weak<Server>, headers: &HeaderMap) -> Result<Arc<Server>, Failure> {
    let server = api.upgrade().ok_or_else(|| Failure {
        retry_after_s: Some(1),
        ..failure(
            StatusCode::SERVICE_UNAVAILABLE,
            "server",
            "the server is stopping",
        )
    })?;
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if !server.authorized(token) {
        return Err(failure(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a bearer token the server knows is needed: Authorization: Bearer <token>",
        ));
    }
    Ok(server)
}

/// A call's answer as a response: its JSON, or its error with the status of its class.
async fn answer(server: Arc<Server>, kind: CallKind, key: String) -> Result<Json<Value>, Failure> {
    let answer = server.call(Call { kind, key });
    drop(server);
    match answer.await {
        Ok(Outcome::Ok(bytes)) => serde_json::from_slice(&bytes).map(Json).map_err(|e| {
            failure(
                StatusCode::BAD_GATEWAY,
                "codec",
                format!("the worker's answer is not JSON: {e}"),
            )
        }),
        Ok(Outcome::Err { kind, message }) => {
            let status = match kind.as_str() {
                "unknown_run" => StatusCode::NOT_FOUND,
                "invalid" | "codec" => StatusCode::BAD_REQUEST,
                "run_finished" => StatusCode::CONFLICT,
                "limit_exceeded" => StatusCode::PAYLOAD_TOO_LARGE,
                "not_held" | "stopped" | "log" => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            Err(failure(status, &kind, message))
        }
        Err(r) => Err(refusal(r)),
    }
}

fn refusal(r: Refused) -> Failure {
    let (status, kind, retry) = match &r {
        Refused::NoHolder { .. } => (StatusCode::SERVICE_UNAVAILABLE, "no_holder", Some(1)),
        Refused::Unavailable { retry_after_ms } => (
            StatusCode::SERVICE_UNAVAILABLE,
            "server",
            Some(retry_after_ms.div_ceil(1000)),
        ),
        Refused::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "too_large", None),
        _ => (StatusCode::BAD_REQUEST, "refused", None),
    };
    Failure {
        retry_after_s: retry,
        ..failure(status, kind, r.to_string())
    }
}

fn bad_request(message: impl Into<String>) -> Failure {
    failure(StatusCode::BAD_REQUEST, "invalid", message)
}

/// A JSON body, or a clear refusal naming what is wrong.
fn body<T: serde::de::DeserializeOwned>(bytes: &[u8], shape: &str) -> Result<T, Failure> {
    serde_json::from_slice(bytes)
        .map_err(|e| bad_request(format!("the body must be JSON {shape}: {e}")))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StartBody {
    workflow: String,
    id: String,
    #[serde(default)]
    input: Value,
}

async fn start(State(api): Api, headers: HeaderMap, bytes: axum::body::Bytes) -> Response {
    let run = async {
        let server = open(&api, &headers)?;
        let b: StartBody = body(&bytes, r#"{"workflow", "id", "input"}"#)?;
        let kind = CallKind::Start {
            workflow: b.workflow,
            input: serde_json::to_vec(&b.input).expect("JSON serializes"),
            id: b.id.clone(),
        };
        answer(server, kind, b.id).await
    };
    run.await.into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SignalBody {
    #[serde(default)]
    value: Value,
}

async fn signal(
    State(api): Api,
    Path((id, name)): Path<(String, String)>,
    headers: HeaderMap,
    bytes: axum::body::Bytes,
) -> Response {
    let run = async {
        let server = open(&api, &headers)?;
        let b: SignalBody = if bytes.is_empty() {
            SignalBody { value: Value::Null }
        } else {
            body(&bytes, r#"{"value"}"#)?
        };
        let key = match headers.get("idempotency-key") {
            Some(k) => k
                .to_str()
                .map_err(|_| bad_request("the Idempotency-Key header must be text"))?
                .to_string(),
            None => fresh_key(),
        };
        let kind = CallKind::Signal {
            id,
            name,
            value: serde_json::to_vec(&b.value).expect("JSON serializes"),
        };
        answer(server, kind, key).await.map(|_| Json(json!({})))
    };
    run.await.into_response()
}

async fn cancel(State(api): Api, Path(id): Path<String>, headers: HeaderMap) -> Response {
    let run = async {
        let server = open(&api, &headers)?;
        let cancelled = answer(server, CallKind::Cancel { id }, fresh_key()).await?;
        Ok::<_, Failure>(Json(json!({ "cancelled": cancelled.0 })))
    };
    run.await.into_response()
}

async fn query(State(api): Api, Path(id): Path<String>, headers: HeaderMap) -> Response {
    let run = async {
        let server = open(&api, &headers)?;
        let published = answer(server, CallKind::Query { id }, String::new()).await?;
        Ok::<_, Failure>(Json(json!({ "published": published.0 })))
    };
    run.await.into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ResultParams {
    #[serde(default)]
    wait_ms: u32,
}

async fn result(
    State(api): Api,
    Path(id): Path<String>,
    params: Result<Query<ResultParams>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let run = async {
        let server = open(&api, &headers)?;
        let Query(p) = params.map_err(|e| bad_request(format!("?wait_ms=MILLISECONDS: {e}")))?;
        answer(
            server,
            CallKind::Result {
                id,
                wait_ms: p.wait_ms,
            },
            String::new(),
        )
        .await
    };
    run.await.into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListParams {
    state: Option<String>,
    after: Option<String>,
    limit: Option<usize>,
}

const STATES: [&str; 5] = ["running", "finished", "failed", "cancelled", "parked"];

async fn list(
    State(api): Api,
    params: Result<Query<ListParams>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Response {
    let run = async {
        let server = open(&api, &headers)?;
        let Query(p) =
            params.map_err(|e| bad_request(format!("?state=S&after=ID&limit=N: {e}")))?;
        if let Some(s) = &p.state
            && !STATES.contains(&s.as_str())
        {
            return Err(bad_request(format!(
                "state {s:?} is not one of {}",
                STATES.join(", ")
            )));
        }
        let limit = p.limit.unwrap_or(LIST_MAX).clamp(1, LIST_MAX);
        let runs: Vec<RunSummary> = server.runs(p.state.as_deref(), p.after.as_deref(), limit);
        // Where the next page starts, if this one is full.
        let next = (runs.len() == limit).then(|| runs[runs.len() - 1].id.clone());
        Ok(Json(json!({ "runs": runs, "next": next })))
    };
    run.await.into_response()
}

async fn show(State(api): Api, Path(id): Path<String>, headers: HeaderMap) -> Response {
    let run = async {
        let server = open(&api, &headers)?;
        match server.run(&id) {
            Some(r) => Ok(Json(serde_json::to_value(r).expect("a summary serializes"))),
            None => Err(failure(
                StatusCode::NOT_FOUND,
                "unknown_run",
                format!("no run {id:?}: it was never started (durably) on this server"),
            )),
        }
    };
    run.await.into_response()
}

/// A key for a signal or cancel the caller gave none for: a call the server sends again
/// (its holder changed) is still delivered once.
fn fresh_key() -> String {
    use ferry_core::seams::{Rng, SplitMix64};
    let mut r = SplitMix64::from_entropy();
    format!("http/{:016x}{:016x}", r.next_u64(), r.next_u64())
}
