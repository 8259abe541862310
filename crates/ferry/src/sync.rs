//! `ferry sync check|install|enroll|serve|status|replica|refile|wish|withdraw|wishes`: partial replicas of
//! Postgres tables on SQLite (docs/sync.md), and what replicas write back (docs/sync-up.md).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use clap::{Args, Subcommand};
use ferry_sync::catalog::Catalog;
use ferry_sync::relay::spec::Spec;
use ferry_sync::relay::{Relay, RelaySettings, RelayStats};
use ferry_sync::replica::{Live, Replica, RunSettings};
use ferry_sync::rules::Rules;
use sqlx::PgPool;

#[derive(Subcommand)]
pub enum SyncSub {
    /// Validate a rules file against the database and print the triggers and indexes it
    /// would install, and whether each is installed.
    Check(RulesArgs),
    /// Install (or update) the ferry_sync schema, the capture triggers and the indexes,
    /// in one transaction.
    Install(RulesArgs),
    /// Give a replica its token (printed, or written to --token-file); enrolling again
    /// replaces it and provisions the replica again.
    Enroll(EnrollArgs),
    /// Serve replicas over HTTP and, while this process holds the relay lock, record
    /// their messages; until SIGTERM.
    Serve(ServeArgs),
    /// Where every replica stands (synced, catching up, unreachable, silent) and, per
    /// mirrored table, how many of the rows it should hold it confirmed.
    Status(StatusArgs),
    /// Keep a local SQLite replica in step with a `ferry sync serve`, until SIGTERM
    /// (with --metrics-listen, serving its own /metrics and /status: synced, catching up,
    /// offline); or, with `status`, say where the replica's file stands.
    Replica(ReplicaArgs),
    /// File the inbox again now: the rows replicas uploaded that the database refused
    /// (docs/sync-up.md §5.2). The relay does this at start and every --retry-every-ms.
    Refile(RefileArgs),
    /// Wish values onto a replica's setting row (docs/sync-up.md §7): the replica carries
    /// the wish out and answers applied, refused, superseded or waiting.
    Wish(WishArgs),
    /// Withdraw the wish for a replica's setting row.
    Withdraw(WithdrawArgs),
    /// The wishes and where each stands: pending, waiting, applied, refused, superseded.
    Wishes(WishesArgs),
}

#[derive(Args)]
pub struct WishArgs {
    #[arg(long, env = "FERRY_SYNC_DB")]
    pub db: String,
    /// The replica (its uuid).
    #[arg(long)]
    pub replica: uuid::Uuid,
    /// The setting table, as the replicas name it.
    #[arg(long)]
    pub table: String,
    /// The row's key: a JSON array of its values, in key order (`'["<uuid>", "till"]'`).
    #[arg(long)]
    pub key: String,
    /// A desired column and its value, COLUMN=JSON (`volume=7`, `price_list="summer"`;
    /// a value that is not JSON is taken as text). Repeat for more columns.
    #[arg(long = "set", required = true)]
    pub set: Vec<String>,
    /// Carry it out only while the row's version is this.
    #[arg(long)]
    pub if_version: Option<i64>,
    #[arg(long)]
    pub note: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct WithdrawArgs {
    #[arg(long, env = "FERRY_SYNC_DB")]
    pub db: String,
    #[arg(long)]
    pub replica: uuid::Uuid,
    #[arg(long)]
    pub table: String,
    /// The row's key: a JSON array of its values.
    #[arg(long)]
    pub key: String,
}

#[derive(Args)]
pub struct WishesArgs {
    #[arg(long, env = "FERRY_SYNC_DB")]
    pub db: String,
    /// Only this replica's.
    #[arg(long)]
    pub replica: Option<uuid::Uuid>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct RefileArgs {
    #[arg(long)]
    pub rules: PathBuf,
    #[arg(long)]
    pub db: String,
    /// File as this Postgres role, as `serve --file-role` does.
    #[arg(long)]
    pub file_role: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct RulesArgs {
    /// The rules file (TOML): which relation lists the replicas, and each table's route.
    #[arg(long)]
    pub rules: PathBuf,
    /// The Postgres database: postgres://USER@HOST/DB.
    #[arg(long)]
    pub db: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct EnrollArgs {
    #[arg(long)]
    pub db: String,
    /// The replica's id (the uuid in the replicas relation).
    #[arg(long)]
    pub replica: uuid::Uuid,
    /// Write the token here (mode 0600) instead of printing it.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ServeArgs {
    #[arg(long)]
    pub rules: PathBuf,
    #[arg(long)]
    pub db: String,
    /// Where replicas connect, e.g. 0.0.0.0:7370. /metrics and /status are served here too.
    #[arg(long, default_value = "127.0.0.1:7370")]
    pub listen: SocketAddr,
    /// A standby takes the relay lock within this long of the holder's end.
    #[arg(long, default_value_t = 5_000)]
    pub standby_ms: u64,
    /// Notes planned per pass.
    #[arg(long, default_value_t = 500)]
    pub batch: usize,
    /// Without a notification, look for notes this often.
    #[arg(long, default_value_t = 250)]
    pub idle_ms: u64,
    /// Pacing: after a pass, the next waits this many microseconds per message the
    /// pass recorded (from the pass's start), so a fast stream of changes to many
    /// replicas shares passes and messages. 0 turns pacing off.
    #[arg(long, default_value_t = 400)]
    pub pace_us_per_message: u64,
    /// The most pacing makes a pass wait.
    #[arg(long, default_value_t = 50)]
    pub pace_max_ms: u64,
    /// Retry parked notes and quarantined rows this often.
    #[arg(long, default_value_t = 3_600_000)]
    pub retry_every_ms: u64,
    /// File replicas' uploads as this Postgres role (`SET LOCAL ROLE`), so grants and
    /// row-level security decide what each may write; `ferry_sync.replica` holds the
    /// sender's id for policies to read. Default: the connection's own role.
    #[arg(long)]
    pub file_role: Option<String>,
    /// Serve replicas only; never take the relay lock.
    #[arg(long)]
    pub no_relay: bool,
    /// With relay shards (`[relay] shards = N` in the rules, docs/sync-scale.md §2): the
    /// shard this serve's relay records for, 0 to N-1. Run one serve per shard (and a
    /// standby of each anywhere); every serve serves every replica.
    #[arg(long, default_value_t = 0)]
    pub shard: u32,
    /// Also carry replicas' traffic over NATS JetStream at this server
    /// (nats://HOST:PORT): publish their frames, file their uploads (docs/sync-nats.md).
    #[arg(long)]
    pub nats: Option<String>,
    /// The NATS subjects' prefix: frames go to <prefix>.<replica>.down.
    #[arg(long, default_value = ferry_sync::nats::PREFIX_DEFAULT)]
    pub nats_prefix: String,
}

#[derive(Args)]
pub struct StatusArgs {
    #[arg(long)]
    pub db: String,
    /// Only the replicas of this partition.
    #[arg(long)]
    pub partition: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct ReplicaArgs {
    #[command(subcommand)]
    pub status: Option<ReplicaSub>,
    /// The sync server: http://HOST:PORT of a `ferry sync serve`, or nats://HOST:PORT of
    /// the NATS server a `ferry sync serve --nats` bridges to.
    #[arg(long)]
    pub server: Option<String>,
    /// With a nats:// server: the subjects' prefix, as `ferry sync serve --nats-prefix`.
    #[arg(long, default_value = ferry_sync::nats::PREFIX_DEFAULT)]
    pub nats_prefix: String,
    /// The local SQLite file.
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// This replica's id.
    #[arg(long)]
    pub id: Option<uuid::Uuid>,
    /// File holding this replica's token.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Frames fetched per round trip.
    #[arg(long, default_value_t = 16)]
    pub window: usize,
    /// Report at least this often when nothing changed.
    #[arg(long, default_value_t = 30_000)]
    pub keepalive_ms: u64,
    /// How long one fetch waits at the server for a message (long poll; at most 30,000).
    #[arg(long, default_value_t = 20_000)]
    pub wait_ms: u64,
    /// No answer from the server for this long and the replica stands `offline` (must be
    /// above --wait-ms).
    #[arg(long, default_value_t = 60_000)]
    pub offline_after_ms: u64,
    /// Serve this running replica's /metrics (Prometheus) and /status (JSON: its file's
    /// status, its standing and when it last heard from the server) on this address,
    /// e.g. 127.0.0.1:7371 (port 0: any free port, logged). Off unless given.
    #[arg(long)]
    pub metrics_listen: Option<String>,
}

#[derive(Subcommand)]
pub enum ReplicaSub {
    /// Where the local replica stands, from its file alone (whether it is synced or
    /// offline takes the running replica: its --metrics-listen /status).
    Status(ReplicaStatusArgs),
}

#[derive(Args)]
pub struct ReplicaStatusArgs {
    #[arg(long)]
    pub db: PathBuf,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(sub: SyncSub) -> anyhow::Result<()> {
    if let SyncSub::Replica(a) = sub {
        return replica(a);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        match sub {
            SyncSub::Check(a) => check(a, false).await,
            SyncSub::Install(a) => check(a, true).await,
            SyncSub::Enroll(a) => enroll(a).await,
            SyncSub::Serve(a) => serve(a).await,
            SyncSub::Status(a) => status(a).await,
            SyncSub::Refile(a) => refile(a).await,
            SyncSub::Wish(a) => wish(a).await,
            SyncSub::Withdraw(a) => withdraw(a).await,
            SyncSub::Wishes(a) => wishes(a).await,
            SyncSub::Replica(_) => unreachable!("handled above"),
        }
    })
}

fn load_rules(path: &PathBuf) -> anyhow::Result<Rules> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the rules file {}", path.display()))?;
    Ok(Rules::parse(&text, path)?)
}

async fn connect(url: &str) -> anyhow::Result<PgPool> {
    PgPool::connect(url)
        .await
        .with_context(|| format!("cannot connect to --db {}", redact(url)))
}

/// The URL without its password, for messages.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => match url[s + 3..at].split_once(':') {
            Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
            None => url.to_string(),
        },
        _ => url.to_string(),
    }
}

async fn check(a: RulesArgs, install: bool) -> anyhow::Result<()> {
    let rules = load_rules(&a.rules)?;
    let pool = connect(&a.db).await?;
    let report = if install {
        ferry_sync::schema::install(&pool, &rules).await?
    } else {
        let mut conn = pool.acquire().await?;
        ferry_sync::schema::check(&mut conn, &rules).await?
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(())
}

async fn enroll(a: EnrollArgs) -> anyhow::Result<()> {
    let pool = connect(&a.db).await?;
    let token = ferry_sync::enroll::new_token();
    let mut conn = pool.acquire().await?;
    ferry_sync::enroll::enroll(&mut conn, a.replica, &token)
        .await
        .context("enrolling (is the ferry_sync schema installed? `ferry sync install`)")?;
    match &a.token_file {
        Some(path) => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(path)
                .with_context(|| format!("cannot write --token-file {}", path.display()))?;
            writeln!(f, "{token}")?;
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"replica": a.replica, "token_file": path})
                );
            } else {
                println!(
                    "replica {} enrolled; its token is in {}",
                    a.replica,
                    path.display()
                );
            }
        }
        None if a.json => println!(
            "{}",
            serde_json::json!({"replica": a.replica, "token": token})
        ),
        None => println!("{token}"),
    }
    Ok(())
}

async fn spec(pool: &PgPool, rules: &Rules) -> anyhow::Result<Spec> {
    let mut conn = pool.acquire().await?;
    ferry_sync::schema::verify(&mut conn, rules).await?;
    let catalog = Catalog::load(&mut conn, rules).await?;
    Spec::build(rules, &catalog).map_err(|e| anyhow!("{e}"))
}

async fn refile(a: RefileArgs) -> anyhow::Result<()> {
    let rules = load_rules(&a.rules)?;
    let pool = connect(&a.db).await?;
    let spec = spec(&pool, &rules).await?;
    let mut conn = pool.acquire().await?;
    let shape = ferry_sync::file::Shape { role: a.file_role };
    let done = ferry_sync::file::refile(&mut conn, &spec.records, &shape).await?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({"filed": done.filed, "still_refused": done.still_refused})
        );
    } else {
        println!(
            "filed {} rows from the inbox; {} still refused (`ferry sync status` shows why)",
            done.filed, done.still_refused
        );
    }
    Ok(())
}

/// A `--key` argument: a JSON array.
fn key_arg(key: &str) -> anyhow::Result<serde_json::Value> {
    match serde_json::from_str::<serde_json::Value>(key) {
        Ok(v @ serde_json::Value::Array(_)) => Ok(v),
        _ => bail!(
            "--key {key:?} is not a JSON array of the row's key values, in key order: for example '[\"7c9e6679-7425-40de-944b-e07fc1f90ae7\", \"till\"]'"
        ),
    }
}

async fn wish(a: WishArgs) -> anyhow::Result<()> {
    let key = key_arg(&a.key)?;
    let mut values = serde_json::Map::new();
    for set in &a.set {
        let Some((column, value)) = set.split_once('=') else {
            bail!("--set {set:?} is not COLUMN=VALUE: for example --set volume=7");
        };
        let value = serde_json::from_str(value)
            .unwrap_or_else(|_| serde_json::Value::String(value.to_string()));
        values.insert(column.to_string(), value);
    }
    let pool = connect(&a.db).await?;
    let mut conn = pool.acquire().await?;
    let values = serde_json::Value::Object(values);
    let number = ferry_sync::wish::wish(
        &mut conn,
        a.replica,
        &a.table,
        &key,
        &values,
        a.if_version,
        a.note.as_deref(),
    )
    .await
    .map_err(|e| {
        anyhow!(
            "the wish was not made: {}",
            e.as_database_error()
                .map_or(e.to_string(), |d| d.message().to_string())
        )
    })?;
    if a.json {
        println!("{}", serde_json::json!({"wish": number}));
    } else {
        println!(
            "wish {number} for {} {} of replica {}: {values}; `ferry sync wishes` shows its answer",
            a.table, a.key, a.replica
        );
    }
    Ok(())
}

async fn withdraw(a: WithdrawArgs) -> anyhow::Result<()> {
    let key = key_arg(&a.key)?;
    let pool = connect(&a.db).await?;
    let mut conn = pool.acquire().await?;
    if ferry_sync::wish::withdraw(&mut conn, a.replica, &a.table, &key).await? {
        println!(
            "withdrawn: the wish for {} {} of replica {}",
            a.table, a.key, a.replica
        );
    } else {
        println!(
            "no wish for {} {} of replica {}: nothing withdrawn",
            a.table, a.key, a.replica
        );
    }
    Ok(())
}

async fn wishes(a: WishesArgs) -> anyhow::Result<()> {
    let pool = connect(&a.db).await?;
    let mut conn = pool.acquire().await?;
    let all = ferry_sync::wish::wishes(&mut conn, a.replica).await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    let rows: Vec<Vec<String>> = all
        .iter()
        .map(|w| {
            vec![
                w.replica.to_string(),
                w.setting.clone(),
                w.key.clone(),
                w.values.clone(),
                w.state.clone(),
                w.reason.clone().unwrap_or_default(),
            ]
        })
        .collect();
    print!(
        "{}",
        crate::table::render(
            &["replica", "table", "key", "values", "state", "reason"],
            &rows
        )
    );
    Ok(())
}

async fn serve(a: ServeArgs) -> anyhow::Result<()> {
    let settings = RelaySettings {
        batch: a.batch,
        standby: Duration::from_millis(a.standby_ms),
        idle: Duration::from_millis(a.idle_ms),
        pace_per_message: Duration::from_micros(a.pace_us_per_message),
        pace_max: Duration::from_millis(a.pace_max_ms),
        file_shape: ferry_sync::file::Shape {
            role: a.file_role.clone(),
        },
        retry_every: Duration::from_millis(a.retry_every_ms),
        shard: a.shard,
        ..RelaySettings::default()
    };
    for (flag, zero) in [
        ("--standby-ms", a.standby_ms == 0),
        ("--idle-ms", a.idle_ms == 0),
        ("--retry-every-ms", a.retry_every_ms == 0),
        ("--batch", a.batch == 0),
    ] {
        if zero {
            bail!("{flag} must be above 0");
        }
    }
    let rules = load_rules(&a.rules)?;
    if a.shard >= rules.shards {
        bail!(
            "--shard {} is not a shard of these rules, which spread replicas over {} relay shard(s) ([relay] shards): name 0 to {}",
            a.shard,
            rules.shards,
            rules.shards - 1
        );
    }
    // No ping before each use of a pooled connection: serve makes a few statements per
    // request, and the ping was one more round trip each time. A connection the database
    // dropped fails its request (the replica sends it again) and leaves the pool.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .test_before_acquire(false)
        .connect(&a.db)
        .await
        .with_context(|| format!("cannot connect to --db {}", redact(&a.db)))?;
    let spec = Arc::new(spec(&pool, &rules).await?);
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("cannot listen on --listen {}", a.listen))?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stats = Arc::new(RelayStats::default());
    let records = spec.records.clone();
    let relay_task = if a.no_relay {
        None
    } else {
        let mut relay = Relay::new(spec, settings);
        relay.stats = stats.clone();
        let url = a.db.clone();
        let stop = stop_rx.clone();
        Some(tokio::spawn(async move { relay.run(&url, stop).await }))
    };
    let serve = ferry_sync::serve::Serve::new(pool.clone(), stats)
        .await?
        .stop_on(stop_rx.clone())
        .file_into(
            records,
            ferry_sync::file::Shape {
                role: a.file_role.clone(),
            },
        );
    let nats_task = match &a.nats {
        None => None,
        Some(url) => {
            let names = ferry_sync::nats::Names::new(&a.nats_prefix).map_err(|e| anyhow!("{e}"))?;
            let bridge = ferry_sync::nats::bridge::Bridge::connect(serve.clone(), url, names)
                .await
                .map_err(|e| anyhow!("--nats: {e}"))?;
            tracing::info!(nats = %url, prefix = %a.nats_prefix, "ferry sync serve: carrying replicas over NATS JetStream too");
            let stop = stop_rx.clone();
            Some(tokio::spawn(async move { bridge.run(stop).await }))
        }
    };
    tracing::info!(listen = %a.listen, db = %redact(&a.db), relay = !a.no_relay, shard = a.shard, "ferry sync serve: serving replicas");
    let mut stop_http = stop_rx.clone();
    let http = tokio::spawn(async move {
        axum::serve(listener, serve.router())
            .with_graceful_shutdown(async move {
                let _ = stop_http.wait_for(|s| *s).await;
            })
            .await
    });
    // A bridge that fails stops the process with its error (a serve that no longer
    // carries NATS traffic must not pass for one that does); SIGTERM stops it cleanly.
    let mut nats_task = nats_task;
    let bridge_failed = tokio::select! {
        _ = crate::terminated() => None,
        r = async { nats_task.as_mut().expect("only polled with a bridge").await },
            if nats_task.is_some() =>
        {
            nats_task = None;
            Some(match r {
                Ok(Ok(())) => anyhow!("--nats: the bridge stopped"),
                Ok(Err(e)) => anyhow!("--nats: {e}"),
                Err(e) => anyhow!("--nats: {e}"),
            })
        }
    };
    let _ = stop_tx.send(true);
    if let Some(t) = relay_task {
        t.await??;
    }
    if let Some(t) = nats_task {
        t.await?.map_err(|e| anyhow!("--nats: {e}"))?;
    }
    http.await??;
    if let Some(e) = bridge_failed {
        tracing::error!(error = %e, "ferry sync serve: stopping");
        return Err(e);
    }
    tracing::info!("ferry sync serve: stopped");
    Ok(())
}

async fn status(a: StatusArgs) -> anyhow::Result<()> {
    let pool = connect(&a.db).await?;
    let s = ferry_sync::status::read(&pool, a.partition.as_deref()).await?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    println!(
        "epoch {}  notes pending {} (oldest {} ms)  parked {}  restores {}",
        s.epoch,
        s.notes_pending,
        s.oldest_pending_ms.unwrap_or(0),
        s.notes_parked,
        s.restores
    );
    let rows: Vec<Vec<String>> = s
        .replicas
        .iter()
        .map(|r| {
            vec![
                r.id.clone(),
                r.partition.clone().unwrap_or_default(),
                r.standing.to_string(),
                format!("{}/{}", r.confirmed_seq, r.last_seq),
                r.outbox_messages.to_string(),
                r.held_rows.to_string(),
                r.quarantined.to_string(),
                r.filings.to_string(),
                r.inbox.to_string(),
                r.heard_ago_ms
                    .map_or("never".into(), |ms| format!("{ms} ms")),
            ]
        })
        .collect();
    print!(
        "{}",
        crate::table::render(
            &[
                "replica",
                "partition",
                "standing",
                "confirmed",
                "outbox",
                "held",
                "quarantined",
                "filings",
                "inbox",
                "heard"
            ],
            &rows
        )
    );
    let tables: Vec<Vec<String>> = s
        .replicas
        .iter()
        .flat_map(|r| r.tables.iter().map(move |t| (r, t)))
        .map(|(r, t)| {
            vec![
                r.id.clone(),
                t.table.clone(),
                t.kind.to_string(),
                format!("{}/{}", t.confirmed, t.rows),
                t.pending.to_string(),
                t.quarantined.to_string(),
                match (t.covered, t.latest_pass) {
                    (Some(true), _) => "yes".into(),
                    (Some(false), Some(latest)) => {
                        format!("no (mark {} < pass {latest})", r.confirmed_pass)
                    }
                    _ => "-".into(),
                },
            ]
        })
        .collect();
    if !tables.is_empty() {
        println!();
        print!(
            "{}",
            crate::table::render(
                &[
                    "replica",
                    "table",
                    "kind",
                    "confirmed",
                    "pending",
                    "quarantined",
                    "mark covers latest"
                ],
                &tables
            )
        );
    }
    Ok(())
}

fn replica(a: ReplicaArgs) -> anyhow::Result<()> {
    if let Some(ReplicaSub::Status(s)) = a.status {
        let replica = Replica::open(&s.db, [0u8; 32])
            .with_context(|| format!("cannot open --db {}", s.db.display()))?;
        let st = replica.status()?;
        if s.json {
            println!("{}", serde_json::to_string_pretty(&st)?);
        } else {
            println!(
                "position seq {} (epoch {})  gap {}  rejections {}  retired {}  standing {}",
                st.seq,
                st.epoch.as_deref().unwrap_or("none"),
                st.gap,
                st.rejections,
                st.retired,
                st.standing.map_or(
                    "see the running replica's /status (--metrics-listen)".to_string(),
                    |s| s.name().to_string()
                )
            );
            for t in &st.tables {
                println!("  {:<32} {:>10} rows", t.name, t.rows);
            }
        }
        return Ok(());
    }
    let server = a.server.ok_or_else(|| {
        anyhow!("--server is required (http://HOST:PORT of a `ferry sync serve`, or nats://HOST:PORT of the NATS server one bridges to)")
    })?;
    let db =
        a.db.ok_or_else(|| anyhow!("--db is required (the local SQLite file)"))?;
    let id =
        a.id.ok_or_else(|| anyhow!("--id is required (this replica's uuid)"))?;
    let token = crate::read_token(&a.token_file)?
        .ok_or_else(|| anyhow!("--token-file is required (from `ferry sync enroll`)"))?;
    let mut link = open_link(&server, &a.nats_prefix, id, &token)?;
    let mut replica = Replica::open(&db, ferry_sync::wire::seal_key(token.as_bytes()))
        .with_context(|| format!("cannot open --db {}", db.display()))?;
    let settings = RunSettings {
        window: a.window,
        keepalive: Duration::from_millis(a.keepalive_ms),
        wait: Duration::from_millis(a.wait_ms),
        offline_after: Duration::from_millis(a.offline_after_ms),
        ..RunSettings::default()
    };
    settings.check().map_err(|e| {
        let given = match e.setting {
            "window" => a.window.to_string(),
            "wait" => a.wait_ms.to_string(),
            "keepalive" => a.keepalive_ms.to_string(),
            "offline_after" => a.offline_after_ms.to_string(),
            _ => e.value.clone(),
        };
        REPLICA_FLAGS.error(&e, Some(given))
    })?;
    let live = Arc::new(Live::new());
    if let Some(addr) = &a.metrics_listen {
        let listener = std::net::TcpListener::bind(addr)
            .with_context(|| format!("cannot listen on --metrics-listen {addr}"))?;
        serve_replica_metrics(listener, live.clone(), db.clone())?;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a signal runtime starts");
        rt.block_on(crate::terminated());
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
    });
    // The way up runs beside the loop, on its own connection and link, so a write is
    // uploaded while the loop waits in its long poll (docs/sync-up.md §3.2).
    let mut uploader =
        ferry_sync::replica::Uploader::open(&db, ferry_sync::wire::seal_key(token.as_bytes()), id)
            .with_context(|| format!("cannot open --db {}", db.display()))?;
    let mut uplink = open_link(&server, &a.nats_prefix, id, &token)?;
    // One network under both: when either hears the server again, the other stops
    // waiting out its backoff.
    let link_back = Arc::new(ferry_sync::replica::LinkBack::default());
    uploader.set_link_back(link_back.clone());
    replica.set_link_back(link_back);
    let up_stop = stop.clone();
    let up = std::thread::spawn(move || {
        let end = uploader.run(
            &mut uplink,
            &up_stop,
            &ferry_sync::replica::UpSettings::default(),
        );
        // A permanent failure of the way up stops the whole replica, with its error.
        up_stop.store(true, std::sync::atomic::Ordering::SeqCst);
        end
    });
    tracing::info!(%server, db = %db.display(), %id, "ferry sync replica: following");
    let end = replica.run_live(&mut link, &stop, &settings, &live);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let up_end = up.join().map_err(|_| anyhow!("the uploader panicked"))?;
    let end = end?;
    up_end?;
    tracing::info!(?end, "ferry sync replica: stopped");
    Ok(())
}

/// The replica loop's settings as its flags spell them.
const REPLICA_FLAGS: crate::grammar::Flags = crate::grammar::Flags(&[
    ("window", "--window"),
    ("wait", "--wait-ms"),
    ("keepalive", "--keepalive-ms"),
    ("offline_after", "--offline-after-ms"),
]);

/// Serve the running replica's /metrics (its counters and standing, from `live` alone),
/// /status (its file read on a connection of its own, with `live`) and /healthz, on a
/// thread of its own: the replica's loop is synchronous and must not wait on a scrape.
/// A replica's transport, by its server's scheme.
fn open_link(
    server: &str,
    prefix: &str,
    id: uuid::Uuid,
    token: &str,
) -> anyhow::Result<ferry_sync::client::Link> {
    ferry_sync::client::Link::new(server, prefix, id, token).map_err(|e| {
        anyhow!("{e} (the server is http(s):// for a `ferry sync serve`, nats:// for the NATS server one bridges to)")
    })
}

fn serve_replica_metrics(
    listener: std::net::TcpListener,
    live: Arc<Live>,
    db: PathBuf,
) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics and /status");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the metrics runtime")?;
    let listener = {
        let _entered = rt.enter();
        tokio::net::TcpListener::from_std(listener)?
    };
    let live_metrics = live.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let live = live_metrics.clone();
                async move { live.metrics() }
            }),
        )
        .route(
            "/status",
            axum::routing::get(move || {
                let (live, db) = (live.clone(), db.clone());
                async move { replica_status(&live, db).await }
            }),
        )
        .route("/healthz", axum::routing::get(|| async { "ok\n" }));
    std::thread::Builder::new()
        .name("replica-metrics".into())
        .spawn(move || {
            rt.block_on(async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!("metrics server stopped: {e}");
                }
            })
        })
        .context("starting the metrics thread")?;
    Ok(())
}

/// /status: the file's status (counting each table's rows, off the async thread) with
/// what the running loop knows.
async fn replica_status(live: &Live, db: PathBuf) -> axum::response::Response {
    use axum::response::IntoResponse;
    match tokio::task::spawn_blocking(move || ferry_sync::replica::read_status(&db)).await {
        Ok(Ok(file)) => axum::Json(live.status(file)).into_response(),
        Ok(Err(e)) => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({
                "error": format!("{e}; the running replica's standing is {}", live.standing().name())
            })),
        )
            .into_response(),
        Err(e) => (
            axum::http::StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading the replica's status failed: {e}"),
        )
            .into_response(),
    }
}
