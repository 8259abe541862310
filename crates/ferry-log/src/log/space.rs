//! The newest segment's file space (docs/log.md §3, "Zeroes ahead" and "Spares"): how
//! far its file reaches, the zeroes the writer keeps ahead of the log's end, and
//! segments made from retired ones kept as spares.
//!
//! Making a segment from a spare:
//! 1. write the new segment's header into the spare, under the spare's name;
//! 2. sync the spare;
//! 3. rename it to the segment's name (the writer then syncs the directory).
//!
//! A crash before 3 leaves the spare under its own name, which recovery never reads as
//! part of the log; after 3, a file under a segment's name always has its own header.

use super::state::Inner;
use crate::Lsn;
use crate::format::SEGMENT_HEADER_BYTES;
use ferry_core::sync::lock;

/// How far the newest segment's file reaches: its batches, then zeroes written ahead,
/// or what a spare it was made from held.
pub(super) struct Filled {
    pub(super) seg: Lsn,
    pub(super) len: u64,
    /// Made from a spare: after `len`'s batches comes what the spare held.
    pub(super) reused: bool,
}

/// The writer keeps this much zero-filled space ahead of the log's end. A batch written
/// over zeroes the disk already holds changes no file size or extent, so its fdatasync
/// writes the data alone; appending to the end of a file would make every sync write
/// the inode too.
const ZERO_AHEAD: u64 = 1 << 20;

/// The zeroes are topped up inside the same sync as a batch, as soon as this much of
/// them is used, by this much to twice it: that sync carries them, and one that
/// carried half a MiB took 1-2.5 ms (docs/log.md §3).
const ZERO_STEP: u64 = 64 << 10;

/// What a top-up writes from (never allocated per top-up).
pub(super) static ZEROES: [u8; 2 * ZERO_STEP as usize] = [0; 2 * ZERO_STEP as usize];

const _: () = assert!(2 * ZERO_STEP <= ZERO_AHEAD);

/// After a batch written up to offset `end` of the newest segment, whose file is now
/// `len` bytes long (`len >= end`): where to top the zeroes ahead up to, in the same
/// sync, or None while more than `ZERO_AHEAD - ZERO_STEP` of them are ahead (or the
/// file reaches the segment's end). A top-up writes at most `2 * ZERO_STEP` (what
/// `ZEROES` holds), never past `end + ZERO_AHEAD` or the segment's end.
#[inline]
pub(super) fn top_up(len: u64, end: u64, segment_bytes: u64) -> Option<u64> {
    if len + ZERO_STEP <= end + ZERO_AHEAD && len < segment_bytes {
        Some(
            (end + ZERO_AHEAD)
                .min(segment_bytes)
                .min(len + 2 * ZERO_STEP),
        )
    } else {
        None
    }
}

/// Is a spare `len` bytes long worth making a segment from? One shorter than the
/// zeroes a new segment would get saves nothing, unless segments are that small.
pub(super) fn worth_reusing(len: u64, segment_bytes: u64) -> bool {
    len >= segment_bytes.min(SEGMENT_HEADER_BYTES + ZERO_AHEAD)
}

/// Make segment `name` from the oldest spare worth reusing, with `header`; its file's
/// length, or None with no spare left (the caller creates the segment). Spares too
/// short to save a top-up are removed. Spares are only a saving: one that fails here
/// (gone, unreadable) is dropped with a warning, and the next one, or a new file, is
/// used instead.
pub(super) fn segment_from_spare(inner: &Inner, name: &str, header: &[u8]) -> Option<u64> {
    let st = &*inner.storage;
    loop {
        let spare = {
            let mut spares = lock(&inner.spares);
            if spares.is_empty() {
                return None;
            }
            spares.remove(0)
        };
        // Made of a full segment, unless the segment size changed since. The header
        // goes in under the spare's name, synced, before the rename: a file under a
        // segment's name always has its own header.
        let made = st.len(&spare).and_then(|len| {
            if !worth_reusing(len, inner.config.segment_bytes) {
                return Ok(None);
            }
            st.write_at(&spare, 0, header)?;
            st.sync(&spare)?;
            st.rename(&spare, name)?;
            Ok(Some(len))
        });
        match made {
            Ok(Some(len)) => return Some(len),
            Ok(None) => {}
            Err(e) => tracing::warn!(%spare, "not reusing a spare segment: {e}"),
        }
        let _ = st.remove(&spare);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::seams::{Rng, SplitMix64};

    #[test]
    fn zeroes_are_topped_up_a_little_at_a_time_and_never_past_the_segment() {
        // A segment written batch by batch, of up to ZERO_STEP each: every top-up is
        // at most what ZEROES holds; once the zeroes ahead have reached their band
        // they stay above ZERO_AHEAD - ZERO_STEP after every batch; the file never
        // passes the segment's end, and the last batches there are not topped up.
        const SEGMENT: u64 = 16 << 20;
        let mut rng = SplitMix64::seeded(3);
        let (mut len, mut end) = (SEGMENT_HEADER_BYTES, SEGMENT_HEADER_BYTES);
        let mut ramped = false;
        while end < SEGMENT {
            end = (end + 8 + rng.below(ZERO_STEP - 8)).min(SEGMENT);
            len = len.max(end);
            if let Some(upto) = top_up(len, end, SEGMENT) {
                assert!(upto > len && upto - len <= ZEROES.len() as u64);
                assert!(upto <= end + ZERO_AHEAD && upto <= SEGMENT);
                len = upto;
            }
            if len < SEGMENT {
                ramped |= len - end > ZERO_AHEAD - ZERO_STEP;
                assert!(!ramped || len - end > ZERO_AHEAD - ZERO_STEP, "end {end}");
            }
        }
        assert!(ramped);
        assert_eq!(len, SEGMENT);
        assert_eq!(top_up(SEGMENT, SEGMENT - 100, SEGMENT), None);
    }

    #[test]
    fn a_new_segment_gets_two_steps_and_a_reused_one_none() {
        let h = SEGMENT_HEADER_BYTES;
        assert_eq!(
            top_up(h + 100, h + 100, 64 << 20),
            Some(h + 100 + 2 * ZERO_STEP)
        );
        // A segment made from a spare reaches its end already.
        assert_eq!(top_up(64 << 20, h + 100, 64 << 20), None);
        // A small segment is filled to its end, no further.
        assert_eq!(top_up(h + 100, h + 100, 4096), Some(4096));
    }

    #[test]
    fn a_spare_is_reused_only_if_it_saves_the_zeroes_a_new_segment_would_get() {
        let h = SEGMENT_HEADER_BYTES;
        assert!(worth_reusing(64 << 20, 64 << 20));
        assert!(worth_reusing(h + ZERO_AHEAD, 64 << 20));
        assert!(!worth_reusing(h + ZERO_AHEAD - 1, 64 << 20));
        // Segments smaller than the zeroes ahead: a whole one is worth it.
        assert!(worth_reusing(4096, 4096));
        assert!(!worth_reusing(4095, 4096));
    }
}
