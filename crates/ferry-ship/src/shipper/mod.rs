//! The shipper: ships every `*.db` in a directory (or the names given) to one receiver.
//!
//! Threads:
//! - `workers` (default 2) run steps (see [`track`]); a database is stepped by at most
//!   one worker at a time, so its state needs no finer locking. SQLite and HTTP run on
//!   these plain threads, never on an async task.
//! - one watcher reads inotify events on the directory: a write to `NAME.db-wal` wakes
//!   NAME within milliseconds, a new `NAME.db` is picked up. Every database is also looked
//!   at every second (a backstop) and the directory rescanned every five.
//! - commits on connections prepared with [`crate::prepare_connection`] in this process
//!   wake the database directly.
//!
//! The rooms, lowest first: [`limits`]; the pure cores [`proof`] (the continuity proof of
//! docs/ship.md §3.3), [`batch`] (what waits for acknowledgement, and requests) and
//! [`fold_policy`] (when to fold); [`files`] (the database's files and identity),
//! [`base`] (a base's stream and progress), [`client`] (HTTP), [`fold`] (the folder
//! thread); [`track`] (one database's step) and `snapshot` (taking and sending a base);
//! [`error`], [`status`]; this module: the [`Shipper`], its scheduler, workers and watcher.

pub mod base;
pub mod batch;
pub mod client;
pub mod error;
pub mod files;
pub mod fold;
pub mod fold_policy;
mod http1;
pub mod limits;
mod nice;
pub mod proof;
mod snapshot;
pub mod status;
pub mod track;

pub use crate::proto::{BATCH_BYTES_MAX, PART_BYTES_MAX};
pub use limits::{FOLD_MIN_FRAMES, NICE, TXN_INLINE_BYTES_MAX, UNACKED_BYTES_MAX, WAL_MAX_BYTES};
pub use status::{DbStatus, SavedState, ShipperStatus, metrics, offline_status};

use base::BaseProgress;
use client::Client;
pub use error::{OfflineError, StartError, StepError};
use ferry_core::ConfigError;
use ferry_core::epoch::Epoch;
use ferry_core::fs::DirLock;
use ferry_core::seams::{Clock, SystemClock};
use ferry_core::sync::lock;
use fold::FoldState;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use track::{Next, Track, TrackConfig};

/// Backstop: every database is looked at this often even without a wake-up.
const POLL: Duration = Duration::from_secs(1);
/// A database woken again sooner than this after its last step waits out the rest:
/// under a stream of commits the shipper then sends one request per `PACE` carrying
/// every commit meanwhile, instead of one request per commit that costs the app's
/// core as much as the commit itself. Below any lag a reader could act on.
const PACE: Duration = Duration::from_micros(1000);
/// The watcher's pause after each batch of inotify events (see `Watcher::run`): a
/// database it woke cannot step again sooner than `PACE` anyway, so pausing as long adds
/// no lag to it, and under a stream of commits wakes the watcher once per step instead of
/// once per commit (at 3,000 commits a second, a sixth of a sidecar's CPU).
const WATCH_COALESCE: Duration = PACE;
/// The watcher's pause instead when every WAL write it read was of a database whose
/// app's commit hook had fired since its last read: the hook woke the database already,
/// so the watcher's own wake-ups (one per commit under load, on the app's core) bought
/// nothing. A write by another process meanwhile is noticed at most this much later.
const HOOKED_COALESCE: Duration = Duration::from_millis(5);
/// The status snapshot of a busy database is rebuilt at most this often.
const SNAPSHOT_INTERVAL: Duration = Duration::from_millis(100);
/// The directory is rescanned for new databases this often (inotify does it sooner).
const RESCAN: Duration = Duration::from_secs(5);

/// How a shipper is set up. Checked by [`Shipper::start`].
#[derive(Clone)]
pub struct ShipperConfig {
    pub dir: PathBuf,
    /// Databases to ship; empty means every `*.db` in `dir`.
    pub names: Vec<String>,
    /// `http://HOST:PORT` of the receiver.
    pub peer: String,
    pub token: Option<String>,
    /// Ship with at least this epoch (to take a name over after a promotion, on purpose).
    pub epoch: Option<Epoch>,
    pub workers: usize,
    pub wal_max_bytes: u64,
    pub fold_min_frames: u32,
    /// Niceness of the shipper's threads (0 to 19; 0 leaves them as they are). The
    /// shipper runs beside the app it ships, often on the same cores: a positive value
    /// lets the app's threads take a core back the moment they wake, so that shipping
    /// costs the app's commits as little as possible. When the app keeps every core busy
    /// a nice shipper falls behind, which the lag in its status shows.
    pub nice: i32,
    /// Time for every deadline, interval and stamp of the shipper.
    pub clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for ShipperConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShipperConfig")
            .field("dir", &self.dir)
            .field("names", &self.names)
            .field("peer", &self.peer)
            .field("token", &self.token.as_ref().map(|_| "(set)"))
            .field("epoch", &self.epoch)
            .field("workers", &self.workers)
            .field("wal_max_bytes", &self.wal_max_bytes)
            .field("fold_min_frames", &self.fold_min_frames)
            .field("nice", &self.nice)
            .finish_non_exhaustive()
    }
}

impl ShipperConfig {
    pub fn new(dir: impl Into<PathBuf>, peer: impl Into<String>) -> Self {
        ShipperConfig {
            dir: dir.into(),
            names: Vec::new(),
            peer: peer.into(),
            token: None,
            epoch: None,
            workers: 2,
            wal_max_bytes: WAL_MAX_BYTES,
            fold_min_frames: FOLD_MIN_FRAMES,
            nice: NICE,
            clock: Arc::new(SystemClock),
        }
    }
}

impl ShipperConfig {
    /// Check every setting once, before anything starts; an error names the setting as
    /// this struct spells it.
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.workers == 0 || self.workers > 64 {
            return Err(ConfigError::new(
                "workers",
                self.workers,
                "must be between 1 and 64",
            ));
        }
        if !(0..=19).contains(&self.nice) {
            return Err(ConfigError::new(
                "nice",
                self.nice,
                "must be between 0 and 19",
            ));
        }
        if self.fold_min_frames == 0 {
            return Err(ConfigError::new("fold_min_frames", 0, "must be at least 1"));
        }
        // The cap must leave room to reach the fold threshold twice over (at 4 KiB pages),
        // or every burst would end in a base.
        let min_cap = self.fold_min_frames as u64 * (4096 + 24) * 2;
        if self.wal_max_bytes < min_cap {
            return Err(ConfigError::new(
                "wal_max_bytes",
                self.wal_max_bytes,
                format!(
                    "is too small for fold_min_frames {}: it must be at least {min_cap} \
                     (twice the fold threshold at 4 KiB pages), or every burst of writes would end in a base",
                    self.fold_min_frames
                ),
            ));
        }
        for n in &self.names {
            crate::names::validate(n)
                .map_err(|e| ConfigError::new("names", format!("{n:?}"), e.problem.to_string()))?;
        }
        let meta = std::fs::metadata(&self.dir).map_err(|e| {
            ConfigError::new("dir", self.dir.display(), format!("cannot be used: {e}"))
        })?;
        if !meta.is_dir() {
            return Err(ConfigError::new(
                "dir",
                self.dir.display(),
                "is not a directory",
            ));
        }
        Ok(())
    }
}

/// A running shipper. Dropping it shuts it down cleanly.
pub struct Shipper {
    inner: Arc<Inner>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

struct Inner {
    config: ShipperConfig,
    client: Client,
    started: Instant,
    _lock: DirLock,
    sched: Mutex<Sched>,
    cv: Condvar,
    dbs: Mutex<BTreeMap<String, Arc<Entry>>>,
    stop: AtomicBool,
    folder: Arc<fold::Folder>,
    /// When the directory was last scanned for new databases.
    discovered: Mutex<Instant>,
}

struct Entry {
    track: Mutex<Option<Track>>,
    /// When `snapshot` was last rebuilt.
    refreshed: Mutex<Instant>,
    snapshot: Mutex<DbStatus>,
    progress: Arc<BaseProgress>,
    /// Set by an app's commit hook, cleared when a step begins: while set, a step that
    /// will see the commit is already scheduled, so later commits skip the scheduler (its
    /// lock, on the app's commit path, was contended by the workers on most commits).
    woken: Arc<AtomicBool>,
    /// Set by an app's commit hook, cleared by the watcher when it reads a WAL write of
    /// this database (see `HOOKED_COALESCE`).
    hooked: Arc<AtomicBool>,
    /// What the database's track shares with the folder; also reached by the commit hook
    /// (see `FoldState::on_commit`).
    fold_state: Arc<FoldState>,
    _wake: crate::sqlite::Registration,
}

#[derive(Default)]
struct Sched {
    ready: VecDeque<String>,
    slots: HashMap<String, Slot>,
}

#[derive(Default)]
struct Slot {
    queued: bool,
    running: bool,
    again: bool,
    due: Option<Instant>,
    parked: bool,
    /// When the last step began (see `PACE`).
    began: Option<Instant>,
}

impl Slot {
    /// When a woken database may step again: at once, or `PACE` after its last step.
    fn paced(&self, now: Instant) -> Option<Instant> {
        self.began.map(|b| b + PACE).filter(|&at| at > now)
    }

    /// Step again as soon as the pace allows: true to queue now, or false with `due` set.
    fn pace(&mut self, now: Instant) -> bool {
        match self.paced(now) {
            Some(at) => {
                self.due = Some(at);
                false
            }
            None => true,
        }
    }
}

impl Shipper {
    /// Check the configuration, lock the directory and start shipping.
    pub fn start(config: ShipperConfig) -> Result<Shipper, StartError> {
        crate::sqlite::check_library()?;
        let client = Client::new(&config.peer, config.token.clone())?;
        config.check()?;
        let state_dir = config.dir.join(".ferry-ship");
        std::fs::create_dir_all(&state_dir).map_err(|source| StartError::StateDir {
            path: state_dir.clone(),
            source,
        })?;
        let dir_lock = DirLock::try_acquire(&state_dir.join("lock"), "another ferry shipper")?;
        let config_nice = config.nice;
        let now = config.clock.now();
        let inner = Arc::new(Inner {
            config,
            client,
            started: now,
            _lock: dir_lock,
            sched: Mutex::new(Sched::default()),
            cv: Condvar::new(),
            dbs: Mutex::new(BTreeMap::new()),
            stop: AtomicBool::new(false),
            folder: fold::Folder::start(config_nice),
            discovered: Mutex::new(now),
        });
        // Watch before the first scan of the directory, so that a database created in
        // between is seen by one or the other.
        let watcher = Watcher::new(&inner.config.dir);
        inner.discover();
        let mut threads = Vec::new();
        for i in 0..inner.config.workers {
            let w = inner.clone();
            threads.push(spawn(&format!("ferry-ship-{i}"), config_nice, move || {
                w.work()
            }));
        }
        let weak = Arc::downgrade(&inner);
        threads.push(spawn("ferry-ship-watch", config_nice, move || {
            watcher.run(weak)
        }));
        Ok(Shipper {
            inner,
            threads: Mutex::new(threads),
        })
    }

    /// Look at `name` soon (cheap; call after commits if not using `prepare_connection`).
    pub fn wake(&self, name: &str) {
        self.inner.wake(name);
    }

    pub fn status(&self) -> ShipperStatus {
        self.inner.status()
    }

    /// Prometheus text.
    pub fn metrics(&self) -> String {
        metrics(&self.status())
    }

    /// Stop: workers finish their current step, state is saved. Idempotent.
    pub fn shutdown(&self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        self.inner.cv.notify_all();
        // Wake the watcher out of its blocking read.
        let poke = self.inner.config.dir.join(".ferry-ship").join("stop");
        let _ = std::fs::write(&poke, b"");
        let _ = std::fs::remove_file(&poke);
        let threads: Vec<_> = std::mem::take(&mut *lock(&self.threads));
        for t in threads {
            let _ = t.join();
        }
        self.inner.folder.shutdown();
        let entries: Vec<_> = lock(&self.inner.dbs).values().cloned().collect();
        for e in entries {
            if let Some(t) = lock(&e.track).as_mut()
                && let Err(err) = t.save()
            {
                tracing::warn!(db = %t.name, "saving state at shutdown: {err}");
            }
        }
    }
}

impl Drop for Shipper {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn spawn(name: &str, nice: i32, f: impl FnOnce() + Send + 'static) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            nice::lower_thread_priority(nice);
            f()
        })
        .expect("spawning a thread only fails when the process is out of resources")
}

impl Inner {
    fn now(&self) -> Instant {
        self.config.clock.now()
    }

    /// Track the configured names, or every `*.db` in the directory.
    fn discover(self: &Arc<Self>) {
        let names: Vec<String> = if self.config.names.is_empty() {
            std::fs::read_dir(&self.config.dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
                .filter_map(|e| crate::names::from_file_name(&e.file_name()))
                .collect()
        } else {
            self.config.names.clone()
        };
        for n in names {
            self.track(&n);
        }
    }

    fn track(self: &Arc<Self>, name: &str) {
        // Called for every write to a main file (a fold's): answer from memory first, and
        // never stat the file in a way that touches its timestamps (see `crate::quiet`).
        if self.is_tracked(name) {
            return;
        }
        let path = self.config.dir.join(format!("{name}.db"));
        if crate::quiet::stat(&path).is_err() {
            return;
        }
        {
            let mut dbs = lock(&self.dbs);
            if dbs.contains_key(name) {
                return;
            }
            let weak: Weak<Inner> = Arc::downgrade(self);
            let n = name.to_string();
            let woken = Arc::new(AtomicBool::new(false));
            let hooked = Arc::new(AtomicBool::new(false));
            let fold_state = Arc::new(FoldState::default());
            let flag = woken.clone();
            let hook = hooked.clone();
            let folds = fold_state.clone();
            let wake = crate::sqlite::register_waker(
                &path,
                Arc::new(move || {
                    hook.store(true, Ordering::Relaxed);
                    // SeqCst pairs with the clear in `run`: a commit that finds the flag
                    // set happened before that clear, so before the step reads the WAL.
                    if !flag.swap(true, Ordering::SeqCst)
                        && let Some(i) = weak.upgrade()
                    {
                        i.wake(&n);
                    }
                    // After the wake, so that shipping this commit never waits for a
                    // fold's locked half run here.
                    folds.on_commit();
                }),
            );
            dbs.insert(
                name.to_string(),
                Arc::new(Entry {
                    track: Mutex::new(None),
                    refreshed: Mutex::new(self.now()),
                    snapshot: Mutex::new(DbStatus {
                        name: name.to_string(),
                        state: "starting".into(),
                        ..DbStatus::default()
                    }),
                    progress: Arc::new(BaseProgress::default()),
                    woken,
                    hooked,
                    fold_state,
                    _wake: wake,
                }),
            );
        }
        tracing::info!(db = name, "tracking");
        let mut s = lock(&self.sched);
        s.slots.entry(name.to_string()).or_default().parked = false;
        drop(s);
        self.wake(name);
    }

    fn is_tracked(&self, name: &str) -> bool {
        lock(&self.dbs).contains_key(name)
    }

    fn tracked(&self) -> Vec<String> {
        lock(&self.dbs).keys().cloned().collect()
    }

    /// Whether an app's commit hook fired for `name` since the last time this was asked.
    fn hooked_since(&self, name: &str) -> bool {
        lock(&self.dbs)
            .get(name)
            .is_some_and(|e| e.hooked.swap(false, Ordering::Relaxed))
    }

    fn wake(&self, name: &str) {
        let mut s = lock(&self.sched);
        let Some(slot) = s.slots.get_mut(name) else {
            return;
        };
        if slot.parked {
            return;
        }
        if slot.running {
            slot.again = true;
        } else if !slot.queued {
            if let Some(at) = slot.paced(self.now()) {
                // Under a stream of commits the slot is usually due already, and a worker
                // waits for that time: only an earlier time needs one woken (a wake-up
                // here is a syscall on the app's commit path, and the woken thread
                // often takes the app's core right then).
                if slot.due.is_some_and(|d| d <= at) {
                    return;
                }
                slot.due = Some(at);
            } else {
                slot.queued = true;
                slot.due = None;
                s.ready.push_back(name.to_string());
            }
            self.cv.notify_one();
        }
    }

    fn work(self: Arc<Self>) {
        while let Some(name) = self.next_job() {
            self.rediscover_if_due();
            let next = self.run(&name);
            let now = self.now();
            let mut s = lock(&self.sched);
            let slot = s.slots.entry(name.clone()).or_default();
            slot.running = false;
            let requeue = match next {
                Next::Again => true,
                // A batch went out, or a commit came in during the step: again, paced.
                Next::Sent => slot.pace(now),
                Next::Idle if slot.again => slot.pace(now),
                Next::Idle => {
                    slot.due = Some(now + POLL);
                    false
                }
                Next::After(d) => {
                    slot.due = Some(now + d);
                    false
                }
                Next::Gone | Next::Fenced => {
                    slot.parked = true;
                    slot.due = None;
                    false
                }
            };
            slot.again = false;
            if requeue {
                slot.queued = true;
                slot.due = None;
                s.ready.push_back(name.clone());
                self.cv.notify_one();
            }
            drop(s);
            if next == Next::Gone {
                self.untrack(&name);
            }
        }
    }

    /// The backstop for missed inotify events: rescan the directory every `RESCAN`.
    fn rediscover_if_due(self: &Arc<Self>) {
        let due = {
            let mut at = lock(&self.discovered);
            let now = self.now();
            let due = now.saturating_duration_since(*at) >= RESCAN;
            if due {
                *at = now;
            }
            due
        };
        if due {
            self.discover();
        }
    }

    /// Wait for a database to step; None when stopping.
    fn next_job(&self) -> Option<String> {
        let mut s = lock(&self.sched);
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return None;
            }
            let now = self.now();
            let mut due_names = Vec::new();
            let mut earliest: Option<Instant> = None;
            for (n, slot) in &s.slots {
                if let Some(d) = slot.due {
                    if d <= now && !slot.queued && !slot.running && !slot.parked {
                        due_names.push(n.clone());
                    } else if !slot.parked {
                        earliest = Some(earliest.map_or(d, |e: Instant| e.min(d)));
                    }
                }
            }
            for n in due_names {
                let slot = s.slots.get_mut(&n).expect("listed above");
                slot.queued = true;
                slot.due = None;
                s.ready.push_back(n);
            }
            if let Some(name) = s.ready.pop_front() {
                let slot = s.slots.entry(name.clone()).or_default();
                slot.queued = false;
                slot.running = true;
                slot.began = Some(now);
                return Some(name);
            }
            let wait = earliest
                .map_or(POLL, |e| e.saturating_duration_since(now))
                .max(Duration::from_micros(100));
            s = ferry_core::sync::wait_timeout(&self.cv, s, wait);
        }
    }

    /// One step of `name`, opening it first if needed.
    fn run(&self, name: &str) -> Next {
        let Some(entry) = lock(&self.dbs).get(name).cloned() else {
            return Next::Gone;
        };
        let mut guard = lock(&entry.track);
        if guard.is_none() {
            let cfg = TrackConfig {
                wal_max_bytes: self.config.wal_max_bytes,
                fold_min_frames: self.config.fold_min_frames,
                epoch: self.config.epoch,
                clock: self.config.clock.clone(),
            };
            match Track::open(
                &self.config.dir,
                name,
                cfg,
                entry.progress.clone(),
                self.folder.clone(),
                entry.fold_state.clone(),
            ) {
                Ok(t) => *guard = Some(t),
                Err(e) => {
                    if !self.config.dir.join(format!("{name}.db")).exists() {
                        return Next::Gone;
                    }
                    let mut snap = lock(&entry.snapshot);
                    snap.state = "error".into();
                    snap.failures += 1;
                    let msg = format!("cannot open {name}.db for shipping: {e}");
                    if snap.last_error.as_deref() != Some(&msg) {
                        tracing::error!(db = name, "{msg}");
                    }
                    snap.last_error = Some(msg);
                    return Next::After(Duration::from_secs(1));
                }
            }
        }
        let track = guard.as_mut().expect("opened above");
        entry.woken.store(false, Ordering::SeqCst);
        let next = track.step(&self.client);
        // The status snapshot is rebuilt when the database settles, and otherwise at most
        // every SNAPSHOT_INTERVAL: building it per step (per commit, under load) cost as
        // much as the step. A step that sent a batch has not settled: another follows.
        let mut refreshed = lock(&entry.refreshed);
        let now = self.now();
        let settled = !matches!(next, Next::Again | Next::Sent);
        if settled || now.saturating_duration_since(*refreshed) >= SNAPSHOT_INTERVAL {
            *refreshed = now;
            let mut status = track.status();
            if next == Next::Gone {
                status.state = "gone".into();
                let _ = track.save();
            }
            *lock(&entry.snapshot) = status;
        }
        next
    }

    fn untrack(&self, name: &str) {
        tracing::info!(
            db = name,
            "the database file is gone; no longer tracking it"
        );
        lock(&self.dbs).remove(name);
        lock(&self.sched).slots.remove(name);
    }

    fn status(&self) -> ShipperStatus {
        let entries: Vec<_> = lock(&self.dbs).values().cloned().collect();
        ShipperStatus {
            dir: self.config.dir.display().to_string(),
            peer: self.client.peer().to_string(),
            uptime_secs: self.now().saturating_duration_since(self.started).as_secs(),
            databases: entries
                .iter()
                .map(|e| {
                    let mut s = lock(&e.snapshot).clone();
                    s.base_progress = e.progress.get();
                    if s.base_progress.is_some() {
                        s.state = "sending base".into();
                    }
                    s
                })
                .collect(),
        }
    }
}

/// inotify on the shipper directory; None when unavailable (the backstop poll and the
/// periodic rescan then do its job, more slowly).
struct Watcher(Option<inotify::Inotify>);

impl Watcher {
    fn new(dir: &Path) -> Watcher {
        use inotify::{Inotify, WatchMask};
        let ino = match Inotify::init() {
            Ok(i) => i,
            Err(e) => {
                tracing::warn!(
                    "inotify unavailable ({e}); noticing commits by polling every {POLL:?}"
                );
                return Watcher(None);
            }
        };
        let mask = WatchMask::MODIFY
            | WatchMask::CREATE
            | WatchMask::MOVED_TO
            | WatchMask::DELETE
            | WatchMask::MOVED_FROM;
        if let Err(e) = ino.watches().add(dir, mask) {
            tracing::warn!(
                "cannot watch {} ({e}); noticing commits by polling every {POLL:?}",
                dir.display()
            );
            return Watcher(None);
        }
        let _ = ino
            .watches()
            .add(dir.join(".ferry-ship"), WatchMask::CREATE);
        Watcher(Some(ino))
    }

    /// Turn events into wake-ups until the shipper stops.
    fn run(self, inner: Weak<Inner>) {
        let Some(mut ino) = self.0 else {
            return rescan_loop(inner);
        };
        let all = match inner.upgrade() {
            Some(i) => i.config.names.is_empty(),
            None => return,
        };
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let events = match ino.read_events_blocking(&mut buf) {
                Ok(ev) => ev,
                Err(e) => {
                    tracing::warn!("inotify read failed ({e}); polling instead");
                    return rescan_loop(inner);
                }
            };
            let Some(i) = inner.upgrade() else { return };
            if i.stop.load(Ordering::SeqCst) {
                return;
            }
            let (mut saw_write, mut all_hooked) = (false, true);
            for ev in events {
                if ev.mask.contains(inotify::EventMask::Q_OVERFLOW) {
                    // Events were dropped: any database may have commits unnoticed.
                    for db in i.tracked() {
                        i.wake(&db);
                    }
                    all_hooked = false;
                    continue;
                }
                let Some(file) = ev.name.and_then(|n| n.to_str()) else {
                    continue;
                };
                let db = file.strip_suffix("-wal").unwrap_or(file);
                let Some(db) = crate::names::from_file_name(db.as_ref()) else {
                    continue;
                };
                // A write to a WAL is the common event and only wakes; anything else may
                // be a database appearing (or the WAL of one not tracked yet).
                let is_write =
                    ev.mask.contains(inotify::EventMask::MODIFY) && file.ends_with("-wal");
                if (!is_write || !i.is_tracked(&db)) && (all || i.config.names.contains(&db)) {
                    i.track(&db);
                }
                // Woken whatever the hook did: the write read here may be another
                // process's, merged with the app's into one event.
                i.wake(&db);
                saw_write |= is_write;
                all_hooked &= is_write && i.hooked_since(&db);
            }
            drop(i);
            // SQLite writes a transaction's frames with one write each, and every write is
            // an event. Pausing a moment lets the kernel merge the rest of a transaction's
            // events into one read, instead of waking this thread (and taking the
            // scheduler's lock) once per frame.
            std::thread::sleep(if saw_write && all_hooked {
                HOOKED_COALESCE
            } else {
                WATCH_COALESCE
            });
        }
    }
}

fn rescan_loop(inner: Weak<Inner>) {
    loop {
        std::thread::sleep(RESCAN);
        let Some(i) = inner.upgrade() else { return };
        if i.stop.load(Ordering::SeqCst) {
            return;
        }
        i.discover();
    }
}
