//! `ferry outbox install|relay|status|requeue|discard|pause|resume`.

use crate::grammar::Flags;
use crate::table;
use anyhow::{Context, anyhow, bail};
use clap::{Args, Subcommand};
use ferry_core::ConfigError;
use ferry_outbox::ConnectError;
use ferry_outbox::relay::{Relay, RelayConfig};
use ferry_outbox::status::Status;
use ferry_outbox::store::{Select, Store, redact};
use ferry_outbox::transport::{self, TransportError, TransportOptions};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Subcommand)]
pub enum OutboxSub {
    /// Create or upgrade the outbox schema (idempotent; safe from several processes).
    Install(InstallArgs),
    /// Publish outbox messages to NATS JetStream or a webhook until SIGTERM.
    Relay(RelayArgs),
    /// Depth by state, oldest claimable age, parked messages, paused topics.
    Status(StatusArgs),
    /// Put parked messages back to pending, attempts reset.
    Requeue(SelectArgs),
    /// Delete parked messages for good.
    Discard(SelectArgs),
    /// Stop relays taking messages of a topic.
    Pause(TopicArgs),
    /// Let relays take messages of a paused topic again.
    Resume(TopicArgs),
}

#[derive(Args)]
pub struct DbArg {
    /// The app's database: postgres://USER@HOST/DB or sqlite:PATH.
    #[arg(long)]
    pub db: String,
}

#[derive(Args)]
pub struct InstallArgs {
    #[command(flatten)]
    pub db: DbArg,
    /// Print JSON: {"installed": "created"|"upgraded"|"current", "from", "version"}.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct RelayArgs {
    #[command(flatten)]
    pub db: DbArg,
    /// Where to publish: nats://HOST:PORT (JetStream) or http(s)://HOST/PATH (webhook).
    #[arg(long)]
    pub to: String,
    /// NATS: the stream every topic must land in (checked at start-up, and its
    /// duplicate window read).
    #[arg(long)]
    pub stream: Option<String>,
    /// Webhook: file holding the HMAC secret for the Ferry-Signature header.
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// Webhook: how long the endpoint keeps idempotency keys, in milliseconds (an
    /// uncertain message older than this raises an alarm). Default a day.
    #[arg(long, default_value_t = 86_400_000)]
    pub webhook_dedup_ms: u64,
    /// The same in seconds: the spelling before durations were milliseconds everywhere.
    #[arg(long, hide = true, conflicts_with = "webhook_dedup_ms")]
    pub webhook_dedup_secs: Option<u64>,
    /// Relay loops in this process.
    #[arg(long, default_value_t = 2)]
    pub lanes: usize,
    /// Messages per lease.
    #[arg(long, default_value_t = 256)]
    pub batch: u32,
    /// Publishes in flight per lane.
    #[arg(long, default_value_t = 64)]
    pub window: usize,
    /// Lease length in milliseconds (extended at half-life while publishing).
    #[arg(long, default_value_t = 30_000)]
    pub lease_ms: u64,
    /// Refusals attributable to a message before it is parked.
    #[arg(long, default_value_t = 10)]
    pub max_attempts: i32,
    /// Backstop poll in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub poll_ms: u64,
    /// Time to wait for one publish's answer, in milliseconds (then: uncertain).
    #[arg(long, default_value_t = 10_000)]
    pub publish_timeout_ms: u64,
    /// Serve /metrics and /status on this address, e.g. 127.0.0.1:7360.
    #[arg(long)]
    pub metrics_listen: Option<String>,
}

#[derive(Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub db: DbArg,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct SelectArgs {
    #[command(flatten)]
    pub db: DbArg,
    /// Message ids (as the app gave them); repeat the flag.
    #[arg(long = "id")]
    pub ids: Vec<String>,
    /// Every parked message of this topic.
    #[arg(long)]
    pub topic: Option<String>,
    /// Every parked message.
    #[arg(long)]
    pub all_parked: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct TopicArgs {
    #[command(flatten)]
    pub db: DbArg,
    #[arg(long)]
    pub topic: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(sub: OutboxSub) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        match sub {
            OutboxSub::Install(a) => install(a).await,
            OutboxSub::Relay(a) => relay(a).await,
            OutboxSub::Status(a) => status(a).await,
            OutboxSub::Requeue(a) => operate(a, false).await,
            OutboxSub::Discard(a) => operate(a, true).await,
            OutboxSub::Pause(a) => {
                let store = open(&a.db.db).await?;
                store.pause(&a.topic).await?;
                if a.json {
                    print_json(&serde_json::json!({"topic": a.topic, "paused": true}))?;
                } else {
                    println!(
                        "topic {} paused: relays take none of its messages until `ferry outbox resume`",
                        a.topic
                    );
                }
                Ok(())
            }
            OutboxSub::Resume(a) => {
                let store = open(&a.db.db).await?;
                store.resume(&a.topic).await?;
                if a.json {
                    print_json(&serde_json::json!({"topic": a.topic, "paused": false}))?;
                } else {
                    println!("topic {} resumed", a.topic);
                }
                Ok(())
            }
        }
    })
}

fn print_json(v: &impl serde::Serialize) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(v)?);
    Ok(())
}

/// The flags behind the library's settings, for messages: the library names settings,
/// the CLI names its flags.
const FLAGS: Flags = Flags(&[
    ("db", "--db"),
    ("to", "--to"),
    ("stream", "--stream"),
    ("lanes", "--lanes"),
    ("batch", "--batch"),
    ("window", "--window"),
    ("lease", "--lease-ms"),
    ("max_attempts", "--max-attempts"),
    ("poll", "--poll-ms"),
    ("publish_timeout", "--publish-timeout-ms"),
]);

fn connect_error(e: ConnectError) -> anyhow::Error {
    match e {
        ConnectError::Config(c) => FLAGS.error(&c, None),
        other => anyhow!(other),
    }
}

fn transport_error(e: TransportError) -> anyhow::Error {
    match e {
        TransportError::Config(c) => FLAGS.error(&c, None),
        other => anyhow!(other),
    }
}

/// Connect and check the schema is there and not newer than this build.
async fn open(url: &str) -> anyhow::Result<Store> {
    let store = Store::connect(url).await.map_err(connect_error)?;
    match store.schema_version().await? {
        None => bail!(
            "{} has no outbox schema: run `ferry outbox install --db {}` first",
            redact(url),
            redact(url)
        ),
        Some(v) if v > ferry_outbox::schema::VERSION => bail!(
            "{} holds outbox schema version {v}, newer than this ferry ({}); upgrade ferry",
            redact(url),
            ferry_outbox::schema::VERSION
        ),
        Some(v) if v < ferry_outbox::schema::VERSION => bail!(
            "{} holds outbox schema version {v}; run `ferry outbox install --db {}` to upgrade it",
            redact(url),
            redact(url)
        ),
        Some(_) => Ok(store),
    }
}

async fn install(a: InstallArgs) -> anyhow::Result<()> {
    use ferry_outbox::schema::{Installed, VERSION};
    let url = &a.db.db;
    let store = Store::connect(url).await.map_err(connect_error)?;
    let done = store.install().await?;
    if a.json {
        let (installed, from) = match done {
            Installed::Created => ("created", None),
            Installed::Upgraded { from } => ("upgraded", Some(from)),
            Installed::AlreadyCurrent => ("current", None),
        };
        return print_json(
            &serde_json::json!({"installed": installed, "from": from, "version": VERSION}),
        );
    }
    match done {
        Installed::Created => println!(
            "outbox schema version {VERSION} installed in {}",
            redact(url)
        ),
        Installed::Upgraded { from } => println!(
            "outbox schema upgraded from version {from} to {VERSION} in {}",
            redact(url)
        ),
        Installed::AlreadyCurrent => println!(
            "outbox schema version {VERSION} already installed in {}",
            redact(url)
        ),
    }
    Ok(())
}

async fn relay(a: RelayArgs) -> anyhow::Result<()> {
    // The settings first: a wrong one is reported before anything is connected.
    let config = RelayConfig {
        lanes: a.lanes,
        batch: a.batch,
        window: a.window,
        lease: Duration::from_millis(a.lease_ms),
        max_attempts: a.max_attempts,
        poll: Duration::from_millis(a.poll_ms),
        ..RelayConfig::default()
    };
    config.check().map_err(|e| relay_config_error(&a, &e))?;
    let publish_timeout = Duration::from_millis(a.publish_timeout_ms);
    if publish_timeout >= config.lease / 2 {
        bail!(
            "--publish-timeout-ms {} must be under half of --lease-ms {}: a publish must end before the lease needs extending",
            a.publish_timeout_ms,
            a.lease_ms
        );
    }
    let listener = match &a.metrics_listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen on --metrics-listen {addr}"))?,
        ),
        None => None,
    };
    let store = open(&a.db.db).await?;
    let secret = match &a.secret_file {
        Some(p) => Some(
            crate::read_token(&Some(p.clone()))?
                .expect("read_token returns a token for a path")
                .into_bytes(),
        ),
        None => None,
    };
    let options = TransportOptions {
        publish_timeout,
        webhook_secret: secret,
        webhook_dedup_window: match a.webhook_dedup_secs {
            Some(secs) => Duration::from_secs(secs),
            None => Duration::from_millis(a.webhook_dedup_ms),
        },
        nats_stream: a.stream.clone(),
        ..TransportOptions::default()
    };
    let t = transport::connect(&a.to, &options)
        .await
        .map_err(transport_error)?;
    let relay =
        Relay::new(store.clone(), Arc::from(t), config).map_err(|e| relay_config_error(&a, &e))?;
    if let Some(listener) = listener {
        serve_metrics(listener, &relay, &store)?;
    }
    tracing::info!(db = %redact(&a.db.db), to = %a.to, "relaying");
    let r = relay.clone();
    let progress = tokio::spawn(async move { report_progress(r).await });
    let ended = relay.run(crate::terminated()).await;
    progress.abort();
    store.close().await;
    match ended {
        Ok(()) => {
            tracing::info!("relay stopped: every batch in flight was settled");
            Ok(())
        }
        Err(e) => Err(anyhow!(e)),
    }
}

/// A relay setting's error, with the flag's value as typed.
fn relay_config_error(a: &RelayArgs, e: &ConfigError) -> anyhow::Error {
    let given = match e.setting {
        "lanes" => a.lanes.to_string(),
        "batch" => a.batch.to_string(),
        "window" => a.window.to_string(),
        "lease" => a.lease_ms.to_string(),
        "max_attempts" => a.max_attempts.to_string(),
        "poll" => a.poll_ms.to_string(),
        _ => e.value.clone(),
    };
    FLAGS.error(e, Some(given))
}

/// Serve /metrics (the relay's counters and the outbox's depth), /status and /healthz.
fn serve_metrics(
    listener: tokio::net::TcpListener,
    relay: &Arc<Relay>,
    store: &Store,
) -> anyhow::Result<()> {
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics and /status");
    let (r1, r2, s) = (relay.clone(), relay.clone(), store.clone());
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let r = r1.clone();
                let s = s.clone();
                async move { r.metrics() + &depth_metrics(&s).await }
            }),
        )
        .route(
            "/status",
            axum::routing::get(move || {
                let r = r2.clone();
                async move { axum::Json(r.status()) }
            }),
        )
        .route("/healthz", axum::routing::get(|| async { "ok\n" }));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!("metrics server stopped: {e}");
        }
    });
    Ok(())
}

/// Log what the relay did every 10 s while it does something.
async fn report_progress(r: Arc<Relay>) {
    let mut last = 0;
    loop {
        tokio::time::sleep(Duration::from_secs(10)).await;
        let s = r.status();
        if s.settled != last {
            tracing::info!(
                published = s.published,
                duplicates = s.duplicates,
                parked = s.parked,
                fenced = s.fenced,
                uncertain = s.uncertain,
                "relayed {} messages in the last 10 s",
                s.settled - last
            );
            last = s.settled;
        }
    }
}

/// Depth gauges from the table, appended to the relay's own counters.
async fn depth_metrics(store: &Store) -> String {
    let Ok(st) = store.depth().await else {
        return String::new();
    };
    let mut e = ferry_core::metrics::Exposition::new();
    for (state, n) in [
        ("pending", st.pending),
        ("uncertain", st.uncertain),
        ("leased", st.leased),
        ("parked", st.parked),
    ] {
        e.gauge(
            "ferry_outbox_messages",
            "Messages in the outbox by state.",
            &[("state", state)],
            n as f64,
        );
    }
    e.gauge(
        "ferry_outbox_oldest_claimable_seconds",
        "Age of the oldest message a relay could take now.",
        &[],
        st.oldest_claimable_secs.unwrap_or(0.0),
    );
    e.gauge(
        "ferry_outbox_oldest_uncertain_seconds",
        "Age of the oldest unanswered publish still unresolved.",
        &[],
        st.oldest_uncertain_secs.unwrap_or(0.0),
    );
    e.finish()
}

async fn status(a: StatusArgs) -> anyhow::Result<()> {
    let store = open(&a.db.db).await?;
    let st = store.status().await?;
    if a.json {
        return print_json(&st);
    }
    print!("{}", render(&st));
    Ok(())
}

fn render(st: &Status) -> String {
    let secs = |s: Option<f64>| s.map_or("-".to_string(), |v| format!("{v:.1} s"));
    let mut out = table::render(
        &[
            "pending",
            "uncertain",
            "leased",
            "parked",
            "oldest claimable",
            "oldest uncertain",
        ],
        &[vec![
            st.pending.to_string(),
            st.uncertain.to_string(),
            st.leased.to_string(),
            st.parked.to_string(),
            secs(st.oldest_claimable_secs),
            secs(st.oldest_uncertain_secs),
        ]],
    );
    if !st.parked_messages.is_empty() {
        out.push_str("\nparked (requeue with `ferry outbox requeue --id ID`, or discard):\n");
        let rows: Vec<Vec<String>> = st
            .parked_messages
            .iter()
            .map(|p| {
                vec![
                    p.message_id.clone(),
                    p.topic.clone(),
                    p.key.clone().unwrap_or_default(),
                    p.attempts.to_string(),
                    p.last_error.clone().unwrap_or_default(),
                ]
            })
            .collect();
        out.push_str(&table::render(
            &["message id", "topic", "key", "attempts", "last error"],
            &rows,
        ));
    }
    if !st.paused_topics.is_empty() {
        out.push_str(&format!(
            "\npaused topics: {}\n",
            st.paused_topics.join(", ")
        ));
    }
    if !st.relays.is_empty() {
        let t = &st.relay_totals;
        out.push_str(&format!(
            "\nrelays, all time: published {}, duplicates {}, unavailable {}, uncertain {}, fenced {}, retried {}, parked {}, db errors {}, breaker openings {}\n",
            t.published,
            t.duplicates,
            t.unavailable,
            t.uncertain,
            t.fenced,
            t.retried,
            t.parked,
            t.db_errors,
            t.breaker_openings
        ));
        let rows: Vec<Vec<String>> = st
            .relays
            .iter()
            .map(|r| {
                vec![
                    r.owner.clone(),
                    r.transport.clone(),
                    if r.stopped {
                        format!("stopped {:.0} s ago", r.seen_secs_ago)
                    } else {
                        format!("{:.0} s ago", r.seen_secs_ago)
                    },
                    if r.breaker_open { "open" } else { "closed" }.to_string(),
                    r.totals.published.to_string(),
                    r.totals.duplicates.to_string(),
                    r.totals.unavailable.to_string(),
                    r.totals.db_errors.to_string(),
                    r.last_error.clone().unwrap_or_default(),
                ]
            })
            .collect();
        out.push_str(&table::render(
            &[
                "relay",
                "transport",
                "seen",
                "breaker",
                "published",
                "duplicates",
                "unavailable",
                "db errors",
                "last error",
            ],
            &rows,
        ));
    }
    out
}

async fn operate(a: SelectArgs, discard: bool) -> anyhow::Result<()> {
    let which = match (a.ids.is_empty(), &a.topic, a.all_parked) {
        (false, None, false) => Select::MessageIds(a.ids.clone()),
        (true, Some(t), false) => Select::Topic(t.clone()),
        (true, None, true) => Select::AllParked,
        _ => bail!(
            "say which parked messages: --id ID (repeatable), --topic TOPIC, or --all-parked (one of them)"
        ),
    };
    let store = open(&a.db.db).await?;
    let n = if discard {
        store.discard(&which).await?
    } else {
        store.requeue(&which).await?
    };
    if a.json {
        let key = if discard { "discarded" } else { "requeued" };
        return print_json(&serde_json::json!({ key: n }));
    }
    println!(
        "{n} parked message{} {}",
        if n == 1 { "" } else { "s" },
        if discard { "discarded" } else { "requeued" }
    );
    Ok(())
}
