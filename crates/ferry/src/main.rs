//! The `ferry` command. Flags can also come from `FERRY_*` environment variables; logs go
//! to stderr through `tracing` (filter with `FERRY_LOG`, e.g. `FERRY_LOG=debug`).

mod demo;
mod demo_flow;
mod demo_outbox;
mod flow;
mod outbox;
mod ship;
mod table;

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "ferry",
    version,
    about = "Moves data between processes, machines and databases without losing any of it."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run ferry's main jobs on a temporary directory and report what happened: a live
    /// database shipped to a standby, the standby killed and restarted, then promoted
    /// and checked equal to the primary; then orders and their events written in one
    /// transaction and relayed to a webhook that goes down and comes back; then order
    /// workflows run through a SIGKILL of their engine.
    Demo(demo::DemoArgs),
    /// Ship every *.db in a directory to a receiver (ferry-ship's sidecar), or show status.
    Ship(ShipCommand),
    /// Receive shipped databases into replicas, or show status.
    Receive(ReceiveCommand),
    /// Fence a replica and turn it into a primary database at a new path.
    Promote(ship::PromoteArgs),
    /// The transactional outbox: install its schema, relay messages, inspect and repair.
    #[command(subcommand)]
    Outbox(outbox::OutboxSub),
    /// Durable execution: list, show, signal and cancel the runs of a ferry-flow engine.
    #[command(subcommand)]
    Flow(flow::FlowSub),
    /// The engine process of the demo's flow part (the demo starts and kills it).
    #[command(hide = true)]
    DemoFlowEngine(demo_flow::EngineArgs),
}

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
struct ShipCommand {
    #[command(subcommand)]
    sub: Option<ShipSub>,
    #[command(flatten)]
    run: ship::ShipArgs,
}

#[derive(Subcommand)]
enum ShipSub {
    /// Show what each database's shipper has shipped (from a running shipper's
    /// --metrics-listen address, or from the directory's saved state).
    Status(ship::ShipStatusArgs),
}

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
struct ReceiveCommand {
    #[command(subcommand)]
    sub: Option<ReceiveSub>,
    #[command(flatten)]
    run: ship::ReceiveArgs,
}

#[derive(Subcommand)]
enum ReceiveSub {
    /// Show each replica's position, epoch and lag (from a running receiver, or from its
    /// directory).
    Status(ship::ReceiveStatusArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo prints its own report of what happened, failures included; logs of its
    // components (a receiver killed on purpose, a primary fenced on purpose) would drown it.
    init_logging(if matches!(cli.command, Command::Demo(_)) {
        "off"
    } else {
        "info"
    });
    let result = match cli.command {
        Command::Demo(a) => demo::run(a),
        Command::Ship(ShipCommand {
            sub: Some(ShipSub::Status(a)),
            ..
        }) => ship::ship_status(a),
        Command::Ship(ShipCommand { sub: None, run }) => ship::ship(run),
        Command::Receive(ReceiveCommand {
            sub: Some(ReceiveSub::Status(a)),
            ..
        }) => ship::receive_status(a),
        Command::Receive(ReceiveCommand { sub: None, run }) => ship::receive(run),
        Command::Promote(a) => ship::promote(a),
        Command::Outbox(sub) => outbox::run(sub),
        Command::Flow(sub) => flow::run(sub),
        Command::DemoFlowEngine(a) => demo_flow::engine(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(default: &str) {
    use tracing_subscriber::EnvFilter;
    // async-nats reports every reconnection attempt at info; ferry says what matters.
    let filter = EnvFilter::try_from_env("FERRY_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("{default},async_nats=warn")));
    let json = std::env::var("FERRY_LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Read a token file: one line, surrounding whitespace ignored.
pub fn read_token(path: &Option<PathBuf>) -> anyhow::Result<Option<String>> {
    let Some(path) = path else { return Ok(None) };
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read the token file {}: {e}", path.display()))?;
    let token = text.trim().to_string();
    if token.is_empty() {
        anyhow::bail!("the token file {} is empty", path.display());
    }
    Ok(Some(token))
}

/// Wait for SIGTERM or SIGINT.
pub async fn terminated() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term =
        signal(SignalKind::terminate()).expect("installing a SIGTERM handler works on Unix");
    let mut int =
        signal(SignalKind::interrupt()).expect("installing a SIGINT handler works on Unix");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
}
