//! A reference webhook receiver: what an endpoint behind the webhook transport should do,
//! small enough to read. It verifies `Ferry-Signature` when given the secret, stores each
//! `Idempotency-Key` once (a repeat is answered 200 and counted, not stored again), and
//! keeps what it received in order, for the demo and the tests.
//!
//! Faults can be switched on to play a bad endpoint: answer every request with a status,
//! refuse one message id with a status, or drop the connection after storing a message
//! (its acknowledgement is lost).

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// One message as the sink stored it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Received {
    pub message_id: String,
    pub topic: String,
    pub key: Option<String>,
    pub seq: Option<i64>,
    pub body: Vec<u8>,
}

/// What the sink does with the next requests.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Answer every request with this status, storing nothing.
    pub all: Option<u16>,
    /// Answer requests for these message ids with these statuses, storing nothing.
    pub refuse: HashMap<String, u16>,
    /// Store these message ids, then drop the connection without answering (once each).
    pub lose_ack: HashSet<String>,
    /// Take this long over every request (a slow endpoint).
    pub delay: Option<std::time::Duration>,
}

#[derive(Default)]
struct Inner {
    received: Vec<Received>,
    seen: HashSet<String>,
    duplicates: u64,
    requests: u64,
    bad_signatures: u64,
    faults: Faults,
}

/// A running sink; cloning shares it.
#[derive(Clone)]
pub struct Sink {
    inner: Arc<Mutex<Inner>>,
    secret: Option<Arc<Vec<u8>>>,
}

impl Sink {
    pub fn new(secret: Option<Vec<u8>>) -> Sink {
        Sink {
            inner: Arc::default(),
            secret: secret.map(Arc::new),
        }
    }

    /// The routes: `POST /` and `POST /hook`.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/", post(receive))
            .route("/hook", post(receive))
            .with_state(self.clone())
    }

    /// Serve on `listener` until the task is dropped or aborted.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        axum::serve(listener, self.router()).await
    }

    pub fn received(&self) -> Vec<Received> {
        self.lock().received.clone()
    }

    /// How many distinct messages are stored (cheaper than `received().len()`).
    pub fn received_count(&self) -> usize {
        self.lock().received.len()
    }

    pub fn duplicates(&self) -> u64 {
        self.lock().duplicates
    }

    pub fn requests(&self) -> u64 {
        self.lock().requests
    }

    pub fn bad_signatures(&self) -> u64 {
        self.lock().bad_signatures
    }

    pub fn set_faults(&self, faults: Faults) {
        self.lock().faults = faults;
    }

    pub fn faults(&self) -> Faults {
        self.lock().faults.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        ferry_core::sync::lock(&self.inner)
    }
}

async fn receive(
    State(sink): State<Sink>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<StatusCode, StatusCode> {
    let h = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let Some(id) = h("idempotency-key") else {
        return Ok(StatusCode::BAD_REQUEST);
    };
    if let Some(secret) = &sink.secret {
        let ts = h("ferry-timestamp").unwrap_or_default();
        let want = format!(
            "v1={}",
            crate::transport::webhook::sign(secret, &ts, &id, &body)
        );
        if h("ferry-signature").as_deref() != Some(want.as_str()) {
            sink.lock().bad_signatures += 1;
            return Ok(StatusCode::UNAUTHORIZED);
        }
    }
    let delay = sink.lock().faults.delay;
    if let Some(d) = delay {
        tokio::time::sleep(d).await;
    }
    // Decide under the lock, wait (if at all) after it is released.
    let hang = {
        let mut inner = sink.lock();
        inner.requests += 1;
        if let Some(s) = inner.faults.all {
            return Ok(StatusCode::from_u16(s).unwrap_or(StatusCode::SERVICE_UNAVAILABLE));
        }
        if let Some(s) = inner.faults.refuse.get(&id) {
            return Ok(StatusCode::from_u16(*s).unwrap_or(StatusCode::BAD_REQUEST));
        }
        if !inner.seen.insert(id.clone()) {
            inner.duplicates += 1;
            return Ok(StatusCode::OK);
        }
        inner.received.push(Received {
            message_id: id.clone(),
            topic: h("ferry-topic").unwrap_or_default(),
            key: h("ferry-key"),
            seq: h("ferry-seq").and_then(|s| s.parse().ok()),
            body: body.to_vec(),
        });
        inner.faults.lose_ack.remove(&id)
    };
    if hang {
        // Stored, but the answer never comes: axum has no way to drop the connection
        // from a handler, so hang past any publish timeout instead.
        std::future::pending::<()>().await;
    }
    Ok(StatusCode::OK)
}
