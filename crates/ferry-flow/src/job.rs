//! A run handed to its shard ([`Job`]: its id, generation, replay cursor, input and
//! code), the start record of a generation, and each shard's intake ([`Starts`]), which
//! hands newly started runs over once their start records are durable.

use crate::api::FlowError;
use crate::ctx::Ctx;
use crate::journal::{Entry, Json, Record};
use crate::journal_log::JournalLog;
use crate::replay::Replay;
use ferry_core::sync::lock;
use ferry_log::Lsn;
use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// A workflow's code, as registered: the context and the input in, the output out.
pub(crate) type Handler =
    Arc<dyn Fn(Ctx, Json) -> Pin<Box<dyn Future<Output = Result<Json, FlowError>>>> + Send + Sync>;

pub(crate) struct Job {
    pub(crate) run: String,
    pub(crate) generation: u32,
    pub(crate) replay: Replay,
    pub(crate) input: Json,
    pub(crate) handler: Handler,
    /// The end of the run's last record so far (what its first step waits for).
    pub(crate) last: Lsn,
}

/// The start record of generation `generation`, carrying what the run consumed in
/// the generations before it.
pub(crate) fn next_start(
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

/// Runs started on one shard whose start records are not durable yet. A run's first
/// step waits for its start record anyway; handed to the shard at once, the run would
/// wake the shard to run up to that wait and sleep again, a wake-up per start. Handed
/// over by the log's writer right after the sync, every run that sync started goes in
/// one message, which joins the wake-up that sync gives the shard for its steps (and
/// the writer waits for the shard as for them, `ferry_log::Follower`). One wait on the
/// log per shard at a time, for the lowest position pending when it was made (a run
/// pushed below it, by a starter that appended earlier but pushed later, waits for it:
/// at most one sync more).
pub(crate) struct Starts {
    pub(crate) pending: Mutex<Pending>,
    pub(crate) tx: mpsc::UnboundedSender<Vec<Job>>,
    pub(crate) follower: Option<ferry_log::Follower>,
    /// The shard's places for running runs (`EngineBuilder::max_running`).
    pub(crate) running: Option<Arc<tokio::sync::Semaphore>>,
}

#[derive(Default)]
pub(crate) struct Pending {
    /// By the end of the start record, ascending.
    jobs: VecDeque<(Lsn, Job)>,
    /// A wait on the log is registered.
    armed: bool,
}

impl Starts {
    /// Add `job`, whose start record ends at `end`; true if the caller must arm.
    pub(crate) fn push(&self, end: Lsn, job: Job) -> bool {
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

    pub(crate) fn arm(starts: Arc<Starts>, log: &Arc<dyn JournalLog>, lsn: Lsn) {
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
    pub(crate) fn fire(
        starts: Arc<Starts>,
        log: &Arc<dyn JournalLog>,
        r: Result<(), ferry_log::Error>,
    ) {
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
