//! The replica's loop over a transport: fetch, apply, report.
//!
//! 1. Report where the replica stands: at once when it starts and after a batch that
//!    moved nothing (a gap, a refusal); after batches that applied, at most once per
//!    `report_every` (the next fetch's wait is cut short when one falls due); every
//!    `keepalive` otherwise. The transport took the report: its rejections are marked
//!    reported.
//! 2. Fetch up to `window` frames after the replica's position (seq, nonce), waiting up
//!    to `wait` (long poll, cut short when a report falls due); mark the server heard.
//! 3. Apply them in order ([`Replica::receive`]). A gap or refused frame applies nothing
//!    but the batch goes on, since a later frame may start a chain; a later protocol
//!    ends the loop (`RunEnd::LaterProtocol`: upgrade); a transient storage failure
//!    ends the batch and backs off (the frame comes again).
//! 4. On a transient failure (the transport, a full disk) or a batch that moved nothing,
//!    wait a backoff (full jitter) before fetching again; a permanent failure (a wrong
//!    token, a broken file) ends the loop with the error.
//!
//! Nothing here is persisted beyond what `receive`, `reported` and `heard` write. A
//! crash anywhere leaves the file at a message boundary; the loop restarts from it.
//! [`Replica::run_live`] also tells a [`Live`] what it does, for the running replica's
//! /metrics and /status (`live.rs`).

use super::live::{FileFacts, Live};
use super::{Received, Replica, ReplicaError};
use crate::wire;
use ferry_core::backoff::Backoff;
use ferry_core::seams::{SplitMix64, wall_ms};
use ferry_core::{Class, Classify, ConfigError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The transport, replica side: all a transport implements (HTTP is built in; others
/// through this seam).
pub trait Downlink {
    /// Up to `max` frames after `position`, in order, waiting up to `wait` for one;
    /// empty when none came. A position in an epoch the server no longer uses means
    /// "from the start of its current chain".
    fn fetch(
        &mut self,
        position: Position,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError>;

    /// Sends an encoded report ([`wire::encode_up`]); `Ok` once the server stored it.
    fn report(&mut self, up: &[u8]) -> Result<(), TransportError>;
}

/// Where a replica stands in its chain: what a fetch asks to continue from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// The epoch of the last applied message; `None` before the first.
    pub epoch: Option<[u8; 16]>,
    pub seq: u64,
    pub nonce: u64,
}

/// Why the transport failed, by what the loop does next.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The server could not be reached, or failed in a way that passes (5xx, a timeout).
    #[error("the sync server is unavailable: {0}; retrying with backoff")]
    Unavailable(String),
    /// The server refused this replica (401: a wrong token or another replica's id; 413:
    /// a report over its limit). Retrying cannot help.
    /// The server's own words say what to do (serve's refusals do: docs/sync-protocol.md §2.1).
    #[error("the sync server refused this replica's request: {0}")]
    Refused(String),
}

impl Classify for TransportError {
    fn class(&self) -> Class {
        match self {
            TransportError::Unavailable(_) => Class::Transient,
            TransportError::Refused(_) => Class::Permanent,
        }
    }
}

/// The loop's settings. Checked once by [`RunSettings::check`].
#[derive(Clone, Debug)]
pub struct RunSettings {
    /// Frames per fetch: 16 apply in well under a second, and the server serves at most
    /// 64 (`docs/sync-protocol.md` §2.1).
    pub window: usize,
    /// Long-poll wait per fetch; the server waits at most 30 s.
    pub wait: Duration,
    /// How soon an unreported change (applied frames, or a report that failed) is
    /// reported: while frames keep applying, reports go at most this often.
    pub report_every: Duration,
    /// How often the replica reports with nothing new (the server's view of its
    /// position is at most this old).
    pub keepalive: Duration,
    /// How often reports carry digests, which read every synced row.
    pub digest_every: Duration,
    /// No fetch answered within this long: the replica stands `offline`. Above `wait`, or
    /// a replica waiting in a healthy long poll would show offline.
    pub offline_after: Duration,
    pub backoff: Backoff,
}

/// How long the replica's loops wait after a failure to reach the server: 200 ms
/// doubling, full jitter, at most 5 s. A store offline for a day comes back within a few
/// seconds of its network (a 30 s cap cost a median 11 s before the first try:
/// docs/notes/2026-12-06-offline-day.md); 5 s spreads a fleet's return over as much.
pub const BACKOFF: Backoff = Backoff::new(
    Duration::from_millis(200),
    Duration::from_secs(5),
    Duration::from_millis(50),
);

/// The most frames the server serves per fetch, and its longest wait.
pub const WINDOW_MAX: usize = 64;
pub const WAIT_MAX: Duration = Duration::from_secs(30);

impl Default for RunSettings {
    fn default() -> RunSettings {
        RunSettings {
            window: 16,
            wait: Duration::from_secs(20),
            report_every: Duration::from_secs(1),
            keepalive: Duration::from_secs(30),
            digest_every: Duration::from_secs(600),
            offline_after: Duration::from_secs(60),
            backoff: BACKOFF,
        }
    }
}

impl RunSettings {
    pub fn check(&self) -> Result<(), ConfigError> {
        if self.window == 0 || self.window > WINDOW_MAX {
            return Err(ConfigError::new(
                "window",
                self.window,
                "must be 1 to 64 frames (the server serves at most 64)",
            ));
        }
        if self.wait > WAIT_MAX {
            return Err(ConfigError::new(
                "wait",
                format!("{:?}", self.wait),
                "must be at most 30 s (the server waits no longer)",
            ));
        }
        if self.report_every.is_zero() || self.report_every > self.keepalive {
            return Err(ConfigError::new(
                "report_every",
                format!("{:?}", self.report_every),
                "must be above 0 and at most keepalive, or a change would be reported later than no change",
            ));
        }
        if self.offline_after <= self.wait {
            return Err(ConfigError::new(
                "offline_after",
                format!("{:?}", self.offline_after),
                "must be above wait, or a replica waiting in a healthy long poll would show offline",
            ));
        }
        Ok(())
    }
}

/// How the loop ended without an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunEnd {
    /// `stop` was set.
    Stopped,
    /// The server speaks a later protocol: upgrade this replica's ferry.
    LaterProtocol(u16),
}

/// Why the loop stopped: a permanent failure of the transport or the replica's file.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Replica(#[from] ReplicaError),
}

impl Classify for RunError {
    fn class(&self) -> Class {
        match self {
            RunError::Config(e) => e.class(),
            RunError::Transport(e) => e.class(),
            RunError::Replica(e) => e.class(),
        }
    }
}

/// What the loop remembers between turns (nothing of it is persisted).
struct Turn<'a> {
    /// Where the loop tells what it does, for readers on other threads.
    live: &'a Live,
    /// A change (applied, gap, refusal, failure) not yet reported.
    unreported: bool,
    last_attempt: Option<Instant>,
    last_ok: Option<Instant>,
    last_digest: Option<Instant>,
    /// The last fetch brought fewer frames than the window: nothing more known to apply.
    caught_up: bool,
    failures: u32,
}

impl Replica {
    /// Fetches, applies and reports until `stop` is set, the server speaks a later
    /// protocol, or a permanent failure (returned). Transient failures (the transport,
    /// a full disk) are retried after a backoff.
    pub fn run(
        &mut self,
        link: &mut dyn Downlink,
        stop: &AtomicBool,
        settings: &RunSettings,
    ) -> Result<RunEnd, RunError> {
        self.run_live(link, stop, settings, &Live::new())
    }

    /// As [`Replica::run`], telling `live` what it does (its counters, when the server
    /// last answered, a snapshot of the file's position), so another thread can serve the
    /// running replica's /metrics and /status.
    pub fn run_live(
        &mut self,
        link: &mut dyn Downlink,
        stop: &AtomicBool,
        settings: &RunSettings,
        live: &Live,
    ) -> Result<RunEnd, RunError> {
        settings.check()?;
        live.set_offline_after_ms(settings.offline_after.as_millis() as u64);
        self.tell_file(live);
        let mut rng = SplitMix64::from_entropy();
        let mut turn = Turn {
            live,
            unreported: true,
            last_attempt: None,
            last_ok: None,
            last_digest: None,
            caught_up: false,
            failures: 0,
        };
        while !stop.load(Ordering::SeqCst) {
            // The uploader's count before this turn: news after it ends a backoff.
            let seen = self.link_back.as_ref().map(|b| b.other(Side::Fetch));
            let result = self.turn(link, &mut turn, settings);
            self.tell_file(live);
            let back = (self.link_back.as_deref().zip(seen)).map(|(b, s)| (b, Side::Fetch, s));
            match result {
                Ok(Some(end)) => return Ok(end),
                Ok(None) if turn.failures == 0 => {}
                Ok(None) => {
                    pause_unless_back(stop, settings.backoff.delay(turn.failures, &mut rng), back)
                }
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e, "the replica loop failed; retrying after a backoff");
                    live.failed();
                    turn.failures = turn.failures.saturating_add(1);
                    // The server may come back changed (restarted, or restored from an
                    // older copy, which a report shows it at once): report first.
                    turn.unreported = true;
                    turn.last_attempt = None;
                    pause_unless_back(stop, settings.backoff.delay(turn.failures, &mut rng), back);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(RunEnd::Stopped)
    }

    /// Step 3 of `live.rs`: the file's facts a standing needs. A failed read keeps the
    /// last ones (the turn's own error says what failed).
    fn tell_file(&self, live: &Live) {
        let read = || -> Result<FileFacts, ReplicaError> {
            let state = super::state::State::read(&self.conn)?;
            let rejections: i64 = self
                .conn
                .query_row("SELECT COUNT(*) FROM _ferry_sync_rejections", [], |r| {
                    r.get(0)
                })
                .map_err(|e| ReplicaError::storage("counting rejections", e))?;
            Ok(FileFacts {
                provisioned: state.epoch.is_some(),
                seq: state.seq,
                gap: state.gap,
                rejections: rejections as u64,
                heard_at_ms: state.heard_at_ms,
            })
        };
        if let Ok(facts) = read() {
            live.file_read(facts);
        }
    }

    /// Steps 1 to 3 once. `turn.failures` grows when the batch moved nothing (a gap, a
    /// refusal, a storage failure), so the caller backs off before fetching it again.
    fn turn(
        &mut self,
        link: &mut dyn Downlink,
        turn: &mut Turn<'_>,
        settings: &RunSettings,
    ) -> Result<Option<RunEnd>, RunError> {
        if until_report(turn, settings).is_zero() {
            self.report(link, turn, settings)?;
            self.answered(turn);
        }
        // Waiting wishes are offered again each turn.
        self.wishes_round();
        let wait = settings.wait.min(until_report(turn, settings));
        let position = super::state::State::read(&self.conn)?;
        let at = Position {
            epoch: position.epoch,
            seq: position.seq,
            nonce: position.nonce,
        };
        let frames = link.fetch(at, settings.window, wait)?;
        self.answered(turn);
        let heard_at_ms = wall_ms();
        turn.caught_up = frames.len() < settings.window;
        turn.live.heard(heard_at_ms, turn.caught_up);
        self.heard(heard_at_ms)?;
        if frames.is_empty() {
            turn.failures = 0;
            return Ok(None);
        }
        let moved = match self.apply_batch(&frames, turn.live)? {
            Batch::Done { moved } => moved,
            Batch::LaterProtocol(protocol) => {
                // Best effort: the server learns the position; the loop ends anyway.
                let _ = self.report(link, turn, settings);
                return Ok(Some(RunEnd::LaterProtocol(protocol)));
            }
            Batch::StorageFailed => false,
        };
        if moved {
            self.wishes_round(); // the wishes these messages brought
        }
        turn.unreported = true;
        // A batch that moved nothing (a gap, a refusal) is told at once: the server heals
        // it. Otherwise at most once per `report_every`: a report costs the server a
        // pass's work per replica, and what it carries (confirmations) only prunes the
        // outbox and moves marks; what is sent next never waits for it.
        if !moved || until_report(turn, settings).is_zero() {
            self.report(link, turn, settings)?;
        }
        turn.failures = if moved {
            0
        } else {
            turn.failures.saturating_add(1)
        };
        Ok(None)
    }

    /// The server answered: after failures, the uploader beside this loop stops waiting
    /// out its backoff (as soon as the report goes through, not after the long poll).
    fn answered(&self, turn: &Turn<'_>) {
        if turn.failures > 0
            && let Some(back) = &self.link_back
        {
            back.heard(Side::Fetch);
        }
    }

    /// Carries the open wishes out; a failure is the next round's to retry.
    fn wishes_round(&mut self) {
        match self.carry_out_wishes() {
            Ok(round) if round != Default::default() => tracing::info!(?round, "wishes answered"),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "carrying wishes out failed; trying again next turn")
            }
        }
    }

    /// Step 3 for one batch.
    fn apply_batch(&mut self, frames: &[Vec<u8>], live: &Live) -> Result<Batch, ReplicaError> {
        let mut moved = false;
        if frames.len() > 1 {
            match self.receive_many(frames) {
                Ok(Some(received)) => {
                    for (frame, r) in frames.iter().zip(&received) {
                        live.received(frame.len());
                        live.count(r);
                        moved |= matches!(r, Received::Applied { .. });
                    }
                    return Ok(Batch::Done { moved });
                }
                Ok(None) => {} // one at a time, below
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e, "applying messages failed; they will be fetched again");
                    return Ok(Batch::StorageFailed);
                }
                Err(e) => return Err(e),
            }
        }
        for frame in frames {
            live.received(frame.len());
            let received = self.receive(frame);
            if let Ok(r) = &received {
                live.count(r);
            }
            match received {
                Ok(Received::Applied { .. }) => moved = true,
                Ok(Received::AlreadyApplied { .. }) => {}
                Ok(Received::Gap { seq }) => {
                    tracing::warn!(seq, "a message did not follow the chain")
                }
                Ok(Received::Refused { reason }) => tracing::warn!(%reason, "a frame was refused"),
                Ok(Received::LaterProtocol(protocol)) => return Ok(Batch::LaterProtocol(protocol)),
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e, "applying a message failed; it will be fetched again");
                    return Ok(Batch::StorageFailed);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Batch::Done { moved })
    }

    /// Step 1: one report. Until one succeeds, the change stays unreported (retried
    /// after `report_every`).
    fn report(
        &mut self,
        link: &mut dyn Downlink,
        turn: &mut Turn<'_>,
        settings: &RunSettings,
    ) -> Result<(), RunError> {
        let now = Instant::now();
        turn.last_attempt = Some(now);
        turn.unreported = true;
        let digests = turn.caught_up
            && turn
                .last_digest
                .is_none_or(|at| now.duration_since(at) >= settings.digest_every);
        let up = if digests {
            self.up()?
        } else {
            self.up_without_digests()?
        };
        link.report(&wire::encode_up(&up))?;
        turn.live.reported();
        turn.unreported = false;
        turn.last_ok = Some(now);
        if !up.digests.is_empty() {
            turn.last_digest = Some(now);
        }
        self.reported(&up)?;
        Ok(())
    }
}

enum Batch {
    /// `moved`: at least one message applied.
    Done {
        moved: bool,
    },
    LaterProtocol(u16),
    StorageFailed,
}

/// Time until the next report falls due.
fn until_report(turn: &Turn<'_>, settings: &RunSettings) -> Duration {
    let since = |at: Option<Instant>| at.map_or(Duration::MAX, |at| at.elapsed());
    if turn.unreported {
        settings
            .report_every
            .saturating_sub(since(turn.last_attempt))
    } else {
        settings.keepalive.saturating_sub(since(turn.last_ok))
    }
}

/// Shared by a replica's fetch loop and its uploader ([`Replica::set_link_back`],
/// [`super::Uploader::set_link_back`]): each bumps it when the server answers after a
/// failure, and the other, waiting out its backoff, tries again at once. Two loops over
/// one network need not draw two waits after it comes back. One count per side, so a
/// loop is never woken by its own news.
#[derive(Debug, Default)]
pub struct LinkBack {
    fetch: std::sync::atomic::AtomicU64,
    up: std::sync::atomic::AtomicU64,
}

/// Which loop tells or waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Fetch,
    Up,
}

impl LinkBack {
    /// The server is reachable again: both loops stop waiting. For a host whose own
    /// transport hears the server again (a network-change event); the loops tell each
    /// other themselves.
    pub fn bump(&self) {
        self.heard(Side::Fetch);
        self.heard(Side::Up);
    }

    /// `side` heard the server after a failure.
    pub(crate) fn heard(&self, side: Side) {
        match side {
            Side::Fetch => &self.fetch,
            Side::Up => &self.up,
        }
        .fetch_add(1, Ordering::SeqCst);
    }

    /// The other side's count, which `side` waits on.
    pub(crate) fn other(&self, side: Side) -> u64 {
        match side {
            Side::Fetch => &self.up,
            Side::Up => &self.fetch,
        }
        .load(Ordering::SeqCst)
    }
}

/// Sleeps `d`, waking early when `stop` is set, or when `back` (the link, the side
/// waiting, and the other side's count when the wait began) says the server answered the
/// other loop meanwhile (checked every 20 ms).
pub(crate) fn pause_unless_back(
    stop: &AtomicBool,
    d: Duration,
    back: Option<(&LinkBack, Side, u64)>,
) {
    let end = Instant::now() + d;
    while !stop.load(Ordering::SeqCst) {
        if back.is_some_and(|(link, side, seen)| link.other(side) != seen) {
            return;
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        std::thread::sleep(left.min(Duration::from_millis(20)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A loop waits out its backoff whatever it told the other loop itself, and stops
    /// waiting as soon as the other loop (or the host) says the server answered: the
    /// review found a loop woken by its own report, retrying without a pause.
    #[test]
    fn a_loop_is_woken_by_the_other_loops_news_never_by_its_own() {
        let link = LinkBack::default();
        let stop = AtomicBool::new(false);
        let seen = link.other(Side::Fetch);
        link.heard(Side::Fetch);
        let began = Instant::now();
        pause_unless_back(
            &stop,
            Duration::from_millis(200),
            Some((&link, Side::Fetch, seen)),
        );
        assert!(
            began.elapsed() >= Duration::from_millis(200),
            "woken by itself"
        );

        for news in [Side::Up, Side::Fetch] {
            let waiting = if news == Side::Up {
                Side::Fetch
            } else {
                Side::Up
            };
            let seen = link.other(waiting);
            link.heard(news);
            let began = Instant::now();
            pause_unless_back(
                &stop,
                Duration::from_secs(3_600),
                Some((&link, waiting, seen)),
            );
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "{waiting:?} slept on"
            );
        }
        let seen = link.other(Side::Up);
        link.bump();
        pause_unless_back(
            &stop,
            Duration::from_secs(3_600),
            Some((&link, Side::Up, seen)),
        );
    }
}
