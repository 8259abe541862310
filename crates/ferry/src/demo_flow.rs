//! The flow part of `ferry demo`, on embedded defaults:
//!
//! 1. A payments service (HTTP, in this process) applies each charge and notification
//!    once per idempotency key and counts repeats.
//! 2. An engine process (`ferry demo-flow-engine`, this binary) runs order workflows:
//!    charge (a step calling the service with its key), a durable sleep ("packing"),
//!    wait for a "shipped" signal, notify (another step calling the service).
//! 3. Half the orders get their signal through the engine's inbox (as `ferry flow
//!    signal` sends it); once half the charges are answered (each takes the service
//!    0.2–1 s) the demo SIGKILLs the engine, starts it again, and signals the rest.
//! 4. Right after the kill, before the restart, the demo reads which step results the
//!    journal holds (`ferry_flow::read_journal`): those the restart replays.
//! 5. When every order has finished, the demo checks each finished with the charge the
//!    service issued for it, each step's effect was applied once, no step whose result
//!    was durable at the kill called the service again, and no step ran after a later
//!    step of its order had started (a step acknowledged durable never runs again; one
//!    cut short by the kill may, with the same key).

use crate::report::{fact, say};
use anyhow::{Context, bail, ensure};
use axum::extract::{Query, State};
use axum::routing::post;
use clap::Args;
use ferry_core::sync::lock;
use ferry_flow::admin::{self, Request};
use ferry_flow::{Ctx, Engine, FlowError, Retry, Signal, StepError, Workflow};
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

static ORDER: Workflow<u32, String> = Workflow::new("order");
static SHIPPED: Signal<String> = Signal::new("shipped");

#[derive(Args)]
pub struct EngineArgs {
    #[arg(long)]
    dir: PathBuf,
    #[arg(long)]
    service: String,
    #[arg(long)]
    orders: u32,
}

/// The engine process: start every order (starting an id again returns its run), then
/// run until every order finished or SIGTERM.
pub fn engine(a: EngineArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let service = Arc::new(a.service);
        let engine = Engine::builder(&a.dir)
            .register(ORDER, move |ctx: Ctx, n: u32| {
                order(ctx, n, service.clone())
            })
            .open()?;
        for n in 0..a.orders {
            engine.start(ORDER, &format!("order-{n:03}"), &n).await?;
        }
        let all_done = async {
            for n in 0..a.orders {
                let _ = engine
                    .run::<String>(&format!("order-{n:03}"))
                    .expect("started above")
                    .result()
                    .await;
            }
        };
        tokio::select! {
            _ = all_done => {}
            _ = crate::terminated() => {}
        }
        Ok(())
    })
}

async fn order(ctx: Ctx, n: u32, service: Arc<String>) -> Result<String, FlowError> {
    let charge = service_step(&ctx, &service, "charge", n).await?;
    ctx.publish(&format!("charged {charge}, packing"))?;
    ctx.sleep(Duration::from_millis(300)).await?;
    ctx.publish(&format!("charged {charge}, waiting for shipment"))?;
    let carrier = ctx
        .wait_for(SHIPPED, Some(Duration::from_secs(120)))
        .await?
        .unwrap_or_else(|| "nobody (timed out)".into());
    service_step(&ctx, &service, "notify", n).await?;
    Ok(format!("{charge} shipped by {carrier}"))
}

/// A step named `what` that calls the service's `what` with the step's key for order
/// `n`, retried on failure; the effect's id.
pub(crate) async fn service_step(
    ctx: &Ctx,
    service: &str,
    what: &'static str,
    n: u32,
) -> Result<String, FlowError> {
    ctx.step(what, |s| call(service, what, s.key().to_string(), n))
        .retry(Retry::exponential(10, Duration::from_millis(50)))
        .await
}

/// POST to the service; its answer is the effect's id.
pub(crate) fn call(
    service: &str,
    what: &'static str,
    key: String,
    n: u32,
) -> impl std::future::Future<Output = Result<String, StepError>> + use<> {
    // `by`: which process called, for tests that tell workers apart.
    let url = format!(
        "{service}/{what}?key={key}&order={n}&by={}",
        std::process::id()
    );
    async move {
        // A service that does not answer, or answers with an error, may answer the
        // next attempt: every failure here is transient.
        let answer = tokio::task::spawn_blocking(move || {
            ureq::post(&url)
                .send_empty()
                .map_err(|e| e.to_string())?
                .body_mut()
                .read_to_string()
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())?;
        Ok(answer?)
    }
}

/// The payments service: effects by key, every call in arrival order.
#[derive(Default)]
pub(crate) struct Service {
    /// (what, key) → effect id.
    pub(crate) effects: BTreeMap<(String, String), String>,
    /// (what, order, key) for every call, repeats included.
    pub(crate) calls: Vec<(String, u32, String)>,
    /// Charge calls answered.
    pub(crate) answered: usize,
}

impl Service {
    /// The effect ids of `what` (charge, notify) made for run `id`.
    pub(crate) fn effects_of(&self, what: &str, id: &str) -> Vec<&String> {
        let prefix = format!("{id}/");
        self.effects
            .iter()
            .filter(|((w, key), _)| w == what && key.starts_with(&prefix))
            .map(|(_, effect)| effect)
            .collect()
    }

    /// Order `n` was charged after its first notification: a step acknowledged durable
    /// (notify starts only once the charge's result is) ran again.
    pub(crate) fn charged_after_notifying(&self, n: u32) -> bool {
        let calls: Vec<&(String, u32, String)> = self.calls.iter().filter(|c| c.1 == n).collect();
        calls
            .iter()
            .position(|c| c.0 == "notify")
            .is_some_and(|first| calls[first..].iter().any(|c| c.0 == "charge"))
    }

    /// Calls of `what` made again with a key already called.
    pub(crate) fn repeats(&self, what: &str) -> usize {
        self.calls.iter().filter(|c| c.0 == what).count()
            - self.effects.keys().filter(|(w, _)| w == what).count()
    }
}

#[derive(Deserialize)]
struct CallQuery {
    key: String,
    order: u32,
}

async fn serve_call(
    State((svc, what)): State<(Arc<Mutex<Service>>, &'static str)>,
    Query(q): Query<CallQuery>,
) -> String {
    let effect = {
        let mut s = lock(&svc);
        s.calls.push((what.to_string(), q.order, q.key.clone()));
        let next = s.effects.len();
        s.effects
            .entry((what.to_string(), q.key))
            .or_insert_with(|| format!("{what}-{next:04}"))
            .clone()
    };
    if what == "charge" {
        // A card network takes its time: 0.2 to 1 s, so the kill finds charges under way.
        let ms = 200 + u64::from(q.order) * 37 % 800;
        tokio::time::sleep(Duration::from_millis(ms)).await;
        lock(&svc).answered += 1;
    }
    effect
}

/// The payments service on a runtime of `threads` threads of its own: the runtime (the
/// service lives as long as it), the service's state, and its URL.
pub(crate) fn start_service(
    threads: usize,
) -> anyhow::Result<(tokio::runtime::Runtime, Arc<Mutex<Service>>, String)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    let svc = Arc::new(Mutex::new(Service::default()));
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let service = format!("http://{}", listener.local_addr()?);
    let app = axum::Router::new()
        .route(
            "/charge",
            post(serve_call).with_state((svc.clone(), "charge")),
        )
        .route(
            "/notify",
            post(serve_call).with_state((svc.clone(), "notify")),
        );
    rt.spawn(async move { axum::serve(listener, app).await });
    Ok((rt, svc, service))
}

/// The engine as a child process.
struct EngineProcess {
    child: Child,
}

impl EngineProcess {
    fn start(dir: &Path, service: &str, orders: u32, log: &Path) -> anyhow::Result<Self> {
        let orders = orders.to_string();
        let args = [
            "demo-flow-engine".as_ref(),
            "--dir".as_ref(),
            dir.as_os_str(),
            "--service".as_ref(),
            service.as_ref(),
            "--orders".as_ref(),
            orders.as_ref(),
        ];
        let child = crate::demo::spawn_ferry::<&std::ffi::OsStr>("flow engine", &args, log)?;
        Ok(EngineProcess { child })
    }

    fn kill(&mut self) -> anyhow::Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    fn wait(mut self, limit: Duration) -> anyhow::Result<()> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(st) = self.child.try_wait()? {
                ensure!(st.success(), "the flow engine exited with {st}");
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("the flow engine did not finish within {limit:?}")
    }
}

impl Drop for EngineProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Signal "shipped" to `orders` through the running engine's inbox, as
/// `ferry flow signal` does, and check every answer.
fn ship(dir: &Path, orders: impl Iterator<Item = u32>) -> anyhow::Result<()> {
    let mut sent = Vec::new();
    for n in orders {
        let carrier = ["post", "courier", "drone"][n as usize % 3];
        let id = admin::send(
            dir,
            &Request::Signal {
                run: format!("order-{n:03}"),
                name: SHIPPED.name().to_string(),
                value: serde_json::Value::from(carrier),
            },
        )?;
        sent.push((n, id));
    }
    for (n, id) in sent {
        match admin::wait_reply(dir, &id, Duration::from_secs(10)) {
            Some(r) if r.ok => {}
            Some(r) => bail!("signalling order {n}: {}", r.message),
            None => bail!("the engine did not answer the signal for order {n} within 10 s"),
        }
    }
    Ok(())
}

/// Wait until the engine's status lists `orders` runs (it started them all).
fn wait_started(dir: &Path, orders: u32) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(st) = admin::read_status(dir)
            && admin::engine_alive(&st)
            && admin::fresh_status(dir, Duration::from_secs(5))
                .is_ok_and(|st| st.runs.len() == orders as usize)
        {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the engine did not start its {orders} orders within 30 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn run(root: &Path, orders: u32) -> anyhow::Result<()> {
    let (_rt, svc, service) = start_service(2)?;

    say!();
    say!(
        "ferry demo: ferry-flow runs {orders} order workflows (charge, packing timer, shipment signal, notify) through a SIGKILL"
    );
    let dir = root.join("flow");
    std::fs::create_dir_all(&dir)?;
    let log = root.join("flow-engine.log");
    let started = Instant::now();
    let mut engine = EngineProcess::start(&dir, &service, orders, &log)?;
    wait_started(&dir, orders)?;
    ship(&dir, (0..orders).filter(|n| n % 2 == 0))?;
    let charged = |svc: &Mutex<Service>| lock(svc).answered;
    let deadline = Instant::now() + Duration::from_secs(30);
    while charged(&svc) < orders as usize / 2 {
        ensure!(
            Instant::now() < deadline,
            "the engine charged only {} orders in 30 s; see {}",
            charged(&svc),
            log.display()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let at_kill = charged(&svc);
    engine.kill()?;
    // What the journal holds now is what the restart replays: none of those steps may
    // call the service again (a step cut short by the kill may, with the same key).
    let held = held_steps(&dir)?;
    let calls_at_kill = lock(&svc).calls.len();
    say!(
        "  signalled the even orders \"shipped\"; SIGKILLed the engine when {at_kill} of {orders} charges were answered; restarted it and signalled the odd orders"
    );
    let engine = EngineProcess::start(&dir, &service, orders, &log)?;
    wait_started(&dir, orders)?;
    ship(&dir, (0..orders).filter(|n| n % 2 == 1))?;
    engine.wait(Duration::from_secs(60)).with_context(|| {
        format!(
            "waiting for every order to finish; `ferry flow list --dir {}` shows where they are",
            dir.display()
        )
    })?;
    let elapsed = started.elapsed();

    // The status the engine left on exit, and what the service saw.
    let status = admin::read_status(&dir).map_err(|e| anyhow::anyhow!(e))?;
    let s = lock(&svc);
    let finished = status.runs.iter().filter(|r| r.state == "finished").count();
    let mut bad = Vec::new();
    for r in &status.runs {
        let n: u32 =
            r.id.trim_start_matches("order-")
                .parse()
                .unwrap_or(u32::MAX);
        let output = r.detail.as_ref().and_then(|d| d.as_str()).unwrap_or("");
        let charges = s.effects_of("charge", &r.id);
        if charges.len() != 1 || !output.starts_with(charges[0].as_str()) {
            bad.push(format!("{}: output {output:?}, charges {charges:?}", r.id));
        }
        if s.charged_after_notifying(n) {
            bad.push(format!("{}: charged again after notifying", r.id));
        }
    }
    for (what, n, _) in &s.calls[calls_at_kill..] {
        if held.contains(&(*n, what.clone())) {
            bad.push(format!(
                "order-{n:03}: {what} called again though its result was durable at the kill"
            ));
        }
    }
    let repeats = |what: &str| s.repeats(what);
    fact("flow", "orders", orders);
    fact("flow", "finished", finished);
    fact("flow", "secs", elapsed.as_secs_f64());
    fact(
        "flow",
        "charges_applied",
        s.effects.keys().filter(|(w, _)| w == "charge").count(),
    );
    fact("flow", "charges_repeated", repeats("charge"));
    fact("flow", "notifications_repeated", repeats("notify"));
    fact("flow", "recovery_ms", status.recovery_ms);
    fact(
        "flow",
        "records_per_sync",
        status.log.records as f64 / status.log.syncs.max(1) as f64,
    );
    fact("flow", "orders_wrong", bad.len());
    say!(
        "  orders finished:          {finished} of {orders} (in {:.1} s, one SIGKILL)",
        elapsed.as_secs_f64()
    );
    say!(
        "  charges applied:          {} (calls {}, {} re-run with the same key after the kill)",
        s.effects.keys().filter(|(w, _)| w == "charge").count(),
        s.calls.iter().filter(|c| c.0 == "charge").count(),
        repeats("charge")
    );
    say!(
        "  durable at the kill:      {} charge results, read back from the journal before the restart; none called again",
        held.iter().filter(|(_, w)| w == "charge").count()
    );
    say!(
        "  notifications applied:    {} (calls {}, {} repeated)",
        s.effects.keys().filter(|(w, _)| w == "notify").count(),
        s.calls.iter().filter(|c| c.0 == "notify").count(),
        repeats("notify")
    );
    say!(
        "  engine restart:           opened in {:.1} ms, {} log records replayed, {} runs resumed",
        status.recovery_ms,
        status.recovered_records,
        status.resumed
    );
    say!(
        "  log:                      {} records in {} fdatasyncs ({:.1} per sync)",
        status.log.records,
        status.log.syncs,
        status.log.records as f64 / status.log.syncs.max(1) as f64
    );
    let metric = |name: &str| -> u64 {
        status
            .metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse::<f64>().ok())
            .unwrap_or(0.0) as u64
    };
    say!(
        "  restarted engine metrics: {} step attempts ok, {} failed, {} runs parked (as `ferry flow metrics --dir DIR` prints them)",
        metric("ferry_flow_step_attempts_total{result=\"ok\"}"),
        metric("ferry_flow_step_attempts_total{result=\"error\"}")
            + metric("ferry_flow_step_attempts_total{result=\"timeout\"}"),
        metric("ferry_flow_runs{state=\"parked\"}"),
    );
    say!(
        "  orders wrong:             {} (wrong charge in the result, or a step re-run that was durable or after a later one started)",
        bad.len()
    );
    ensure!(
        finished == orders as usize,
        "only {finished} of {orders} orders finished"
    );
    ensure!(bad.is_empty(), "orders that went wrong: {bad:?}");
    Ok(())
}

/// (order, step name) of every step result the journal in `dir` holds for the runs a
/// restart replays.
fn held_steps(dir: &Path) -> anyhow::Result<BTreeSet<(u32, String)>> {
    let journal = ferry_flow::read_journal(dir)?;
    Ok(journal
        .steps()
        .filter_map(|(run, name, _)| {
            let n = run.strip_prefix("order-")?.parse().ok()?;
            Some((n, name.to_string()))
        })
        .collect())
}
