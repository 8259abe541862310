//! What a relay counts ([`Stats`]), its status snapshot ([`RelayStatus`]) and its
//! Prometheus text.

use crate::breaker::Breaker;
use crate::totals::Totals;
use ferry_core::metrics::{Exposition, Histogram};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

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
pub(super) fn add(counter: &AtomicU64, n: u64) {
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

impl Stats {
    pub(super) fn snapshot(&self, owner: &str, transport: String, b: &Breaker) -> RelayStatus {
        let s = self;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RelayStatus {
            owner: owner.to_string(),
            transport,
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
}

impl RelayStatus {
    /// Prometheus text for this relay's counters, with its publish latency.
    pub(super) fn metrics(&self, publish_latency: &Histogram) -> String {
        let st = self;
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
            publish_latency,
        );
        e.finish()
    }
}
