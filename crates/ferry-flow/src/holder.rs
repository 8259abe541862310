//! An engine that is a server's worker (`EngineBuilder::server`, docs/flow-server.md
//! §1, §5.3, §7, §8): its shards come and go with the server's grants.
//!
//! One thread, the holder, hears the connection's events and changes the shards:
//!
//! - **Granted**: read the shard's records from the server, rebuild its runs as an open
//!   does (`recovery.rs`), put its lane in place (its journal is the grant's stream)
//!   and start its thread. A grant of a shard whose previous thread has not ended yet
//!   (a step body blocking it) waits for that thread: two threads never run one
//!   shard's runs, so nothing of an old grant can act under a new one.
//! - **Lost**: put a vacant lane in place (calls about its runs are refused as not
//!   held), ask its thread to stop (its runs are dropped where they wait; they resume
//!   wherever the shard is granted next) and forget its runs.
//! - **Drain**: hand the shard back (`Worker::release`: no step body starts, the
//!   release goes once what was appended is acknowledged); then it is lost.
//! - **Stuck**: a shard whose thread has not turned for `stuck_after` is handed back
//!   the same way (the server would revoke it).
//!
//! Closing hands every shard back and waits, up to a lease, for each to go, then up to
//! another for the shard threads to end (one a step body blocks is left behind).
//!
//! The holder does one thing at a time: while it recovers a grant (reading pages from
//! the server, waiting for the grant's confirmation), other shards' events wait. Their
//! streams are fenced by the connection whatever the holder does; what waits is only
//! the engine's view (`NotHeld`, forgotten runs).

use crate::api::FlowError;
use crate::checkpoint::Folded;
use crate::journal_log::{Durable, JournalLog, OnDurable, Watched};
use crate::recovery::{Journaled, journaled_of, recover_run};
use crate::remote::worker::{Event, ShardStream, Worker};
use crate::shard::Shard;
use crate::shared::{Lane, Shared};
use ferry_core::sync::lock;
use ferry_log::{Error, Follower, Lsn, Record, Stats};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::time::Instant;

/// The journal of a shard this worker does not hold: it takes nothing.
pub(crate) struct Vacant {
    pub(crate) what: String,
}

impl Vacant {
    fn refusal(&self) -> Error {
        Error::Fenced(format!("{} is not held by this worker", self.what))
    }
}

impl JournalLog for Vacant {
    fn append(&self, _kind: u8, _payload: &[u8]) -> Result<Lsn, Error> {
        Err(self.refusal())
    }

    fn durable_lsn(&self) -> Lsn {
        0
    }

    fn start_lsn(&self) -> Lsn {
        0
    }

    fn end_lsn(&self) -> Lsn {
        0
    }

    fn durable(&self, lsn: Lsn, _follower: Option<&Follower>) -> Durable {
        let r = if lsn == 0 {
            Ok(())
        } else {
            Err(self.refusal())
        };
        Box::pin(std::future::ready(r))
    }

    fn on_durable(&self, lsn: Lsn, _follower: Option<&Follower>, f: OnDurable) {
        f(if lsn == 0 {
            Ok(())
        } else {
            Err(self.refusal())
        })
    }

    fn read(&self, from: Lsn, _f: &mut dyn FnMut(Record<'_>)) -> Result<Lsn, Error> {
        Ok(from)
    }

    fn retire_below(&self, _lsn: Lsn) -> Result<usize, Error> {
        Ok(0)
    }

    fn stats(&self) -> Stats {
        Stats::default()
    }

    fn may_act(&self) -> bool {
        false
    }
}

/// A granted shard's journal as the server holds it: its newest checkpoint, and the
/// records after it (docs/flow-server.md §7).
async fn journal_of(stream: &ShardStream) -> Result<Journaled, FlowError> {
    let folded = match stream.checkpoint().await? {
        None => Folded::default(),
        Some((position, bytes)) => {
            let mut folded = Folded::decode(&bytes).map_err(|e| FlowError::Damaged {
                what: format!(
                    "shard {}'s checkpoint at {position} on the server",
                    stream.shard()
                ),
                reason: e.to_string(),
                hint: "the server's copy is damaged: restore the server's directory from a copy"
                    .into(),
            })?;
            folded.lsn = position;
            folded
        }
    };
    let records = stream.records(folded.lsn).await?;
    journaled_of(folded, &mut |from, f| {
        for (i, rec) in records.iter().enumerate() {
            f(Record {
                lsn: from + i as u64,
                end: from + i as u64 + 1,
                kind: rec.kind,
                payload: &rec.bytes,
            });
        }
        Ok(from + records.len() as u64)
    })
}

/// The lane of shard `shard` while this worker does not hold it.
pub(crate) fn vacant_lane(shard: usize, running: Option<usize>) -> Arc<Lane> {
    let journal = Arc::new(Vacant {
        what: format!("shard {shard}"),
    });
    Lane::new(journal, None, None, running).0
}

/// The holder thread (or, on the caller's thread, task) and what it shares with the
/// engine.
pub(crate) struct Holder {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    task: Option<tokio::task::AbortHandle>,
}

/// A shard this worker holds.
struct Held {
    epoch: u64,
    stream: Arc<ShardStream>,
    thread: Shard,
    /// Its turn count when last looked at, and since when it stands there.
    turns: (u64, Instant),
    /// Being handed back.
    releasing: bool,
}

/// The holder thread's state.
struct Holding {
    shared: Arc<Shared>,
    worker: Arc<Worker>,
    running: Option<usize>,
    held: Vec<Option<Held>>,
    /// Threads of shards lost, until they end.
    ending: Vec<Option<Shard>>,
    /// Grants waiting for the shard's previous thread to end.
    waiting: Vec<(u32, u64)>,
    /// Drains of grants not taken yet (the server may ask for a shard back before its
    /// grant arrives): handed back as soon as they are.
    drained: Vec<(u32, u64)>,
    /// How long a finished run stays in the runs map ([`Holding::sweep`]).
    retention: Duration,
    /// Where the sweep goes on from (None: the start of the map), and when it last
    /// looked.
    swept_to: Option<String>,
    swept_at: Instant,
}

/// Runs the sweep looks at each time: the runs map's lock is held for a slice, not for
/// the whole map.
const SWEEP_SLICE: usize = 4096;
/// How often the sweep looks at a slice.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

impl Holder {
    /// Start holding for `shared`, whose lanes are vacant, over `worker`'s connection.
    pub(crate) fn start(
        shared: Arc<Shared>,
        worker: Worker,
        running: Option<usize>,
        retention: Duration,
    ) -> Result<Holder, std::io::Error> {
        let worker = Arc::new(worker);
        let stop = Arc::new(AtomicBool::new(false));
        let shards = shared.lanes.len();
        let mut holding = Holding {
            shared,
            worker,
            running,
            held: (0..shards).map(|_| None).collect(),
            ending: (0..shards).map(|_| None).collect(),
            waiting: Vec::new(),
            drained: Vec::new(),
            retention,
            swept_to: None,
            swept_at: Instant::now(),
        };
        let stopping = stop.clone();
        if holding.shared.here.is_some() {
            // On the caller's thread (a simulation): a task that looks for events every
            // millisecond of tokio's clock. Dropping the engine aborts it: a kill, with
            // nothing handed back.
            let task = tokio::task::spawn_local(async move {
                while !stopping.load(Ordering::SeqCst) {
                    holding.turn(Duration::ZERO).await;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            });
            return Ok(Holder {
                stop,
                thread: None,
                task: Some(task.abort_handle()),
            });
        }
        let thread = std::thread::Builder::new()
            .name("ferry-flow-holder".into())
            .spawn(move || {
                // Its own runtime, for the awaits of recovery (reads from the server);
                // the events are waited for blocking, nothing else runs here.
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                    .expect("a current-thread runtime builds");
                rt.block_on(async move {
                    while !stopping.load(Ordering::SeqCst) {
                        holding.turn(Duration::from_millis(50)).await;
                    }
                    holding.close().await;
                });
            })?;
        Ok(Holder {
            stop,
            thread: Some(thread),
            task: None,
        })
    }
}

/// Dropping the holder hands every shard back, stops their threads and closes the
/// connection.
impl Drop for Holder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl Holding {
    /// Wait up to `wait` for an event and act on it; then start grants that waited, and
    /// hand back shards that stopped turning.
    async fn turn(&mut self, wait: Duration) {
        match self.worker.next_event(wait) {
            Some(Event::Granted { shard, epoch }) => self.waiting.push((shard, epoch)),
            Some(Event::Lost { shard, epoch, why }) => self.lose(shard, epoch, &why),
            Some(Event::Drain { shard, epoch }) => {
                if self.held[shard as usize]
                    .as_ref()
                    .is_some_and(|h| h.epoch == epoch)
                {
                    self.hand_back(shard, "the server asked for it");
                } else {
                    self.drained.push((shard, epoch));
                }
            }
            None => {}
        }
        for (shard, epoch) in std::mem::take(&mut self.waiting) {
            let ended = self.ending[shard as usize]
                .as_ref()
                .is_none_or(Shard::is_finished);
            if ended {
                self.ending[shard as usize] = None;
                self.take(shard, epoch).await;
            } else {
                self.waiting.push((shard, epoch));
            }
        }
        self.watch_turns();
        self.sweep();
    }

    /// Forget finished runs `retention` after this sweep first found them finished
    /// (docs/flow-server.md §14): a result asked later comes from the server's index
    /// while the server keeps it. As embedded, a finished child stays while its
    /// parent has not finished. One slice of the map a second.
    fn sweep(&mut self) {
        use crate::api::RunStatus::Finished;
        use std::ops::Bound::{Excluded, Unbounded};
        if self.swept_at.elapsed() < SWEEP_EVERY {
            return;
        }
        self.swept_at = Instant::now();
        let now = self.shared.clock.wall_ms().max(1);
        let retention = self.retention.as_millis() as u64;
        let shared = &self.shared;
        let mut runs = lock(&shared.runs);
        let (mut seen, mut last, mut old) = (0, None, Vec::new());
        let range = match &self.swept_to {
            Some(after) => runs.range_mut::<str, _>((Excluded(after.as_str()), Unbounded)),
            None => runs.range_mut::<str, _>(..),
        };
        for (id, e) in range.take(SWEEP_SLICE) {
            seen += 1;
            last = Some(id);
            if !matches!(e.status, Finished(_)) {
                continue;
            }
            if e.finished_seen_ms == 0 {
                e.finished_seen_ms = now;
            } else if now.saturating_sub(e.finished_seen_ms) >= retention {
                old.push(id.clone());
            }
        }
        self.swept_to = if seen < SWEEP_SLICE {
            None
        } else {
            last.cloned()
        };
        for id in old {
            let parent_running = runs
                .get(&id)
                .and_then(|e| e.parent())
                .and_then(|p| runs.get(p))
                .is_some_and(|p| !matches!(p.status, Finished(_)));
            if !parent_running && let Some(e) = runs.remove(&id) {
                shared.counters.removed(&e.status);
                shared.counters.expired(1);
            }
        }
    }

    /// Shard `shard` was granted at `epoch`: recover it and run it.
    async fn take(&mut self, shard: u32, epoch: u64) {
        let Some(stream) = self.worker.stream(shard).filter(|s| s.epoch() == epoch) else {
            tracing::info!(
                shard,
                epoch,
                "shard granted, and lost again before it was taken"
            );
            return;
        };
        let started = Instant::now();
        let journal: Arc<dyn JournalLog> = Arc::new(Watched {
            log: stream.clone(),
            failure: self.shared.failure.clone(),
        });
        let (lane, rx) = Lane::new(journal, Some(epoch), None, self.running);
        // The turns count from the grant: a long recovery is progress.
        stream.turns.fetch_add(1, Ordering::Relaxed);
        // A read cut short by a blip of the connection is read again, while the grant
        // lasts (it is resumed with the connection, or lost).
        let read = loop {
            match journal_of(&stream).await {
                Err(FlowError::Log(e)) if !matches!(e, Error::Fenced(_)) && !stream.is_lost() => {
                    tracing::warn!(
                        shard,
                        epoch,
                        "reading the shard from the server: {e}; again"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                r => break r,
            }
        };
        let recovered = read.and_then(|j| {
            let Journaled {
                folded,
                by_run,
                read,
            } = j;
            // Runs the checkpoint keeps as finished (their results, their ids taken).
            {
                let mut runs = lock(&self.shared.runs);
                for (id, d) in folded.finished {
                    let name = self.shared.workflow_name(&d.workflow);
                    let mut e = crate::registry::RunEntry::new(
                        name,
                        d.parent,
                        d.generation,
                        crate::api::RunStatus::Finished(d.outcome),
                    );
                    e.inbox.remember_keys(&d.keys);
                    self.shared.insert_recovered(&mut runs, id, e);
                }
            }
            let mut resumed = 0;
            for (run, records) in by_run {
                if recover_run(&self.shared, &lane, run, records)? {
                    resumed += 1;
                }
            }
            Ok((read, resumed))
        });
        let (read, resumed) = match recovered {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(shard, epoch, "recovering the shard failed: {e}");
                return self.give_up(shard, epoch);
            }
        };
        // No step body starts before the server confirmed the grant (§5.3): a run that
        // found its shard unconfirmed would stop as fenced, and the grant go on without
        // it. The connection pings as soon as a grant comes, so this is a round trip;
        // a grant that is not confirmed within a lease is handed back.
        let until = Instant::now() + self.worker.timing().lease;
        while !stream.may_act() && !stream.is_lost() && Instant::now() < until {
            stream.turns.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if !stream.may_act() {
            tracing::warn!(shard, epoch, "the server did not confirm the grant");
            return self.give_up(shard, epoch);
        }
        *self.shared.lanes[shard as usize]
            .write()
            .unwrap_or_else(|e| e.into_inner()) = lane.clone();
        let beat = {
            let stream = stream.clone();
            let every = (self.worker.timing().ping_every / 2).max(Duration::from_millis(5));
            let beat: Box<dyn Fn() + Send> = Box::new(move || {
                stream.turns.fetch_add(1, Ordering::Relaxed);
            });
            (every, beat)
        };
        let thread = if self.shared.here.is_some() {
            Shard::start_here(self.shared.clone(), rx, beat)
        } else {
            Shard::start(shard as usize, self.shared.clone(), lane, rx, Some(beat))
        };
        tracing::info!(
            shard,
            epoch,
            records = read,
            resumed,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "shard granted and recovered"
        );
        self.held[shard as usize] = Some(Held {
            epoch,
            turns: (stream.turns.load(Ordering::Relaxed), Instant::now()),
            stream,
            thread,
            releasing: false,
        });
        let drained = self.drained.contains(&(shard, epoch));
        self.drained.retain(|d| d.0 != shard || d.1 > epoch);
        if drained {
            self.hand_back(shard, "the server asked for it before its grant came");
        }
    }

    /// Shard `shard`'s grant at `epoch` is lost: stop it, forget its runs.
    fn lose(&mut self, shard: u32, epoch: u64, why: &str) {
        let i = shard as usize;
        if self.held[i].as_ref().is_none_or(|h| h.epoch != epoch) {
            return;
        }
        let mut held = self.held[i].take().expect("looked at it");
        *self.shared.lanes[i]
            .write()
            .unwrap_or_else(|e| e.into_inner()) = vacant_lane(i, self.running);
        held.thread.ask_to_stop();
        self.ending[i] = Some(held.thread);
        self.forget_runs(i);
        tracing::info!(shard, epoch, "shard let go: {why}");
    }

    /// A grant not taken after all: forget what its recovery put in the map and hand
    /// it back, for the server to grant again (elsewhere, if it can).
    fn give_up(&mut self, shard: u32, epoch: u64) {
        tracing::warn!(shard, epoch, "handing the shard back untaken");
        self.forget_runs(shard as usize);
        self.worker.release(shard, epoch);
    }

    /// Drop shard `shard`'s runs from the map: whoever waits on one hears that it is
    /// not held here.
    fn forget_runs(&self, shard: usize) {
        let shared = &self.shared;
        let mut runs = lock(&shared.runs);
        runs.retain(|id, e| {
            let keep = shared.shard_of(id) != shard;
            if !keep {
                shared.counters.removed(&e.status);
                drop(e.take_waiters());
            }
            keep
        });
    }

    fn hand_back(&mut self, shard: u32, why: &str) {
        if let Some(h) = self.held[shard as usize].as_mut()
            && !h.releasing
        {
            h.releasing = true;
            tracing::info!(shard, epoch = h.epoch, "handing the shard back: {why}");
            self.worker.release(shard, h.epoch);
        }
    }

    /// Hand back each shard whose thread has not turned for `stuck_after`
    /// (docs/flow-server.md §5.4).
    fn watch_turns(&mut self) {
        let stuck_after = self.worker.timing().stuck_after;
        let mut stuck = Vec::new();
        for (i, h) in self.held.iter_mut().enumerate() {
            let Some(h) = h else { continue };
            let now = h.stream.turns.load(Ordering::Relaxed);
            if now != h.turns.0 {
                h.turns = (now, Instant::now());
            } else if h.turns.1.elapsed() >= stuck_after {
                stuck.push(i as u32);
            }
        }
        for shard in stuck {
            self.hand_back(shard, "its thread has not turned for stuck_after");
        }
    }

    /// Hand every shard back and wait, up to a lease, for each to go; then stop every
    /// shard thread, waiting up to another lease for them (a thread a step body blocks
    /// is left behind, so that closing ends).
    async fn close(&mut self) {
        let shards: Vec<u32> = (0..self.held.len() as u32).collect();
        for shard in shards {
            self.hand_back(shard, "the engine is closing");
        }
        let lease = self.worker.timing().lease;
        let until = Instant::now() + lease;
        loop {
            // Grants not taken are handed back at once.
            for (shard, epoch) in std::mem::take(&mut self.waiting) {
                self.worker.release(shard, epoch);
            }
            if self.held.iter().all(Option::is_none) || Instant::now() >= until {
                break;
            }
            match self.worker.next_event(Duration::from_millis(20)) {
                Some(Event::Lost { shard, epoch, why }) => self.lose(shard, epoch, &why),
                Some(Event::Granted { shard, epoch }) => self.waiting.push((shard, epoch)),
                _ => {}
            }
        }
        for i in 0..self.held.len() {
            if let Some(epoch) = self.held[i].as_ref().map(|h| h.epoch) {
                self.lose(i as u32, epoch, "the engine closed");
            }
        }
        let until = Instant::now() + lease;
        while self.ending.iter().flatten().any(|t| !t.is_finished()) && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for (i, t) in self.ending.iter_mut().enumerate() {
            match t.take() {
                Some(mut t) if t.is_finished() => t.stop(),
                Some(_) => tracing::warn!(
                    shard = i,
                    "the shard's thread is still blocked (a step body that does not \
                     return); the engine closes without it"
                ),
                None => {}
            }
        }
    }
}
