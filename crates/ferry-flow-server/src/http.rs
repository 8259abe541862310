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
use ferry_flow::remote::fresh_key;
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
/// tokens. A server with no tokens serves loopback only (`ferry flow serve` checks its
/// address): it also refuses a `Host` that is not a loopback name (DNS rebinding). A
/// `POST` must say its body is JSON, which a web page cannot send to another origin
/// without asking first (CORS), so a page the server's user visits cannot start or
/// cancel runs.
fn open(api: &Weak<Server>, headers: &HeaderMap, post: bool) -> Result<Arc<Server>, Failure> {
    let server = api
        .upgrade()
        .ok_or_else(|| unavailable("server", "the server is stopping"))?;
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim());
    if !server.authorized(token) {
        return Err(failure(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "a bearer token the server knows is needed: Authorization: Bearer <token>",
        ));
    }
    if !server.has_tokens() {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let name = host.rsplit_once(':').map_or(host, |(n, _)| n);
        if !matches!(name, "127.0.0.1" | "localhost" | "[::1]") {
            return Err(failure(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!("Host {host:?}: a server with no tokens answers loopback names only"),
            ));
        }
    }
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if post && !json {
        return Err(failure(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid",
            "a POST must have Content-Type: application/json",
        ));
    }
    Ok(server)
}

fn unavailable(kind: &str, message: impl Into<String>) -> Failure {
    Failure {
        retry_after_s: Some(1),
        ..failure(StatusCode::SERVICE_UNAVAILABLE, kind, message)
    }
}

type Answer = Result<Json<Value>, Failure>;

/// A call's answer as a response: its JSON, or its error with the status of its class.
async fn answer(server: Arc<Server>, kind: CallKind, key: String) -> Answer {
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
        Ok(Outcome::Err { kind, message }) => Err(match kind.as_str() {
            "unknown_run" => failure(StatusCode::NOT_FOUND, &kind, message),
            "invalid" | "codec" => failure(StatusCode::BAD_REQUEST, &kind, message),
            "run_finished" => failure(StatusCode::CONFLICT, &kind, message),
            "limit_exceeded" => failure(StatusCode::PAYLOAD_TOO_LARGE, &kind, message),
            "not_held" | "stopped" | "log" | "io" => unavailable(&kind, message),
            _ => failure(StatusCode::INTERNAL_SERVER_ERROR, &kind, message),
        }),
        Err(r) => Err(refusal(r)),
    }
}

fn refusal(r: Refused) -> Failure {
    match &r {
        Refused::NoHolder { .. } => unavailable("no_holder", r.to_string()),
        Refused::Unavailable { retry_after_ms } => Failure {
            retry_after_s: Some(retry_after_ms.div_ceil(1000)),
            ..unavailable("server", r.to_string())
        },
        Refused::TooLarge { .. } => {
            failure(StatusCode::PAYLOAD_TOO_LARGE, "too_large", r.to_string())
        }
        _ => failure(StatusCode::BAD_REQUEST, "refused", r.to_string()),
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

async fn start(State(api): Api, headers: HeaderMap, bytes: axum::body::Bytes) -> Answer {
    let server = open(&api, &headers, true)?;
    let b: StartBody = body(&bytes, r#"{"workflow", "id", "input"}"#)?;
    let kind = CallKind::Start {
        workflow: b.workflow,
        input: serde_json::to_vec(&b.input).expect("JSON serializes"),
        id: b.id.clone(),
    };
    answer(server, kind, b.id).await
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
) -> Answer {
    let server = open(&api, &headers, true)?;
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
        None => fresh_key("http"),
    };
    let kind = CallKind::Signal {
        id,
        name,
        value: serde_json::to_vec(&b.value).expect("JSON serializes"),
    };
    answer(server, kind, key).await.map(|_| Json(json!({})))
}

async fn cancel(State(api): Api, Path(id): Path<String>, headers: HeaderMap) -> Answer {
    let server = open(&api, &headers, true)?;
    let cancelled = answer(server, CallKind::Cancel { id }, fresh_key("http")).await?;
    Ok(Json(json!({ "cancelled": cancelled.0 })))
}

async fn query(State(api): Api, Path(id): Path<String>, headers: HeaderMap) -> Answer {
    let server = open(&api, &headers, false)?;
    let published = answer(server, CallKind::Query { id }, String::new()).await?;
    Ok(Json(json!({ "published": published.0 })))
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
) -> Answer {
    let server = open(&api, &headers, false)?;
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
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListParams {
    state: Option<String>,
    after: Option<String>,
    limit: Option<usize>,
}

/// The states a run has in the index.
const STATES: [&str; 5] = ["running", "parked", "finished", "failed", "cancelled"];

async fn list(
    State(api): Api,
    params: Result<Query<ListParams>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
) -> Answer {
    let server = open(&api, &headers, false)?;
    let Query(p) = params.map_err(|e| bad_request(format!("?state=S&after=ID&limit=N: {e}")))?;
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
}

async fn show(State(api): Api, Path(id): Path<String>, headers: HeaderMap) -> Answer {
    let server = open(&api, &headers, false)?;
    match server.run(&id) {
        Some(r) => Ok(Json(serde_json::to_value(r).expect("a summary serializes"))),
        None => Err(failure(
            StatusCode::NOT_FOUND,
            "unknown_run",
            format!("no run {id:?}: it was never started (durably) on this server"),
        )),
    }
}
