//! The log: appends, the group-commit writer, waiting for durability, reading, recovery
//! and retirement (docs/log.md §3-§5).

use crate::format::{
    self, BATCH_HEADER_BYTES, BatchBuf, BatchHeader, FRAME_HEADER_BYTES, SEGMENT_HEADER_BYTES,
    SegmentHeader, align, frame_crc, parse_segment_name, parse_spare_name, segment_name,
    spare_name,
};
use crate::storage::{FileStorage, Storage};
use crate::{Error, Lsn};
use ferry_core::sync::lock;
use std::collections::VecDeque;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Limits of a log.
#[derive(Clone, Debug)]
pub struct Config {
    /// A batch that would pass this many bytes starts a new segment. Default 64 MiB.
    pub segment_bytes: u64,
    /// The largest record payload. Default 4 MiB.
    pub record_bytes_max: u32,
    /// Appends wait while this many bytes are appended and not yet durable (the disk is
    /// slower than the code). Default 32 MiB.
    pub pending_bytes_max: u64,
    /// After a sync, how long the writer waits for the [`Follower`]s it woke to go idle
    /// before it takes the next batch: what they append in reply to the sync then rides
    /// the next sync, not the one after. Zero: never wait. Default 25 µs.
    pub follow: Duration,
    /// At most how many retired segments are kept for later segments to be made from
    /// (each takes `segment_bytes` of disk; docs/log.md §3). A retirement keeps no more
    /// spares than it retires segments: what was written between two retirements is
    /// what the next interval will likely write, so a log written fast keeps up to
    /// this many and one written slowly few. Zero keeps none. Default 16 (1 GiB at the
    /// default segment size, enough for every segment to be a reused one up to about
    /// 100 MB/s of journal retired every 10 s), at most 64.
    pub spare_segments: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            segment_bytes: 64 << 20,
            record_bytes_max: 4 << 20,
            pending_bytes_max: 32 << 20,
            follow: Duration::from_micros(25),
            spare_segments: 16,
        }
    }
}

impl Config {
    fn check(&self) -> Result<(), Error> {
        let room = SEGMENT_HEADER_BYTES + BATCH_HEADER_BYTES + FRAME_HEADER_BYTES + format::ALIGN;
        if self.segment_bytes < 1024
            || self.segment_bytes > 1 << 30
            || u64::from(self.record_bytes_max) + room > self.segment_bytes
        {
            return Err(Error::Invalid(format!(
                "segment_bytes {} must be between 1 KiB and 1 GiB and hold the largest record \
                 (record_bytes_max {}) with {room} bytes of headers",
                self.segment_bytes, self.record_bytes_max
            )));
        }
        if self.spare_segments > 64 {
            return Err(Error::Invalid(format!(
                "spare_segments {} must be at most 64",
                self.spare_segments
            )));
        }
        if self.pending_bytes_max == 0 {
            return Err(Error::Invalid(
                "pending_bytes_max must be above zero".into(),
            ));
        }
        Ok(())
    }
}

/// What opening found.
#[derive(Clone, Debug)]
pub struct Recovery {
    pub segments: usize,
    pub records: u64,
    /// Where the log ends: the next record goes here, and everything before is durable.
    pub end: Lsn,
    /// Bytes cut from a torn tail (a write the crash interrupted; never acknowledged).
    pub torn_bytes: u64,
    pub elapsed: Duration,
}

/// Counters since the log was opened.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub records: u64,
    /// Batches written: one write each (two when a batch starts a segment).
    pub batches: u64,
    pub syncs: u64,
    pub bytes_written: u64,
    pub durable: Lsn,
    pub end: Lsn,
    pub segments: usize,
    /// Segments made from a retired one kept as a spare, rather than created.
    pub segments_reused: u64,
    /// The writer's cycles (writing and syncing what filled) by how long they took:
    /// `write_us_log2[i]` counts cycles of 2^i to 2^(i+1) µs (the first also those under
    /// 1 µs, the last those longer). What the disk gives the log, as operators and the
    /// benchmark read it.
    pub write_us_log2: [u64; WRITE_BUCKETS],
    /// Microseconds spent in those cycles, in all.
    pub write_us: u64,
}

/// Buckets of [`Stats::write_us_log2`]: up to 2^23 µs, about 8 s.
pub const WRITE_BUCKETS: usize = 24;

impl Stats {
    /// The bucket of a cycle that took `us` microseconds.
    pub fn write_bucket(us: u64) -> usize {
        (u64::BITS - us.max(1).leading_zeros() - 1).min(WRITE_BUCKETS as u32 - 1) as usize
    }

    /// The upper bound in µs of the bucket where `q` (0 to 1) of the cycles counted in
    /// `buckets` end: `q = 0.99` says 99% of them took less. None with no cycles.
    pub fn write_quantile_us(buckets: &[u64; WRITE_BUCKETS], q: f64) -> Option<u64> {
        let total: u64 = buckets.iter().sum();
        if total == 0 {
            return None;
        }
        let want = (q * total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in buckets.iter().enumerate() {
            seen += n;
            if seen >= want {
                return Some(1 << (i + 1));
            }
        }
        Some(1 << WRITE_BUCKETS)
    }
}

/// A record read back.
#[derive(Clone, Copy, Debug)]
pub struct Record<'a> {
    /// Where the record starts (its identity in the log).
    pub lsn: Lsn,
    /// Where it ends: the position `append` returned for it.
    pub end: Lsn,
    pub kind: u8,
    pub payload: &'a [u8],
}

/// A batch sealed and waiting for the writer.
struct Sealed {
    seg: Lsn,
    creates_segment: bool,
    offset: u64,
    /// A header's room and the frames until the writer seals them (`format::seal`),
    /// then the bytes to write.
    bytes: Vec<u8>,
    end: Lsn,
    /// Frame bytes it takes off `pending_bytes` once written.
    pending: u64,
}

type Waiter = oneshot::Sender<Result<(), Error>>;

/// What a wait does once its position is durable, or cannot become so.
enum Notify {
    /// Answer a task or thread waiting on the channel.
    Channel(Waiter),
    /// Call this on the writer's thread ([`Log::on_durable`]).
    Call(Box<dyn FnOnce(Result<(), Error>) + Send>),
}

impl Notify {
    /// Nobody is left to hear it (a channel whose receiver was dropped).
    fn abandoned(&self) -> bool {
        match self {
            Notify::Channel(tx) => tx.is_closed(),
            Notify::Call(_) => false,
        }
    }

    fn send(self, r: Result<(), Error>) {
        match self {
            Notify::Channel(tx) => {
                let _ = tx.send(r);
            }
            Notify::Call(f) => f(r),
        }
    }
}

/// One wait for a position.
struct Waiting {
    lsn: Lsn,
    tx: Notify,
    /// The follower's `woken` flag (see [`Follower`]).
    follower: Option<Arc<AtomicBool>>,
}

/// A thread that replies to syncs with appends of its own (an executor running what
/// waited for durability): after a sync that woke it, the writer waits up to
/// [`Config::follow`] for it to call [`Follower::idle`] before it takes the next
/// batch, so that what it appends in reply rides the next sync, not the one after.
/// Its waits go through [`Log::durable_following`].
#[derive(Clone)]
pub struct Follower {
    follow: Arc<Follow>,
    /// Set by the writer as it wakes this follower's wait (before the wake, so that
    /// the writer's next look counts it); cleared by `idle`.
    woken: Arc<AtomicBool>,
}

impl Follower {
    /// Nothing more to append for now: the thread is about to sleep.
    pub fn idle(&self) {
        if !self.woken.swap(false, Ordering::SeqCst) {
            return;
        }
        let f = &*self.follow;
        // SeqCst on both sides: either the writer sees the count at zero, or this sees
        // it following and wakes it, under the lock it waits with.
        if f.working.fetch_sub(1, Ordering::SeqCst) == 1 && f.following.load(Ordering::SeqCst) {
            let _g = lock(&f.lock);
            f.cv.notify_one();
        }
    }
}

struct Shared {
    open: BatchBuf,
    /// Where the open batch starts.
    open_start: Lsn,
    open_pending: u64,
    /// The open batch is the first of a segment the writer has still to create.
    open_creates_segment: bool,
    /// The segment the open batch goes to.
    seg: Lsn,
    sealed: VecDeque<Sealed>,
    /// The end of the last record appended.
    end: Lsn,
    pending_bytes: u64,
    /// First positions of the segments, ascending (the newest may not exist yet).
    segments: Vec<Lsn>,
    poisoned: Option<Arc<io::Error>>,
    closing: bool,
    /// The writer sleeps on `work`: an append must wake it. While it writes, appends
    /// leave it be (a notify is a syscall even with no one waiting), and it looks for
    /// more before it sleeps again.
    writer_asleep: bool,
    /// Who waits for which position, ascending. Records are appended in order, so a
    /// waiter almost always goes at the back: no allocation per waiter but its channel.
    waiters: VecDeque<Waiting>,
    /// Buffers of batches written, kept for the next batches: a batch's buffer grows
    /// to its size once, not in every cycle (and under the lock appends take).
    spare: Vec<Vec<u8>>,
    stats: Stats,
}

impl Shared {
    /// Close the open batch (which holds at least one record) for the writer, which
    /// seals it (`format::seal`: the checksum over every frame) once it has let go of
    /// the lock appends take; returns where the next batch starts.
    fn seal_open(&mut self) -> Lsn {
        let batch = std::mem::replace(
            &mut self.open,
            BatchBuf {
                bytes: self.spare.pop().unwrap_or_default(),
                records: 0,
            },
        );
        let bytes = batch.bytes;
        let end = self.open_start + align(bytes.len() as u64);
        self.sealed.push_back(Sealed {
            seg: self.seg,
            creates_segment: std::mem::take(&mut self.open_creates_segment),
            offset: self.open_start - self.seg,
            bytes,
            end,
            pending: std::mem::take(&mut self.open_pending),
        });
        self.open_start = end;
        end
    }
}

struct Inner {
    storage: Arc<dyn Storage>,
    config: Config,
    log_id: u64,
    shared: CacheLine<Mutex<Shared>>,
    /// The writer waits here for work.
    work: Condvar,
    /// Appenders wait here for `pending_bytes` to fall.
    space: Condvar,
    durable: CacheLine<AtomicU64>,
    /// No writer thread: whoever holds the log calls [`Log::write_pending`].
    driven: bool,
    /// What followers share with the writer (not the log itself: a follower left
    /// over keeps no file or lock open).
    follow: Arc<Follow>,
    /// Retired segments kept for the next segments, oldest first (at most
    /// `Config::spare_segments`): a segment made from one is written over space the disk already
    /// holds, so its syncs write data alone (docs/log.md §3).
    spares: Mutex<Vec<String>>,
}

/// The writer's wait for its followers (see [`Follower`]).
#[derive(Default)]
struct Follow {
    /// Followers woken by a sync and not idle since.
    working: AtomicUsize,
    /// The writer waits on `cv` for `working` to reach zero: the last `idle` wakes it.
    following: AtomicBool,
    /// The log is closing: the writer waits no more.
    closing: AtomicBool,
    lock: Mutex<()>,
    cv: Condvar,
}

/// A value alone on its cache lines (two, for the adjacent-line prefetcher).
#[repr(align(128))]
struct CacheLine<T>(T);

impl<T> std::ops::Deref for CacheLine<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// See the crate docs. Cheap to share behind an `Arc`; every method takes `&self`.
pub struct Log {
    inner: Arc<Inner>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// A driven log's write position (the writer thread keeps its own).
    filled: Mutex<Option<Filled>>,
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
        Log::open_with(storage, config, false)
    }

    /// [`Log::open`] without a writer thread: nothing becomes durable until the caller
    /// calls [`Log::write_pending`], and appends never wait for the disk. For a
    /// simulation on one thread, where the seed, not the scheduler, picks when the disk
    /// syncs.
    pub fn open_driven(
        storage: Arc<dyn Storage>,
        config: Config,
    ) -> Result<(Log, Recovery), Error> {
        Log::open_with(storage, config, true)
    }

    fn open_with(
        storage: Arc<dyn Storage>,
        config: Config,
        driven: bool,
    ) -> Result<(Log, Recovery), Error> {
        config.check()?;
        let found = recover(&*storage, config.spare_segments)?;
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
                open: BatchBuf::default(),
                open_start: found.recovery.end,
                open_pending: 0,
                open_creates_segment: false,
                seg,
                sealed: VecDeque::new(),
                end: found.recovery.end,
                pending_bytes: 0,
                segments: found.segments,
                poisoned: None,
                closing: false,
                writer_asleep: false,
                waiters: VecDeque::new(),
                spare: Vec::new(),
                stats: Stats::default(),
            })),
            work: Condvar::new(),
            space: Condvar::new(),
            durable: CacheLine(AtomicU64::new(found.recovery.end)),
            driven,
            follow: Arc::default(),
            spares: Mutex::new(found.spares),
        });
        let filled = Filled {
            seg,
            len: found.last_file_len,
            reused: false,
        };
        let (writer, filled) = if driven {
            (None, Some(filled))
        } else {
            let w = inner.clone();
            let writer = std::thread::Builder::new()
                .name("ferry-log-writer".into())
                .spawn(move || write_loop(&w, filled))
                .map_err(|e| Error::io("start its writer thread", e))?;
            (Some(writer), None)
        };
        Ok((
            Log {
                inner,
                writer: Mutex::new(writer),
                filled: Mutex::new(filled),
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
        let Ok(mut filled) = self.filled.lock() else {
            return false;
        };
        let Some(filled) = filled.as_mut() else {
            return false;
        };
        let batches = take_batches(&mut lock(&self.inner.shared));
        if batches.is_empty() {
            return false;
        }
        write_and_publish(&self.inner, batches, filled);
        true
    }

    /// Append a record and return the position just past it, at once: it is durable
    /// when [`Log::durable_lsn`] reaches that position. `kind` 0 is reserved. Waits
    /// only while `pending_bytes_max` bytes are not yet written.
    pub fn append(&self, kind: u8, payload: &[u8]) -> Result<Lsn, Error> {
        let inner = &*self.inner;
        if kind == 0 {
            return Err(Error::Invalid("record kind 0 is reserved".into()));
        }
        if payload.len() > inner.config.record_bytes_max as usize {
            return Err(Error::TooLarge {
                len: payload.len(),
                max: inner.config.record_bytes_max,
            });
        }
        let frame = FRAME_HEADER_BYTES + payload.len() as u64;
        let crc = frame_crc(kind, payload);
        let mut s = lock(&inner.shared);
        loop {
            if let Some(cause) = &s.poisoned {
                return Err(Error::PreviousIo {
                    cause: cause.clone(),
                });
            }
            if s.closing {
                return Err(Error::Closed);
            }
            if s.pending_bytes < inner.config.pending_bytes_max || inner.driven {
                break;
            }
            s = inner.space.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        // A batch never spans segments: if this frame (with the batch's padding) would
        // pass the segment's end, the next segment starts where the last batch ends.
        if s.open_start + align(s.open.len() + frame) > s.seg + inner.config.segment_bytes {
            let next = if s.open.is_empty() {
                s.open_start
            } else {
                s.seal_open()
            };
            s.seg = next;
            s.segments.push(next);
            s.open_start = next + SEGMENT_HEADER_BYTES;
            s.open_creates_segment = true;
        }
        let at = s.open.push(kind, crc, payload);
        let end = s.open_start + at + frame;
        s.end = end;
        s.open_pending += frame;
        s.pending_bytes += frame;
        s.stats.records += 1;
        let wake = s.writer_asleep;
        drop(s);
        if wake {
            inner.work.notify_one();
        }
        Ok(end)
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
        lock(&self.inner.shared).end
    }

    /// Block until `lsn` is durable. Not from inside an async task: use [`Log::durable`].
    pub fn wait_durable(&self, lsn: Lsn) -> Result<(), Error> {
        match self.register(lsn, None)? {
            None => Ok(()),
            Some(rx) => rx.blocking_recv().unwrap_or(Err(Error::Closed)),
        }
    }

    /// Resolves when `lsn` is durable, or with the error that stopped it becoming so.
    pub fn durable(
        &self,
        lsn: Lsn,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send + 'static {
        self.durable_with(lsn, None)
    }

    /// [`Log::durable`], for `follower`: the sync that makes `lsn` durable waits for
    /// it to go idle before the writer takes the next batch.
    pub fn durable_following(
        &self,
        lsn: Lsn,
        follower: &Follower,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send + 'static {
        self.durable_with(lsn, Some(follower.woken.clone()))
    }

    fn durable_with(
        &self,
        lsn: Lsn,
        follower: Option<Arc<AtomicBool>>,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send + 'static {
        let registered = self.register(lsn, follower);
        async move {
            match registered? {
                None => Ok(()),
                Some(rx) => rx.await.unwrap_or(Err(Error::Closed)),
            }
        }
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
    pub fn on_durable(
        &self,
        lsn: Lsn,
        follower: Option<&Follower>,
        f: impl FnOnce(Result<(), Error>) + Send + 'static,
    ) {
        if self.durable_lsn() >= lsn {
            return f(Ok(()));
        }
        let follower = follower.map(|f| f.woken.clone());
        match self.enqueue(lsn, follower, Notify::Call(Box::new(f))) {
            Ok(None) => {}
            Ok(Some(n)) => n.send(Ok(())),
            Err((e, n)) => n.send(Err(e)),
        }
    }

    fn register(
        &self,
        lsn: Lsn,
        follower: Option<Arc<AtomicBool>>,
    ) -> Result<Option<oneshot::Receiver<Result<(), Error>>>, Error> {
        if self.durable_lsn() >= lsn {
            return Ok(None);
        }
        let (tx, rx) = oneshot::channel();
        match self.enqueue(lsn, follower, Notify::Channel(tx)) {
            Ok(None) => Ok(Some(rx)),
            Ok(Some(_)) => Ok(None),
            Err((e, _)) => Err(e),
        }
    }

    /// Queue `tx` as the wait for `lsn` (None); or give it back, if `lsn` became
    /// durable meanwhile (Some) or cannot become so (Err).
    fn enqueue(
        &self,
        lsn: Lsn,
        follower: Option<Arc<AtomicBool>>,
        tx: Notify,
    ) -> Result<Option<Notify>, (Error, Notify)> {
        let mut s = lock(&self.inner.shared);
        // The writer publishes under this lock: checked again, no wake-up is missed.
        if self.durable_lsn() >= lsn {
            return Ok(Some(tx));
        }
        if let Some(cause) = &s.poisoned {
            let e = Error::PreviousIo {
                cause: cause.clone(),
            };
            return Err((e, tx));
        }
        if lsn > s.end {
            let e = Error::Invalid(format!(
                "position {lsn} is past the end of the log ({})",
                s.end
            ));
            return Err((e, tx));
        }
        // From the back: a new record's waiter goes last, and one for an older record
        // (a shard waiting on what it appended before) a few places from the end.
        let at = s
            .waiters
            .iter()
            .rposition(|w| w.lsn <= lsn)
            .map_or(0, |i| i + 1);
        s.waiters.insert(at, Waiting { lsn, tx, follower });
        Ok(None)
    }

    /// Call `f` with every durable record that starts at or after `from`, in order;
    /// returns the durable position read up to. `from` below the oldest segment still
    /// kept (see [`Log::retire_below`]) is an error.
    pub fn read(&self, from: Lsn, mut f: impl FnMut(Record<'_>)) -> Result<Lsn, Error> {
        let (segments, durable) = {
            let s = lock(&self.inner.shared);
            (s.segments.clone(), self.durable_lsn())
        };
        if let Some(&oldest) = segments.first()
            && from < oldest
        {
            return Err(Error::Invalid(format!(
                "position {from} was retired; the log starts at {oldest}"
            )));
        }
        let st = &*self.inner.storage;
        for (i, &seg) in segments.iter().enumerate() {
            let limit = segments
                .get(i + 1)
                .copied()
                .unwrap_or(Lsn::MAX)
                .min(durable);
            if seg >= durable {
                break;
            }
            if limit <= from {
                continue;
            }
            let name = segment_name(seg);
            let mut off = SEGMENT_HEADER_BYTES;
            while seg + off < limit {
                let (frames, extent) = match read_batch(st, &name, seg, off, limit - seg)
                    .map_err(|e| Error::io("read a segment", e))?
                {
                    BatchRead::Valid { frames, extent } => (frames, extent),
                    // Retired while this read ran, and maybe made into a new segment
                    // since: not damage.
                    BatchRead::Bad(_) if !lock(&self.inner.shared).segments.contains(&seg) => {
                        return Err(Error::Invalid(format!(
                            "the segment at position {seg} was retired while it was read"
                        )));
                    }
                    BatchRead::Bad(reason) => {
                        return Err(Error::Corrupted {
                            segment: name,
                            offset: off,
                            reason,
                        });
                    }
                };
                let batch_lsn = seg + off;
                for fr in format::frames(&frames).expect("read_batch checked the frames") {
                    let lsn = batch_lsn + BATCH_HEADER_BYTES + fr.at as u64;
                    if lsn >= from {
                        f(Record {
                            lsn,
                            end: batch_lsn + BATCH_HEADER_BYTES + fr.end as u64,
                            kind: fr.kind,
                            payload: &frames[fr.payload],
                        });
                    }
                }
                off += extent;
            }
        }
        Ok(durable)
    }

    /// Retire the segments that lie wholly below `lsn` (the caller keeps what they held
    /// elsewhere, e.g. in a checkpoint): they leave the log, deleted or kept as spares
    /// for later segments (docs/log.md §3). The newest segment is always kept. Returns
    /// how many were retired. A reader still reading them fails.
    pub fn retire_below(&self, lsn: Lsn) -> Result<usize, Error> {
        let durable = self.durable_lsn();
        let _one_at_a_time = lock(&self.retiring);
        let victims: Vec<Lsn> = {
            let s = lock(&self.inner.shared);
            s.segments
                .windows(2)
                // Only once the next segment holds a durable batch: recovery must always
                // find the segment that holds the end, with records in it.
                .take_while(|w| w[1] <= lsn && w[1] + SEGMENT_HEADER_BYTES < durable)
                .map(|w| w[0])
                .collect()
        };
        if victims.is_empty() {
            return Ok(0);
        }
        // Oldest first, each removal made durable before the next: a crash between them
        // leaves the log contiguous (a directory without a journal may persist removals
        // out of order). The newest victims become spares while there is room for them
        // (a storage that cannot rename keeps none): as many as this retirement retires
        // at most, the next interval's likely need, and `spare_segments` in all.
        let st = &*self.inner.storage;
        let want = self.inner.config.spare_segments.min(victims.len());
        let room = want.saturating_sub(lock(&self.inner.spares).len());
        let keep_from = victims.len().saturating_sub(room);
        for (i, &v) in victims.iter().enumerate() {
            let name = segment_name(v);
            let kept = i >= keep_from && st.rename(&name, &spare_name(v)).is_ok();
            if !kept {
                st.remove(&name)
                    .map_err(|e| Error::io("remove a retired segment", e))?;
            }
            lock(&self.inner.shared).segments.retain(|&f| f != v);
            st.sync_dir()
                .map_err(|e| Error::io("sync its directory after retiring a segment", e))?;
            if kept {
                lock(&self.inner.spares).push(spare_name(v));
            }
        }
        Ok(victims.len())
    }

    pub fn stats(&self) -> Stats {
        let s = lock(&self.inner.shared);
        Stats {
            durable: self.durable_lsn(),
            end: s.end,
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
            && let Ok(filled) = self.filled.lock()
            && let Some(filled) = filled.as_ref()
        {
            cut_reused(&self.inner, filled);
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
        let f = &*self.inner.follow;
        f.closing.store(true, Ordering::SeqCst);
        drop(lock(&f.lock));
        f.cv.notify_all();
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

/// The writer: take what filled, write it, sync it, publish, wake who it covers.
fn write_loop(inner: &Inner, mut filled: Filled) {
    loop {
        follow(&inner.follow, inner.config.follow);
        let batches: Vec<Sealed> = {
            let mut s = lock(&inner.shared);
            loop {
                let batches = take_batches(&mut s);
                if !batches.is_empty() {
                    break batches;
                }
                if s.closing {
                    let clean = s.poisoned.is_none();
                    drop(s);
                    if clean {
                        cut_reused(inner, &filled);
                    }
                    return;
                }
                s.writer_asleep = true;
                s = inner.work.wait(s).unwrap_or_else(|p| p.into_inner());
                s.writer_asleep = false;
            }
        };
        write_and_publish(inner, batches, &mut filled);
    }
}

/// On a clean close, the newest segment, if made from a spare, loses what the spare
/// held after the log's end: the next open then finds the end followed by nothing, not
/// by bytes it would have to cut as a torn tail.
fn cut_reused(inner: &Inner, filled: &Filled) {
    if !filled.reused {
        return;
    }
    let end = inner.durable.load(Ordering::SeqCst) - filled.seg;
    let name = segment_name(filled.seg);
    let st = &*inner.storage;
    if let Err(e) = st.truncate(&name, end).and_then(|()| st.sync(&name)) {
        tracing::warn!(segment = %name, "could not cut a reused segment at the log's end: {e}");
    }
}

/// Wait up to `limit` (`Config::follow`) for the followers the last sync woke to go
/// idle.
fn follow(f: &Follow, limit: Duration) {
    if limit.is_zero() || f.working.load(Ordering::SeqCst) == 0 {
        return;
    }
    let until = Instant::now() + limit;
    let mut g = lock(&f.lock);
    f.following.store(true, Ordering::SeqCst);
    while f.working.load(Ordering::SeqCst) > 0 && !f.closing.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now >= until {
            break;
        }
        g =
            f.cv.wait_timeout(g, until - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
    }
    f.following.store(false, Ordering::SeqCst);
}

/// Everything appended and not yet taken, sealed (none once the log is poisoned).
fn take_batches(s: &mut Shared) -> Vec<Sealed> {
    if s.poisoned.is_some() {
        return Vec::new();
    }
    if !s.open.is_empty() {
        s.seal_open();
    }
    s.sealed.drain(..).collect()
}

/// Write and sync `batches` (at least one), then publish the durable position and wake
/// the waiters it covers; or poison the log and fail every waiter.
fn write_and_publish(inner: &Inner, mut batches: Vec<Sealed>, filled: &mut Filled) {
    for b in &mut batches {
        format::seal(&mut b.bytes, b.seg + b.offset);
    }
    let began = std::time::Instant::now();
    let result = write_batches(inner, &batches, filled);
    let took = began.elapsed().as_micros() as u64;
    let end = batches.last().expect("at least one batch").end;
    let batches_n = batches.len() as u64;
    let bytes: u64 = batches.iter().map(|b| b.bytes.len() as u64).sum();
    // Buffers not kept are freed after the lock is let go (a large one is an munmap).
    let mut freed = Vec::new();
    let mut s = lock(&inner.shared);
    s.pending_bytes -= batches.iter().map(|b| b.pending).sum::<u64>();
    for b in batches {
        if s.spare.len() < SPARE_MAX && b.bytes.capacity() <= SPARE_BYTES_MAX {
            let mut bytes = b.bytes;
            bytes.clear();
            s.spare.push(bytes);
        } else {
            freed.push(b.bytes);
        }
    }
    match result {
        Ok((syncs, reused)) => {
            s.stats.batches += batches_n;
            s.stats.syncs += syncs;
            s.stats.segments_reused += reused;
            s.stats.bytes_written += bytes;
            s.stats.write_us_log2[Stats::write_bucket(took)] += 1;
            s.stats.write_us += took;
            inner.durable.store(end, Ordering::SeqCst);
            let n = s.waiters.partition_point(|w| w.lsn <= end);
            let done: Vec<Waiting> = s.waiters.drain(..n).collect();
            drop(s);
            for w in done {
                // A wait given up (its receiver dropped) wakes no one to wait for.
                if let Some(f) = &w.follower
                    && !w.tx.abandoned()
                    && !f.swap(true, Ordering::SeqCst)
                {
                    inner.follow.working.fetch_add(1, Ordering::SeqCst);
                }
                w.tx.send(Ok(()));
            }
        }
        Err(e) => {
            tracing::error!("the log's write or sync failed; refusing writes until reopened: {e}");
            let cause = Arc::new(e);
            s.poisoned = Some(cause.clone());
            s.sealed.clear();
            let all = std::mem::take(&mut s.waiters);
            drop(s);
            for w in all {
                w.tx.send(Err(Error::Io {
                    what: "make the record durable",
                    source: cause.clone(),
                }));
            }
        }
    }
    inner.space.notify_all();
}

/// At most this many buffers of written batches are kept for reuse, each at most
/// `SPARE_BYTES_MAX` (a burst's large batch is not held on to).
const SPARE_MAX: usize = 4;
const SPARE_BYTES_MAX: usize = 1 << 20;

/// How far the newest segment's file reaches: its batches, then zeroes written ahead,
/// or what a spare it was made from held.
struct Filled {
    seg: Lsn,
    len: u64,
    /// Made from a spare: after `len`'s batches comes what the spare held.
    reused: bool,
}

/// The writer keeps this much zero-filled space ahead of the log's end. A batch written
/// over zeroes the disk already holds changes no file size or extent, so its fdatasync
/// writes the data alone; appending to the end of a file would make every sync write
/// the inode too.
const ZERO_AHEAD: u64 = 1 << 20;

/// The zeroes are topped up inside the same sync as a batch, as soon as this much of
/// them is used, by this much to twice it: that sync carries them, and one that
/// carried half a MiB took 1-2.5 ms (docs/log.md §3).
const ZERO_STEP: u64 = 64 << 10;

/// What a top-up writes from (never allocated per top-up).
static ZEROES: [u8; 2 * ZERO_STEP as usize] = [0; 2 * ZERO_STEP as usize];

/// Make segment `name` from the oldest spare worth reusing, with `header`; its file's
/// length, or None with no spare left (the caller creates the segment). Spares too
/// short to save a top-up are removed. Spares are only a saving: one that fails here
/// (gone, unreadable) is dropped with a warning, and the next one, or a new file, is
/// used instead.
fn segment_from_spare(inner: &Inner, name: &str, header: &[u8]) -> Option<u64> {
    let st = &*inner.storage;
    loop {
        let spare = {
            let mut spares = lock(&inner.spares);
            if spares.is_empty() {
                return None;
            }
            spares.remove(0)
        };
        // Made of a full segment, unless the segment size changed since. The header
        // goes in under the spare's name, synced, before the rename: a file under a
        // segment's name always has its own header.
        let made = st.len(&spare).and_then(|len| {
            if len
                < inner
                    .config
                    .segment_bytes
                    .min(SEGMENT_HEADER_BYTES + ZERO_AHEAD)
            {
                return Ok(None);
            }
            st.write_at(&spare, 0, header)?;
            st.sync(&spare)?;
            st.rename(&spare, name)?;
            Ok(Some(len))
        });
        match made {
            Ok(Some(len)) => return Some(len),
            Ok(None) => {}
            Err(e) => tracing::warn!(%spare, "not reusing a spare segment: {e}"),
        }
        let _ = st.remove(&spare);
    }
}

/// Write `batches` (creating segments as they begin) and sync every segment written.
/// Returns the number of syncs and of segments made from spares.
fn write_batches(inner: &Inner, batches: &[Sealed], filled: &mut Filled) -> io::Result<(u64, u64)> {
    let st = &*inner.storage;
    let mut syncs = 0;
    let mut reused = 0;
    let mut unsynced: Option<Lsn> = None;
    for b in batches {
        let name = segment_name(b.seg);
        if b.creates_segment {
            // The old segment is complete and synced before the new one exists, so only
            // the newest segment can ever have a torn tail.
            if let Some(prev) = unsynced.take() {
                st.sync(&segment_name(prev))?;
                syncs += 1;
            }
            let header = SegmentHeader {
                first: b.seg,
                log_id: inner.log_id,
            }
            .encode();
            *filled = match segment_from_spare(inner, &name, &header) {
                Some(len) => {
                    reused += 1;
                    Filled {
                        seg: b.seg,
                        len,
                        reused: true,
                    }
                }
                None => {
                    st.create(&name)?;
                    st.write_at(&name, 0, &header)?;
                    st.sync(&name)?;
                    Filled {
                        seg: b.seg,
                        len: SEGMENT_HEADER_BYTES,
                        reused: false,
                    }
                }
            };
            st.sync_dir()?;
            syncs += 2;
        }
        st.write_at(&name, b.offset, &b.bytes)?;
        unsynced = Some(b.seg);
        let end = b.offset + b.bytes.len() as u64;
        if filled.seg == b.seg {
            filled.len = filled.len.max(end);
            let limit = inner.config.segment_bytes;
            if filled.len + ZERO_STEP <= end + ZERO_AHEAD && filled.len < limit {
                let upto = (end + ZERO_AHEAD)
                    .min(limit)
                    .min(filled.len + 2 * ZERO_STEP);
                st.write_at(&name, filled.len, &ZEROES[..(upto - filled.len) as usize])?;
                filled.len = upto;
            }
        }
    }
    if let Some(seg) = unsynced {
        st.sync(&segment_name(seg))?;
        syncs += 1;
    }
    Ok((syncs, reused))
}

enum BatchRead {
    Valid { frames: Vec<u8>, extent: u64 },
    Bad(String),
}

/// The batch at `off` of segment `seg` (`len` bytes of which count), checked whole.
fn read_batch(st: &dyn Storage, name: &str, seg: Lsn, off: u64, len: u64) -> io::Result<BatchRead> {
    if len.saturating_sub(off) < BATCH_HEADER_BYTES {
        return Ok(BatchRead::Bad("a batch header is cut short".into()));
    }
    let mut h = [0u8; BATCH_HEADER_BYTES as usize];
    if st.read_at(name, off, &mut h)? < h.len() {
        return Ok(BatchRead::Bad("a batch header is cut short".into()));
    }
    let header = match BatchHeader::decode(&h) {
        Ok(x) => x,
        Err(reason) => return Ok(BatchRead::Bad(reason)),
    };
    if header.lsn != seg + off {
        return Ok(BatchRead::Bad(format!(
            "the batch header names position {}, but sits at {}",
            header.lsn,
            seg + off
        )));
    }
    if off + header.extent() > len {
        return Ok(BatchRead::Bad(
            "the batch runs past the end of the segment".into(),
        ));
    }
    let mut frames = vec![0u8; header.frames_len as usize];
    if st.read_at(name, off + BATCH_HEADER_BYTES, &mut frames)? < frames.len() {
        return Ok(BatchRead::Bad("the batch is cut short".into()));
    }
    if !header.matches(&h, &frames) {
        return Ok(BatchRead::Bad("the batch fails its checksum".into()));
    }
    if let Err(reason) = format::frames(&frames) {
        return Ok(BatchRead::Bad(reason));
    }
    Ok(BatchRead::Valid {
        frames,
        extent: header.extent(),
    })
}

/// A valid batch anywhere in `name` after `off` (at an aligned offset, naming its own
/// position, passing its checksum): its offset.
fn valid_batch_after(
    st: &dyn Storage,
    name: &str,
    seg: Lsn,
    off: u64,
    len: u64,
) -> io::Result<Option<u64>> {
    // Read a window at a time: after a segment made from a spare, the rest of the file
    // (up to a whole segment) is the spare's old bytes. A header that names its own
    // position is checked whole, wherever its batch ends.
    const WINDOW: u64 = 1 << 20;
    let mut buf = vec![0u8; (WINDOW + BATCH_HEADER_BYTES) as usize];
    let mut from = off + format::ALIGN;
    while from + BATCH_HEADER_BYTES <= len {
        let want = (len - from).min(WINDOW + BATCH_HEADER_BYTES) as usize;
        let n = st.read_at(name, from, &mut buf[..want])? as u64;
        let mut p = 0;
        while p < WINDOW && p + BATCH_HEADER_BYTES <= n {
            if let Ok(h) = BatchHeader::decode(&buf[p as usize..n as usize])
                && h.lsn == seg + from + p
                && let BatchRead::Valid { .. } = read_batch(st, name, seg, from + p, len)?
            {
                return Ok(Some(from + p));
            }
            p += format::ALIGN;
        }
        if n < want as u64 {
            break;
        }
        from += WINDOW;
    }
    Ok(None)
}

struct Found {
    recovery: Recovery,
    segments: Vec<Lsn>,
    /// Spares to reuse, oldest first.
    spares: Vec<String>,
    log_id: u64,
    /// The newest segment's file length (its logical end plus any zeroes ahead).
    last_file_len: u64,
}

/// Is `name` all zeroes from `from` to `to`?
fn all_zero(st: &dyn Storage, name: &str, from: u64, to: u64) -> io::Result<bool> {
    let mut buf = vec![0u8; 64 << 10];
    let mut at = from;
    while at < to {
        let want = ((to - at) as usize).min(buf.len());
        let n = st.read_at(name, at, &mut buf[..want])?;
        if n == 0 {
            return Ok(true);
        }
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
    Ok(true)
}

/// docs/log.md §4.
fn recover(st: &dyn Storage, spares_max: usize) -> Result<Found, Error> {
    let started = Instant::now();
    let io = |what| move |e| Error::io(what, e);
    let listed = st.list().map_err(io("list its directory"))?;
    let mut firsts: Vec<Lsn> = listed
        .iter()
        .filter_map(|n| parse_segment_name(n))
        .collect();
    firsts.sort_unstable();
    let mut spares: Vec<Lsn> = listed.iter().filter_map(|n| parse_spare_name(n)).collect();
    spares.sort_unstable();
    let mut torn_bytes = 0;
    let mut log_id = None;
    let mut unfinished = None;
    let mut segs: Vec<(Lsn, u64)> = Vec::new();
    for (i, &first) in firsts.iter().enumerate() {
        let name = segment_name(first);
        let len = st.len(&name).map_err(io("read a segment's length"))?;
        let mut hb = [0u8; SEGMENT_HEADER_BYTES as usize];
        let n = st
            .read_at(&name, 0, &mut hb)
            .map_err(io("read a segment header"))?;
        match SegmentHeader::decode(&hb[..n]) {
            // Records are written only after a new segment's header is synced: a newest
            // segment with no valid header and nothing after it was being created when
            // the process stopped, and holds nothing.
            Err(_) if i + 1 == firsts.len() && len <= SEGMENT_HEADER_BYTES => {
                // Removed once everything else checked out: a refused open changes nothing.
                unfinished = Some((name, len));
            }
            Err(reason) => {
                return Err(Error::Corrupted {
                    segment: name,
                    offset: 0,
                    reason,
                });
            }
            Ok(h) => {
                if h.first != first {
                    return Err(Error::Corrupted {
                        segment: name,
                        offset: 0,
                        reason: format!(
                            "the header names position {}, the file name {first}",
                            h.first
                        ),
                    });
                }
                if *log_id.get_or_insert(h.log_id) != h.log_id {
                    return Err(Error::Corrupted {
                        segment: name,
                        offset: 0,
                        reason: "this segment belongs to another log (its log id differs)".into(),
                    });
                }
                segs.push((first, len));
            }
        }
    }
    // Scan every segment before changing anything: a refused open changes nothing.
    // A segment before the newest ends where the next one begins: what follows there is
    // zeroes the writer filled ahead (see `ZERO_AHEAD`) or what a spare it was made
    // from held. The newest ends where its batches stop.
    let mut records = 0;
    let count = segs.len();
    let mut cut: Option<(String, u64, u64, String)> = None;
    let mut ends = Vec::with_capacity(count);
    for (i, &(first, len)) in segs.iter().enumerate() {
        let name = segment_name(first);
        let stop = segs
            .get(i + 1)
            .map_or(len, |next| next.0.saturating_sub(first).min(len));
        let mut off = SEGMENT_HEADER_BYTES;
        while off < stop {
            match read_batch(st, &name, first, off, stop).map_err(io("read a segment"))? {
                BatchRead::Valid { frames, extent } => {
                    records += format::frames(&frames).expect("checked").len() as u64;
                    off += extent;
                }
                BatchRead::Bad(reason) => {
                    if all_zero(st, &name, off, len).map_err(io("read a segment"))? {
                        break;
                    }
                    if i + 1 < count {
                        return Err(Error::Corrupted {
                            segment: name,
                            offset: off,
                            reason,
                        });
                    }
                    if let Some(at) = valid_batch_after(st, &name, first, off, len)
                        .map_err(io("read a segment"))?
                    {
                        return Err(Error::Corrupted {
                            segment: name,
                            offset: off,
                            reason: format!("{reason}, and a durable batch follows at byte {at}"),
                        });
                    }
                    cut = Some((name.clone(), off, len, reason));
                    break;
                }
            }
        }
        ends.push(off.min(len));
    }
    for (i, w) in segs.windows(2).enumerate() {
        let ((a, _), (b, _)) = (w[0], w[1]);
        if a + ends[i] != b {
            return Err(Error::Corrupted {
                segment: segment_name(b),
                offset: 0,
                reason: format!(
                    "the segment before ends at position {}, this one starts at {b}: a segment \
                     is missing or was cut",
                    a + ends[i]
                ),
            });
        }
    }
    let mut last_file_len = segs.last().map_or(0, |s| s.1);
    if let Some((name, off, len, reason)) = cut {
        tracing::warn!(
            segment = %name,
            offset = off,
            bytes = len - off,
            "cutting what follows the log's end (a torn write, or what the spare this \
             segment was made from held): {reason}"
        );
        st.truncate(&name, off).map_err(io("cut a torn tail"))?;
        torn_bytes += len - off;
        last_file_len = off;
    }
    for (seg, end) in segs.iter_mut().zip(&ends) {
        seg.1 = *end;
    }
    if let Some((name, len)) = unfinished {
        tracing::warn!(segment = %name, "removing a segment whose creation was interrupted");
        st.remove(&name)
            .map_err(io("remove an unfinished segment"))?;
        torn_bytes += len;
    }
    // Only spares this log retired are kept: they held positions below its oldest
    // segment, so none of their old batches can name a position the log will write. A
    // spare from anywhere else (a log reset by deleting its segments, a copy) might,
    // and is removed; so are any beyond `spare_segments`.
    let oldest = segs.first().map(|s| s.0);
    let (keep, stray): (Vec<Lsn>, Vec<Lsn>) = spares
        .into_iter()
        .partition(|&f| oldest.is_some_and(|o| f < o));
    let spares: Vec<Lsn> = keep.iter().copied().take(spares_max).collect();
    for f in stray.into_iter().chain(keep.into_iter().skip(spares_max)) {
        tracing::info!(spare = %spare_name(f), "removing a spare segment this log will not reuse");
        st.remove(&spare_name(f))
            .map_err(io("remove a spare segment"))?;
    }
    let log_id = match (log_id, segs.is_empty()) {
        (Some(id), false) => id,
        _ => {
            // A new log.
            let id = ferry_core::seams::random_nonzero_u64();
            let name = segment_name(0);
            st.create(&name).map_err(io("create its first segment"))?;
            st.write_at(
                &name,
                0,
                &SegmentHeader {
                    first: 0,
                    log_id: id,
                }
                .encode(),
            )
            .map_err(io("write its first segment header"))?;
            st.sync(&name).map_err(io("sync its first segment"))?;
            st.sync_dir().map_err(io("sync its directory"))?;
            segs.push((0, SEGMENT_HEADER_BYTES));
            last_file_len = SEGMENT_HEADER_BYTES;
            id
        }
    };
    let &(last, last_len) = segs.last().expect("at least one segment");
    // What a killed process wrote may sit in the page cache only: it becomes durable
    // here, before anyone is told so, and so do the directory's entries. (Older
    // segments were synced before the next one was created.)
    st.sync(&segment_name(last))
        .map_err(io("sync its newest segment"))?;
    st.sync_dir().map_err(io("sync its directory"))?;
    Ok(Found {
        recovery: Recovery {
            segments: segs.len(),
            records,
            end: last + last_len,
            torn_bytes,
            elapsed: started.elapsed(),
        },
        segments: segs.iter().map(|&(f, _)| f).collect(),
        spares: spares.into_iter().map(spare_name).collect(),
        log_id,
        last_file_len,
    })
}
