//! A worker's connection to a server (docs/flow-server.md §5.3, §6, §8): one thread with
//! its own runtime that says hello, pings, sends each shard's records as they are
//! appended, hands acknowledgements to the shards' waits, keeps each shard's deadline,
//! and reconnects and resumes after a blip. Each shard it holds is a [`ShardStream`], the
//! [`JournalLog`] its runs journal through.
//!
//! What the engine learns comes as [`Event`]s: a shard granted (recover it and start its
//! runs), lost (stop its runs: nothing of it may leave the process any more), asked back.
//!
//! The engine's side (recovering a granted shard, stopping a lost one) is the next step
//! (docs/flow-server.md §15); this is the connection and the streams.

use super::io::{FrameReader, write_frame};
use super::proto::{
    Append, Body, Frame, Granted, Hello, PROTOCOL, Rec, Refused, Resume, Role, Turns,
};
use crate::journal_log::{Durable, JournalLog, OnDurable};
use ferry_core::sync::lock;
use ferry_log::{Error, Follower, Lsn, Record, Stats};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Notify, mpsc};

/// Where and how to reach the server.
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    /// `unix:/path` or `HOST:PORT`.
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
    /// Shard granted at `epoch`; its records end at `end`: recover it, then run it.
    Granted { shard: u32, epoch: u64 },
    /// Shard no longer held: stop its runs. Every wait on it has ended with `Fenced`.
    Lost { shard: u32, why: String },
    /// The server asks for the shard back (rebalance): stop it, then [`Worker::release`].
    Drain { shard: u32 },
}

/// One shard's journal on the server, as this worker holds it.
pub struct ShardStream {
    shard: u32,
    /// Weak: the connection holds the streams.
    conn: std::sync::Weak<Conn>,
    state: Arc<Mutex<StreamState>>,
    /// Bumped by the shard's thread as it turns (docs/flow-server.md §5.4).
    pub turns: AtomicU64,
}

#[derive(Default)]
struct StreamState {
    /// Held at this epoch (0: not held).
    epoch: u64,
    /// The position after the last record appended.
    next: u64,
    /// Every record before this is durable on the server.
    acked: u64,
    /// Appended, not yet written to the connection.
    unsent: VecDeque<(u64, Rec)>,
    /// Written, not yet acknowledged: sent again after a reconnect.
    unacked: VecDeque<(u64, Rec)>,
    /// No step body may start, and nothing may be released, from this instant on
    /// (`None`: not yet confirmed since the grant).
    deadline: Option<Instant>,
    /// The shard was lost: every append and wait fails with this.
    failed: Option<Error>,
    waiters: Vec<(u64, Waker)>,
    callbacks: Vec<(u64, OnDurable)>,
}

impl ShardStream {
    pub fn shard(&self) -> u32 {
        self.shard
    }

    /// The epoch this worker holds the shard at (0: not held).
    pub fn epoch(&self) -> u64 {
        lock(&self.state).epoch
    }

    /// Whether a step body may start, or a result leave the process, now: the shard is
    /// held and its deadline is ahead (docs/flow-server.md §5.3).
    pub fn may_act(&self) -> bool {
        let s = lock(&self.state);
        s.failed.is_none() && s.epoch > 0 && s.deadline.is_some_and(|d| Instant::now() < d)
    }

    /// The shard is lost: fail every wait, and every append from now on.
    fn lose(&self, why: &str) -> bool {
        let (wakers, callbacks) = {
            let mut s = lock(&self.state);
            if s.failed.is_some() || s.epoch == 0 {
                return false;
            }
            s.failed = Some(Error::Fenced(format!(
                "shard {} at epoch {}: {why}",
                self.shard, s.epoch
            )));
            s.epoch = 0;
            s.unsent.clear();
            s.unacked.clear();
            (
                std::mem::take(&mut s.waiters),
                std::mem::take(&mut s.callbacks),
            )
        };
        let err = lock(&self.state).failed.clone().expect("set above");
        for (_, w) in wakers {
            w.wake();
        }
        for (_, f) in callbacks {
            f(Err(err.clone()));
        }
        true
    }

    /// Granted at `epoch`, the server's records ending at `end`.
    fn grant(&self, epoch: u64, end: u64) {
        let mut s = lock(&self.state);
        *s = StreamState {
            epoch,
            next: end,
            acked: end,
            ..StreamState::default()
        };
    }

    /// The server holds every record before `position` durably.
    fn ack(&self, epoch: u64, position: u64) {
        let (wakers, callbacks) = {
            let mut s = lock(&self.state);
            if s.epoch != epoch || position <= s.acked {
                return;
            }
            s.acked = position.min(s.next);
            let acked = s.acked;
            while s.unacked.front().is_some_and(|(p, _)| *p < acked) {
                s.unacked.pop_front();
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
}

impl JournalLog for ShardStream {
    fn append(&self, kind: u8, payload: &[u8]) -> Result<Lsn, Error> {
        let mut s = lock(&self.state);
        if let Some(e) = &s.failed {
            return Err(e.clone());
        }
        if s.epoch == 0 {
            return Err(Error::Fenced(format!(
                "shard {} is not held by this worker",
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
        if let Some(c) = self.conn.upgrade() {
            c.wake.notify_one();
        }
        Ok(pos + 1)
    }

    fn durable_lsn(&self) -> Lsn {
        lock(&self.state).acked
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
            if s.acked >= lsn {
                return Poll::Ready(Ok(()));
            }
            if let Some(e) = &s.failed {
                return Poll::Ready(Err(e.clone()));
            }
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

    /// Pages from the server (blocking: not from the connection's own thread).
    fn read(&self, from: Lsn, f: &mut dyn FnMut(Record<'_>)) -> Result<Lsn, Error> {
        let mut at = from;
        loop {
            let epoch = self.epoch();
            if epoch == 0 {
                return Err(Error::Fenced(format!("shard {} is not held", self.shard)));
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let conn = self.conn.upgrade().ok_or(Error::Closed)?;
            conn.reads
                .send((self.shard, epoch, at, tx))
                .map_err(|_| Error::Closed)?;
            conn.wake.notify_one();
            drop(conn);
            let page = rx.recv().map_err(|_| Error::Closed)??;
            for rec in &page.0 {
                at += 1;
                f(Record {
                    lsn: at - 1,
                    end: at,
                    kind: rec.kind,
                    payload: &rec.bytes,
                });
            }
            if page.1 {
                return Ok(at);
            }
        }
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
}

type ReadReply = std::sync::mpsc::Sender<Result<(Vec<Rec>, bool), Error>>;

/// What the connection thread and the streams share.
struct Conn {
    settings: WorkerSettings,
    session: u128,
    streams: OnceLock<Vec<Arc<ShardStream>>>,
    /// Appends, reads and releases wake the connection's writer.
    wake: Notify,
    reads: mpsc::UnboundedSender<(u32, u64, u64, ReadReply)>,
    releases: mpsc::UnboundedSender<u32>,
    events: Mutex<VecDeque<Event>>,
    event: Condvar,
    stop: AtomicBool,
    /// The lease figures from the last Welcome.
    lease: Mutex<(Duration, Duration)>,
}

impl Conn {
    fn emit(&self, e: Event) {
        lock(&self.events).push_back(e);
        self.event.notify_all();
    }
}

/// A worker's connection (module doc).
pub struct Worker {
    conn: Arc<Conn>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    /// Start connecting; returns once the server answered the first hello (or with why
    /// it refused). Shards come as [`Event::Granted`].
    pub fn connect(settings: WorkerSettings) -> Result<Worker, Error> {
        let (reads_tx, reads_rx) = mpsc::unbounded_channel();
        let (releases_tx, releases_rx) = mpsc::unbounded_channel();
        let session = {
            use ferry_core::seams::{Rng, SplitMix64};
            let mut r = SplitMix64::from_entropy();
            (u128::from(r.next_u64()) << 64) | u128::from(r.next_u64())
        };
        let conn = Arc::new(Conn {
            settings,
            session,
            streams: OnceLock::new(),
            wake: Notify::new(),
            reads: reads_tx,
            releases: releases_tx,
            events: Mutex::new(VecDeque::new()),
            event: Condvar::new(),
            stop: AtomicBool::new(false),
            lease: Mutex::new((Duration::from_secs(5), Duration::from_secs(1))),
        });
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        let c = conn.clone();
        let thread = std::thread::Builder::new()
            .name("ferry-flow-worker".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a current-thread runtime builds");
                rt.block_on(run(c, reads_rx, releases_rx, first_tx));
            })
            .map_err(|e| Error::Io {
                what: "start the worker's connection thread",
                source: Arc::new(e),
            })?;
        match first_rx.recv() {
            Ok(Ok(())) => Ok(Worker {
                conn,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                conn.stop.store(true, Ordering::SeqCst);
                conn.wake.notify_one();
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(Error::Closed),
        }
    }

    /// The shard's stream (once the server said how many there are).
    pub fn stream(&self, shard: u32) -> Option<Arc<ShardStream>> {
        self.conn.streams.get()?.get(shard as usize).cloned()
    }

    pub fn shards(&self) -> u32 {
        self.conn.streams.get().map_or(0, |s| s.len() as u32)
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

    /// Hand a shard back once its appends are acknowledged (docs/flow-server.md §8.2).
    pub fn release(&self, shard: u32) {
        let _ = self.conn.releases.send(shard);
        self.conn.wake.notify_one();
    }

    /// This worker's session (for the server's status).
    pub fn session(&self) -> u128 {
        self.conn.session
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.conn.stop.store(true, Ordering::SeqCst);
        self.conn.wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

async fn dial(server: &str) -> std::io::Result<Box<dyn Stream>> {
    Ok(match server.strip_prefix("unix:") {
        Some(path) => Box::new(tokio::net::UnixStream::connect(path).await?),
        None => {
            let s = tokio::net::TcpStream::connect(server).await?;
            s.set_nodelay(true)?;
            Box::new(s)
        }
    })
}

/// The connection thread: connect, say hello, serve, and again after a break.
async fn run(
    conn: Arc<Conn>,
    mut reads: mpsc::UnboundedReceiver<(u32, u64, u64, ReadReply)>,
    mut releases: mpsc::UnboundedReceiver<u32>,
    first: std::sync::mpsc::Sender<Result<(), Error>>,
) {
    let mut first = Some(first);
    let mut backoff = Duration::from_millis(100);
    while !conn.stop.load(Ordering::SeqCst) {
        match session(&conn, &mut reads, &mut releases, &mut first).await {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => {
                if let Some(f) = first.take() {
                    let _ = f.send(Err(e));
                    return;
                }
                tracing::debug!(error = %e, "ferry flow worker: the connection broke");
            }
        }
        if conn.stop.load(Ordering::SeqCst) {
            break;
        }
        // Past its deadline a held shard is lost; the rest wait for the resume.
        expire(&conn, false);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
    if let Some(streams) = conn.streams.get() {
        for s in streams {
            if s.lose("the worker stopped") {
                conn.emit(Event::Lost {
                    shard: s.shard,
                    why: "the worker stopped".into(),
                });
            }
        }
    }
}

/// Lose every held shard whose deadline has passed (or, with the connection gone, was
/// never set: a grant not yet confirmed cannot be resumed).
fn expire(conn: &Conn, connected: bool) {
    let Some(streams) = conn.streams.get() else {
        return;
    };
    let now = Instant::now();
    for s in streams {
        let past = {
            let st = lock(&s.state);
            st.epoch > 0
                && st.failed.is_none()
                && match st.deadline {
                    Some(d) => now >= d,
                    None => !connected,
                }
        };
        if past && s.lose("its lease ran out before the server confirmed it again") {
            conn.emit(Event::Lost {
                shard: s.shard,
                why: "lease ran out".into(),
            });
        }
    }
}

/// One connection, from hello until it breaks (Err) or the worker stops (Ok).
async fn session(
    conn: &Arc<Conn>,
    reads: &mut mpsc::UnboundedReceiver<(u32, u64, u64, ReadReply)>,
    releases: &mut mpsc::UnboundedReceiver<u32>,
    first: &mut Option<std::sync::mpsc::Sender<Result<(), Error>>>,
) -> Result<(), Error> {
    let io = |what: &'static str| {
        move |e: std::io::Error| Error::Io {
            what,
            source: Arc::new(e),
        }
    };
    let stream = dial(&conn.settings.server)
        .await
        .map_err(io("connect to the flow server"))?;
    let (mut rd, mut wr) = tokio::io::split(stream);
    // Resume what is still ours: held, and inside its deadline.
    let resume: Vec<Resume> = conn
        .streams
        .get()
        .map(|streams| {
            streams
                .iter()
                .filter_map(|s| {
                    let st = lock(&s.state);
                    (st.epoch > 0 && st.failed.is_none()).then(|| Resume {
                        shard: s.shard,
                        epoch: st.epoch,
                        acked: st.acked,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let mut id = 1u64;
    let mut next_id = || {
        id += 1;
        id
    };
    write_frame(
        &mut wr,
        &Frame {
            id: next_id(),
            body: Body::Hello(Hello {
                version: PROTOCOL,
                role: Role::Worker,
                session: conn.session,
                max_shards: conn.settings.max_shards,
                token: conn.settings.token.clone(),
                resume,
                name: conn.settings.name.clone(),
            }),
        },
    )
    .await
    .map_err(io("send the hello"))?;
    let mut frames_in = FrameReader::default();
    let welcome = match frames_in.next(&mut rd).await {
        Ok(Some(Frame {
            body: Body::Welcome(w),
            ..
        })) => w,
        Ok(Some(Frame {
            body: Body::Refused { refused, .. },
            ..
        })) => {
            return Err(Error::Invalid(format!(
                "the flow server refused this worker: {refused}"
            )));
        }
        Ok(_) => {
            return Err(Error::Invalid(
                "the flow server did not welcome this worker".into(),
            ));
        }
        Err(e) => return Err(Error::Invalid(format!("the flow server's welcome: {e}"))),
    };
    let lease = Duration::from_millis(u64::from(welcome.lease_ms));
    let ping_every =
        Duration::from_millis(u64::from(welcome.ping_ms)).max(Duration::from_millis(10));
    *lock(&conn.lease) = (lease, ping_every);
    let streams = conn.streams.get_or_init(|| {
        (0..welcome.shards)
            .map(|shard| {
                Arc::new(ShardStream {
                    shard,
                    conn: Arc::downgrade(conn),
                    state: Arc::new(Mutex::new(StreamState::default())),
                    turns: AtomicU64::new(0),
                })
            })
            .collect()
    });
    // What the welcome resumed keeps going (unacknowledged records are sent again); the
    // rest of what we held is lost.
    let resumed: HashMap<u32, &Granted> = welcome.grants.iter().map(|g| (g.shard, g)).collect();
    for s in streams {
        let keep = {
            let mut st = lock(&s.state);
            match resumed.get(&s.shard) {
                Some(g) if st.epoch == g.epoch && st.failed.is_none() => {
                    let again: Vec<_> = st.unacked.drain(..).collect();
                    for r in again.into_iter().rev() {
                        st.unsent.push_front(r);
                    }
                    true
                }
                _ => st.epoch == 0,
            }
        };
        if !keep && s.lose("not resumed: the server had given it up") {
            conn.emit(Event::Lost {
                shard: s.shard,
                why: "not resumed".into(),
            });
        }
    }
    if let Some(f) = first.take() {
        let _ = f.send(Ok(()));
    }
    // Requests in flight: appends by id (to know a refused one's shard), reads by id.
    let mut appends: HashMap<u64, (u32, u64)> = HashMap::new();
    let mut pending_reads: HashMap<u64, ReadReply> = HashMap::new();
    let mut pings: HashMap<u64, Instant> = HashMap::new();
    let mut tick = tokio::time::interval(ping_every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (frames_tx, mut frames) = mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        loop {
            match frames_in.next(&mut rd).await {
                Ok(Some(f)) => {
                    if frames_tx.send(f).is_err() {
                        return;
                    }
                }
                _ => return,
            }
        }
    });
    let result = loop {
        if conn.stop.load(Ordering::SeqCst) {
            break Ok(());
        }
        // Send what was appended, shard by shard.
        let mut broken = false;
        for s in streams {
            let batch = {
                let mut st = lock(&s.state);
                if st.epoch == 0 || st.unsent.is_empty() {
                    continue;
                }
                let taken: Vec<(u64, Rec)> = st.unsent.drain(..).collect();
                st.unacked.extend(taken.iter().cloned());
                (st.epoch, taken)
            };
            let (epoch, taken) = batch;
            let first = taken[0].0;
            let rid = next_id();
            appends.insert(rid, (s.shard, first + taken.len() as u64));
            if write_frame(
                &mut wr,
                &Frame {
                    id: rid,
                    body: Body::Append(Append {
                        shard: s.shard,
                        epoch,
                        first,
                        records: taken.into_iter().map(|(_, r)| r).collect(),
                    }),
                },
            )
            .await
            .is_err()
            {
                broken = true;
                break;
            }
        }
        if broken {
            break Err(Error::Closed);
        }
        tokio::select! {
            biased;
            f = frames.recv() => {
                let Some(f) = f else { break Err(Error::Closed) };
                if handle(conn, streams, f, &mut appends, &mut pending_reads, &mut pings, lease, ping_every) {
                    tick.reset_immediately();
                }
            }
            _ = tick.tick() => {
                expire(conn, true);
                let turns: Vec<Turns> = streams
                    .iter()
                    .filter_map(|s| {
                        let epoch = s.epoch();
                        (epoch > 0).then(|| Turns { shard: s.shard, epoch, turns: s.turns.load(Ordering::Relaxed) })
                    })
                    .collect();
                let rid = next_id();
                pings.insert(rid, Instant::now());
                if write_frame(&mut wr, &Frame { id: rid, body: Body::Ping(turns) }).await.is_err() {
                    break Err(Error::Closed);
                }
            }
            r = reads.recv() => {
                let Some((shard, epoch, from, reply)) = r else { break Ok(()) };
                let rid = next_id();
                pending_reads.insert(rid, reply);
                if write_frame(&mut wr, &Frame { id: rid, body: Body::Recover { shard, epoch, from, max_bytes: 1 << 20 } }).await.is_err() {
                    break Err(Error::Closed);
                }
            }
            r = releases.recv() => {
                let Some(shard) = r else { break Ok(()) };
                let s = &streams[shard as usize];
                let (epoch, end) = { let st = lock(&s.state); (st.epoch, st.acked) };
                if epoch > 0 {
                    s.lose("released");
                    let rid = next_id();
                    if write_frame(&mut wr, &Frame { id: rid, body: Body::Release { shard, epoch, end } }).await.is_err() {
                        break Err(Error::Closed);
                    }
                }
            }
            _ = conn.wake.notified() => {}
        }
    };
    reader.abort();
    for (_, reply) in pending_reads {
        let _ = reply.send(Err(Error::Closed));
    }
    result
}

/// One frame from the server; true: ping at once (new shards want a deadline).
#[allow(clippy::too_many_arguments)]
fn handle(
    conn: &Conn,
    streams: &[Arc<ShardStream>],
    f: Frame,
    appends: &mut HashMap<u64, (u32, u64)>,
    reads: &mut HashMap<u64, ReadReply>,
    pings: &mut HashMap<u64, Instant>,
    lease: Duration,
    ping_every: Duration,
) -> bool {
    let stream = |shard: u32| streams.get(shard as usize);
    match f.body {
        Body::Grant(grants) => {
            for g in grants {
                if let Some(s) = stream(g.shard) {
                    s.grant(g.epoch, g.end);
                    conn.emit(Event::Granted {
                        shard: g.shard,
                        epoch: g.epoch,
                    });
                }
            }
            return true;
        }
        Body::Durable(ps) => {
            for p in ps {
                if let Some(s) = stream(p.shard) {
                    s.ack(p.epoch, p.position);
                }
                appends.retain(|_, &mut (shard, end)| shard != p.shard || end > p.position);
            }
        }
        Body::Pong(held) => {
            let Some(sent) = pings.remove(&f.id) else {
                return false;
            };
            // Older pings' answers are superseded by this one.
            pings.retain(|&id, _| id > f.id);
            let margin = lease.mul_f64(conn.settings.drift) + ping_every / 4;
            let deadline = sent + lease.saturating_sub(margin);
            for s in streams {
                let mut st = lock(&s.state);
                if st.epoch == 0 || st.failed.is_some() {
                    continue;
                }
                if held
                    .iter()
                    .any(|h| h.shard == s.shard && h.epoch == st.epoch)
                {
                    st.deadline = Some(deadline);
                } else if st.deadline.is_some() {
                    // Confirmed before and not now: the server no longer counts it ours.
                    drop(st);
                    if s.lose("the server no longer confirms it") {
                        conn.emit(Event::Lost {
                            shard: s.shard,
                            why: "not confirmed".into(),
                        });
                    }
                }
            }
        }
        Body::Revoke { shard, .. } => {
            if let Some(s) = stream(shard)
                && s.lose("revoked by the server")
            {
                conn.emit(Event::Lost {
                    shard,
                    why: "revoked".into(),
                });
            }
        }
        Body::Drain { shard, .. } => conn.emit(Event::Drain { shard }),
        Body::Records(r) => {
            if let Some(reply) = reads.remove(&f.id) {
                let _ = reply.send(Ok((r.records, r.last)));
            }
        }
        Body::Refused { to, refused } => {
            if let Some(reply) = reads.remove(&to) {
                let _ = reply.send(Err(refused_error(&refused)));
            }
            if let Some((shard, _)) = appends.remove(&to)
                && let Some(s) = stream(shard)
            {
                let why = refused.to_string();
                if s.lose(&why) {
                    conn.emit(Event::Lost { shard, why });
                }
            }
        }
        _ => {}
    }
    false
}

fn refused_error(r: &Refused) -> Error {
    if r.is_fenced() {
        Error::Fenced(r.to_string())
    } else {
        Error::Invalid(r.to_string())
    }
}
