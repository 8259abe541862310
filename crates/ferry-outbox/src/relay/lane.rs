//! One lane of a relay: the loop of the module doc (ask the breaker, lease, publish with
//! a window, decide each outcome, settle fenced), and what it tells the breaker.

use super::handle::{Relay, RelayError};
use super::stats::add;
use crate::breaker::{Admit, Change, Era};
use crate::error::DbError;
use crate::store::{Leased, Settle, SettleRow, Settled, Uncertain};
use crate::transport::Outcome;
use ferry_core::Classify;
use ferry_core::backoff::Backoff;
use ferry_core::epoch::{Epoch, Fence};
use ferry_core::seams::{Rng, SplitMix64};
use ferry_core::sync::lock;
use futures_util::StreamExt;
use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
/// `FERRY_OUTBOX_CRASH_BEFORE_SETTLE=1` makes the relay abort after publishing its first
/// batch, before settling it. For crash tests only (the `failpoints` feature, which
/// release builds leave off); read once.
#[cfg(feature = "failpoints")]
fn crash_before_settle() -> bool {
    static SET: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SET.get_or_init(|| std::env::var("FERRY_OUTBOX_CRASH_BEFORE_SETTLE").is_ok_and(|v| v == "1"))
}

/// The relay's randomness, locked only while the breaker draws from it (when it opens):
/// recording a publish's outcome otherwise takes the breaker's lock alone.
struct DrawLocked<'a>(&'a Mutex<SplitMix64>);

impl Rng for DrawLocked<'_> {
    fn next_u64(&mut self) -> u64 {
        lock(self.0).next_u64()
    }
}

impl Relay {
    pub(super) async fn lane(self: Arc<Self>, lane: usize) -> Result<(), RelayError> {
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
        self.record(era, outcome)
    }

    /// Feed the breaker with the outcome of a publish started in `era` (one call under
    /// its lock); log what it did. Returns the outcome as the breaker decided it (a 5xx
    /// among confirmations is the message's own refusal).
    fn record(&self, era: Era, o: Outcome) -> Outcome {
        let now = self.config.clock.now();
        let connections = self.connections_now();
        let (outcome, change) =
            lock(&self.breaker).record(era, o, now, connections, &mut DrawLocked(&self.rng));
        if let Some(change) = change {
            self.breaker_moved(change, &outcome);
        }
        outcome
    }

    /// The breaker changed state on outcome `o`: log it, and wake the lanes waiting on it.
    fn breaker_moved(&self, change: Change, o: &Outcome) {
        let reason = match o {
            Outcome::Unavailable { reason, .. } | Outcome::Unknown(reason) => reason.as_str(),
            Outcome::Confirmed { .. } | Outcome::Refused(_) => "",
        };
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
        // Every row is written or fenced (the store's account of a settle guarantees it).
        let written = settled
            .deleted
            .checked_add(settled.returned)
            .and_then(|n| n.checked_add(settled.parked))
            .expect("settle invariant: counts never wrap");
        add(&s.settled, written);
        add(&s.parked, settled.parked);
        add(&s.retried, settled.retried);
        if !settled.fenced.is_empty() {
            self.report_fenced(lane, &settled);
        }
        let fenced: HashSet<i64> = settled.fenced.iter().map(|f| f.id).collect();
        for r in &rows {
            if let Settle::Park { error } = &r.settle
                && !fenced.contains(&r.id)
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
}
