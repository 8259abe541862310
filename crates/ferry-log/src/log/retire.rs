//! Retirement (docs/log.md §1, guarantee 5; §3, "Spares"; §4): segments leave the log
//! only below a position the caller keeps elsewhere (a checkpoint), oldest first.
//!
//! 1. Choose the victims: the oldest segments whose next segment starts at or below
//!    the position given and already holds a durable batch; never the newest.
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
    let victims: Vec<Lsn> = {
        let s = lock(&inner.shared);
        s.segments
            .windows(2)
            // Only once the next segment holds a durable batch: recovery must always
            // find the segment that holds the end, with records in it.
            .take_while(|w| w[1] <= lsn && w[1] + SEGMENT_HEADER_BYTES < durable)
            .map(|w| w[0])
            .collect()
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
    let want = inner.config.spare_segments.min(victims.len());
    let room = want.saturating_sub(lock(&inner.spares).len());
    let keep_from = victims.len().saturating_sub(room);
    for (i, &v) in victims.iter().enumerate() {
        let name = segment_name(v);
        let kept = i >= keep_from && st.rename(&name, &spare_name(v)).is_ok();
        if !kept {
            st.remove(&name)
                .map_err(|e| Error::io("remove a retired segment", e))?;
        }
        lock(&inner.shared).segments.retain(|&f| f != v);
        st.sync_dir()
            .map_err(|e| Error::io("sync its directory after retiring a segment", e))?;
        if kept {
            lock(&inner.spares).push(spare_name(v));
        }
    }
    Ok(victims.len())
}
