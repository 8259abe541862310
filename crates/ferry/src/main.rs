//! The `ferry` command: `ferry <engine> <verb> [flags]` (`grammar.rs` has the rules).
//! Every flag can also come from `FERRY_<ENGINE>_<FLAG>`; logs go to stderr through
//! `tracing` (filter with `FERRY_LOG`, e.g. `FERRY_LOG=debug`; `FERRY_LOG_FORMAT=json`).

mod demo;
mod demo_flow;
mod demo_flow_server;
mod demo_outbox;
mod demo_sync;
mod flow;
mod flow_client;
mod flow_serve;
mod grammar;
mod outbox;
mod report;
mod ship;
mod sync;
mod table;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
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
    /// Warm standby copies of SQLite databases: ship a directory's databases to a
    /// receiver, receive them into replicas, promote a replica, and show status.
    #[command(subcommand)]
    Ship(ShipSub),
    /// The transactional outbox: install its schema, relay messages, inspect and repair.
    #[command(subcommand)]
    Outbox(outbox::OutboxSub),
    /// Durable execution: list, show, signal and cancel the runs of a ferry-flow engine.
    #[command(subcommand)]
    Flow(flow::FlowSub),
    /// Partial replicas of Postgres tables on SQLite: check and install the rules, enrol
    /// replicas, serve them, follow a server from a replica, and show where each stands.
    #[command(subcommand)]
    Sync(sync::SyncSub),
    /// The engine process of the demo's flow part (the demo starts and kills it).
    #[command(hide = true)]
    DemoFlowEngine(demo_flow::EngineArgs),
    /// A worker process of the demo's flow server part (the demo starts and kills it).
    #[command(hide = true)]
    DemoFlowWorker(demo_flow_server::WorkerArgs),
    /// The demo's flow server part alone.
    #[command(hide = true)]
    DemoFlowServer(demo_flow_server::PartArgs),
}

#[derive(Subcommand)]
enum ShipSub {
    /// Ship every *.db in a directory to a receiver until SIGTERM (the sidecar).
    Send(ship::ShipArgs),
    /// Show what each database's shipper has shipped (from a running shipper's
    /// --metrics-listen address, or from the directory's saved state).
    Status(ship::ShipStatusArgs),
    /// Receive shipped databases into replicas until SIGTERM (the standby).
    Receive(ship::ReceiveArgs),
    /// Show each replica's position, epoch and lag (from a running receiver, or from its
    /// directory).
    Replicas(ship::ReceiveStatusArgs),
    /// Fence a replica and turn it into a primary database at a new path.
    Promote(ship::PromoteArgs),
}

fn main() -> ExitCode {
    // Before any thread starts: old variable names are copied to the new ones.
    let old_variables = grammar::read_old_variables();
    let (args, old_spelling) = grammar::rewrite_aliases(std::env::args_os().collect());
    let matches = grammar::with_env(Cli::command()).get_matches_from(args);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // The demo prints its own report of what happened, failures included; logs of its
    // components (a receiver killed on purpose, a primary fenced on purpose) would drown it.
    init_logging(
        if matches!(cli.command, Command::Demo(_) | Command::DemoFlowServer(_)) {
            "off"
        } else {
            "info"
        },
    );
    for warning in old_variables.iter().chain(&old_spelling) {
        tracing::warn!("{warning}");
    }
    let result = match cli.command {
        Command::Demo(a) => demo::run(a),
        Command::Ship(ShipSub::Send(a)) => ship::ship(a),
        Command::Ship(ShipSub::Status(a)) => ship::ship_status(a),
        Command::Ship(ShipSub::Receive(a)) => ship::receive(a),
        Command::Ship(ShipSub::Replicas(a)) => ship::receive_status(a),
        Command::Ship(ShipSub::Promote(a)) => ship::promote(a),
        Command::Outbox(sub) => outbox::run(sub),
        Command::Flow(sub) => flow::run(sub),
        Command::Sync(sub) => sync::run(sub),
        Command::DemoFlowEngine(a) => demo_flow::engine(a),
        Command::DemoFlowWorker(a) => demo_flow_server::worker(a),
        Command::DemoFlowServer(a) => demo_flow_server::part(a),
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
    // async-nats logs every reconnection attempt, and a reconnect as an unexplained
    // `ERROR expected INFO, got nothing`; the outbox logs each NATS event itself, with
    // the server and what happened.
    let filter = EnvFilter::try_from_env("FERRY_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("{default},async_nats=off")));
    let json = std::env::var("FERRY_LOG_FORMAT").is_ok_and(|v| v == "json");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only for a person at a terminal, not in a log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
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
