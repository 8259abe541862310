//! Opening a log: what recovery reads, cuts, removes and refuses (docs/log.md §4).

use super::scan::{BatchRead, all_zero, read_batch, valid_batch_after};
use crate::format::{
    self, SEGMENT_HEADER_BYTES, SegmentHeader, parse_segment_name, parse_spare_name, segment_name,
    spare_name,
};
use crate::storage::Storage;
use crate::{Error, Lsn};
use std::time::{Duration, Instant};

/// What opening found.
#[derive(Clone, Debug)]
pub struct Recovery {
    pub segments: usize,
    pub records: u64,
    /// Where the log ends: the next record goes here, and everything before is durable.
    pub end: Lsn,
    /// Bytes cut from a torn tail (a write the crash interrupted; never acknowledged).
    pub torn_bytes: u64,
    pub elapsed: Duration,
}

pub(super) struct Found {
    pub(super) recovery: Recovery,
    pub(super) segments: Vec<Lsn>,
    /// Spares to reuse, oldest first.
    pub(super) spares: Vec<String>,
    pub(super) log_id: u64,
    /// The newest segment's file length (its logical end plus any zeroes ahead).
    pub(super) last_file_len: u64,
}

/// docs/log.md §4.
pub(super) fn recover(st: &dyn Storage, spares_max: usize) -> Result<Found, Error> {
    let started = Instant::now();
    let io = |what| move |e| Error::io(what, e);
    let listed = st.list().map_err(io("list its directory"))?;
    let mut firsts: Vec<Lsn> = listed
        .iter()
        .filter_map(|n| parse_segment_name(n))
        .collect();
    firsts.sort_unstable();
    let mut spares: Vec<Lsn> = listed.iter().filter_map(|n| parse_spare_name(n)).collect();
    spares.sort_unstable();
    let mut torn_bytes = 0;
    let mut log_id = None;
    let mut unfinished = None;
    let mut segs: Vec<(Lsn, u64)> = Vec::new();
    for (i, &first) in firsts.iter().enumerate() {
        let name = segment_name(first);
        let len = st.len(&name).map_err(io("read a segment's length"))?;
        let mut hb = [0u8; SEGMENT_HEADER_BYTES as usize];
        let n = st
            .read_at(&name, 0, &mut hb)
            .map_err(io("read a segment header"))?;
        match SegmentHeader::decode(&hb[..n]) {
            // Records are written only after a new segment's header is synced: a newest
            // segment with no valid header and nothing after it was being created when
            // the process stopped, and holds nothing.
            Err(_) if i + 1 == firsts.len() && len <= SEGMENT_HEADER_BYTES => {
                // Removed once everything else checked out: a refused open changes nothing.
                unfinished = Some((name, len));
            }
            Err(reason) => {
                return Err(Error::Corrupted {
                    segment: name,
                    offset: 0,
                    reason,
                });
            }
            Ok(h) => {
                if h.first != first {
                    return Err(Error::Corrupted {
                        segment: name,
                        offset: 0,
                        reason: format!(
                            "the header names position {}, the file name {first}",
                            h.first
                        ),
                    });
                }
                if *log_id.get_or_insert(h.log_id) != h.log_id {
                    return Err(Error::Corrupted {
                        segment: name,
                        offset: 0,
                        reason: "this segment belongs to another log (its log id differs)".into(),
                    });
                }
                segs.push((first, len));
            }
        }
    }
    // Scan every segment before changing anything: a refused open changes nothing.
    // A segment before the newest ends where the next one begins: what follows there is
    // zeroes the writer filled ahead (see `ZERO_AHEAD`) or what a spare it was made
    // from held. The newest ends where its batches stop.
    let mut records = 0;
    let count = segs.len();
    let mut cut: Option<(String, u64, u64, String)> = None;
    let mut ends = Vec::with_capacity(count);
    for (i, &(first, len)) in segs.iter().enumerate() {
        let name = segment_name(first);
        let stop = segs
            .get(i + 1)
            .map_or(len, |next| next.0.saturating_sub(first).min(len));
        let mut off = SEGMENT_HEADER_BYTES;
        while off < stop {
            match read_batch(st, &name, first, off, stop).map_err(io("read a segment"))? {
                BatchRead::Valid { frames, extent } => {
                    records += format::frames(&frames).expect("checked").len() as u64;
                    off += extent;
                }
                BatchRead::Bad(reason) => {
                    if all_zero(st, &name, off, len).map_err(io("read a segment"))? {
                        break;
                    }
                    if i + 1 < count {
                        return Err(Error::Corrupted {
                            segment: name,
                            offset: off,
                            reason,
                        });
                    }
                    if let Some(at) = valid_batch_after(st, &name, first, off, len)
                        .map_err(io("read a segment"))?
                    {
                        return Err(Error::Corrupted {
                            segment: name,
                            offset: off,
                            reason: format!("{reason}, and a durable batch follows at byte {at}"),
                        });
                    }
                    cut = Some((name.clone(), off, len, reason));
                    break;
                }
            }
        }
        ends.push(off.min(len));
    }
    for (i, w) in segs.windows(2).enumerate() {
        let ((a, _), (b, _)) = (w[0], w[1]);
        if a + ends[i] != b {
            return Err(Error::Corrupted {
                segment: segment_name(b),
                offset: 0,
                reason: format!(
                    "the segment before ends at position {}, this one starts at {b}: a segment \
                     is missing or was cut",
                    a + ends[i]
                ),
            });
        }
    }
    let mut last_file_len = segs.last().map_or(0, |s| s.1);
    if let Some((name, off, len, reason)) = cut {
        tracing::warn!(
            segment = %name,
            offset = off,
            bytes = len - off,
            "cutting what follows the log's end (a torn write, or what the spare this \
             segment was made from held): {reason}"
        );
        st.truncate(&name, off).map_err(io("cut a torn tail"))?;
        torn_bytes += len - off;
        last_file_len = off;
    }
    for (seg, end) in segs.iter_mut().zip(&ends) {
        seg.1 = *end;
    }
    if let Some((name, len)) = unfinished {
        tracing::warn!(segment = %name, "removing a segment whose creation was interrupted");
        st.remove(&name)
            .map_err(io("remove an unfinished segment"))?;
        torn_bytes += len;
    }
    // Only spares this log retired are kept: they held positions below its oldest
    // segment, so none of their old batches can name a position the log will write. A
    // spare from anywhere else (a log reset by deleting its segments, a copy) might,
    // and is removed; so are any beyond `spare_segments`.
    let oldest = segs.first().map(|s| s.0);
    let (keep, stray): (Vec<Lsn>, Vec<Lsn>) = spares
        .into_iter()
        .partition(|&f| oldest.is_some_and(|o| f < o));
    let spares: Vec<Lsn> = keep.iter().copied().take(spares_max).collect();
    for f in stray.into_iter().chain(keep.into_iter().skip(spares_max)) {
        tracing::info!(spare = %spare_name(f), "removing a spare segment this log will not reuse");
        st.remove(&spare_name(f))
            .map_err(io("remove a spare segment"))?;
    }
    let log_id = match (log_id, segs.is_empty()) {
        (Some(id), false) => id,
        _ => {
            // A new log.
            let id = ferry_core::seams::random_nonzero_u64();
            let name = segment_name(0);
            st.create(&name).map_err(io("create its first segment"))?;
            st.write_at(
                &name,
                0,
                &SegmentHeader {
                    first: 0,
                    log_id: id,
                }
                .encode(),
            )
            .map_err(io("write its first segment header"))?;
            st.sync(&name).map_err(io("sync its first segment"))?;
            st.sync_dir().map_err(io("sync its directory"))?;
            segs.push((0, SEGMENT_HEADER_BYTES));
            last_file_len = SEGMENT_HEADER_BYTES;
            id
        }
    };
    let &(last, last_len) = segs.last().expect("at least one segment");
    // What a killed process wrote may sit in the page cache only: it becomes durable
    // here, before anyone is told so, and so do the directory's entries. (Older
    // segments were synced before the next one was created.)
    st.sync(&segment_name(last))
        .map_err(io("sync its newest segment"))?;
    st.sync_dir().map_err(io("sync its directory"))?;
    Ok(Found {
        recovery: Recovery {
            segments: segs.len(),
            records,
            end: last + last_len,
            torn_bytes,
            elapsed: started.elapsed(),
        },
        segments: segs.iter().map(|&(f, _)| f).collect(),
        spares: spares.into_iter().map(spare_name).collect(),
        log_id,
        last_file_len,
    })
}
