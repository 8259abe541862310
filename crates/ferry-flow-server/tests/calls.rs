//! Calls across shards and the HTTP API (docs/flow-server.md §9, §10), with real
//! worker engines on a real server: a start, signal, cancel or query made on any worker
//! (or over HTTP) reaches the holder of the run's shard; results, lists and shows come
//! from the server's index of durable records, with or without workers; a call made
//! while its shard moves is delivered once.

mod common;

use common::{close, more_than_once, open_worker};

use ferry_flow::{Ctx, Engine, FlowError, Signal, Workflow};
use ferry_flow_server::server::{Server, Settings, token_hash};
use ferry_testkit::{Scratch, eventually};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

static ORDER: Workflow<u32, u64> = Workflow::new("order");
static GO: Signal<u32> = Signal::new("go");

/// How many times each step's body ran, and each run received "go", by key / run.
static RAN: Mutex<BTreeMap<String, u32>> = Mutex::new(BTreeMap::new());

fn count(key: String) {
    *RAN.lock().unwrap().entry(key).or_default() += 1;
}

/// An order: charge (a step), publish, wait for "go" (and count every one that came),
/// ship (a step).
async fn order(ctx: Ctx, n: u32) -> Result<u64, FlowError> {
    let charged: u64 = ctx
        .step("charge", |s| async move {
            count(s.key().to_string());
            Ok(u64::from(n) * 10)
        })
        .await?;
    ctx.publish(&"charged")?;
    let go = ctx.wait_for(GO, None).await?.unwrap_or(0);
    // A second "go" would be consumed here: none may come (each is sent once, by key).
    let again = ctx.wait_for(GO, Some(Duration::from_millis(50))).await?;
    let shipped: u64 = ctx
        .step("ship", |s| async move {
            count(s.key().to_string());
            Ok(u64::from(go) + u64::from(again.is_some()) * 1_000_000)
        })
        .await?;
    Ok(charged + shipped)
}

/// The server's HTTP API on a free loopback port.
async fn http(server: &Arc<Server>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = ferry_flow_server::http::router(server);
    tokio::spawn(async move { axum::serve(listener, app).await });
    base
}

/// One HTTP request: its status and JSON body.
async fn request(
    method: &'static str,
    url: String,
    body: Option<&'static str>,
    headers: Vec<(&'static str, String)>,
) -> (u16, Value) {
    tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(30)))
            .http_status_as_error(false)
            .build()
            .new_agent();
        let resp = if method == "POST" {
            let mut r = agent.post(&url);
            if !headers.iter().any(|(h, _)| *h == "Content-Type") {
                r = r.header("Content-Type", "application/json");
            }
            for (h, v) in &headers {
                r = r.header(*h, v);
            }
            r.send(body.unwrap_or(""))
        } else {
            let mut r = agent.get(&url);
            for (h, v) in &headers {
                r = r.header(*h, v);
            }
            r.call()
        };
        let mut resp = resp.unwrap();
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    })
    .await
    .unwrap()
}

/// Guards guarantee 6's calls and 7 (T1's list and show half): two workers hold two
/// shards each; every call is made on the first (or over HTTP), so half of them reach
/// the second through the server. Each run starts, answers its query, takes its signal
/// once, and ends with the output the embedded engine gives; the results come from the
/// server's index; list and show answer after both workers are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_from_any_worker_reach_the_holder_and_the_index_answers_without_workers() {
    const SHARDS: u32 = 4;
    const RUNS: u32 = 24;
    let scratch = Scratch::new("flow-calls");
    let socket = scratch.path().join("s.sock");
    let settings = Settings {
        call_wait: Duration::from_millis(500),
        ..common::settings(SHARDS)
    };
    let server = common::start_with(scratch.path(), &socket, settings);
    let base = http(&server.server).await;
    let a = open_worker(&scratch.dir("a"), &socket, |b| {
        b.max_shards(2).register(ORDER, order)
    })
    .await;
    let b = open_worker(&scratch.dir("b"), &socket, |b| {
        b.max_shards(2).register(ORDER, order)
    })
    .await;
    eventually("the shards to spread over both workers", || {
        a.held_shards().len() == 2 && b.held_shards().len() == 2
    })
    .await;
    let ids: Vec<String> = (0..RUNS).map(|i| format!("order-{i}")).collect();
    let mut handles = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        handles.push(a.start(ORDER, id, &(i as u32)).await.unwrap());
    }
    let on_b = ids
        .iter()
        .filter(|id| ferry_flow::shard_of(id, SHARDS) == b.held_shards()[0].0)
        .count();
    assert!(on_b > 0, "some runs live on b's shards");
    // A query reaches the run wherever it is, once it has published.
    for id in &ids {
        let asked = Instant::now();
        loop {
            let q: Option<String> = a.query_anywhere(id).await.unwrap();
            if q.as_deref() == Some("charged") {
                break;
            }
            // A guard against hanging, not a timing.
            assert!(asked.elapsed() < Duration::from_secs(120), "{id}: {q:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    // A signal once per key: the second send is a no-op (the run would count it).
    for id in &ids {
        a.signal_once(id, GO, &1, "go-once").await.unwrap();
        a.signal_once(id, GO, &1, "go-once").await.unwrap();
    }
    for (i, h) in handles.iter().enumerate() {
        assert_eq!(h.result().await.unwrap(), i as u64 * 10 + 1, "{}", ids[i]);
    }
    // Calls about runs nobody started, or with bad input, answer as embedded.
    let e = a.cancel("nobody").await.unwrap_err();
    assert!(matches!(e, FlowError::UnknownRun { .. }), "{e}");
    let e = a
        .signal(&ids[0], GO, &1)
        .await
        .expect_err("a finished run takes no signal");
    assert!(matches!(e, FlowError::RunFinished { .. }), "{e}");
    assert_eq!(more_than_once(&RAN), Vec::<(String, u32)>::new());

    // Over HTTP: start, signal (keyed twice), result.
    let (status, body) = request(
        "POST",
        format!("{base}/v1/runs"),
        Some(r#"{"workflow": "order", "id": "h-1", "input": 5}"#),
        vec![],
    )
    .await;
    assert_eq!((status, &body), (200, &json!({"id": "h-1"})));
    for _ in 0..2 {
        let (status, body) = request(
            "POST",
            format!("{base}/v1/runs/h-1/signals/go"),
            Some(r#"{"value": 2}"#),
            vec![("Idempotency-Key", "k".into())],
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, body) = request(
        "GET",
        format!("{base}/v1/runs/h-1/result?wait_ms=20000"),
        None,
        vec![],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "finished", "{body}");
    assert_eq!(body["detail"], 52, "{body}");
    // Bad input is refused by name and starts nothing.
    let (status, body) = request(
        "POST",
        format!("{base}/v1/runs"),
        Some(r#"{"workflow": "order", "idd": "x"}"#),
        vec![],
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"].as_str().unwrap().contains("idd"), "{body}");
    let (status, body) = request(
        "POST",
        format!("{base}/v1/runs"),
        Some(r#"{"workflow": "nope", "id": "x"}"#),
        vec![],
    )
    .await;
    assert_eq!(
        (status, body["kind"].as_str()),
        (400, Some("invalid")),
        "{body}"
    );
    let (status, _) = request("GET", format!("{base}/v1/runs/x"), None, vec![]).await;
    assert_eq!(status, 404);

    // With no worker left, the index still answers.
    close(a).await;
    close(b).await;
    let (status, body) = request(
        "GET",
        format!("{base}/v1/runs?state=finished&limit=10"),
        None,
        vec![],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["runs"].as_array().unwrap().len(), 10);
    let next = body["next"].as_str().unwrap().to_string();
    let (_, rest) = request(
        "GET",
        format!("{base}/v1/runs?state=finished&after={next}"),
        None,
        vec![],
    )
    .await;
    assert_eq!(
        rest["runs"].as_array().unwrap().len(),
        RUNS as usize + 1 - 10
    );
    let (status, one) = request("GET", format!("{base}/v1/runs/order-3"), None, vec![]).await;
    assert_eq!(status, 200);
    assert_eq!(
        one,
        json!({"id": "order-3", "workflow": "order", "shard": ferry_flow::shard_of("order-3", SHARDS),
               "generation": 0, "state": "finished", "detail": 31})
    );
    // A call with no holder waits `call_wait`, then is refused as transient.
    let (status, body) = request(
        "POST",
        format!("{base}/v1/runs/order-3/cancel"),
        None,
        vec![],
    )
    .await;
    assert_eq!(
        (status, body["kind"].as_str()),
        (503, Some("no_holder")),
        "{body}"
    );
    server.stop().await;
}

/// Guards the API's bearer tokens (§10): with tokens set, a request without one of
/// them is refused and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_refuses_requests_without_a_known_token() {
    let scratch = Scratch::new("flow-calls-token");
    let socket = scratch.path().join("s.sock");
    let settings = Settings {
        tokens: vec![token_hash("sesame")],
        call_wait: Duration::from_millis(200),
        ..common::settings(2)
    };
    let server = common::start_with(scratch.path(), &socket, settings);
    let base = http(&server.server).await;
    for auth in [None, Some("Bearer wrong"), Some("sesame")] {
        let headers = auth
            .map(|a| vec![("Authorization", a.to_string())])
            .unwrap_or_default();
        let (status, body) = request(
            "POST",
            format!("{base}/v1/runs"),
            Some(r#"{"workflow": "order", "id": "t", "input": 1}"#),
            headers,
        )
        .await;
        assert_eq!((status, body["kind"].as_str()), (401, Some("unauthorized")));
    }
    let ok = vec![("Authorization", "Bearer sesame".to_string())];
    let (status, body) = request("GET", format!("{base}/v1/runs"), None, ok.clone()).await;
    assert_eq!((status, body), (200, json!({"runs": [], "next": null})));
    // Known token, no worker: refused as transient once call_wait passed.
    let (status, body) = request(
        "POST",
        format!("{base}/v1/runs"),
        Some(r#"{"workflow": "order", "id": "t", "input": 1}"#),
        ok,
    )
    .await;
    assert_eq!(
        (status, body["kind"].as_str()),
        (503, Some("no_holder")),
        "{body}"
    );
    server.stop().await;
}

/// Guards guarantee 6's calls across a takeover: signals sent over HTTP while the
/// worker holding every shard hands them back to a standby each arrive once (a call
/// whose holder let go before answering is sent to the next holder under the same
/// key), and every run finishes on the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_sent_while_shards_move_arrive_once() {
    const SHARDS: u32 = 2;
    const RUNS: u32 = 30;
    let scratch = Scratch::new("flow-calls-move");
    let socket = scratch.path().join("s.sock");
    let server = common::start(scratch.path(), &socket, SHARDS);
    let base = http(&server.server).await;
    let a = open_worker(&scratch.dir("a"), &socket, |b| {
        b.max_shards(0).register(ORDER, order)
    })
    .await;
    eventually("a to hold every shard", || {
        a.held_shards().len() == SHARDS as usize
    })
    .await;
    let ids: Vec<String> = (0..RUNS).map(|i| format!("move-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        a.start(ORDER, id, &(i as u32)).await.unwrap();
    }
    let b = open_worker(&scratch.dir("b"), &socket, |b| {
        b.max_shards(0).register(ORDER, order)
    })
    .await;
    // Signals over HTTP, each with its key, while a closes (hands everything to b).
    let sends = {
        let base = base.clone();
        let ids = ids.clone();
        tokio::spawn(async move {
            for id in ids {
                let (status, body) = request(
                    "POST",
                    format!("{base}/v1/runs/{id}/signals/go"),
                    Some(r#"{"value": 3}"#),
                    vec![("Idempotency-Key", format!("go/{id}"))],
                )
                .await;
                assert_eq!(status, 200, "{id}: {body}");
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    close(a).await;
    sends.await.unwrap();
    for (i, id) in ids.iter().enumerate() {
        let out = b.run::<u64>(id).unwrap().result().await.unwrap();
        assert_eq!(out, i as u64 * 10 + 3, "{id}: one go, none twice");
    }
    let in_index = server.server.runs(Some("finished"), None, 1000);
    assert_eq!(in_index.len(), RUNS as usize);
    close(b).await;
    server.stop().await;
}

/// Guards the API's loopback rules (§10) and a stopping server: a server with no tokens
/// refuses a POST that is not JSON (what a web page could send) and a Host that is not
/// a loopback name; a call waiting for a holder when the server stops is answered
/// (transient) and does not hold the stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_takes_no_cross_site_requests_and_a_stop_answers_waiting_calls() {
    let scratch = Scratch::new("flow-calls-stop");
    let socket = scratch.path().join("s.sock");
    let settings = Settings {
        call_wait: Duration::from_secs(60),
        ..common::settings(2)
    };
    let server = common::start_with(scratch.path(), &socket, settings);
    let base = http(&server.server).await;
    let start = r#"{"workflow": "order", "id": "s", "input": 1}"#;
    let (status, body) = request(
        "POST",
        format!("{base}/v1/runs"),
        Some(start),
        vec![("Content-Type", "text/plain".into())],
    )
    .await;
    assert_eq!(
        (status, body["kind"].as_str()),
        (415, Some("invalid")),
        "{body}"
    );
    let (status, body) = request(
        "GET",
        format!("{base}/v1/runs"),
        None,
        vec![("Host", "evil.example".into())],
    )
    .await;
    assert_eq!(
        (status, body["kind"].as_str()),
        (403, Some("forbidden")),
        "{body}"
    );
    // A start waits for a holder (60 s); the server stops meanwhile.
    let waiting = tokio::spawn(request(
        "POST",
        format!("{base}/v1/runs"),
        Some(start),
        vec![],
    ));
    eventually("the start to wait on the server", || {
        server.server.status().shards.len() == 2 && !waiting.is_finished()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.stop().await;
    let (status, body) = waiting.await.unwrap();
    assert_eq!(
        (status, body["kind"].as_str()),
        (503, Some("server")),
        "{body}"
    );
}

static SENDER: Workflow<(String, u32), u32> = Workflow::new("sender");
static COLLECTOR: Workflow<u32, Vec<u32>> = Workflow::new("collector");
static NOTE: Signal<u32> = Signal::new("note");

/// A worker running the sender and the collector.
async fn messenger(dir: &Path, socket: &Path, max_shards: u32) -> Engine {
    open_worker(dir, socket, move |b| {
        b.max_shards(max_shards)
            .register(SENDER, |ctx: Ctx, (to, n): (String, u32)| async move {
                for i in 0..n {
                    ctx.signal(&to, NOTE, &i).await?;
                    ctx.sleep(Duration::from_millis(15)).await?;
                }
                Ok(n)
            })
            .register(COLLECTOR, |ctx: Ctx, n: u32| async move {
                let mut got = Vec::new();
                while got.len() < n as usize {
                    got.push(ctx.wait_for(NOTE, None).await?.unwrap_or(u32::MAX));
                }
                // Any note sent twice would come now.
                if let Some(extra) = ctx.wait_for(NOTE, Some(Duration::from_millis(200))).await? {
                    got.push(extra);
                }
                Ok(got)
            })
    })
    .await
}

/// Guards guarantee 6 for what a run sends (T8, docs/flow-server.md §9): a run on one
/// worker's shard signals a run on the other worker's shard 40 times (`ctx.signal`,
/// through the server); its worker hands its shard back midway and the other worker
/// carries the sender on. Every note arrives once, in the order sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_signals_to_another_shard_arrive_once_in_order_across_a_takeover() {
    const NOTES: u32 = 40;
    let scratch = Scratch::new("flow-calls-notes");
    let socket = scratch.path().join("s.sock");
    let server = common::start(scratch.path(), &socket, 2);
    // a holds one shard at most; b takes what is left, and later a's.
    let a = messenger(&scratch.dir("a"), &socket, 1).await;
    let b = messenger(&scratch.dir("b"), &socket, 0).await;
    eventually("one shard each", || {
        a.held_shards().len() == 1 && b.held_shards().len() == 1
    })
    .await;
    let (on_a, on_b) = (a.held_shards()[0].0, b.held_shards()[0].0);
    let id_on = |shard: u32, what: &str| {
        (0..)
            .map(|i| format!("{what}-{i}"))
            .find(|id| ferry_flow::shard_of(id, 2) == shard)
            .unwrap()
    };
    let (sender, collector) = (id_on(on_a, "sender"), id_on(on_b, "collector"));
    a.start(COLLECTOR, &collector, &NOTES).await.unwrap();
    a.start(SENDER, &sender, &(collector.clone(), NOTES))
        .await
        .unwrap();
    // Midway, a hands its shard (the sender's) back: b carries the sender on.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        a.status(&sender),
        Some(ferry_flow::RunStatus::Running),
        "the sender is midway when its worker hands it back"
    );
    close(a).await;
    // A hang is a failure that says where each run stands.
    let within = Duration::from_secs(30);
    let stuck = |what: &str| -> ! {
        let index = |id: &str| server.server.run(id).map(|r| (r.state, r.detail));
        panic!(
            "{what} did not end within {within:?}: on b, sender {:?} collector {:?}; \
             the server's index: sender {:?} collector {:?}; b holds {:?}",
            b.status(&sender),
            b.status(&collector),
            index(&sender),
            index(&collector),
            b.held_shards()
        )
    };
    let got = tokio::time::timeout(within, b.run::<Vec<u32>>(&collector).unwrap().result())
        .await
        .unwrap_or_else(|_| stuck("the collector"))
        .unwrap();
    assert_eq!(
        got,
        (0..NOTES).collect::<Vec<_>>(),
        "each note once, in order"
    );
    let sent = tokio::time::timeout(within, b.run::<u32>(&sender).unwrap().result())
        .await
        .unwrap_or_else(|_| stuck("the sender"))
        .unwrap();
    assert_eq!(sent, NOTES);
    close(b).await;
    server.stop().await;
}
