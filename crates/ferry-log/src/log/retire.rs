//! Retirement (docs/log.md §1, guarantee 5; §3, "Spares"; §4): segments leave the log
//! only below a position the caller keeps elsewhere (a checkpoint), oldest first.
//!
//! 1. Choose the victims: the oldest segments whose next segment starts at or below
//!    the position given and already holds a durable batch; never the newest. Sync the
//!    directory (an earlier retirement's last removal may be undecided).
//! 2. For each, oldest first: rename it to a spare (the newest victims, while there
//!    is room) or remove it; drop it from the segment list; sync the directory.
//!
//! A crash between two victims leaves the log contiguous (each removal was made
//! durable before the next); recovery scans what is left and the caller retires
//! again.

use super::state::Inner;
use crate::format::{SEGMENT_HEADER_BYTES, segment_name, spare_name};
use crate::{Error, Lsn};
use ferry_core::sync::lock;

/// See `Log::retire_below`; `durable` is the durable position read before the caller
/// took the retirement lock, one retirement at a time.
pub(super) fn retire_below(inner: &Inner, lsn: Lsn, durable: Lsn) -> Result<usize, Error> {
    let (victims, first_kept) = {
        let s = lock(&inner.shared);
        let n = victims(&s.segments, lsn, durable);
        (s.segments[..n].to_vec(), s.segments[n])
    };
    if victims.is_empty() {
        return Ok(0);
    }
    // Oldest first, each removal made durable before the next: a crash between them
    // leaves the log contiguous (a directory without a journal may persist removals
    // out of order). The newest victims become spares while there is room for them
    // (a storage that cannot rename keeps none): as many as this retirement retires
    // at most, the next interval's likely need, and `spare_segments` in all.
    let st = &*inner.storage;
    // An earlier retirement whose directory sync failed left its last removal
    // undecided: made durable first, or this one would remove the next segment while
    // the one before may still come back after a crash, leaving a gap recovery refuses.
    st.sync_dir()
        .map_err(|e| Error::io("sync its directory before retiring", e))?;
    let keep_from = spares_from(
        victims.len(),
        inner.config.spare_segments,
        lock(&inner.spares).len(),
    );
    for (i, &v) in victims.iter().enumerate() {
        // Guarantee 5, checked where a segment leaves for good: everything it holds
        // lies below the position the caller keeps elsewhere, and the segment after it
        // holds a durable batch, so recovery still finds the end.
        let next = victims.get(i + 1).copied().unwrap_or(first_kept);
        assert!(
            next <= lsn && next + SEGMENT_HEADER_BYTES < durable,
            "retirement never drops a segment at or above the durable position a \
             checkpoint needs (segment {v}, next {next}, below {lsn}, durable {durable})"
        );
        let name = segment_name(v);
        let kept = i >= keep_from && st.rename(&name, &spare_name(v)).is_ok();
        if !kept {
            st.remove(&name)
                .map_err(|e| Error::io("remove a retired segment", e))?;
        }
        {
            let mut s = lock(&inner.shared);
            // Appends add segments at the back only, and one retirement runs at a
            // time: a segment dropped from the middle would leave a gap recovery
            // refuses, and the newest holds the log's end.
            assert!(
                s.segments.len() > 1 && s.segments[0] == v,
                "segments leave the log oldest first, and never the newest"
            );
            s.segments.remove(0);
        }
        st.sync_dir()
            .map_err(|e| Error::io("sync its directory after retiring a segment", e))?;
        if kept {
            lock(&inner.spares).push(spare_name(v));
        }
    }
    Ok(victims.len())
}

/// How many of the oldest `segments` (first positions, ascending) a retirement below
/// `below` drops, the log durable up to `durable`: those whose next segment starts at
/// or below `below` and already holds a durable batch (recovery must always find the
/// segment that holds the end, with records in it). Never the newest.
pub(super) fn victims(segments: &[Lsn], below: Lsn, durable: Lsn) -> usize {
    segments
        .windows(2)
        .take_while(|w| w[1] <= below && w[1] + SEGMENT_HEADER_BYTES < durable)
        .count()
}

/// Of `victims` segments retired, oldest first, the first to keep as a spare (the
/// newest are kept): no more than the retirement retires, the next interval's likely
/// need, and `spares_max` in all, counting the `spares_held` already.
pub(super) fn spares_from(victims: usize, spares_max: usize, spares_held: usize) -> usize {
    let room = spares_max.min(victims).saturating_sub(spares_held);
    victims - room
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: u64 = SEGMENT_HEADER_BYTES;

    #[test]
    fn a_segment_is_dropped_only_below_the_position_given_and_before_a_durable_batch() {
        let segments = [0, 100, 200, 300];
        assert_eq!(victims(&segments, 250, 1000), 2);
        assert_eq!(
            victims(&segments, 200, 1000),
            2,
            "a segment ending at the position"
        );
        assert_eq!(victims(&segments, 199, 1000), 1);
        // The next segment must hold a durable batch, not only its header.
        assert_eq!(victims(&segments, 1000, 200 + H), 1);
        assert_eq!(victims(&segments, 1000, 200 + H + 1), 2);
        // The position durable and the caller's both far ahead: never the newest.
        assert_eq!(victims(&segments, u64::MAX, u64::MAX), 3);
        assert_eq!(victims(&[0], u64::MAX, u64::MAX), 0);
        assert_eq!(victims(&segments, 0, u64::MAX), 0);
    }

    #[test]
    fn a_retirement_keeps_as_many_spares_as_it_retires_up_to_the_limit() {
        // (victims, spares_max, held) -> first kept as a spare
        assert_eq!(spares_from(5, 16, 0), 0, "all five kept");
        assert_eq!(spares_from(5, 2, 0), 3, "the newest two kept");
        assert_eq!(
            spares_from(5, 16, 3),
            3,
            "five wanted, three held: two more"
        );
        assert_eq!(spares_from(5, 16, 14), 5, "as many held as retired: none");
        assert_eq!(spares_from(5, 0, 0), 5, "spares off");
        assert_eq!(spares_from(0, 16, 0), 0);
        for victims in 0..20 {
            for max in 0..20 {
                for held in 0..=max {
                    let kept = victims - spares_from(victims, max, held);
                    assert!(held + kept <= max && kept <= victims);
                }
            }
        }
    }
}
