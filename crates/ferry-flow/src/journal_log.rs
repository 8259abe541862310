//! The log the engine journals to, behind a seam (docs/flow.md §4, "The seam").
//!
//! The engine never names ferry-log's `Log` beyond opening one: every record it writes,
//! every wait for durability and every read at recovery goes through [`JournalLog`].
//! ferry-log implements it on local files; a log that lives elsewhere (a server holding
//! the logs, later) implements the same trait, and workflow code does not change.
//!
//! What an implementation must guarantee, because the engine's guarantees rest on it:
//!
//! 1. `append` returns the position just past the record without waiting for it to be
//!    durable (it may wait for room: a log bounds what is appended and not yet
//!    durable); positions only rise, in the order of the calls.
//! 2. `durable_lsn` never falls, and a record is durable once it passes the record's
//!    end: it survives any crash of this process and of the log's own.
//! 3. Durability is a prefix: when a position is durable, so is everything before it.
//! 4. A wait (`durable`, `on_durable`) resolves `Ok` only once its position is durable,
//!    and with an error if the position can never become so in this log's life (a
//!    failed sync, a closed log, a fenced writer): after such an error the log refuses
//!    further appends until reopened, so nothing is acknowledged on top of a hole.
//! 5. `read` gives every durable record from a position on, in order, byte for byte
//!    as appended; damage is an error, never a record skipped.
//!
//! Over a journal that is not ferry-log on the engine's own directory (see
//! [`crate::EngineBuilder::journal`]) the engine keeps no checkpoints and retires
//! nothing: keeping its history bounded is the journal's owner's job.

use ferry_core::sync::lock;
use ferry_log::{Cycle, Error, Follower, Log, Lsn, Record, Stats};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// A wait for durability: `Ok` once the position is durable, or the error that means
/// it never will be.
pub type Durable = Pin<Box<dyn Future<Output = Result<(), Error>> + Send + 'static>>;

/// What the engine calls once a position is durable, or with the error that stops it.
pub type OnDurable = Box<dyn FnOnce(Result<(), Error>) + Send + 'static>;

/// The log the engine journals to; see the module doc for what an implementation
/// guarantees.
pub trait JournalLog: Send + Sync + 'static {
    /// Append a record of `kind` (0 is reserved) and return the position just past it,
    /// without waiting for it to be durable. An `Io` or `PreviousIo` error means the
    /// journal refuses everything from now on (guarantee 4).
    fn append(&self, kind: u8, payload: &[u8]) -> Result<Lsn, Error>;

    /// Everything before this position is durable.
    fn durable_lsn(&self) -> Lsn;

    /// Where the oldest record still kept starts: reading from here reads them all.
    fn start_lsn(&self) -> Lsn;

    /// The end of the last record appended.
    fn end_lsn(&self) -> Lsn;

    /// Resolves once `lsn` is durable. `follower`, from [`JournalLog::follower`], is
    /// the waiting thread's: the log may wait for it to go idle after waking it.
    fn durable(&self, lsn: Lsn, follower: Option<&Follower>) -> Durable;

    /// Call `f` once `lsn` is durable, or with the error that stops it becoming so: on
    /// whatever thread learns it, right away (so `f` must be short), or at once on this
    /// thread. `f` may hold the last handle to the log and drop it.
    fn on_durable(&self, lsn: Lsn, follower: Option<&Follower>, f: OnDurable);

    /// A handle for a thread that appends in reply to what a sync made durable (a
    /// shard): a log with a writer of its own may wait for it after a sync, so that
    /// those appends ride the next sync. None: this log has no use for one.
    fn follower(&self) -> Option<Follower> {
        None
    }

    /// Call `f` with every durable record at or after `from`, in order; returns the
    /// durable position read up to.
    fn read(&self, from: Lsn, f: &mut dyn FnMut(Record<'_>)) -> Result<Lsn, Error>;

    /// Let go of what lies wholly below `lsn` (the engine keeps it in a checkpoint);
    /// how many pieces (segments) went. Doing nothing is allowed.
    fn retire_below(&self, lsn: Lsn) -> Result<usize, Error>;

    /// Counters for the status file and metrics; zeroes where the log keeps none.
    fn stats(&self) -> Stats;

    /// Keep the last `capacity` cycles of the log's writer for [`JournalLog::take_cycles`]
    /// (`ferry_log::Log::trace_cycles`); a log without a writer of its own keeps none.
    fn trace_cycles(&self, _capacity: usize) {}

    /// The writer's cycles kept since the last call, oldest first.
    fn take_cycles(&self) -> Vec<Cycle> {
        Vec::new()
    }

    /// Whether what this log's writer does may reach the outside world now: a step body
    /// start, a run's result. A log held under a lease (a server-mode shard) answers false once its
    /// lease may have passed to another writer (docs/flow-server.md §5.3); a local log
    /// always may.
    fn may_act(&self) -> bool {
        true
    }

    /// The epoch this log is held under (a server-mode shard's grant); `None` for a log
    /// of the engine's own.
    fn epoch(&self) -> Option<u64> {
        None
    }
}

impl JournalLog for Log {
    fn append(&self, kind: u8, payload: &[u8]) -> Result<Lsn, Error> {
        Log::append(self, kind, payload)
    }

    fn durable_lsn(&self) -> Lsn {
        Log::durable_lsn(self)
    }

    fn start_lsn(&self) -> Lsn {
        Log::start_lsn(self)
    }

    fn end_lsn(&self) -> Lsn {
        Log::end_lsn(self)
    }

    fn durable(&self, lsn: Lsn, follower: Option<&Follower>) -> Durable {
        match follower {
            Some(f) => Box::pin(Log::durable_following(self, lsn, f)),
            None => Box::pin(Log::durable(self, lsn)),
        }
    }

    fn on_durable(&self, lsn: Lsn, follower: Option<&Follower>, f: OnDurable) {
        Log::on_durable(self, lsn, follower, f)
    }

    fn follower(&self) -> Option<Follower> {
        Some(Log::follower(self))
    }

    fn read(&self, from: Lsn, f: &mut dyn FnMut(Record<'_>)) -> Result<Lsn, Error> {
        Log::read(self, from, f)
    }

    fn retire_below(&self, lsn: Lsn) -> Result<usize, Error> {
        Log::retire_below(self, lsn)
    }

    fn stats(&self) -> Stats {
        Log::stats(self)
    }

    fn trace_cycles(&self, capacity: usize) {
        Log::trace_cycles(self, capacity)
    }

    fn take_cycles(&self) -> Vec<Cycle> {
        Log::take_cycles(self)
    }
}

/// A journal's failure as the engine met it: the first error that means the journal
/// refuses everything from then on (a write or sync that failed), kept, and heard by
/// whoever waits for a run that can no longer go on in this process.
#[derive(Default)]
pub(crate) struct Failure {
    error: std::sync::Mutex<Option<Error>>,
    heard: tokio::sync::Notify,
}

impl Failure {
    /// The failure, if the journal failed.
    pub(crate) fn get(&self) -> Option<Error> {
        lock(&self.error).clone()
    }

    /// Resolves with the failure once there is one (at once if there is).
    pub(crate) async fn wait(&self) -> Error {
        loop {
            // Registered before looking, so a failure noted in between is not missed.
            let heard = self.heard.notified();
            tokio::pin!(heard);
            heard.as_mut().enable();
            if let Some(e) = self.get() {
                return e;
            }
            heard.await;
        }
    }

    /// Note `e` if it is such a failure. Takes no lock but its own: called from
    /// wherever an error surfaces, with any of the engine's locks held.
    fn note(&self, e: &Error) {
        if !matches!(e, Error::Io { .. } | Error::PreviousIo { .. }) {
            return;
        }
        let mut error = lock(&self.error);
        if error.is_none() {
            tracing::error!(
                "the journal failed; runs stop in this process and resume from what is \
                 durable when the engine is reopened: {e}"
            );
            *error = Some(e.clone());
        }
        drop(error);
        self.heard.notify_waiters();
    }

    fn noted<T>(&self, r: Result<T, Error>) -> Result<T, Error> {
        if let Err(e) = &r {
            self.note(e);
        }
        r
    }
}

/// The journal as the engine holds it: every failure it reports, however it surfaces
/// (an append, a wait, a read, on any thread), is noted in `failure`, so that callers
/// waiting for runs that can no longer go on hear of it.
pub(crate) struct Watched {
    pub(crate) log: Arc<dyn JournalLog>,
    pub(crate) failure: Arc<Failure>,
}

impl JournalLog for Watched {
    fn append(&self, kind: u8, payload: &[u8]) -> Result<Lsn, Error> {
        self.failure.noted(self.log.append(kind, payload))
    }

    fn durable_lsn(&self) -> Lsn {
        self.log.durable_lsn()
    }

    fn start_lsn(&self) -> Lsn {
        self.log.start_lsn()
    }

    fn end_lsn(&self) -> Lsn {
        self.log.end_lsn()
    }

    fn durable(&self, lsn: Lsn, follower: Option<&Follower>) -> Durable {
        let wait = self.log.durable(lsn, follower);
        let failure = self.failure.clone();
        Box::pin(async move { failure.noted(wait.await) })
    }

    fn on_durable(&self, lsn: Lsn, follower: Option<&Follower>, f: OnDurable) {
        let failure = self.failure.clone();
        self.log
            .on_durable(lsn, follower, Box::new(move |r| f(failure.noted(r))))
    }

    fn follower(&self) -> Option<Follower> {
        self.log.follower()
    }

    fn read(&self, from: Lsn, f: &mut dyn FnMut(Record<'_>)) -> Result<Lsn, Error> {
        self.failure.noted(self.log.read(from, f))
    }

    fn retire_below(&self, lsn: Lsn) -> Result<usize, Error> {
        self.failure.noted(self.log.retire_below(lsn))
    }

    fn stats(&self) -> Stats {
        self.log.stats()
    }

    fn trace_cycles(&self, capacity: usize) {
        self.log.trace_cycles(capacity)
    }

    fn take_cycles(&self) -> Vec<Cycle> {
        self.log.take_cycles()
    }

    fn may_act(&self) -> bool {
        self.log.may_act()
    }

    fn epoch(&self) -> Option<u64> {
        self.log.epoch()
    }
}
