//! Recovery (docs/flow.md §5): what an open replays (the newest checkpoint's records of
//! each unfinished run, then every record the log holds after it), each run rebuilt from
//! its records, and [`read_journal`], the same reading for tools and tests.

use crate::api::{FlowError, RunStatus};
use crate::checkpoint::{self, Folded};
use crate::job::{Job, next_start};
use crate::journal::{Entry, RECORD_KIND, Record};
use crate::journal_log::JournalLog;
use crate::registry::RunEntry;
use crate::replay::Replay;
use crate::shared::Shared;
use ferry_core::sync::lock;
use ferry_log::{Config as LogConfig, Log};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Rebuild one run from its records (every generation's, in log order): its inbox, its
/// status, and a job on its shard if it is unfinished. True if it resumed.
pub(crate) fn recover_run(
    shared: &Shared,
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
