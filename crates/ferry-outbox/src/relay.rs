//! The relay (docs/outbox.md §4). Each lane repeats:
//!
//! 1. Lease up to `batch` claimable messages in one statement (nothing held after it).
//! 2. Publish them with up to `window` in flight, extending the lease at half-life.
//! 3. Settle the batch in one fenced statement: rows the lane no longer holds are
//!    reported fenced and left alone.
//! 4. With nothing claimable, wait for a wake-up (`NOTIFY` on Postgres, a change of
//!    `PRAGMA data_version` on SQLite) or the backstop poll.
//!
//! A crash between any two steps leaves leased rows whose lease runs out; `reclaim`
//! returns them to pending, marked uncertain, and the next presentation carries the same
//! message id, which the transport deduplicates.

use crate::store::{Leased, Settle, Settled, Store, Uncertain};
use crate::transport::{Outcome, Transport};
use ferry_core::backoff::Backoff;
use ferry_core::metrics::{Exposition, Histogram};
use ferry_core::seams::SplitMix64;
use futures_util::StreamExt;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How a relay runs. Checked by [`Relay::new`].
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// This relay's name in `lease_owner` (host, pid and a random suffix by default).
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
        }
    }
}

/// Per-message retry after a refusal: 1 s doubling to 5 min, full jitter.
const RETRY: Backoff = Backoff::new(
    Duration::from_secs(1),
    Duration::from_secs(300),
    Duration::from_millis(100),
);
/// The breaker stays open 100 ms doubling to 30 s, full jitter.
const BREAKER: Backoff = Backoff::new(
    Duration::from_millis(100),
    Duration::from_secs(30),
    Duration::from_millis(50),
);
/// An unanswered publish is presented again after this.
const UNCERTAIN_RETRY: Duration = Duration::from_secs(1);
/// Database errors back a lane off this long before it tries again.
const DB_RETRY: Backoff = Backoff::new(
    Duration::from_millis(100),
    Duration::from_secs(5),
    Duration::from_millis(50),
);
/// SQLite: how often an idle relay looks at `PRAGMA data_version` for commits by others.
const SQLITE_WATCH: Duration = Duration::from_millis(2);
/// Lease and poll bounds: a lease shorter than a second cannot cover one publish timeout.
const LEASE_MIN: Duration = Duration::from_secs(1);
const BATCH_MAX: u32 = 10_000;
const WINDOW_MAX: usize = 4096;

/// `FERRY_OUTBOX_CRASH_BEFORE_SETTLE=1` makes the relay abort after publishing its first
/// batch, before settling it. For crash tests only; read once.
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

/// Counters, for `/metrics` and tests.
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

/// A snapshot of [`Stats`] and the breaker.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RelayStatus {
    pub transport: String,
    pub breaker_open: bool,
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
    pub uncertain_past_window: bool,
}

/// The circuit breaker over the transport (docs/outbox.md §4.1).
#[derive(Debug, Default)]
struct Breaker {
    failures: u32,
    open_until: Option<Instant>,
    /// Confirmations since the last failure: a 5xx while these grow is the message's own.
    confirmed_since_failure: u64,
    last_error: Option<String>,
}

pub struct Relay {
    store: Store,
    transport: Arc<dyn Transport>,
    config: RelayConfig,
    stats: Stats,
    publish_latency: Histogram,
    breaker: Mutex<Breaker>,
    rng: Mutex<SplitMix64>,
    wake: Notify,
    stopping: AtomicBool,
}

impl Relay {
    pub fn new(
        store: Store,
        transport: Arc<dyn Transport>,
        config: RelayConfig,
    ) -> Result<Arc<Relay>, String> {
        if config.lanes == 0 || config.lanes > 64 {
            return Err(format!("--lanes {} must be between 1 and 64", config.lanes));
        }
        if config.batch == 0 || config.batch > BATCH_MAX {
            return Err(format!(
                "--batch {} must be between 1 and {BATCH_MAX}",
                config.batch
            ));
        }
        if config.window == 0 || config.window > WINDOW_MAX {
            return Err(format!(
                "--window {} must be between 1 and {WINDOW_MAX}",
                config.window
            ));
        }
        if config.lease < LEASE_MIN {
            return Err(format!(
                "--lease-ms {} must be at least {}",
                config.lease.as_millis(),
                LEASE_MIN.as_millis()
            ));
        }
        if config.max_attempts < 1 {
            return Err("--max-attempts must be at least 1".into());
        }
        Ok(Arc::new(Relay {
            store,
            transport,
            config,
            stats: Stats::default(),
            publish_latency: Histogram::latency(),
            breaker: Mutex::new(Breaker::default()),
            rng: Mutex::new(SplitMix64::from_entropy()),
            wake: Notify::new(),
            stopping: AtomicBool::new(false),
        }))
    }

    /// Run until `shutdown` resolves, then finish the batches in flight (publish and
    /// settle them) and return.
    pub async fn run(self: &Arc<Self>, shutdown: impl std::future::Future<Output = ()>) {
        let mut tasks = tokio::task::JoinSet::new();
        for lane in 0..self.config.lanes {
            let r = self.clone();
            tasks.spawn(async move { r.lane(lane).await });
        }
        let watcher = {
            let r = self.clone();
            tokio::spawn(async move { r.watch().await })
        };
        let reclaimer = {
            let r = self.clone();
            tokio::spawn(async move { r.reclaim_loop().await })
        };
        shutdown.await;
        tracing::info!("stopping: finishing the batches in flight");
        self.stopping.store(true, Ordering::SeqCst);
        self.wake.notify_waiters();
        while tasks.join_next().await.is_some() {}
        watcher.abort();
        reclaimer.abort();
    }

    /// Run on the current tokio runtime until [`Running::stop`].
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
        let b = self.breaker.lock().expect("breaker lock");
        let s = &self.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RelayStatus {
            transport: self.transport.describe(),
            breaker_open: b.open_until.is_some_and(|t| t > Instant::now()),
            consecutive_failures: b.failures,
            last_error: b.last_error.clone(),
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
            uncertain_past_window: s.uncertain_past_window.load(Ordering::Relaxed),
        }
    }

    /// Prometheus text for this relay's counters.
    pub fn metrics(&self) -> String {
        let st = self.status();
        let mut e = Exposition::new();
        let counters: [(&str, &str, u64); 11] = [
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
                "Publishes that found the transport away.",
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
                self.stats.db_errors.load(Ordering::Relaxed),
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
            "1 while the transport's circuit breaker is open.",
            &[],
            if st.breaker_open { 1.0 } else { 0.0 },
        );
        e.histogram(
            "ferry_outbox_publish_seconds",
            "Time from sending a publish to its answer.",
            &[],
            &self.publish_latency,
        );
        e.finish()
    }

    async fn lane(self: Arc<Self>, lane: usize) {
        let mut db_failures = 0u32;
        while !self.stopping.load(Ordering::SeqCst) {
            let batch = match self.breaker_wait().await {
                Some(b) => b,
                None => continue,
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
                    db_failures += 1;
                    self.stats.db_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(lane, "lease failed (retrying): {e}");
                    let d = DB_RETRY.delay(db_failures, &mut *self.rng.lock().expect("rng lock"));
                    self.sleep_or_stop(d).await;
                    continue;
                }
            };
            if leased.is_empty() {
                if !self.stopping.load(Ordering::SeqCst) {
                    let _ = tokio::time::timeout(self.config.poll, notified).await;
                }
                continue;
            }
            self.stats
                .leased
                .fetch_add(leased.len() as u64, Ordering::Relaxed);
            let outcomes = self.publish_batch(&leased).await;
            if crash_before_settle() {
                // A crash test's failpoint: die between publishing and settling, the
                // case the transport's dedup exists for (tests/outbox_crash.rs).
                std::process::abort();
            }
            self.settle(lane, &leased, outcomes).await;
        }
    }

    /// Wait while the breaker is open; the batch size to lease (1 when half open), or
    /// None when stopping.
    async fn breaker_wait(&self) -> Option<u32> {
        loop {
            if self.stopping.load(Ordering::SeqCst) {
                return None;
            }
            let (open_until, half_open) = {
                let b = self.breaker.lock().expect("breaker lock");
                (b.open_until, b.failures >= self.config.breaker_failures)
            };
            match open_until {
                Some(t) if t > Instant::now() => {
                    self.sleep_or_stop(t - Instant::now()).await;
                }
                _ => return Some(if half_open { 1 } else { self.config.batch }),
            }
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
    async fn publish_batch(&self, leased: &[Leased]) -> Vec<Outcome> {
        let held: Vec<(i64, i64)> = leased.iter().map(|m| (m.id, m.generation)).collect();
        // Collected first: a lazy `map` closure inside a spawned task trips the compiler's
        // higher-ranked lifetime inference.
        let sends: Vec<_> = leased
            .iter()
            .enumerate()
            .map(|(i, m)| self.publish_indexed(i, m))
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
                    match self.store.extend(&held, self.config.lease).await {
                        Ok(kept) if kept.len() < held.len() => tracing::warn!(
                            lost = held.len() - kept.len(),
                            "lost the lease of part of a batch while publishing: its settle will be fenced"
                        ),
                        Ok(_) => {}
                        Err(e) => {
                            self.stats.db_errors.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!("extending a lease failed: {e}");
                        }
                    }
                }
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.expect("every message of the batch was published"))
            .collect()
    }

    async fn publish_indexed(&self, i: usize, m: &Leased) -> (usize, Outcome) {
        (i, self.publish_one(m).await)
    }

    async fn publish_one(&self, m: &Leased) -> Outcome {
        {
            let b = self.breaker.lock().expect("breaker lock");
            if b.open_until.is_some_and(|t| t > Instant::now()) {
                return Outcome::Unavailable {
                    reason: b
                        .last_error
                        .clone()
                        .unwrap_or_else(|| "the transport's breaker is open".into()),
                    retry_after: None,
                    server_error: false,
                };
            }
        }
        let started = Instant::now();
        let outcome = self.transport.publish(m).await;
        self.publish_latency.observe(started.elapsed());
        // A 5xx while the endpoint was confirming other messages right before is this
        // message's own failure: decided now, before this failure resets the count.
        let outcome = match outcome {
            Outcome::Unavailable {
                reason,
                server_error: true,
                ..
            } if self
                .breaker
                .lock()
                .expect("breaker lock")
                .confirmed_since_failure
                > 0 =>
            {
                Outcome::Refused(reason)
            }
            other => other,
        };
        self.record(&outcome);
        outcome
    }

    /// Feed the breaker with an outcome.
    fn record(&self, o: &Outcome) {
        let mut b = self.breaker.lock().expect("breaker lock");
        match o {
            Outcome::Confirmed { .. } | Outcome::Refused(_) => {
                if b.failures >= self.config.breaker_failures {
                    tracing::info!(transport = %self.transport.describe(), "the transport answers again: closing the breaker");
                }
                b.failures = 0;
                b.open_until = None;
                b.confirmed_since_failure += 1;
            }
            Outcome::Unavailable { reason, .. } | Outcome::Unknown(reason) => {
                b.failures += 1;
                b.confirmed_since_failure = 0;
                b.last_error = Some(reason.clone());
                if b.failures >= self.config.breaker_failures {
                    let opens = b.failures - self.config.breaker_failures + 1;
                    let d = BREAKER.delay(opens, &mut *self.rng.lock().expect("rng lock"));
                    if b.open_until.is_none_or(|t| t <= Instant::now()) {
                        tracing::warn!(transport = %self.transport.describe(), failures = b.failures, pause_ms = d.as_millis() as u64, "the transport is away: pausing publishing ({reason})");
                    }
                    b.open_until = Some(Instant::now() + d);
                }
            }
        }
    }

    /// What to write back for each outcome (docs/outbox.md §4 step 4).
    fn decide(&self, m: &Leased, o: Outcome) -> Settle {
        let refused = |error: String| {
            let attempts = m.attempts + 1;
            if attempts >= self.config.max_attempts {
                Settle::Park {
                    error: format!("parked after {attempts} attempts: {error}"),
                }
            } else {
                Settle::Retry {
                    retry_in: RETRY
                        .delay(attempts as u32, &mut *self.rng.lock().expect("rng lock")),
                    attempt: true,
                    uncertain: Uncertain::Clear,
                    error,
                }
            }
        };
        match o {
            Outcome::Confirmed { .. } => Settle::Confirmed,
            Outcome::Refused(e) => refused(e),
            Outcome::Unavailable {
                reason,
                retry_after,
                ..
            } => {
                let pause = {
                    let b = self.breaker.lock().expect("breaker lock");
                    b.open_until
                        .map(|t| t.saturating_duration_since(Instant::now()))
                };
                Settle::Retry {
                    retry_in: retry_after.or(pause).unwrap_or(Duration::from_millis(200)),
                    attempt: false,
                    uncertain: Uncertain::Keep,
                    error: reason,
                }
            }
            Outcome::Unknown(reason) => Settle::Retry {
                retry_in: UNCERTAIN_RETRY,
                attempt: false,
                uncertain: Uncertain::Mark,
                error: reason,
            },
        }
    }

    async fn settle(&self, lane: usize, leased: &[Leased], outcomes: Vec<Outcome>) {
        let mut rows = Vec::with_capacity(leased.len());
        let (mut published, mut duplicates, mut reconciled, mut uncertain, mut unavailable) =
            (0u64, 0u64, 0u64, 0u64, 0u64);
        for (m, o) in leased.iter().zip(outcomes) {
            match &o {
                Outcome::Confirmed { duplicate } => {
                    published += 1;
                    duplicates += *duplicate as u64;
                    reconciled += m.uncertain as u64;
                }
                Outcome::Unknown(_) => uncertain += 1,
                Outcome::Unavailable { .. } => unavailable += 1,
                Outcome::Refused(_) => {}
            }
            rows.push((m.id, m.generation, self.decide(m, o)));
        }
        let s = &self.stats;
        s.published.fetch_add(published, Ordering::Relaxed);
        s.duplicates.fetch_add(duplicates, Ordering::Relaxed);
        s.reconciled.fetch_add(reconciled, Ordering::Relaxed);
        s.uncertain.fetch_add(uncertain, Ordering::Relaxed);
        s.unavailable.fetch_add(unavailable, Ordering::Relaxed);
        // A settle that fails (the database restarting) is retried until the lease would
        // have run out: after that it could only be fenced.
        let deadline = Instant::now() + self.config.lease;
        let mut failures = 0;
        let settled: Settled = loop {
            match self.store.settle(&rows).await {
                Ok(s) => break s,
                Err(e) => {
                    failures += 1;
                    self.stats.db_errors.fetch_add(1, Ordering::Relaxed);
                    if Instant::now() >= deadline {
                        tracing::warn!(
                            lane,
                            "settle failed until the lease ran out; the batch will be leased again: {e}"
                        );
                        return;
                    }
                    tracing::warn!(lane, "settle failed (retrying): {e}");
                    let d = DB_RETRY.delay(failures, &mut *self.rng.lock().expect("rng lock"));
                    tokio::time::sleep(d.min(deadline - Instant::now())).await;
                }
            }
        };
        s.settled.fetch_add(
            settled.deleted + settled.returned + settled.parked,
            Ordering::Relaxed,
        );
        s.parked.fetch_add(settled.parked, Ordering::Relaxed);
        s.retried.fetch_add(
            rows.iter()
                .filter(|(id, _, st)| {
                    matches!(st, Settle::Retry { attempt: true, .. })
                        && !settled.fenced.contains(id)
                })
                .count() as u64,
            Ordering::Relaxed,
        );
        if !settled.fenced.is_empty() {
            s.fenced
                .fetch_add(settled.fenced.len() as u64, Ordering::Relaxed);
            tracing::warn!(
                lane,
                fenced = settled.fenced.len(),
                "the lease of part of a batch ran out before its settle: those rows were not written (another relay holds them now)"
            );
        }
        for (id, _, st) in &rows {
            if let Settle::Park { error } = st
                && !settled.fenced.contains(id)
            {
                tracing::warn!(id, "message parked: {error}");
            }
        }
    }

    /// Turn database commits into wake-ups: `LISTEN ferry_outbox` on Postgres; on SQLite
    /// a change of `PRAGMA data_version` (any connection's commit, in any process).
    async fn watch(self: Arc<Self>) {
        match &self.store {
            Store::Pg(pool) => loop {
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
            Store::Sqlite(pool) => {
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
                Err(e) => tracing::debug!("reclaiming expired leases failed: {e}"),
            }
            self.check_dedup_window().await;
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

/// A relay started by [`Relay::spawn`]. Dropping it stops the relay at once, without
/// finishing the batches in flight: call [`Running::stop`].
#[derive(Debug)]
#[must_use = "dropping it stops the relay; call stop().await"]
pub struct Running {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// Stop leasing, publish and settle the batches in flight, and return.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = (&mut self.task).await;
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
