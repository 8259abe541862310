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
pub(super) const ZERO_AHEAD: u64 = 1 << 20;

/// The zeroes are topped up inside the same sync as a batch, as soon as this much of
/// them is used, by this much to twice it: that sync carries them, and one that
/// carried half a MiB took 1-2.5 ms (docs/log.md §3).
pub(super) const ZERO_STEP: u64 = 64 << 10;

/// What a top-up writes from (never allocated per top-up).
pub(super) static ZEROES: [u8; 2 * ZERO_STEP as usize] = [0; 2 * ZERO_STEP as usize];

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
            if len
                < inner
                    .config
                    .segment_bytes
                    .min(SEGMENT_HEADER_BYTES + ZERO_AHEAD)
            {
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
