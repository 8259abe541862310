//! The engine's shared state ([`Shared`]): the journal, the runs map, the registered
//! workflows, each shard's intake, the limits, clock and counters. Its methods are what
//! every caller does to a run (start, signal, cancel, settle, park); it implements
//! [`Host`], the one interface a run's code reaches the engine through.

use crate::api::{self, FlowError, Limit, Limits, RunStatus};
use crate::job::{Handler, Job, Starts};
use crate::journal::{Entry, Json, Outcome, RECORD_KIND, RUN_ID_MAX, Record};
use crate::journal_log::{Failure, JournalLog};
use crate::metrics::Counters;
use crate::registry::{Inbox, RunEntry};
use crate::replay::Replay;
use crate::run::{Host, RunCtx, Wake, Watch};
use ferry_core::seams::{Clock, Rng, SplitMix64};
use ferry_core::sync::lock;
use ferry_log::Lsn;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, RwLock};
use tokio::sync::{mpsc, oneshot};

/// What a cancellation does once its record is durable: nothing more (asked before),
/// wake the run, or settle a parked run as cancelled.
enum Then {
    Answer,
    Wake,
    Settle,
}

pub(crate) struct Shared {
    /// Itself, for work it spawns that outlives a call (a child's cancellation).
    pub(crate) me: std::sync::Weak<Shared>,
    /// The engine's own log: ferry-log on the engine's directory, unless the builder
    /// was given a journal (`EngineBuilder::journal`). Compaction, the status file and
    /// the log's figures read it; runs journal through their shard's [`Lane`]. (A worker
    /// of a server has none: a vacant journal stands in.)
    pub(crate) log: Arc<dyn JournalLog>,
    /// Each shard's lane: where its runs' records go and what they wait on, and its
    /// intake. Embedded, every lane journals to the one log and never changes; on a
    /// worker each grant of a shard is a lane of its own, and a shard not held has a
    /// vacant one (docs/flow-server.md §6).
    pub(crate) lanes: Vec<RwLock<Arc<Lane>>>,
    /// Every run by id. A B-tree, not a hash map: a hash map's resize moves every
    /// entry under this lock at once, which stalled every shard for tens of
    /// milliseconds at 30,000 runs.
    pub(crate) runs: Mutex<BTreeMap<String, RunEntry>>,
    pub(crate) handlers: HashMap<&'static str, Handler>,
    pub(crate) limits: Limits,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) rng: Mutex<SplitMix64>,
    /// On the caller's thread (`on_this_thread`): every task the engine spawned there,
    /// aborted when it is dropped. (A shard thread's tasks die with its runtime.)
    pub(crate) here: Option<Mutex<Vec<tokio::task::AbortHandle>>>,
    /// What `Engine::metrics` reports.
    pub(crate) counters: Counters,
    /// The journal's failure, once it failed (noted by `log`, a `Watched`): callers
    /// waiting for a running run hear of it.
    pub(crate) failure: Arc<Failure>,
    /// A worker of a server (`EngineBuilder::server`): shards come and go.
    pub(crate) on_server: bool,
    /// On a server's worker: what reaches runs on shards other workers hold.
    pub(crate) caller: std::sync::OnceLock<crate::remote::worker::Caller>,
}

/// The shard of run `run` among `shards`: FNV-1a of its root id (up to the first `/`)
/// modulo the count, so a child (`parent/generation/position`) lives on its root's
/// shard (docs/flow-server.md §1). Stable across processes and builds.
pub fn shard_of(run: &str, shards: u32) -> u32 {
    let root = run.split('/').next().unwrap_or(run);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in root.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    (h % u64::from(shards.max(1))) as u32
}

/// A record appended to a shard's journal: wait for it there.
pub(crate) struct Appended {
    pub(crate) journal: Arc<dyn JournalLog>,
    pub(crate) end: Lsn,
}

impl Appended {
    pub(crate) async fn durable(self) -> Result<(), ferry_log::Error> {
        crate::durable::durable(&self.journal, self.end).await
    }
}

/// One shard as the engine holds it now.
pub(crate) struct Lane {
    /// Where the shard's runs journal.
    pub(crate) journal: Arc<dyn JournalLog>,
    /// Its intake: runs started and not yet handed to the shard, and the channel to it.
    pub(crate) starts: Arc<Starts>,
    /// The epoch it is held under on a server; `None` embedded, or not held.
    pub(crate) epoch: Option<u64>,
}

impl Lane {
    /// A lane journaling to `journal`, and the receiving end of its intake. `follower`:
    /// the shard thread as the log's writer sees it; `running`: its places
    /// (`EngineBuilder::max_running`).
    pub(crate) fn new(
        journal: Arc<dyn JournalLog>,
        epoch: Option<u64>,
        follower: Option<ferry_log::Follower>,
        running: Option<usize>,
    ) -> (Arc<Lane>, mpsc::UnboundedReceiver<Vec<Job>>) {
        let (tx, rx) = mpsc::unbounded_channel::<Vec<Job>>();
        let starts = Arc::new(Starts {
            pending: Mutex::new(Default::default()),
            tx,
            follower,
            running: running.map(|n| Arc::new(tokio::sync::Semaphore::new(n))),
        });
        let lane = Lane {
            journal,
            starts,
            epoch,
        };
        (Arc::new(lane), rx)
    }
}

impl Shared {
    /// The shard of `run`: FNV-1a of its root id (up to the first `/`), so a child
    /// (`parent/generation/position`) lives on its root's shard (docs/flow-server.md §1).
    /// Stable across processes, so a run stays on its shard after a restart.
    pub(crate) fn shard_of(&self, run: &str) -> usize {
        shard_of(run, self.lanes.len() as u32) as usize
    }

    /// Shard `shard`'s lane as it is now.
    pub(crate) fn lane(&self, shard: usize) -> Arc<Lane> {
        self.lanes[shard]
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The journal of `run`'s shard.
    pub(crate) fn journal(&self, run: &str) -> Arc<dyn JournalLog> {
        self.lane(self.shard_of(run)).journal.clone()
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
    pub(crate) fn abort_here(&self) {
        if let Some(here) = &self.here {
            for h in lock(here).drain(..) {
                h.abort();
            }
        }
    }

    /// `run`'s shard's lane, if this engine holds the shard (embedded: always). A call
    /// that touches the runs map reads it with the map's lock held: a worker's holder
    /// swaps a shard's lane and changes its runs one after the other, never both at
    /// once, so the lane and the runs such a call sees belong to the same grant.
    pub(crate) fn held(&self, run: &str) -> Result<Arc<Lane>, FlowError> {
        let shard = self.shard_of(run);
        let lane = self.lane(shard);
        if self.on_server && lane.epoch.is_none() {
            return Err(FlowError::NotHeld {
                run: run.to_string(),
                shard: shard as u32,
            });
        }
        Ok(lane)
    }

    /// Hand `job` to its shard once `end` (its start record in `lane`'s journal) is
    /// durable ([`Starts`]).
    pub(crate) fn spawn_when_durable(&self, lane: &Lane, end: Lsn, job: Job) {
        if lane.starts.push(end, job) {
            Starts::arm(lane.starts.clone(), &lane.journal, end);
        }
    }

    pub(crate) fn check_payload(&self, bytes: usize) -> Result<(), FlowError> {
        api::check_payload(&self.limits, bytes)
    }

    /// Start run `id` of `workflow`, unless a run has that id. Returns the end of the
    /// id's start record (to wait for).
    pub(crate) fn start_run(
        &self,
        workflow: &str,
        id: &str,
        input: Json,
        parent: Option<String>,
    ) -> Result<Appended, FlowError> {
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
        let lane = self.held(id)?;
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
            return Ok(Appended {
                journal: lane.journal.clone(),
                end: e.start_end,
            });
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
        let end = lane.journal.append(RECORD_KIND, &bytes)?;
        let mut entry = RunEntry::new(workflow, parent, 0, RunStatus::Running);
        entry.start_end = end;
        self.counters.added(&entry.status, true);
        runs.insert(id.to_string(), entry);
        drop(runs);
        self.spawn_when_durable(
            &lane,
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
        Ok(Appended {
            journal: lane.journal.clone(),
            end,
        })
    }

    /// Ask run `id` to cancel (docs/flow.md §2). False if it had already finished.
    pub(crate) async fn cancel(&self, id: &str) -> Result<bool, FlowError> {
        let (journal, end, then) = {
            let mut runs = lock(&self.runs);
            let journal = self.held(id)?.journal.clone();
            let e = runs
                .get_mut(id)
                .ok_or_else(|| FlowError::UnknownRun { id: id.into() })?;
            if matches!(e.status, RunStatus::Finished(_)) {
                return Ok(false);
            }
            let (end, then) =
                if e.inbox.wake.cancel.swap(true, Ordering::Relaxed) && e.parked_at().is_none() {
                    // Asked before: answer once that request is durable.
                    (journal.end_lsn(), Then::Answer)
                } else {
                    self.journal_cancel(&journal, id, e)?
                };
            (journal, end, then)
        };
        crate::durable::durable(&journal, end).await?;
        match then {
            Then::Answer => {}
            Then::Wake => self.wake(id),
            Then::Settle => self.settle(id, RunStatus::Finished(Outcome::Cancelled)),
        }
        Ok(true)
    }

    /// Journal run `id`'s cancellation request (and a parked run's end); the end of the
    /// last record, and whether the run was parked.
    fn journal_cancel(
        &self,
        journal: &Arc<dyn JournalLog>,
        id: &str,
        e: &mut RunEntry,
    ) -> Result<(Lsn, Then), FlowError> {
        let request = Record {
            run: id.to_string(),
            generation: e.generation,
            pos: None,
            entry: Entry::CancelRequested,
        };
        let mut end = journal.append(RECORD_KIND, &request.encode())?;
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
            end = journal.append(RECORD_KIND, &fin.encode())?;
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
        let (journal, end, fresh) = {
            let mut runs = lock(&shared.runs);
            let journal = shared.held(id)?.journal.clone();
            let e = runs
                .get_mut(id)
                .ok_or_else(|| FlowError::UnknownRun { id: id.into() })?;
            let (end, fresh) = if let Some(k) = key
                && e.inbox.has_key(k)
            {
                // Delivered before (perhaps before the run finished): answer once that
                // delivery is durable (everything appended so far is).
                (journal.end_lsn(), false)
            } else if matches!(e.status, RunStatus::Finished(_)) {
                return Err(FlowError::RunFinished {
                    id: id.into(),
                    signal: name.into(),
                });
            } else {
                let rec = Record {
                    run: id.to_string(),
                    generation: e.generation,
                    pos: None,
                    entry: Entry::Signal {
                        name: name.to_string(),
                        value: value.clone(),
                        key: key.map(str::to_string),
                    },
                };
                let bytes = rec.encode();
                shared.check_payload(bytes.len())?;
                shared.journal_signal(&journal, &mut e.inbox, &bytes, name, value, key)?
            };
            (journal, end, fresh)
        };
        crate::durable::durable(&journal, end).await?;
        if fresh {
            shared.wake(id);
        }
        Ok(())
    }

    /// Append a signal's record and put it in the inbox (under the runs lock: the
    /// journal order and the inbox order are the same).
    fn journal_signal(
        &self,
        journal: &Arc<dyn JournalLog>,
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
        let end = journal.append(RECORD_KIND, bytes)?;
        inbox.push(name.to_string(), value, key.map(str::to_string));
        self.counters.signal();
        Ok((end, true))
    }

    pub(crate) fn wake(&self, id: &str) {
        if let Some(w) = lock(&self.runs).get(id).map(|e| e.inbox.wake.clone()) {
            w.arrived.notify_waiters();
        }
    }

    /// Put a run found by recovery in the map (replacing what a checkpoint said of it).
    pub(crate) fn insert_recovered(
        &self,
        runs: &mut BTreeMap<String, RunEntry>,
        id: String,
        e: RunEntry,
    ) {
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
            for w in e.take_waiters() {
                let _ = w.send(status.clone());
            }
        }
    }

    pub(crate) fn park(&self, run: &RunCtx, reason: String) {
        tracing::error!(run = %run.run, "parked: {reason}");
        let at = (run.generation, run.replay.borrow().len());
        // Gone only on a worker whose shard was just lost: nothing to settle here.
        if let Some(e) = lock(&self.runs).get_mut(&run.run) {
            e.set_parked_at(Some(at));
        }
        let epoch = self.lane(self.shard_of(&run.run)).epoch;
        self.tell_parked(&run.run, epoch, &reason);
        self.settle(&run.run, RunStatus::Parked(reason));
    }

    /// On a server's worker, tell the server that `run`, of the grant at `epoch`, is
    /// parked: its index shows it so until the shard moves (docs/flow-server.md §10).
    pub(crate) fn tell_parked(&self, run: &str, epoch: Option<u64>, reason: &str) {
        if let (Some(caller), Some(epoch)) = (self.caller.get(), epoch) {
            caller.parked(self.shard_of(run) as u32, epoch, run, reason);
        }
    }
}

impl Shared {
    /// A workflow name as the registry spells it; a name no handler has (a run of a
    /// workflow this build does not register) is leaked, once per distinct name.
    pub(crate) fn workflow_name(&self, name: &str) -> &'static str {
        if let Some((&k, _)) = self.handlers.get_key_value(name) {
            return k;
        }
        static UNKNOWN: Mutex<BTreeMap<String, &'static str>> = Mutex::new(BTreeMap::new());
        lock(&UNKNOWN)
            .entry(name.to_string())
            .or_insert_with(|| Box::leak(name.to_string().into_boxed_str()))
    }
}

impl Host for Shared {
    fn journal(&self, run: &str) -> Arc<dyn JournalLog> {
        Shared::journal(self, run)
    }

    fn failure(&self) -> &Arc<Failure> {
        &self.failure
    }

    fn limits(&self) -> &Limits {
        &self.limits
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    fn wall_ms(&self) -> u64 {
        self.clock.wall_ms()
    }

    fn random_u64(&self) -> u64 {
        lock(&self.rng).next_u64()
    }

    fn wake_of(&self, run: &str) -> Arc<Wake> {
        lock(&self.runs)
            .get(run)
            .map(|e| e.inbox.wake.clone())
            .unwrap_or_default()
    }

    fn signal_at(&self, run: &str, name: &str, index: u32) -> Option<Json> {
        let runs = lock(&self.runs);
        runs.get(run).and_then(|e| e.inbox.signal_at(name, index))
    }

    fn consumed_one(&self, run: &str) {
        if let Some(e) = lock(&self.runs).get_mut(run) {
            e.inbox.consumed_one();
        }
    }

    fn publish(&self, run: &str, value: Json) {
        if let Some(e) = lock(&self.runs).get_mut(run) {
            e.publish(value);
        }
    }

    fn start_child(
        &self,
        workflow: &str,
        id: &str,
        input: Json,
        parent: &str,
    ) -> Result<Lsn, FlowError> {
        Ok(self
            .start_run(workflow, id, input, Some(parent.to_string()))?
            .end)
    }

    fn watch(&self, id: &str) -> Result<Watch, FlowError> {
        let mut runs = lock(&self.runs);
        // Retention never forgets a child whose parent is unfinished.
        let child = runs
            .get_mut(id)
            .ok_or_else(|| FlowError::Invalid(format!("child run {id:?} is gone")))?;
        Ok(match &child.status {
            RunStatus::Finished(outcome) => Watch::Finished(outcome.clone()),
            // Running, or parked (it may resume after a deploy): wait.
            _ => {
                let (tx, rx) = oneshot::channel();
                child.add_waiter(tx);
                Watch::Waiting(rx)
            }
        })
    }

    fn send_signal(
        &self,
        id: String,
        name: String,
        value: Json,
        key: String,
    ) -> std::pin::Pin<Box<dyn Future<Output = Result<(), FlowError>>>> {
        let me = self.me.clone();
        Box::pin(async move {
            let shared = me.upgrade().ok_or(FlowError::Stopped)?;
            shared.deliver_anywhere(&id, &name, value, Some(&key)).await
        })
    }

    fn cancel_later(&self, id: String) {
        let Some(shared) = self.me.upgrade() else {
            return;
        };
        self.spawn_here(async move {
            if let Err(e) = shared.cancel(&id).await {
                tracing::warn!(child = %id, "cancelling a child run: {e}");
            }
        });
    }
}
