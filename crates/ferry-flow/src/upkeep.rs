//! The thread that keeps an engine's directory (an engine on files only): it writes the
//! status file, answers the request inbox (`admin.rs` holds the file protocol), and
//! compacts: folds what became durable into a checkpoint and retires the log below it.

use crate::admin;
use crate::api::{Recovery, RunStatus};
use crate::checkpoint::{self, Folded};
use crate::journal::{Json, Outcome, RECORD_KIND};
use crate::shared::Shared;
use ferry_core::sync::lock;
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How often the directory thread removes old replies, and how old a reply must be.
const PRUNE_EVERY: Duration = Duration::from_secs(60);
const REPLY_KEEP: Duration = Duration::from_secs(600);
/// A request queued while no engine ran, for a run the application has not started
/// again yet, waits this long after opening before it is answered "no run".
const LATE_START_GRACE: Duration = Duration::from_secs(10);

/// Why a compaction did not finish (it is tried again later, unless a record could not
/// be folded: then compaction stops until the engine is reopened).
#[derive(Debug, thiserror::Error)]
enum CompactionError {
    #[error("stopped: the record at {lsn} cannot be folded: {source}")]
    Fold {
        lsn: ferry_log::Lsn,
        source: checkpoint::CheckpointError,
    },
    #[error(transparent)]
    Log(#[from] ferry_log::Error),
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// Compaction's state: what is folded so far, and when to fold more.
pub(crate) struct Compaction {
    pub(crate) folded: Folded,
    pub(crate) every_bytes: u64,
    pub(crate) min_interval: std::time::Duration,
    pub(crate) retention_ms: u64,
    pub(crate) last: std::time::Instant,
    /// A record could not be folded: compaction stops (the log keeps everything)
    /// until the engine is reopened.
    pub(crate) broken: bool,
}

impl Compaction {
    fn maybe_run(&mut self, shared: &Shared, dir: &Path) {
        let durable = shared.log.durable_lsn();
        let behind = durable.saturating_sub(self.folded.lsn);
        let now = shared.clock.now();
        let since = now.saturating_duration_since(self.last);
        let due = (behind >= self.every_bytes && since >= self.min_interval)
            || (behind > 0 && since >= std::time::Duration::from_secs(60));
        if self.broken || !due {
            return;
        }
        self.last = now;
        let result = self.run(shared, dir);
        if let Err(e) = &result {
            tracing::warn!("compaction: {e}");
        }
        shared.counters.compacted(
            shared.clock.now().saturating_duration_since(self.last),
            result.map_err(|_| ()),
        );
    }

    /// Fold what became durable, expire old finished runs, write the checkpoint, then
    /// retire the segments it covers; how many it retired.
    fn run(&mut self, shared: &Shared, dir: &Path) -> Result<usize, CompactionError> {
        let t = shared.clock.now();
        let now = shared.clock.wall_ms();
        let mut bad = None;
        let folded = &mut self.folded;
        let upto = shared.log.read(folded.lsn, &mut |r| {
            if r.kind == RECORD_KIND
                && bad.is_none()
                && let Err(e) = folded.fold(r.payload, now)
            {
                bad = Some(CompactionError::Fold {
                    lsn: r.lsn,
                    source: e,
                });
            }
        })?;
        if let Some(e) = bad {
            self.broken = true;
            return Err(e);
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
        ferry_core::fs::write_atomic(&path, &folded.encode()).map_err(|source| {
            CompactionError::Io {
                what: "write",
                path,
                source,
            }
        })?;
        let found = checkpoint::list(dir).map_err(|source| CompactionError::Io {
            what: "list",
            path: dir.to_path_buf(),
            source,
        })?;
        for (lsn, old) in found {
            if lsn < upto {
                let _ = std::fs::remove_file(old);
            }
        }
        let retired = shared.log.retire_below(upto)?;
        tracing::info!(
            lsn = upto,
            active = folded.active.len(),
            finished = folded.finished.len(),
            expired = removed,
            retired,
            ms = shared
                .clock
                .now()
                .saturating_duration_since(t)
                .as_secs_f64()
                * 1e3,
            "checkpoint written"
        );
        Ok(retired)
    }
}

/// The thread that keeps the status file and answers the inbox (`admin.rs`).
pub(crate) struct Admin {
    stop: std::sync::mpsc::Sender<()>,
    thread: JoinHandle<()>,
}

impl Admin {
    pub(crate) fn start(
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
                let clock = shared.clock.clone();
                let mut pruned: Option<std::time::Instant> = None;
                let opened = clock.now();
                shared.write_status(&dir, recovery, true);
                loop {
                    let now = clock.now();
                    if pruned.is_none_or(|t| now.saturating_duration_since(t) > PRUNE_EVERY) {
                        admin::prune_replies(&dir, REPLY_KEEP);
                        pruned = Some(now);
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
                                && admin::age(&id) > now.saturating_duration_since(opened)
                                && now.saturating_duration_since(opened) < LATE_START_GRACE =>
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

    pub(crate) fn stop(self) {
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
                write_p50_us: stats.write_us.quantile_us(0.5),
                write_p99_us: stats.write_us.quantile_us(0.99),
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
