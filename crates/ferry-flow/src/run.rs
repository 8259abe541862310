//! One run as its workflow code reaches the engine: the [`Host`] interface (everything
//! `ctx.rs` may ask of the engine, and nothing more), the run's per-generation state
//! ([`RunCtx`]: its journal cursor, its limits' counts, where its last record ends), its
//! wake-up ([`Wake`]) and its place among its shard's running runs ([`Place`]).
//!
//! `ctx.rs` depends on this module only; the engine implements [`Host`]. So the code
//! that workflows call never locks the engine's run map or reaches into its fields.

use crate::api::{FlowError, Limit, Limits};
use crate::journal::{Entry, Json, Outcome, RECORD_KIND};
use crate::journal_log::{Failure, JournalLog};
use crate::metrics::Counters;
use crate::replay::Replay;
use ferry_log::Lsn;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;
use tokio::sync::{Notify, oneshot};

/// What a run's code may ask of its engine (implemented by the engine's shared state).
pub(crate) trait Host: Send + Sync {
    /// The journal `run`'s records go to (its shard's).
    fn journal(&self, run: &str) -> Arc<dyn JournalLog>;
    /// The journal's failure, once it failed: a run waiting on another run races it.
    fn failure(&self) -> &Arc<Failure>;
    fn limits(&self) -> &Limits;
    fn counters(&self) -> &Counters;
    /// The wall clock in ms by the engine's clock.
    fn wall_ms(&self) -> u64;
    /// A random u64 from the engine's generator (seeded in a simulation).
    fn random_u64(&self) -> u64;
    /// `run`'s wake-up (shared with its inbox) and cancellation flag.
    fn wake_of(&self, run: &str) -> Arc<Wake>;
    /// The `index`th signal named `name` that `run` received.
    fn signal_at(&self, run: &str, name: &str, index: u32) -> Option<Json>;
    /// `run` consumed one signal from its inbox.
    fn consumed_one(&self, run: &str);
    /// Make `value` what a query of `run` returns.
    fn publish(&self, run: &str, value: Json);
    /// Start run `id` of `workflow` as a child of `parent`; the end of its start record.
    fn start_child(
        &self,
        workflow: &str,
        id: &str,
        input: Json,
        parent: &str,
    ) -> Result<Lsn, FlowError>;
    /// How run `id` stands for a parent waiting on it: finished, or a receiver told its
    /// status when it settles. An error if the engine does not know it.
    fn watch(&self, id: &str) -> Result<Watch, FlowError>;
    /// Deliver signal `name` to run `id` once per `key`, wherever it is (on a worker,
    /// through the server for a shard another worker holds).
    fn send_signal(
        &self,
        id: String,
        name: String,
        value: Json,
        key: String,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), FlowError>>>>;
    /// Ask run `id` to cancel, in the background (a cancelled parent's child).
    fn cancel_later(&self, id: String);
}

/// What [`Host::watch`] finds.
pub(crate) enum Watch {
    Finished(Outcome),
    /// Told the run's status when it settles (finished or parked).
    Waiting(oneshot::Receiver<crate::api::RunStatus>),
}

/// A run's wake-up on arrivals, and its cancellation flag.
#[derive(Default)]
pub(crate) struct Wake {
    pub(crate) arrived: Notify,
    pub(crate) cancel: std::sync::atomic::AtomicBool,
}

/// A run's place among its shard's running runs (`EngineBuilder::max_running`), from
/// generation to generation.
pub(crate) struct Place {
    /// The shard's places; `None`: no bound.
    places: Option<Arc<tokio::sync::Semaphore>>,
    held: RefCell<Option<tokio::sync::OwnedSemaphorePermit>>,
}

impl Place {
    /// Wait for a place (in order), and hold it.
    pub(crate) async fn take(
        places: Option<Arc<tokio::sync::Semaphore>>,
        shared: &dyn Host,
    ) -> Place {
        let place = Place {
            places,
            held: RefCell::new(None),
        };
        place.acquire(shared).await;
        place
    }

    async fn acquire(&self, shared: &dyn Host) {
        let Some(places) = &self.places else { return };
        // Counted only when the run has to wait.
        let permit = match places.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                shared.counters().waiting(1);
                let p = places.clone().acquire_owned().await;
                shared.counters().waiting(-1);
                p.expect("a shard's places are never closed")
            }
        };
        *self.held.borrow_mut() = Some(permit);
    }

    /// Give up the place for a wait: another run takes it meanwhile. Whether this run
    /// held one (a run whose code waits on two things at once may not).
    pub(crate) fn leave(&self) -> bool {
        self.held.borrow_mut().take().is_some()
    }

    /// Back from a wait: take a place again (waiting for one) if the run gave one up.
    /// Boxed: a run parked for days keeps no room in its wait for what it does after.
    pub(crate) async fn back(&self, shared: &dyn Host, held: bool) {
        if held {
            Box::pin(self.acquire(shared)).await;
        }
    }
}

/// One generation of one run, as its code sees it from the context.
pub(crate) struct RunCtx {
    /// Its place among the shard's running runs.
    pub(crate) place: Rc<Place>,
    pub(crate) shared: Arc<dyn Host>,
    pub(crate) run: String,
    pub(crate) generation: u32,
    pub(crate) replay: RefCell<Replay>,
    /// The end of this run's last record: what anything leaving the process waits for.
    pub(crate) last: Cell<Lsn>,
    /// Signals consumed so far, by name, this generation and before it.
    pub(crate) consumed: RefCell<BTreeMap<String, u32>>,
    /// The run observed its cancellation (journaled `CancelSeen`).
    pub(crate) cancel_seen: Cell<bool>,
    /// Entries at positions this generation (the history limit).
    history: Cell<u32>,
    /// Sleeps pending now (the timers limit).
    pub(crate) timers: Cell<u32>,
    /// Set by `ctx.continue_as_new`.
    pub(crate) next_input: RefCell<Option<Json>>,
    /// The run's wake-up on arrivals and its cancellation flag.
    pub(crate) wake: Arc<Wake>,
    /// Its shard's journal, looked up once.
    pub(crate) journal: Arc<dyn JournalLog>,
    /// A step met its shard's fence (the shard's lease may be another worker's): the
    /// run journals nothing more in this process, whatever its code makes of the error,
    /// and resumes wherever the shard is held next.
    pub(crate) fenced: Cell<bool>,
}

thread_local! {
    /// Where a run's records are encoded on their way to the log: one buffer per
    /// thread, reused from record to record, rather than one allocated (and grown past
    /// its first guess) per record.
    static ENCODED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// `ENCODED` is let go of once a record took it past this.
const ENCODED_KEEP: usize = 64 << 10;

impl RunCtx {
    pub(crate) fn new(
        shared: Arc<dyn Host>,
        place: Rc<Place>,
        (run, generation): (String, u32),
        replay: Replay,
        last: Lsn,
    ) -> RunCtx {
        let (consumed, cancel_seen) = match replay.started() {
            Some(Entry::Started {
                consumed,
                cancel_seen,
                ..
            }) => (consumed.clone(), *cancel_seen),
            _ => (BTreeMap::new(), false),
        };
        let wake = shared.wake_of(&run);
        let journal = shared.journal(&run);
        RunCtx {
            place,
            wake,
            journal,
            fenced: Cell::new(false),
            shared,
            run,
            generation,
            history: Cell::new(replay.entries()),
            replay: RefCell::new(replay),
            last: Cell::new(last),
            consumed: RefCell::new(consumed),
            cancel_seen: Cell::new(cancel_seen),
            timers: Cell::new(0),
            next_input: RefCell::new(None),
        }
    }

    /// `e` as a run's error; a fence (its shard's lease is over, wherever it surfaced)
    /// marks the run fenced, so it journals nothing more here.
    pub(crate) fn fenced_by(&self, e: ferry_log::Error) -> FlowError {
        if matches!(e, ferry_log::Error::Fenced(_)) {
            self.fenced.set(true);
        }
        FlowError::Log(e)
    }

    /// The error of a run that met its shard's fence.
    pub(crate) fn fence(&self) -> FlowError {
        FlowError::Log(ferry_log::Error::Fenced(format!(
            "run {}: its shard's lease may have passed to another worker; it journals \
             nothing more here and resumes where the shard is held next",
            self.run
        )))
    }

    /// Is there room in the history for one more call?
    pub(crate) fn room(&self) -> Result<(), FlowError> {
        let max = self.shared.limits().history;
        if self.history.get() >= max {
            return Err(FlowError::LimitExceeded {
                limit: Limit::History,
                value: u64::from(self.history.get()) + 1,
                max: u64::from(max),
            });
        }
        Ok(())
    }

    /// Journal `entry` at `pos` (None: an arrival), within the run's limits. Encoded
    /// into this thread's buffer (`ENCODED`), which the log copies from.
    pub(crate) fn append(&self, pos: Option<u32>, entry: &Entry) -> Result<(), FlowError> {
        self.replay.borrow().check()?;
        if self.fenced.get() {
            return Err(self.fence());
        }
        // The history limit is checked when a call begins (its first entry; a step
        // checks before its body runs, see `room`): what completes a call already
        // begun, or ends the run, is always journaled.
        let begins = matches!(
            entry,
            Entry::TimerSet { .. }
                | Entry::TimerRefused { .. }
                | Entry::WaitStarted { .. }
                | Entry::Value { .. }
                | Entry::Patch { .. }
                | Entry::ChildStarted { .. }
        );
        if begins {
            self.room()?;
        }
        let end = ENCODED.with_borrow_mut(|bytes| {
            bytes.clear();
            crate::journal::encode_into(bytes, &self.run, self.generation, pos, entry);
            let r = crate::api::check_payload(self.shared.limits(), bytes.len()).and_then(|()| {
                self.journal
                    .append(RECORD_KIND, bytes)
                    .map_err(|e| self.fenced_by(e))
            });
            // A rare large record does not stay allocated on the shard.
            if bytes.capacity() > ENCODED_KEEP {
                *bytes = Vec::new();
            }
            r
        })?;
        self.last.set(end);
        if pos.is_some() {
            self.history.set(self.history.get() + 1);
        }
        Ok(())
    }
}
