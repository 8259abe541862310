//! `ferry ship`, `ferry receive`, `ferry promote` and their status commands.

use crate::grammar::Flags;
use crate::table;
use anyhow::{Context, anyhow, bail};
use clap::Args;
use ferry_core::ConfigError;
use ferry_core::epoch::Epoch;
use ferry_ship::receiver::{ReceiverStatus, server};
use ferry_ship::shipper::{FOLD_MIN_FRAMES, ShipperStatus, WAL_MAX_BYTES};
use ferry_ship::{Receiver, ReceiverConfig, Shipper, ShipperConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Args)]
pub struct ShipArgs {
    /// Directory holding the databases to ship (NAME.db files in WAL mode).
    #[arg(long, required = true)]
    pub dir: Option<PathBuf>,
    /// Receiver URL, e.g. http://standby:7350.
    #[arg(long, required = true)]
    pub peer: Option<String>,
    /// Ship only these databases (NAME or NAME.db); repeat the flag. Default: every *.db.
    #[arg(long = "db", value_name = "NAME", value_delimiter = ',')]
    pub dbs: Vec<String>,
    /// File holding the bearer token the receiver expects.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Ship with at least this fencing epoch (to take a name over after a promotion).
    #[arg(long)]
    pub epoch: Option<u64>,
    /// Worker threads stepping databases.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// WAL bytes not acknowledged by the receiver before the shipper gives up the stream,
    /// folds the WAL, and sends a base when the receiver is back.
    #[arg(long, default_value_t = WAL_MAX_BYTES)]
    pub wal_max_bytes: u64,
    /// Frames in the WAL before the shipper folds it (once the receiver has them).
    #[arg(long, default_value_t = FOLD_MIN_FRAMES)]
    pub fold_min_frames: u32,
    /// Niceness of the shipper's threads, 0 to 19 (0 leaves them alone): a nice shipper
    /// lets the app it runs beside take a core back the moment the app needs it.
    #[arg(long, default_value_t = ferry_ship::shipper::NICE)]
    pub nice: i32,
    /// Serve /metrics and /status on this address, e.g. 127.0.0.1:7351.
    #[arg(long)]
    pub metrics_listen: Option<String>,
}

#[derive(Args)]
pub struct ShipStatusArgs {
    /// A running shipper's --metrics-listen address (http://HOST:PORT).
    #[arg(long)]
    pub url: Option<String>,
    /// The shipper's directory, to show its saved state when it is not running.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ReceiveArgs {
    /// Directory holding the replicas (created if missing).
    #[arg(long, required = true)]
    pub dir: Option<PathBuf>,
    /// Address to listen on, e.g. 0.0.0.0:7350.
    #[arg(long, required = true)]
    pub listen: Option<String>,
    /// File holding the bearer token shippers must present.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Largest request body of transactions, in bytes.
    #[arg(long, default_value_t = ferry_ship::receiver::BODY_BYTES_MAX)]
    pub max_body_bytes: u64,
    /// Largest base (a whole database), in bytes.
    #[arg(long, default_value_t = ferry_ship::receiver::BASE_BYTES_MAX)]
    pub max_base_bytes: u64,
    /// Skip PRAGMA quick_check on incoming bases (faster for huge databases).
    #[arg(long)]
    pub no_base_check: bool,
}

#[derive(Args)]
pub struct ReceiveStatusArgs {
    /// A running receiver's URL (http://HOST:PORT).
    #[arg(long)]
    pub url: Option<String>,
    /// The receiver's directory, to read replicas' positions when it is not running.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Token file, if the receiver has one.
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct PromoteArgs {
    /// The receiver's directory.
    #[arg(long)]
    pub dir: PathBuf,
    /// The database to promote (NAME or NAME.db).
    pub name: String,
    /// Where to put the promoted database; must not exist.
    #[arg(long)]
    pub to: PathBuf,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Each library setting (`ShipperConfig`, `ReceiverConfig`, promote's destination) and
/// the flag that gives it: library errors name settings, a person typed flags.
const FLAGS: Flags = Flags(&[
    ("dir", "--dir"),
    ("peer", "--peer"),
    ("names", "--db"),
    ("token", "--token-file"),
    ("epoch", "--epoch"),
    ("workers", "--workers"),
    ("wal_max_bytes", "--wal-max-bytes"),
    ("fold_min_frames", "--fold-min-frames"),
    ("nice", "--nice"),
    ("max_body_bytes", "--max-body-bytes"),
    ("max_base_bytes", "--max-base-bytes"),
    ("dest", "--to"),
]);

/// A library error as one sentence: its message already carries its cause, which `{:#}`
/// would print a second time.
fn said(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("{e}")
}

/// A setting error as a person reads it: the flag, the value given, why (`Flags::error`);
/// the token's value is a secret, so its file is named instead.
fn flagged(e: &ConfigError) -> anyhow::Error {
    if e.setting == "token" {
        return anyhow!("the token in --token-file {}", FLAGS.reason(e));
    }
    FLAGS.error(e, None)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub fn ship(a: ShipArgs) -> anyhow::Result<()> {
    let dir = a.dir.expect("clap requires --dir");
    let mut config = ShipperConfig::new(dir, a.peer.expect("clap requires --peer"));
    config.names = a
        .dbs
        .iter()
        .map(|n| ferry_ship::names::from_argument(n))
        .collect::<Result<_, _>>()
        .map_err(said)?;
    config.token = crate::read_token(&a.token_file)?;
    config.epoch = a.epoch.map(Epoch);
    config.workers = a.workers;
    config.wal_max_bytes = a.wal_max_bytes;
    config.fold_min_frames = a.fold_min_frames;
    config.nice = a.nice;
    for n in &config.names {
        if !config.dir.join(format!("{n}.db")).exists() {
            tracing::warn!(db = %n, "{n}.db does not exist in {} yet; it ships once it appears", config.dir.display());
        }
    }
    let rt = runtime()?;
    let listener = match &a.metrics_listen {
        Some(addr) => Some(
            rt.block_on(tokio::net::TcpListener::bind(addr))
                .with_context(|| format!("cannot listen on --metrics-listen {addr}"))?,
        ),
        None => None,
    };
    let shipper = Arc::new(Shipper::start(config.clone()).map_err(|e| match e {
        ferry_ship::shipper::StartError::Config(c) => flagged(&c),
        e => said(e),
    })?);
    tracing::info!(dir = %config.dir.display(), peer = %config.peer, "shipping");
    rt.block_on(async {
        if let Some(listener) = listener {
            tracing::info!(addr = %listener.local_addr()?, "serving /metrics and /status");
            let s = shipper.clone();
            let app = axum::Router::new()
                .route(
                    "/metrics",
                    axum::routing::get({
                        let s = s.clone();
                        move || async move { s.metrics() }
                    }),
                )
                .route(
                    "/status",
                    axum::routing::get(move || async move { axum::Json(s.status()) }),
                )
                .route("/healthz", axum::routing::get(|| async { "ok\n" }));
            tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!("metrics server stopped: {e}");
                }
            });
        }
        let s = shipper.clone();
        tokio::spawn(async move { report_progress(s).await });
        crate::terminated().await;
        anyhow::Ok(())
    })?;
    shipper.shutdown();
    tracing::info!("shipper stopped; state saved");
    Ok(())
}

/// Log the progress of bases in flight every few seconds.
async fn report_progress(s: Arc<Shipper>) {
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        for d in s.status().databases {
            if let Some((sent, total)) = d.base_progress {
                tracing::info!(db = %d.name, "base: {} of {} sent ({:.0}%)", table::bytes(sent), table::bytes(total), sent as f64 * 100.0 / total.max(1) as f64);
            }
        }
    }
}

pub fn receive(a: ReceiveArgs) -> anyhow::Result<()> {
    let mut config = ReceiverConfig::new(a.dir.expect("clap requires --dir"));
    config.token = crate::read_token(&a.token_file)?;
    config.max_body_bytes = a.max_body_bytes;
    config.max_base_bytes = a.max_base_bytes;
    config.base_quick_check = !a.no_base_check;
    let listen = a.listen.expect("clap requires --listen");
    let receiver = Receiver::open(config.clone()).map_err(|e| match e {
        ferry_ship::receiver::OpenError::Config(c) => flagged(&c),
        e => said(e),
    })?;
    receiver.start_checkpointer();
    let rt = runtime()?;
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(&listen).await.with_context(|| format!("cannot listen on --listen {listen}"))?;
        tracing::info!(addr = %listener.local_addr()?, dir = %config.dir.display(), token = config.token.is_some(), "receiving");
        server::serve(receiver, listener, crate::terminated()).await.context("serving")?;
        tracing::info!("receiver stopped");
        anyhow::Ok(())
    })
}

pub fn promote(a: PromoteArgs) -> anyhow::Result<()> {
    let name = ferry_ship::names::from_argument(&a.name).map_err(said)?;
    let mut last = std::time::Instant::now();
    let mut progress = |done: u32, total: u32| {
        if last.elapsed() >= Duration::from_secs(2) {
            eprintln!("copying: {done} of {total} pages");
            last = std::time::Instant::now();
        }
    };
    let p = ferry_ship::promote(&a.dir, &name, &a.to, &mut progress).map_err(|e| match e {
        ferry_ship::receiver::PromoteError::Config(c) => flagged(&c),
        e => said(e),
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        println!(
            "promoted {} to {} at epoch {}: {} pages ({}), the primary as of transaction {} of generation {:#x}.\n\
             The old primary is fenced: the receiver refuses its epoch. A shipper started on {} ships with epoch {}.",
            p.name,
            p.path,
            p.epoch,
            p.pages,
            table::bytes(p.bytes),
            p.seq,
            p.generation,
            p.path,
            p.epoch
        );
    }
    Ok(())
}

fn get_json<T: serde::de::DeserializeOwned>(url: &str, token: Option<String>) -> anyhow::Result<T> {
    let agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .new_agent();
    let mut req = agent.get(url);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let mut resp = req.call().with_context(|| format!("cannot reach {url}"))?;
    let text = resp
        .body_mut()
        .read_to_string()
        .with_context(|| format!("reading the reply of {url}"))?;
    serde_json::from_str(&text)
        .with_context(|| format!("{url} did not answer with a status: {text:.200}"))
}

pub fn ship_status(a: ShipStatusArgs) -> anyhow::Result<()> {
    if let Some(url) = a.url {
        let status: ShipperStatus =
            get_json(&format!("{}/status", url.trim_end_matches('/')), None)?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&status)?);
            return Ok(());
        }
        println!(
            "shipping {} to {} (up {}s)",
            status.dir, status.peer, status.uptime_secs
        );
        let rows: Vec<Vec<String>> = status
            .databases
            .iter()
            .map(|d| {
                vec![
                    d.name.clone(),
                    d.state.clone(),
                    d.epoch.to_string(),
                    d.acked_seq.to_string(),
                    d.lag_transactions.to_string(),
                    table::bytes(d.lag_bytes),
                    format!("{:.3}", d.lag_seconds),
                    d.bases.values().sum::<u64>().to_string(),
                    d.failures.to_string(),
                    d.last_error.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        print!(
            "{}",
            table::render(
                &[
                    "DB",
                    "STATE",
                    "EPOCH",
                    "ACKED",
                    "LAG TX",
                    "LAG BYTES",
                    "LAG S",
                    "BASES",
                    "FAILS",
                    "LAST ERROR"
                ],
                &rows
            )
        );
        return Ok(());
    }
    let Some(dir) = a.dir else {
        bail!("give --url of a running shipper's --metrics-listen, or --dir of its directory")
    };
    let states = ferry_ship::shipper::offline_status(&dir).map_err(said)?;
    if a.json {
        let v: Vec<_> = states
            .iter()
            .map(|(n, s)| match s {
                Ok(s) => serde_json::json!({"name": n, "state": s}),
                Err(e) => serde_json::json!({"name": n, "error": e.to_string()}),
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "saved shipper state in {} (start the shipper with --metrics-listen for live lag)",
        dir.display()
    );
    let rows: Vec<Vec<String>> = states
        .iter()
        .map(|(n, s)| match s {
            Ok(s) => vec![
                n.clone(),
                s.epoch.to_string(),
                format!("{:#x}", s.generation),
                s.acked_seq.to_string(),
                if s.needs_base { "yes" } else { "no" }.into(),
            ],
            Err(e) => vec![n.clone(), "-".into(), "-".into(), "-".into(), e.to_string()],
        })
        .collect();
    print!(
        "{}",
        table::render(&["DB", "EPOCH", "GENERATION", "ACKED", "BASE OWED"], &rows)
    );
    Ok(())
}

pub fn receive_status(a: ReceiveStatusArgs) -> anyhow::Result<()> {
    let token = crate::read_token(&a.token_file)?;
    let status: ReceiverStatus = if let Some(url) = a.url {
        get_json(&format!("{}/status", url.trim_end_matches('/')), token)?
    } else if let Some(dir) = a.dir {
        ferry_ship::receiver::offline_status(&dir).map_err(said)?
    } else {
        bail!("give --url of a running receiver, or --dir of its directory");
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
        return Ok(());
    }
    println!("replicas in {}", status.dir);
    let rows: Vec<Vec<String>> = status
        .replicas
        .iter()
        .map(|r| {
            vec![
                r.name.clone(),
                if r.promoted {
                    "promoted"
                } else if r.has_replica {
                    "replica"
                } else {
                    "none"
                }
                .into(),
                r.epoch.to_string(),
                format!("{:#x}", r.generation),
                r.seq.to_string(),
                table::bytes(r.bytes),
                r.lag_ms.map_or("-".into(), |l| format!("{l} ms")),
                r.last_error.clone().unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    print!(
        "{}",
        table::render(
            &[
                "DB",
                "STATE",
                "EPOCH",
                "GENERATION",
                "SEQ",
                "SIZE",
                "LAG",
                "LAST ERROR"
            ],
            &rows
        )
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Guards the setting-to-flag table: an error names the flag a person typed, and so
    // does its reason for a setting of more than one word, while one-word settings stay
    // words in prose.
    #[test]
    fn a_setting_error_is_reported_with_flags() {
        let e = ConfigError::new("max_body_bytes", 5, "is below max_base_bytes for this dir");
        assert_eq!(
            flagged(&e).to_string(),
            "--max-body-bytes 5: is below --max-base-bytes for this dir"
        );
        assert_eq!(FLAGS.of("names"), "--db");
        assert_eq!(
            FLAGS.of("lease"),
            "lease",
            "no flag: the setting's own name"
        );
    }
}
