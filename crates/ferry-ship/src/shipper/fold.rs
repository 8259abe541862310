//! The folder: one thread per shipper that runs checkpoints (docs/ship.md §3.5) on
//! connections of its own, so that copying megabytes into the main file and syncing it
//! never holds up shipping.
//!
//! A fold of one database:
//! 1. If the job names a cycle, check the WAL header still names it.
//! 2. PASSIVE checkpoint, no lock held: copies the bulk while the app keeps writing.
//! 3. `BEGIN IMMEDIATE` on the barrier connection (waiting at most `BARRIER_WAIT`), check
//!    the cycle again, PASSIVE again: every frame is copied when the lock is released,
//!    so the next writer starts on a fully copied WAL and resets it.
//! 4. `ROLLBACK`.
//!
//! Steps 3 and 4 need the write lock between two of the app's transactions. When the
//! app commits through a prepared connection in this process, they are handed to its
//! next commit hook ([`FoldState::on_commit`]), which runs them on the app's thread just
//! after a commit, when no transaction of its own holds the lock (as SQLite's own
//! autocheckpoint does, there). Otherwise, or if no commit comes within `HANDOFF_WAIT`,
//! the folder thread takes the lock itself, retrying every `BARRIER_RETRY`: on a core it
//! shares with the app it only gets the lock when the app is preempted between two
//! transactions, and it spent more CPU waking up to try than on everything else it does.
//!
//! Nothing is persisted here and nothing depends on the outcome: the shipper proves every
//! reset it sees (§3.3 rule 4), whoever caused it. A crash mid-fold leaves a partly
//! copied WAL, which SQLite handles like any interrupted checkpoint.

use super::proof::PublishedEnds;
use crate::wal::{self, Salts};
use ferry_core::sync::lock;
use rusqlite::Connection;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long the locked half waits for an app's write transaction before giving up.
const BARRIER_WAIT: Duration = Duration::from_millis(200);
/// Between attempts at the write lock. SQLite's own busy handler sleeps 1 ms, then 2, 5,
/// 10…: against a writer that commits back to back it almost never lands in the
/// microseconds between two transactions, and the fold never resets the WAL. Retrying
/// every 50 µs lands there within a few milliseconds.
const BARRIER_RETRY: Duration = Duration::from_micros(50);

/// How long the folder waits for an app's commit hook to run the locked half before
/// running it itself: commits that call the hook come every millisecond or so under load,
/// and an app that stopped writing leaves the lock free.
const HANDOFF_WAIT: Duration = Duration::from_millis(50);

/// Busy handler of the barrier connection: retry every `BARRIER_RETRY` up to
/// `BARRIER_WAIT`.
fn barrier_busy(attempts: i32) -> bool {
    if (attempts as u128) * BARRIER_RETRY.as_micros() >= BARRIER_WAIT.as_micros() {
        return false;
    }
    std::thread::sleep(BARRIER_RETRY);
    true
}
/// Fold requests waiting; one per database is ever outstanding, so this only bounds a
/// burst across many databases. A full queue drops the request: the database asks again
/// at its next step.
const QUEUE: usize = 256;

/// What a database shares with the folder about its folds.
#[derive(Debug, Default)]
pub struct FoldState {
    /// A fold is queued or running.
    pub busy: AtomicBool,
    /// Folds that copied every frame.
    pub complete: AtomicU64,
    /// Set by `Folder::forget`, cleared once the folder has dropped its connections.
    pub forget: AtomicBool,
    /// How far SQLite had published the last few WAL cycles, as the folder's checkpoints
    /// saw them. A WAL resets only after a checkpoint copied all of a cycle, here the
    /// folder's (a prepared app never checkpoints): so the end of a cycle that reset is
    /// here, though the wal-index names the new cycle by the time the shipper looks. Without
    /// it, the old cycle's last commits, published after the shipper's last look, could not
    /// be told from a commit nobody published (docs/ship.md §3.2). At most
    /// `PUBLISHED_CYCLES_MAX` cycles, the newest.
    published: Mutex<PublishedEnds>,
    /// An app's commit hook ran since the folder last looked: a fold's locked half can be
    /// handed to the next one.
    hooked: AtomicBool,
    /// Locked halves an app's commit hook ran.
    pub in_hook: AtomicU64,
    /// A locked half waits in `handoff` for a commit hook.
    wanted: AtomicBool,
    handoff: Mutex<Option<Handoff>>,
    /// Signalled when a commit hook ran the locked half.
    handed: Condvar,
}

/// What `PRAGMA wal_checkpoint` answers: busy (1 if it could not run), frames in the WAL,
/// frames copied.
type Checkpoint = (i64, i64, i64);
/// The locked half's outcome: None when it did not checkpoint (no lock, or the cycle
/// changed), and the first half's outcome stands.
type Locked = Result<Option<Checkpoint>, FoldError>;

/// A fold's locked half, waiting for an app's commit hook.
#[derive(Debug)]
struct Handoff {
    conns: Arc<Mutex<Conns>>,
    wal: PathBuf,
    salts: Option<Salts>,
    /// Set by the hook that ran it.
    outcome: Option<Locked>,
}

impl FoldState {
    /// Called by an app's commit hook after each commit to this database, on the app's
    /// thread, with no transaction of the app's holding the write lock: runs a fold's
    /// locked half if one waits and the lock is free (otherwise a later commit tries). It
    /// never waits: not for the write lock (one try), nor for another thread running it.
    pub fn on_commit(&self) {
        self.hooked.store(true, Ordering::Relaxed);
        if !self.wanted.load(Ordering::Relaxed) {
            return;
        }
        // Another of the app's threads running it already: not wait for it inside a commit.
        let Ok(mut handoff) = self.handoff.try_lock() else {
            return;
        };
        let Some(h) = handoff.as_mut().filter(|h| h.outcome.is_none()) else {
            return;
        };
        let c = lock(&h.conns);
        if let Some(outcome) = locked_half(&c, &h.wal, h.salts, self, false) {
            drop(c);
            h.outcome = Some(outcome);
            self.in_hook.fetch_add(1, Ordering::Relaxed);
            self.wanted.store(false, Ordering::Relaxed);
            self.handed.notify_one();
        }
    }

    /// The furthest the folder saw SQLite publish of the cycle `salts`.
    pub fn published(&self, salts: Salts) -> Option<u32> {
        lock(&self.published).get(salts)
    }

    fn note(&self, end: crate::sqlite::WalIndexEnd) {
        lock(&self.published).note(end);
    }
}

/// What the folder thread is asked to do.
enum Message {
    Fold(Job),
    /// Drop the connections to this path (see `Folder::forget`).
    Forget(PathBuf, Arc<FoldState>),
}

struct Job {
    path: PathBuf,
    /// The inode the shipper tracks at `path`: a file renamed over it since is left alone
    /// until the shipper has looked at it (its old `-wal` may still be beside it).
    ino: u64,
    wal: PathBuf,
    salts: Option<Salts>,
    state: Arc<FoldState>,
}

/// The folder thread's handle.
pub struct Folder {
    tx: Mutex<Option<SyncSender<Message>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Folder {
    /// Start the folder thread at niceness `nice` (see `ShipperConfig::nice`).
    pub fn start(nice: i32) -> Arc<Folder> {
        let (tx, rx) = sync_channel(QUEUE);
        let thread = std::thread::Builder::new()
            .name("ferry-ship-fold".into())
            .spawn(move || {
                super::nice::lower_thread_priority(nice);
                run(rx)
            })
            .expect("spawning a thread only fails when the process is out of resources");
        Arc::new(Folder {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Ask for a fold of the database at `path`; false if one is already outstanding or
    /// the queue is full. `salts`: only copy while the WAL is still in this cycle.
    pub fn request(
        &self,
        path: &Path,
        ino: u64,
        salts: Option<Salts>,
        state: &Arc<FoldState>,
    ) -> bool {
        if state.busy.swap(true, Ordering::SeqCst) {
            return false;
        }
        let sent = self.send(Message::Fold(Job {
            path: path.to_path_buf(),
            ino,
            wal: crate::names::sidecar(path, "-wal"),
            salts,
            state: state.clone(),
        }));
        if !sent {
            state.busy.store(false, Ordering::SeqCst);
        }
        sent
    }

    /// Drop the folder's connections to `path` (a step failed inside SQLite: see
    /// `Track::failed`). SQLite shares one wal-index mapping among all of a process's
    /// connections to a file, so new connections of the shipper's own see the files as
    /// they are now only once the folder's are gone too: `state.forget` stays set until
    /// they are.
    pub fn forget(&self, path: &Path, state: &Arc<FoldState>) {
        if state.forget.swap(true, Ordering::SeqCst) {
            return;
        }
        if !self.send(Message::Forget(path.to_path_buf(), state.clone())) {
            // A full queue (or a folder stopping): the next call asks again.
            state.forget.store(false, Ordering::SeqCst);
        }
    }

    /// Queue a message; false if the queue is full or the folder is stopping.
    fn send(&self, message: Message) -> bool {
        match lock(&self.tx).as_ref() {
            Some(tx) => tx.try_send(message).is_ok(),
            None => false,
        }
    }

    /// Stop after the fold in progress.
    pub fn shutdown(&self) {
        lock(&self.tx).take();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

/// Connections the folder keeps per database file (by inode: a replaced file gets new ones).
#[derive(Debug)]
struct Conns {
    ino: u64,
    main: Connection,
    barrier: Connection,
}

/// A fold that failed. Nothing depends on a fold's outcome (the shipper proves every
/// reset it sees), so it is only logged; the folder drops its connections to the file and
/// the database asks again at a later step.
#[derive(Debug, thiserror::Error)]
enum FoldError {
    #[error("SQLite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

fn run(rx: Receiver<Message>) {
    let mut conns: HashMap<PathBuf, Arc<Mutex<Conns>>> = HashMap::new();
    while let Ok(message) = rx.recv() {
        let job = match message {
            Message::Fold(job) => job,
            Message::Forget(path, state) => {
                conns.remove(&path);
                state.forget.store(false, Ordering::SeqCst);
                continue;
            }
        };
        let outcome = fold(&mut conns, &job).map_err(|e| e.to_string());
        if let Err(e) = &outcome {
            tracing::debug!(db = %job.path.display(), "fold failed: {e}");
            conns.remove(&job.path);
        }
        if matches!(outcome, Ok((0, log, done)) if log == done && log >= 0) {
            job.state.complete.fetch_add(1, Ordering::Relaxed);
        }
        if let Ok((busy, log, done)) = outcome {
            tracing::debug!(db = %job.path.display(), busy, log, done, "folded");
        }
        job.state.busy.store(false, Ordering::SeqCst);
    }
}

fn fold(
    conns: &mut HashMap<PathBuf, Arc<Mutex<Conns>>>,
    job: &Job,
) -> Result<Checkpoint, FoldError> {
    let ino = crate::quiet::stat(&job.path)?.ino;
    if ino != job.ino {
        return Ok((1, -1, -1));
    }
    if conns.get(&job.path).is_none_or(|c| lock(c).ino != ino) {
        let main = crate::sqlite::open_primary(&job.path)?;
        let barrier = crate::sqlite::open_primary(&job.path)?;
        barrier.busy_handler(Some(barrier_busy))?;
        // (A fold gives up sooner than a base: it is only worth a short wait.)
        conns.insert(
            job.path.clone(),
            Arc::new(Mutex::new(Conns { ino, main, barrier })),
        );
    }
    let shared = conns.get(&job.path).expect("inserted above").clone();
    let first = {
        let c = lock(&shared);
        if !in_cycle(&job.wal, job.salts)? {
            return Ok((1, -1, -1));
        }
        let before = header_salts(&job.wal);
        let first = passive(&c.main)?;
        note(&c, &job.wal, &job.state, before, first.1);
        first
    };
    let state = &job.state;
    if state.hooked.swap(false, Ordering::Relaxed) {
        *lock(&state.handoff) = Some(Handoff {
            conns: shared.clone(),
            wal: job.wal.clone(),
            salts: job.salts,
            outcome: None,
        });
        state.wanted.store(true, Ordering::Relaxed);
        let deadline = std::time::Instant::now() + HANDOFF_WAIT;
        let mut handoff = lock(&state.handoff);
        while handoff.as_ref().is_some_and(|h| h.outcome.is_none()) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            handoff = ferry_core::sync::wait_timeout(&state.handed, handoff, left);
        }
        state.wanted.store(false, Ordering::Relaxed);
        if let Some(outcome) = handoff.take().and_then(|h| h.outcome) {
            return outcome.map(|second| second.unwrap_or(first));
        }
    }
    let c = lock(&shared);
    locked_half(&c, &job.wal, job.salts, state, true)
        .expect("waiting for the lock always gives an outcome")
        .map(|second| second.unwrap_or(first))
}

/// Steps 3 and 4: take the write lock on the barrier connection (`wait`: with its busy
/// handler, else one try), check the cycle, PASSIVE again, release. None if the lock was
/// held and `wait` was false.
fn locked_half(
    c: &Conns,
    wal: &Path,
    salts: Option<Salts>,
    state: &FoldState,
    wait: bool,
) -> Option<Locked> {
    if !wait && c.barrier.busy_handler(None).is_err() {
        return None;
    }
    let begun = c.barrier.execute_batch("BEGIN IMMEDIATE").is_ok();
    if !wait {
        let _ = c.barrier.busy_handler(Some(barrier_busy));
    }
    if !begun {
        return if wait { Some(Ok(None)) } else { None };
    }
    let second = match in_cycle(wal, salts) {
        Ok(true) => {
            let before = header_salts(wal);
            let second = passive(&c.main);
            if let Ok((_, log, _)) = second {
                note(c, wal, state, before, log);
            }
            second.map(Some).map_err(Into::into)
        }
        Ok(false) => Ok(None),
        Err(e) => Err(FoldError::Io(e)),
    };
    let _ = c.barrier.execute_batch("ROLLBACK");
    Some(second)
}

/// Whether the WAL header still names the cycle `salts` (any cycle if None).
fn in_cycle(wal: &Path, salts: Option<Salts>) -> std::io::Result<bool> {
    let Some(salts) = salts else {
        return Ok(true);
    };
    let Ok(f) = crate::quiet::open(wal) else {
        return Ok(false);
    };
    Ok(wal::read_header(&f)?
        .and_then(|h| h.ok())
        .is_some_and(|h| h.salts == salts))
}

fn passive(conn: &Connection) -> rusqlite::Result<Checkpoint> {
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?))
    })
}

fn header_salts(wal: &Path) -> Option<Salts> {
    let f = crate::quiet::open(wal).ok()?;
    wal::read_header(&f).ok()??.ok().map(|h| h.salts)
}

/// What a checkpoint copied up to is published (it reports the index's end as it began),
/// and it is of the cycle the WAL header named before and after it: the index names
/// another cycle than the header only while that cycle has no frame published (a writer
/// writes the header before its frames, and publishes after), so a checkpoint of a cycle
/// the header did not name yet reports 0.
fn note(c: &Conns, wal: &Path, state: &FoldState, before: Option<Salts>, log: i64) {
    if log < 0 {
        // Not in WAL mode (or busy before it read the index): nothing to note.
        return;
    }
    if let Some(end) = crate::sqlite::wal_index_end(&c.main) {
        state.note(end);
    }
    if let (Some(salts), Ok(frame)) = (before, u32::try_from(log))
        && header_salts(wal) == Some(salts)
    {
        state.note(crate::sqlite::WalIndexEnd { salts, frame });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    fn db(name: &str) -> (PathBuf, Connection) {
        let dir = std::env::temp_dir().join(format!("ferry-fold-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.db");
        let mut app = Connection::open(&path).unwrap();
        crate::sqlite::prepare_connection(&mut app).unwrap();
        app.execute_batch("CREATE TABLE t(x)").unwrap();
        (path, app)
    }

    fn salts(path: &Path) -> Salts {
        header_salts(&crate::names::sidecar(path, "-wal")).unwrap()
    }

    /// Ask for a fold of the current cycle and wait for it to end.
    fn fold_now(folder: &Folder, path: &Path, state: &Arc<FoldState>) {
        let ino = crate::quiet::stat(path).unwrap().ino;
        assert!(folder.request(path, ino, Some(salts(path)), state));
        let t = std::time::Instant::now();
        while state.busy.load(Ordering::SeqCst) {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the fold never ended"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    // An app committing back to back on one thread leaves the write lock free only
    // between its own transactions: its commit hook runs the fold's locked half there,
    // and the WAL resets at its next commit.
    #[test]
    fn an_app_committing_back_to_back_folds_in_its_own_commit_hook() {
        let (path, app) = db("hook");
        let state = Arc::new(FoldState::default());
        let s = state.clone();
        let _hook = crate::sqlite::register_waker(&path, Arc::new(move || s.on_commit()));
        let folder = Folder::start(0);
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    app.execute("INSERT INTO t VALUES (randomblob(1000))", [])
                        .unwrap();
                }
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        let before = salts(&path);
        fold_now(&folder, &path, &state);
        assert_eq!(
            state.in_hook.load(Ordering::Relaxed),
            1,
            "the hook ran the locked half"
        );
        assert_eq!(
            state.complete.load(Ordering::Relaxed),
            1,
            "every frame was copied"
        );
        let t = std::time::Instant::now();
        while salts(&path) == before {
            assert!(t.elapsed() < Duration::from_secs(5), "the WAL never reset");
            std::thread::sleep(Duration::from_millis(1));
        }
        stop.store(true, Ordering::SeqCst);
        writer.join().unwrap();
        folder.shutdown();
    }

    // With no commit to hand it to (the app stopped writing, or writes from another
    // process), the folder takes the lock itself.
    #[test]
    fn with_no_commit_the_folder_takes_the_lock_itself() {
        let (path, app) = db("idle");
        let state = Arc::new(FoldState::default());
        let s = state.clone();
        let _hook = crate::sqlite::register_waker(&path, Arc::new(move || s.on_commit()));
        let folder = Folder::start(0);
        for _ in 0..20 {
            app.execute("INSERT INTO t VALUES (randomblob(1000))", [])
                .unwrap();
        }
        // The hook ran (a commit happened) but none comes while the fold waits.
        fold_now(&folder, &path, &state);
        assert_eq!(state.in_hook.load(Ordering::Relaxed), 0);
        assert_eq!(state.complete.load(Ordering::Relaxed), 1);
        let before = salts(&path);
        app.execute("INSERT INTO t VALUES (1)", []).unwrap();
        assert_ne!(salts(&path), before, "the next commit reset the WAL");
        folder.shutdown();
    }
}
