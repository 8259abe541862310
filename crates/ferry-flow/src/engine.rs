//! The engine, first slice (docs/flow.md §4): typed workflows, runs started by id,
//! steps journaled to one ferry-log with output holding, results awaited from anywhere,
//! recovery by replay, nondeterminism parking. Runs are spread over shards, each a
//! thread with a single-threaded executor; every shard appends to the one log, whose
//! writer's fdatasync covers them all.
//!
//! Not yet: retries, timers, signals, children, cancellation, limits, continue-as-new,
//! compaction (docs/flow.md).

use crate::journal::{Entry, Json, Outcome, RECORD_KIND, RUN_ID_MAX, Record, ValueKind};
use crate::replay::{Call, Nondeterminism, Replay, Slot};
use ferry_log::{Config as LogConfig, Log, Lsn};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::marker::PhantomData;
use std::path::Path;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

/// A signal's name and payload type: `static REVIEW: Signal<Review> = Signal::new("review");`
pub struct Signal<T> {
    name: &'static str,
    _types: PhantomData<fn(T)>,
}

impl<T> Signal<T> {
    pub const fn new(name: &'static str) -> Self {
        Signal {
            name,
            _types: PhantomData,
        }
    }
}

impl<T> Clone for Signal<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Signal<T> {}

/// A workflow's name and types: `static CHECKOUT: Workflow<Order, Receipt> = Workflow::new("checkout");`
pub struct Workflow<I, O> {
    name: &'static str,
    _types: PhantomData<fn(I) -> O>,
}

impl<I, O> Workflow<I, O> {
    pub const fn new(name: &'static str) -> Self {
        Workflow {
            name,
            _types: PhantomData,
        }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }
}

impl<I, O> Clone for Workflow<I, O> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<I, O> Copy for Workflow<I, O> {}

#[derive(Clone, Debug, thiserror::Error)]
pub enum FlowError {
    #[error("step {name:?} failed: {error}")]
    Step { name: String, error: String },
    #[error(transparent)]
    Nondeterminism(#[from] Nondeterminism),
    #[error("the run is parked: {0}")]
    Parked(String),
    #[error(transparent)]
    Log(#[from] ferry_log::Error),
    #[error("cannot encode or decode a value: {0}")]
    Codec(String),
    #[error("{0}")]
    Invalid(String),
    #[error("the engine stopped")]
    Stopped,
}

type Handler =
    Arc<dyn Fn(Ctx, Json) -> Pin<Box<dyn Future<Output = Result<Json, FlowError>>>> + Send + Sync>;

fn encode<T: Serialize>(v: &T) -> Result<Json, FlowError> {
    serde_json::to_value(v).map_err(|e| FlowError::Codec(e.to_string()))
}

fn decode<T: DeserializeOwned>(v: Json) -> Result<T, FlowError> {
    serde_json::from_value(v).map_err(|e| FlowError::Codec(e.to_string()))
}

/// Where a run stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunStatus {
    Running,
    Finished(Outcome),
    Parked(String),
}

struct RunEntry {
    status: RunStatus,
    waiters: Vec<oneshot::Sender<RunStatus>>,
}

struct Shared {
    log: Arc<Log>,
    runs: Mutex<HashMap<String, RunEntry>>,
    /// Signals each run has received, in journal order, and a wake-up for its waits.
    inboxes: Mutex<HashMap<String, Inbox>>,
}

#[derive(Default)]
struct Inbox {
    signals: Vec<(String, Json)>,
    arrived: Arc<tokio::sync::Notify>,
}

impl Shared {
    /// The `index`th signal named `name` the run received, and the run's wake-up.
    fn signal(
        &self,
        run: &str,
        name: &str,
        index: u32,
    ) -> (Option<Json>, Arc<tokio::sync::Notify>) {
        let mut inboxes = self.inboxes.lock().unwrap_or_else(|p| p.into_inner());
        let inbox = inboxes.entry(run.to_string()).or_default();
        let value = inbox
            .signals
            .iter()
            .filter(|(n, _)| n == name)
            .nth(index as usize)
            .map(|(_, v)| v.clone());
        (value, inbox.arrived.clone())
    }
}

impl Shared {
    fn settle(&self, run: &str, status: RunStatus) {
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        let e = runs.entry(run.to_string()).or_insert(RunEntry {
            status: RunStatus::Running,
            waiters: Vec::new(),
        });
        e.status = status.clone();
        for w in e.waiters.drain(..) {
            let _ = w.send(status.clone());
        }
    }
}

struct Job {
    run: String,
    generation: u32,
    replay: Replay,
    input: Json,
    handler: Handler,
}

/// Builds an [`Engine`].
pub struct EngineBuilder {
    dir: std::path::PathBuf,
    storage: Option<Arc<dyn ferry_log::Storage>>,
    shards: usize,
    log: LogConfig,
    handlers: HashMap<&'static str, Handler>,
}

impl EngineBuilder {
    pub fn shards(mut self, n: usize) -> Self {
        self.shards = n;
        self
    }

    /// Keep the log on `storage` instead of files in the directory (the simulation).
    pub fn storage(mut self, storage: Arc<dyn ferry_log::Storage>) -> Self {
        self.storage = Some(storage);
        self
    }

    pub fn log_config(mut self, c: LogConfig) -> Self {
        self.log = c;
        self
    }

    /// Register `f` as the code of `workflow`.
    pub fn register<I, O, F, Fut>(mut self, workflow: Workflow<I, O>, f: F) -> Self
    where
        I: DeserializeOwned + 'static,
        O: Serialize + 'static,
        F: Fn(Ctx, I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<O, FlowError>> + 'static,
    {
        let f = Arc::new(f);
        let handler: Handler = Arc::new(move |ctx, input| {
            let f = f.clone();
            Box::pin(async move {
                let input: I = decode(input)?;
                let out = f(ctx, input).await?;
                encode(&out)
            })
        });
        self.handlers.insert(workflow.name, handler);
        self
    }

    /// Open the log (recovering it), rebuild every run from its journal, restart the
    /// unfinished ones.
    pub fn open(self) -> Result<Engine, FlowError> {
        if self.shards == 0 || self.shards > 256 {
            return Err(FlowError::Invalid(format!(
                "shards {} must be between 1 and 256",
                self.shards
            )));
        }
        let (log, recovery) = match self.storage {
            Some(st) => Log::open(st, self.log)?,
            None => Log::open_dir(&self.dir, self.log)?,
        };
        let log = Arc::new(log);
        let mut by_run: BTreeMap<String, Vec<Record>> = BTreeMap::new();
        let mut bad = None;
        log.read(log.start_lsn(), |r| {
            if r.kind != RECORD_KIND {
                return;
            }
            match Record::decode(r.payload) {
                Ok(rec) => by_run.entry(rec.run.clone()).or_default().push(rec),
                Err(e) => {
                    bad.get_or_insert(format!("record at {}: {e}", r.lsn));
                }
            }
        })?;
        if let Some(e) = bad {
            return Err(FlowError::Codec(format!(
                "the journal holds a record this build cannot read ({e})"
            )));
        }
        let shared = Arc::new(Shared {
            log: log.clone(),
            runs: Mutex::new(HashMap::new()),
            inboxes: Mutex::new(HashMap::new()),
        });
        let mut shards = Vec::new();
        for i in 0..self.shards {
            shards.push(Shard::start(i, shared.clone()));
        }
        let engine = Engine {
            shared,
            shards,
            handlers: self.handlers,
        };
        let mut resumed = 0;
        for (run, records) in by_run {
            let generation = records.iter().map(|r| r.generation).max().unwrap_or(0);
            let records: Vec<Record> = records
                .into_iter()
                .filter(|r| r.generation == generation)
                .collect();
            let replay = Replay::new(records);
            let signals: Vec<(String, Json)> = replay
                .arrivals()
                .iter()
                .filter_map(|e| match e {
                    Entry::Signal { name, value } => Some((name.clone(), value.clone())),
                    _ => None,
                })
                .collect();
            if !signals.is_empty() {
                engine
                    .shared
                    .inboxes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(run.clone())
                    .or_default()
                    .signals = signals;
            }
            let ended = replay_end(&replay);
            let status = match ended {
                Some(s) => s,
                None => match replay.started().cloned() {
                    Some(Entry::Started {
                        workflow, input, ..
                    }) => match engine.handlers.get(workflow.as_str()) {
                        Some(h) => {
                            engine.spawn(Job {
                                run: run.clone(),
                                generation,
                                replay,
                                input,
                                handler: h.clone(),
                            });
                            resumed += 1;
                            RunStatus::Running
                        }
                        None => RunStatus::Parked(format!(
                            "no workflow named {workflow:?} is registered; register it and restart"
                        )),
                    },
                    _ => RunStatus::Parked("the journal has no start record".into()),
                },
            };
            engine
                .shared
                .runs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(run)
                .or_insert(RunEntry {
                    status,
                    waiters: Vec::new(),
                });
        }
        tracing::info!(
            resumed,
            log_records = recovery.records,
            ms = recovery.elapsed.as_secs_f64() * 1e3,
            "flow engine open"
        );
        Ok(engine)
    }
}

/// A finished or parked generation's last entry, as a status.
fn replay_end(replay: &Replay) -> Option<RunStatus> {
    replay.last().and_then(|e| match e {
        Entry::Finished { outcome } => Some(RunStatus::Finished(outcome.clone())),
        Entry::Parked { reason } => Some(RunStatus::Parked(reason.clone())),
        _ => None,
    })
}

/// Durable execution on one directory.
pub struct Engine {
    shared: Arc<Shared>,
    shards: Vec<Shard>,
    handlers: HashMap<&'static str, Handler>,
}

impl Engine {
    pub fn builder(dir: impl AsRef<Path>) -> EngineBuilder {
        EngineBuilder {
            dir: dir.as_ref().to_path_buf(),
            storage: None,
            shards: 2,
            log: LogConfig::default(),
            handlers: HashMap::new(),
        }
    }

    fn shard_of(&self, run: &str) -> &Shard {
        // FNV-1a: stable across processes, so a run stays on its shard after a restart.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in run.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        &self.shards[(h % self.shards.len() as u64) as usize]
    }

    fn spawn(&self, job: Job) {
        let _ = self.shard_of(&job.run).tx.send(job);
    }

    /// Start `workflow` as run `id`, or return the run that already has that id
    /// (running, parked or finished: docs/flow.md §1.6). Returns once the start is
    /// durable.
    pub async fn start<I: Serialize, O: DeserializeOwned>(
        &self,
        workflow: Workflow<I, O>,
        id: &str,
        input: &I,
    ) -> Result<RunHandle<O>, FlowError> {
        if id.is_empty() || id.len() > RUN_ID_MAX {
            return Err(FlowError::Invalid(format!(
                "a run id must be 1 to {RUN_ID_MAX} bytes, not {}",
                id.len()
            )));
        }
        let handler = self
            .handlers
            .get(workflow.name)
            .ok_or_else(|| {
                FlowError::Invalid(format!(
                    "no workflow named {:?} is registered",
                    workflow.name
                ))
            })?
            .clone();
        let input = encode(input)?;
        let handle = RunHandle {
            shared: self.shared.clone(),
            id: id.to_string(),
            _out: PhantomData,
        };
        let lsn = {
            let mut runs = self.shared.runs.lock().unwrap_or_else(|p| p.into_inner());
            if runs.contains_key(id) {
                return Ok(handle);
            }
            let rec = Record {
                run: id.to_string(),
                generation: 0,
                pos: Some(0),
                entry: Entry::Started {
                    workflow: workflow.name.to_string(),
                    input: input.clone(),
                    parent: None,
                },
            };
            let lsn = self.shared.log.append(RECORD_KIND, &rec.encode())?;
            runs.insert(
                id.to_string(),
                RunEntry {
                    status: RunStatus::Running,
                    waiters: Vec::new(),
                },
            );
            self.spawn(Job {
                run: id.to_string(),
                generation: 0,
                replay: Replay::new([rec]),
                input,
                handler,
            });
            lsn
        };
        self.shared.log.durable(lsn).await?;
        Ok(handle)
    }

    /// Deliver `value` as signal `signal` to run `id`; returns once it is durable. The
    /// run's `wait_for` calls consume a name's signals in arrival order.
    pub async fn signal<T: Serialize>(
        &self,
        id: &str,
        signal: Signal<T>,
        value: &T,
    ) -> Result<(), FlowError> {
        let value = encode(value)?;
        let lsn = {
            let runs = self.shared.runs.lock().unwrap_or_else(|p| p.into_inner());
            match runs.get(id).map(|r| &r.status) {
                None => return Err(FlowError::Invalid(format!("no run {id:?}"))),
                Some(RunStatus::Finished(_)) => {
                    return Err(FlowError::Invalid(format!(
                        "run {id:?} has finished; it takes no more signals"
                    )));
                }
                _ => {}
            }
            let rec = Record {
                run: id.to_string(),
                generation: 0,
                pos: None,
                entry: Entry::Signal {
                    name: signal.name.to_string(),
                    value: value.clone(),
                },
            };
            // Appended and put in the inbox under the runs lock: the journal order and
            // the inbox order are the same.
            let lsn = self.shared.log.append(RECORD_KIND, &rec.encode())?;
            let mut inboxes = self
                .shared
                .inboxes
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let inbox = inboxes.entry(id.to_string()).or_default();
            inbox.signals.push((signal.name.to_string(), value));
            lsn
        };
        self.shared.log.durable(lsn).await?;
        let notify = self
            .shared
            .inboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .map(|i| i.arrived.clone());
        if let Some(n) = notify {
            n.notify_waiters();
        }
        Ok(())
    }

    /// A handle on an existing run (for `result` after a restart).
    pub fn run<O: DeserializeOwned>(&self, id: &str) -> Option<RunHandle<O>> {
        let runs = self.shared.runs.lock().unwrap_or_else(|p| p.into_inner());
        runs.contains_key(id).then(|| RunHandle {
            shared: self.shared.clone(),
            id: id.to_string(),
            _out: PhantomData,
        })
    }

    pub fn status(&self, id: &str) -> Option<RunStatus> {
        let runs = self.shared.runs.lock().unwrap_or_else(|p| p.into_inner());
        runs.get(id).map(|r| r.status.clone())
    }

    pub fn log_stats(&self) -> ferry_log::Stats {
        self.shared.log.stats()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for s in &mut self.shards {
            s.stop();
        }
    }
}

/// A run's result, awaitable from any thread.
pub struct RunHandle<O> {
    shared: Arc<Shared>,
    id: String,
    _out: PhantomData<fn() -> O>,
}

impl<O: DeserializeOwned> RunHandle<O> {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The run's output once it finished and that is durable; its error if it failed or
    /// is parked.
    pub async fn result(&self) -> Result<O, FlowError> {
        let rx = {
            let mut runs = self.shared.runs.lock().unwrap_or_else(|p| p.into_inner());
            let entry = runs
                .get_mut(&self.id)
                .ok_or_else(|| FlowError::Invalid(format!("no run {:?}", self.id)))?;
            match &entry.status {
                RunStatus::Running => {
                    let (tx, rx) = oneshot::channel();
                    entry.waiters.push(tx);
                    Some(rx)
                }
                done => return status_result(done.clone()),
            }
        };
        match rx {
            Some(rx) => status_result(rx.await.map_err(|_| FlowError::Stopped)?),
            None => unreachable!("returned above"),
        }
    }
}

fn status_result<O: DeserializeOwned>(s: RunStatus) -> Result<O, FlowError> {
    match s {
        RunStatus::Finished(Outcome::Ok(v)) => decode(v),
        RunStatus::Finished(Outcome::Err(e)) => Err(FlowError::Step {
            name: "workflow".into(),
            error: e,
        }),
        RunStatus::Parked(reason) => Err(FlowError::Parked(reason)),
        RunStatus::Running => Err(FlowError::Stopped),
    }
}

struct Shard {
    tx: mpsc::UnboundedSender<Job>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Shard {
    fn start(i: usize, shared: Arc<Shared>) -> Shard {
        let (tx, mut rx) = mpsc::unbounded_channel::<Job>();
        let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("ferry-flow-{i}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                    .expect("a current-thread runtime builds");
                let local = tokio::task::LocalSet::new();
                local.block_on(&rt, async move {
                    loop {
                        tokio::select! {
                            job = rx.recv() => match job {
                                Some(job) => {
                                    tokio::task::spawn_local(run_job(shared.clone(), job));
                                }
                                None => break,
                            },
                            _ = &mut stop_rx => break,
                        }
                    }
                });
            })
            .expect("spawning a shard thread");
        Shard {
            tx,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    fn stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Run (or resume) one run to its end on this shard.
async fn run_job(shared: Arc<Shared>, job: Job) {
    let ctx = Ctx {
        run: Rc::new(RunCtx {
            shared: shared.clone(),
            run: job.run.clone(),
            generation: job.generation,
            replay: RefCell::new(job.replay),
            last: Cell::new(0),
            consumed: RefCell::new(HashMap::new()),
        }),
    };
    let result = (job.handler)(ctx.clone(), job.input).await;
    let run = &ctx.run;
    let (entry, status) = match result {
        // Not journaled: after every restart the run replays up to the same call (no
        // step body runs while replaying) and parks again, until a deploy takes the
        // recorded path and it resumes by itself.
        Err(FlowError::Nondeterminism(n)) => {
            tracing::error!(run = %run.run, "{n}");
            shared.settle(&run.run, RunStatus::Parked(n.to_string()));
            return;
        }
        Err(FlowError::Log(e)) => {
            // The log refuses writes: nothing more can be journaled for this run in
            // this process; it resumes after a restart.
            tracing::error!(run = %run.run, "the journal failed: {e}");
            return;
        }
        Err(FlowError::Stopped) => return,
        Ok(v) => {
            let o = Outcome::Ok(v);
            (
                Entry::Finished { outcome: o.clone() },
                RunStatus::Finished(o),
            )
        }
        Err(e) => {
            let o = Outcome::Err(e.to_string());
            (
                Entry::Finished { outcome: o.clone() },
                RunStatus::Finished(o),
            )
        }
    };
    let pos = match run.replay.borrow_mut().finish() {
        Ok(Slot::Fresh { pos }) => Some(pos),
        Ok(Slot::Recorded { .. }) => None,
        Err(n) => {
            // The code returned while its journal holds more calls: parked, as above.
            tracing::error!(run = %run.run, "{n}");
            shared.settle(&run.run, RunStatus::Parked(n.to_string()));
            return;
        }
    };
    if let Some(pos) = pos
        && run.append(Some(pos), entry).is_err()
    {
        return;
    }
    // A result leaves the process only once its record is durable.
    if shared.log.durable(run.last.get()).await.is_ok() {
        shared.settle(&run.run, status);
    }
}

struct RunCtx {
    shared: Arc<Shared>,
    run: String,
    generation: u32,
    replay: RefCell<Replay>,
    /// The end of this run's last record: what anything leaving the process waits for.
    last: Cell<Lsn>,
    /// Signals consumed so far, by name (replayed waits count too).
    consumed: RefCell<HashMap<String, u32>>,
}

impl RunCtx {
    fn append(&self, pos: Option<u32>, entry: Entry) -> Result<(), FlowError> {
        let rec = Record {
            run: self.run.clone(),
            generation: self.generation,
            pos,
            entry,
        };
        let end = self.shared.log.append(RECORD_KIND, &rec.encode())?;
        self.last.set(end);
        Ok(())
    }
}

/// What a workflow's code calls (docs/flow.md §2). Cheap to clone; not `Send` (a run
/// lives on its shard).
#[derive(Clone)]
pub struct Ctx {
    run: Rc<RunCtx>,
}

fn step_result<T: DeserializeOwned>(name: &str, outcome: Outcome) -> Result<T, FlowError> {
    match outcome {
        Outcome::Ok(v) => decode(v),
        Outcome::Err(error) => Err(FlowError::Step {
            name: name.to_string(),
            error,
        }),
    }
}

/// How often a step is tried, and how long between tries: exponential from `first`,
/// doubling, capped at `max`. The retry time is journaled with each failed attempt, so
/// a restart neither retries early nor starts the count again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retry {
    pub max_attempts: u32,
    pub first: Duration,
    pub max: Duration,
}

impl Retry {
    /// One attempt: a failure is the step's result.
    pub fn none() -> Retry {
        Retry {
            max_attempts: 1,
            first: Duration::ZERO,
            max: Duration::ZERO,
        }
    }

    /// Up to `max_attempts` attempts, `first` after the first failure, doubling, at most
    /// a minute apart.
    pub fn exponential(max_attempts: u32, first: Duration) -> Retry {
        Retry {
            max_attempts: max_attempts.max(1),
            first,
            max: Duration::from_secs(60),
        }
    }

    fn delay(&self, failed_attempt: u32) -> Duration {
        let factor = 1u32 << failed_attempt.saturating_sub(1).min(20);
        (self.first * factor).min(self.max)
    }
}

/// A step being set up; await it to run it (see [`Ctx::step`]).
pub struct Step<'a, T, F> {
    ctx: &'a Ctx,
    name: String,
    body: F,
    retry: Retry,
    timeout: Option<Duration>,
    _out: PhantomData<fn() -> T>,
}

impl<T, F> Step<'_, T, F> {
    pub fn retry(mut self, retry: Retry) -> Self {
        self.retry = retry;
        self
    }

    /// Each attempt fails if it takes longer than `d`.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = Some(d);
        self
    }
}

impl<'a, T, F, Fut> std::future::IntoFuture for Step<'a, T, F>
where
    T: Serialize + DeserializeOwned + 'a,
    F: FnMut(StepCtx) -> Fut + 'a,
    Fut: Future<Output = Result<T, String>> + 'a,
{
    type Output = Result<T, FlowError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Result<T, FlowError>> + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(
            self.ctx
                .run_step(self.name, self.body, self.retry, self.timeout),
        )
    }
}

/// What a step's body gets: the key to pass to the outside world.
pub struct StepCtx {
    key: String,
}

impl StepCtx {
    /// Stable across re-executions of the same step of the same run: `run/generation/position`.
    pub fn key(&self) -> &str {
        &self.key
    }
}

impl Ctx {
    pub fn run_id(&self) -> &str {
        &self.run.run
    }

    /// Code changes that would change a running run's path go behind a patch:
    /// `if ctx.patched("fraud-check")? { … new calls … }`. True for runs that reach
    /// this point under the new code (journaled, so their replays take it again); false,
    /// taking no position, for runs journaled before it existed.
    pub fn patched(&self, id: &str) -> Result<bool, FlowError> {
        let (taken, pos) = self.run.replay.borrow_mut().patched(id);
        if let Some(pos) = pos {
            self.run
                .append(Some(pos), Entry::Patch { id: id.to_string() })?;
        }
        Ok(taken)
    }

    /// The wall clock in ms since the epoch, as the run first saw it here: replays see
    /// the same value.
    pub fn now_ms(&self) -> Result<u64, FlowError> {
        let v = self.value(ValueKind::Now, || Json::from(ferry_core::seams::wall_ms()))?;
        decode(v)
    }

    /// A random u64, the same on every replay.
    pub fn random_u64(&self) -> Result<u64, FlowError> {
        let v = self.value(ValueKind::Random, || {
            use ferry_core::seams::Rng;
            Json::from(ferry_core::seams::SplitMix64::from_entropy().next_u64())
        })?;
        decode(v)
    }

    /// Sleep durably: the wake-up time is journaled, so after a restart the run sleeps
    /// until the same moment (at once if it passed while the engine was down). Never
    /// wakes early by the wall clock.
    pub async fn sleep(&self, d: Duration) -> Result<(), FlowError> {
        let fresh_at = ferry_core::seams::wall_ms().saturating_add(d.as_millis() as u64);
        self.sleep_until_ms(fresh_at).await
    }

    /// Sleep until `at_ms` (ms since the epoch, wall clock), durably: see [`Ctx::sleep`].
    pub async fn sleep_until_ms(&self, at_ms: u64) -> Result<(), FlowError> {
        let (pos, fire_at) = {
            let mut replay = self.run.replay.borrow_mut();
            match replay.call(Call::Sleep)? {
                Slot::Recorded { pos, entries } => {
                    if entries.iter().any(|e| matches!(e, Entry::TimerFired)) {
                        return Ok(());
                    }
                    match &entries[0] {
                        Entry::TimerSet { fire_at_ms } => (Some(pos), *fire_at_ms),
                        other => {
                            return Err(FlowError::Codec(format!(
                                "position {pos} holds {} where a timer was set",
                                other.describe()
                            )));
                        }
                    }
                }
                Slot::Fresh { pos } => {
                    drop(replay);
                    self.run
                        .append(Some(pos), Entry::TimerSet { fire_at_ms: at_ms })?;
                    (Some(pos), at_ms)
                }
            }
        };
        loop {
            let now = ferry_core::seams::wall_ms();
            if now >= fire_at {
                break;
            }
            // Timers sleep on the monotonic clock, which may run a little ahead of the
            // wall clock: check again rather than fire early.
            tokio::time::sleep(Duration::from_millis(fire_at - now)).await;
        }
        if let Some(pos) = pos {
            self.run.append(Some(pos), Entry::TimerFired)?;
        }
        Ok(())
    }

    /// Wait for the next signal named `signal` (in arrival order), or until `timeout`
    /// passes: `None`. Which of the two happened is journaled, and the deadline too, so
    /// a restart keeps both.
    pub async fn wait_for<T: DeserializeOwned>(
        &self,
        signal: Signal<T>,
        timeout: Option<Duration>,
    ) -> Result<Option<T>, FlowError> {
        let name = signal.name;
        let (pos, deadline) = {
            let mut replay = self.run.replay.borrow_mut();
            match replay.call(Call::WaitFor(name))? {
                Slot::Recorded { pos, entries } => {
                    let mut deadline = None;
                    let mut got = None;
                    for e in entries {
                        match e {
                            Entry::WaitStarted { deadline_ms, .. } => deadline = *deadline_ms,
                            Entry::Waited { got: g, .. } => got = Some(*g),
                            _ => {}
                        }
                    }
                    match got {
                        Some(Some(index)) => {
                            drop(replay);
                            *self
                                .run
                                .consumed
                                .borrow_mut()
                                .entry(name.to_string())
                                .or_default() += 1;
                            let (value, _) = self.run.shared.signal(&self.run.run, name, index);
                            let value = value.ok_or_else(|| {
                                FlowError::Codec(format!(
                                    "the journal says signal {name:?} #{index} was consumed, but it never arrived"
                                ))
                            })?;
                            return decode(value).map(Some);
                        }
                        Some(None) => return Ok(None),
                        None => (pos, deadline),
                    }
                }
                Slot::Fresh { pos } => {
                    drop(replay);
                    let deadline = timeout
                        .map(|d| ferry_core::seams::wall_ms().saturating_add(d.as_millis() as u64));
                    self.run.append(
                        Some(pos),
                        Entry::WaitStarted {
                            name: name.to_string(),
                            deadline_ms: deadline,
                        },
                    )?;
                    (pos, deadline)
                }
            }
        };
        let index = self.run.consumed.borrow().get(name).copied().unwrap_or(0);
        let (_, arrived) = self.run.shared.signal(&self.run.run, name, index);
        loop {
            // Registered before looking, so an arrival in between is not missed.
            let notified = arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let (Some(v), _) = self.run.shared.signal(&self.run.run, name, index) {
                self.run.append(
                    Some(pos),
                    Entry::Waited {
                        name: name.to_string(),
                        got: Some(index),
                    },
                )?;
                *self
                    .run
                    .consumed
                    .borrow_mut()
                    .entry(name.to_string())
                    .or_default() += 1;
                return decode(v).map(Some);
            }
            let now = ferry_core::seams::wall_ms();
            match deadline {
                Some(d) if now >= d => {
                    self.run.append(
                        Some(pos),
                        Entry::Waited {
                            name: name.to_string(),
                            got: None,
                        },
                    )?;
                    return Ok(None);
                }
                Some(d) => {
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep(Duration::from_millis(d - now)) => {}
                    }
                }
                None => notified.await,
            }
        }
    }

    /// A value drawn once and journaled. Nothing outside the process has seen it, so it
    /// does not wait for the disk; a step that uses it waits (output holding).
    fn value(&self, kind: ValueKind, draw: impl FnOnce() -> Json) -> Result<Json, FlowError> {
        let pos = {
            let mut replay = self.run.replay.borrow_mut();
            match replay.call(Call::Value(kind))? {
                Slot::Recorded { entries, pos } => match &entries[0] {
                    Entry::Value { value, .. } => return Ok(value.clone()),
                    _ => {
                        return Err(FlowError::Codec(format!("position {pos} holds no value")));
                    }
                },
                Slot::Fresh { pos } => pos,
            }
        };
        let value = draw();
        self.run.append(
            Some(pos),
            Entry::Value {
                kind,
                value: value.clone(),
            },
        )?;
        Ok(value)
    }

    /// A step: `body` runs durably, once its result is journaled never again; on
    /// replay the journaled result is returned. Before each attempt everything this run
    /// journaled is durable (output holding). Await it directly, or set
    /// [`Step::retry`] and [`Step::timeout`] first. The body is called once per attempt.
    pub fn step<'a, T, F, Fut>(&'a self, name: &str, body: F) -> Step<'a, T, F>
    where
        T: Serialize + DeserializeOwned + 'a,
        F: FnMut(StepCtx) -> Fut + 'a,
        Fut: Future<Output = Result<T, String>> + 'a,
    {
        Step {
            ctx: self,
            name: name.to_string(),
            body,
            retry: Retry::none(),
            timeout: None,
            _out: PhantomData,
        }
    }

    async fn run_step<T, F, Fut>(
        &self,
        name: String,
        mut body: F,
        retry: Retry,
        timeout: Option<Duration>,
    ) -> Result<T, FlowError>
    where
        T: Serialize + DeserializeOwned,
        F: FnMut(StepCtx) -> Fut,
        Fut: Future<Output = Result<T, String>>,
    {
        // What the journal says: done, or attempts that failed and when to retry.
        let (pos, mut attempt, mut retry_at) = {
            let mut replay = self.run.replay.borrow_mut();
            match replay.call(Call::Step(&name))? {
                Slot::Recorded { pos, entries } => {
                    let mut attempts = 0;
                    let mut at = 0;
                    for e in entries {
                        match e {
                            Entry::Step { outcome, .. } => {
                                let outcome = outcome.clone();
                                drop(replay);
                                return step_result(&name, outcome);
                            }
                            Entry::StepAttempt {
                                attempt,
                                retry_at_ms,
                                ..
                            } => {
                                attempts = attempts.max(*attempt);
                                at = *retry_at_ms;
                            }
                            _ => {}
                        }
                    }
                    (pos, attempts + 1, at)
                }
                Slot::Fresh { pos } => (pos, 1, 0),
            }
        };
        loop {
            while ferry_core::seams::wall_ms() < retry_at {
                let wait = retry_at - ferry_core::seams::wall_ms().min(retry_at);
                tokio::time::sleep(Duration::from_millis(wait.max(1))).await;
            }
            // Output holding: the body talks to the outside world, so what it follows
            // must be durable first.
            self.run.shared.log.durable(self.run.last.get()).await?;
            let key = format!("{}/{}/{}", self.run.run, self.run.generation, pos);
            let attempt_result = match timeout {
                None => body(StepCtx { key }).await,
                Some(d) => match tokio::time::timeout(d, body(StepCtx { key })).await {
                    Ok(r) => r,
                    Err(_) => Err(format!("attempt {attempt} timed out after {d:?}")),
                },
            };
            let outcome = match attempt_result {
                Ok(v) => Outcome::Ok(encode(&v)?),
                Err(e) if attempt < retry.max_attempts => {
                    retry_at =
                        ferry_core::seams::wall_ms() + retry.delay(attempt).as_millis() as u64;
                    self.run.append(
                        Some(pos),
                        Entry::StepAttempt {
                            name: name.clone(),
                            attempt,
                            error: e,
                            retry_at_ms: retry_at,
                        },
                    )?;
                    attempt += 1;
                    continue;
                }
                Err(e) => Outcome::Err(e),
            };
            self.run.append(
                Some(pos),
                Entry::Step {
                    name: name.clone(),
                    outcome: outcome.clone(),
                    attempts: attempt,
                },
            )?;
            return step_result(&name, outcome);
        }
    }
}
