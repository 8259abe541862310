//! What a relay counts ([`Stats`]), its status snapshot ([`RelayStatus`]) and its
//! Prometheus text.

use crate::breaker::Breaker;
use crate::totals::Totals;
use ferry_core::metrics::{Exposition, Histogram};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// [`Stats`], [`RelayStatus`], and the snapshot and totals taken from them, over the
/// counters listed once in crate::totals.
macro_rules! define_relay_counters {
    (relay: $($relay:ident),+; breaker: breaker_openings) => {
        /// Counters, for `/metrics`, the totals and tests.
        #[derive(Debug, Default)]
        pub struct Stats {
            $(pub $relay: AtomicU64,)+
            /// An uncertain message is older than the transport's dedup window less a margin:
            /// its next presentation may be stored twice (docs/outbox.md §4.2).
            pub uncertain_past_window: AtomicBool,
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
            $(pub $relay: u64,)+
            pub uncertain_past_window: bool,
        }

        impl Stats {
            /// What the relay records in the database (crate::totals): these counters and
            /// the breaker's openings.
            pub(super) fn totals(&self, b: &Breaker) -> Totals {
                Totals {
                    $($relay: self.$relay.load(Ordering::Relaxed),)+
                    breaker_openings: b.opened_total(),
                }
            }

            pub(super) fn snapshot(&self, owner: &str, transport: String, b: &Breaker) -> RelayStatus {
                RelayStatus {
                    owner: owner.to_string(),
                    transport,
                    breaker_open: b.is_open(),
                    breaker_pause_ms: u64::try_from(b.pause().as_millis()).unwrap_or(u64::MAX),
                    breaker_openings: b.opened_total(),
                    breaker_probes_failed: b.probes_failed_total(),
                    consecutive_failures: b.failures(),
                    last_error: b.last_error().map(str::to_string),
                    $($relay: self.$relay.load(Ordering::Relaxed),)+
                    uncertain_past_window: self.uncertain_past_window.load(Ordering::Relaxed),
                }
            }
        }
    };
}

crate::totals::counters!(define_relay_counters);

/// Add `n` to a counter. Counters never wrap: at a billion events a second a u64 lasts
/// five centuries, so a wrap means a bug (a negative count cast), and the relay stops.
pub(super) fn add(counter: &AtomicU64, n: u64) {
    let before = counter.fetch_add(n, Ordering::Relaxed);
    assert!(
        before.checked_add(n).is_some(),
        "relay invariant: counters never wrap"
    );
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
