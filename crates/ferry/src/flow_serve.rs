//! `ferry flow serve`: server mode's server (docs/flow-server.md) as a process. Listens
//! on TCP or a Unix socket for workers, serves the HTTP/JSON API on `--http` (§10),
//! /metrics, /status and /healthz on `--metrics-listen`, logs what changes every 10 s,
//! and on SIGTERM closes every
//! connection and the log (what was appended is synced; workers resume elsewhere or
//! when it is back).

use anyhow::Context;
use clap::Args;
use ferry_flow::LogConfig;
use ferry_flow_server::replica::{Replica, ReplicaSettings};
use ferry_flow_server::server::{Server, Settings, token_hash};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct ServeArgs {
    /// The server's directory: its log (every shard's journal and every grant's epoch).
    #[arg(long)]
    pub dir: PathBuf,
    /// Where workers connect: `unix:/path/to/socket` or `HOST:PORT`.
    #[arg(long)]
    pub listen: String,
    /// How many shards runs are spread over; fixed when DIR is first used.
    #[arg(long, default_value_t = 16)]
    pub shards: u32,
    /// A worker silent this long loses its shards.
    #[arg(long, default_value_t = 5_000)]
    pub lease_ms: u64,
    /// How often workers ping: at most a third of the lease.
    #[arg(long, default_value_t = 1_000)]
    pub ping_ms: u64,
    /// A shard whose thread has not turned for this long is taken from its worker.
    #[arg(long, default_value_t = 10_000)]
    pub stuck_ms: u64,
    /// A file of tokens, one per line, of which a worker, a client and an HTTP request
    /// (`Authorization: Bearer`) must present one. Without it, any process that can
    /// reach --listen may hold shards: use a Unix socket's permissions, or a private
    /// network; and --http must be on a loopback address.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Serve the HTTP/JSON API (start, signal, cancel, query, result, list, show under
    /// /v1) on this HOST:PORT.
    #[arg(long)]
    pub http: Option<String>,
    /// How long a start, signal, cancel or query waits for its run's shard to have a
    /// worker before it is refused as transient.
    #[arg(long, default_value_t = 5_000)]
    pub call_wait_ms: u64,
    /// Write each shard's checkpoint and retire the log below them once the log grew by
    /// this many bytes (or a minute passed with anything new).
    #[arg(long, default_value_t = 64 << 20)]
    pub compact_bytes: u64,
    /// How long a finished run stays known (its result, its id taken) after the first
    /// checkpoint that saw it finished.
    #[arg(long, default_value_t = 24 * 3600 * 1000)]
    pub retention_ms: u64,
    /// After a sync, wait up to this long for the workers it acknowledged to send their
    /// next appends, so that they ride the next sync: fewer syncs, for latency (0: do
    /// not wait). docs/notes/2026-12-07-flow-server-engine.md has what it did.
    #[arg(long, default_value_t = 0)]
    pub follow_us: u64,
    /// Serve /metrics (Prometheus), /status (JSON) and /healthz on this HOST:PORT.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// Keep the log in a NATS JetStream stream too (`nats://HOST:PORT`, several
    /// comma-separated), so that it outlives this machine
    /// (docs/flow-server-replica.md): a record is acknowledged once the stream has it.
    /// Every server started with the same --replicate and --stream is one server and
    /// its standbys: the one holding the stream's lock serves, the others wait, and
    /// the next takes over within a lease of the last renewal. DIR is then a copy of
    /// the stream, rebuilt at every start.
    #[arg(long)]
    pub replicate: Option<String>,
    /// With --replicate: the stream's name (its subject is `ferry.flow.<name>`; its lock
    /// is the stream `<name>_LOCK`).
    #[arg(long, default_value = "FERRY_FLOW")]
    pub stream: String,
    /// With --replicate: the replicas of the stream and its lock, when this server
    /// creates them (3 in production: a quorum of them holds each record).
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
}

pub fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let tokens = match &a.token_file {
        None => Vec::new(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read --token-file {}", path.display()))?;
            let tokens: Vec<[u8; 32]> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(token_hash)
                .collect();
            if tokens.is_empty() {
                anyhow::bail!(
                    "--token-file {} holds no token: one per line, or leave the flag out",
                    path.display()
                );
            }
            tokens
        }
    };
    let settings = Settings {
        shards: a.shards,
        lease: Duration::from_millis(a.lease_ms),
        ping_every: Duration::from_millis(a.ping_ms),
        stuck_after: Duration::from_millis(a.stuck_ms),
        call_wait: Duration::from_millis(a.call_wait_ms),
        compact_bytes: a.compact_bytes,
        retention: Duration::from_millis(a.retention_ms),
        tokens,
        ..Settings::default()
    };
    if let Some(addr) = &a.http {
        let loopback = addr
            .parse::<std::net::SocketAddr>()
            .map(|s| s.ip().is_loopback())
            .unwrap_or_else(|_| addr.starts_with("localhost:"));
        if settings.tokens.is_empty() && !loopback {
            anyhow::bail!(
                "--http {addr}: an API on an address other machines reach needs --token-file \
                 (or serve it on 127.0.0.1)"
            );
        }
    }
    settings.check().map_err(|e| {
        let flag = match e.setting {
            "shards" => "--shards",
            "lease" => "--lease-ms",
            "ping_every" => "--ping-ms",
            "stuck_after" => "--stuck-ms",
            "call_wait" => "--call-wait-ms",
            other => other,
        };
        anyhow::anyhow!("{flag}: {}", e.reason)
    })?;
    if a.replicate.is_some() && a.lease_ms < 1_000 {
        anyhow::bail!(
            "--lease-ms {}: with --replicate it must be at least 1000 (the stream's lock is renewed every third of it, over the network)",
            a.lease_ms
        );
    }
    let rt = tokio::runtime::Runtime::new().context("starting the runtime")?;
    rt.block_on(async move {
        // One handler, installed at its first poll (while standing by): a SIGTERM while
        // standing by or rebuilding counts.
        let terminated = crate::terminated();
        tokio::pin!(terminated);
        let log = LogConfig {
            follow: Duration::from_micros(a.follow_us),
            ..LogConfig::default()
        };
        let server = match &a.replicate {
            None => Server::open(&a.dir, settings, log),
            Some(url) => {
                let replicated = ReplicaSettings {
                    url: url.clone(),
                    stream: a.stream.clone(),
                    replicas: a.replicas,
                    lease: settings.lease,
                };
                let mut replica = Replica::connect(&replicated)
                    .await
                    .context("--replicate: the stream cannot be used")?;
                replica.expect_shards(settings.shards);
                tokio::select! {
                    taken = replica.acquire() => taken.context("--replicate")?,
                    _ = &mut terminated => {
                        tracing::info!("ferry flow serve: stopped while standing by");
                        return Ok(());
                    }
                }
                let restored = tokio::select! {
                    restored = replica.restore(&a.dir, log.clone()) => restored,
                    _ = &mut terminated => {
                        replica.release().await;
                        tracing::info!("ferry flow serve: stopped while rebuilding from the stream");
                        return Ok(());
                    }
                };
                if let Err(e) = restored {
                    // Given up at once: a standby need not wait a lease for it.
                    replica.release().await;
                    return Err(anyhow::Error::new(e)
                        .context("--replicate: the log could not be rebuilt from the stream"));
                }
                Server::open_replicated(&a.dir, settings, log, replica)
            }
        }
        .with_context(|| format!("cannot open the server's directory --dir {}", a.dir.display()))?;
        let server = Arc::new(server);
        server.start();
        if let Some(addr) = &a.metrics_listen {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on --metrics-listen {addr}"))?;
            serve_metrics(listener, server.clone());
        }
        if let Some(addr) = &a.http {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on --http {addr}"))?;
            let app = ferry_flow_server::http::router(&server);
            tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!("the HTTP API stopped: {e}");
                }
            });
            tracing::info!(http = %addr, "ferry flow serve: serving the HTTP API");
        }
        let accept = accept(&a.listen, &server).await?;
        tracing::info!(listen = %a.listen, dir = %a.dir.display(), shards = a.shards, "ferry flow serve: serving workers");
        let progress = tokio::spawn(report_progress(server.clone()));
        tokio::select! {
            _ = &mut terminated => {}
            _ = server.stopped() => {}
        }
        let failed = server.failed();
        accept.abort();
        progress.abort();
        let _ = accept.await;
        let _ = progress.await;
        // The metrics server's handle goes with the runtime; wait for the last holder.
        let server = wait_for_last(server).await;
        server.shutdown().await;
        if let Some(path) = a.listen.strip_prefix("unix:") {
            let _ = std::fs::remove_file(path);
        }
        if failed {
            anyhow::bail!(
                "the server stopped on an error (see above): its log failed, or with \
                 --replicate the stream went to another server; start it again: it recovers \
                 what was durable and workers resume (with --replicate it stands by while \
                 another server holds the stream)"
            );
        }
        tracing::info!("ferry flow serve: stopped");
        anyhow::Ok(())
    })
}

/// The server once nothing else holds it (the metrics routes hold clones for the span of
/// a request).
async fn wait_for_last(mut server: Arc<Server>) -> Server {
    loop {
        match Arc::try_unwrap(server) {
            Ok(s) => return s,
            Err(still) => {
                server = still;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Accept workers on `listen` until aborted.
async fn accept(listen: &str, server: &Arc<Server>) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    enum Listener {
        Unix(tokio::net::UnixListener),
        Tcp(tokio::net::TcpListener),
    }
    let listener =
        match listen.strip_prefix("unix:") {
            Some(path) => {
                // A socket left by a server that was killed: nobody answers on it.
                if std::os::unix::net::UnixStream::connect(path).is_err() {
                    let _ = std::fs::remove_file(path);
                }
                Listener::Unix(
                    tokio::net::UnixListener::bind(path)
                        .with_context(|| format!("cannot listen on --listen {listen}"))?,
                )
            }
            None => Listener::Tcp(tokio::net::TcpListener::bind(listen).await.with_context(
                || format!("cannot listen on --listen {listen} (unix:/path for a Unix socket)"),
            )?),
        };
    let connector = server.connector();
    Ok(tokio::spawn(async move {
        loop {
            let accepted = match &listener {
                Listener::Unix(l) => l
                    .accept()
                    .await
                    .map(|(s, _)| tokio::spawn(connector.connection(s))),
                Listener::Tcp(l) => l.accept().await.map(|(s, _)| {
                    let _ = s.set_nodelay(true);
                    tokio::spawn(connector.connection(s))
                }),
            };
            if let Err(e) = accepted {
                tracing::warn!(error = %e, "ferry flow serve: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }))
}

fn serve_metrics(listener: tokio::net::TcpListener, server: Arc<Server>) {
    let weak = Arc::downgrade(&server);
    drop(server);
    let (w1, w2) = (weak.clone(), weak);
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let s = w1.upgrade();
                async move { s.map(|s| s.metrics()).unwrap_or_default() }
            }),
        )
        .route(
            "/status",
            axum::routing::get(move || {
                let s = w2.upgrade();
                async move {
                    match s {
                        Some(s) => axum::Json(serde_json::to_value(s.status()).unwrap_or_default()),
                        None => axum::Json(serde_json::json!({"error": "stopping"})),
                    }
                }
            }),
        )
        .route("/healthz", axum::routing::get(|| async { "ok\n" }));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("metrics server stopped: {e}");
        }
    });
}

/// Log shards held and records appended every 10 s while something changes.
async fn report_progress(server: Arc<Server>) {
    let mut last = (usize::MAX, 0u64);
    loop {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let st = server.status();
        let held = st.shards.iter().filter(|s| s.holder.is_some()).count();
        let records: u64 = st.shards.iter().map(|s| s.records).sum();
        if (held, records) != last {
            tracing::info!(
                held,
                shards = st.shards.len(),
                workers = st.workers.iter().filter(|w| w.connected).count(),
                records,
                "ferry flow serve: {} records appended in the last 10 s",
                records.saturating_sub(last.1.min(records))
            );
            last = (held, records);
        }
    }
}
