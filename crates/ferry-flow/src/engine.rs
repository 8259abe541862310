//! The engine (docs/flow.md §4): typed workflows, runs started by id, one ferry-log
//! shared by every shard, recovery by replay, parking, cancellation, continue-as-new,
//! child runs, limits. Runs are spread over shards, each a thread with a
//! single-threaded executor; every shard appends to the one log, whose writer's
//! fdatasync covers them all. What a workflow's code calls is in `ctx.rs`.

use crate::admin;
use crate::checkpoint::{self, Folded};
use crate::ctx::Ctx;
use crate::journal::{Entry, Json, Outcome, RECORD_KIND, RUN_ID_MAX, Record};
use crate::journal_log::{Failure, JournalLog, Watched};
use crate::metrics::Counters;
use crate::replay::{Nondeterminism, Replay, Slot};
use ferry_core::seams::{Clock, Rng, SplitMix64, SystemClock};
use ferry_log::{Config as LogConfig, Log, Lsn};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::marker::PhantomData;
use std::path::Path;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::thread::JoinHandle;
use tokio::sync::{Notify, mpsc, oneshot};

/// A signal's name and payload type: `static REVIEW: Signal<Review> = Signal::new("review");`
pub struct Signal<T> {
    pub(crate) name: &'static str,
    _types: PhantomData<fn(T)>,
}

impl<T> Signal<T> {
    pub const fn new(name: &'static str) -> Self {
        Signal {
            name,
            _types: PhantomData,
        }
    }

    pub fn name(&self) -> &'static str {
        self.name
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
    #[error("child run {id:?} failed: {error}")]
    Child { id: String, error: String },
    /// The run was cancelled (`engine.cancel`); returned by the suspension call that
    /// observed it, and by `result()` of a run that ended so.
    #[error("the run was cancelled")]
    Cancelled,
    #[error(transparent)]
    Nondeterminism(#[from] Nondeterminism),
    #[error("the run is parked: {0}")]
    Parked(String),
    #[error("{limit} is {value}, over the limit of {max}: {}", limit.hint())]
    LimitExceeded { limit: Limit, value: u64, max: u64 },
    /// What `ctx.continue_as_new` returns: return it from the workflow.
    #[error("the run continues as new")]
    ContinuedAsNew,
    #[error(transparent)]
    Log(#[from] ferry_log::Error),
    #[error("cannot encode or decode a value: {0}")]
    Codec(String),
    #[error("{0}")]
    Invalid(String),
    #[error("the engine stopped")]
    Stopped,
}

/// Which limit a run exceeded (docs/flow.md §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    Payload,
    History,
    Timers,
    Signals,
}

impl Limit {
    fn hint(&self) -> &'static str {
        match self {
            Limit::Payload => {
                "keep large values outside the journal (a blob store) and journal a \
                 reference, or raise Limits::payload_bytes"
            }
            Limit::History => {
                "long-running workflows should ctx.continue_as_new to start a fresh \
                 history, or raise Limits::history"
            }
            Limit::Timers => "await fewer sleeps at once, or raise Limits::timers",
            Limit::Signals => {
                "the run is not consuming its signals (wait_for); let it catch up, or \
                 raise Limits::signals"
            }
        }
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Limit::Payload => "a journal record's size in bytes",
            Limit::History => "the run's history length (entries this generation)",
            Limit::Timers => "the run's pending timers",
            Limit::Signals => "the run's pending signals",
        })
    }
}

/// Explicit limits per run (docs/flow.md §6). A run that exceeds one fails with
/// [`FlowError::LimitExceeded`]; other runs are unaffected. A caller exceeding one
/// (a start input, a signal) gets the error and nothing is journaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The largest journal record: a step result, input, output or signal payload with
    /// its few bytes of framing. Default 1 MiB.
    pub payload_bytes: usize,
    /// Entries per generation. Default 10,000.
    pub history: u32,
    /// Sleeps pending at once in one run. Default 1,000.
    pub timers: u32,
    /// Signals received and not yet consumed by one run. Default 1,000.
    pub signals: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            payload_bytes: 1 << 20,
            history: 10_000,
            timers: 1_000,
            signals: 1_000,
        }
    }
}

type Handler =
    Arc<dyn Fn(Ctx, Json) -> Pin<Box<dyn Future<Output = Result<Json, FlowError>>>> + Send + Sync>;

pub(crate) fn encode<T: Serialize>(v: &T) -> Result<Json, FlowError> {
    serde_json::to_value(v).map_err(|e| FlowError::Codec(e.to_string()))
}

pub(crate) fn decode<T: DeserializeOwned>(v: Json) -> Result<T, FlowError> {
    serde_json::from_value(v).map_err(|e| FlowError::Codec(e.to_string()))
}

/// A poisoned lock means a thread panicked while holding it; the maps it guards are
/// updated in single statements, so they are still consistent.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where a run stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunStatus {
    Running,
    Finished(Outcome),
    Parked(String),
}

/// One run, as `Engine::runs` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunInfo {
    pub id: String,
    pub workflow: String,
    pub generation: u32,
    pub status: RunStatus,
    pub parent: Option<String>,
}

/// One run in the runs map. Kept small (what most runs need inline, the rest boxed
/// when first needed): a map of a million parked runs is mostly these.
pub(crate) struct RunEntry {
    workflow: &'static str,
    pub(crate) status: RunStatus,
    generation: u32,
    /// The end of the run's start record: `start` returns once it is durable.
    start_end: Lsn,
    pub(crate) inbox: Inbox,
    extra: Option<Box<Extra>>,
}

/// What some runs have: a parent, callers waiting for the result, a park position, a
/// published state.
#[derive(Default)]
struct Extra {
    parent: Option<String>,
    /// Callers of `result()` and parents waiting for this child: told its end.
    waiters: Vec<oneshot::Sender<RunStatus>>,
    /// A parked run's generation and the position after its journal, where a
    /// cancellation journals its end.
    parked_at: Option<(u32, u32)>,
    published: Option<Json>,
}

impl RunEntry {
    fn new(
        workflow: &'static str,
        parent: Option<String>,
        generation: u32,
        status: RunStatus,
    ) -> Self {
        let mut e = RunEntry {
            workflow,
            status,
            generation,
            start_end: 0,
            inbox: Inbox::default(),
            extra: None,
        };
        if parent.is_some() {
            e.extra().parent = parent;
        }
        e
    }

    fn extra(&mut self) -> &mut Extra {
        self.extra.get_or_insert_with(Box::default)
    }

    pub(crate) fn parent(&self) -> Option<&String> {
        self.extra.as_ref().and_then(|x| x.parent.as_ref())
    }

    pub(crate) fn add_waiter(&mut self, tx: oneshot::Sender<RunStatus>) {
        self.extra().waiters.push(tx);
    }

    fn parked_at(&self) -> Option<(u32, u32)> {
        self.extra.as_ref().and_then(|x| x.parked_at)
    }

    fn set_parked_at(&mut self, at: Option<(u32, u32)>) {
        if at.is_some() || self.extra.is_some() {
            self.extra().parked_at = at;
        }
    }

    pub(crate) fn published(&self) -> Option<&Json> {
        self.extra.as_ref().and_then(|x| x.published.as_ref())
    }

    pub(crate) fn publish(&mut self, v: Json) {
        self.extra().published = Some(v);
    }
}

/// What arrived for a run from outside: signals in journal order, a cancellation.
#[derive(Default)]
pub(crate) struct Inbox {
    /// Shared with the run's context, which checks it without a lock.
    pub(crate) wake: Arc<Wake>,
    /// Boxed when the first signal comes.
    mail: Option<Box<Mail>>,
}

#[derive(Default)]
struct Mail {
    signals: Vec<(String, Json)>,
    /// Signals consumed (all names): `signals.len() - consumed` are pending.
    consumed: usize,
    /// The keys of keyed signals received (never reset: a key is delivered once).
    keys: Vec<String>,
}

impl Inbox {
    fn mail(&mut self) -> &mut Mail {
        self.mail.get_or_insert_with(Box::default)
    }

    pub(crate) fn pending(&self) -> usize {
        self.mail
            .as_ref()
            .map_or(0, |m| m.signals.len().saturating_sub(m.consumed))
    }

    pub(crate) fn consumed_one(&mut self) {
        self.mail().consumed += 1;
    }

    fn has_key(&self, k: &str) -> bool {
        self.mail
            .as_ref()
            .is_some_and(|m| m.keys.iter().any(|x| x == k))
    }

    fn push(&mut self, name: String, value: Json, key: Option<String>) {
        let m = self.mail();
        m.signals.push((name, value));
        m.keys.extend(key);
    }

    /// The `index`th signal named `name`.
    fn signal_at(&self, name: &str, index: u32) -> Option<Json> {
        self.mail.as_ref().and_then(|m| {
            m.signals
                .iter()
                .filter(|(n, _)| n == name)
                .nth(index as usize)
                .map(|(_, v)| v.clone())
        })
    }
}

/// A run's wake-up on arrivals, and its cancellation flag.
#[derive(Default)]
pub(crate) struct Wake {
    pub(crate) arrived: Notify,
    pub(crate) cancel: std::sync::atomic::AtomicBool,
}

/// What a cancellation does once its record is durable: nothing more (asked before),
/// wake the run, or settle a parked run as cancelled.
enum Then {
    Answer,
    Wake,
    Settle,
}

pub(crate) struct Shared {
    /// Where every record goes: ferry-log on the engine's directory, unless the
    /// builder was given a journal (`EngineBuilder::journal`).
    pub(crate) log: Arc<dyn JournalLog>,
    /// Every run by id. A B-tree, not a hash map: a hash map's resize moves every
    /// entry under this lock at once, which stalled every shard for tens of
    /// milliseconds at 30,000 runs.
    pub(crate) runs: Mutex<BTreeMap<String, RunEntry>>,
    handlers: HashMap<&'static str, Handler>,
    shards: Vec<mpsc::UnboundedSender<Vec<Job>>>,
    /// Runs started and not yet handed to their shard, by shard.
    starts: Vec<Arc<Starts>>,
    pub(crate) limits: Limits,
    pub(crate) clock: Arc<dyn Clock>,
    rng: Mutex<SplitMix64>,
    /// On the caller's thread (`on_this_thread`): every task the engine spawned there,
    /// aborted when it is dropped. (A shard thread's tasks die with its runtime.)
    here: Option<Mutex<Vec<tokio::task::AbortHandle>>>,
    /// What `Engine::metrics` reports.
    pub(crate) counters: Counters,
    /// The journal's failure, once it failed (noted by `log`, a `Watched`): callers
    /// waiting for a running run hear of it.
    pub(crate) failure: Arc<Failure>,
}

impl Shared {
    fn shard_of(&self, run: &str) -> usize {
        // FNV-1a: stable across processes, so a run stays on its shard after a restart.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in run.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        (h % self.shards.len() as u64) as usize
    }

    /// A random u64 from the engine's generator (seeded in a simulation).
    pub(crate) fn random_u64(&self) -> u64 {
        lock(&self.rng).next_u64()
    }

    /// Spawn `task` on this thread's `LocalSet` (a shard's, or the caller's with
    /// `on_this_thread`, where it is aborted with the engine).
    pub(crate) fn spawn_here(&self, task: impl Future<Output = ()> + 'static) {
        let handle = tokio::task::spawn_local(task);
        if let Some(here) = &self.here {
            let mut here = lock(here);
            // Finished tasks are dropped now and then, so this stays the size of what runs.
            if here.len() >= 64 && here.len().is_power_of_two() {
                here.retain(|h| !h.is_finished());
            }
            here.push(handle.abort_handle());
        }
    }

    /// Abort every task spawned on the caller's thread (`on_this_thread`): none is polled
    /// again, as none of a stopped shard thread's would be.
    fn abort_here(&self) {
        if let Some(here) = &self.here {
            for h in lock(here).drain(..) {
                h.abort();
            }
        }
    }

    fn spawn(&self, job: Job) {
        let _ = self.shards[self.shard_of(&job.run)].send(vec![job]);
    }

    /// Hand `job` to its shard once `end` (its start record) is durable
    /// ([`Starts`]).
    fn spawn_when_durable(&self, end: Lsn, job: Job) {
        let starts = &self.starts[self.shard_of(&job.run)];
        if starts.push(end, job) {
            Starts::arm(starts.clone(), &self.log, end);
        }
    }

    pub(crate) fn check_payload(&self, bytes: usize) -> Result<(), FlowError> {
        if bytes > self.limits.payload_bytes {
            return Err(FlowError::LimitExceeded {
                limit: Limit::Payload,
                value: bytes as u64,
                max: self.limits.payload_bytes as u64,
            });
        }
        Ok(())
    }

    /// Start run `id` of `workflow`, unless a run has that id. Returns the end of the
    /// id's start record (to wait for).
    pub(crate) fn start_run(
        &self,
        workflow: &str,
        id: &str,
        input: Json,
        parent: Option<String>,
    ) -> Result<Lsn, FlowError> {
        if id.is_empty() || id.len() > RUN_ID_MAX {
            return Err(FlowError::Invalid(format!(
                "a run id must be 1 to {RUN_ID_MAX} bytes, not {}",
                id.len()
            )));
        }
        if parent.is_none() && id.contains('/') {
            return Err(FlowError::Invalid(format!(
                "run id {id:?} contains '/', which only child runs' ids (parent/generation/\
                 position) do; pick an id without it"
            )));
        }
        let (&workflow, handler) = self.handlers.get_key_value(workflow).ok_or_else(|| {
            FlowError::Invalid(format!("no workflow named {workflow:?} is registered"))
        })?;
        let handler = handler.clone();
        let mut runs = lock(&self.runs);
        if let Some(e) = runs.get(id) {
            // The id is taken: the same workflow gets that run back (whatever the
            // input: docs/flow.md §1.6), another workflow would get a handle whose
            // result is not its type.
            if e.workflow != workflow {
                return Err(FlowError::Invalid(format!(
                    "run {id:?} exists as workflow {:?}, not {workflow:?}: pick another id, \
                     or start {:?}",
                    e.workflow, e.workflow
                )));
            }
            return Ok(e.start_end);
        }
        let rec = Record {
            run: id.to_string(),
            generation: 0,
            pos: Some(0),
            entry: Entry::Started {
                workflow: workflow.to_string(),
                input: input.clone(),
                parent: parent.clone(),
                consumed: BTreeMap::new(),
                cancel_seen: false,
            },
        };
        let bytes = rec.encode();
        self.check_payload(bytes.len())?;
        let end = self.log.append(RECORD_KIND, &bytes)?;
        let mut entry = RunEntry::new(workflow, parent, 0, RunStatus::Running);
        entry.start_end = end;
        self.counters.added(&entry.status, true);
        runs.insert(id.to_string(), entry);
        drop(runs);
        self.spawn_when_durable(
            end,
            Job {
                run: id.to_string(),
                generation: 0,
                replay: Replay::new([rec]),
                input,
                handler,
                last: end,
            },
        );
        Ok(end)
    }

    /// Ask run `id` to cancel (docs/flow.md §2). False if it had already finished.
    pub(crate) async fn cancel(&self, id: &str) -> Result<bool, FlowError> {
        let (end, then) = {
            let mut runs = lock(&self.runs);
            let e = runs
                .get_mut(id)
                .ok_or_else(|| FlowError::Invalid(format!("no run {id:?}")))?;
            if matches!(e.status, RunStatus::Finished(_)) {
                return Ok(false);
            }
            if e.inbox.wake.cancel.swap(true, Ordering::Relaxed) && e.parked_at().is_none() {
                // Asked before: answer once that request is durable.
                (self.log.end_lsn(), Then::Answer)
            } else {
                self.journal_cancel(id, e)?
            }
        };
        self.log.durable(end, None).await?;
        match then {
            Then::Answer => {}
            Then::Wake => self.wake(id),
            Then::Settle => self.settle(id, RunStatus::Finished(Outcome::Cancelled)),
        }
        Ok(true)
    }

    /// Journal run `id`'s cancellation request (and a parked run's end); the end of the
    /// last record, and whether the run was parked.
    fn journal_cancel(&self, id: &str, e: &mut RunEntry) -> Result<(Lsn, Then), FlowError> {
        let request = Record {
            run: id.to_string(),
            generation: e.generation,
            pos: None,
            entry: Entry::CancelRequested,
        };
        let mut end = self.log.append(RECORD_KIND, &request.encode())?;
        self.counters.cancel();
        // A parked run is not running: nothing will observe the request, so its
        // end is journaled here.
        let parked = e.parked_at();
        e.set_parked_at(None);
        if let Some((generation, pos)) = parked {
            let fin = Record {
                run: id.to_string(),
                generation,
                pos: Some(pos),
                entry: Entry::Finished {
                    outcome: Outcome::Cancelled,
                },
            };
            end = self.log.append(RECORD_KIND, &fin.encode())?;
        }
        Ok((
            end,
            if parked.is_some() {
                Then::Settle
            } else {
                Then::Wake
            },
        ))
    }

    /// Journal signal `name` for run `id` and put it in the run's inbox; a signal with
    /// a `key` the run already received is not delivered again.
    pub(crate) async fn deliver(
        &self,
        id: &str,
        name: &str,
        value: Json,
        key: Option<&str>,
    ) -> Result<(), FlowError> {
        let shared = self;
        let (end, fresh) = {
            let mut runs = lock(&shared.runs);
            let generation = match runs.get(id) {
                None => return Err(FlowError::Invalid(format!("no run {id:?}"))),
                Some(RunEntry {
                    status: RunStatus::Finished(_),
                    ..
                }) => {
                    return Err(FlowError::Invalid(format!(
                        "run {id:?} has finished; it takes no more signals"
                    )));
                }
                Some(e) => e.generation,
            };
            let rec = Record {
                run: id.to_string(),
                generation,
                pos: None,
                entry: Entry::Signal {
                    name: name.to_string(),
                    value: value.clone(),
                    key: key.map(str::to_string),
                },
            };
            let bytes = rec.encode();
            shared.check_payload(bytes.len())?;
            let inbox = &mut runs.get_mut(id).expect("looked up above").inbox;
            if let Some(k) = key
                && inbox.has_key(k)
            {
                // Delivered before: answer once that delivery is durable (everything
                // appended so far is).
                (shared.log.end_lsn(), false)
            } else {
                shared.journal_signal(inbox, &bytes, name, value, key)?
            }
        };
        shared.log.durable(end, None).await?;
        if fresh {
            shared.wake(id);
        }
        Ok(())
    }

    /// Append a signal's record and put it in the inbox (under the runs lock: the
    /// journal order and the inbox order are the same).
    fn journal_signal(
        &self,
        inbox: &mut Inbox,
        bytes: &[u8],
        name: &str,
        value: Json,
        key: Option<&str>,
    ) -> Result<(Lsn, bool), FlowError> {
        let pending = inbox.pending();
        if pending >= self.limits.signals as usize {
            return Err(FlowError::LimitExceeded {
                limit: Limit::Signals,
                value: pending as u64 + 1,
                max: u64::from(self.limits.signals),
            });
        }
        let end = self.log.append(RECORD_KIND, bytes)?;
        inbox.push(name.to_string(), value, key.map(str::to_string));
        self.counters.signal();
        Ok((end, true))
    }

    pub(crate) fn wake(&self, id: &str) {
        if let Some(w) = lock(&self.runs).get(id).map(|e| e.inbox.wake.clone()) {
            w.arrived.notify_waiters();
        }
    }

    /// The run's wake-up for arrivals (signals, cancellation) and cancellation flag.
    pub(crate) fn wake_of(&self, run: &str) -> Arc<Wake> {
        lock(&self.runs)
            .get(run)
            .map(|e| e.inbox.wake.clone())
            .unwrap_or_default()
    }

    /// The `index`th signal named `name` the run received.
    pub(crate) fn signal_at(&self, run: &str, name: &str, index: u32) -> Option<Json> {
        let runs = lock(&self.runs);
        runs.get(run).and_then(|e| e.inbox.signal_at(name, index))
    }

    /// Put a run found by recovery in the map (replacing what a checkpoint said of it).
    fn insert_recovered(&self, runs: &mut BTreeMap<String, RunEntry>, id: String, e: RunEntry) {
        self.counters.added(&e.status, false);
        if let Some(old) = runs.insert(id, e) {
            self.counters.removed(&old.status);
        }
    }

    pub(crate) fn settle(&self, run: &str, status: RunStatus) {
        let mut runs = lock(&self.runs);
        if let Some(e) = runs.get_mut(run) {
            self.counters.moved(&e.status, &status);
            e.status = status.clone();
            if let Some(x) = e.extra.as_mut() {
                for w in x.waiters.drain(..) {
                    let _ = w.send(status.clone());
                }
            }
        }
    }

    fn park(&self, run: &RunCtx, reason: String) {
        tracing::error!(run = %run.run, "parked: {reason}");
        let at = (run.generation, run.replay.borrow().len());
        lock(&self.runs)
            .get_mut(&run.run)
            .expect("a running run has an entry")
            .set_parked_at(Some(at));
        self.settle(&run.run, RunStatus::Parked(reason));
    }
}

/// Runs started on one shard whose start records are not durable yet. A run's first
/// step waits for its start record anyway; handed to the shard at once, the run would
/// wake the shard to run up to that wait and sleep again, a wake-up per start. Handed
/// over by the log's writer right after the sync, every run that sync started goes in
/// one message, which joins the wake-up that sync gives the shard for its steps (and
/// the writer waits for the shard as for them, `ferry_log::Follower`). One wait on the
/// log per shard at a time, for the lowest position pending when it was made (a run
/// pushed below it, by a starter that appended earlier but pushed later, waits for it:
/// at most one sync more).
struct Starts {
    pending: Mutex<Pending>,
    tx: mpsc::UnboundedSender<Vec<Job>>,
    follower: Option<ferry_log::Follower>,
    /// The shard's places for running runs (`EngineBuilder::max_running`).
    running: Option<Arc<tokio::sync::Semaphore>>,
}

#[derive(Default)]
struct Pending {
    /// By the end of the start record, ascending.
    jobs: VecDeque<(Lsn, Job)>,
    /// A wait on the log is registered.
    armed: bool,
}

impl Starts {
    /// Add `job`, whose start record ends at `end`; true if the caller must arm.
    fn push(&self, end: Lsn, job: Job) -> bool {
        let mut p = lock(&self.pending);
        // From the back: starts are pushed in about the order they were appended.
        let at = p
            .jobs
            .iter()
            .rposition(|(e, _)| *e <= end)
            .map_or(0, |i| i + 1);
        p.jobs.insert(at, (end, job));
        !std::mem::replace(&mut p.armed, true)
    }

    fn arm(starts: Arc<Starts>, log: &Arc<dyn JournalLog>, lsn: Lsn) {
        // Weak: the log holds this wait, and must not keep itself alive. Upgraded on
        // the writer's thread, it may be the last handle: ferry-log allows that.
        let weak = Arc::downgrade(log);
        let follower = starts.follower.clone();
        log.on_durable(
            lsn,
            follower.as_ref(),
            Box::new(move |r| {
                if let Some(log) = weak.upgrade() {
                    Starts::fire(starts, &log, r);
                }
            }),
        );
    }

    /// On the log's writer thread, after a sync: hand over what became durable, and
    /// wait again for what did not.
    fn fire(starts: Arc<Starts>, log: &Arc<dyn JournalLog>, r: Result<(), ferry_log::Error>) {
        let durable = log.durable_lsn();
        let (ready, next) = {
            let mut p = lock(&starts.pending);
            let n = p.jobs.partition_point(|(end, _)| *end <= durable);
            let ready: Vec<Job> = p.jobs.drain(..n).map(|(_, job)| job).collect();
            if let Err(e) = &r
                && let Some((_, first)) = p.jobs.front()
            {
                // The log stopped: what is not durable never will be in this process.
                // Their callers' `start` fails with the same error; each starts after
                // a restart if its record made it to the disk.
                tracing::warn!(
                    runs = p.jobs.len(),
                    first = %first.run,
                    "started runs not run in this process: {e}"
                );
                p.jobs.clear();
            }
            let next = p.jobs.front().map(|(end, _)| *end);
            p.armed = next.is_some();
            (ready, next)
        };
        if !ready.is_empty() && starts.tx.send(ready).is_err() {
            // The shard is gone (the engine closed): it will not go idle for this.
            if let Some(f) = &starts.follower {
                f.idle();
            }
        }
        if let Some(lsn) = next {
            Starts::arm(starts, log, lsn);
        }
    }
}

struct Job {
    run: String,
    generation: u32,
    replay: Replay,
    input: Json,
    handler: Handler,
    /// The end of the run's last record so far (what its first step waits for).
    last: Lsn,
}

/// What `EngineBuilder::wrap_files` puts between the log and its files.
type WrapFiles = Box<dyn FnOnce(ferry_log::FileStorage) -> Arc<dyn ferry_log::Storage> + Send>;

/// Builds an [`Engine`].
pub struct EngineBuilder {
    dir: std::path::PathBuf,
    storage: Option<Arc<dyn ferry_log::Storage>>,
    /// Put between the log and its files in `dir` (`wrap_files`).
    wrap_files: Option<WrapFiles>,
    journal: Option<Arc<dyn JournalLog>>,
    /// The log is ferry-log on files in `dir` (no storage or journal given): only
    /// then are there checkpoints, compaction, a status file and an inbox.
    storage_is_files: bool,
    shards: usize,
    /// Runs running at once per shard (`max_running`); `None`: no bound.
    max_running: Option<usize>,
    log: LogConfig,
    limits: Limits,
    retention: std::time::Duration,
    compact_bytes: Option<u64>,
    compact_interval: std::time::Duration,
    handlers: HashMap<&'static str, Handler>,
    clock: Arc<dyn Clock>,
    /// Run on the caller's thread, the disk's syncs timed from this seed.
    on_this_thread: Option<u64>,
}

/// Runs running at once on one shard, unless the builder says otherwise.
pub const DEFAULT_MAX_RUNNING: usize = 1_000;

impl EngineBuilder {
    pub fn shards(mut self, n: usize) -> Self {
        self.shards = n;
        self
    }

    /// How many runs may be running at once on one shard (default
    /// [`DEFAULT_MAX_RUNNING`]; `None`: no bound). A run is running from when its shard
    /// takes it up to its end, except while it waits in `sleep`, `wait_for`, a child's
    /// result or a retry's backoff: then it gives up its place, and takes one again
    /// before it goes on. Runs beyond the bound wait, in order, for a place; their starts
    /// are journaled and acknowledged as usual. Without a bound, a burst of starts, a
    /// recovery of many unfinished runs or a timer storm runs every one of them at once,
    /// each with its state in memory and interleaved with all the others. Below a few
    /// hundred, fewer records share each sync (docs/flow.md §4). A step whose body waits
    /// for another run of the same engine holds its place meanwhile: make that run a
    /// child instead.
    pub fn max_running(mut self, n: Option<usize>) -> Self {
        self.max_running = n;
        self
    }

    /// Keep the log on `storage` instead of files in the directory (the simulation).
    pub fn storage(mut self, storage: Arc<dyn ferry_log::Storage>) -> Self {
        self.storage = Some(storage);
        self
    }

    /// Keep the log on files in the directory, as by default (checkpoints, compaction,
    /// the status file and the inbox with it), but reach them through what `wrap`
    /// makes of them: a storage that adds to the real files, such as a fixed sync
    /// latency for a benchmark's control, or faults for a test.
    pub fn wrap_files(
        mut self,
        wrap: impl FnOnce(ferry_log::FileStorage) -> Arc<dyn ferry_log::Storage> + Send + 'static,
    ) -> Self {
        self.wrap_files = Some(Box::new(wrap));
        self
    }

    /// Journal to `journal` instead of a ferry-log of the engine's own: a log that
    /// lives elsewhere (docs/flow.md §4, "The seam"). Recovery reads it from its start;
    /// the engine keeps no checkpoints, retires nothing and keeps no status file or
    /// inbox in the directory, so bounding the history is the journal's job. Not with
    /// [`EngineBuilder::storage`].
    pub fn journal(mut self, journal: Arc<dyn JournalLog>) -> Self {
        self.journal = Some(journal);
        self
    }

    /// Read the wall clock (`ctx.now_ms`, timers, deadlines, retry times) from `clock`.
    /// Default: the system's.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Run on the caller's thread, for a deterministic simulation: `open` must then be
    /// called inside a tokio `LocalSet` on a current-thread runtime. The shards become
    /// tasks of that `LocalSet`, the log gets no writer thread, and a task writes and
    /// syncs it at moments drawn from `seed` (as are `ctx.random_u64` and `ctx.uuid`).
    /// Only with [`EngineBuilder::storage`] (or a [`EngineBuilder::journal`], which
    /// then makes records durable itself); nothing spawned outlives the engine. With
    /// tokio's clock paused and [`EngineBuilder::clock`] reading it, everything the
    /// engine does follows from the seed and the caller's own calls. docs/flow.md §4.
    pub fn on_this_thread(mut self, seed: u64) -> Self {
        self.on_this_thread = Some(seed);
        self
    }

    pub fn log_config(mut self, c: LogConfig) -> Self {
        self.log = c;
        self
    }

    pub fn limits(mut self, l: Limits) -> Self {
        self.limits = l;
        self
    }

    /// How long a finished run stays known (its result, `start` of its id returning
    /// it) after compaction first saw it finished. Default a day.
    pub fn retention(mut self, d: std::time::Duration) -> Self {
        self.retention = d;
        self
    }

    /// Compact once this many bytes were journaled since the last checkpoint (and at
    /// least every minute while anything was). Default: the log's segment size.
    pub fn compact_every(mut self, bytes: u64) -> Self {
        self.compact_bytes = Some(bytes.max(1));
        self
    }

    /// Never compact more often than this (a checkpoint rewrites every retained
    /// finished run). Default 10 s.
    pub fn compact_interval(mut self, d: std::time::Duration) -> Self {
        self.compact_interval = d;
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
    pub fn open(mut self) -> Result<Engine, FlowError> {
        self.storage_is_files = self.storage.is_none() && self.journal.is_none();
        if self.on_this_thread.is_some() && self.storage_is_files {
            return Err(FlowError::Invalid(
                "on_this_thread is for a simulation: give it its storage with .storage(..)".into(),
            ));
        }
        if self.storage.is_some() && self.journal.is_some() {
            return Err(FlowError::Invalid(
                "give the engine a storage for its own log or a journal, not both".into(),
            ));
        }
        if self.wrap_files.is_some() && !self.storage_is_files {
            return Err(FlowError::Invalid(
                "wrap_files wraps the log's files in the directory: it does not go with a \
                 storage or a journal of its own"
                    .into(),
            ));
        }
        if self.shards == 0 || self.shards > 256 {
            return Err(FlowError::Invalid(format!(
                "shards {} must be between 1 and 256",
                self.shards
            )));
        }
        if let Some(n) = self.max_running
            && (n == 0 || n > tokio::sync::Semaphore::MAX_PERMITS)
        {
            return Err(FlowError::Invalid(format!(
                "max_running {n} must be between 1 and {} (None for no bound)",
                tokio::sync::Semaphore::MAX_PERMITS
            )));
        }
        if self.limits.payload_bytes > self.log.record_bytes_max as usize {
            return Err(FlowError::Invalid(format!(
                "the payload limit ({} bytes) is over the log's largest record ({} bytes)",
                self.limits.payload_bytes, self.log.record_bytes_max
            )));
        }
        let started = std::time::Instant::now();
        let segment_bytes = self.log.segment_bytes;
        let over_journal = self.journal.is_some();
        // A driven log (on the caller's thread) is also kept as itself, for the task
        // that writes it.
        let mut driven = None;
        let (log, opened): (Arc<dyn JournalLog>, Option<ferry_log::Recovery>) =
            match (self.journal.take(), self.storage.take()) {
                (Some(journal), _) => (journal, None),
                (None, Some(st)) if self.on_this_thread.is_some() => {
                    let (log, found) = Log::open_driven(st, self.log)?;
                    let log = Arc::new(log);
                    driven = Some(log.clone());
                    (log, Some(found))
                }
                (None, Some(st)) => {
                    let (log, found) = Log::open(st, self.log)?;
                    (Arc::new(log), Some(found))
                }
                (None, None) => {
                    let (log, found) = match self.wrap_files.take() {
                        None => Log::open_dir(&self.dir, self.log)?,
                        Some(wrap) => {
                            // As `Log::open_dir` reports it.
                            let files = ferry_log::FileStorage::open(&self.dir).map_err(|e| {
                                ferry_log::Error::Io {
                                    what: "open its directory",
                                    source: Arc::new(e),
                                }
                            })?;
                            Log::open(wrap(files), self.log)?
                        }
                    };
                    (Arc::new(log), Some(found))
                }
            };
        if over_journal && log.start_lsn() > 0 {
            return Err(FlowError::Invalid(format!(
                "the journal starts at position {}: over a journal of its own the engine keeps \
                 no checkpoints, so it needs the whole history (from 0) to recover",
                log.start_lsn()
            )));
        }
        // Every failure of the journal, however it surfaces, is noted for the callers
        // waiting on runs that can no longer go on.
        let failure = Arc::new(Failure::default());
        let log: Arc<dyn JournalLog> = Arc::new(Watched {
            log,
            failure: failure.clone(),
        });
        let dir = self.storage_is_files.then_some(self.dir.as_path());
        let Journaled {
            folded,
            by_run,
            read,
        } = journaled(dir, &*log)?;
        let mut txs = Vec::new();
        let mut rxs = Vec::new();
        let mut starts = Vec::new();
        for _ in 0..self.shards {
            let (tx, rx) = mpsc::unbounded_channel::<Vec<Job>>();
            starts.push(Arc::new(Starts {
                pending: Mutex::new(Pending::default()),
                tx: tx.clone(),
                // Shards that are tasks on the caller's thread never go idle for it.
                follower: if self.on_this_thread.is_none() {
                    log.follower()
                } else {
                    None
                },
                running: self
                    .max_running
                    .map(|n| Arc::new(tokio::sync::Semaphore::new(n))),
            }));
            txs.push(tx);
            rxs.push(rx);
        }
        let shared = Arc::new(Shared {
            log: log.clone(),
            runs: Mutex::new(BTreeMap::new()),
            handlers: self.handlers,
            shards: txs,
            starts,
            limits: self.limits,
            clock: self.clock,
            rng: Mutex::new(match self.on_this_thread {
                Some(seed) => SplitMix64::seeded(seed),
                None => SplitMix64::from_entropy(),
            }),
            here: self.on_this_thread.map(|_| Mutex::new(Vec::new())),
            counters: Counters::default(),
            failure,
        });
        {
            let mut runs = lock(&shared.runs);
            for (id, d) in &folded.finished {
                let name = shared.workflow_name(&d.workflow);
                let e = RunEntry::new(
                    name,
                    d.parent.clone(),
                    d.generation,
                    RunStatus::Finished(d.outcome.clone()),
                );
                shared.insert_recovered(&mut runs, id.clone(), e);
            }
        }
        let mut resumed = 0;
        for (run, records) in by_run {
            if recover_run(&shared, run, records)? {
                resumed += 1;
            }
        }
        // The shards start after every run is known, so a resumed parent finds its
        // children.
        let shards = match self.on_this_thread {
            None => rxs
                .into_iter()
                .enumerate()
                .map(|(i, rx)| Shard::start(i, shared.clone(), rx))
                .collect(),
            Some(seed) => {
                for rx in rxs {
                    let shared2 = shared.clone();
                    shared.spawn_here(Shard::run_here(shared2, rx));
                }
                if let Some(log) = driven {
                    shared.spawn_here(disk(log, seed));
                }
                Vec::new()
            }
        };
        let elapsed = started.elapsed();
        // A journal of someone else's recovers before it is handed over: what the
        // engine read of it is what it counts.
        let (log_records, torn_bytes) = opened.map_or((read, 0), |o| (o.records, o.torn_bytes));
        tracing::info!(
            resumed,
            log_records,
            ms = elapsed.as_secs_f64() * 1e3,
            "flow engine open"
        );
        let recovery = Recovery {
            elapsed,
            log_records,
            resumed,
            torn_bytes,
        };
        // An engine on files keeps a status file and takes requests in its directory;
        // one on other storage (the simulation) has no directory of its own.
        let admin = if self.storage_is_files {
            let compaction = Compaction {
                every_bytes: self.compact_bytes.unwrap_or(segment_bytes),
                min_interval: self.compact_interval,
                retention_ms: self.retention.as_millis() as u64,
                last: std::time::Instant::now(),
                broken: false,
                folded,
            };
            Some(Admin::start(self.dir, shared.clone(), recovery, compaction))
        } else {
            None
        };
        Ok(Engine {
            shared,
            shards,
            recovery,
            admin,
        })
    }
}

impl Shared {
    /// A workflow name as the registry spells it; a name no handler has (a run of a
    /// workflow this build does not register) is leaked, once per distinct name.
    fn workflow_name(&self, name: &str) -> &'static str {
        if let Some((&k, _)) = self.handlers.get_key_value(name) {
            return k;
        }
        static UNKNOWN: Mutex<BTreeMap<String, &'static str>> = Mutex::new(BTreeMap::new());
        lock(&UNKNOWN)
            .entry(name.to_string())
            .or_insert_with(|| Box::leak(name.to_string().into_boxed_str()))
    }
}

/// Rebuild one run from its records (every generation's, in log order): its inbox, its
/// status, and a job on its shard if it is unfinished. True if it resumed.
fn recover_run(shared: &Shared, run: String, records: Vec<Record>) -> Result<bool, FlowError> {
    let generation = records
        .iter()
        .filter(|r| r.pos.is_some())
        .map(|r| r.generation)
        .max()
        .unwrap_or(0);
    // Arrivals belong to the run, whatever generation was current when they came.
    let records: Vec<Record> = records
        .into_iter()
        .filter(|r| r.pos.is_none() || r.generation == generation)
        .collect();
    let mut replay = Replay::new(records);
    let (workflow, input, parent, mut consumed, mut cancel_seen) = match replay.started() {
        Some(Entry::Started {
            workflow,
            input,
            parent,
            consumed,
            cancel_seen,
        }) => (
            workflow.clone(),
            input.clone(),
            parent.clone(),
            consumed.clone(),
            *cancel_seen,
        ),
        _ => {
            // Only damage or a bug leaves this. A cancel ends such a run (journaled
            // after its last position, so that end is found again on the next open).
            let mut e = match replay.last() {
                Some(Entry::Finished { outcome }) => {
                    RunEntry::new("?", None, generation, RunStatus::Finished(outcome.clone()))
                }
                _ => {
                    let reason = "the journal has no start record for this generation";
                    RunEntry::new("?", None, generation, RunStatus::Parked(reason.into()))
                }
            };
            if matches!(e.status, RunStatus::Parked(_)) {
                e.set_parked_at(Some((generation, replay.len())));
            }
            shared.insert_recovered(&mut lock(&shared.runs), run, e);
            return Ok(false);
        }
    };
    // What the run consumed up to its journal's end, this generation included.
    for (name, n) in replay.consumed_by_name() {
        *consumed.entry(name).or_default() += n;
    }
    cancel_seen |= replay.cancel_seen();
    let name = shared.workflow_name(&workflow);
    let mut entry = RunEntry::new(name, parent.clone(), generation, RunStatus::Running);
    let consumed_total: usize = consumed.values().map(|n| *n as usize).sum();
    if consumed_total > 0 {
        entry.inbox.mail().consumed = consumed_total;
    }
    for e in replay.take_arrivals() {
        match e {
            Entry::Signal { name, value, key } => {
                entry.inbox.push(name, value, key);
            }
            Entry::CancelRequested => entry.inbox.wake.cancel.store(true, Ordering::Relaxed),
            _ => {}
        }
    }
    let mut job_generation = generation;
    let mut job_input = input;
    let mut last = 0;
    match replay.last() {
        Some(Entry::Finished { outcome }) => entry.status = RunStatus::Finished(outcome.clone()),
        Some(Entry::Parked { reason }) => entry.status = RunStatus::Parked(reason.clone()),
        // The generation ended but the next one's start was lost: journal it again.
        Some(Entry::ContinuedAsNew { input }) => {
            let next = next_start(
                &run,
                generation + 1,
                &workflow,
                input,
                parent,
                consumed,
                cancel_seen,
            );
            last = shared.log.append(RECORD_KIND, &next.encode())?;
            job_generation = generation + 1;
            job_input = input.clone();
            replay = Replay::new([next]);
        }
        _ => {}
    }
    entry.generation = job_generation;
    let resume = entry.status == RunStatus::Running;
    if resume {
        match shared.handlers.get(workflow.as_str()) {
            Some(h) => shared.spawn(Job {
                run: run.clone(),
                generation: job_generation,
                replay,
                input: job_input,
                handler: h.clone(),
                last,
            }),
            None => {
                entry.status = RunStatus::Parked(format!(
                    "no workflow named {workflow:?} is registered; register it and restart"
                ));
                entry.set_parked_at(Some((job_generation, replay.len())));
            }
        }
    }
    shared.insert_recovered(&mut lock(&shared.runs), run, entry);
    Ok(resume)
}

/// The start record of generation `generation`, carrying what the run consumed in
/// the generations before it.
fn next_start(
    run: &str,
    generation: u32,
    workflow: &str,
    input: &Json,
    parent: Option<String>,
    consumed: BTreeMap<String, u32>,
    cancel_seen: bool,
) -> Record {
    Record {
        run: run.to_string(),
        generation,
        pos: Some(0),
        entry: Entry::Started {
            workflow: workflow.to_string(),
            input: input.clone(),
            parent,
            consumed,
            cancel_seen,
        },
    }
}

/// How long opening took, and what it found.
#[derive(Clone, Copy, Debug)]
pub struct Recovery {
    pub elapsed: std::time::Duration,
    pub log_records: u64,
    pub resumed: usize,
    /// Bytes of a torn tail the log cut (a write a crash cut short, never acknowledged).
    pub torn_bytes: u64,
}

/// Durable execution on one directory.
pub struct Engine {
    shared: Arc<Shared>,
    shards: Vec<Shard>,
    recovery: Recovery,
    admin: Option<Admin>,
}

impl Engine {
    pub fn builder(dir: impl AsRef<Path>) -> EngineBuilder {
        EngineBuilder {
            dir: dir.as_ref().to_path_buf(),
            storage: None,
            wrap_files: None,
            journal: None,
            storage_is_files: true,
            shards: 2,
            max_running: Some(DEFAULT_MAX_RUNNING),
            log: LogConfig::default(),
            limits: Limits::default(),
            retention: std::time::Duration::from_secs(24 * 3600),
            compact_bytes: None,
            compact_interval: std::time::Duration::from_secs(10),
            handlers: HashMap::new(),
            clock: Arc::new(SystemClock),
            on_this_thread: None,
        }
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
        let end = self
            .shared
            .start_run(workflow.name, id, encode(input)?, None)?;
        self.shared.log.durable(end, None).await?;
        Ok(RunHandle {
            shared: Arc::downgrade(&self.shared),
            id: id.to_string(),
            _out: PhantomData,
        })
    }

    /// Deliver `value` as signal `signal` to run `id`; returns once it is durable. The
    /// run's `wait_for` calls consume a name's signals in arrival order.
    pub async fn signal<T: Serialize>(
        &self,
        id: &str,
        signal: Signal<T>,
        value: &T,
    ) -> Result<(), FlowError> {
        self.signal_json(id, signal.name, encode(value)?).await
    }

    /// [`Engine::signal`], delivered at most once per `key`: sending again with the same
    /// key (a retry after a timeout or a crash of the sender) returns once the first
    /// delivery is durable and delivers nothing more.
    pub async fn signal_once<T: Serialize>(
        &self,
        id: &str,
        signal: Signal<T>,
        value: &T,
        key: &str,
    ) -> Result<(), FlowError> {
        let value = encode(value)?;
        self.shared.deliver(id, signal.name, value, Some(key)).await
    }

    /// [`Engine::signal`] with an untyped value.
    pub async fn signal_json(&self, id: &str, name: &str, value: Json) -> Result<(), FlowError> {
        self.shared.deliver(id, name, value, None).await
    }

    /// Ask run `id` to cancel; returns once the request is durable. The run's next
    /// suspension point (`step`, `sleep`, `wait_for`, `child`) returns
    /// [`FlowError::Cancelled`]; a parked run ends cancelled at once. False if the run
    /// had already finished.
    pub async fn cancel(&self, id: &str) -> Result<bool, FlowError> {
        self.shared.cancel(id).await
    }

    /// What run `id` last published with `ctx.publish` (rebuilt by replay after a
    /// restart), if anything.
    pub fn query<T: DeserializeOwned>(&self, id: &str) -> Result<Option<T>, FlowError> {
        let v = {
            let runs = lock(&self.shared.runs);
            let e = runs
                .get(id)
                .ok_or_else(|| FlowError::Invalid(format!("no run {id:?}")))?;
            e.published().cloned()
        };
        v.map(decode).transpose()
    }

    /// A handle on an existing run (for `result` after a restart).
    pub fn run<O: DeserializeOwned>(&self, id: &str) -> Option<RunHandle<O>> {
        let runs = lock(&self.shared.runs);
        runs.contains_key(id).then(|| RunHandle {
            shared: Arc::downgrade(&self.shared),
            id: id.to_string(),
            _out: PhantomData,
        })
    }

    pub fn status(&self, id: &str) -> Option<RunStatus> {
        lock(&self.shared.runs).get(id).map(|r| r.status.clone())
    }

    /// Every run the engine knows, by id.
    pub fn runs(&self) -> Vec<RunInfo> {
        let runs = lock(&self.shared.runs);
        let mut v: Vec<RunInfo> = runs
            .iter()
            .map(|(id, e)| RunInfo {
                id: id.clone(),
                workflow: e.workflow.to_string(),
                generation: e.generation,
                status: e.status.clone(),
                parent: e.parent().cloned(),
            })
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    pub fn log_stats(&self) -> ferry_log::Stats {
        self.shared.log.stats()
    }

    /// The engine's counters, its runs by state, its recovery and its log's figures, as
    /// Prometheus text (version 0.0.4) for the application to serve on its `/metrics`
    /// (docs/flow.md §7). Cheap: it walks no runs.
    pub fn metrics(&self) -> String {
        self.shared
            .counters
            .render(&self.recovery, &self.shared.log.stats())
    }

    /// What opening found, and how long it took.
    pub fn recovery(&self) -> Recovery {
        self.recovery
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for s in &mut self.shards {
            s.stop();
        }
        self.shared.abort_here();
        // Callers still waiting for a result hear that the engine stopped, even if
        // something keeps the runs map alive a while longer.
        for entry in lock(&self.shared.runs).values_mut() {
            if let Some(x) = entry.extra.as_mut() {
                x.waiters.clear();
            }
        }
        // After the shards: the last status shows where every run stopped.
        if let Some(a) = self.admin.take() {
            a.stop();
        }
    }
}

/// The journal records an engine directory holds for the runs a restart would replay,
/// by run, in order: the newest checkpoint's records of each unfinished run, then
/// every record the log holds after it, read as an engine's open would read them (a
/// torn tail is not a record). Reads a copy of the log's segments and the checkpoints
/// (in the system's temporary directory, removed afterwards), so the directory is left
/// exactly as it is and the next open still finds what it must repair; no engine may
/// be writing it meanwhile. For tools and tests that check what is durable, e.g. which
/// step results a crash left.
pub fn read_journal(dir: impl AsRef<Path>) -> Result<BTreeMap<String, Vec<Record>>, FlowError> {
    let dir = dir.as_ref();
    let io = |what: &str, e: std::io::Error| {
        FlowError::Invalid(format!(
            "reading the journal in {}: {what}: {e}",
            dir.display()
        ))
    };
    static COPIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let copy = std::env::temp_dir().join(format!(
        "ferry-flow-read-{}-{}",
        std::process::id(),
        COPIES.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&copy).map_err(|e| io("make a directory for the copy", e))?;
    let read = (|| {
        for entry in std::fs::read_dir(dir).map_err(|e| io("list it", e))? {
            let entry = entry.map_err(|e| io("list it", e))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            // Segments and checkpoints: what an open reads (spares hold nothing).
            if name.ends_with(".seg") || name.starts_with("checkpoint-") {
                std::fs::copy(entry.path(), copy.join(&*name))
                    .map_err(|e| io(&format!("copy {name}"), e))?;
            }
        }
        let (log, _) = Log::open_dir(&copy, LogConfig::default())?;
        read_log(log, Some(&copy))
    })();
    let _ = std::fs::remove_dir_all(&copy);
    read
}

/// [`read_journal`] for a log on `storage` (an engine off files, which keeps no
/// checkpoints: the log is all there is). The log is recovered in place, so pass a
/// copy of a state that the engine's own open must still find (`SimStorage::copy`).
pub fn read_journal_on(
    storage: Arc<dyn ferry_log::Storage>,
) -> Result<BTreeMap<String, Vec<Record>>, FlowError> {
    let (log, _) = Log::open(storage, LogConfig::default())?;
    read_log(log, None)
}

/// What an open of `log` (and of the checkpoints in `dir`) replays, by run; then the
/// log is closed.
fn read_log(log: Log, dir: Option<&Path>) -> Result<BTreeMap<String, Vec<Record>>, FlowError> {
    let journaled = journaled(dir, &log)?;
    log.close()?;
    Ok(journaled.by_run)
}

/// What an open replays.
struct Journaled {
    /// The newest checkpoint (empty off files).
    folded: Folded,
    /// By run: its records in the checkpoint, then those after it in the log.
    by_run: BTreeMap<String, Vec<Record>>,
    /// Records read from the log.
    read: u64,
}

/// Load the newest checkpoint of `dir` (an engine on files) and the log's records after
/// it.
fn journaled(dir: Option<&Path>, log: &dyn JournalLog) -> Result<Journaled, FlowError> {
    let folded = match dir {
        Some(dir) => load_checkpoint(dir, log)?,
        None => Folded::default(),
    };
    let mut by_run: BTreeMap<String, Vec<Record>> = folded
        .active_records()
        .map_err(|e| FlowError::Codec(format!("the newest checkpoint holds a bad record ({e})")))?;
    let mut bad = None;
    let mut read = 0u64;
    log.read(folded.lsn, &mut |r| {
        if r.kind != RECORD_KIND {
            return;
        }
        read += 1;
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
    Ok(Journaled {
        folded,
        by_run,
        read,
    })
}

/// The newest checkpoint in `dir` (none: an empty one), checked against the log.
fn load_checkpoint(dir: &Path, log: &dyn JournalLog) -> Result<Folded, FlowError> {
    let io = |e: std::io::Error| FlowError::Invalid(format!("reading {}: {e}", dir.display()));
    let found = checkpoint::list(dir).map_err(io)?;
    let folded = match found.last() {
        None => Folded::default(),
        Some((_, path)) => {
            let bytes = std::fs::read(path).map_err(io)?;
            Folded::decode(&bytes).map_err(|e| {
                FlowError::Codec(format!(
                    "the checkpoint {} is unreadable: {e}; the log before it was retired, so \
                     restore the directory from a copy",
                    path.display()
                ))
            })?
        }
    };
    if log.start_lsn() > folded.lsn {
        return Err(FlowError::Invalid(format!(
            "the log in {} starts at {} but no checkpoint covers what came before it; \
             restore the directory (with its checkpoint files) from a copy",
            dir.display(),
            log.start_lsn()
        )));
    }
    if log.end_lsn() < folded.lsn {
        return Err(FlowError::Invalid(format!(
            "the checkpoint in {} covers the log up to {} but the log ends at {}: the log \
             was replaced or cut; restore the directory from a copy",
            dir.display(),
            folded.lsn,
            log.end_lsn()
        )));
    }
    // Older checkpoints, segments below this one and half-written checkpoints may be
    // left by a crash between writing it and cleaning up.
    for (lsn, path) in &found {
        if *lsn < folded.lsn {
            let _ = std::fs::remove_file(path);
        }
    }
    checkpoint::remove_leftovers(dir);
    log.retire_below(folded.lsn)?;
    Ok(folded)
}

/// Compaction's state: what is folded so far, and when to fold more.
struct Compaction {
    folded: Folded,
    every_bytes: u64,
    min_interval: std::time::Duration,
    retention_ms: u64,
    last: std::time::Instant,
    /// A record could not be folded: compaction stops (the log keeps everything)
    /// until the engine is reopened.
    broken: bool,
}

impl Compaction {
    fn maybe_run(&mut self, shared: &Shared, dir: &Path) {
        let durable = shared.log.durable_lsn();
        let behind = durable.saturating_sub(self.folded.lsn);
        let since = self.last.elapsed();
        let due = (behind >= self.every_bytes && since >= self.min_interval)
            || (behind > 0 && since >= std::time::Duration::from_secs(60));
        if self.broken || !due {
            return;
        }
        self.last = std::time::Instant::now();
        let result = self.run(shared, dir);
        if let Err(e) = &result {
            tracing::warn!("compaction: {e}");
        }
        shared
            .counters
            .compacted(self.last.elapsed(), result.map_err(|_| ()));
    }

    /// Fold what became durable, expire old finished runs, write the checkpoint, then
    /// retire the segments it covers; how many it retired.
    fn run(&mut self, shared: &Shared, dir: &Path) -> Result<usize, String> {
        let t = std::time::Instant::now();
        let now = shared.clock.wall_ms();
        let mut bad = None;
        let folded = &mut self.folded;
        let upto = shared
            .log
            .read(folded.lsn, &mut |r| {
                if r.kind == RECORD_KIND
                    && bad.is_none()
                    && let Err(e) = folded.fold(r.payload, now)
                {
                    bad = Some(format!("record at {}: {e}", r.lsn));
                }
            })
            .map_err(|e| e.to_string())?;
        if let Some(e) = bad {
            self.broken = true;
            return Err(format!("stopped: {e}"));
        }
        folded.lsn = upto;
        // Forgotten by the fold now, so by the runs map now too (the checkpoint below
        // may fail; the next one is written from this fold).
        let expired = folded.expire(now, self.retention_ms);
        let mut removed = 0;
        for chunk in expired.chunks(1000) {
            let mut runs = lock(&shared.runs);
            for id in chunk {
                if matches!(
                    runs.get(id).map(|e| &e.status),
                    Some(RunStatus::Finished(_))
                ) && let Some(e) = runs.remove(id)
                {
                    shared.counters.removed(&e.status);
                    removed += 1;
                }
            }
        }
        shared.counters.expired(removed);
        let path = checkpoint::path(dir, upto);
        ferry_core::fs::write_atomic(&path, &folded.encode())
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        for (lsn, old) in checkpoint::list(dir).map_err(|e| e.to_string())? {
            if lsn < upto {
                let _ = std::fs::remove_file(old);
            }
        }
        let retired = shared.log.retire_below(upto).map_err(|e| e.to_string())?;
        tracing::info!(
            lsn = upto,
            active = folded.active.len(),
            finished = folded.finished.len(),
            expired = removed,
            retired,
            ms = t.elapsed().as_secs_f64() * 1e3,
            "checkpoint written"
        );
        Ok(retired)
    }
}

/// The thread that keeps the status file and answers the inbox (`admin.rs`).
struct Admin {
    stop: std::sync::mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

impl Admin {
    fn start(
        dir: std::path::PathBuf,
        shared: Arc<Shared>,
        recovery: Recovery,
        mut compaction: Compaction,
    ) -> Admin {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("ferry-flow-admin".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                    .expect("a current-thread runtime builds");
                let mut pruned: Option<std::time::Instant> = None;
                let opened = std::time::Instant::now();
                shared.write_status(&dir, recovery, true);
                loop {
                    if pruned.is_none_or(|t| t.elapsed() > std::time::Duration::from_secs(60)) {
                        admin::prune_replies(&dir, std::time::Duration::from_secs(600));
                        pruned = Some(std::time::Instant::now());
                    }
                    for (id, req) in admin::pending(&dir) {
                        let reply = match req {
                            Ok(admin::Request::Status) => {
                                shared.write_status(&dir, recovery, true);
                                admin::Reply {
                                    ok: true,
                                    message: "status written".into(),
                                }
                            }
                            Ok(admin::Request::Metrics) => admin::Reply {
                                ok: true,
                                message: shared.counters.render(&recovery, &shared.log.stats()),
                            },
                            // A request queued while no engine ran, for a run the
                            // application has not started again yet: it gets ten
                            // seconds after opening to do so.
                            Ok(
                                admin::Request::Signal { run, .. } | admin::Request::Cancel { run },
                            ) if !lock(&shared.runs).contains_key(run.as_str())
                                && admin::age(&id) > opened.elapsed()
                                && opened.elapsed() < std::time::Duration::from_secs(10) =>
                            {
                                continue;
                            }
                            Ok(req) => rt.block_on(shared.apply(&id, req)),
                            Err(e) => admin::Reply {
                                ok: false,
                                message: e,
                            },
                        };
                        if let Err(e) = admin::answer(&dir, &id, &reply) {
                            tracing::warn!(request = %id, "answering a request: {e}");
                        }
                    }
                    compaction.maybe_run(&shared, &dir);
                    match stopped.recv_timeout(std::time::Duration::from_millis(100)) {
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        _ => break,
                    }
                }
                shared.write_status(&dir, recovery, false);
            })
            .expect("spawning the admin thread");
        Admin { stop, thread }
    }

    fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.thread.join();
    }
}

impl Shared {
    /// Carry out a request from the inbox.
    async fn apply(&self, request: &str, req: admin::Request) -> admin::Reply {
        let (ok, message) = match req {
            admin::Request::Signal { run, name, value } => {
                // Keyed by the request: applied again after a crash before the request
                // was removed, it is not delivered twice.
                match self.deliver(&run, &name, value, Some(request)).await {
                    Ok(()) => (true, format!("signal {name:?} delivered to {run:?}")),
                    Err(e) => (false, e.to_string()),
                }
            }
            admin::Request::Cancel { run } => match self.cancel(&run).await {
                Ok(true) => (true, format!("cancellation of {run:?} requested")),
                Ok(false) => (true, format!("{run:?} had already finished")),
                Err(e) => (false, e.to_string()),
            },
            admin::Request::Status | admin::Request::Metrics => (
                false,
                "status and metrics requests are answered by the admin loop".into(),
            ),
        };
        admin::Reply { ok, message }
    }

    /// Every run's view, taken a thousand runs at a time so the shards never wait
    /// long for the runs lock.
    fn views(&self) -> Vec<admin::RunView> {
        use std::ops::Bound;
        let mut views: Vec<admin::RunView> = Vec::new();
        loop {
            let runs = lock(&self.runs);
            let from = match views.last() {
                Some(v) => Bound::Excluded(v.id.clone()),
                None => Bound::Unbounded,
            };
            let before = views.len();
            for (id, e) in runs.range((from, Bound::Unbounded)).take(1000) {
                let (state, detail) = match &e.status {
                    RunStatus::Running => ("running", None),
                    RunStatus::Finished(Outcome::Ok(v)) => ("finished", Some(v.clone())),
                    RunStatus::Finished(Outcome::Err(err)) => {
                        ("failed", Some(Json::from(err.clone())))
                    }
                    RunStatus::Finished(Outcome::Cancelled) => ("cancelled", None),
                    RunStatus::Parked(why) => ("parked", Some(Json::from(why.clone()))),
                };
                views.push(admin::RunView {
                    id: id.clone(),
                    workflow: e.workflow.to_string(),
                    generation: e.generation,
                    state: state.into(),
                    detail,
                    parent: e.parent().cloned(),
                    published: e.published().cloned(),
                    pending_signals: e.inbox.pending(),
                });
            }
            if views.len() - before < 1000 {
                return views;
            }
        }
    }

    fn write_status(&self, dir: &Path, recovery: Recovery, open: bool) {
        let runs = self.views();
        let stats = self.log.stats();
        let status = admin::Status {
            pid: std::process::id(),
            open,
            written_ms: ferry_core::seams::wall_ms(),
            recovery_ms: recovery.elapsed.as_secs_f64() * 1e3,
            recovered_records: recovery.log_records,
            resumed: recovery.resumed,
            log: admin::LogView {
                records: stats.records,
                syncs: stats.syncs,
                durable: stats.durable,
                end: stats.end,
                segments: stats.segments,
                segments_reused: stats.segments_reused,
                write_p50_us: ferry_log::Stats::write_quantile_us(&stats.write_us_log2, 0.5),
                write_p99_us: ferry_log::Stats::write_quantile_us(&stats.write_us_log2, 0.99),
            },
            runs,
            metrics: self.counters.render(&recovery, &stats),
        };
        let bytes = serde_json::to_vec(&status).expect("the status serializes");
        if let Err(e) = admin::write_quietly(&dir.join(admin::STATUS_FILE), &bytes) {
            tracing::warn!("writing the status file: {e}");
        }
    }
}

/// A run's result, awaitable from any thread while its engine is open. It does not keep
/// the engine (nor its log and directory lock) alive: once the engine is dropped,
/// `result` returns `FlowError::Stopped`.
pub struct RunHandle<O> {
    shared: std::sync::Weak<Shared>,
    id: String,
    _out: PhantomData<fn() -> O>,
}

impl<O: DeserializeOwned> RunHandle<O> {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The run's output once it finished and that is durable; its error if it failed, was
    /// cancelled or is parked. Or why this engine cannot tell: the journal failed
    /// (`FlowError::Log`: no run goes on in this process; this one may have finished
    /// durably just before, or resumes from what is durable when the engine is
    /// reopened, so ask again then), or the engine was dropped (`FlowError::Stopped`).
    pub async fn result(&self) -> Result<O, FlowError> {
        let (rx, failure) = {
            let shared = self.shared.upgrade().ok_or(FlowError::Stopped)?;
            let mut runs = lock(&shared.runs);
            let entry = runs
                .get_mut(&self.id)
                .ok_or_else(|| FlowError::Invalid(format!("no run {:?}", self.id)))?;
            match &entry.status {
                RunStatus::Running => {
                    let (tx, rx) = oneshot::channel();
                    entry.add_waiter(tx);
                    (rx, shared.failure.clone())
                }
                done => return status_result(done.clone()),
            }
        };
        tokio::select! {
            biased;
            r = rx => match r {
                Ok(status) => status_result(status),
                Err(_) => Err(FlowError::Stopped),
            },
            e = failure.wait() => Err(FlowError::Log(e)),
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
        RunStatus::Finished(Outcome::Cancelled) => Err(FlowError::Cancelled),
        RunStatus::Parked(reason) => Err(FlowError::Parked(reason)),
        RunStatus::Running => Err(FlowError::Stopped),
    }
}

thread_local! {
    /// How many times this shard's thread has parked (its runtime's `on_thread_park`).
    static PARKS: Cell<u64> = const { Cell::new(0) };
}

/// A shard's loop polled with nothing to do, again and again, without its thread
/// parking: tokio's `block_on` is being woken in a loop. That happens when a thread
/// that was waking this shard (through an `AtomicWaker`: the job channel's, the
/// `LocalSet`'s) was preempted inside the wake, typically by this very shard on the
/// same CPU: each registration then sees the wake in progress and wakes the shard again
/// at once, and the shard spins until the scheduler ends its slice (3-4 ms seen in
/// `perf sched` at W3's 25%, on 2 vCPUs, with the client thread waiting behind it).
/// After `IDLE_POLLS_BEFORE_YIELD` such polls the shard yields its CPU, so that the
/// preempted thread can finish its wake.
#[derive(Default)]
struct IdlePolls {
    parks: u64,
    polls: u32,
}

const IDLE_POLLS_BEFORE_YIELD: u32 = 64;

impl IdlePolls {
    fn note(&mut self) {
        let parks = PARKS.with(Cell::get);
        if parks != self.parks {
            *self = IdlePolls { parks, polls: 0 };
        }
        self.polls += 1;
        if self.polls >= IDLE_POLLS_BEFORE_YIELD {
            self.polls = 0;
            std::thread::yield_now();
        }
    }
}

struct Shard {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Shard {
    fn start(i: usize, shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<Vec<Job>>) -> Shard {
        let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("ferry-flow-{i}"))
            .spawn(move || {
                // After a sync that woke this shard, the log's writer waits a moment
                // for it to append what it ran next (`ferry_log::Follower`): until it
                // is about to sleep.
                let follower = shared.starts[i].follower.clone();
                let idle = follower.clone();
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .on_thread_park(move || {
                        PARKS.with(|p| p.set(p.get() + 1));
                        if let Some(f) = &idle {
                            f.idle();
                        }
                    })
                    .build()
                    .expect("a current-thread runtime builds");
                let local = tokio::task::LocalSet::new();
                let watcher = crate::durable::Waits::install(shared.log.clone(), follower.clone());
                local.block_on(&rt, async move {
                    tokio::task::spawn_local(watcher);
                    let mut idle = IdlePolls::default();
                    // Jobs first, then the stop: what was sent before the stop runs.
                    std::future::poll_fn(|cx| {
                        loop {
                            match rx.poll_recv(cx) {
                                Poll::Ready(Some(jobs)) => {
                                    idle.polls = 0;
                                    for job in jobs {
                                        tokio::task::spawn_local(run_job(
                                            shared.clone(),
                                            Box::new(job),
                                        ));
                                    }
                                }
                                Poll::Ready(None) => return Poll::Ready(()),
                                Poll::Pending => {
                                    if Pin::new(&mut stop_rx).poll(cx).is_ready() {
                                        return Poll::Ready(());
                                    }
                                    idle.note();
                                    return Poll::Pending;
                                }
                            }
                        }
                    })
                    .await;
                });
                if let Some(f) = &follower {
                    f.idle();
                }
            })
            .expect("spawning a shard thread");
        Shard {
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    /// A shard as a task of the caller's `LocalSet` (`on_this_thread`): each job is a
    /// task of its own, aborted with the engine.
    async fn run_here(shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<Vec<Job>>) {
        while let Some(jobs) = rx.recv().await {
            for job in jobs {
                let s = shared.clone();
                shared.spawn_here(run_job(s, Box::new(job)));
            }
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

/// The disk of an engine on the caller's thread (`on_this_thread`): write and sync what
/// was appended at moments drawn from `seed`. Tokio's timers tick in whole milliseconds,
/// so the gaps are 1 to 3 ms, and within a tick the disk yields a drawn number of times
/// first (letting a drawn share of the ready tasks append before the sync), up to three
/// times per tick.
async fn disk(log: Arc<Log>, seed: u64) {
    let mut rng = SplitMix64::seeded(seed ^ 0xd15c);
    loop {
        let gap = 1 + rng.below(3);
        tokio::time::sleep(std::time::Duration::from_millis(gap)).await;
        for _ in 0..=rng.below(3) {
            for _ in 0..rng.below(8) {
                tokio::task::yield_now().await;
            }
            log.write_pending();
        }
    }
}

/// Run (or resume) one run to its end on this shard, generation after generation.
///
/// The job comes boxed: an async fn keeps its arguments for its whole life, and a run
/// parked for days should not keep a copy of its start.
async fn run_job(shared: Arc<Shared>, mut job: Box<Job>) {
    let places = shared.starts[shared.shard_of(&job.run)].running.clone();
    let place = Rc::new(Box::pin(Place::take(places, &shared)).await);
    loop {
        // Moved out whole, so the box is freed here (a destructuring pattern would move
        // the fields out and keep the box until the loop comes round).
        let unboxed: Job = {
            let b = job;
            *b
        };
        let Job {
            run,
            generation,
            replay,
            input,
            handler,
            last,
        } = unboxed;
        let ctx = Ctx::new(RunCtx::new(
            shared.clone(),
            place.clone(),
            (run, generation),
            replay,
            last,
        ));
        let result = handler(ctx.clone(), input).await;
        // What follows the code is boxed: while the code waits (a run parked for days),
        // the task holds only the state above.
        match Box::pin(end_generation(&shared, ctx, handler, result)).await {
            Some(next) => job = Box::new(next),
            None => return,
        }
    }
}

/// Journal how a generation ended; the next generation's job if it continued as new.
async fn end_generation(
    shared: &Arc<Shared>,
    ctx: Ctx,
    handler: Handler,
    result: Result<Json, FlowError>,
) -> Option<Job> {
    let run = ctx.run();
    // A mismatch with the journal parks the run whatever the code made of the error
    // (caught it, mapped it, returned something else).
    if let Err(n) = run.replay.borrow().check() {
        shared.park(run, n.to_string());
        return None;
    }
    let mut outcome = match result {
        // Not journaled: after every restart the run replays up to the same call (no
        // step body runs while replaying) and parks again, until a deploy takes the
        // recorded path and it resumes by itself (or it is cancelled).
        Err(FlowError::Nondeterminism(n)) => {
            shared.park(run, n.to_string());
            return None;
        }
        // The log refuses writes: nothing more can be journaled for this run in this
        // process (the journal noted the failure for its callers); it resumes after a
        // restart.
        Err(FlowError::Log(_)) => return None,
        Err(FlowError::Stopped) => return None,
        Err(FlowError::ContinuedAsNew) => match run.next_input.borrow_mut().take() {
            Some(input) => match next_generation(shared, run, handler, input) {
                Ok(job) => {
                    shared.counters.continued();
                    return Some(job);
                }
                Err(FlowError::Log(_)) => return None,
                Err(e) => Outcome::Err(e.to_string()),
            },
            None => Outcome::Err(
                "the workflow returned ContinuedAsNew without calling ctx.continue_as_new".into(),
            ),
        },
        Ok(v) => Outcome::Ok(v),
        Err(FlowError::Cancelled) => Outcome::Cancelled,
        Err(e) => Outcome::Err(e.to_string()),
    };
    // (Bound before matching: `park` borrows the replay again.)
    let finish = run.replay.borrow_mut().finish().map(|slot| match slot {
        Slot::Fresh { pos } => Some(pos),
        Slot::Recorded { .. } => None,
    });
    let pos = match finish {
        Ok(pos) => pos,
        Err(n) => {
            // The code returned while its journal holds more calls: parked, as above.
            shared.park(run, n.to_string());
            return None;
        }
    };
    if let Some(pos) = pos {
        let mut finished = Entry::Finished { outcome };
        match run.append(Some(pos), &finished) {
            Ok(()) => {}
            Err(e @ FlowError::LimitExceeded { .. }) => {
                finished = Entry::Finished {
                    outcome: Outcome::Err(format!("the run's output: {e}")),
                };
                if run.append(Some(pos), &finished).is_err() {
                    return None;
                }
            }
            // The journal failed (and noted it for the run's callers), or the engine
            // is stopping.
            Err(_) => return None,
        }
        let Entry::Finished { outcome: o } = finished else {
            unreachable!("built as Finished above")
        };
        outcome = o;
    }
    // A result leaves the process only once its record is durable.
    if crate::durable::durable(&shared.log, run.last.get())
        .await
        .is_ok()
    {
        shared.settle(&run.run, RunStatus::Finished(outcome));
    }
    None
}

/// End this generation with `ContinuedAsNew` and start the next with `input`.
fn next_generation(
    shared: &Shared,
    run: &RunCtx,
    handler: Handler,
    input: Json,
) -> Result<Job, FlowError> {
    let finish = run.replay.borrow_mut().finish().map(|slot| match slot {
        Slot::Fresh { pos } => Some(pos),
        Slot::Recorded { .. } => None,
    });
    let pos = finish?;
    if let Some(pos) = pos {
        run.append(
            Some(pos),
            &Entry::ContinuedAsNew {
                input: input.clone(),
            },
        )?;
    }
    let (workflow, parent) = {
        let runs = lock(&shared.runs);
        let e = runs.get(&run.run).expect("a running run has an entry");
        (e.workflow, e.parent().cloned())
    };
    let next = next_start(
        &run.run,
        run.generation + 1,
        workflow,
        &input,
        parent,
        run.consumed.borrow().clone(),
        run.cancel_seen.get(),
    );
    let bytes = next.encode();
    shared.check_payload(bytes.len())?;
    let last = shared.log.append(RECORD_KIND, &bytes)?;
    if let Some(e) = lock(&shared.runs).get_mut(&run.run) {
        e.generation = run.generation + 1;
    }
    Ok(Job {
        run: run.run.clone(),
        generation: run.generation + 1,
        replay: Replay::new([next]),
        input,
        handler,
        last,
    })
}

/// A run's place among its shard's running runs (`EngineBuilder::max_running`), from
/// generation to generation.
pub(crate) struct Place {
    /// The shard's places; `None`: no bound.
    places: Option<Arc<tokio::sync::Semaphore>>,
    held: RefCell<Option<tokio::sync::OwnedSemaphorePermit>>,
}

impl Place {
    /// Wait for a place (in order), and hold it.
    async fn take(places: Option<Arc<tokio::sync::Semaphore>>, shared: &Shared) -> Place {
        let place = Place {
            places,
            held: RefCell::new(None),
        };
        place.acquire(shared).await;
        place
    }

    async fn acquire(&self, shared: &Shared) {
        let Some(places) = &self.places else { return };
        // Counted only when the run has to wait.
        let permit = match places.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                shared.counters.waiting(1);
                let p = places.clone().acquire_owned().await;
                shared.counters.waiting(-1);
                p.expect("a shard's places are never closed")
            }
        };
        *self.held.borrow_mut() = Some(permit);
    }

    /// Give up the place for a wait: another run takes it meanwhile. Whether this run
    /// held one (a run whose code waits on two things at once may not).
    pub(crate) fn leave(&self) -> bool {
        self.held.borrow_mut().take().is_some()
    }

    /// Back from a wait: take a place again (waiting for one) if the run gave one up.
    /// Boxed: a run parked for days keeps no room in its wait for what it does after.
    pub(crate) async fn back(&self, shared: &Shared, held: bool) {
        if held {
            Box::pin(self.acquire(shared)).await;
        }
    }
}

/// One generation of one run, as its code sees it from the context.
pub(crate) struct RunCtx {
    /// Its place among the shard's running runs.
    pub(crate) place: Rc<Place>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) run: String,
    pub(crate) generation: u32,
    pub(crate) replay: RefCell<Replay>,
    /// The end of this run's last record: what anything leaving the process waits for.
    pub(crate) last: Cell<Lsn>,
    /// Signals consumed so far, by name, this generation and before it.
    pub(crate) consumed: RefCell<BTreeMap<String, u32>>,
    /// The run observed its cancellation (journaled `CancelSeen`).
    pub(crate) cancel_seen: Cell<bool>,
    /// Entries at positions this generation (the history limit).
    history: Cell<u32>,
    /// Sleeps pending now (the timers limit).
    pub(crate) timers: Cell<u32>,
    /// Set by `ctx.continue_as_new`.
    pub(crate) next_input: RefCell<Option<Json>>,
    /// The run's wake-up on arrivals and its cancellation flag.
    pub(crate) wake: Arc<Wake>,
}

thread_local! {
    /// Where a run's records are encoded on their way to the log: one buffer per
    /// thread, reused from record to record, rather than one allocated (and grown past
    /// its first guess) per record.
    static ENCODED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// `ENCODED` is let go of once a record took it past this.
const ENCODED_KEEP: usize = 64 << 10;

impl RunCtx {
    fn new(
        shared: Arc<Shared>,
        place: Rc<Place>,
        (run, generation): (String, u32),
        replay: Replay,
        last: Lsn,
    ) -> RunCtx {
        let (consumed, cancel_seen) = match replay.started() {
            Some(Entry::Started {
                consumed,
                cancel_seen,
                ..
            }) => (consumed.clone(), *cancel_seen),
            _ => (BTreeMap::new(), false),
        };
        let wake = shared.wake_of(&run);
        RunCtx {
            place,
            wake,
            shared,
            run,
            generation,
            history: Cell::new(replay.entries()),
            replay: RefCell::new(replay),
            last: Cell::new(last),
            consumed: RefCell::new(consumed),
            cancel_seen: Cell::new(cancel_seen),
            timers: Cell::new(0),
            next_input: RefCell::new(None),
        }
    }

    /// Is there room in the history for one more call?
    pub(crate) fn room(&self) -> Result<(), FlowError> {
        let max = self.shared.limits.history;
        if self.history.get() >= max {
            return Err(FlowError::LimitExceeded {
                limit: Limit::History,
                value: u64::from(self.history.get()) + 1,
                max: u64::from(max),
            });
        }
        Ok(())
    }

    /// Journal `entry` at `pos` (None: an arrival), within the run's limits. Encoded
    /// into this thread's buffer (`ENCODED`), which the log copies from.
    pub(crate) fn append(&self, pos: Option<u32>, entry: &Entry) -> Result<(), FlowError> {
        self.replay.borrow().check()?;
        // The history limit is checked when a call begins (its first entry; a step
        // checks before its body runs, see `room`): what completes a call already
        // begun, or ends the run, is always journaled.
        let begins = matches!(
            entry,
            Entry::TimerSet { .. }
                | Entry::TimerRefused { .. }
                | Entry::WaitStarted { .. }
                | Entry::Value { .. }
                | Entry::Patch { .. }
                | Entry::ChildStarted { .. }
        );
        if begins {
            self.room()?;
        }
        let end = ENCODED.with_borrow_mut(|bytes| {
            bytes.clear();
            crate::journal::encode_into(bytes, &self.run, self.generation, pos, entry);
            let r = self.shared.check_payload(bytes.len()).and_then(|()| {
                self.shared
                    .log
                    .append(RECORD_KIND, bytes)
                    .map_err(FlowError::from)
            });
            // A rare large record does not stay allocated on the shard.
            if bytes.capacity() > ENCODED_KEEP {
                *bytes = Vec::new();
            }
            r
        })?;
        self.last.set(end);
        if pos.is_some() {
            self.history.set(self.history.get() + 1);
        }
        Ok(())
    }
}
