//! Reading batches back from a segment, checked whole (docs/log.md §2, guarantee 3):
//! what reading and recovery share. Reads through the `Storage` seam, writes nothing.

use crate::Lsn;
use crate::format::{self, BATCH_HEADER_BYTES, BatchHeader};
use crate::storage::Storage;
use std::io;

pub(super) enum BatchRead {
    Valid { frames: Vec<u8>, extent: u64 },
    Bad(String),
}

/// The batch at `off` of segment `seg` (`len` bytes of which count), checked whole.
pub(super) fn read_batch(
    st: &dyn Storage,
    name: &str,
    seg: Lsn,
    off: u64,
    len: u64,
) -> io::Result<BatchRead> {
    if len.saturating_sub(off) < BATCH_HEADER_BYTES {
        return Ok(BatchRead::Bad("a batch header is cut short".into()));
    }
    let mut h = [0u8; BATCH_HEADER_BYTES as usize];
    if st.read_at(name, off, &mut h)? < h.len() {
        return Ok(BatchRead::Bad("a batch header is cut short".into()));
    }
    let header = match BatchHeader::decode(&h) {
        Ok(x) => x,
        Err(reason) => return Ok(BatchRead::Bad(reason.to_string())),
    };
    if header.lsn != seg + off {
        return Ok(BatchRead::Bad(format!(
            "the batch header names position {}, but sits at {}",
            header.lsn,
            seg + off
        )));
    }
    if off + header.extent() > len {
        return Ok(BatchRead::Bad(
            "the batch runs past the end of the segment".into(),
        ));
    }
    let mut frames = vec![0u8; header.frames_len as usize];
    if st.read_at(name, off + BATCH_HEADER_BYTES, &mut frames)? < frames.len() {
        return Ok(BatchRead::Bad("the batch is cut short".into()));
    }
    if !header.matches(&h, &frames) {
        return Ok(BatchRead::Bad("the batch fails its checksum".into()));
    }
    if let Err(reason) = format::frames(&frames) {
        return Ok(BatchRead::Bad(reason.to_string()));
    }
    Ok(BatchRead::Valid {
        frames,
        extent: header.extent(),
    })
}

/// A valid batch anywhere in `name` after `off` (at an aligned offset, naming its own
/// position, passing its checksum): its offset.
pub(super) fn valid_batch_after(
    st: &dyn Storage,
    name: &str,
    seg: Lsn,
    off: u64,
    len: u64,
) -> io::Result<Option<u64>> {
    // Read a window at a time: after a segment made from a spare, the rest of the file
    // (up to a whole segment) is the spare's old bytes. A header that names its own
    // position is checked whole, wherever its batch ends.
    const WINDOW: u64 = 1 << 20;
    let mut buf = vec![0u8; (WINDOW + BATCH_HEADER_BYTES) as usize];
    let mut from = off + format::ALIGN;
    while from + BATCH_HEADER_BYTES <= len {
        let want = (len - from).min(WINDOW + BATCH_HEADER_BYTES) as usize;
        let n = st.read_at(name, from, &mut buf[..want])? as u64;
        let mut p = 0;
        while p < WINDOW && p + BATCH_HEADER_BYTES <= n {
            if let Ok(h) = BatchHeader::decode(&buf[p as usize..n as usize])
                && h.lsn == seg + from + p
                && let BatchRead::Valid { .. } = read_batch(st, name, seg, from + p, len)?
            {
                return Ok(Some(from + p));
            }
            p += format::ALIGN;
        }
        if n < want as u64 {
            break;
        }
        from += WINDOW;
    }
    Ok(None)
}

/// Is `name` all zeroes from `from` to `to`?
pub(super) fn all_zero(st: &dyn Storage, name: &str, from: u64, to: u64) -> io::Result<bool> {
    let mut buf = vec![0u8; 64 << 10];
    let mut at = from;
    while at < to {
        let want = ((to - at) as usize).min(buf.len());
        let n = st.read_at(name, at, &mut buf[..want])?;
        if n == 0 {
            return Ok(true);
        }
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
    Ok(true)
}
