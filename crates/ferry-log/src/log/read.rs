//! Reading durable records back (docs/log.md §2): segment by segment, batch by batch,
//! each batch checked whole before any of its records is handed out. Reads only what
//! was durable when the read began; writes nothing.

use super::scan::{BatchRead, read_batch};
use super::state::Inner;
use crate::format::{self, BATCH_HEADER_BYTES, SEGMENT_HEADER_BYTES, segment_name};
use crate::{Error, Lsn};
use ferry_core::sync::lock;
use std::sync::atomic::Ordering;

/// A record read back.
#[derive(Clone, Copy, Debug)]
pub struct Record<'a> {
    /// Where the record starts (its identity in the log).
    pub lsn: Lsn,
    /// Where it ends: the position `append` returned for it.
    pub end: Lsn,
    pub kind: u8,
    pub payload: &'a [u8],
}

/// See `Log::read_while`.
pub(super) fn read(
    inner: &Inner,
    from: Lsn,
    mut f: impl FnMut(Record<'_>) -> bool,
) -> Result<Lsn, Error> {
    let (segments, durable) = {
        let s = lock(&inner.shared);
        (s.segments.clone(), inner.durable.load(Ordering::SeqCst))
    };
    if let Some(&oldest) = segments.first()
        && from < oldest
    {
        return Err(Error::Invalid(format!(
            "position {from} was retired; the log starts at {oldest}"
        )));
    }
    let st = &*inner.storage;
    for (i, &seg) in segments.iter().enumerate() {
        let limit = segments
            .get(i + 1)
            .copied()
            .unwrap_or(Lsn::MAX)
            .min(durable);
        if seg >= durable {
            break;
        }
        if limit <= from {
            continue;
        }
        let name = segment_name(seg);
        let mut off = SEGMENT_HEADER_BYTES;
        while seg + off < limit {
            let (frames, extent) = match read_batch(st, &name, seg, off, limit - seg)
                .map_err(|e| Error::io("read a segment", e))?
            {
                BatchRead::Valid { frames, extent } => (frames, extent),
                // Retired while this read ran, and maybe made into a new segment
                // since: not damage.
                BatchRead::Bad(_) if !lock(&inner.shared).segments.contains(&seg) => {
                    return Err(Error::Invalid(format!(
                        "the segment at position {seg} was retired while it was read"
                    )));
                }
                BatchRead::Bad(reason) => {
                    return Err(Error::Corrupted {
                        segment: name,
                        offset: off,
                        reason,
                    });
                }
            };
            let batch_lsn = seg + off;
            for fr in format::frames(&frames).expect("read_batch checked the frames") {
                let lsn = batch_lsn + BATCH_HEADER_BYTES + fr.at as u64;
                if lsn >= from {
                    let end = batch_lsn + BATCH_HEADER_BYTES + fr.end as u64;
                    let more = f(Record {
                        lsn,
                        end,
                        kind: fr.kind,
                        payload: &frames[fr.payload],
                    });
                    if !more {
                        return Ok(end);
                    }
                }
            }
            off += extent;
        }
    }
    Ok(durable)
}
