//! What a workflow's code calls (docs/flow.md §2): steps with retries and timeouts,
//! durable sleeps, signals, child runs, deterministic values, patches, queries,
//! cancellation and continue-as-new. Each call takes the next journal position; on
//! replay it returns what the journal holds there.

use crate::api::{FlowError, Limit, Signal, StepError, Workflow, decode, encode};
use crate::journal::{Entry, Json, Outcome, ValueKind};
use crate::metrics::Attempt;
use crate::replay::{Call, Slot};
use crate::run::{RunCtx, Watch};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::oneshot;

/// What a workflow's code calls (docs/flow.md §2). Cheap to clone; not `Send` (a run
/// lives on its shard).
#[derive(Clone)]
pub struct Ctx {
    run: Rc<RunCtx>,
}

impl Ctx {
    pub(crate) fn new(run: RunCtx) -> Ctx {
        Ctx { run: Rc::new(run) }
    }

    pub(crate) fn run(&self) -> &RunCtx {
        &self.run
    }

    /// A suspension call at `pos` looks for a cancellation the run has not observed:
    /// it observes it there (journaled) and returns `Cancelled`.
    fn observe_cancel(&self, pos: u32) -> Result<(), FlowError> {
        if self.run.cancel_seen.get() || !self.run.wake.cancel.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.run.append(Some(pos), &Entry::CancelSeen)?;
        self.run.cancel_seen.set(true);
        Err(FlowError::Cancelled)
    }

    /// Journal the first entry of a fresh call at `pos`. If a limit refuses it, the
    /// position is given back, so the journal never has a hole where a call failed.
    fn begin(&self, pos: u32, entry: Entry) -> Result<(), FlowError> {
        let r = self.run.append(Some(pos), &entry);
        if let Err(FlowError::LimitExceeded { .. }) = r {
            self.run.replay.borrow_mut().give_back(pos);
        }
        r
    }

    /// A fresh call at `pos` fails before journaling anything: give the position back.
    fn refuse<T>(&self, pos: u32, e: FlowError) -> Result<T, FlowError> {
        self.run.replay.borrow_mut().give_back(pos);
        Err(e)
    }

    /// Replaying a suspension call: did it observe the cancellation?
    fn replayed_cancel(&self, entries: &[Entry]) -> Result<(), FlowError> {
        if entries.iter().any(|e| matches!(e, Entry::CancelSeen)) {
            self.run.cancel_seen.set(true);
            return Err(FlowError::Cancelled);
        }
        Ok(())
    }
}

fn child_result<T: DeserializeOwned>(id: &str, outcome: Outcome) -> Result<T, FlowError> {
    match outcome {
        Outcome::Ok(v) => decode(v),
        Outcome::Err(error) => Err(FlowError::Child {
            id: id.to_string(),
            error,
        }),
        Outcome::Cancelled => Err(FlowError::Child {
            id: id.to_string(),
            error: "it was cancelled".into(),
        }),
    }
}

fn step_result<T: DeserializeOwned>(name: &str, outcome: Outcome) -> Result<T, FlowError> {
    match outcome {
        Outcome::Ok(v) => decode(v),
        Outcome::Err(error) => Err(FlowError::Step {
            name: name.to_string(),
            error,
        }),
        Outcome::Cancelled => Err(FlowError::Cancelled),
    }
}

/// Counts a pending sleep while it lives.
struct Pending<'a>(&'a std::cell::Cell<u32>);

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
    }
}

/// How often a step is tried, and how long between tries: after the n-th failed attempt,
/// a time drawn uniformly between `first` and `first·2^(n-1)` (capped at `max`):
/// ferry-core's backoff with jitter, floored at `first`, so retries of many runs that
/// failed together spread out, and none comes sooner than `first`. The retry time is
/// journaled with each failed attempt, so a restart neither retries early nor starts
/// the count again. A permanent failure ([`StepError::permanent`]) is not retried.
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

    /// How long to wait after failed attempt `failed_attempt` (1 = the first), drawn
    /// from `seed` (the engine's generator: replayable in a simulation).
    fn delay(&self, failed_attempt: u32, seed: u64) -> Duration {
        let first = self.first.min(self.max);
        let backoff = ferry_core::backoff::Backoff::new(first, self.max, first);
        backoff.delay(
            failed_attempt,
            &mut ferry_core::seams::SplitMix64::seeded(seed),
        )
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
    Fut: Future<Output = Result<T, StepError>> + 'a,
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

/// What a step's body gets: the key to pass to the outside world, and which attempt
/// this is.
pub struct StepCtx {
    key: String,
    attempt: u32,
    epoch: Option<u64>,
}

/// `run/generation/position`: built once per step, so without `format!`'s machinery.
fn step_key(run: &str, generation: u32, pos: u32) -> String {
    let mut digits = itoa::Buffer::new();
    let mut key = String::with_capacity(run.len() + 22);
    key.push_str(run);
    key.push('/');
    key.push_str(digits.format(generation));
    key.push('/');
    key.push_str(digits.format(pos));
    key
}

impl StepCtx {
    /// Stable across re-executions of the same step of the same run: `run/generation/position`.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// This attempt's number, from 1; counted across restarts (a failed attempt is
    /// journaled), so attempt 3 after a crash is the third attempt, not the first.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// On a server's worker, the epoch the run's shard is held under
    /// (docs/flow-server.md §2): it rises with every takeover, so an effect that keeps
    /// the highest epoch it saw per key can refuse an attempt from a deposed worker.
    /// `None` embedded.
    pub fn epoch(&self) -> Option<u64> {
        self.epoch
    }
}

impl Ctx {
    pub fn run_id(&self) -> &str {
        &self.run.run
    }

    /// The wall clock in ms by the engine's clock (a simulation's runs on tokio's time).
    fn wall_ms(&self) -> u64 {
        self.run.shared.wall_ms()
    }

    /// Code changes that would change a running run's path go behind a patch:
    /// `if ctx.patched("fraud-check")? { … new calls … }`. True for runs that reach
    /// this point under the new code (journaled, so their replays take it again); false,
    /// taking no position, for runs journaled before it existed.
    pub fn patched(&self, id: &str) -> Result<bool, FlowError> {
        let (taken, pos) = self.run.replay.borrow_mut().patched(id);
        if let Some(pos) = pos {
            self.begin(pos, Entry::Patch { id: id.to_string() })?;
        }
        Ok(taken)
    }

    /// The wall clock in ms since the epoch, as the run first saw it here: replays see
    /// the same value.
    pub fn now_ms(&self) -> Result<u64, FlowError> {
        let v = self.value(ValueKind::Now, || Json::from(self.wall_ms()))?;
        decode(v)
    }

    /// A random u64, the same on every replay.
    pub fn random_u64(&self) -> Result<u64, FlowError> {
        let v = self.value(ValueKind::Random, || {
            Json::from(self.run.shared.random_u64())
        })?;
        decode(v)
    }

    /// A random (version 4) UUID, the same on every replay.
    pub fn uuid(&self) -> Result<String, FlowError> {
        let v = self.value(ValueKind::Uuid, || {
            let (hi, lo) = (self.run.shared.random_u64(), self.run.shared.random_u64());
            let hi = (hi & !0xf000) | 0x4000;
            let lo = (lo & !(0xc << 60)) | (0x8 << 60);
            Json::from(format!(
                "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
                hi >> 32,
                (hi >> 16) & 0xffff,
                hi & 0xffff,
                lo >> 48,
                lo & 0xffff_ffff_ffff
            ))
        })?;
        decode(v)
    }

    /// Sleep durably: the wake-up time is journaled, so after a restart the run sleeps
    /// until the same moment (at once if it passed while the engine was down). Never
    /// wakes early by the wall clock.
    pub async fn sleep(&self, d: Duration) -> Result<(), FlowError> {
        let fresh_at = self.wall_ms().saturating_add(d.as_millis() as u64);
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
                    self.replayed_cancel(entries)?;
                    match &entries[0] {
                        Entry::TimerSet { fire_at_ms } => (pos, *fire_at_ms),
                        Entry::TimerRefused { pending, max } => {
                            return Err(FlowError::LimitExceeded {
                                limit: Limit::Timers,
                                value: u64::from(*pending) + 1,
                                max: u64::from(*max),
                            });
                        }
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
                    self.observe_cancel(pos)?;
                    let pending = self.run.timers.get();
                    let max = self.run.shared.limits().timers;
                    if pending >= max {
                        self.begin(pos, Entry::TimerRefused { pending, max })?;
                        return Err(FlowError::LimitExceeded {
                            limit: Limit::Timers,
                            value: u64::from(pending) + 1,
                            max: u64::from(max),
                        });
                    }
                    self.begin(pos, Entry::TimerSet { fire_at_ms: at_ms })?;
                    (pos, at_ms)
                }
            }
        };
        self.run.timers.set(self.run.timers.get() + 1);
        let _pending = Pending(&self.run.timers);
        self.pause_until(pos, fire_at).await?;
        self.run.append(Some(pos), &Entry::TimerFired)?;
        Ok(())
    }

    /// The run starts to wait: it gives up its place among its shard's running runs
    /// (`EngineBuilder::max_running`) until [`Ctx::back`].
    fn leave(&self) -> bool {
        self.run.place.leave()
    }

    /// The wait is over: take a place again if [`Ctx::leave`] gave one up.
    async fn back(&self, held: bool) {
        self.run.place.back(&*self.run.shared, held).await;
    }

    /// Wait until `at_ms` by the wall clock, observing a cancellation at `pos` meanwhile.
    async fn pause_until(&self, pos: u32, at_ms: u64) -> Result<(), FlowError> {
        if at_ms == 0 {
            // Nothing to wait out (no timer, no backoff): only a cancellation to see.
            return self.observe_cancel(pos);
        }
        let arrived = &self.run.wake.arrived;
        loop {
            // Registered before looking, so an arrival in between is not missed.
            let notified = arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            self.observe_cancel(pos)?;
            let now = self.wall_ms();
            if now >= at_ms {
                return Ok(());
            }
            // Timers sleep on the monotonic clock, which may run a little ahead of the
            // wall clock: check again rather than fire early. (Boxed: a run parked in a
            // wait keeps no room for a timer it is not using.)
            let held = self.leave();
            tokio::select! {
                biased;
                _ = Box::pin(tokio::time::sleep(Duration::from_millis(at_ms - now))) => {}
                _ = notified => {}
            }
            self.back(held).await;
        }
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
                    self.replayed_cancel(entries)?;
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
                            self.count_consumed(name);
                            let value = self.run.shared.signal_at(&self.run.run, name, index);
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
                    self.observe_cancel(pos)?;
                    let deadline =
                        timeout.map(|d| self.wall_ms().saturating_add(d.as_millis() as u64));
                    self.begin(
                        pos,
                        Entry::WaitStarted {
                            name: name.to_string(),
                            deadline_ms: deadline,
                        },
                    )?;
                    (pos, deadline)
                }
            }
        };
        let arrived = &self.run.wake.arrived;
        loop {
            // Registered before looking, so an arrival in between is not missed.
            let notified = arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            self.observe_cancel(pos)?;
            // Read here, not before the loop: another wait for the same name in this
            // run may have consumed the signal this one was waiting for.
            let index = self.run.consumed.borrow().get(name).copied().unwrap_or(0);
            if let Some(v) = self.run.shared.signal_at(&self.run.run, name, index) {
                self.run.append(
                    Some(pos),
                    &Entry::Waited {
                        name: name.to_string(),
                        got: Some(index),
                    },
                )?;
                self.count_consumed(name);
                self.run.shared.consumed_one(&self.run.run);
                return decode(v).map(Some);
            }
            let now = self.wall_ms();
            match deadline {
                Some(d) if now >= d => {
                    self.run.append(
                        Some(pos),
                        &Entry::Waited {
                            name: name.to_string(),
                            got: None,
                        },
                    )?;
                    return Ok(None);
                }
                Some(d) => {
                    let held = self.leave();
                    tokio::select! {
                        biased;
                        _ = notified => {}
                        _ = Box::pin(tokio::time::sleep(Duration::from_millis(d - now))) => {}
                    }
                    self.back(held).await;
                }
                None => {
                    let held = self.leave();
                    notified.await;
                    self.back(held).await;
                }
            }
        }
    }

    fn count_consumed(&self, name: &str) {
        *self
            .run
            .consumed
            .borrow_mut()
            .entry(name.to_string())
            .or_default() += 1;
    }

    /// Run `workflow` as a child of this run, with the id `parent/generation/position`,
    /// and wait for its result. The child is a run of its own (listed, queried and
    /// cancelled by that id); its start and its outcome are journaled here, so a
    /// restart neither starts it twice nor waits for it again. If this run observes its
    /// cancellation while waiting, the child is cancelled too.
    pub async fn child<I: Serialize, O: DeserializeOwned>(
        &self,
        workflow: Workflow<I, O>,
        input: &I,
    ) -> Result<O, FlowError> {
        let (pos, id, fresh) = {
            let mut replay = self.run.replay.borrow_mut();
            match replay.call(Call::Child(workflow.name()))? {
                Slot::Recorded { pos, entries } => {
                    let mut id = None;
                    for e in entries {
                        match e {
                            Entry::ChildStarted { id: i, .. } => id = Some(i.clone()),
                            Entry::ChildDone { outcome } => {
                                let id = id.unwrap_or_default();
                                return child_result(&id, outcome.clone());
                            }
                            Entry::CancelSeen => {
                                self.run.cancel_seen.set(true);
                                if let Some(id) = id {
                                    self.cancel_child(id);
                                }
                                return Err(FlowError::Cancelled);
                            }
                            _ => {}
                        }
                    }
                    let id = id.ok_or_else(|| {
                        FlowError::Codec(format!("position {pos} holds no child's start"))
                    })?;
                    (pos, id, false)
                }
                Slot::Fresh { pos } => {
                    let id = format!("{}/{}/{}", self.run.run, self.run.generation, pos);
                    (pos, id, true)
                }
            }
        };
        if fresh {
            self.observe_cancel(pos)?;
            // Started before it is journaled here, so its start precedes this record
            // in the log: replay finds the child whenever it finds the record. A start
            // that fails (the input, the id) gives the position back.
            let started = encode(input).and_then(|input| {
                self.run
                    .shared
                    .start_child(workflow.name(), &id, input, &self.run.run)
            });
            if let Err(e) = started {
                return self.refuse(pos, e);
            }
            self.begin(
                pos,
                Entry::ChildStarted {
                    id: id.clone(),
                    workflow: workflow.name().to_string(),
                },
            )?;
        }
        let arrived = &self.run.wake.arrived;
        // One waiter on the child at a time, kept across wake-ups for other reasons.
        let mut waiting: Option<oneshot::Receiver<crate::RunStatus>> = None;
        loop {
            let notified = arrived.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Err(e) = self.observe_cancel(pos) {
                self.cancel_child(id);
                return Err(e);
            }
            if waiting.is_none() {
                match self.run.shared.watch(&id)? {
                    Watch::Finished(outcome) => {
                        self.run.append(
                            Some(pos),
                            &Entry::ChildDone {
                                outcome: outcome.clone(),
                            },
                        )?;
                        return child_result(&id, outcome);
                    }
                    Watch::Waiting(rx) => waiting = Some(rx),
                }
            }
            let rx = waiting.as_mut().expect("set above");
            let held = self.leave();
            let woke = tokio::select! {
                biased;
                r = rx => Ok(Some(r.is_ok())),
                _ = notified => Ok(None),
                // The journal failed: the child cannot finish in this process.
                e = self.run.shared.failure().wait() => Err(e),
            };
            self.back(held).await;
            match woke {
                // Settled (finished, or parked: then wait again).
                Ok(Some(true)) => waiting = None,
                Ok(Some(false)) => return Err(FlowError::Stopped),
                Ok(None) => {}
                Err(e) => return Err(FlowError::Log(e)),
            }
        }
    }

    fn cancel_child(&self, id: String) {
        self.run.shared.cancel_later(id);
    }

    /// Has this run observed a cancellation? True from the suspension call that
    /// returned [`FlowError::Cancelled`] on: the code can tell cleanup apart.
    pub fn cancelled(&self) -> bool {
        self.run.cancel_seen.get()
    }

    /// Send `value` as signal `signal` to run `id`: any run, on any shard (on a server's
    /// worker, through the server when another worker holds it; docs/flow-server.md §9).
    /// It is a step: durable once sent, delivered once (its key is the step's) however
    /// often the step runs again (a retry, a takeover), and a run's sends arrive in the
    /// order it made them. Transient failures (no holder yet, the server away) are
    /// retried for up to about twenty minutes; a run that had finished, or none by that
    /// id, fails the step.
    pub async fn signal<T: Serialize>(
        &self,
        id: &str,
        signal: Signal<T>,
        value: &T,
    ) -> Result<(), FlowError> {
        let value = encode(value)?;
        let host = self.run.shared.clone();
        let (id, name) = (id.to_string(), signal.name().to_string());
        self.step(&format!("signal {name:?} to {id:?}"), move |s| {
            let sent = host.send_signal(
                id.clone(),
                name.clone(),
                value.clone(),
                format!("signal/{}", s.key()),
            );
            async move { sent.await.map_err(|e| StepError::classified(&e)) }
        })
        .retry(Retry::exponential(30, Duration::from_millis(100)))
        .await
    }

    /// Make `state` what `engine.query(id)` returns for this run. Not journaled: replay
    /// publishes again as it passes the same code.
    pub fn publish<S: Serialize>(&self, state: &S) -> Result<(), FlowError> {
        let v = encode(state)?;
        self.run.shared.publish(&self.run.run, v);
        Ok(())
    }

    /// End this generation and start the next with `input` and an empty history (the
    /// same run id, result and signals): `return Err(ctx.continue_as_new(&next))`. The
    /// run's generation counts up; step keys include it.
    pub fn continue_as_new<I: Serialize>(&self, input: &I) -> FlowError {
        match encode(input) {
            Ok(v) => {
                *self.run.next_input.borrow_mut() = Some(v);
                FlowError::ContinuedAsNew
            }
            Err(e) => e,
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
        self.begin(
            pos,
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
        Fut: Future<Output = Result<T, StepError>> + 'a,
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
        Fut: Future<Output = Result<T, StepError>>,
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
                    self.replayed_cancel(entries)?;
                    (pos, attempts + 1, at)
                }
                Slot::Fresh { pos } => {
                    drop(replay);
                    // The history must have room before the body runs: once it ran,
                    // its result is always journaled.
                    if let Err(e) = self.run.room() {
                        return self.refuse(pos, e);
                    }
                    (pos, 1, 0)
                }
            }
        };
        loop {
            // A cancellation is observed before an attempt, and during a backoff; an
            // attempt under way is not interrupted.
            self.pause_until(pos, retry_at).await?;
            // Output holding: the body talks to the outside world, so what it follows
            // must be durable first.
            crate::durable::durable(&self.run.journal, self.run.last.get())
                .await
                .map_err(|e| self.run.fenced_by(e))?;
            // The fence that covers side effects: past its shard's lease deadline, no
            // body starts (docs/flow-server.md §5.3).
            if !self.run.journal.may_act() {
                self.run.fenced.set(true);
                return Err(self.run.fence());
            }
            let key = step_key(&self.run.run, self.run.generation, pos);
            let epoch = self.run.journal.epoch();
            let step = StepCtx {
                key,
                attempt,
                epoch,
            };
            let ran = match timeout {
                None => Ok(body(step).await),
                Some(d) => tokio::time::timeout(d, body(step)).await.map_err(|_| d),
            };
            // Counted once the attempt's end is known: a result that cannot be encoded
            // or journaled ends it in error.
            let counters = self.run.shared.counters();
            let mut how = match &ran {
                Ok(Ok(_)) => Attempt::Ok,
                Ok(Err(_)) => Attempt::Error,
                Err(_) => Attempt::TimedOut,
            };
            let attempt_result = ran.unwrap_or_else(|d| {
                Err(StepError::transient(format!(
                    "attempt {attempt} timed out after {d:?}"
                )))
            });
            let outcome = match attempt_result {
                Ok(v) => match encode(&v) {
                    Ok(v) => Outcome::Ok(v),
                    Err(e) => {
                        counters.attempt(Attempt::Error);
                        return Err(e);
                    }
                },
                Err(e) if attempt < retry.max_attempts && !e.is_permanent() => {
                    counters.attempt(how);
                    let delay = retry.delay(attempt, self.run.shared.random_u64());
                    retry_at = self.wall_ms() + delay.as_millis() as u64;
                    self.run.append(
                        Some(pos),
                        &Entry::StepAttempt {
                            name: name.clone(),
                            attempt,
                            error: e.message,
                            retry_at_ms: retry_at,
                        },
                    )?;
                    attempt += 1;
                    continue;
                }
                Err(e) => Outcome::Err(e.message),
            };
            let mut done = Entry::Step {
                name,
                outcome,
                attempts: attempt,
            };
            let journaled = match self.run.append(Some(pos), &done) {
                Ok(()) => Ok(()),
                // The body ran: journal that its result was refused, so a replay does
                // not run it again and fails the same way.
                Err(e @ FlowError::LimitExceeded { .. }) => {
                    how = Attempt::Error;
                    if let Entry::Step { outcome, .. } = &mut done {
                        *outcome = Outcome::Err(format!("its result: {e}"));
                    }
                    self.run.append(Some(pos), &done)
                }
                Err(e) => Err(e),
            };
            counters.attempt(how);
            journaled?;
            let Entry::Step { name, outcome, .. } = done else {
                unreachable!("built as Step above")
            };
            return step_result(&name, outcome);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_waits_at_least_first_and_at_most_its_doubling_window() {
        let retry = Retry::exponential(10, Duration::from_millis(100));
        for seed in 0..200 {
            assert_eq!(retry.delay(1, seed), Duration::from_millis(100));
            for failed in 2..12u32 {
                let window = (Duration::from_millis(100) * (1 << (failed - 1))).min(retry.max);
                let d = retry.delay(failed, seed);
                assert!(d >= retry.first && d <= window, "{failed}: {d:?}");
            }
        }
        // A first delay above the cap waits the cap.
        let slow = Retry {
            max_attempts: 3,
            first: Duration::from_secs(90),
            max: Duration::from_secs(60),
        };
        assert_eq!(slow.delay(1, 7), Duration::from_secs(60));
    }
}
