//! The engine as an application holds it ([`Engine`]): start runs, signal, cancel and
//! query them, list them, read its metrics; and [`RunHandle`], a run's result. Every
//! call goes to the shared state (`shared.rs`); opening is `builder.rs`.

use crate::api::{FlowError, Recovery, RunInfo, RunStatus, Signal, Workflow, decode, encode};
use crate::calls;
use crate::journal::{Json, Outcome};
use crate::remote::proto::CallKind;
use crate::remote::worker::Caller;
use crate::shard::Shard;
use crate::shared::Shared;
use crate::upkeep::Admin;
use ferry_core::sync::lock;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::marker::PhantomData;
use std::sync::Arc;
use tokio::sync::oneshot;

/// Durable execution on one directory.
pub struct Engine {
    pub(crate) shared: Arc<Shared>,
    pub(crate) shards: Vec<Shard>,
    pub(crate) recovery: Recovery,
    pub(crate) admin: Option<Admin>,
    /// A server's worker: what takes and lets go of its shards.
    pub(crate) holder: Option<crate::holder::Holder>,
}

impl Engine {
    /// Start `workflow` as run `id`, or return the run that already has that id
    /// (running, parked or finished: docs/flow.md §1.6). Returns once the start is
    /// durable.
    ///
    /// On a server's worker, a run whose shard another worker holds is started there,
    /// through the server (docs/flow-server.md §9), and so are the signals, cancels and
    /// results below.
    pub async fn start<I: Serialize, O: DeserializeOwned>(
        &self,
        workflow: Workflow<I, O>,
        id: &str,
        input: &I,
    ) -> Result<RunHandle<O>, FlowError> {
        let input = encode(input)?;
        match self.elsewhere(id) {
            None => {
                self.shared
                    .start_run(workflow.name(), id, input, None)?
                    .durable()
                    .await?
            }
            Some(c) => {
                let kind = CallKind::Start {
                    workflow: workflow.name().to_string(),
                    id: id.to_string(),
                    input: serde_json::to_vec(&input).expect("JSON serializes"),
                };
                calls::remote(c, kind, id.to_string()).await?;
            }
        }
        Ok(self.handle(id))
    }

    fn handle<O>(&self, id: &str) -> RunHandle<O> {
        RunHandle {
            shared: Arc::downgrade(&self.shared),
            id: id.to_string(),
            caller: self.shared.caller.get().cloned(),
            _out: PhantomData,
        }
    }

    /// On a server's worker, the caller to use for run `id` when this worker does not
    /// hold its shard.
    fn elsewhere(&self, id: &str) -> Option<&Caller> {
        self.shared
            .caller
            .get()
            .filter(|_| calls::elsewhere(&self.shared.held(id)))
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
        self.shared
            .deliver_anywhere(id, signal.name, value, Some(key))
            .await
    }

    /// [`Engine::signal`] with an untyped value.
    pub async fn signal_json(&self, id: &str, name: &str, value: Json) -> Result<(), FlowError> {
        self.shared.deliver_anywhere(id, name, value, None).await
    }

    /// Ask run `id` to cancel; returns once the request is durable. The run's next
    /// suspension point (`step`, `sleep`, `wait_for`, `child`) returns
    /// [`FlowError::Cancelled`]; a parked run ends cancelled at once. False if the run
    /// had already finished.
    pub async fn cancel(&self, id: &str) -> Result<bool, FlowError> {
        let Some(c) = self.elsewhere(id) else {
            return self.shared.cancel(id).await;
        };
        let kind = CallKind::Cancel { id: id.to_string() };
        let key = crate::remote::fresh_key("call");
        Ok(calls::remote(c, kind, key).await? == Json::Bool(true))
    }

    /// What run `id` last published with `ctx.publish` (rebuilt by replay after a
    /// restart), if anything.
    /// On a server's worker, this answers only for runs on shards this worker holds
    /// (else `NotHeld`); [`Engine::query_anywhere`] asks the holder through the server.
    pub fn query<T: DeserializeOwned>(&self, id: &str) -> Result<Option<T>, FlowError> {
        self.shared.published(id)?.map(decode).transpose()
    }

    /// [`Engine::query`], and on a server's worker for a run on a shard another worker
    /// holds, asked of that worker through the server.
    pub async fn query_anywhere<T: DeserializeOwned>(
        &self,
        id: &str,
    ) -> Result<Option<T>, FlowError> {
        let Some(c) = self.elsewhere(id) else {
            return self.query(id);
        };
        let kind = CallKind::Query { id: id.to_string() };
        match calls::remote(c, kind, String::new()).await? {
            Json::Null => Ok(None),
            v => decode(v).map(Some),
        }
    }

    /// A handle on an existing run (for `result` after a restart). On a server's worker,
    /// any id gets one: the server knows whether the run exists.
    pub fn run<O: DeserializeOwned>(&self, id: &str) -> Option<RunHandle<O>> {
        let known = self.shared.caller.get().is_some() || lock(&self.shared.runs).contains_key(id);
        known.then(|| self.handle(id))
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

    /// On a server's worker, the shards it holds now, each with its epoch
    /// (docs/flow-server.md §5); embedded, none.
    pub fn held_shards(&self) -> Vec<(u32, u64)> {
        (0..self.shared.lanes.len())
            .filter_map(|i| self.shared.lane(i).epoch.map(|e| (i as u32, e)))
            .collect()
    }

    pub fn log_stats(&self) -> ferry_log::Stats {
        self.shared.log.stats()
    }

    /// Keep the log writer's last `capacity` cycles (0: none) for
    /// [`Engine::take_log_cycles`]: with a run's own timestamps, where its latency goes
    /// (`ferry_log::Log::trace_cycles`; the benchmark's W3 uses it). A log without a
    /// writer of its own (a server-mode worker's) keeps none.
    pub fn trace_log_cycles(&self, capacity: usize) {
        self.shared.log.trace_cycles(capacity)
    }

    /// The log writer's cycles kept since the last call, oldest first.
    pub fn take_log_cycles(&self) -> Vec<ferry_log::Cycle> {
        self.shared.log.take_cycles()
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
        // A worker hands its shards back first (docs/flow-server.md §8.2).
        drop(self.holder.take());
        for s in &mut self.shards {
            s.stop();
        }
        self.shared.abort_here();
        // Callers still waiting for a result hear that the engine stopped, even if
        // something keeps the runs map alive a while longer.
        for entry in lock(&self.shared.runs).values_mut() {
            drop(entry.take_waiters());
        }
        // After the shards: the last status shows where every run stopped.
        if let Some(a) = self.admin.take() {
            a.stop();
        }
    }
}

/// A run's result, awaitable from any thread while its engine is open. It does not keep
/// the engine (nor its log and directory lock) alive: once the engine is dropped,
/// `result` returns `FlowError::Stopped`.
pub struct RunHandle<O> {
    shared: std::sync::Weak<Shared>,
    id: String,
    /// On a server's worker: where to ask when the run is not here.
    caller: Option<Caller>,
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
    ///
    /// On a server's worker, the result of a run on a shard this worker does not hold
    /// (or stopped holding while waiting) comes from the server's index once durable.
    pub async fn result(&self) -> Result<O, FlowError> {
        let here = self.local_result().await;
        match &self.caller {
            Some(c) if calls::elsewhere(&here) => calls::remote_result(c, &self.id).await,
            _ => here,
        }
    }

    async fn local_result(&self) -> Result<O, FlowError> {
        let (rx, failure) = {
            let shared = self.shared.upgrade().ok_or(FlowError::Stopped)?;
            let mut runs = lock(&shared.runs);
            let entry = runs
                .get_mut(&self.id)
                .ok_or_else(|| FlowError::UnknownRun {
                    id: self.id.clone(),
                })?;
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
                // Let go of: the engine stopped, or (on a worker) the run's shard was
                // lost. It may be back here already under a new epoch, the run not yet
                // recovered: the server's index answers wherever the run goes on.
                Err(_) => {
                    let open = self.caller.as_ref().is_some_and(Caller::is_open);
                    match self.shared.upgrade() {
                        Some(shared) if shared.on_server && open => Err(FlowError::NotHeld {
                            run: self.id.clone(),
                            shard: shared.shard_of(&self.id) as u32,
                        }),
                        Some(shared) => shared.held(&self.id).and(Err(FlowError::Stopped)),
                        None => Err(FlowError::Stopped),
                    }
                }
            },
            e = failure.wait() => Err(FlowError::Log(e)),
        }
    }
}

fn status_result<O: DeserializeOwned>(s: RunStatus) -> Result<O, FlowError> {
    match s {
        RunStatus::Finished(Outcome::Ok(v)) => decode(v),
        RunStatus::Finished(Outcome::Err(error)) => Err(FlowError::RunFailed { error }),
        RunStatus::Finished(Outcome::Cancelled) => Err(FlowError::Cancelled),
        RunStatus::Parked(reason) => Err(FlowError::Parked(reason)),
        RunStatus::Running => Err(FlowError::Stopped),
    }
}
