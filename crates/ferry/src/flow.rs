//! `ferry flow list|show|metrics|signal|cancel --dir DIR`: look at and steer the runs of a
//! ferry-flow engine from outside its process, through the status file and request
//! inbox it keeps in its directory (docs/flow.md §7; `ferry_flow::admin`).
//! With `--server URL` instead of `--dir`, the same commands (and `start`, `result`) go
//! to a flow server's HTTP API (`flow_client.rs`).
//! `ferry flow serve`: server mode's server (docs/flow-server.md; `flow_serve.rs`).

use crate::table;
use clap::{Args, Subcommand};
use ferry_flow::admin::{self, Request, RunView, Status};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Subcommand)]
pub enum FlowSub {
    /// List the runs of the engine on DIR, with its recovery time and log figures.
    List(ListArgs),
    /// Show one run: state, output or error or park reason, published state.
    Show(ShowArgs),
    /// Print the engine's metrics in the Prometheus text format (fresh from a running
    /// engine, else as it last wrote them), e.g. for node_exporter's textfile collector.
    Metrics(MetricsArgs),
    /// Send a signal to a run (VALUE is JSON; default null). Returns once the engine
    /// journaled it durably.
    Signal(SignalArgs),
    /// Ask a run to cancel: its next suspension point returns Cancelled, so it can
    /// run cleanup steps; a parked run ends cancelled at once.
    Cancel(CancelArgs),
    /// Start a run on a flow server's workers (INPUT is JSON; default null). Returns
    /// once the start is durable; starting an existing id returns that run.
    Start(StartArgs),
    /// Wait for a run on a flow server to end, and show how it ended.
    Result(ResultArgs),
    /// Server mode's server: holds the journal of every shard in DIR and leases the
    /// shards to workers (applications opened with `.server(ADDR)`) under epochs
    /// (docs/flow-server.md). Runs until SIGTERM.
    Serve(crate::flow_serve::ServeArgs),
}

#[derive(Args)]
pub struct DirArg {
    /// The engine's directory (its log, status file and inbox).
    #[arg(long)]
    pub dir: PathBuf,
}

/// An embedded engine's directory, or a flow server's HTTP API.
#[derive(Args)]
pub struct Target {
    #[command(flatten)]
    pub at: Where,
    /// With --server: a bearer token the server knows (its --token-file).
    #[arg(long, env = "FERRY_FLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

#[derive(Args)]
#[group(required = true, multiple = false)]
pub struct Where {
    /// The engine's directory (its log, status file and inbox).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// A flow server's HTTP API instead (`ferry flow serve --http`): http://HOST:PORT.
    #[arg(long)]
    pub server: Option<String>,
}

/// A flow server's HTTP API, for the commands only a server answers.
#[derive(Args)]
pub struct ServerArg {
    /// The flow server's HTTP API (`ferry flow serve --http`): http://HOST:PORT.
    #[arg(long)]
    pub server: String,
    /// A bearer token the server knows (its --token-file).
    #[arg(long, env = "FERRY_FLOW_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

impl Target {
    /// The server client, if the target is a server.
    fn client(&self, timeout_ms: u64) -> anyhow::Result<Option<crate::flow_client::Client>> {
        self.at
            .server
            .as_deref()
            .map(|s| {
                crate::flow_client::Client::new(
                    s,
                    self.token.clone(),
                    Duration::from_millis(timeout_ms),
                )
            })
            .transpose()
    }

    fn dir(&self) -> &Path {
        self.at
            .dir
            .as_deref()
            .expect("clap asks for --dir or --server")
    }
}

#[derive(Args)]
pub struct MetricsArgs {
    #[command(flatten)]
    pub dir: DirArg,
    /// Print JSON: {"fresh", "samples": [{"name", "labels", "value"}]}.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ListArgs {
    #[command(flatten)]
    pub target: Target,
    /// Only runs in this state: running, finished, failed, cancelled, parked.
    #[arg(long)]
    pub state: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ShowArgs {
    #[command(flatten)]
    pub target: Target,
    /// The run's id.
    pub id: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct SignalArgs {
    #[command(flatten)]
    pub target: Target,
    /// The run's id.
    pub id: String,
    /// The signal's name, as the workflow's `Signal::new` spells it.
    pub name: String,
    /// The signal's value, as JSON.
    #[arg(default_value = "null")]
    pub value: String,
    /// How long to wait for the engine's answer, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// With --server: deliver it once per KEY, however often it is sent.
    #[arg(long, requires = "server")]
    pub key: Option<String>,
    /// Print the answer as JSON: {"ok", "queued", "message"}.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct StartArgs {
    #[command(flatten)]
    pub server: ServerArg,
    /// The workflow, as the workers register it.
    pub workflow: String,
    /// The run's id (also what makes a second start return the first run).
    pub id: String,
    /// The input, as JSON.
    #[arg(default_value = "null")]
    pub input: String,
    /// Print the answer as JSON: {"ok", "queued", "message"}.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct ResultArgs {
    #[command(flatten)]
    pub server: ServerArg,
    /// The run's id.
    pub id: String,
    /// How long to wait for the run to end, in milliseconds (it shows as running past
    /// that).
    #[arg(long, default_value_t = 60_000)]
    pub wait_ms: u64,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct CancelArgs {
    #[command(flatten)]
    pub target: Target,
    /// The run's id.
    pub id: String,
    /// How long to wait for the engine's answer, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Print the answer as JSON: {"ok", "queued", "message"}.
    #[arg(long)]
    pub json: bool,
}

/// How long a command waits for a server's answer by default.
const SERVER_WAIT_MS: u64 = 30_000;

fn json_arg(text: &str, what: &str) -> anyhow::Result<serde_json::Value> {
    serde_json::from_str(text)
        .map_err(|e| anyhow::anyhow!("{what} {text:?} is not JSON ({e}); quote strings: '\"yes\"'"))
}

fn server_client(s: &ServerArg, timeout_ms: u64) -> anyhow::Result<crate::flow_client::Client> {
    crate::flow_client::Client::new(
        &s.server,
        s.token.clone(),
        Duration::from_millis(timeout_ms),
    )
}

pub fn run(sub: FlowSub) -> anyhow::Result<()> {
    use crate::flow_client as server;
    match sub {
        FlowSub::List(a) => match a.target.client(SERVER_WAIT_MS)? {
            Some(c) => server::list(&c, a.state.as_deref(), a.json),
            None => list(a),
        },
        FlowSub::Show(a) => match a.target.client(SERVER_WAIT_MS)? {
            Some(c) => server::show(&c, &a.id, a.json),
            None => show(a),
        },
        FlowSub::Metrics(a) => metrics(&a.dir.dir, a.json),
        FlowSub::Signal(a) => {
            let value = json_arg(&a.value, "the signal's value")?;
            if let Some(c) = a.target.client(a.timeout_ms)? {
                return server::signal(&c, &a.id, &a.name, value, a.key.as_deref(), a.json);
            }
            let req = Request::Signal {
                run: a.id,
                name: a.name,
                value,
            };
            request(a.target.dir(), &req, a.timeout_ms, a.json)
        }
        FlowSub::Serve(a) => crate::flow_serve::serve(a),
        FlowSub::Cancel(a) => match a.target.client(a.timeout_ms)? {
            Some(c) => server::cancel(&c, &a.id, a.json),
            None => request(
                a.target.dir(),
                &Request::Cancel { run: a.id },
                a.timeout_ms,
                a.json,
            ),
        },
        FlowSub::Start(a) => {
            let input = json_arg(&a.input, "the input")?;
            let c = server_client(&a.server, SERVER_WAIT_MS)?;
            server::start(&c, &a.workflow, &a.id, input, a.json)
        }
        FlowSub::Result(a) => {
            let c = server_client(&a.server, a.wait_ms + SERVER_WAIT_MS)?;
            server::result(&c, &a.id, a.wait_ms, a.json)
        }
    }
}

fn status(dir: &Path) -> anyhow::Result<Status> {
    Ok(admin::fresh_status(dir, Duration::from_secs(10))?)
}

fn list(a: ListArgs) -> anyhow::Result<()> {
    let mut st = status(a.target.dir())?;
    if let Some(state) = &a.state {
        const STATES: [&str; 5] = ["running", "finished", "failed", "cancelled", "parked"];
        if !STATES.contains(&state.as_str()) {
            anyhow::bail!("--state {state:?} is not one of {}", STATES.join(", "));
        }
        st.runs.retain(|r| &r.state == state);
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&st)?);
        return Ok(());
    }
    print!("{}", header(&st));
    let rows: Vec<Vec<String>> = st
        .runs
        .iter()
        .map(|r| {
            vec![
                r.id.clone(),
                r.workflow.clone(),
                r.generation.to_string(),
                r.state.clone(),
                r.pending_signals.to_string(),
                r.detail.as_ref().map(short).unwrap_or_default(),
            ]
        })
        .collect();
    print!(
        "{}",
        table::render(
            &["RUN", "WORKFLOW", "GEN", "STATE", "SIGNALS", "DETAIL"],
            &rows
        )
    );
    Ok(())
}

fn metrics(dir: &Path, json: bool) -> anyhow::Result<()> {
    let (text, fresh) = admin::fresh_metrics(dir, Duration::from_secs(10))?;
    if json {
        let samples = crate::table::prometheus_samples(&text);
        let out = serde_json::json!({ "fresh": fresh, "samples": samples });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    if !fresh {
        eprintln!(
            "no engine runs on {}: these are the metrics the last one wrote",
            dir.display()
        );
    }
    print!("{text}");
    Ok(())
}

fn header(st: &Status) -> String {
    let by = |s: &str| st.runs.iter().filter(|r| r.state == s).count();
    let engine = if admin::engine_alive(st) {
        format!("engine pid {} running", st.pid)
    } else {
        format!("no engine running (last status from pid {})", st.pid)
    };
    let writes = match (st.log.write_p50_us, st.log.write_p99_us) {
        (Some(p50), Some(p99)) => format!(" (write and sync: p50 < {p50} µs, p99 < {p99} µs)"),
        _ => String::new(),
    };
    let reused = match st.log.segments_reused {
        0 => String::new(),
        n => format!(" ({n} made from retired ones)"),
    };
    format!(
        "{engine}; opened in {:.1} ms ({} log records replayed, {} runs resumed); log: {} records, {} syncs{writes}, {} segment(s){reused}\n\
         {} runs: {} running, {} finished, {} failed, {} cancelled, {} parked\n\n",
        st.recovery_ms,
        st.recovered_records,
        st.resumed,
        st.log.records,
        st.log.syncs,
        st.log.segments,
        st.runs.len(),
        by("running"),
        by("finished"),
        by("failed"),
        by("cancelled"),
        by("parked"),
    )
}

/// A value on one line, cut to fit a table.
pub(crate) fn short(v: &serde_json::Value) -> String {
    let s = match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let s = s.replace('\n', " ");
    if s.chars().count() > 60 {
        format!("{}…", s.chars().take(59).collect::<String>())
    } else {
        s
    }
}

fn show(a: ShowArgs) -> anyhow::Result<()> {
    let dir = a.target.dir();
    let st = status(dir)?;
    let Some(run) = st.runs.iter().find(|r| r.id == a.id) else {
        anyhow::bail!(
            "no run {:?} in {} (`ferry flow list --dir {}` lists them)",
            a.id,
            dir.display(),
            dir.display()
        );
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(run)?);
        return Ok(());
    }
    print!("{}", render_run(run, &st));
    Ok(())
}

fn render_run(r: &RunView, st: &Status) -> String {
    let mut out = format!(
        "run        {}\nworkflow   {}\ngeneration {}\nstate      {}\n",
        r.id, r.workflow, r.generation, r.state
    );
    if let Some(p) = &r.parent {
        out.push_str(&format!("parent     {p}\n"));
    }
    let children: Vec<&str> = st
        .runs
        .iter()
        .filter(|c| c.parent.as_deref() == Some(&r.id))
        .map(|c| c.id.as_str())
        .collect();
    if !children.is_empty() {
        out.push_str(&format!("children   {}\n", children.join(", ")));
    }
    let label = match r.state.as_str() {
        "finished" => "output",
        "failed" => "error",
        "parked" => "reason",
        _ => "detail",
    };
    if let Some(d) = &r.detail {
        out.push_str(&format!("{label:<10} {}\n", pretty(d)));
    }
    if let Some(p) = &r.published {
        out.push_str(&format!("published  {}\n", pretty(p)));
    }
    out.push_str(&format!("signals    {} pending\n", r.pending_signals));
    out
}

pub(crate) fn pretty(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn request(dir: &Path, req: &Request, timeout_ms: u64, json: bool) -> anyhow::Result<()> {
    if !dir.is_dir() {
        anyhow::bail!("{} is not a directory", dir.display());
    }
    let live = admin::read_status(dir).ok().filter(admin::engine_alive);
    let id = admin::send(dir, req)
        .map_err(|e| anyhow::anyhow!("cannot leave the request in {}/inbox: {e}", dir.display()))?;
    let say = |ok: bool, queued: bool, message: &str| {
        if json {
            let v = serde_json::json!({"ok": ok, "queued": queued, "message": message});
            println!("{v}");
        } else {
            println!("{message}");
        }
    };
    if live.is_none() {
        say(
            true,
            true,
            &format!(
                "queued: no engine is running on {}; the request is applied when one next opens it",
                dir.display()
            ),
        );
        return Ok(());
    }
    match admin::wait_reply(dir, &id, Duration::from_millis(timeout_ms)) {
        Some(r) if r.ok => {
            say(true, false, &r.message);
            Ok(())
        }
        Some(r) => {
            if json {
                say(false, false, &r.message);
            }
            anyhow::bail!("{}", r.message)
        }
        None => anyhow::bail!(
            "the engine did not answer within {timeout_ms} ms; the request stays queued in {}/inbox and is applied when the engine gets to it",
            dir.display()
        ),
    }
}
