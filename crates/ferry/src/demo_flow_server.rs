//! The flow server part of `ferry demo` (docs/flow-server.md): order workflows on a
//! `ferry flow serve` process and two worker processes (`ferry demo-flow-worker`, this
//! binary), through a worker's death and the server's.
//!
//! 1. The payments service of the flow part (`demo_flow`) applies each charge and
//!    notification once per idempotency key and counts repeats.
//! 2. A server with 8 shards and two workers; each worker starts the orders on the
//!    shards it holds, and again whenever it is granted more (starting an id twice
//!    gives one run). An order: charge (a step calling the service with its key), a
//!    durable sleep, notify (another step).
//! 3. Once a third of the charges are answered, the worker holding the most shards is
//!    SIGKILLed; the demo times how long until the other holds every shard (the
//!    takeover: the lease, then the grants and the recovery from the server).
//! 4. Once two thirds are answered, the server is SIGKILLed and started again on its
//!    directory; the demo times how long until the worker holds every shard again.
//! 5. When every order is notified, the demo checks each order was charged and
//!    notified once (one effect per key; a repeat with the same key is a step cut short
//!    by a kill, run again), and that no order was charged after it was notified (a
//!    step whose result was acknowledged never runs again).

use crate::demo_flow::{Service, service_step, start_service};
use crate::report::{fact, say};
use anyhow::{Context, bail, ensure};
use clap::Args;
use ferry_core::sync::lock;
use ferry_flow::{Ctx, Engine, FlowError, Workflow};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

static ORDER: Workflow<u32, String> = Workflow::new("order");

/// Shards of the demo's server.
const SHARDS: usize = 8;
/// The demo server's lease: a dead worker's shards move after it.
const LEASE_MS: u64 = 2_000;

#[derive(Args)]
pub struct WorkerArgs {
    /// The flow server: `unix:/path` or `HOST:PORT`.
    #[arg(long)]
    server: String,
    #[arg(long)]
    service: String,
    #[arg(long)]
    orders: u32,
    /// The worker's directory (it keeps nothing durable there).
    #[arg(long)]
    dir: PathBuf,
    /// Start orders once this file exists (the demo makes it once both workers hold
    /// shards).
    #[arg(long)]
    go: PathBuf,
    /// The token the server asks for (its --token-file).
    #[arg(
        long,
        env = "FERRY_FLOW_TOKEN",
        hide_env_values = true,
        default_value = ""
    )]
    token: String,
}

/// `ferry demo-flow-server`: this part of the demo alone (for its test).
#[derive(Args)]
pub struct PartArgs {
    /// Work in this directory (kept afterwards).
    #[arg(long)]
    dir: PathBuf,
    #[arg(long, default_value_t = 60)]
    orders: u32,
    /// Print the figures as JSON (the sentences go to stderr).
    #[arg(long)]
    json: bool,
}

pub fn part(a: PartArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&a.dir)?;
    crate::report::json(a.json);
    let result = run(&a.dir, a.orders);
    crate::report::finish(&result);
    result
}

fn order_id(n: u32) -> String {
    format!("order-{n:03}")
}

/// A worker process: hold what the server grants, start every order on a shard held
/// (until each is started), run until SIGTERM, then hand the shards back.
pub fn worker(a: WorkerArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let service = Arc::new(a.service);
        let (dir, server) = (a.dir, a.server);
        let engine = tokio::task::spawn_blocking(move || {
            Engine::builder(dir)
                .server(server)
                .server_token(a.token)
                .register(ORDER, move |ctx: Ctx, n: u32| {
                    order(ctx, n, service.clone())
                })
                .open()
        })
        .await??;
        let starting = async {
            while !a.go.exists() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let mut started = vec![false; a.orders as usize];
            loop {
                for n in 0..a.orders {
                    if started[n as usize] {
                        continue;
                    }
                    match engine.start(ORDER, &order_id(n), &n).await {
                        Ok(_) => started[n as usize] = true,
                        Err(FlowError::NotHeld { .. }) => {}
                        Err(e) => tracing::warn!(order = n, "starting the order: {e}"),
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        tokio::select! {
            _ = starting => {}
            _ = crate::terminated() => {}
        }
        // Closing hands the shards back: off the runtime, it waits for the server.
        tokio::task::spawn_blocking(move || drop(engine)).await?;
        Ok(())
    })
}

async fn order(ctx: Ctx, n: u32, service: Arc<String>) -> Result<String, FlowError> {
    let charge = service_step(&ctx, &service, "charge", n).await?;
    ctx.sleep(Duration::from_millis(300)).await?;
    service_step(&ctx, &service, "notify", n).await?;
    Ok(charge)
}

/// A child process of the demo, killed if it is still running when dropped.
struct Proc {
    child: Child,
    what: &'static str,
}

impl Proc {
    fn start(what: &'static str, args: &[&str], log: &Path) -> anyhow::Result<Proc> {
        let child = crate::demo::spawn_ferry(what, args, log)?;
        Ok(Proc { child, what })
    }

    fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// SIGTERM, and how long it took to exit.
    fn terminate(mut self, limit: Duration) -> anyhow::Result<Duration> {
        let start = Instant::now();
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        while start.elapsed() < limit {
            if let Some(st) = self.child.try_wait()? {
                ensure!(
                    st.success(),
                    "the {} exited with {st} on SIGTERM",
                    self.what
                );
                return Ok(start.elapsed());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        bail!("the {} did not exit within {limit:?} of SIGTERM", self.what)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The server's /status, or None while it does not answer.
fn status(metrics: &str) -> Option<serde_json::Value> {
    let mut r = ureq::get(&format!("http://{metrics}/status")).call().ok()?;
    serde_json::from_str(&r.body_mut().read_to_string().ok()?).ok()
}

/// The session holding every shard, if one does and it is connected (a restarted
/// server keeps each shard for its last holder until that one is back or a lease
/// passed).
fn sole_holder(st: &serde_json::Value) -> Option<String> {
    let shards = st["shards"].as_array()?;
    let first = shards.first()?["holder"].as_str()?.to_string();
    let connected = st["workers"].as_array()?.iter().any(|w| {
        w["session"].as_str() == Some(first.as_str()) && w["connected"].as_bool() == Some(true)
    });
    (connected
        && shards.iter().all(|s| {
            s["holder"].as_str() == Some(first.as_str()) && s["granted"].as_bool() == Some(true)
        }))
    .then_some(first)
}

/// Wait up to `limit` for `f` to hold of the server's status, polling every 5 ms; how
/// long it took.
fn until(
    metrics: &str,
    limit: Duration,
    what: &str,
    f: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    loop {
        if status(metrics).is_some_and(|st| f(&st)) {
            return Ok(start.elapsed());
        }
        ensure!(start.elapsed() < limit, "{what} took longer than {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn serve_args<'a>(dir: &'a str, socket: &'a str, metrics: &'a str, http: &'a str) -> Vec<&'a str> {
    vec![
        "flow",
        "serve",
        "--dir",
        dir,
        "--listen",
        socket,
        "--shards",
        "8",
        "--lease-ms",
        "2000",
        "--ping-ms",
        "400",
        "--metrics-listen",
        metrics,
        "--http",
        http,
    ]
}

/// How many runs the server's index says finished (its HTTP API, §10), page by page.
fn finished_in_index(http: &str) -> anyhow::Result<usize> {
    let mut n = 0;
    let mut after = String::new();
    loop {
        let url = format!("http://{http}/v1/runs?state=finished&after={after}");
        let text = ureq::get(&url)
            .call()
            .with_context(|| format!("the server's API at {url}"))?
            .body_mut()
            .read_to_string()?;
        let page: serde_json::Value =
            serde_json::from_str(&text).context("the server's list of runs")?;
        n += page["runs"].as_array().map_or(0, Vec::len);
        match page["next"].as_str() {
            Some(next) => after = next.to_string(),
            None => return Ok(n),
        }
    }
}

pub fn run(root: &Path, orders: u32) -> anyhow::Result<()> {
    let (_rt, svc, service) = start_service(1)?;
    say!();
    say!(
        "ferry demo: ferry-flow's server mode runs {orders} orders (charge, packing timer, notify) on two worker processes through a worker's SIGKILL and the server's"
    );
    let dir = root.join("flow-server");
    let socket = format!("unix:{}", root.join("flow.sock").display());
    let metrics = format!("127.0.0.1:{}", crate::demo::free_port()?);
    let http = format!("127.0.0.1:{}", crate::demo::free_port()?);
    let dir_s = dir.display().to_string();
    let log = root.join("flow-server.log");
    let mut server = Proc::start(
        "flow server",
        &serve_args(&dir_s, &socket, &metrics, &http),
        &log,
    )?;
    until(
        &metrics,
        Duration::from_secs(10),
        "the server's start",
        |_| true,
    )?;
    let started = Instant::now();
    let go = root.join("flow-go");
    let worker = |name: &str| -> anyhow::Result<Proc> {
        let wdir = root.join(format!("flow-worker-{name}"));
        let args = [
            "demo-flow-worker",
            "--server",
            &socket,
            "--service",
            &service,
            "--orders",
            &orders.to_string(),
            "--dir",
            &wdir.display().to_string(),
            "--go",
            &go.display().to_string(),
        ]
        .map(str::to_string);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Proc::start(
            "worker",
            &args,
            &root.join(format!("flow-worker-{name}.log")),
        )
    };
    let mut workers = vec![worker("a")?, worker("b")?];
    let charged = |svc: &Mutex<Service>| lock(svc).answered;
    let wait_charged = |n: usize| -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while charged(&svc) < n {
            ensure!(
                Instant::now() < deadline,
                "the workers charged only {} orders in 60 s; see {}",
                charged(&svc),
                root.display()
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    };
    until(
        &metrics,
        Duration::from_secs(20),
        "both workers holding shards",
        |st| {
            st["workers"].as_array().is_some_and(|w| {
                w.iter()
                    .filter(|w| w["shards"].as_array().is_some_and(|s| !s.is_empty()))
                    .count()
                    == 2
            })
        },
    )?;
    std::fs::write(&go, b"")?;
    wait_charged(orders as usize / 3)?;

    // The worker holding the most shards dies.
    let st = status(&metrics).context("the server's status")?;
    let (victim_pid, victim_held) = st["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|w| {
            let pid: u32 = w["name"].as_str()?.strip_prefix("pid ")?.parse().ok()?;
            let held: Vec<u32> = w["shards"]
                .as_array()?
                .iter()
                .filter_map(|s| s.as_u64().map(|s| s as u32))
                .collect();
            Some((pid, held))
        })
        .max_by_key(|(_, held)| held.len())
        .context("no worker holds a shard")?;
    let victim_shards = victim_held.len();
    let at = workers
        .iter()
        .position(|w| w.child.id() == victim_pid)
        .context("the holder of the most shards is not one of the demo's workers")?;
    let mut victim = workers.remove(at);
    let at_kill = charged(&svc);
    victim.kill()?;
    let takeover = until(
        &metrics,
        Duration::from_millis(LEASE_MS) + Duration::from_secs(10),
        "the takeover",
        |st| sole_holder(st).is_some(),
    )?;
    say!(
        "  SIGKILLed the worker holding {victim_shards} of {SHARDS} shards when {at_kill} of {orders} charges were answered; the other held every shard {:.0} ms later (lease {LEASE_MS} ms)",
        takeover.as_secs_f64() * 1e3
    );

    // Then the server dies, and comes back on its directory, once the survivor made
    // headway on the shards it took over.
    wait_charged((orders as usize * 2 / 3).max(charged(&svc) + orders as usize / 6))?;
    server.kill()?;
    let at_server_kill = charged(&svc);
    let calls_at_server_kill = lock(&svc).calls.len();
    let server = Proc::start(
        "flow server",
        &serve_args(&dir_s, &socket, &metrics, &http),
        &log,
    )?;
    let resumed = until(
        &metrics,
        Duration::from_secs(20),
        "the worker's resume on the restarted server",
        |st| sole_holder(st).is_some(),
    )?;
    say!(
        "  SIGKILLed the server when {at_server_kill} charges were answered; restarted, it had the worker holding every shard again {:.0} ms after its start",
        resumed.as_secs_f64() * 1e3
    );

    // Every order notified.
    let notified = |svc: &Mutex<Service>| {
        lock(svc)
            .effects
            .keys()
            .filter(|(w, _)| w == "notify")
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while notified(&svc) < orders as usize {
        if Instant::now() >= deadline {
            let s = lock(&svc);
            let late: Vec<String> = (0..orders)
                .filter(|n| s.effects_of("notify", &order_id(*n)).is_empty())
                .map(|n| {
                    let calls = s.calls.iter().filter(|c| c.1 == n).count();
                    format!(
                        "{} (shard {}, {calls} calls)",
                        order_id(n),
                        ferry_flow::shard_of(&order_id(n), SHARDS as u32)
                    )
                })
                .collect();
            bail!(
                "only {} of {orders} orders were notified within 60 s (not: {}); see {}",
                notified(&svc),
                late.join(", "),
                root.display()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let elapsed = started.elapsed();
    let survivor = workers.pop().expect("one worker left");
    let handed_back = survivor.terminate(Duration::from_secs(10))?;
    // With no worker left, the server still answers for every run (guarantee 7).
    let in_index = finished_in_index(&http)?;
    server.terminate(Duration::from_secs(10))?;

    let s = lock(&svc);
    let mut bad = Vec::new();
    for n in 0..orders {
        let id = order_id(n);
        let effects = |what: &str| s.effects_of(what, &id).len();
        if effects("charge") != 1 || effects("notify") != 1 {
            bad.push(format!(
                "{id}: {} charges, {} notifications",
                effects("charge"),
                effects("notify")
            ));
        }
        if s.charged_after_notifying(n) {
            bad.push(format!("{id}: charged again after notifying"));
        }
    }
    // The worker resumed on the restarted server within its lease: nothing it ran
    // before the kill runs again (guarantee 5), so no key of an order on a shard it held
    // from the start is called both before the server's kill and after. (The orders of
    // the killed worker's shards may be: steps it had under way when it died run again
    // on the survivor, perhaps after the server's kill.)
    let (before, after) = s.calls.split_at(calls_at_server_kill);
    let again_after_server_kill = after
        .iter()
        .filter(|c| !victim_held.contains(&ferry_flow::shard_of(&order_id(c.1), SHARDS as u32)))
        .filter(|c| before.iter().any(|b| b.0 == c.0 && b.2 == c.2))
        .count();
    let repeats = |what: &str| s.repeats(what);
    fact("flow_server", "orders", orders);
    fact("flow_server", "secs", elapsed.as_secs_f64());
    fact("flow_server", "takeover_ms", takeover.as_secs_f64() * 1e3);
    fact("flow_server", "resume_ms", resumed.as_secs_f64() * 1e3);
    fact("flow_server", "charges_repeated", repeats("charge"));
    fact(
        "flow_server",
        "calls_again_after_server_kill",
        again_after_server_kill,
    );
    fact("flow_server", "orders_wrong", bad.len());
    fact("flow_server", "finished_in_index", in_index);
    say!(
        "  orders notified:          {orders} of {orders} (in {:.1} s)",
        elapsed.as_secs_f64()
    );
    say!(
        "  charges applied:          {} (calls {}, {} re-run with the same key after the worker's kill)",
        s.effects.keys().filter(|(w, _)| w == "charge").count(),
        s.calls.iter().filter(|c| c.0 == "charge").count(),
        repeats("charge")
    );
    say!(
        "  calls made again after the server's kill: {again_after_server_kill} on the survivor's own shards (it resumed where it was)"
    );
    say!(
        "  SIGTERM to the last worker: it handed its shards back and exited in {:.0} ms",
        handed_back.as_secs_f64() * 1e3
    );
    say!(
        "  orders wrong:             {} (not charged and notified once each, or charged after notifying)",
        bad.len()
    );
    say!(
        "  the server's index, with no worker left: {in_index} of {orders} orders finished (ferry flow list --server)"
    );
    ensure!(
        takeover <= Duration::from_millis(LEASE_MS) + Duration::from_secs(1),
        "the takeover took {takeover:?}, over the lease plus 1 s"
    );
    ensure!(bad.is_empty(), "orders that went wrong: {bad:?}");
    ensure!(
        in_index == orders as usize,
        "the server's index shows {in_index} of {orders} orders finished"
    );
    ensure!(
        again_after_server_kill == 0,
        "{again_after_server_kill} calls made before the server's kill were made again after it"
    );
    Ok(())
}
