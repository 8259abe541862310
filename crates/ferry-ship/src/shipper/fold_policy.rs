//! When the shipper folds (checkpoints) the primary's WAL, and when it gives up the
//! lineage at the WAL cap (docs/ship.md §3.4 steps 4–5, §3.5). Pure: every question is
//! answered from values and the time given; the folder thread does the folding.
//!
//! A fold is asked for when the WAL holds at least `fold_min_frames` frames and nothing
//! waiting to ship still needs it (every transaction not acknowledged is held in memory,
//! and the scan reached the WAL's end), but only while requests come back quickly and
//! little is outstanding: the fold runs on another thread, and if the shipper then sits
//! in a slow request, the app can reset the WAL and write past the cursor before the
//! next step proves the reset, which then costs a base. A slow peer postpones folds
//! instead; the WAL cap still bounds the WAL.

use super::limits::IDENTITY_INTERVAL;
use crate::wal::{self, Cursor, Stop};
use std::time::{Duration, Instant};

/// Retry a fold that a reader held up after this long, even with no new commits.
pub const FOLD_RETRY: Duration = Duration::from_secs(5);
/// Folds wait while the last request took longer than this, or while more than
/// `FOLD_UNACKED_MAX` of pages wait for acknowledgement.
pub const FOLD_RTT_MAX: Duration = Duration::from_millis(50);
pub const FOLD_UNACKED_MAX: u64 = 1 << 20;
/// While a base is owed, the WAL is folded at most this often.
pub const OWING_FOLD_INTERVAL: Duration = Duration::from_millis(200);

/// What a fold decision looks at, besides the policy's own memory.
#[derive(Clone, Copy, Debug)]
pub struct FoldView {
    /// Where scanning reached; None while the WAL was empty at the base.
    pub scan: Option<Cursor>,
    pub stop: Stop,
    /// Every transaction waiting is held in memory.
    pub all_inline: bool,
    /// A fold is queued or running on the folder.
    pub folder_busy: bool,
    /// The peer is being backed off after a failure.
    pub backing_off: bool,
    pub unacked_bytes: u64,
    pub fold_min_frames: u32,
}

/// The fold policy's memory.
#[derive(Debug)]
pub struct FoldPolicy {
    /// The cursor a fold was last asked for at, and when: not asked again for the same
    /// cursor within `FOLD_RETRY`.
    tried: Option<(Cursor, Instant)>,
    /// Last fold while a base was owed.
    owing_at: Option<Instant>,
    /// How long the last txns request took.
    pub last_request: Duration,
    /// Last look at the WAL cap.
    cap_at: Instant,
}

impl FoldPolicy {
    pub fn new(now: Instant) -> FoldPolicy {
        FoldPolicy {
            tried: None,
            owing_at: None,
            last_request: Duration::ZERO,
            cap_at: now,
        }
    }

    /// Fold now? See the module doc.
    pub fn may_fold(&self, v: &FoldView, now: Instant) -> bool {
        let Some(cursor) = v.scan else {
            return false;
        };
        let tried = self
            .tried
            .is_some_and(|(c, at)| c == cursor && now.saturating_duration_since(at) < FOLD_RETRY);
        self.may_fold_untimed(v) && !v.backing_off && !tried
    }

    /// The conditions of [`Self::may_fold`] that need no clock (`v.backing_off` is not
    /// read): false rules a fold out, so a caller on a hot path asks this before reading
    /// the time.
    pub fn may_fold_untimed(&self, v: &FoldView) -> bool {
        let Some(cursor) = v.scan else {
            return false;
        };
        v.all_inline
            && v.stop == Stop::End
            && cursor.frame >= v.fold_min_frames
            && !v.folder_busy
            && self.last_request <= FOLD_RTT_MAX
            && v.unacked_bytes <= FOLD_UNACKED_MAX
    }

    /// A fold was asked for at `cursor`.
    pub fn folded(&mut self, cursor: Cursor, now: Instant) {
        self.tried = Some((cursor, now));
    }

    /// A base was installed: the next fold starts afresh.
    pub fn forget(&mut self) {
        self.tried = None;
    }

    /// While a base is owed: is a fold due (at most every `OWING_FOLD_INTERVAL`)?
    pub fn owing_fold_due(&self, now: Instant) -> bool {
        self.owing_at
            .is_none_or(|at| now.saturating_duration_since(at) >= OWING_FOLD_INTERVAL)
    }

    pub fn owing_folded(&mut self, now: Instant) {
        self.owing_at = Some(now);
    }

    /// Is the WAL cap due a look (at most every `IDENTITY_INTERVAL`: it needs a stat)?
    pub fn cap_due(&mut self, now: Instant) -> bool {
        if now.saturating_duration_since(self.cap_at) < IDENTITY_INTERVAL {
            return false;
        }
        self.cap_at = now;
        true
    }
}

/// Past the WAL cap? `unacked_wal`: WAL bytes of the transactions waiting; `wal_len`: the
/// file's length. Frames not scanned count only while the scan is held back by its
/// budget: then the file's length past the cursor is WAL still to ship. Otherwise the
/// scan reached the cycle's end, and the file's length says nothing (a reset keeps the
/// file, with frames of older cycles past the current one's end).
pub fn over_cap(unacked_wal: u64, wal_len: u64, scan: &Cursor, stop: Stop, cap: u64) -> bool {
    let unscanned = if stop == Stop::Budget {
        wal_len.saturating_sub(wal::frame_offset(scan.page_size, scan.frame + 1))
    } else {
        0
    };
    unacked_wal + unscanned > cap
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::Salts;
    use crate::wal::testing::WalBuilder;

    fn view(frame: u32) -> FoldView {
        let mut scan = WalBuilder::new(4096, Salts(1, 2), false).header().start();
        scan.frame = frame;
        FoldView {
            scan: Some(scan),
            stop: Stop::End,
            all_inline: true,
            folder_busy: false,
            backing_off: false,
            unacked_bytes: 0,
            fold_min_frames: 1000,
        }
    }

    // Guards against a fold that could let the app reset the WAL past what the shipper
    // can prove, and against a WAL that never folds: each condition alone holds a fold.
    #[test]
    fn a_fold_waits_for_every_condition() {
        let now = Instant::now();
        let mut p = FoldPolicy::new(now);
        let ok = view(1000);
        assert!(p.may_fold(&ok, now));
        let holds: [(&str, FoldView); 7] = [
            ("no scan yet", FoldView { scan: None, ..ok }),
            ("below the threshold", view(999)),
            (
                "a large transaction needs the WAL",
                FoldView {
                    all_inline: false,
                    ..ok
                },
            ),
            (
                "the scan is held back",
                FoldView {
                    stop: Stop::Budget,
                    ..ok
                },
            ),
            (
                "a fold is in flight",
                FoldView {
                    folder_busy: true,
                    ..ok
                },
            ),
            (
                "the peer is backed off",
                FoldView {
                    backing_off: true,
                    ..ok
                },
            ),
            (
                "much waits for acknowledgement",
                FoldView {
                    unacked_bytes: FOLD_UNACKED_MAX + 1,
                    ..ok
                },
            ),
        ];
        for (why, v) in holds {
            assert!(!p.may_fold(&v, now), "{why}");
        }
        p.last_request = FOLD_RTT_MAX + Duration::from_millis(1);
        assert!(!p.may_fold(&ok, now), "the peer is slow");
        p.last_request = Duration::ZERO;
        p.folded(ok.scan.unwrap(), now);
        assert!(
            !p.may_fold(&ok, now + Duration::from_secs(1)),
            "asked already"
        );
        assert!(
            p.may_fold(&view(1001), now),
            "a new cursor may fold at once"
        );
        assert!(
            p.may_fold(&ok, now + FOLD_RETRY),
            "asked again after FOLD_RETRY"
        );
        p.forget();
        assert!(p.may_fold(&ok, now));
    }

    #[test]
    fn the_cap_counts_unscanned_frames_only_while_the_scan_is_held_back() {
        let scan = view(10).scan.unwrap();
        let len = wal::frame_offset(4096, 11) + 5 * 4120;
        assert!(!over_cap(100, len, &scan, Stop::End, 1000));
        assert!(over_cap(100, len, &scan, Stop::Budget, 1000));
        assert!(over_cap(1001, 0, &scan, Stop::End, 1000));
        let now = Instant::now();
        let mut p = FoldPolicy::new(now);
        assert!(!p.cap_due(now));
        assert!(p.cap_due(now + IDENTITY_INTERVAL));
        assert!(p.owing_fold_due(now));
        p.owing_folded(now);
        assert!(!p.owing_fold_due(now + Duration::from_millis(100)));
        assert!(p.owing_fold_due(now + OWING_FOLD_INTERVAL));
    }
}
