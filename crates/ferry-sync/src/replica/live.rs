//! What a running replica knows beyond its file, for its own /metrics and /status
//! (`ferry sync replica --metrics-listen`): whether it is synced, catching up or offline
//! takes the transport, which only the running loop has.
//!
//! 1. The loop ([`Replica::run_live`](super::Replica::run_live)) counts each frame it
//!    receives and what became of it, and each report the transport took.
//! 2. After each fetch that answered, it records the wall time and whether the fetch
//!    reached the end of what the server had (`caught_up`).
//! 3. After each turn, and once before the first, it copies the few facts of its file a
//!    standing needs (position, gap, rejections, last heard) into a small snapshot.
//! 4. Readers on other threads take the counters (atomics) and the snapshot (a mutex held
//!    for a copy) at any time; [`Live::metrics`] reads nothing else, and
//!    [`Live::status`] joins them with the file's status read on a connection of the
//!    reader's own ([`super::read_status`]).
//!
//! Nothing here is persisted: a restarted process counts from 0, and until its first
//! fetch answers it judges its standing by the last heard time its file recorded.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use ferry_core::metrics::Exposition;
use ferry_core::seams::wall_ms;
use serde::Serialize;

use super::{ReplicaStatus, Standing};

/// A running replica's counters and the snapshot of its file, shared between its loop
/// and its readers.
#[derive(Debug, Default)]
pub struct Live {
    frames: AtomicU64,
    bytes: AtomicU64,
    applied: AtomicU64,
    already_applied: AtomicU64,
    gaps: AtomicU64,
    refused: AtomicU64,
    reports: AtomicU64,
    failures: AtomicU64,
    /// Whether the last fetch that answered brought fewer frames than the window: nothing
    /// more known to apply.
    caught_up: AtomicBool,
    /// From the loop's settings, so a reader judges as the loop would.
    offline_after_ms: AtomicU64,
    file: Mutex<FileFacts>,
}

/// What the loop last read of its file (step 3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FileFacts {
    pub provisioned: bool,
    pub seq: u64,
    pub gap: u64,
    pub rejections: u64,
    /// Wall time of the last fetch that answered: the file's record at start, then the
    /// loop's own after each fetch.
    pub heard_at_ms: Option<u64>,
}

/// The running replica's status: its file's, with the standing only the running process
/// can tell, when it last heard from the server, and its counters since it started.
#[derive(Clone, Debug, Serialize)]
pub struct LiveStatus {
    /// The file's status; its `standing` is the full one (never `null` here).
    #[serde(flatten)]
    pub file: ReplicaStatus,
    /// Milliseconds since the server last answered a fetch (`None`: never).
    pub heard_ago_ms: Option<u64>,
    /// The last fetch brought everything the server had.
    pub caught_up: bool,
    /// No answer within this long is `offline` (`--offline-after-ms`).
    pub offline_after_ms: u64,
    pub totals: LiveTotals,
}

/// What the running process did since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LiveTotals {
    /// Frames received, and their bytes as carried.
    pub frames: u64,
    pub bytes: u64,
    /// Messages applied and committed.
    pub applied: u64,
    /// Redeliveries acknowledged without applying.
    pub already_applied: u64,
    /// Messages that did not follow the chain.
    pub gaps: u64,
    /// Frames refused (seal, malformed, did not fit the replica's tables).
    pub refused: u64,
    /// Reports the server stored.
    pub reports: u64,
    /// Turns that failed (the transport, the file) and backed off.
    pub failures: u64,
}

impl Live {
    pub fn new() -> Live {
        Live::default()
    }

    /// The standing now: the file's facts first, then the transport's.
    pub fn standing(&self) -> Standing {
        let facts = self.facts();
        Standing::judge(
            Standing::of_file(facts.provisioned, facts.gap, facts.rejections),
            facts.heard_at_ms,
            self.caught_up.load(Relaxed),
            wall_ms(),
            self.offline_after_ms.load(Relaxed),
        )
    }

    pub fn totals(&self) -> LiveTotals {
        LiveTotals {
            frames: self.frames.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            applied: self.applied.load(Relaxed),
            already_applied: self.already_applied.load(Relaxed),
            gaps: self.gaps.load(Relaxed),
            refused: self.refused.load(Relaxed),
            reports: self.reports.load(Relaxed),
            failures: self.failures.load(Relaxed),
        }
    }

    /// Step 4: `file` (read by the caller, [`super::read_status`]) with what the running
    /// loop knows. The standing judges the loop's snapshot of the file, not `file`, so it
    /// agrees with /metrics.
    pub fn status(&self, mut file: ReplicaStatus) -> LiveStatus {
        let facts = self.facts();
        file.standing = Some(self.standing());
        LiveStatus {
            file,
            heard_ago_ms: facts.heard_at_ms.map(|at| wall_ms().abs_diff(at)),
            caught_up: self.caught_up.load(Relaxed),
            offline_after_ms: self.offline_after_ms.load(Relaxed),
            totals: self.totals(),
        }
    }

    /// Step 4: the counters, the snapshot and the standing in the Prometheus text format.
    /// Reads no file, so a scrape costs nothing the loop would notice.
    pub fn metrics(&self) -> String {
        let t = self.totals();
        let facts = self.facts();
        let standing = self.standing();
        let mut e = Exposition::new();
        let counters: [(&str, &str, u64); 8] = [
            (
                "frames_received_total",
                "Frames received from the server.",
                t.frames,
            ),
            (
                "bytes_received_total",
                "Bytes of frames received, as carried.",
                t.bytes,
            ),
            (
                "messages_applied_total",
                "Messages applied and committed.",
                t.applied,
            ),
            (
                "messages_already_applied_total",
                "Redeliveries acknowledged without applying.",
                t.already_applied,
            ),
            (
                "gaps_total",
                "Messages that did not follow the chain.",
                t.gaps,
            ),
            (
                "refused_total",
                "Frames refused: bad seal, malformed, or not fitting the replica's tables.",
                t.refused,
            ),
            ("reports_total", "Reports the server stored.", t.reports),
            (
                "failures_total",
                "Turns that failed (the transport or the file) and backed off.",
                t.failures,
            ),
        ];
        for (name, help, value) in counters {
            e.counter(&format!("ferry_sync_replica_{name}"), help, &[], value);
        }
        e.gauge(
            "ferry_sync_replica_applied_seq",
            "The seq of the last applied message (0: none).",
            &[],
            facts.seq as f64,
        );
        e.gauge(
            "ferry_sync_replica_rejections",
            "Rows this replica refused, recorded and not yet cleared by the server.",
            &[],
            facts.rejections as f64,
        );
        if let Some(at) = facts.heard_at_ms {
            e.gauge(
                "ferry_sync_replica_heard_ago_seconds",
                "Seconds since the server last answered a fetch.",
                &[],
                wall_ms().abs_diff(at) as f64 / 1000.0,
            );
        }
        for s in Standing::ALL {
            e.gauge(
                "ferry_sync_replica_standing",
                "1 for the replica's standing now, 0 for the others.",
                &[("standing", s.name())],
                f64::from(u8::from(s == standing)),
            );
        }
        e.finish()
    }

    fn facts(&self) -> FileFacts {
        *ferry_core::sync::lock(&self.file)
    }

    // What the loop writes (steps 1 to 3).

    pub(crate) fn set_offline_after_ms(&self, ms: u64) {
        self.offline_after_ms.store(ms, Relaxed);
    }

    pub(crate) fn received(&self, bytes: usize) {
        self.frames.fetch_add(1, Relaxed);
        self.bytes.fetch_add(bytes as u64, Relaxed);
    }

    pub(crate) fn count(&self, received: &super::Received) {
        use super::Received as R;
        let counter = match received {
            R::Applied { .. } => &self.applied,
            R::AlreadyApplied { .. } => &self.already_applied,
            R::Gap { .. } => &self.gaps,
            R::Refused { .. } => &self.refused,
            R::LaterProtocol(_) => return,
        };
        counter.fetch_add(1, Relaxed);
    }

    pub(crate) fn reported(&self) {
        self.reports.fetch_add(1, Relaxed);
    }

    pub(crate) fn failed(&self) {
        self.failures.fetch_add(1, Relaxed);
    }

    pub(crate) fn heard(&self, at_ms: u64, caught_up: bool) {
        self.caught_up.store(caught_up, Relaxed);
        ferry_core::sync::lock(&self.file).heard_at_ms = Some(at_ms);
    }

    /// Step 3. The loop's own heard time is kept when it is newer than the file's.
    pub(crate) fn file_read(&self, read: FileFacts) {
        let mut facts = ferry_core::sync::lock(&self.file);
        let heard_at_ms = facts.heard_at_ms.max(read.heard_at_ms);
        *facts = FileFacts {
            heard_at_ms,
            ..read
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards: /metrics names exactly one standing, and the file's facts come before the
    /// transport's (a gap is `awaiting_fix` however recently the server answered).
    #[test]
    fn metrics_name_one_standing_and_the_file_comes_first() {
        let live = Live::new();
        live.set_offline_after_ms(60_000);
        assert_eq!(live.standing(), Standing::NotProvisioned);
        live.file_read(FileFacts {
            provisioned: true,
            seq: 7,
            ..FileFacts::default()
        });
        assert_eq!(live.standing(), Standing::Offline, "never heard");
        live.heard(wall_ms(), false);
        assert_eq!(live.standing(), Standing::CatchingUp);
        live.heard(wall_ms(), true);
        assert_eq!(live.standing(), Standing::Synced);
        let text = live.metrics();
        assert!(
            text.contains("ferry_sync_replica_standing{standing=\"synced\"} 1\n"),
            "{text}"
        );
        assert_eq!(text.matches("} 1\n").count(), 1, "{text}");
        assert!(
            text.contains("ferry_sync_replica_applied_seq 7\n"),
            "{text}"
        );
        live.file_read(FileFacts {
            provisioned: true,
            seq: 7,
            gap: 9,
            ..FileFacts::default()
        });
        assert_eq!(live.standing(), Standing::AwaitingFix);
        assert!(
            live.facts().heard_at_ms.is_some(),
            "a file read keeps the loop's heard time"
        );
        live.set_offline_after_ms(0);
        live.heard(wall_ms() - 10, true);
        live.file_read(FileFacts {
            provisioned: true,
            ..FileFacts::default()
        });
        assert_eq!(live.standing(), Standing::Offline);
    }
}
