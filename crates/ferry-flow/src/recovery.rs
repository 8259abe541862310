//! Recovery (docs/flow.md §5): what an open replays (the newest checkpoint's records of
//! each unfinished run, then every record the log holds after it), each run rebuilt from
//! its records, and [`read_journal`], the same reading for tools and tests.

use crate::api::{FlowError, RunStatus};
use crate::checkpoint::{self, Folded};
use crate::job::{Job, next_start};
use crate::journal::{Entry, Outcome, RECORD_KIND, Record};
use crate::journal_log::JournalLog;
use crate::registry::RunEntry;
use crate::replay::Replay;
use crate::shared::{Lane, Shared};
use ferry_core::sync::lock;
use ferry_log::{Config as LogConfig, Log, Lsn};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Rebuild one run from its records (every generation's, in log order): its inbox, its
/// status, and a job on its shard (`lane`) if it is unfinished. True if it resumed.
pub(crate) fn recover_run(
    shared: &Shared,
    lane: &Lane,
    run: String,
    records: Vec<Record>,
) -> Result<bool, FlowError> {
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
    entry.inbox.set_consumed(consumed_total);
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
            last = lane.journal.append(RECORD_KIND, &next.encode())?;
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
            Some(h) => {
                let job = Job {
                    run: run.clone(),
                    generation: job_generation,
                    replay,
                    input: job_input,
                    handler: h.clone(),
                    last,
                };
                // The shard is gone only if the engine is.
                let _ = lane.starts.tx.send(vec![job]);
            }
            None => {
                let reason = format!(
                    "no workflow named {workflow:?} is registered; register it and restart"
                );
                shared.tell_parked(&run, lane.epoch, &reason);
                entry.status = RunStatus::Parked(reason);
                entry.set_parked_at(Some((job_generation, replay.len())));
            }
        }
    }
    shared.insert_recovered(&mut lock(&shared.runs), run, entry);
    Ok(resume)
}

/// What an engine directory holds for each run, as a restart would find it: read by
/// [`read_journal`].
#[derive(Clone, Debug, Default)]
pub struct Journal {
    /// The runs a restart replays (unfinished ones, and those that finished after the
    /// newest checkpoint), each with its records in order: the checkpoint's, then the
    /// log's after it.
    pub records: BTreeMap<String, Vec<Record>>,
    /// Runs the newest checkpoint holds as finished (within the retention): their
    /// outcomes, without their records.
    pub finished: BTreeMap<String, FinishedRun>,
}

/// A finished run as a checkpoint keeps it.
#[derive(Clone, Debug, PartialEq)]
pub struct FinishedRun {
    pub workflow: String,
    pub parent: Option<String>,
    pub generation: u32,
    pub outcome: Outcome,
}

impl Journal {
    /// How run `id` ended, if the journal says it did (in the checkpoint or in its
    /// records); `None` for a run still going, or one the journal does not hold.
    pub fn outcome(&self, id: &str) -> Option<&Outcome> {
        if let Some(f) = self.finished.get(id) {
            return Some(&f.outcome);
        }
        self.records
            .get(id)?
            .iter()
            .rev()
            .find_map(|r| match &r.entry {
                Entry::Finished { outcome } => Some(outcome),
                _ => None,
            })
    }

    /// Does the journal hold run `id` at all?
    pub fn has(&self, id: &str) -> bool {
        self.finished.contains_key(id) || self.records.contains_key(id)
    }

    /// Every step result the journal holds, as (run, step name, outcome), in run order
    /// then journal order: the steps a restart will not run again.
    pub fn steps(&self) -> impl Iterator<Item = (&str, &str, &Outcome)> {
        self.records.iter().flat_map(|(run, records)| {
            records.iter().filter_map(move |r| match &r.entry {
                Entry::Step { name, outcome, .. } => Some((run.as_str(), name.as_str(), outcome)),
                _ => None,
            })
        })
    }
}

/// The journal an engine directory holds ([`Journal`]): the newest checkpoint's
/// finished runs and the records of each unfinished run, then every record the log
/// holds after it, read as an engine's open would read them (a torn tail is not a
/// record). Reads a copy of the log's segments and the checkpoints (in the system's
/// temporary directory, removed afterwards), so the directory is left exactly as it is
/// and the next open still finds what it must repair; no engine may be writing it
/// meanwhile. For tools and tests that check what is durable, e.g. which step results
/// a crash left.
pub fn read_journal(dir: impl AsRef<Path>) -> Result<Journal, FlowError> {
    let dir = dir.as_ref();
    let io = |what: &'static str, path: &Path, e: std::io::Error| FlowError::Io {
        what,
        path: path.to_path_buf(),
        source: Arc::new(e),
    };
    static COPIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let copy = std::env::temp_dir().join(format!(
        "ferry-flow-read-{}-{}",
        std::process::id(),
        COPIES.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&copy).map_err(|e| io("make the directory", &copy, e))?;
    let read = (|| {
        for entry in std::fs::read_dir(dir).map_err(|e| io("list", dir, e))? {
            let entry = entry.map_err(|e| io("list", dir, e))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            // Segments and checkpoints: what an open reads (spares hold nothing).
            if name.ends_with(".seg") || name.starts_with("checkpoint-") {
                std::fs::copy(entry.path(), copy.join(&*name))
                    .map_err(|e| io("copy", &entry.path(), e))?;
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
pub fn read_journal_on(storage: Arc<dyn ferry_log::Storage>) -> Result<Journal, FlowError> {
    let (log, _) = Log::open(storage, LogConfig::default())?;
    read_log(log, None)
}

/// What an open of `log` (and of the checkpoints in `dir`) finds; then the log is
/// closed.
fn read_log(log: Log, dir: Option<&Path>) -> Result<Journal, FlowError> {
    let journaled = journaled(dir, &log)?;
    log.close()?;
    let finished = journaled
        .folded
        .finished
        .into_iter()
        .map(|(id, d)| {
            let run = FinishedRun {
                workflow: d.workflow,
                parent: d.parent,
                generation: d.generation,
                outcome: d.outcome,
            };
            (id, run)
        })
        .collect();
    Ok(Journal {
        records: journaled.by_run,
        finished,
    })
}

/// What an open replays.
pub(crate) struct Journaled {
    /// The newest checkpoint (empty off files).
    pub(crate) folded: Folded,
    /// By run: its records in the checkpoint, then those after it in the log.
    pub(crate) by_run: BTreeMap<String, Vec<Record>>,
    /// Records read from the log.
    pub(crate) read: u64,
}

/// Load the newest checkpoint of `dir` (an engine on files) and the log's records after
/// it.
pub(crate) fn journaled(dir: Option<&Path>, log: &dyn JournalLog) -> Result<Journaled, FlowError> {
    let folded = match dir {
        Some(dir) => load_checkpoint(dir, log)?,
        None => Folded::default(),
    };
    journaled_from(folded, log)
}

/// The records of `folded` (a checkpoint) and the log's after it.
pub(crate) fn journaled_from(folded: Folded, log: &dyn JournalLog) -> Result<Journaled, FlowError> {
    journaled_of(folded, &mut |from, f| log.read(from, f))
}

/// Reads records from a position on, as [`JournalLog::read`].
pub(crate) type ReadFrom<'a> =
    dyn FnMut(Lsn, &mut dyn FnMut(ferry_log::Record<'_>)) -> Result<Lsn, ferry_log::Error> + 'a;

/// [`journaled_from`] with the records after the checkpoint from `read`.
pub(crate) fn journaled_of(
    folded: Folded,
    read_from: &mut ReadFrom<'_>,
) -> Result<Journaled, FlowError> {
    let mut by_run: BTreeMap<String, Vec<Record>> =
        folded.active_records().map_err(|e| FlowError::Damaged {
            what: "a record in the newest checkpoint".into(),
            reason: e.to_string(),
            hint: RESTORE.into(),
        })?;
    let mut bad = None;
    let mut read = 0u64;
    read_from(folded.lsn, &mut |r| {
        if r.kind != RECORD_KIND {
            return;
        }
        read += 1;
        match Record::decode(r.payload) {
            Ok(rec) => by_run.entry(rec.run.clone()).or_default().push(rec),
            Err(e) => {
                bad.get_or_insert((r.lsn, e.to_string()));
            }
        }
    })?;
    if let Some((lsn, reason)) = bad {
        return Err(FlowError::Damaged {
            what: format!("the journal's record at {lsn}"),
            reason,
            hint: "it passed the log's checksum, so it was written by another build of \
                   ferry-flow (open the directory with that build) or by a bug; nothing \
                   was changed"
                .into(),
        });
    }
    Ok(Journaled {
        folded,
        by_run,
        read,
    })
}

/// What to do about a damaged directory whose log no longer holds everything.
const RESTORE: &str = "restore the directory (with its checkpoint files) from a copy";

/// The newest checkpoint in `dir` (none: an empty one), checked against the log.
fn load_checkpoint(dir: &Path, log: &dyn JournalLog) -> Result<Folded, FlowError> {
    let found = checkpoint::list(dir).map_err(|e| FlowError::Io {
        what: "list",
        path: dir.to_path_buf(),
        source: Arc::new(e),
    })?;
    let folded = match found.last() {
        None => Folded::default(),
        Some((_, path)) => {
            let bytes = std::fs::read(path).map_err(|e| FlowError::Io {
                what: "read",
                path: path.clone(),
                source: Arc::new(e),
            })?;
            Folded::decode(&bytes).map_err(|e| FlowError::Damaged {
                what: format!("the checkpoint {}", path.display()),
                reason: e.to_string(),
                hint: if log.start_lsn() == 0 {
                    // Nothing was retired: the log alone rebuilds every run.
                    "the log still holds everything from its start, so move this file \
                     out of the directory and open again (the engine rebuilds from the log)"
                        .into()
                } else {
                    format!(
                        "the log before position {} was retired and this checkpoint is all \
                         that holds it: {RESTORE}",
                        log.start_lsn()
                    )
                },
            })?
        }
    };
    if log.start_lsn() > folded.lsn {
        return Err(FlowError::Damaged {
            what: format!("the engine directory {}", dir.display()),
            reason: format!(
                "its log starts at {} but no checkpoint covers what came before it",
                log.start_lsn()
            ),
            hint: RESTORE.into(),
        });
    }
    if log.end_lsn() < folded.lsn {
        return Err(FlowError::Damaged {
            what: format!("the engine directory {}", dir.display()),
            reason: format!(
                "its checkpoint covers the log up to {} but the log ends at {}: the log \
                 was replaced or cut",
                folded.lsn,
                log.end_lsn()
            ),
            hint: RESTORE.into(),
        });
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
