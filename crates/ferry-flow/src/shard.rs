//! The shard executor: each shard is a thread with a current-thread tokio runtime and a
//! `LocalSet`, running every run handed to it as a task of its own (or, on the caller's
//! thread for a simulation, tasks of the caller's `LocalSet` over a simulated disk).

use crate::job::Job;
use crate::lifecycle::run_job;
use crate::shared::{Lane, Shared};
use ferry_core::seams::{Rng, SplitMix64};
use ferry_core::sync::lock;
use ferry_log::Log;
use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::thread::JoinHandle;
use tokio::sync::{mpsc, oneshot};

thread_local! {
    /// How many times this shard's thread has parked (its runtime's `on_thread_park`).
    static PARKS: Cell<u64> = const { Cell::new(0) };
}

/// A shard's loop polled with nothing to do, again and again, without its thread
/// parking: tokio's `block_on` is being woken in a loop. That happens when a thread
/// that was waking this shard (through an `AtomicWaker`: the job channel's, the
/// `LocalSet`'s) was preempted inside the wake, typically by this very shard on the
/// same CPU: each registration then sees the wake in progress and wakes the shard again
/// at once, and the shard spins until the scheduler ends its slice (3-4 ms seen in
/// `perf sched` at W3's 25%, on 2 vCPUs, with the client thread waiting behind it).
/// After `IDLE_POLLS_BEFORE_YIELD` such polls the shard yields its CPU, so that the
/// preempted thread can finish its wake.
#[derive(Default)]
struct IdlePolls {
    parks: u64,
    polls: u32,
}

const IDLE_POLLS_BEFORE_YIELD: u32 = 64;

impl IdlePolls {
    fn note(&mut self) {
        let parks = PARKS.with(Cell::get);
        if parks != self.parks {
            *self = IdlePolls { parks, polls: 0 };
        }
        self.polls += 1;
        if self.polls >= IDLE_POLLS_BEFORE_YIELD {
            self.polls = 0;
            std::thread::yield_now();
        }
    }
}

/// What a shard thread calls, and how often, while it turns.
pub(crate) type Beat = (std::time::Duration, Box<dyn Fn() + Send>);

pub(crate) struct Shard {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    /// On the caller's thread: the shard's task.
    task: Option<tokio::task::AbortHandle>,
}

impl Shard {
    /// Shard `i`'s thread, running what comes on `rx` against `lane`. `beat`: call it
    /// every so often while the thread's loop turns (a worker's progress, for the
    /// server, docs/flow-server.md §5.4).
    pub(crate) fn start(
        i: usize,
        shared: Arc<Shared>,
        lane: Arc<Lane>,
        mut rx: mpsc::UnboundedReceiver<Vec<Job>>,
        beat: Option<Beat>,
    ) -> Shard {
        let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("ferry-flow-{i}"))
            .spawn(move || {
                // After a sync that woke this shard, the log's writer waits a moment
                // for it to append what it ran next (`ferry_log::Follower`): until it
                // is about to sleep.
                let follower = lane.starts.follower.clone();
                let idle = follower.clone();
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .on_thread_park(move || {
                        PARKS.with(|p| p.set(p.get() + 1));
                        if let Some(f) = &idle {
                            f.idle();
                        }
                    })
                    .build()
                    .expect("a current-thread runtime builds");
                let local = tokio::task::LocalSet::new();
                let watcher =
                    crate::durable::Waits::install(lane.journal.clone(), follower.clone());
                drop(lane);
                local.block_on(&rt, async move {
                    tokio::task::spawn_local(watcher);
                    if let Some((every, beat)) = beat {
                        tokio::task::spawn_local(async move {
                            loop {
                                tokio::time::sleep(every).await;
                                beat();
                            }
                        });
                    }
                    let mut idle = IdlePolls::default();
                    // Jobs first, then the stop: what was sent before the stop runs.
                    std::future::poll_fn(|cx| {
                        loop {
                            match rx.poll_recv(cx) {
                                Poll::Ready(Some(jobs)) => {
                                    idle.polls = 0;
                                    for job in jobs {
                                        tokio::task::spawn_local(run_job(
                                            shared.clone(),
                                            Box::new(job),
                                        ));
                                    }
                                }
                                Poll::Ready(None) => return Poll::Ready(()),
                                Poll::Pending => {
                                    if Pin::new(&mut stop_rx).poll(cx).is_ready() {
                                        return Poll::Ready(());
                                    }
                                    idle.note();
                                    return Poll::Pending;
                                }
                            }
                        }
                    })
                    .await;
                });
                if let Some(f) = &follower {
                    f.idle();
                }
            })
            .expect("spawning a shard thread");
        Shard {
            stop: Some(stop_tx),
            thread: Some(thread),
            task: None,
        }
    }

    /// A server's worker's shard as a task of the caller's `LocalSet` (a simulation):
    /// its runs are tasks of its own, dropped where they wait when it stops, as a
    /// thread's are; `beat` as for [`Shard::start`].
    pub(crate) fn start_here(
        shared: Arc<Shared>,
        mut rx: mpsc::UnboundedReceiver<Vec<Job>>,
        beat: Beat,
    ) -> Shard {
        let (stop_tx, mut stop_rx) = oneshot::channel::<()>();
        let s = shared.clone();
        let task = tokio::task::spawn_local(async move {
            let (every, beat) = beat;
            let mut runs = tokio::task::JoinSet::new();
            let mut tick = tokio::time::interval(every);
            loop {
                tokio::select! {
                    biased;
                    _ = &mut stop_rx => break,
                    jobs = rx.recv() => match jobs {
                        Some(jobs) => {
                            for job in jobs {
                                runs.spawn_local(run_job(s.clone(), Box::new(job)));
                            }
                        }
                        None => break,
                    },
                    Some(_) = runs.join_next(), if !runs.is_empty() => {}
                    _ = tick.tick() => beat(),
                }
            }
        });
        let abort = task.abort_handle();
        if let Some(here) = &shared.here {
            lock(here).push(abort.clone());
        }
        Shard {
            stop: Some(stop_tx),
            thread: None,
            task: Some(abort),
        }
    }

    /// A shard as a task of the caller's `LocalSet` (`on_this_thread`): each job is a
    /// task of its own, aborted with the engine.
    pub(crate) async fn run_here(shared: Arc<Shared>, mut rx: mpsc::UnboundedReceiver<Vec<Job>>) {
        while let Some(jobs) = rx.recv().await {
            for job in jobs {
                let s = shared.clone();
                shared.spawn_here(run_job(s, Box::new(job)));
            }
        }
    }

    pub(crate) fn stop(&mut self) {
        self.ask_to_stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Tell the thread to stop (its runs are dropped where they wait), not waiting for
    /// it: a step body may be blocking it.
    pub(crate) fn ask_to_stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    /// The thread (or task) has ended.
    pub(crate) fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
            && self.task.as_ref().is_none_or(|t| t.is_finished())
    }
}

/// The disk of an engine on the caller's thread (`on_this_thread`): write and sync what
/// was appended at moments drawn from `seed`. Tokio's timers tick in whole milliseconds,
/// so the gaps are 1 to 3 ms, and within a tick the disk yields a drawn number of times
/// first (letting a drawn share of the ready tasks append before the sync), up to three
/// times per tick.
pub(crate) async fn disk(log: Arc<Log>, seed: u64) {
    let mut rng = SplitMix64::seeded(seed ^ 0xd15c);
    loop {
        let gap = 1 + rng.below(3);
        tokio::time::sleep(std::time::Duration::from_millis(gap)).await;
        for _ in 0..=rng.below(3) {
            for _ in 0..rng.below(8) {
                tokio::task::yield_now().await;
            }
            log.write_pending();
        }
    }
}
