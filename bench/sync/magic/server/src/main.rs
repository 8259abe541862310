//! `magic-sync-server`: magic_sync 0.5.1's server for the side-by-side sync benchmark,
//! with the loopback transport of `bench/sync/magic/README.md`.
//!
//! ```text
//! magic-sync-server --db URL --listen 127.0.0.1:PORT [--unconfirmed-after-ms N]
//!                   [--watch-every-ms N] [--idle-ms N]
//! ```
//!
//! 1. Connects to the driver's database and installs what magic_sync needs there
//!    (`Server::install`: its `sync` schema, the triggers on `products` and `orders`, the
//!    planner's indexes), in one transaction, before anything is served.
//! 2. Runs magic_sync's relay (`Server::run`) in a task: it plans what each live store
//!    should hold against what it holds, and hands each message to the transport.
//! 3. The transport ([`queue`]) keeps each store's messages in memory, numbered from 1,
//!    until the store's host fetches past them (`GET /down/{replica}`); what the host
//!    posts (`POST /up/{replica}`) goes to `Server::receive`.
//! 4. Prints one `{"event":"ready",…}` line with the effective settings, then serves
//!    until SIGTERM or SIGINT, when it stops the relay and the HTTP server and exits 0.
//!
//! What is persisted is magic_sync's own (the `sync` schema): the transport's queues are
//! in memory, so a restart of this process loses what it had taken and not delivered,
//! which magic_sync heals as a lost message (README, "Healing").

mod queue;
#[path = "../../shop.rs"]
mod shop;

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use magic_sync::plan::{Audience, Replicas};
use magic_sync::run::server::{Anyone, Server, Settings};
use queue::{Loopback, Queues};
use tokio::sync::watch;
use uuid::Uuid;

/// The stores are the replicas: every row of `stores` whose `live` is true is sent what
/// it should hold. One partition: a broadcast product goes to every live store.
const STORES: Replicas = Replicas::new("public.stores", "stores").live("live");

/// Connections to Postgres: the relay holds one for its lock the whole run, each pass
/// takes one or two more, and each `POST /up` filing one or two; ten is sqlx's default.
const POOL_CONNECTIONS: u32 = 10;

/// The largest body `POST /up` takes. magic_sync keeps a replica's message within its
/// `Limits` (512 KiB by default) and drops a larger one itself; this only bounds what
/// the HTTP layer reads before handing it over, with room for a larger `Limits`.
const UP_BODY_BYTES_MAX: usize = 4 << 20;

/// The longest a long poll waits, whatever `wait_ms` asks: a fetch that hangs longer
/// would hold up the graceful stop.
const WAIT_MS_MAX: u64 = 30_000;

/// How long the stop waits for the relay and the open requests to end: a `POST /up`
/// being filed finishes, or is cut off with the process (the host posts it again).
const STOP_WAIT: Duration = Duration::from_secs(1);

type Engine = Server<Anyone, Loopback>;

#[derive(Clone)]
struct App {
    server: Arc<Engine>,
    queues: Arc<Queues>,
    /// Turns true on SIGTERM or SIGINT: a waiting long poll answers at once, so the
    /// graceful stop does not wait out its `wait_ms`.
    stopped: watch::Receiver<bool>,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = run(&args) {
        eprintln!("magic-sync-server: {e}");
        std::process::exit(1);
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let db = need(args, "--db")?;
    let listen = need(args, "--listen")?;
    let mut settings = Settings::default();
    if let Some(ms) = millis(args, "--unconfirmed-after-ms")? {
        settings.unconfirmed_after = ms;
    }
    if let Some(ms) = millis(args, "--watch-every-ms")? {
        settings.watch_every = ms;
    }
    if let Some(ms) = millis(args, "--idle-ms")? {
        settings.idle = ms;
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    runtime.block_on(serve(db, listen, settings))
}

async fn serve(db: String, listen: String, settings: Settings) -> Result<(), String> {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(POOL_CONNECTIONS)
        .connect(&db)
        .await
        .map_err(|e| format!("cannot connect to {db}: {e}"))?;
    let queues = Arc::new(Queues::default());
    let ready = ready_line(&listen, &settings);
    let audiences = vec![Audience::new("stores", STORES, shop::codecs())];
    let server = Server::install(
        pool.clone(),
        audiences,
        Loopback(queues.clone()),
        Anyone::new(pool.clone()),
        settings,
    )
    .await
    .map_err(|e| format!("magic_sync refused to install on {db}: {e}"))?;
    let server = Arc::new(server);
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;

    let (stop, stopped) = watch::channel(false);
    let relay = tokio::spawn({
        let server = server.clone();
        let stopped = stopped.clone();
        async move { server.run(until(stopped)).await }
    });
    let app = Router::new()
        .route("/down/{replica}", get(down))
        .route("/up/{replica}", post(up))
        .route("/control/lose-next", post(lose_next))
        .route("/control/lost", get(lost))
        .route("/control/stats", get(stats))
        .layer(DefaultBodyLimit::max(UP_BODY_BYTES_MAX))
        .with_state(App {
            server,
            queues,
            stopped: stopped.clone(),
        });
    let http = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(until(stopped))
            .into_future(),
    );
    say(&ready);

    signalled().await?;
    let _ = stop.send(true);
    let _ = tokio::time::timeout(STOP_WAIT, async {
        let _ = relay.await;
        let _ = http.await;
    })
    .await;
    Ok(())
}

/// The ready line: every setting of magic_sync's that a run may depend on, as in force.
fn ready_line(listen: &str, s: &Settings) -> serde_json::Value {
    let ms = |d: Duration| d.as_millis() as u64;
    serde_json::json!({
        "event": "ready",
        "listen": listen,
        "magic_sync": "0.5.1",
        "idle_ms": ms(s.idle),
        "unconfirmed_after_ms": ms(s.unconfirmed_after),
        "watch_every_ms": ms(s.watch_every),
        "batch": s.batch.get(),
        "concurrency": s.concurrency.get(),
        "send_timeout_ms": ms(s.send_timeout),
        "limits_rows": s.limits.rows(),
        "limits_bytes": s.limits.bytes(),
        "outbox_messages": s.outbox_messages.get(),
        "outbox_bytes": s.outbox_bytes.get(),
        "backoff_ms": [ms(s.backoff.first), ms(s.backoff.max)],
        "replica_backoff_ms": [ms(s.replica_backoff.first), ms(s.replica_backoff.max)],
        "standby_ms": ms(s.standby),
        "retry_every_ms": ms(s.retry_every),
        "pool_connections": POOL_CONNECTIONS,
        "fetch_messages_max": queue::FETCH_MESSAGES_MAX,
    })
}

#[derive(serde::Deserialize)]
struct DownQuery {
    #[serde(default)]
    after: u64,
    #[serde(default)]
    wait_ms: u64,
}

/// `GET /down/{replica}?after=K&wait_ms=W`: the messages after K, as
/// `[u64 BE index][u32 BE length][bytes]` each; empty when none came within W.
async fn down(
    State(app): State<App>,
    Path(replica): Path<Uuid>,
    Query(q): Query<DownQuery>,
) -> Response {
    let wait = Duration::from_millis(q.wait_ms.min(WAIT_MS_MAX));
    let body = tokio::select! {
        body = app.queues.fetch(replica, q.after, wait) => body,
        () = until(app.stopped.clone()) => Vec::new(),
    };
    ([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response()
}

/// `POST /up/{replica}`: one message up, handed to magic_sync. Its error means the
/// message must come again (magic_sync's own contract for `receive`).
async fn up(State(app): State<App>, Path(replica): Path<Uuid>, body: Bytes) -> Response {
    app.queues.count_up(body.len());
    match app.server.receive(replica, &body).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn lose_next(State(app): State<App>) -> Response {
    app.queues.arm_loss();
    json(app.queues.lost())
}

async fn lost(State(app): State<App>) -> Response {
    json(app.queues.lost())
}

async fn stats(State(app): State<App>) -> Response {
    json(app.queues.stats())
}

fn json(v: serde_json::Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// Resolves once `stopped` turns true (or its sender is gone).
async fn until(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

async fn signalled() -> Result<(), String> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term =
        signal(SignalKind::terminate()).map_err(|e| format!("cannot watch SIGTERM: {e}"))?;
    let mut int =
        signal(SignalKind::interrupt()).map_err(|e| format!("cannot watch SIGINT: {e}"))?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    Ok(())
}

/// One JSON line on stdout, flushed: the driver reads it as it comes.
fn say(v: &serde_json::Value) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

fn need(args: &[String], name: &str) -> Result<String, String> {
    flag(args, name)
        .ok_or_else(|| format!("{name} is required (usage: see bench/sync/magic/README.md)"))
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// A duration flag in milliseconds, not zero: magic_sync refuses a zero duration.
fn millis(args: &[String], name: &str) -> Result<Option<Duration>, String> {
    let Some(v) = flag(args, name) else {
        return Ok(None);
    };
    let n: u64 = v
        .parse()
        .map_err(|e| format!("{name} {v}: not a whole number of milliseconds ({e})"))?;
    if n == 0 {
        return Err(format!("{name} is 0: magic_sync refuses a zero duration"));
    }
    Ok(Some(Duration::from_millis(n)))
}
