//! The log (docs/log.md §3-§5): `Log`, the handle callers hold, and the rooms behind
//! it. From the bottom up:
//!
//! - `config`, `stats`, `trace`: the limits, checked once at open, the counters, and
//!   the writer's cycles when asked for.
//! - `batch`, `waiters`, `follow`: pure decisions under the lock appends take: what a
//!   batch covers, which waits a sync releases, how long the writer waits for its
//!   followers.
//! - `state`: what appenders, the writer and the waiters share.
//! - `scan`: reading a batch back, checked whole (for reading and recovery).
//! - `recovery`, `space`: opening (cut a torn tail, refuse damage); the newest
//!   segment's file space (zeroes ahead, segments made from spares).
//! - `writer`, `append`, `wait`, `read`, `retire`: the writer thread; appends with
//!   backpressure; durability waits; reading; retirement.
//!
//! A room imports only rooms above it in this list; this file imports them all.

mod append;
mod batch;
mod config;
mod follow;
mod read;
mod recovery;
mod retire;
mod scan;
mod space;
mod state;
mod stats;
mod trace;
mod wait;
mod waiters;
mod writer;

pub use config::Config;
pub use follow::Follower;
pub use read::Record;
pub use recovery::Recovery;
pub use stats::{Stats, WRITE_BUCKETS, WriteHistogram};
pub use trace::Cycle;

use crate::storage::{FileStorage, Storage};
use crate::{Error, Lsn};
use batch::Batches;
use ferry_core::seams::{Clock, SystemClock};
use ferry_core::sync::lock;
use space::Filled;
use state::{CacheLine, Inner, Shared};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use waiters::Waiters;
use writer::Writer;

/// See the crate docs. Cheap to share behind an `Arc`; every method takes `&self`.
pub struct Log {
    inner: Arc<Inner>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// A driven log's writer state (the writer thread keeps its own).
    writer_state: Mutex<Option<Writer>>,
    /// Held by `retire_below`: one retirement at a time.
    retiring: Mutex<()>,
}

impl Log {
    /// Open (or create) the log in `dir`, locking it against other processes.
    pub fn open_dir(dir: &Path, config: Config) -> Result<(Log, Recovery), Error> {
        let storage = FileStorage::open(dir).map_err(|e| Error::io("open its directory", e))?;
        Log::open(Arc::new(storage), config)
    }

    /// Open (or create) the log on `storage`: recover (docs/log.md §4), then start the
    /// writer.
    pub fn open(storage: Arc<dyn Storage>, config: Config) -> Result<(Log, Recovery), Error> {
        Log::open_with(storage, config, false, Arc::new(SystemClock))
    }

    /// [`Log::open`], with the writer reading the time it decides by (how long it has
    /// waited for its followers, [`Config::follow`]) from `clock`, for tests that
    /// drive it.
    pub fn open_with_clock(
        storage: Arc<dyn Storage>,
        config: Config,
        clock: Arc<dyn Clock>,
    ) -> Result<(Log, Recovery), Error> {
        Log::open_with(storage, config, false, clock)
    }

    /// [`Log::open`] without a writer thread: nothing becomes durable until the caller
    /// calls [`Log::write_pending`], and appends never wait for the disk. For a
    /// simulation on one thread, where the seed, not the scheduler, picks when the disk
    /// syncs.
    pub fn open_driven(
        storage: Arc<dyn Storage>,
        config: Config,
    ) -> Result<(Log, Recovery), Error> {
        // A driven log does not wait for followers: it has no decision that reads time.
        Log::open_with(storage, config, true, Arc::new(SystemClock))
    }

    fn open_with(
        storage: Arc<dyn Storage>,
        config: Config,
        driven: bool,
        clock: Arc<dyn Clock>,
    ) -> Result<(Log, Recovery), Error> {
        config.check()?;
        let found = recovery::recover(&*storage, config.spare_segments)?;
        let recovery = found.recovery.clone();
        tracing::info!(
            segments = recovery.segments,
            records = recovery.records,
            end = recovery.end,
            torn_bytes = recovery.torn_bytes,
            ms = recovery.elapsed.as_secs_f64() * 1e3,
            "log recovered"
        );
        let seg = *found.segments.last().expect("recovery leaves a segment");
        let inner = Arc::new(Inner {
            storage,
            config,
            log_id: found.log_id,
            shared: CacheLine(Mutex::new(Shared {
                batches: Batches::new(seg, found.recovery.end),
                segments: found.segments,
                poisoned: None,
                closing: false,
                writer_asleep: false,
                waiters: Waiters::default(),
                stats: Stats::default(),
            })),
            work: Condvar::new(),
            space: Condvar::new(),
            durable: CacheLine(AtomicU64::new(found.recovery.end)),
            driven,
            follow: Arc::default(),
            spares: Mutex::new(found.spares),
            clock,
            trace: Default::default(),
        });
        let state = Writer::new(
            Filled {
                seg,
                len: found.last_file_len,
                reused: false,
            },
            found.recovery.end,
        );
        let (writer, state) = if driven {
            (None, Some(state))
        } else {
            let w = inner.clone();
            let writer = std::thread::Builder::new()
                .name("ferry-log-writer".into())
                .spawn(move || writer::write_loop(&w, state))
                .map_err(|e| Error::io("start its writer thread", e))?;
            (Some(writer), None)
        };
        Ok((
            Log {
                inner,
                writer: Mutex::new(writer),
                writer_state: Mutex::new(state),
                retiring: Mutex::new(()),
            },
            recovery,
        ))
    }

    /// A driven log ([`Log::open_driven`]): write and sync what was appended, as the
    /// writer thread would, and wake who it covers. False if there was nothing to write
    /// (or the log refuses writes since a failure). A no-op on a log with a writer.
    pub fn write_pending(&self) -> bool {
        // A write that panicked took its batches with it: writing what follows would
        // leave a hole, so a driven log whose write panicked writes nothing more.
        let Ok(mut state) = self.writer_state.lock() else {
            return false;
        };
        let Some(state) = state.as_mut() else {
            return false;
        };
        let batches = writer::take_batches(&mut lock(&self.inner.shared));
        if batches.is_empty() {
            return false;
        }
        writer::write_and_publish(&self.inner, batches, state, trace::Marks::now());
        true
    }

    /// Append a record and return the position just past it, at once: it is durable
    /// when [`Log::durable_lsn`] reaches that position. `kind` 0 is reserved. Waits
    /// only while `pending_bytes_max` bytes are not yet written.
    #[inline]
    pub fn append(&self, kind: u8, payload: &[u8]) -> Result<Lsn, Error> {
        append::append(&self.inner, kind, payload)
    }

    /// A follower of this log: see [`Follower`].
    pub fn follower(&self) -> Follower {
        Follower {
            follow: self.inner.follow.clone(),
            woken: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Everything before this position is durable.
    pub fn durable_lsn(&self) -> Lsn {
        self.inner.durable.load(Ordering::SeqCst)
    }

    /// Where the oldest segment kept starts: reading from here reads everything kept.
    pub fn start_lsn(&self) -> Lsn {
        lock(&self.inner.shared)
            .segments
            .first()
            .copied()
            .unwrap_or(0)
    }

    /// The end of the last record appended.
    pub fn end_lsn(&self) -> Lsn {
        lock(&self.inner.shared).batches.end()
    }

    /// Block until `lsn` is durable. Not from inside an async task: use [`Log::durable`].
    #[inline]
    pub fn wait_durable(&self, lsn: Lsn) -> Result<(), Error> {
        wait::wait_durable(&self.inner, lsn)
    }

    /// Resolves when `lsn` is durable, or with the error that stopped it becoming so.
    #[inline]
    pub fn durable(
        &self,
        lsn: Lsn,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send + 'static {
        wait::durable(&self.inner, lsn, None)
    }

    /// [`Log::durable`], for `follower`: the sync that makes `lsn` durable waits for
    /// it to go idle before the writer takes the next batch.
    #[inline]
    pub fn durable_following(
        &self,
        lsn: Lsn,
        follower: &Follower,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send + 'static {
        wait::durable(&self.inner, lsn, Some(follower.woken.clone()))
    }

    /// Block until everything appended so far is durable; returns that position.
    pub fn flush(&self) -> Result<Lsn, Error> {
        let end = self.end_lsn();
        self.wait_durable(end)?;
        Ok(end)
    }

    /// Call `f` once `lsn` is durable, with `Ok`, or with the error that stopped it
    /// becoming so: on the writer's thread right after the sync (with `follower`, the
    /// writer then counts that follower as woken, as [`Log::durable_following`] does),
    /// or at once on this thread if it already is or cannot be. What a sync covers is
    /// called before the writer takes its next batch, so `f` must be short (hand
    /// something to another thread, say). Closing the log writes what was appended
    /// and calls `f` as usual; only a driven log dropped without `close` drops `f`
    /// uncalled. `f` may hold the log (it may be the last to, and drop it).
    #[inline]
    pub fn on_durable(
        &self,
        lsn: Lsn,
        follower: Option<&Follower>,
        f: impl FnOnce(Result<(), Error>) + Send + 'static,
    ) {
        wait::on_durable(&self.inner, lsn, follower.map(|f| f.woken.clone()), f)
    }

    /// Call `f` with every durable record that starts at or after `from`, in order;
    /// returns the durable position read up to. `from` below the oldest segment still
    /// kept (see [`Log::retire_below`]) is an error.
    pub fn read(&self, from: Lsn, mut f: impl FnMut(Record<'_>)) -> Result<Lsn, Error> {
        read::read(&self.inner, from, |r| {
            f(r);
            true
        })
    }

    /// [`Log::read`], stopping after the first record for which `f` answers false;
    /// returns the position read up to (the end of that record, if it stopped).
    pub fn read_while(&self, from: Lsn, f: impl FnMut(Record<'_>) -> bool) -> Result<Lsn, Error> {
        read::read(&self.inner, from, f)
    }

    /// Retire the segments that lie wholly below `lsn` (the caller keeps what they held
    /// elsewhere, e.g. in a checkpoint): they leave the log, deleted or kept as spares
    /// for later segments (docs/log.md §3). The newest segment is always kept. Returns
    /// how many were retired. A reader still reading them fails.
    pub fn retire_below(&self, lsn: Lsn) -> Result<usize, Error> {
        let durable = self.durable_lsn();
        let _one_at_a_time = lock(&self.retiring);
        retire::retire_below(&self.inner, lsn, durable)
    }

    /// Keep the writer's last `capacity` cycles from now on (0: none; those kept are
    /// forgotten), for [`Log::take_cycles`]: where a record's latency goes, for a
    /// benchmark or a profile. Off by default.
    pub fn trace_cycles(&self, capacity: usize) {
        self.inner.trace.set(capacity);
    }

    /// The cycles kept since [`Log::trace_cycles`] or the last call, oldest first.
    pub fn take_cycles(&self) -> Vec<Cycle> {
        self.inner.trace.take()
    }

    pub fn stats(&self) -> Stats {
        let s = lock(&self.inner.shared);
        Stats {
            durable: self.durable_lsn(),
            end: s.batches.end(),
            segments: s.segments.len(),
            ..s.stats
        }
    }

    /// Write and sync what was appended, then stop the writer. An error says the last
    /// records may not be durable.
    pub fn close(self) -> Result<(), Error> {
        self.write_pending();
        if self.inner.driven
            && lock(&self.inner.shared).poisoned.is_none()
            && let Ok(state) = self.writer_state.lock()
            && let Some(state) = state.as_ref()
        {
            writer::cut_reused(&self.inner, &state.filled);
        }
        self.shutdown();
        match &lock(&self.inner.shared).poisoned {
            Some(cause) => Err(Error::PreviousIo {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Stop the writer once it wrote what was appended. A driven log dropped writes
    /// nothing more (its driver decided what became durable).
    fn shutdown(&self) {
        lock(&self.inner.shared).closing = true;
        self.inner.work.notify_all();
        self.inner.space.notify_all();
        self.inner.follow.close();
        let handle = lock(&self.writer).take();
        if let Some(h) = handle {
            // Dropped by the writer itself (an `on_durable` call that held the last
            // handle): it writes what is left and ends once that call returns.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Log {
    fn drop(&mut self) {
        self.shutdown();
    }
}
