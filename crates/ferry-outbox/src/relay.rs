//! The relay (docs/outbox.md §4). Each lane repeats:
//!
//! 1. Ask the breaker (crate::breaker) whether to lease: a full batch when closed, one
//!    message (the probe) when half open, nothing while open.
//! 2. Lease up to `batch` claimable messages in one statement (nothing held after it).
//! 3. Publish them with up to `window` in flight, extending the lease at half-life.
//! 4. Settle the batch in one fenced statement: rows the lane no longer holds are
//!    reported fenced and left alone.
//! 5. With nothing claimable, wait for a wake-up (`NOTIFY` on Postgres, a change of
//!    `PRAGMA data_version` on SQLite) or the backstop poll.
//!
//! A crash between any two steps leaves leased rows whose lease runs out; `reclaim`
//! returns them to pending, marked uncertain, and the next presentation carries the same
//! message id, which the transport deduplicates.
//!
//! Database errors: a transient one (the server restarting, a connection cut) backs the
//! lane off with jitter and retries; a permanent one (a missing privilege, the schema
//! not installed) or a corrupted one stops the relay, and [`Relay::run`] returns it.
//!
//! Every few seconds and when it stops, the relay records its counters in the database
//! (crate::totals), for `ferry outbox status`.

use crate::breaker::{Admit, Breaker, Change, Era};
use crate::error::DbError;
use crate::store::{Leased, Settle, SettleRow, Settled, Store, Uncertain};
use crate::totals::{RelayRecord, Totals};
use crate::transport::{Outcome, Transport};
use ferry_core::backoff::Backoff;
use ferry_core::epoch::{Epoch, Fence};
use ferry_core::metrics::{Exposition, Histogram};
use ferry_core::seams::{Clock, SplitMix64, SystemClock};
use ferry_core::sync::lock;
use ferry_core::{Class, Classify, ConfigError};
use futures_util::StreamExt;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// How a relay runs. Checked by [`Relay::new`].
#[derive(Clone)]
pub struct RelayConfig {
    /// This relay's name in `lease_owner` and in the totals (host, pid and a random
    /// suffix by default).
    pub owner: String,
    /// Relay loops in this process.
    pub lanes: usize,
    /// Messages per lease.
    pub batch: u32,
    /// Publishes in flight per lane.
    pub window: usize,
    pub lease: Duration,
    /// Message-attributable refusals before a message is parked.
    pub max_attempts: i32,
    /// The backstop poll (also how soon a due retry is noticed).
    pub poll: Duration,
    /// Transport failures in a row that open the breaker.
    pub breaker_failures: u32,
    /// Every time the relay reads (deadlines, the breaker's pause, SQLite's times: the
    /// relay sets it on its store). Tests drive it; tokio's sleeps stay tokio's.
    pub clock: Arc<dyn Clock>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            owner: default_owner(),
            lanes: 1,
            batch: 256,
            window: 64,
            lease: Duration::from_secs(30),
            max_attempts: 10,
            poll: Duration::from_secs(1),
            breaker_failures: 5,
            clock: Arc::new(SystemClock),
        }
    }
}

impl std::fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayConfig")
            .field("owner", &self.owner)
            .field("lanes", &self.lanes)
            .field("batch", &self.batch)
            .field("window", &self.window)
            .field("lease", &self.lease)
            .field("max_attempts", &self.max_attempts)
            .field("poll", &self.poll)
            .field("breaker_failures", &self.breaker_failures)
            .finish()
    }
}

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

/// Per-message retry after a refusal: 1 s doubling to 5 min, full jitter.
const RETRY: Backoff = Backoff::new(
    Duration::from_secs(1),
    Duration::from_secs(300),
    Duration::from_millis(100),
);
/// An unanswered publish is presented again after this (while the breaker is closed).
const UNCERTAIN_RETRY: Duration = Duration::from_secs(1);
/// A publish that found the transport away while the breaker stayed closed (one failure
/// among answers) is retried after this; messages caught by an open breaker go back at
/// once instead, for relays whose transport is fine.
const UNAVAILABLE_RETRY: Duration = Duration::from_millis(200);
/// Transient database errors back a lane off this long before it tries again.
const DB_RETRY: Backoff = Backoff::new(
    Duration::from_millis(100),
    Duration::from_secs(5),
    Duration::from_millis(50),
);
/// SQLite: how often an idle relay looks at `PRAGMA data_version` for commits by others.
const SQLITE_WATCH: Duration = Duration::from_millis(2);
/// A lease shorter than a second cannot cover one publish timeout.
const LEASE_MIN: Duration = Duration::from_secs(1);
const LANES_MAX: usize = 64;
const BATCH_MAX: u32 = 10_000;
const WINDOW_MAX: usize = 4096;
/// How often a relay records its counters (crate::totals): a relay killed between two
/// records loses at most this much of them from `ferry outbox status`.
pub const TOTALS_EVERY: Duration = Duration::from_secs(5);

/// `FERRY_OUTBOX_CRASH_BEFORE_SETTLE=1` makes the relay abort after publishing its first
/// batch, before settling it. For crash tests only (the `failpoints` feature, which
/// release builds leave off); read once.
#[cfg(feature = "failpoints")]
fn crash_before_settle() -> bool {
    static SET: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SET.get_or_init(|| std::env::var("FERRY_OUTBOX_CRASH_BEFORE_SETTLE").is_ok_and(|v| v == "1"))
}

fn default_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    format!(
        "{host}-{}-{:04x}",
        std::process::id(),
        ferry_core::seams::random_nonzero_u64() & 0xffff
    )
}

/// Counters, for `/metrics`, the totals and tests.
#[derive(Debug, Default)]
pub struct Stats {
    pub leased: AtomicU64,
    pub published: AtomicU64,
    pub duplicates: AtomicU64,
    pub settled: AtomicU64,
    pub fenced: AtomicU64,
    pub retried: AtomicU64,
    pub unavailable: AtomicU64,
    pub uncertain: AtomicU64,
    pub reconciled: AtomicU64,
    pub parked: AtomicU64,
    pub db_errors: AtomicU64,
    /// An uncertain message is older than the transport's dedup window less a margin:
    /// its next presentation may be stored twice (docs/outbox.md §4.2).
    pub uncertain_past_window: AtomicBool,
}

/// Add `n` to a counter. Counters never wrap: at a billion events a second a u64 lasts
/// five centuries, so a wrap means a bug (a negative count cast), and the relay stops.
fn add(counter: &AtomicU64, n: u64) {
    let before = counter.fetch_add(n, Ordering::Relaxed);
    assert!(
        before.checked_add(n).is_some(),
        "relay invariant: counters never wrap"
    );
}

/// A snapshot of [`Stats`] and the breaker.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RelayStatus {
    pub owner: String,
    pub transport: String,
    /// Open or half open: nothing but a probe is published.
    pub breaker_open: bool,
    /// The pause of the current opening, in ms (0 when closed).
    pub breaker_pause_ms: u64,
    /// Openings since start (an outage opens it once; each failed probe once more).
    pub breaker_openings: u64,
    /// Half-open probes that failed (each reopened the breaker for longer).
    pub breaker_probes_failed: u64,
    pub consecutive_failures: u32,
    pub last_error: Option<String>,
    pub leased: u64,
    pub published: u64,
    pub duplicates: u64,
    pub settled: u64,
    pub fenced: u64,
    pub retried: u64,
    pub unavailable: u64,
    pub uncertain: u64,
    pub reconciled: u64,
    pub parked: u64,
    pub db_errors: u64,
    pub uncertain_past_window: bool,
}

impl RelayStatus {
    pub fn totals(&self) -> Totals {
        Totals {
            leased: self.leased,
            published: self.published,
            duplicates: self.duplicates,
            settled: self.settled,
            fenced: self.fenced,
            retried: self.retried,
            unavailable: self.unavailable,
            uncertain: self.uncertain,
            reconciled: self.reconciled,
            parked: self.parked,
            db_errors: self.db_errors,
            breaker_openings: self.breaker_openings,
        }
    }
}

pub struct Relay {
    store: Store,
    transport: Arc<dyn Transport>,
    config: RelayConfig,
    stats: Stats,
    publish_latency: Histogram,
    breaker: Mutex<Breaker>,
    /// The breaker changed state: lanes waiting for a probe's outcome look again.
    breaker_changed: Notify,
    /// The transport's (re)connection count, when it reports one.
    connections: Option<tokio::sync::watch::Receiver<u64>>,
    rng: Mutex<SplitMix64>,
    wake: Notify,
    stopping: AtomicBool,
    /// A permanent failure to record the totals was logged (once is enough).
    totals_warned: AtomicBool,
    /// Earlier rows under this relay's name were retired (crate::totals): recording may
    /// begin.
    retired: AtomicBool,
}

impl Relay {
    /// Check `config` and build a relay over `store` (which then reads SQLite's times
    /// from `config.clock`) and `transport`.
    pub fn new(
        store: Store,
        transport: Arc<dyn Transport>,
        config: RelayConfig,
    ) -> Result<Arc<Relay>, ConfigError> {
        check(&config)?;
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

    /// Wake idle lanes (an in-process enqueue just committed).
    pub fn wake(&self) {
        self.wake.notify_waiters();
    }

    pub fn status(&self) -> RelayStatus {
        let b = lock(&self.breaker);
        let s = &self.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RelayStatus {
            owner: self.config.owner.clone(),
            transport: self.transport.describe(),
            breaker_open: b.is_open(),
            breaker_pause_ms: u64::try_from(b.pause().as_millis()).unwrap_or(u64::MAX),
            breaker_openings: b.opened_total(),
            breaker_probes_failed: b.probes_failed_total(),
            consecutive_failures: b.failures(),
            last_error: b.last_error().map(str::to_string),
            leased: get(&s.leased),
            published: get(&s.published),
            duplicates: get(&s.duplicates),
            settled: get(&s.settled),
            fenced: get(&s.fenced),
            retried: get(&s.retried),
            unavailable: get(&s.unavailable),
            uncertain: get(&s.uncertain),
            reconciled: get(&s.reconciled),
            parked: get(&s.parked),
            db_errors: get(&s.db_errors),
            uncertain_past_window: s.uncertain_past_window.load(Ordering::Relaxed),
        }
    }

    /// Prometheus text for this relay's counters.
    pub fn metrics(&self) -> String {
        let st = self.status();
        let mut e = Exposition::new();
        let counters: [(&str, &str, u64); 13] = [
            ("ferry_outbox_leased_total", "Messages leased.", st.leased),
            (
                "ferry_outbox_published_total",
                "Publishes the transport confirmed.",
                st.published,
            ),
            (
                "ferry_outbox_duplicates_total",
                "Confirmations the transport marked duplicate (suppressed resends).",
                st.duplicates,
            ),
            (
                "ferry_outbox_settled_total",
                "Messages settled (deleted, returned or parked).",
                st.settled,
            ),
            (
                "ferry_outbox_fenced_total",
                "Settles refused because the lease was lost.",
                st.fenced,
            ),
            (
                "ferry_outbox_retried_total",
                "Messages returned for a later attempt after a refusal.",
                st.retried,
            ),
            (
                "ferry_outbox_unavailable_total",
                "Publishes that found the transport away (or were held back by the open breaker).",
                st.unavailable,
            ),
            (
                "ferry_outbox_uncertain_total",
                "Publishes that went unanswered.",
                st.uncertain,
            ),
            (
                "ferry_outbox_reconciled_total",
                "Uncertain messages confirmed by a later presentation.",
                st.reconciled,
            ),
            (
                "ferry_outbox_parked_total",
                "Messages parked after their attempts.",
                st.parked,
            ),
            (
                "ferry_outbox_db_errors_total",
                "Database statements that failed.",
                st.db_errors,
            ),
            (
                "ferry_outbox_breaker_openings_total",
                "Times the transport's breaker opened (once per outage, once more per failed probe).",
                st.breaker_openings,
            ),
            (
                "ferry_outbox_breaker_probes_failed_total",
                "Half-open probes that failed and reopened the breaker.",
                st.breaker_probes_failed,
            ),
        ];
        for (name, help, v) in counters {
            e.counter(name, help, &[], v);
        }
        e.gauge(
            "ferry_outbox_uncertain_past_window",
            "1 while an unresolved uncertain message is older than the transport's dedup window (less a tenth): its next presentation may be stored twice.",
            &[],
            if st.uncertain_past_window { 1.0 } else { 0.0 },
        );
        e.gauge(
            "ferry_outbox_breaker_open",
            "1 while the transport's circuit breaker is open or half open.",
            &[],
            if st.breaker_open { 1.0 } else { 0.0 },
        );
        e.gauge(
            "ferry_outbox_breaker_pause_seconds",
            "The pause of the breaker's current opening (0 when closed).",
            &[],
            st.breaker_pause_ms as f64 / 1000.0,
        );
        e.histogram(
            "ferry_outbox_publish_seconds",
            "Time from sending a publish to its answer.",
            &[],
            &self.publish_latency,
        );
        e.finish()
    }

    async fn lane(self: Arc<Self>, lane: usize) -> Result<(), RelayError> {
        let mut db_failures = 0u32;
        while !self.stopping.load(Ordering::SeqCst) {
            let Some((batch, probe)) = self.breaker_wait().await else {
                continue;
            };
            // Listen before looking: a commit notified between the lease's snapshot and
            // the wait below must still wake this lane, not wait for the poll.
            let notified = self.wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let leased = match self
                .store
                .lease(&self.config.owner, batch, self.config.lease)
                .await
            {
                Ok(l) => {
                    db_failures = 0;
                    l
                }
                Err(e) => {
                    self.probe_done(probe);
                    add(&self.stats.db_errors, 1);
                    if !e.is_transient() {
                        return Err(e.into());
                    }
                    db_failures = db_failures.saturating_add(1);
                    tracing::warn!(lane, "{e}; retrying");
                    let d = DB_RETRY.delay(db_failures, &mut *lock(&self.rng));
                    self.sleep_or_stop(d).await;
                    continue;
                }
            };
            if leased.is_empty() {
                self.probe_done(probe);
                if !self.stopping.load(Ordering::SeqCst) {
                    let _ = tokio::time::timeout(self.config.poll, notified).await;
                }
                continue;
            }
            for m in &leased {
                assert!(
                    m.generation > Epoch(0),
                    "lease invariant: a lease raises the row's generation (row {})",
                    m.id
                );
            }
            add(&self.stats.leased, leased.len() as u64);
            let outcomes = self.publish_batch(&leased, probe).await;
            #[cfg(feature = "failpoints")]
            if crash_before_settle() {
                // A crash test's failpoint: die between publishing and settling, the
                // case the transport's dedup exists for (tests/outbox_crash.rs).
                std::process::abort();
            }
            let settled = self.settle(lane, &leased, outcomes).await;
            self.probe_done(probe);
            settled?;
        }
        Ok(())
    }

    /// Wait while the breaker is open; the batch size to lease and, when half open, the
    /// probe's era (None when stopping).
    async fn breaker_wait(&self) -> Option<(u32, Option<Era>)> {
        loop {
            if self.stopping.load(Ordering::SeqCst) {
                return None;
            }
            let changed = self.breaker_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let stop = self.wake.notified();
            tokio::pin!(stop);
            stop.as_mut().enable();
            let mut connections = self.connections.clone();
            if let Some(rx) = &mut connections {
                rx.borrow_and_update();
            }
            let admit = lock(&self.breaker).admit(self.config.clock.now(), self.connections_now());
            let wait = match admit {
                Admit::Lease => return Some((self.config.batch, None)),
                Admit::Probe(era) => {
                    tracing::debug!(
                        "the breaker's pause is over: publishing one message as a probe"
                    );
                    return Some((1, Some(era)));
                }
                Admit::Wait(d) => d,
                // Backstop: a probe's lane that died would otherwise leave the others
                // waiting; the poll looks again.
                Admit::AwaitProbe => self.config.poll,
            };
            let reconnected = async {
                match &mut connections {
                    Some(rx) => {
                        let _ = rx.changed().await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = changed => {}
                _ = stop => {}
                _ = reconnected => {}
            }
        }
    }

    fn connections_now(&self) -> u64 {
        self.connections.as_ref().map_or(0, |rx| *rx.borrow())
    }

    fn probe_done(&self, probe: Option<Era>) {
        if let Some(era) = probe {
            lock(&self.breaker).probe_done(era);
            self.breaker_changed.notify_waiters();
        }
    }

    async fn sleep_or_stop(&self, d: Duration) {
        let notified = self.wake.notified();
        if self.stopping.load(Ordering::SeqCst) {
            return;
        }
        let _ = tokio::time::timeout(d, notified).await;
    }

    /// Publish `leased` with up to `window` in flight, extending the lease meanwhile.
    /// `probe`: this batch is the half-open breaker's probe.
    async fn publish_batch(&self, leased: &[Leased], probe: Option<Era>) -> Vec<Outcome> {
        let held: Vec<(i64, Epoch)> = leased.iter().map(|m| (m.id, m.generation)).collect();
        // Collected first: a lazy `map` closure inside a spawned task trips the compiler's
        // higher-ranked lifetime inference.
        let sends: Vec<_> = leased
            .iter()
            .enumerate()
            .map(|(i, m)| self.publish_indexed(i, m, probe))
            .collect();
        let mut publishing = futures_util::stream::iter(sends).buffer_unordered(self.config.window);
        let mut outcomes: Vec<Option<Outcome>> = vec![None; leased.len()];
        let half = self.config.lease / 2;
        let mut extend_at = tokio::time::Instant::now() + half;
        loop {
            tokio::select! {
                next = publishing.next() => match next {
                    Some((i, o)) => outcomes[i] = Some(o),
                    None => break,
                },
                _ = tokio::time::sleep_until(extend_at) => {
                    extend_at += half;
                    self.extend(&held).await;
                }
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.expect("publish invariant: every message of the batch gets an outcome"))
            .collect()
    }

    /// Extend the lease of a batch still publishing; rows lost are reported (their
    /// settle will be fenced).
    async fn extend(&self, held: &[(i64, Epoch)]) {
        match self
            .store
            .extend(&self.config.owner, held, self.config.lease)
            .await
        {
            Ok(kept) if kept.len() < held.len() => {
                let lost: Vec<(i64, Epoch)> = held
                    .iter()
                    .filter(|(id, _)| !kept.contains(id))
                    .copied()
                    .collect();
                let fences = self.store.fences(&lost).await.unwrap_or_default();
                let released = fences
                    .iter()
                    .filter(|f| matches!(f.fence, Some(Fence::Stale { .. })))
                    .count();
                tracing::warn!(
                    lost = lost.len(),
                    leased_again_by_another = released,
                    "lost the lease of part of a batch while publishing: its settle will be fenced"
                );
            }
            Ok(_) => {}
            Err(e) => {
                add(&self.stats.db_errors, 1);
                tracing::warn!("{e}");
            }
        }
    }

    async fn publish_indexed(&self, i: usize, m: &Leased, probe: Option<Era>) -> (usize, Outcome) {
        (i, self.publish_one(m, probe).await)
    }

    async fn publish_one(&self, m: &Leased, probe: Option<Era>) -> Outcome {
        if let Some(defect) = &m.defect {
            // Never published: decide() parks it.
            return Outcome::Refused(defect.clone());
        }
        let era = {
            let b = lock(&self.breaker);
            match b.start(probe) {
                Some(era) => era,
                // Open, or half open and this is not the probe: caught by the outage;
                // back at once, for relays whose transport is fine.
                None => {
                    return Outcome::Unavailable {
                        reason: b
                            .last_error()
                            .unwrap_or("the transport's breaker is open")
                            .to_string(),
                        retry_after: None,
                        server_error: false,
                    };
                }
            }
        };
        let started = self.config.clock.now();
        let outcome = self.transport.publish(m).await;
        self.publish_latency
            .observe(self.config.clock.now().saturating_duration_since(started));
        // A 5xx while the endpoint was confirming other messages right before is this
        // message's own failure: decided now, before this failure resets the count.
        let outcome = match outcome {
            Outcome::Unavailable {
                reason,
                server_error: true,
                ..
            } if lock(&self.breaker).confirmed_since_failure() > 0 => Outcome::Refused(reason),
            other => other,
        };
        self.record(era, &outcome);
        outcome
    }

    /// Feed the breaker with the outcome of a publish started in `era`; log what it did.
    fn record(&self, era: Era, o: &Outcome) {
        let now = self.config.clock.now();
        let connections = self.connections_now();
        let (change, reason) = {
            let mut b = lock(&self.breaker);
            match o {
                Outcome::Confirmed { .. } | Outcome::Refused(_) => (b.answered(era), ""),
                Outcome::Unavailable {
                    reason,
                    retry_after,
                    ..
                } => (
                    b.failed(
                        era,
                        reason,
                        *retry_after,
                        now,
                        connections,
                        &mut *lock(&self.rng),
                    ),
                    reason.as_str(),
                ),
                Outcome::Unknown(reason) => (
                    b.failed(era, reason, None, now, connections, &mut *lock(&self.rng)),
                    reason.as_str(),
                ),
            }
        };
        let Some(change) = change else { return };
        let transport = self.transport.describe();
        match change {
            Change::Opened {
                failures, pause, ..
            } => tracing::warn!(
                %transport,
                failures,
                pause_ms = pause.as_millis() as u64,
                "the transport is away: pausing publishing for {} ms, then probing with one message; messages in flight go back for any relay to take ({reason})",
                pause.as_millis()
            ),
            Change::Reopened { opening, pause } => tracing::info!(
                %transport,
                opening,
                pause_ms = pause.as_millis() as u64,
                "the probe failed: the transport is still away; pausing publishing for {} ms ({reason})",
                pause.as_millis()
            ),
            Change::Closed => {
                tracing::info!(%transport, "the transport answers again: closing the breaker")
            }
        }
        self.breaker_changed.notify_waiters();
    }

    /// What to write back for each outcome (docs/outbox.md §4 step 4). `caught`: the
    /// breaker is open, so a failure is the outage's and the message goes back at once.
    fn decide(&self, m: &Leased, o: Outcome, caught: bool) -> Settle {
        if let Some(defect) = &m.defect {
            return Settle::Park {
                error: format!("parked without publishing: {defect}"),
            };
        }
        match o {
            Outcome::Confirmed { .. } => Settle::Confirmed,
            Outcome::Refused(error) => {
                let attempts = m
                    .attempts
                    .checked_add(1)
                    .expect("settle invariant: attempts never wrap (parked at max_attempts)");
                if attempts >= self.config.max_attempts {
                    Settle::Park {
                        error: format!("parked after {attempts} attempts: {error}"),
                    }
                } else {
                    Settle::Retry {
                        retry_in: RETRY.delay(attempts.unsigned_abs(), &mut *lock(&self.rng)),
                        attempt: true,
                        uncertain: Uncertain::Clear,
                        error,
                    }
                }
            }
            Outcome::Unavailable {
                reason,
                retry_after,
                ..
            } => Settle::Retry {
                retry_in: if caught {
                    Duration::ZERO
                } else {
                    retry_after.unwrap_or(UNAVAILABLE_RETRY)
                },
                attempt: false,
                uncertain: Uncertain::Keep,
                error: reason,
            },
            Outcome::Unknown(reason) => Settle::Retry {
                retry_in: if caught {
                    Duration::ZERO
                } else {
                    UNCERTAIN_RETRY
                },
                attempt: false,
                uncertain: Uncertain::Mark,
                error: reason,
            },
        }
    }

    /// Settle a published batch. Transient database errors are retried until the lease
    /// would have run out (after that the settle could only be fenced); a permanent one
    /// is returned, and stops the relay.
    async fn settle(
        &self,
        lane: usize,
        leased: &[Leased],
        outcomes: Vec<Outcome>,
    ) -> Result<(), DbError> {
        assert_eq!(
            leased.len(),
            outcomes.len(),
            "settle invariant: one outcome per leased message"
        );
        let caught = lock(&self.breaker).is_open();
        let mut rows = Vec::with_capacity(leased.len());
        let (mut published, mut duplicates, mut reconciled, mut uncertain, mut unavailable) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        for (m, o) in leased.iter().zip(outcomes) {
            match &o {
                Outcome::Confirmed { duplicate } => {
                    published += 1;
                    duplicates += u64::from(*duplicate);
                    reconciled += u64::from(m.uncertain);
                }
                Outcome::Unknown(_) => uncertain += 1,
                Outcome::Unavailable { .. } => unavailable += 1,
                Outcome::Refused(_) => {}
            }
            rows.push(SettleRow::new(m, self.decide(m, o, caught)));
        }
        let s = &self.stats;
        add(&s.published, published);
        add(&s.duplicates, duplicates);
        add(&s.reconciled, reconciled);
        add(&s.uncertain, uncertain);
        add(&s.unavailable, unavailable);
        let deadline = self.config.clock.now() + self.config.lease;
        let mut failures = 0;
        let settled: Settled = loop {
            match self.store.settle(&self.config.owner, &rows).await {
                Ok(s) => break s,
                Err(e) => {
                    add(&self.stats.db_errors, 1);
                    if !e.is_transient() {
                        return Err(e);
                    }
                    failures += 1;
                    let now = self.config.clock.now();
                    if now >= deadline {
                        tracing::warn!(
                            lane,
                            "{e}; retried until the lease ran out: the batch will be leased again"
                        );
                        return Ok(());
                    }
                    tracing::warn!(lane, "{e}; retrying");
                    let d = DB_RETRY.delay(failures, &mut *lock(&self.rng));
                    tokio::time::sleep(d.min(deadline - now)).await;
                }
            }
        };
        let written = settled
            .deleted
            .checked_add(settled.returned)
            .and_then(|n| n.checked_add(settled.parked))
            .expect("settle invariant: counts never wrap");
        assert_eq!(
            written + settled.fenced.len() as u64,
            rows.len() as u64,
            "settle invariant: every row of a batch is written or fenced"
        );
        add(&s.settled, written);
        add(&s.parked, settled.parked);
        let spent = rows
            .iter()
            .filter(|r| {
                matches!(r.settle, Settle::Retry { attempt: true, .. })
                    && !settled.fenced.iter().any(|f| f.id == r.id)
            })
            .count();
        add(&s.retried, spent as u64);
        if !settled.fenced.is_empty() {
            self.report_fenced(lane, &settled);
        }
        for r in &rows {
            if let Settle::Park { error } = &r.settle
                && !settled.fenced.iter().any(|f| f.id == r.id)
            {
                tracing::warn!(id = r.id, "message parked: {error}");
            }
        }
        Ok(())
    }

    fn report_fenced(&self, lane: usize, settled: &Settled) {
        add(&self.stats.fenced, settled.fenced.len() as u64);
        let (mut leased_again, mut expired, mut gone) = (0, 0, 0);
        for f in &settled.fenced {
            match f.fence {
                Some(Fence::Stale { .. }) => leased_again += 1,
                Some(Fence::Current) => expired += 1,
                None => gone += 1,
                Some(Fence::Newer { held }) => panic!(
                    "fence invariant: a relay never holds a generation newer than its row's (row {} holds {held})",
                    f.id
                ),
            }
        }
        tracing::warn!(
            lane,
            fenced = settled.fenced.len(),
            leased_again,
            expired,
            gone,
            "the lease of part of a batch ran out before its settle: those rows were not written (another relay holds them now)"
        );
    }

    /// Turn database commits into wake-ups: `LISTEN ferry_outbox` on Postgres; on SQLite
    /// a change of `PRAGMA data_version` (any connection's commit, in any process).
    async fn watch(self: Arc<Self>) {
        match self.store.db() {
            crate::store::Db::Pg(pool) => loop {
                match sqlx::postgres::PgListener::connect_with(pool).await {
                    Ok(mut l) => {
                        if let Err(e) = l.listen("ferry_outbox").await {
                            tracing::warn!("LISTEN failed: {e}; relying on the poll");
                        } else {
                            // Commits made while the listener was away notified no one.
                            self.wake.notify_waiters();
                            while l.recv().await.is_ok() {
                                self.wake.notify_waiters();
                            }
                        }
                    }
                    Err(e) => tracing::debug!("LISTEN connection failed: {e}"),
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            },
            crate::store::Db::Sqlite(pool) => {
                let mut conn = loop {
                    match pool.acquire().await {
                        Ok(c) => break c,
                        Err(e) => {
                            tracing::debug!("the commit watcher cannot get a connection yet: {e}");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                };
                let mut last: Option<i64> = None;
                loop {
                    let v: Option<i64> = sqlx::query_scalar("PRAGMA data_version")
                        .fetch_one(&mut *conn)
                        .await
                        .ok();
                    if v.is_some() && last.is_some() && v != last {
                        self.wake.notify_waiters();
                    }
                    last = v;
                    tokio::time::sleep(SQLITE_WATCH).await;
                }
            }
        }
    }

    /// Return expired leases to pending, every quarter lease.
    async fn reclaim_loop(self: Arc<Self>) {
        loop {
            tokio::time::sleep(self.config.lease / 4).await;
            match self.store.reclaim_expired().await {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(
                        messages = n,
                        "leases ran out (a relay died or stalled): those messages are pending again, marked uncertain"
                    );
                    self.wake.notify_waiters();
                }
                Err(e) if e.is_transient() => tracing::debug!("{e}"),
                Err(e) => tracing::warn!("{e}"),
            }
            self.check_dedup_window().await;
        }
    }

    /// Record the counters every [`TOTALS_EVERY`].
    async fn totals_loop(self: Arc<Self>) {
        loop {
            tokio::time::sleep(TOTALS_EVERY).await;
            self.record_totals(false).await;
        }
    }

    /// Upsert this relay's row of totals (crate::totals). A failure costs the report,
    /// never the relaying: it is logged, once per kind of error.
    async fn record_totals(&self, stopped: bool) {
        if !self.retired.load(Ordering::Relaxed) {
            match self
                .store
                .retire_relays(&self.config.owner, crate::totals::RETIRE_AFTER)
                .await
            {
                Ok(n) => {
                    if n > 0 {
                        tracing::debug!(rows = n, "folded the totals of retired relays");
                    }
                    self.retired.store(true, Ordering::Relaxed);
                }
                Err(e) => {
                    self.totals_failed(e);
                    return;
                }
            }
        }
        let st = self.status();
        let record = RelayRecord {
            owner: st.owner.clone(),
            transport: st.transport.clone(),
            stopped,
            breaker_open: st.breaker_open,
            last_error: st.last_error.clone(),
            totals: st.totals(),
        };
        if let Err(e) = self.store.record_totals(&record).await {
            self.totals_failed(e);
        }
    }

    /// Recording the totals failed: relaying goes on. A permanent failure is logged once.
    fn totals_failed(&self, e: DbError) {
        if e.is_transient() {
            tracing::debug!("{e}");
        } else if !self.totals_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "{e} (relaying goes on; `ferry outbox status` will lack this relay's totals)"
            );
        }
    }

    /// Raise the alarm when an uncertain message has waited so long that the transport
    /// may no longer recognise its id: resolving it then may store it twice.
    async fn check_dedup_window(&self) {
        let Some(window) = self.transport.dedup_window() else {
            return;
        };
        let Ok(st) = self.store.status().await else {
            return;
        };
        let limit = window.mul_f64(0.9).as_secs_f64();
        let past = st.oldest_uncertain_secs.is_some_and(|age| age > limit);
        let was = self
            .stats
            .uncertain_past_window
            .swap(past, Ordering::Relaxed);
        if past && !was {
            tracing::error!(
                oldest_uncertain_secs = st.oldest_uncertain_secs,
                dedup_window_secs = window.as_secs(),
                "an uncertain message has waited longer than the transport's dedup window allows: once the transport answers again it may store that message twice; consumers must deduplicate by message id, or raise the window"
            );
        }
    }
}

/// The settings, checked once: the error names the setting, its value and the limit.
fn check(c: &RelayConfig) -> Result<(), ConfigError> {
    if c.lanes == 0 || c.lanes > LANES_MAX {
        return Err(ConfigError::new(
            "lanes",
            c.lanes,
            format!("must be between 1 and {LANES_MAX}"),
        ));
    }
    if c.batch == 0 || c.batch > BATCH_MAX {
        return Err(ConfigError::new(
            "batch",
            c.batch,
            format!("must be between 1 and {BATCH_MAX}"),
        ));
    }
    if c.window == 0 || c.window > WINDOW_MAX {
        return Err(ConfigError::new(
            "window",
            c.window,
            format!("must be between 1 and {WINDOW_MAX}"),
        ));
    }
    if c.lease < LEASE_MIN {
        return Err(ConfigError::new(
            "lease",
            format!("{} ms", c.lease.as_millis()),
            format!(
                "must be at least {} ms: a shorter lease cannot cover one publish",
                LEASE_MIN.as_millis()
            ),
        ));
    }
    if c.max_attempts < 1 {
        return Err(ConfigError::new(
            "max_attempts",
            c.max_attempts,
            "must be at least 1",
        ));
    }
    if c.breaker_failures < 1 {
        return Err(ConfigError::new(
            "breaker_failures",
            c.breaker_failures,
            "must be at least 1",
        ));
    }
    if c.poll.is_zero() {
        return Err(ConfigError::new(
            "poll",
            "0 ms",
            "must be at least 1 ms: an idle relay would spin",
        ));
    }
    Ok(())
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
