//! A worker's connection to a server (docs/flow-server.md §5.3, §6, §8): one thread with
//! its own runtime (or, in a simulation, a task on the caller's: `connect_here`) that
//! says hello, pings, sends each shard's records as they are appended, hands
//! acknowledgements to the shards' waits, keeps each shard's deadline, and reconnects
//! and resumes after a blip.
//!
//! Each grant of a shard is a [`ShardStream`] of its own, the [`JournalLog`] its runs
//! journal through. A stream that is lost (revoked, past its deadline, refused, released)
//! stays lost: every append and wait on it fails with `Error::Fenced` for good, so code
//! still holding it after the shard came back under a new epoch can do nothing with it.
//!
//! What the engine learns comes as [`Event`]s: a shard granted (recover it and start its
//! runs), lost (stop its runs: nothing of it may leave the process any more), asked back.
//! The engine's side is `holder.rs`; this is the connection and the streams.

pub use super::dial::Stream;

mod frames;
use super::dial::dial;
use super::io::{FrameReader, write_frame};
use super::proto::{
    Append, Body, Call, FRAME_MAX, Frame, Hello, Outcome, PROTOCOL, Rec, Refused, Resume, Role,
    Turns,
};
use crate::journal_log::{Durable, JournalLog, OnDurable};
use ferry_core::sync::lock;
use ferry_log::{Error, Follower, Lsn, Record, Stats};
use frames::handle;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};
use tokio::io::AsyncWrite;
use tokio::sync::{Notify, mpsc, oneshot};

/// Where and how to reach the server.
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    /// `unix:/path` or `HOST:PORT`; several, comma-separated, for a server and its
    /// standbys (tried in turn).
    pub server: String,
    pub token: String,
    /// The most shards to hold; 0: all.
    pub max_shards: u32,
    /// For the server's status: this host and process.
    pub name: String,
    /// The clock-rate difference a deadline allows for (docs/flow-server.md §3).
    pub drift: f64,
}

impl WorkerSettings {
    pub fn new(server: impl Into<String>) -> WorkerSettings {
        WorkerSettings {
            server: server.into(),
            token: String::new(),
            max_shards: 0,
            name: format!("pid {}", std::process::id()),
            drift: 0.01,
        }
    }
}

/// What the connection tells the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Shard granted at `epoch`: its stream is [`Worker::stream`]; recover it, then run it.
    Granted { shard: u32, epoch: u64 },
    /// The shard's stream of `epoch` is lost: stop its runs. Every wait on it has ended
    /// with `Fenced`.
    Lost { shard: u32, epoch: u64, why: String },
    /// The server asks for the shard's grant at `epoch` back (rebalance): stop it, then
    /// [`Worker::release`]. It may come before that grant's `Granted`.
    Drain { shard: u32, epoch: u64 },
}

/// Time on `CLOCK_BOOTTIME`: it runs on while the machine is suspended, so a deadline
/// passes during a suspend as it does on the server (docs/flow-server.md §2).
fn boot_now() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to; CLOCK_BOOTTIME exists on Linux.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    assert_eq!(r, 0, "clock_gettime(CLOCK_BOOTTIME) works on Linux");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Bytes of records one `Append` carries at most (at least one record goes).
const APPEND_BYTES: usize = 64 << 10;
/// How long to wait for the server to accept, say welcome, or take a frame.
const IO_WITHIN: Duration = Duration::from_secs(10);

/// One grant of a shard, as this worker holds it.
pub struct ShardStream {
    shard: u32,
    epoch: u64,
    /// Weak: the connection holds the streams.
    conn: Weak<Conn>,
    state: Arc<Mutex<StreamState>>,
    /// Bumped by the shard's thread as it turns (docs/flow-server.md §5.4).
    pub turns: AtomicU64,
    /// The clock its deadline is kept on (the connection's).
    clock: fn() -> Duration,
}

#[derive(Default)]
struct StreamState {
    /// The position after the last record appended.
    next: u64,
    /// Every record before this is durable on the server.
    acked: u64,
    /// Appended, not yet written to the connection.
    unsent: VecDeque<(u64, Rec)>,
    /// Written, not yet acknowledged: sent again after a reconnect.
    unacked: VecDeque<(u64, Rec)>,
    /// When the oldest of `unacked` was written (the flush timeout).
    oldest_sent: Option<tokio::time::Instant>,
    /// On `CLOCK_BOOTTIME`: no step body may start from here on (`None`: not yet
    /// confirmed since the grant).
    deadline: Option<Duration>,
    /// Lost: every append and wait fails with this, for good.
    failed: Option<Error>,
    /// Being handed back: no appends; `Release` once everything is acknowledged.
    releasing: bool,
    waiters: Vec<(u64, Waker)>,
    callbacks: Vec<(u64, OnDurable)>,
}

impl ShardStream {
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// The epoch of this grant.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether a step body may start, or a result leave the process, now: the grant is
    /// not lost and its deadline is ahead (docs/flow-server.md §5.3).
    pub fn may_act(&self) -> bool {
        let s = lock(&self.state);
        s.failed.is_none() && !s.releasing && s.deadline.is_some_and(|d| (self.clock)() < d)
    }

    /// Send a read for this grant's recovery and wait for its answer. A read is progress
    /// (docs/flow-server.md §7): a long recovery is not a stuck shard.
    async fn ask(&self, request: Body) -> Result<Body, Error> {
        if let Some(e) = lock(&self.state).failed.clone() {
            return Err(e);
        }
        let (tx, rx) = oneshot::channel();
        let conn = self.conn.upgrade().ok_or(Error::Closed)?;
        conn.reads.send((request, tx)).map_err(|_| Error::Closed)?;
        conn.wake.notify_one();
        drop(conn);
        let answer = match tokio::time::timeout(IO_WITHIN * 3, rx).await {
            Ok(Ok(answer)) => answer?,
            Ok(Err(_)) => return Err(Error::Closed),
            Err(_) => {
                return Err(Error::Invalid(format!(
                    "shard {}'s recovery read got no answer from the server in time",
                    self.shard
                )));
            }
        };
        self.turns.fetch_add(1, Ordering::Relaxed);
        Ok(answer)
    }

    /// The shard's newest checkpoint on the server, whole, with its position; `None`
    /// if it has none (docs/flow-server.md §7).
    pub async fn checkpoint(&self) -> Result<Option<(u64, Vec<u8>)>, Error> {
        let (mut position, mut bytes) = (0u64, Vec::new());
        loop {
            let fetch = Body::Fetch {
                shard: self.shard,
                epoch: self.epoch,
                position,
                offset: bytes.len() as u64,
                max_bytes: 1 << 20,
            };
            let Body::Checkpoint {
                position: p,
                offset,
                bytes: chunk,
                last,
                ..
            } = self.ask(fetch).await?
            else {
                return Err(Error::Invalid(
                    "the server answered a Fetch with another frame".into(),
                ));
            };
            if p == 0 {
                return Ok(None);
            }
            if (position != 0 && p != position) || offset != bytes.len() as u64 {
                return Err(Error::Invalid(
                    "the server's checkpoint changed while it was read".into(),
                ));
            }
            position = p;
            bytes.extend_from_slice(&chunk);
            if last {
                return Ok(Some((position, bytes)));
            }
        }
    }

    /// The shard's records from position `from` to its end on the server, a page at a
    /// time (docs/flow-server.md §7).
    pub async fn records(&self, from: u64) -> Result<Vec<Rec>, Error> {
        let mut out = Vec::new();
        loop {
            let recover = Body::Recover {
                shard: self.shard,
                epoch: self.epoch,
                from: from + out.len() as u64,
                max_bytes: 1 << 20,
            };
            let Body::Records(page) = self.ask(recover).await? else {
                return Err(Error::Invalid(
                    "the server answered a Recover with another frame".into(),
                ));
            };
            out.extend(page.records);
            if page.last {
                return Ok(out);
            }
        }
    }

    /// Where the grant's records end, if every one appended is acknowledged.
    fn settled(&self) -> Option<u64> {
        let st = lock(&self.state);
        (st.unsent.is_empty() && st.acked == st.next).then_some(st.acked)
    }

    /// The grant is lost (for good).
    pub fn is_lost(&self) -> bool {
        lock(&self.state).failed.is_some()
    }

    /// The grant is lost: fail every wait now, and every append and wait from now on.
    /// False if it was already.
    fn lose(&self, why: &str) -> bool {
        let (wakers, callbacks, err) = {
            let mut s = lock(&self.state);
            if s.failed.is_some() {
                return false;
            }
            let err = Error::Fenced(format!(
                "shard {} at epoch {}: {why}",
                self.shard, self.epoch
            ));
            s.failed = Some(err.clone());
            s.unsent.clear();
            s.unacked.clear();
            (
                std::mem::take(&mut s.waiters),
                std::mem::take(&mut s.callbacks),
                err,
            )
        };
        for (_, w) in wakers {
            w.wake();
        }
        for (_, f) in callbacks {
            f(Err(err.clone()));
        }
        true
    }

    /// The server holds every record before `position` durably.
    fn ack(&self, position: u64) {
        let (wakers, callbacks) = {
            let mut s = lock(&self.state);
            if s.failed.is_some() || position <= s.acked {
                return;
            }
            s.acked = position.min(s.next);
            let acked = s.acked;
            while s.unacked.front().is_some_and(|(p, _)| *p < acked) {
                s.unacked.pop_front();
            }
            if s.unacked.is_empty() {
                s.oldest_sent = None;
            }
            let (ready, waiting): (Vec<_>, Vec<_>) =
                s.waiters.drain(..).partition(|(l, _)| *l <= acked);
            s.waiters = waiting;
            let mut done = Vec::new();
            let mut keep = Vec::new();
            for (l, f) in s.callbacks.drain(..) {
                if l <= acked {
                    done.push(f)
                } else {
                    keep.push((l, f))
                }
            }
            s.callbacks = keep;
            (ready, done)
        };
        for (_, w) in wakers {
            w.wake();
        }
        for f in callbacks {
            f(Ok(()));
        }
    }

    /// Up to [`APPEND_BYTES`] of what was appended and not sent (at least one record),
    /// moved to the unacknowledged; None if nothing waits.
    fn take_batch(&self) -> Option<(u64, Vec<Rec>)> {
        let mut s = lock(&self.state);
        if s.failed.is_some() || s.unsent.is_empty() {
            return None;
        }
        let first = s.unsent.front().expect("not empty").0;
        let mut bytes = 0;
        let mut out = Vec::new();
        while let Some((_, r)) = s.unsent.front() {
            if !out.is_empty() && bytes + 5 + r.bytes.len() > APPEND_BYTES {
                break;
            }
            bytes += 5 + r.bytes.len();
            let (p, r) = s.unsent.pop_front().expect("looked at it");
            s.unacked.push_back((p, r.clone()));
            out.push(r);
        }
        s.oldest_sent.get_or_insert_with(tokio::time::Instant::now);
        Some((first, out))
    }
}

impl JournalLog for ShardStream {
    fn append(&self, kind: u8, payload: &[u8]) -> Result<Lsn, Error> {
        let conn = self.conn.upgrade();
        let max = conn
            .as_ref()
            .map_or(u32::MAX, |c| c.record_max.load(Ordering::Relaxed));
        if payload.len() + 1 > max as usize {
            return Err(Error::TooLarge {
                len: payload.len(),
                max,
            });
        }
        let mut s = lock(&self.state);
        if let Some(e) = &s.failed {
            return Err(e.clone());
        }
        if s.releasing {
            return Err(Error::Fenced(format!(
                "shard {} is being handed back",
                self.shard
            )));
        }
        let pos = s.next;
        s.next += 1;
        s.unsent.push_back((
            pos,
            Rec {
                kind,
                bytes: payload.to_vec(),
            },
        ));
        drop(s);
        if let Some(c) = conn {
            c.wake.notify_one();
        }
        Ok(pos + 1)
    }

    fn durable_lsn(&self) -> Lsn {
        let s = lock(&self.state);
        // A lost grant's records may never be durable: nothing of it counts as such
        // beyond what was acknowledged (and waits ask `durable`, which fails).
        s.acked
    }

    fn start_lsn(&self) -> Lsn {
        0
    }

    fn end_lsn(&self) -> Lsn {
        lock(&self.state).next
    }

    fn durable(&self, lsn: Lsn, _follower: Option<&Follower>) -> Durable {
        let state = self.state.clone();
        Box::pin(std::future::poll_fn(move |cx| {
            let mut s = lock(&state);
            // Acknowledged under this grant's epoch: durable, lost since or not.
            if s.acked >= lsn {
                return Poll::Ready(Ok(()));
            }
            if let Some(e) = &s.failed {
                return Poll::Ready(Err(e.clone()));
            }
            // One waker per task: a future polled again replaces its own.
            s.waiters
                .retain(|(l, w)| !(*l == lsn && w.will_wake(cx.waker())));
            s.waiters.push((lsn, cx.waker().clone()));
            Poll::Pending
        }))
    }

    fn on_durable(&self, lsn: Lsn, _follower: Option<&Follower>, f: OnDurable) {
        let mut s = lock(&self.state);
        if s.acked >= lsn {
            drop(s);
            return f(Ok(()));
        }
        if let Some(e) = s.failed.clone() {
            drop(s);
            return f(Err(e));
        }
        s.callbacks.push((lsn, f));
    }

    /// Not here: a grant's records come from the server a page at a time, awaited
    /// ([`ShardStream::records`]).
    fn read(&self, _from: Lsn, _f: &mut dyn FnMut(Record<'_>)) -> Result<Lsn, Error> {
        Err(Error::Invalid(
            "a grant's records are read with ShardStream::records".into(),
        ))
    }

    fn retire_below(&self, _lsn: Lsn) -> Result<usize, Error> {
        Ok(0)
    }

    fn stats(&self) -> Stats {
        let s = lock(&self.state);
        Stats {
            durable: s.acked,
            end: s.next,
            ..Stats::default()
        }
    }

    fn may_act(&self) -> bool {
        ShardStream::may_act(self)
    }

    fn epoch(&self) -> Option<u64> {
        Some(self.epoch)
    }
}

/// Where the answer to a read (`Recover` or `Fetch`) goes: the `Records` or
/// `Checkpoint` that answered it.
type ReadReply = oneshot::Sender<Result<Body, Error>>;

/// What the connection thread and the streams share.
struct Conn {
    settings: WorkerSettings,
    session: u128,
    /// `CLOCK_BOOTTIME`, or the simulation's ([`Seams`]).
    clock: fn() -> Duration,
    /// How to reach the server, when not by its address ([`Seams`]).
    dial: Option<Dialer>,
    /// Each shard's current grant, if any (sized by the first Welcome).
    slots: Mutex<Vec<Option<Arc<ShardStream>>>>,
    /// Appends, reads and releases wake the connection's writer.
    wake: Notify,
    /// Reads for a shard's recovery: the request (`Recover` or `Fetch`) and its reply.
    reads: mpsc::UnboundedSender<(Body, ReadReply)>,
    events: Mutex<VecDeque<Event>>,
    event: Condvar,
    stop: AtomicBool,
    /// The largest record the server takes (from the Welcome).
    record_max: AtomicU32,
    /// The server's `lease`, `ping_every` and `stuck_after` (from the Welcome).
    timing: Mutex<Timing>,
    /// Calls the server forwards to this worker (their id, the call), for the engine.
    calls_in: mpsc::UnboundedSender<(u64, Call)>,
    /// Their receiving end, until the worker takes it.
    calls_rx: Mutex<Option<mpsc::UnboundedReceiver<(u64, Call)>>>,
    /// Frames to send as they are: answers to forwarded calls.
    outgoing: Mutex<VecDeque<Frame>>,
    /// This worker's own calls through the server, as they are made.
    calls_out: mpsc::UnboundedSender<(Call, CallReply)>,
    /// Calls not answered when a connection broke: sent again on the next.
    calls_again: Mutex<Vec<(Call, CallReply)>>,
    /// Of several servers (a server and its standbys), the one that answered last:
    /// dialled first.
    preferred: std::sync::atomic::AtomicUsize,
}

/// Where the answer to a call through the server goes.
type CallReply = oneshot::Sender<Result<Outcome, Refused>>;

/// The server's times a worker keeps to (docs/flow-server.md §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    pub lease: Duration,
    pub ping_every: Duration,
    pub stuck_after: Duration,
}

/// What [`Worker::connect_here`] is given instead of the address, the boot clock and
/// a random session.
#[derive(Clone)]
pub struct Seams {
    pub dial: Dialer,
    /// Time since some fixed moment, as `CLOCK_BOOTTIME` would give it.
    pub clock: fn() -> Duration,
    pub session: u128,
}

/// Opens a new connection to the server.
pub type Dialer = Arc<
    dyn Fn() -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<Box<dyn Stream>>> + Send>,
        > + Send
        + Sync,
>;

/// The connection's task: given where to say how the first hello went.
type Run = Box<
    dyn FnOnce(First) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send,
>;

/// Told how the first hello went.
type First = Box<dyn FnOnce(Result<(), Error>) + Send>;

impl Conn {
    fn new(
        settings: WorkerSettings,
        session: u128,
        clock: fn() -> Duration,
        dial: Option<Dialer>,
    ) -> (Arc<Conn>, Run) {
        let (reads_tx, reads_rx) = mpsc::unbounded_channel();
        let (calls_in, calls_rx) = mpsc::unbounded_channel();
        let (calls_out, calls_out_rx) = mpsc::unbounded_channel();
        let conn = Arc::new(Conn {
            settings,
            session,
            clock,
            dial,
            slots: Mutex::new(Vec::new()),
            wake: Notify::new(),
            reads: reads_tx,
            events: Mutex::new(VecDeque::new()),
            event: Condvar::new(),
            stop: AtomicBool::new(false),
            record_max: AtomicU32::new(u32::MAX),
            timing: Mutex::new(Timing {
                lease: Duration::from_secs(5),
                ping_every: Duration::from_secs(1),
                stuck_after: Duration::from_secs(10),
            }),
            calls_in,
            calls_rx: Mutex::new(Some(calls_rx)),
            preferred: std::sync::atomic::AtomicUsize::new(0),
            outgoing: Mutex::new(VecDeque::new()),
            calls_out,
            calls_again: Mutex::new(Vec::new()),
        });
        let c = conn.clone();
        let run: Run = Box::new(move |first| Box::pin(run(c, reads_rx, calls_out_rx, first)));
        (conn, run)
    }

    fn emit(&self, e: Event) {
        lock(&self.events).push_back(e);
        self.event.notify_all();
    }

    /// The current grants.
    fn streams(&self) -> Vec<Arc<ShardStream>> {
        lock(&self.slots).iter().flatten().cloned().collect()
    }

    fn current(&self, shard: u32) -> Option<Arc<ShardStream>> {
        lock(&self.slots).get(shard as usize).cloned().flatten()
    }

    /// Lose the grant `s` and hand it back: the `Release` (request `id`) that tells the
    /// server its records end at `end`.
    fn let_go(&self, s: &Arc<ShardStream>, end: u64, why: &str, id: u64) -> Frame {
        self.lose(s, why);
        Frame {
            id,
            body: Body::Release {
                shard: s.shard,
                epoch: s.epoch,
                end,
            },
        }
    }

    /// Lose the grant and drop it from its slot (if it is still the current one).
    fn lose(&self, s: &Arc<ShardStream>, why: &str) {
        {
            let mut slots = lock(&self.slots);
            if let Some(slot) = slots.get_mut(s.shard as usize)
                && slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, s))
            {
                *slot = None;
            }
        }
        if s.lose(why) {
            self.emit(Event::Lost {
                shard: s.shard,
                epoch: s.epoch,
                why: why.to_string(),
            });
        }
    }
}

/// A worker's connection (module doc).
pub struct Worker {
    conn: Arc<Conn>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// [`Worker::connect_here`]'s task.
    task: Option<tokio::task::AbortHandle>,
    /// The calls the server forwards, until the engine takes them.
    calls: Mutex<Option<mpsc::UnboundedReceiver<(u64, Call)>>>,
}

/// Answers calls the server forwarded to a worker, and makes calls through the server,
/// without keeping the worker's connection open.
#[derive(Clone)]
pub struct Caller {
    conn: Weak<Conn>,
}

impl Caller {
    /// Answer the forwarded call `id`.
    pub fn answer(&self, id: u64, outcome: Outcome) {
        self.send_one_way(Body::Answer { call: id, outcome });
    }

    /// Send `body`, which the server answers not.
    fn send_one_way(&self, body: Body) {
        if let Some(conn) = self.conn.upgrade() {
            lock(&conn.outgoing).push_back(Frame { id: 0, body });
            conn.wake.notify_one();
        }
    }

    /// Tell the server that `run` of the grant of `shard` at `epoch` is parked (not
    /// durable, not answered: docs/flow-server.md §10).
    pub fn parked(&self, shard: u32, epoch: u64, run: &str, reason: &str) {
        self.send_one_way(Body::Parked {
            shard,
            epoch,
            run: run.to_string(),
            reason: reason.to_string(),
        });
    }

    /// Whether the worker's connection is still wanted (the engine not closing).
    pub fn is_open(&self) -> bool {
        self.conn
            .upgrade()
            .is_some_and(|c| !c.stop.load(Ordering::SeqCst))
    }

    /// Make `call` through the server (docs/flow-server.md §9). A call the connection
    /// breaks under is sent again on the next one (its key makes that safe); the worker
    /// stopping, or no answer within [`CALL_WITHIN`], answers `Unavailable`.
    pub async fn call(&self, call: Call) -> Result<Outcome, Refused> {
        let unavailable = Refused::Unavailable {
            retry_after_ms: 1000,
        };
        let (tx, rx) = oneshot::channel();
        match self.conn.upgrade() {
            Some(conn) if !conn.stop.load(Ordering::SeqCst) => {
                if conn.calls_out.send((call, tx)).is_err() {
                    return Err(unavailable);
                }
            }
            _ => return Err(unavailable),
        }
        match tokio::time::timeout(CALL_WITHIN, rx).await {
            Ok(Ok(answer)) => answer,
            _ => Err(unavailable),
        }
    }
}

/// The longest a worker waits for the answer to a call through the server: the server
/// answers within `call_wait` + `lease` while it is reachable.
pub const CALL_WITHIN: Duration = Duration::from_secs(60);

impl Worker {
    /// Start connecting; returns once the server answered the first hello (or with why
    /// it did not). Shards come as [`Event::Granted`].
    pub fn connect(settings: WorkerSettings) -> Result<Worker, Error> {
        let session = {
            use ferry_core::seams::{Rng, SplitMix64};
            let mut r = SplitMix64::from_entropy();
            (u128::from(r.next_u64()) << 64) | u128::from(r.next_u64())
        };
        let (conn, run) = Conn::new(settings, session, boot_now, None);
        // A std channel: `connect` may be called from inside a runtime.
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        let first: First = Box::new(move |r| {
            let _ = first_tx.send(r);
        });
        let thread = std::thread::Builder::new()
            .name("ferry-flow-worker".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a current-thread runtime builds");
                rt.block_on(run(first));
            })
            .map_err(|e| Error::Io {
                what: "start the worker's connection thread",
                source: Arc::new(e),
            })?;
        match first_rx.recv() {
            Ok(Ok(())) => Ok(Worker::of(conn, Some(thread), None)),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(Error::Closed),
        }
    }

    /// [`Worker::connect`] as a task on the caller's runtime, with the seams a
    /// simulation replaces (tests/sim.rs of ferry-flow-server): one thread and tokio's
    /// clock can then run a server and its workers alike from a seed. Dropping this
    /// worker is its process dying: the task is aborted, nothing is handed back.
    pub async fn connect_here(settings: WorkerSettings, seams: Seams) -> Result<Worker, Error> {
        let (conn, run) = Conn::new(settings, seams.session, seams.clock, Some(seams.dial));
        let (first_tx, first_rx) = oneshot::channel();
        let first: First = Box::new(move |r| {
            let _ = first_tx.send(r);
        });
        let task = tokio::spawn(run(first)).abort_handle();
        match first_rx.await {
            Ok(Ok(())) => Ok(Worker::of(conn, None, Some(task))),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::Closed),
        }
    }

    fn of(
        conn: Arc<Conn>,
        thread: Option<std::thread::JoinHandle<()>>,
        task: Option<tokio::task::AbortHandle>,
    ) -> Worker {
        let calls = lock(&conn.calls_rx).take();
        Worker {
            conn,
            thread,
            task,
            calls: Mutex::new(calls),
        }
    }

    /// The shard's current grant, if this worker holds it.
    pub fn stream(&self, shard: u32) -> Option<Arc<ShardStream>> {
        self.conn.current(shard)
    }

    /// How many shards the server spreads runs over.
    pub fn shards(&self) -> u32 {
        lock(&self.conn.slots).len() as u32
    }

    /// The next event, waiting up to `wait`.
    pub fn next_event(&self, wait: Duration) -> Option<Event> {
        let mut q = lock(&self.conn.events);
        let until = Instant::now() + wait;
        loop {
            if let Some(e) = q.pop_front() {
                return Some(e);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            q = self
                .conn
                .event
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Hand the shard back (docs/flow-server.md §8.2): it takes no more appends, and the
    /// `Release` goes once everything appended is acknowledged; then it is lost here.
    pub fn release(&self, shard: u32, epoch: u64) {
        if let Some(s) = self.conn.current(shard).filter(|s| s.epoch == epoch) {
            lock(&s.state).releasing = true;
            self.conn.wake.notify_one();
        }
    }

    /// The server's times, as its last welcome said them.
    pub fn timing(&self) -> Timing {
        *lock(&self.conn.timing)
    }

    /// The calls the server forwards to this worker (their id, the call), to answer with
    /// [`Caller::answer`]; the first asker gets them.
    pub fn take_calls(&self) -> Option<mpsc::UnboundedReceiver<(u64, Call)>> {
        lock(&self.calls).take()
    }

    /// What answers forwarded calls and makes calls through the server.
    pub fn caller(&self) -> Caller {
        Caller {
            conn: Arc::downgrade(&self.conn),
        }
    }

    /// This worker's session (for the server's status).
    pub fn session(&self) -> u128 {
        self.conn.session
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            return;
        }
        self.conn.stop.store(true, Ordering::SeqCst);
        self.conn.wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The connection thread: connect, say hello, serve, and again after a break.
async fn run(
    conn: Arc<Conn>,
    mut reads: mpsc::UnboundedReceiver<(Body, ReadReply)>,
    mut calls: mpsc::UnboundedReceiver<(Call, CallReply)>,
    first: First,
) {
    let mut first = Some(first);
    let mut backoff = Duration::from_millis(100);
    while !conn.stop.load(Ordering::SeqCst) {
        match session(&conn, &mut reads, &mut calls, &mut first).await {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => {
                if let Some(f) = first.take() {
                    f(Err(e));
                    return;
                }
                tracing::debug!(error = %e, "ferry flow worker: the connection broke");
            }
        }
        // Past its deadline (or never confirmed) a grant is lost; the rest wait for the
        // resume. Checked through the backoff too.
        let until = tokio::time::Instant::now() + backoff;
        while tokio::time::Instant::now() < until && !conn.stop.load(Ordering::SeqCst) {
            for s in conn.streams() {
                if lock(&s.state).deadline.is_none_or(|d| (conn.clock)() >= d) {
                    conn.lose(
                        &s,
                        "its lease ran out while the server could not be reached",
                    );
                }
            }
            tokio::select! {
                biased;
                _ = conn.wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
    for s in conn.streams() {
        conn.lose(&s, "the worker stopped");
    }
    // Calls not answered hear that the worker stopped (their senders drop).
    lock(&conn.calls_again).clear();
    calls.close();
}

/// Writes a frame within [`IO_WITHIN`], or says the connection is broken.
async fn send<W: AsyncWrite + Unpin>(w: &mut W, frame: Frame) -> Result<(), Error> {
    match tokio::time::timeout(IO_WITHIN, write_frame(w, &frame)).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(Error::Closed),
    }
}

/// One connection, from hello until it breaks (Err) or the worker stops (Ok).
async fn session(
    conn: &Arc<Conn>,
    reads: &mut mpsc::UnboundedReceiver<(Body, ReadReply)>,
    calls_out: &mut mpsc::UnboundedReceiver<(Call, CallReply)>,
    first: &mut Option<First>,
) -> Result<(), Error> {
    let dialed = match &conn.dial {
        Some(d) => d().await,
        None => dial(&conn.settings.server, &conn.preferred, IO_WITHIN).await,
    };
    let stream = dialed.map_err(|e| Error::Io {
        what: "connect to the flow server",
        source: Arc::new(e),
    })?;
    let (mut rd, mut wr) = tokio::io::split(stream);
    // Resume what is still ours: confirmed, and inside its deadline.
    let resume: Vec<Resume> = conn
        .streams()
        .iter()
        .filter_map(|s| {
            let st = lock(&s.state);
            (st.failed.is_none() && st.deadline.is_some_and(|d| (conn.clock)() < d)).then(|| {
                Resume {
                    shard: s.shard,
                    epoch: s.epoch,
                    acked: st.acked,
                }
            })
        })
        .collect();
    let mut id = 1u64;
    let mut next_id = || {
        id += 1;
        id
    };
    let mut frames_in = FrameReader::default();
    let welcomed = async {
        send(
            &mut wr,
            Frame {
                id: next_id(),
                body: Body::Hello(Hello {
                    version: PROTOCOL,
                    role: Role::Worker,
                    session: conn.session,
                    max_shards: conn.settings.max_shards,
                    token: conn.settings.token.clone(),
                    resume: resume.clone(),
                    name: conn.settings.name.clone(),
                }),
            },
        )
        .await?;
        match tokio::time::timeout(IO_WITHIN, frames_in.next(&mut rd)).await {
            Ok(Ok(Some(Frame {
                body: Body::Welcome(w),
                ..
            }))) => Ok(w),
            Ok(Ok(Some(Frame {
                body: Body::Refused { refused, .. },
                ..
            }))) => Err(Error::Invalid(format!(
                "the flow server refused this worker: {refused}"
            ))),
            Ok(Ok(_)) => Err(Error::Invalid(
                "the flow server did not welcome this worker".into(),
            )),
            Ok(Err(e)) => Err(Error::Invalid(format!("the flow server's welcome: {e}"))),
            Err(_) => Err(Error::Invalid(format!(
                "the flow server did not welcome this worker within {IO_WITHIN:?}"
            ))),
        }
    }
    .await;
    // A server that takes the connection and no hello: the next dial starts with the
    // next server named.
    let welcome = welcomed.inspect_err(|_| {
        conn.preferred.fetch_add(1, Ordering::Relaxed);
    })?;
    let lease = Duration::from_millis(u64::from(welcome.lease_ms));
    let ping_every =
        Duration::from_millis(u64::from(welcome.ping_ms)).max(Duration::from_millis(10));
    conn.record_max.store(welcome.record_max, Ordering::Relaxed);
    *lock(&conn.timing) = Timing {
        lease,
        ping_every,
        stuck_after: Duration::from_millis(u64::from(welcome.stuck_ms)),
    };
    {
        let mut slots = lock(&conn.slots);
        if slots.is_empty() {
            slots.resize(welcome.shards as usize, None);
        }
    }
    // What the welcome resumed keeps going (unacknowledged records are sent again); the
    // rest of what we held is lost.
    for s in conn.streams() {
        let kept = welcome
            .grants
            .iter()
            .any(|g| g.shard == s.shard && g.epoch == s.epoch);
        if kept {
            let mut st = lock(&s.state);
            let again: Vec<_> = st.unacked.drain(..).collect();
            for r in again.into_iter().rev() {
                st.unsent.push_front(r);
            }
            st.oldest_sent = None;
        } else {
            conn.lose(&s, "not resumed: the server had given it up");
        }
    }
    if let Some(f) = first.take() {
        f(Ok(()));
    }
    // Requests in flight: appends by id (their shard, epoch and end), reads by id.
    let mut appends: BTreeMap<u64, (u32, u64, u64)> = BTreeMap::new();
    let mut pending_reads: BTreeMap<u64, ReadReply> = BTreeMap::new();
    let mut pings: BTreeMap<u64, Duration> = BTreeMap::new();
    // This worker's calls in flight, by request id; those a break left unanswered first.
    let mut calls: BTreeMap<u64, (Call, CallReply)> = BTreeMap::new();
    let again: Vec<_> = lock(&conn.calls_again).drain(..).collect();
    for (call, reply) in again {
        let rid = next_id();
        calls.insert(rid, (call.clone(), reply));
        let frame = Frame {
            id: rid,
            body: Body::Call(call),
        };
        if let Err(e) = send(&mut wr, frame).await {
            // For the next connection, with the rest.
            lock(&conn.calls_again).extend(calls.into_values());
            return Err(e);
        }
    }
    let mut tick = tokio::time::interval(ping_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (frames_tx, mut frames) = mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        while let Ok(Some(f)) = frames_in.next(&mut rd).await {
            if frames_tx.send(f).is_err() {
                return;
            }
        }
    });
    let mut heard = tokio::time::Instant::now();
    let result = 'conn: loop {
        if conn.stop.load(Ordering::SeqCst) {
            // Stopping: hand back every grant with nothing unacknowledged (those the
            // engine never took: they came while it closed), so that the server need
            // not keep them for a lease. The rest go as after a crash.
            for s in conn.streams() {
                if let Some(end) = s.settled() {
                    let release = conn.let_go(&s, end, "the worker stopped", next_id());
                    let _ = send(&mut wr, release).await;
                }
            }
            break Ok(());
        }
        let answers: Vec<Frame> = lock(&conn.outgoing).drain(..).collect();
        for a in answers {
            if let Err(e) = send(&mut wr, a).await {
                break 'conn Err(e);
            }
        }
        for s in conn.streams() {
            // Send what was appended, in batches.
            while let Some((first, records)) = s.take_batch() {
                let rid = next_id();
                appends.insert(rid, (s.shard, s.epoch, first + records.len() as u64));
                let frame = Frame {
                    id: rid,
                    body: Body::Append(Append {
                        shard: s.shard,
                        epoch: s.epoch,
                        first,
                        records,
                    }),
                };
                debug_assert!(super::proto::encode(&frame).len() <= FRAME_MAX + 4);
                if let Err(e) = send(&mut wr, frame).await {
                    break 'conn Err(e);
                }
            }
            // A shard being handed back goes once everything is acknowledged.
            let releasing = lock(&s.state).releasing;
            if releasing && let Some(end) = s.settled() {
                let release = conn.let_go(&s, end, "released", next_id());
                if let Err(e) = send(&mut wr, release).await {
                    break 'conn Err(e);
                }
            }
        }
        tokio::select! {
            biased;
            f = frames.recv() => {
                let Some(f) = f else { break Err(Error::Closed) };
                heard = tokio::time::Instant::now();
                if handle(conn, f, &mut appends, &mut pending_reads, &mut pings, &mut calls, lease, ping_every) {
                    tick.reset_immediately();
                }
            }
            _ = tick.tick() => {
                // A server that says nothing for a lease is gone, whatever the socket says.
                if heard.elapsed() > lease {
                    break Err(Error::Invalid("the flow server has been silent for a lease".into()));
                }
                let turns: Vec<Turns> = conn
                    .streams()
                    .iter()
                    .map(|s| Turns { shard: s.shard, epoch: s.epoch, turns: s.turns.load(Ordering::Relaxed) })
                    .collect();
                let rid = next_id();
                pings.insert(rid, (conn.clock)());
                if let Err(e) = send(&mut wr, Frame { id: rid, body: Body::Ping(turns) }).await {
                    break Err(e);
                }
                // Past their deadline, or unacknowledged past the flush timeout: lost,
                // and handed back so the server need not wait for the lease.
                for s in conn.streams() {
                    let (past, acked) = {
                        let st = lock(&s.state);
                        let past = st.deadline.is_some_and(|d| (conn.clock)() >= d)
                            || st.oldest_sent.is_some_and(|t| t.elapsed() > lease);
                        (past, st.acked)
                    };
                    if past {
                        let why = "its lease ran out, or the server did not acknowledge its records within a lease";
                        let release = conn.let_go(&s, acked, why, next_id());
                        if let Err(e) = send(&mut wr, release).await {
                            break 'conn Err(e);
                        }
                    }
                }
            }
            r = reads.recv() => {
                let Some((body, reply)) = r else { break Ok(()) };
                let rid = next_id();
                pending_reads.insert(rid, reply);
                if let Err(e) = send(&mut wr, Frame { id: rid, body }).await {
                    break Err(e);
                }
            }
            c = calls_out.recv() => {
                let Some((call, reply)) = c else { break Ok(()) };
                let rid = next_id();
                let frame = Frame { id: rid, body: Body::Call(call.clone()) };
                calls.insert(rid, (call, reply));
                if let Err(e) = send(&mut wr, frame).await {
                    break Err(e);
                }
            }
            _ = conn.wake.notified() => {}
        }
    };
    reader.abort();
    lock(&conn.calls_again).extend(calls.into_values());
    for (_, reply) in pending_reads {
        let _ = reply.send(Err(Error::Closed));
    }
    result
}
