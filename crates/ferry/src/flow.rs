//! `ferry flow list|show|metrics|signal|cancel --dir DIR`: look at and steer the runs of a
//! ferry-flow engine from outside its process, through the status file and request
//! inbox it keeps in its directory (docs/flow.md §7; `ferry_flow::admin`).
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
    pub dir: DirArg,
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
    pub dir: DirArg,
    /// The run's id.
    pub id: String,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct SignalArgs {
    #[command(flatten)]
    pub dir: DirArg,
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
    /// Print the answer as JSON: {"ok", "queued", "message"}.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct CancelArgs {
    #[command(flatten)]
    pub dir: DirArg,
    /// The run's id.
    pub id: String,
    /// How long to wait for the engine's answer, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Print the answer as JSON: {"ok", "queued", "message"}.
    #[arg(long)]
    pub json: bool,
}

pub fn run(sub: FlowSub) -> anyhow::Result<()> {
    match sub {
        FlowSub::List(a) => list(a),
        FlowSub::Show(a) => show(a),
        FlowSub::Metrics(a) => metrics(&a.dir.dir, a.json),
        FlowSub::Signal(a) => {
            let value: serde_json::Value = serde_json::from_str(&a.value).map_err(|e| {
                anyhow::anyhow!(
                    "the signal's value {:?} is not JSON ({e}); quote strings: '\"yes\"'",
                    a.value
                )
            })?;
            let req = Request::Signal {
                run: a.id,
                name: a.name,
                value,
            };
            request(&a.dir.dir, &req, a.timeout_ms, a.json)
        }
        FlowSub::Serve(a) => crate::flow_serve::serve(a),
        FlowSub::Cancel(a) => request(
            &a.dir.dir,
            &Request::Cancel { run: a.id },
            a.timeout_ms,
            a.json,
        ),
    }
}

fn status(dir: &Path) -> anyhow::Result<Status> {
    Ok(admin::fresh_status(dir, Duration::from_secs(10))?)
}

fn list(a: ListArgs) -> anyhow::Result<()> {
    let mut st = status(&a.dir.dir)?;
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
fn short(v: &serde_json::Value) -> String {
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
    let st = status(&a.dir.dir)?;
    let Some(run) = st.runs.iter().find(|r| r.id == a.id) else {
        anyhow::bail!(
            "no run {:?} in {} (`ferry flow list --dir {}` lists them)",
            a.id,
            a.dir.dir.display(),
            a.dir.dir.display()
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

fn pretty(v: &serde_json::Value) -> String {
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
