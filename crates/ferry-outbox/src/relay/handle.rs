//! A relay as its owner holds it ([`Relay`]): built from a store, a transport and
//! checked settings; run until stopped (its lanes and background tasks), or spawned
//! beside other work ([`Running`]); its status and metrics. What each lane does is
//! `lane.rs`.

use super::config::RelayConfig;
use super::stats::{RelayStatus, Stats};
use crate::breaker::Breaker;
use crate::error::DbError;
use crate::store::Store;
use crate::transport::Transport;
use ferry_core::metrics::Histogram;
use ferry_core::seams::SplitMix64;
use ferry_core::sync::lock;
use ferry_core::{Class, Classify, ConfigError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// Why a relay stopped by itself.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// A database error no retry can cure (a missing privilege, the schema not
    /// installed) or data that failed validation.
    #[error("the relay stopped: {0}")]
    Db(DbError),
    /// One of its own invariants broke (a bug in ferry): the relay stopped rather than
    /// write anything more.
    #[error("the relay stopped: an invariant broke (a bug in ferry; please report it): {0}")]
    Invariant(String),
}

impl From<DbError> for RelayError {
    fn from(e: DbError) -> RelayError {
        RelayError::Db(e)
    }
}

impl Classify for RelayError {
    fn class(&self) -> Class {
        match self {
            RelayError::Db(e) => e.class(),
            RelayError::Invariant(_) => Class::Permanent,
        }
    }
}

pub struct Relay {
    pub(super) store: Store,
    pub(super) transport: Arc<dyn Transport>,
    pub(super) config: RelayConfig,
    pub(super) stats: Stats,
    pub(super) publish_latency: Histogram,
    pub(super) breaker: Mutex<Breaker>,
    /// The breaker changed state: lanes waiting for a probe's outcome look again.
    pub(super) breaker_changed: Notify,
    /// The transport's (re)connection count, when it reports one.
    pub(super) connections: Option<tokio::sync::watch::Receiver<u64>>,
    pub(super) rng: Mutex<SplitMix64>,
    pub(super) wake: Notify,
    pub(super) stopping: AtomicBool,
    /// A permanent failure to record the totals was logged (once is enough).
    pub(super) totals_warned: AtomicBool,
    /// Earlier rows under this relay's name were retired (crate::totals): recording may
    /// begin.
    pub(super) retired: AtomicBool,
}

impl Relay {
    /// Check `config` and build a relay over `store` (which then reads SQLite's times
    /// from `config.clock`) and `transport`.
    pub fn new(
        store: Store,
        transport: Arc<dyn Transport>,
        config: RelayConfig,
    ) -> Result<Arc<Relay>, ConfigError> {
        config.check()?;
        let connections = transport.connections();
        Ok(Arc::new(Relay {
            store: store.with_clock(config.clock.clone()),
            transport,
            breaker: Mutex::new(Breaker::new(config.breaker_failures)),
            config,
            stats: Stats::default(),
            publish_latency: Histogram::latency(),
            breaker_changed: Notify::new(),
            connections,
            rng: Mutex::new(SplitMix64::from_entropy()),
            wake: Notify::new(),
            stopping: AtomicBool::new(false),
            totals_warned: AtomicBool::new(false),
            retired: AtomicBool::new(false),
        }))
    }

    /// Run until `shutdown` resolves, then finish the batches in flight (publish and
    /// settle them), record the totals and return. Returns early, with the error, when
    /// the database refuses the relay for good (a permanent or corrupted error) or an
    /// invariant breaks; the batches in flight are finished first all the same.
    pub async fn run(
        self: &Arc<Self>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), RelayError> {
        self.record_totals(false).await;
        let mut lanes = tokio::task::JoinSet::new();
        for lane in 0..self.config.lanes {
            let r = self.clone();
            lanes.spawn(async move { r.lane(lane).await });
        }
        let helpers = [
            tokio::spawn(self.clone().watch()),
            tokio::spawn(self.clone().reclaim_loop()),
            tokio::spawn(self.clone().totals_loop()),
        ];
        let mut failure = None;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                done = lanes.join_next() => match done {
                    None => break,
                    Some(r) => {
                        failure = lane_failure(r);
                        if failure.is_some() {
                            break;
                        }
                    }
                },
            }
        }
        match &failure {
            None => tracing::info!("stopping: finishing the batches in flight"),
            Some(e) => tracing::error!("{e}; finishing the batches in flight"),
        }
        self.stopping.store(true, Ordering::SeqCst);
        self.wake.notify_waiters();
        self.breaker_changed.notify_waiters();
        while let Some(r) = lanes.join_next().await {
            if failure.is_none() {
                failure = lane_failure(r);
            }
        }
        for h in helpers {
            h.abort();
        }
        self.record_totals(true).await;
        failure.map_or(Ok(()), Err)
    }

    /// Run on the current tokio runtime until [`Running::stop`] (or an error).
    pub fn spawn(self: &Arc<Self>) -> Running {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let r = self.clone();
        let task = tokio::spawn(async move {
            r.run(async {
                let _ = stopped.await;
            })
            .await
        });
        Running {
            stop: Some(stop),
            task,
        }
    }

    /// A snapshot of the relay's counters and its breaker.
    pub fn status(&self) -> RelayStatus {
        let b = lock(&self.breaker);
        self.stats
            .snapshot(&self.config.owner, self.transport.describe(), &b)
    }

    /// Prometheus text for this relay's counters.
    pub fn metrics(&self) -> String {
        self.status().metrics(&self.publish_latency)
    }

    /// Wake idle lanes (an in-process enqueue just committed).
    pub fn wake(&self) {
        self.wake.notify_waiters();
    }
}

/// The error a lane ended with, if any (a panic is an invariant that broke).
fn lane_failure(r: Result<Result<(), RelayError>, tokio::task::JoinError>) -> Option<RelayError> {
    match r {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(j) if j.is_panic() => {
            let p = j.into_panic();
            let what = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a lane panicked".into());
            Some(RelayError::Invariant(what))
        }
        Err(_) => None,
    }
}

/// A relay started by [`Relay::spawn`]. Dropping it asks the relay to stop in the
/// background (it still finishes the batches in flight); [`Running::stop`] waits for
/// that and returns how it ended.
#[derive(Debug)]
#[must_use = "dropping it stops the relay; call stop().await"]
pub struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), RelayError>>,
}

impl Running {
    /// Stop leasing, publish and settle the batches in flight, and return how the relay
    /// ended (an error if it had stopped by itself before).
    pub async fn stop(mut self) -> Result<(), RelayError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.join().await
    }

    /// Has the relay stopped by itself (an error)?
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Wait for the relay to end (by itself, or after [`Running::stop`]).
    pub async fn join(mut self) -> Result<(), RelayError> {
        match (&mut self.task).await {
            Ok(r) => r,
            Err(j) if j.is_panic() => Err(RelayError::Invariant(format!("{j}"))),
            Err(_) => Ok(()),
        }
    }
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("transport", &self.transport.describe())
            .field("config", &self.config)
            .finish()
    }
}
