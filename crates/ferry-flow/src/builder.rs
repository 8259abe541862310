//! Building an engine: its settings ([`EngineBuilder`]), checked once, and `open`:
//! open (and recover) the log, load the newest checkpoint, rebuild every run from its
//! journal, start the shards, and start the thread that keeps the directory.

use crate::api::{FlowError, Limits, Recovery};
use crate::api::{RunStatus, Workflow, decode, encode};
use crate::ctx::Ctx;
use crate::engine::Engine;
use crate::holder::{Holder, Vacant, vacant_lane};
use crate::job::Handler;
use crate::journal_log::{Failure, JournalLog, Watched};
use crate::metrics::Counters;
use crate::recovery::{Journaled, journaled, recover_run};
use crate::registry::RunEntry;
use crate::remote::worker::{Seams, Worker, WorkerSettings};
use crate::shard::{Shard, disk};
use crate::shared::{Lane, Shared};
use crate::upkeep::{Admin, Compaction};
use ferry_core::ConfigError;
use ferry_core::seams::{Clock, SplitMix64, SystemClock};
use ferry_core::sync::lock;
use ferry_log::{Config as LogConfig, Log};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};

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
    /// None: [`default_shards`], or 2 on the caller's thread.
    shards: Option<usize>,
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
    /// A server's worker: where the server is, and how it holds shards there.
    server: Option<WorkerSettings>,
    /// `server_token` and `max_shards`, kept for `server` in whichever order they come.
    server_token: String,
    max_shards: u32,
    /// A simulated server's worker ([`EngineBuilder::server_here`]).
    server_seams: Option<Seams>,
}

/// The most shards an engine runs (each is a thread).
pub const SHARDS_MAX: usize = 256;

/// The shards an embedded engine runs unless told otherwise ([`EngineBuilder::shards`]):
/// half the CPUs this process may use, the rest left to the log's writer, the
/// application's own threads and the kernel's I/O completions; at least 2, at most 16.
/// A shard works through every run a sync made durable one after another, so on a host
/// with cores to spare more shards shorten the time from a sync to the next records
/// (docs/flow.md §4). A run's shard follows from its id and the count at open: an
/// engine reopened with another count places its runs anew.
pub fn default_shards() -> usize {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    (cpus / 2).clamp(2, 16)
}

/// Runs running at once on one shard, unless the builder says otherwise.
pub const DEFAULT_MAX_RUNNING: usize = 1_000;

impl EngineBuilder {
    /// How many shards to run. Unset: [`default_shards`]; on the caller's thread
    /// ([`EngineBuilder::on_this_thread`]) 2, so that a seed plays out alike on every
    /// host.
    fn shard_count(&self) -> usize {
        self.shards.unwrap_or(if self.on_this_thread.is_some() {
            2
        } else {
            default_shards()
        })
    }

    /// Run `n` shards, each a thread (default [`default_shards`]).
    pub fn shards(mut self, n: usize) -> Self {
        self.shards = Some(n);
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

    /// Be a worker of the flow server at `addr` (`unix:/path` or `host:port`; several,
    /// comma-separated, for a server and its standbys) instead of keeping a log in the
    /// directory (docs/flow-server.md): the server holds the
    /// journal, and grants this engine shards, which it recovers from the server and
    /// runs; it stands by for the rest. The shard count is the server's (`shards` is
    /// not used). Runs on a shard this worker does not hold are refused with
    /// [`FlowError::NotHeld`]. Dropping the engine hands its shards back. Not with
    /// `storage`, `journal`, `wrap_files` or `on_this_thread`.
    pub fn server(mut self, addr: impl Into<String>) -> Self {
        self.server = Some(WorkerSettings::new(addr));
        self
    }

    /// Be a server's worker on the caller's thread, for a deterministic simulation
    /// (the server's `tests/sim.rs`): the connection reaches the server through
    /// `seams.dial` and keeps deadlines on `seams.clock`; the holder, the shards and
    /// the calls are tasks of the caller's `LocalSet`. Open with
    /// [`EngineBuilder::open_here`]. Dropping the engine is then a kill: nothing is
    /// handed back.
    pub fn server_here(mut self, seams: Seams) -> Self {
        self.server = Some(WorkerSettings::new("simulated"));
        self.server_seams = Some(seams);
        self
    }

    /// Open a [`EngineBuilder::server_here`] worker: once the server welcomed it.
    pub async fn open_here(mut self) -> Result<Engine, FlowError> {
        self.storage_is_files = false;
        self.check()?;
        let (Some(mut settings), Some(seams)) = (self.server.take(), self.server_seams.take())
        else {
            return Err(FlowError::Invalid(
                "open_here opens a worker made with server_here".into(),
            ));
        };
        settings.token = self.server_token.clone();
        settings.max_shards = self.max_shards;
        let seed = (seams.session >> 64) as u64 ^ seams.session as u64;
        let worker = Worker::connect_here(settings, seams).await?;
        self.worker_engine(worker, Some(seed))
    }

    /// With [`EngineBuilder::server`]: the token the server asks for (its `--token`).
    pub fn server_token(mut self, token: impl Into<String>) -> Self {
        self.server_token = token.into();
        self
    }

    /// With [`EngineBuilder::server`]: hold at most `n` shards (0, the default: as many
    /// as the server grants).
    pub fn max_shards(mut self, n: u32) -> Self {
        self.max_shards = n;
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
        self.handlers.insert(workflow.name(), handler);
        self
    }

    /// The settings make sense together, or the first that does not, named.
    fn check(&self) -> Result<(), ConfigError> {
        if let Some(s) = &self.server {
            let other = if self.storage.is_some() {
                Some("storage")
            } else if self.journal.is_some() {
                Some("journal")
            } else if self.wrap_files.is_some() {
                Some("wrap_files")
            } else if self.on_this_thread.is_some() {
                Some("on_this_thread")
            } else {
                None
            };
            if let Some(other) = other {
                return Err(ConfigError::new(
                    "server",
                    &s.server,
                    format!("a worker of a server keeps no log of its own: drop .{other}(..)"),
                ));
            }
        }
        if self.on_this_thread.is_some() && self.storage_is_files {
            return Err(ConfigError::new(
                "on_this_thread",
                "a seed",
                "it is for a simulation: give the engine its storage with .storage(..) too",
            ));
        }
        if self.storage.is_some() && self.journal.is_some() {
            return Err(ConfigError::new(
                "journal",
                "a journal",
                "give the engine a storage for its own log or a journal, not both",
            ));
        }
        if self.wrap_files.is_some() && !self.storage_is_files {
            return Err(ConfigError::new(
                "wrap_files",
                "a wrapper",
                "it wraps the log's files in the directory: it does not go with a storage or \
                 a journal of its own",
            ));
        }
        let shards = self.shard_count();
        if shards == 0 || shards > SHARDS_MAX {
            return Err(ConfigError::new(
                "shards",
                shards,
                format!("must be between 1 and {SHARDS_MAX}"),
            ));
        }
        if let Some(n) = self.max_running
            && (n == 0 || n > tokio::sync::Semaphore::MAX_PERMITS)
        {
            return Err(ConfigError::new(
                "max_running",
                n,
                format!(
                    "must be between 1 and {} (None for no bound)",
                    tokio::sync::Semaphore::MAX_PERMITS
                ),
            ));
        }
        if self.limits.payload_bytes > self.log.record_bytes_max as usize {
            return Err(ConfigError::new(
                "limits.payload_bytes",
                self.limits.payload_bytes,
                format!(
                    "is over the log's largest record ({} bytes, log_config's \
                     record_bytes_max): raise that too, or lower the payload limit",
                    self.log.record_bytes_max
                ),
            ));
        }
        Ok(())
    }

    /// Open the log (recovering it), rebuild every run from its journal, restart the
    /// unfinished ones.
    pub fn open(mut self) -> Result<Engine, FlowError> {
        self.storage_is_files =
            self.storage.is_none() && self.journal.is_none() && self.server.is_none();
        self.check()?;
        if self.server_seams.is_some() {
            return Err(FlowError::Invalid(
                "a worker made with server_here opens with open_here".into(),
            ));
        }
        if let Some(settings) = self.server.take() {
            return self.open_worker(settings);
        }
        let started = self.clock.now();
        let shards = self.shard_count();
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
            return Err(FlowError::Config(ConfigError::new(
                "journal",
                format!("a journal starting at {}", log.start_lsn()),
                "over a journal of its own the engine keeps no checkpoints, so it needs the \
                 whole history (from position 0) to recover",
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
        let mut lanes = Vec::new();
        let mut rxs = Vec::new();
        for _ in 0..shards {
            // Shards that are tasks on the caller's thread never go idle for it.
            let follower = if self.on_this_thread.is_none() {
                log.follower()
            } else {
                None
            };
            let (lane, rx) = Lane::new(log.clone(), None, follower, self.max_running);
            lanes.push(lane);
            rxs.push(rx);
        }
        let shared = Arc::new_cyclic(|me| Shared {
            me: me.clone(),
            log: log.clone(),
            lanes: lanes.iter().cloned().map(RwLock::new).collect(),
            runs: Mutex::new(BTreeMap::new()),
            handlers: self.handlers,
            limits: self.limits,
            clock: self.clock,
            rng: Mutex::new(match self.on_this_thread {
                Some(seed) => SplitMix64::seeded(seed),
                None => SplitMix64::from_entropy(),
            }),
            here: self.on_this_thread.map(|_| Mutex::new(Vec::new())),
            counters: Counters::default(),
            failure,
            on_server: false,
            caller: std::sync::OnceLock::new(),
        });
        {
            let mut runs = lock(&shared.runs);
            for (id, d) in &folded.finished {
                let name = shared.workflow_name(&d.workflow);
                let mut e = RunEntry::new(
                    name,
                    d.parent.clone(),
                    d.generation,
                    RunStatus::Finished(d.outcome.clone()),
                );
                e.inbox.remember_keys(&d.keys);
                shared.insert_recovered(&mut runs, id.clone(), e);
            }
        }
        let mut resumed = 0;
        for (run, records) in by_run {
            let lane = &lanes[shared.shard_of(&run)];
            if recover_run(&shared, lane, run, records)? {
                resumed += 1;
            }
        }
        // The shards start after every run is known, so a resumed parent finds its
        // children.
        let shards = match self.on_this_thread {
            None => rxs
                .into_iter()
                .zip(lanes)
                .enumerate()
                .map(|(i, (rx, lane))| Shard::start(i, shared.clone(), lane, rx, None))
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
        let elapsed = shared.clock.now().saturating_duration_since(started);
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
                last: shared.clock.now(),
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
            holder: None,
        })
    }
}

impl EngineBuilder {
    /// Open as a server's worker: connect, then hold what the server grants.
    fn open_worker(self, mut settings: WorkerSettings) -> Result<Engine, FlowError> {
        settings.token = self.server_token.clone();
        settings.max_shards = self.max_shards;
        let worker = Worker::connect(settings)?;
        self.worker_engine(worker, None)
    }

    /// The engine over a connected worker; `here`: on the caller's thread, its draws
    /// from this seed.
    fn worker_engine(self, worker: Worker, here: Option<u64>) -> Result<Engine, FlowError> {
        let shards = worker.shards() as usize;
        let running = self.max_running;
        let shared = Arc::new_cyclic(|me| Shared {
            me: me.clone(),
            log: Arc::new(Vacant {
                what: "a log of this engine's own (a worker keeps none)".into(),
            }),
            lanes: (0..shards)
                .map(|i| RwLock::new(vacant_lane(i, running)))
                .collect(),
            runs: Mutex::new(BTreeMap::new()),
            handlers: self.handlers,
            limits: self.limits,
            clock: self.clock,
            rng: Mutex::new(match here {
                Some(seed) => SplitMix64::seeded(seed),
                None => SplitMix64::from_entropy(),
            }),
            here: here.map(|_| Mutex::new(Vec::new())),
            counters: Counters::default(),
            failure: Arc::new(Failure::default()),
            on_server: true,
            caller: std::sync::OnceLock::new(),
        });
        let caller = worker.caller();
        let _ = shared.caller.set(caller.clone());
        let calls = worker
            .take_calls()
            .expect("a new worker's calls are untaken");
        let retention = self.retention;
        let holder = Holder::start(shared.clone(), worker, running, retention).map_err(|e| {
            FlowError::Io {
                what: "start the thread that holds shards for",
                path: self.dir.clone(),
                source: Arc::new(e),
            }
        })?;
        if here.is_some() {
            let answering = crate::calls::answer_calls(Arc::downgrade(&shared), calls, caller);
            shared.spawn_here(answering);
        } else {
            crate::calls::serve(Arc::downgrade(&shared), calls, caller).map_err(|e| {
                FlowError::Io {
                    what: "start the thread that answers calls for",
                    path: self.dir.clone(),
                    source: Arc::new(e),
                }
            })?;
        }
        Ok(Engine {
            shared,
            shards: Vec::new(),
            recovery: Recovery {
                elapsed: std::time::Duration::ZERO,
                log_records: 0,
                resumed: 0,
                torn_bytes: 0,
            },
            admin: None,
            holder: Some(holder),
        })
    }
}

impl Engine {
    pub fn builder(dir: impl AsRef<Path>) -> EngineBuilder {
        EngineBuilder {
            dir: dir.as_ref().to_path_buf(),
            storage: None,
            wrap_files: None,
            journal: None,
            storage_is_files: true,
            shards: None,
            max_running: Some(DEFAULT_MAX_RUNNING),
            log: LogConfig::default(),
            limits: Limits::default(),
            retention: std::time::Duration::from_secs(24 * 3600),
            compact_bytes: None,
            compact_interval: std::time::Duration::from_secs(10),
            handlers: HashMap::new(),
            clock: Arc::new(SystemClock),
            on_this_thread: None,
            server: None,
            server_token: String::new(),
            server_seams: None,
            max_shards: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each setting the engine cannot use is refused before anything is opened, named
    /// with its value.
    #[test]
    fn settings_are_checked_once_and_named() {
        let refused = |b: EngineBuilder| {
            let mut b = b;
            b.storage_is_files = b.storage.is_none() && b.journal.is_none();
            b.check().err().map(|e| (e.setting, e.value))
        };
        let b = || Engine::builder("/nonexistent/never-opened");
        assert_eq!(refused(b()), None);
        assert_eq!(refused(b().shards(0)), Some(("shards", "0".into())));
        assert_eq!(
            refused(b().shards(SHARDS_MAX + 1)),
            Some(("shards", (SHARDS_MAX + 1).to_string()))
        );
        assert_eq!(
            refused(b().max_running(Some(0))),
            Some(("max_running", "0".into()))
        );
        assert_eq!(refused(b().max_running(None)), None);
        let big = Limits {
            payload_bytes: LogConfig::default().record_bytes_max as usize + 1,
            ..Limits::default()
        };
        assert_eq!(
            refused(b().limits(big)).map(|(s, _)| s),
            Some("limits.payload_bytes")
        );
        assert_eq!(
            refused(b().on_this_thread(1)).map(|(s, _)| s),
            Some("on_this_thread")
        );
        assert_eq!(
            refused(
                b().wrap_files(|f| Arc::new(f))
                    .storage(Arc::new(ferry_log::sim::SimStorage::new(1)))
            )
            .map(|(s, _)| s),
            Some("wrap_files")
        );
    }
}
