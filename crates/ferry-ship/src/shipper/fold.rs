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
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long the locked half waits for an app's write transaction before giving up.
const BARRIER_WAIT: Duration = Duration::from_millis(200);
/// Between attempts at the write lock. SQLite's own busy handler sleeps 1 ms, then 2, 5,
/// 10…: against a writer that commits back to back it almost never lands in the
/// microseconds between two transactions, and the fold never resets the WAL. Retrying
/// every 50 µs lands there within a few milliseconds.
const BARRIER_RETRY: Duration = Duration::from_micros(50);

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
}

impl FoldState {
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
    let mut conns: HashMap<PathBuf, Conns> = HashMap::new();
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

fn fold(conns: &mut HashMap<PathBuf, Conns>, job: &Job) -> Result<(i64, i64, i64), FoldError> {
    let ino = crate::quiet::stat(&job.path)?.ino;
    if ino != job.ino {
        return Ok((1, -1, -1));
    }
    if conns.get(&job.path).is_none_or(|c| c.ino != ino) {
        let main = crate::sqlite::open_primary(&job.path)?;
        let barrier = crate::sqlite::open_primary(&job.path)?;
        barrier.busy_handler(Some(barrier_busy))?;
        // (A fold gives up sooner than a base: it is only worth a short wait.)
        conns.insert(job.path.clone(), Conns { ino, main, barrier });
    }
    let c = conns.get(&job.path).expect("inserted above");
    let in_cycle = || -> std::io::Result<bool> {
        let Some(salts) = job.salts else {
            return Ok(true);
        };
        let Ok(f) = crate::quiet::open(&job.wal) else {
            return Ok(false);
        };
        Ok(wal::read_header(&f)?
            .and_then(|h| h.ok())
            .is_some_and(|h| h.salts == salts))
    };
    let passive = |conn: &Connection| -> rusqlite::Result<(i64, i64, i64)> {
        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
    };
    let header_salts = || -> Option<Salts> {
        let f = crate::quiet::open(&job.wal).ok()?;
        wal::read_header(&f).ok()??.ok().map(|h| h.salts)
    };
    // What a checkpoint copied up to is published (it reports the index's end as it
    // began), and it is of the cycle the WAL header named before and after it: the index
    // names another cycle than the header only while that cycle has no frame published
    // (a writer writes the header before its frames, and publishes after), so a
    // checkpoint of a cycle the header did not name yet reports 0.
    let note = |before: Option<Salts>, log: i64| {
        if log < 0 {
            // Not in WAL mode (or busy before it read the index): nothing to note.
            return;
        }
        if let Some(end) = crate::sqlite::wal_index_end(&c.main) {
            job.state.note(end);
        }
        if let (Some(salts), Ok(frame)) = (before, u32::try_from(log))
            && header_salts() == Some(salts)
        {
            job.state.note(crate::sqlite::WalIndexEnd { salts, frame });
        }
    };
    if !in_cycle()? {
        return Ok((1, -1, -1));
    }
    let before = header_salts();
    let first = passive(&c.main)?;
    note(before, first.1);
    if c.barrier.execute_batch("BEGIN IMMEDIATE").is_err() {
        return Ok(first);
    }
    let second = match in_cycle() {
        Ok(true) => {
            let before = header_salts();
            let second = passive(&c.main);
            if let Ok((_, log, _)) = second {
                note(before, log);
            }
            second.map_err(Into::into)
        }
        Ok(false) => Ok(first),
        Err(e) => Err(FoldError::Io(e)),
    };
    let _ = c.barrier.execute_batch("ROLLBACK");
    second
}
