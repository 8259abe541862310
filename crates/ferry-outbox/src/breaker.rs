//! The circuit breaker over a relay's transport (docs/outbox.md §4.1). Pure: time comes
//! in as arguments, randomness through the `Rng` seam.
//!
//! An outage is one event, not one per message:
//!
//! 1. Closed: publish. Failures for transport reasons (unavailable, or sent without an
//!    answer) of publishes started while closed count in a row; `failures_max` of them
//!    open the breaker. Any answer from the transport (a confirmation or a refusal of
//!    the message itself) resets the count. A server error (5xx) while the transport
//!    has confirmed publishes since the last failure is the message's own refusal, not
//!    the transport's failure: [`Breaker::record`] decides it.
//! 2. Open: nothing is leased or published for the pause, drawn once per opening from a
//!    backoff that doubles with each opening in a row (full jitter). Failures reported
//!    while open, or by publishes that started before the opening, neither lengthen nor
//!    replace the pause: they are the same outage.
//! 3. Half open (the pause ran out, or the transport said it reconnected): one lane
//!    leases one message and publishes it, the probe. Its success closes the breaker
//!    (and the next opening starts from the shortest pause again); its failure opens
//!    it again with the next, longer pause. Only the probe's outcome counts.
//!
//! Every change of state starts a new era; a publish carries the era it started in, which
//! is how an outcome is told to belong to the current state or to an earlier one.

use crate::transport::Outcome;
use ferry_core::backoff::Backoff;
use ferry_core::seams::Rng;
use std::time::{Duration, Instant};

/// The breaker stays open 100 ms doubling per opening in a row to 30 s, full jitter (at
/// least 50 ms).
pub const PAUSE: Backoff = Backoff::new(
    Duration::from_millis(100),
    Duration::from_secs(30),
    Duration::from_millis(50),
);

/// The era a publish started in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Era(u64);

/// What a lane may do now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Lease a full batch.
    Lease,
    /// Lease one message and publish it as the probe (release it with
    /// [`Breaker::probe_done`] if the lease found nothing or failed).
    Probe(Era),
    /// Open: wait this long (or until the transport reconnects).
    Wait(Duration),
    /// Half open and another lane's probe is out: wait for its outcome.
    AwaitProbe,
}

/// What an outcome did to the breaker, for the relay to log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Opened after `failures` in a row: the `opening`-th opening in a row, for `pause`.
    Opened {
        failures: u32,
        opening: u32,
        pause: Duration,
    },
    /// The probe failed: open again, longer.
    Reopened { opening: u32, pause: Duration },
    /// The probe went through: closed.
    Closed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Closed,
    Open { until: Instant },
    HalfOpen { probing: bool },
}

#[derive(Debug)]
pub struct Breaker {
    state: State,
    /// Rises at every change of state.
    era: u64,
    /// Transport failures in a row of publishes started in the current closed era.
    failures: u32,
    /// Openings since the breaker last closed (1 while open the first time).
    openings: u32,
    failures_max: u32,
    /// The pause of the current (or last) opening, as drawn.
    pause: Duration,
    /// Confirmations since the last failure: a 5xx while these grow is the message's own.
    confirmed_since_failure: u64,
    last_error: Option<String>,
    /// Openings ever, and probes that failed ever (for status and metrics).
    opened_total: u64,
    probes_failed_total: u64,
    /// The transport's connection count when the breaker last opened: a higher count
    /// means it reconnected since, and the probe need not wait out the pause.
    connections_at_open: u64,
}

impl Breaker {
    pub fn new(failures_max: u32) -> Breaker {
        assert!(
            failures_max >= 1,
            "breaker: failures_max is checked at construction"
        );
        Breaker {
            state: State::Closed,
            era: 0,
            failures: 0,
            openings: 0,
            failures_max,
            pause: Duration::ZERO,
            confirmed_since_failure: 0,
            last_error: None,
            opened_total: 0,
            probes_failed_total: 0,
            connections_at_open: 0,
        }
    }

    /// The era a publish starting now belongs to, or None when it must not go out: while
    /// open, and while half open unless it is the probe (`probe`: the era the lane's
    /// [`Admit::Probe`] gave it).
    pub fn start(&self, probe: Option<Era>) -> Option<Era> {
        match self.state {
            State::Closed => Some(Era(self.era)),
            State::HalfOpen { .. } if probe == Some(Era(self.era)) => Some(Era(self.era)),
            State::Open { .. } | State::HalfOpen { .. } => None,
        }
    }

    /// What a lane may do at `now`; moves an open breaker whose pause ran out, or whose
    /// transport has reconnected since it opened (`connections`), to half open.
    pub fn admit(&mut self, now: Instant, connections: u64) -> Admit {
        if let State::Open { until } = self.state {
            if now < until && connections <= self.connections_at_open {
                return Admit::Wait(until - now);
            }
            self.enter(State::HalfOpen { probing: false });
        }
        match self.state {
            State::Closed => Admit::Lease,
            State::HalfOpen { probing: false } => {
                self.state = State::HalfOpen { probing: true };
                Admit::Probe(Era(self.era))
            }
            State::HalfOpen { probing: true } => Admit::AwaitProbe,
            State::Open { .. } => unreachable!("an open breaker became half open above"),
        }
    }

    /// The probe of `era` leased nothing, failed to lease, or settled without an
    /// outcome that moved the breaker: let another lane probe.
    pub fn probe_done(&mut self, era: Era) {
        if era.0 == self.era && self.state == (State::HalfOpen { probing: true }) {
            self.state = State::HalfOpen { probing: false };
        }
    }

    /// A publish of `era` ended with `outcome`: one call per publish. Returns the
    /// outcome as the relay settles it, and what it did to the breaker. A 5xx while
    /// publishes were confirmed since the last failure becomes the message's own
    /// refusal (decided before this failure would reset that count); any other outcome
    /// stays as it is. `now`, `connections` and `rng` serve an opening, as in
    /// [`Breaker::failed`].
    pub fn record(
        &mut self,
        era: Era,
        outcome: Outcome,
        now: Instant,
        connections: u64,
        rng: &mut dyn Rng,
    ) -> (Outcome, Option<Change>) {
        let (outcome, taken_as_refusal) = match outcome {
            Outcome::Unavailable {
                reason,
                server_error: true,
                ..
            } if self.confirmed_since_failure > 0 => (Outcome::Refused(reason), true),
            other => (other, false),
        };
        let change = match &outcome {
            Outcome::Confirmed { .. } | Outcome::Refused(_) => {
                let change = self.answered(era);
                if taken_as_refusal {
                    // It answered nothing: the next 5xx, with no confirmation between, is
                    // the transport's (else an endpoint failing every request with 5xx
                    // after one success would never open the breaker, and would park
                    // every message instead).
                    self.confirmed_since_failure = 0;
                }
                change
            }
            Outcome::Unavailable {
                reason,
                retry_after,
                ..
            } => self.failed(era, reason, *retry_after, now, connections, rng),
            Outcome::Unknown(reason) => self.failed(era, reason, None, now, connections, rng),
        };
        (outcome, change)
    }

    /// The transport answered a publish of `era` (confirmed, or refused the message).
    pub fn answered(&mut self, era: Era) -> Option<Change> {
        self.failures = 0;
        self.confirmed_since_failure = self.confirmed_since_failure.saturating_add(1);
        match self.state {
            State::HalfOpen { .. } if era.0 == self.era => {
                self.openings = 0;
                self.enter(State::Closed);
                Some(Change::Closed)
            }
            _ => None,
        }
    }

    /// A publish of `era` found the transport away (or got no answer), for `reason`;
    /// `retry_after`: the transport asked for at least this pause.
    pub fn failed(
        &mut self,
        era: Era,
        reason: &str,
        retry_after: Option<Duration>,
        now: Instant,
        connections: u64,
        rng: &mut dyn Rng,
    ) -> Option<Change> {
        self.confirmed_since_failure = 0;
        if era.0 != self.era {
            // Started before the breaker last changed: the same outage, already counted.
            return None;
        }
        self.last_error = Some(reason.to_string());
        match self.state {
            State::Closed => {
                self.failures = self
                    .failures
                    .checked_add(1)
                    .expect("breaker invariant: failures in a row stop at failures_max");
                if self.failures < self.failures_max {
                    return None;
                }
                let failures = self.failures;
                let (opening, pause) = self.open(retry_after, now, connections, rng);
                Some(Change::Opened {
                    failures,
                    opening,
                    pause,
                })
            }
            State::HalfOpen { .. } => {
                self.probes_failed_total = self.probes_failed_total.saturating_add(1);
                let (opening, pause) = self.open(retry_after, now, connections, rng);
                Some(Change::Reopened { opening, pause })
            }
            State::Open { .. } => None,
        }
    }

    fn open(
        &mut self,
        retry_after: Option<Duration>,
        now: Instant,
        connections: u64,
        rng: &mut dyn Rng,
    ) -> (u32, Duration) {
        self.openings = self.openings.saturating_add(1);
        self.opened_total = self.opened_total.saturating_add(1);
        // A transport that asks for a longer pause gets it, up to the backoff's cap: a
        // relay probes at least that often.
        let pause = PAUSE
            .delay(self.openings, rng)
            .max(retry_after.unwrap_or_default().min(PAUSE.cap()));
        self.pause = pause;
        self.connections_at_open = connections;
        self.enter(State::Open { until: now + pause });
        (self.openings, pause)
    }

    fn enter(&mut self, state: State) {
        self.state = state;
        self.era = self
            .era
            .checked_add(1)
            .expect("breaker invariant: eras never wrap (one per state change)");
        self.failures = 0;
    }

    /// Not closed: open, or half open with a probe out or due.
    pub fn is_open(&self) -> bool {
        self.state != State::Closed
    }

    /// The pause of the current opening (zero when closed).
    pub fn pause(&self) -> Duration {
        if self.is_open() {
            self.pause
        } else {
            Duration::ZERO
        }
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }

    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    pub fn opened_total(&self) -> u64 {
        self.opened_total
    }

    pub fn probes_failed_total(&self) -> u64 {
        self.probes_failed_total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::seams::SplitMix64;

    fn fail(b: &mut Breaker, era: Era, now: Instant, rng: &mut SplitMix64) -> Option<Change> {
        b.failed(era, "away", None, now, 0, rng)
    }

    // Guards against one outage opening the breaker once per failed message: a whole
    // window of publishes started while closed fails; only the first failures_max count,
    // the rest (and failures reported while open) neither reopen nor lengthen it.
    #[test]
    fn a_batch_of_failures_opens_the_breaker_once() {
        let mut rng = SplitMix64::seeded(1);
        let mut b = Breaker::new(5);
        let t0 = Instant::now();
        let era = b.start(None).unwrap();
        let mut changes = Vec::new();
        for _ in 0..256 {
            changes.extend(fail(&mut b, era, t0, &mut rng));
        }
        assert_eq!(changes.len(), 1, "{changes:?}");
        let Change::Opened { opening, pause, .. } = changes[0].clone() else {
            panic!("{changes:?}")
        };
        assert_eq!(opening, 1);
        assert!(pause <= Duration::from_millis(100));
        assert_eq!(b.pause(), pause, "the pause reported is the pause in force");
        assert_eq!(b.admit(t0, 0), Admit::Wait(pause));
        assert_eq!(b.start(None), None, "nothing is published while open");
        assert_eq!(b.opened_total(), 1);
    }

    // Guards the half-open protocol: one probe at a time; its failure reopens with the
    // next opening's (longer) window, its success closes and starts again from the
    // shortest; a stale success from before does not close it.
    #[test]
    fn the_probe_decides_and_each_opening_in_a_row_waits_longer() {
        let mut rng = SplitMix64::seeded(2);
        let mut b = Breaker::new(1);
        let mut now = Instant::now();
        let old = b.start(None).unwrap();
        assert!(matches!(
            fail(&mut b, old, now, &mut rng),
            Some(Change::Opened { opening: 1, .. })
        ));
        for opening in 2..=12u32 {
            now += b.pause();
            let Admit::Probe(era) = b.admit(now, 0) else {
                panic!("the pause ran out: a probe is due")
            };
            assert_eq!(b.admit(now, 0), Admit::AwaitProbe, "one probe at a time");
            assert_eq!(
                b.start(None),
                None,
                "only the probe goes out while half open"
            );
            assert_eq!(b.start(Some(era)), Some(era));
            assert_eq!(
                b.answered(old),
                None,
                "an old publish's answer is not the probe's"
            );
            let Some(Change::Reopened { opening: o, pause }) = fail(&mut b, era, now, &mut rng)
            else {
                panic!("the probe failed: reopen")
            };
            assert_eq!(o, opening);
            let window = Duration::from_millis(100)
                .saturating_mul(1 << (opening - 1))
                .min(Duration::from_secs(30));
            assert!(pause <= window, "opening {opening}: {pause:?} > {window:?}");
        }
        assert_eq!(b.probes_failed_total(), 11);
        now += b.pause();
        let Admit::Probe(era) = b.admit(now, 0) else {
            panic!()
        };
        assert_eq!(b.answered(era), Some(Change::Closed));
        assert!(!b.is_open());
        assert_eq!(b.admit(now, 0), Admit::Lease);
        let era = b.start(None).unwrap();
        assert!(matches!(
            fail(&mut b, era, now, &mut rng),
            Some(Change::Opened { opening: 1, .. })
        ));
    }

    // Guards against a paused relay waiting out its pause after the transport says it
    // is back: a reconnection since the opening makes the probe due at once.
    #[test]
    fn a_reconnection_makes_the_probe_due_at_once() {
        let mut rng = SplitMix64::seeded(3);
        let mut b = Breaker::new(1);
        let now = Instant::now();
        let era = b.start(None).unwrap();
        b.failed(era, "away", Some(Duration::from_secs(20)), now, 7, &mut rng);
        assert!(matches!(b.admit(now, 7), Admit::Wait(d) if d >= Duration::from_secs(20)));
        assert!(matches!(b.admit(now, 8), Admit::Probe(_)));
    }

    fn server_error() -> Outcome {
        Outcome::Unavailable {
            reason: "HTTP 500".into(),
            retry_after: None,
            server_error: true,
        }
    }

    // Guards the 5xx rule: an endpoint failing for one message while it confirms others
    // refuses that message (it spends an attempt, and the breaker does not count it);
    // with nothing confirmed since the last failure, a 5xx is the transport's failure
    // and counts toward opening.
    #[test]
    fn a_server_error_among_confirmations_is_the_message_s_own() {
        let mut rng = SplitMix64::seeded(5);
        let mut b = Breaker::new(2);
        let now = Instant::now();
        let era = b.start(None).unwrap();
        let (o, change) = b.record(era, server_error(), now, 0, &mut rng);
        assert_eq!(
            o,
            server_error(),
            "nothing confirmed yet: the transport's failure"
        );
        assert_eq!((change, b.failures()), (None, 1));
        let (o, _) = b.record(
            era,
            Outcome::Confirmed { duplicate: false },
            now,
            0,
            &mut rng,
        );
        assert_eq!(o, Outcome::Confirmed { duplicate: false });
        assert_eq!(b.failures(), 0, "an answer resets the count");
        let (o, change) = b.record(era, server_error(), now, 0, &mut rng);
        assert_eq!(o, Outcome::Refused("HTTP 500".into()), "the message's own");
        assert_eq!((change, b.failures()), (None, 0));
        // A second 5xx with no confirmation between is the transport's, as is every one
        // after it: an endpoint that fails everything opens the breaker.
        let (o, _) = b.record(era, server_error(), now, 0, &mut rng);
        assert_eq!(o, server_error(), "nothing confirmed since the last 5xx");
        assert_eq!(b.failures(), 1);
        b.record(
            era,
            Outcome::Confirmed { duplicate: false },
            now,
            0,
            &mut rng,
        );
        let (o, _) = b.record(era, server_error(), now, 0, &mut rng);
        assert_eq!(o, Outcome::Refused("HTTP 500".into()), "the message's own");
        let away = Outcome::Unknown("timed out".into());
        b.record(era, away.clone(), now, 0, &mut rng);
        let (o, change) = b.record(era, server_error(), now, 0, &mut rng);
        assert_eq!(o, server_error(), "a failure came between: the transport's");
        assert!(matches!(change, Some(Change::Opened { failures: 2, .. })));
    }

    // A lane that took the probe and leased nothing hands it back.
    #[test]
    fn an_unused_probe_is_handed_back() {
        let mut rng = SplitMix64::seeded(4);
        let mut b = Breaker::new(1);
        let now = Instant::now();
        let era = b.start(None).unwrap();
        fail(&mut b, era, now, &mut rng);
        let later = now + Duration::from_secs(31);
        let Admit::Probe(p) = b.admit(later, 0) else {
            panic!()
        };
        b.probe_done(p);
        assert!(matches!(b.admit(later, 0), Admit::Probe(_)));
    }
}
