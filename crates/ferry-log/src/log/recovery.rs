//! Opening a log: what recovery reads, cuts, removes and refuses (docs/log.md §4).
//!
//! 1. List the segments and spares.
//! 2. Check every segment's header (`judge_header`): a newest segment with no valid
//!    header and nothing after it was being created, and is removed later; any other
//!    bad header, or a foreign log id, is damage.
//! 3. Scan every segment batch by batch up to where the next one begins; at a batch
//!    that does not check out, `judge_bad_batch` tells the end (zeroes follow), a torn
//!    tail to cut (the newest segment, no valid batch after it) and damage (anything
//!    else). The segments must then chain (`chain_break`).
//! 4. Only then change anything: cut the torn tail, remove an unfinished segment and
//!    the spares this log will not reuse (`sort_spares`), or create a new log.
//! 5. Sync the newest segment and the directory: what a killed process wrote may sit
//!    in the page cache only, and must not be reported durable before it is.
//!
//! A crash during 4 or 5 leaves what the next open checks again: every change made
//! there is one it would make itself.

use super::scan::{BatchRead, all_zero, read_batch, valid_batch_after};
use crate::format::{
    self, FormatError, SEGMENT_HEADER_BYTES, SegmentHeader, parse_segment_name, parse_spare_name,
    segment_name, spare_name,
};
use crate::storage::Storage;
use crate::{Error, Lsn};
use std::io;
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
    let Headers {
        mut segs,
        log_id,
        unfinished,
    } = read_headers(st, &firsts)?;
    // Scan every segment before changing anything: a refused open changes nothing.
    let Scanned { records, ends, cut } = scan(st, &segs)?;
    // The newest segment's file length (its logical end, then zeroes ahead or what
    // the spare it was made from held), before the lengths become logical ends.
    let mut last_file_len = segs.last().map_or(0, |s| s.1);
    for (seg, end) in segs.iter_mut().zip(&ends) {
        seg.1 = *end;
    }
    if let Some((ended, next)) = chain_break(&segs) {
        return Err(Error::Corrupted {
            segment: segment_name(next),
            offset: 0,
            reason: format!(
                "the segment before ends at position {ended}, this one starts at {next}: a \
                 segment is missing or was cut"
            ),
        });
    }
    let mut torn_bytes = 0;
    if let Some(Cut {
        name,
        at,
        file_len,
        reason,
    }) = cut
    {
        tracing::warn!(
            segment = %name,
            offset = at,
            bytes = file_len - at,
            "cutting what follows the log's end (a torn write, or what the spare this \
             segment was made from held): {reason}"
        );
        st.truncate(&name, at).map_err(io("cut a torn tail"))?;
        torn_bytes += file_len - at;
        last_file_len = at;
    }
    if let Some((name, len)) = unfinished {
        tracing::warn!(segment = %name, "removing a segment whose creation was interrupted");
        st.remove(&name)
            .map_err(io("remove an unfinished segment"))?;
        torn_bytes += len;
    }
    let (spares, removed) = sort_spares(spares, segs.first().map(|s| s.0), spares_max);
    for f in removed {
        tracing::info!(spare = %spare_name(f), "removing a spare segment this log will not reuse");
        st.remove(&spare_name(f))
            .map_err(io("remove a spare segment"))?;
    }
    let log_id = match (log_id, segs.is_empty()) {
        (Some(id), false) => id,
        _ => {
            let id = create(st)?;
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

/// The segments whose headers check out, as (first position, file length).
struct Headers {
    segs: Vec<(Lsn, u64)>,
    log_id: Option<u64>,
    /// A newest segment whose creation was interrupted, and its length: removed once
    /// everything else checked out (a refused open changes nothing).
    unfinished: Option<(String, u64)>,
}

fn read_headers(st: &dyn Storage, firsts: &[Lsn]) -> Result<Headers, Error> {
    let io = |what| move |e| Error::io(what, e);
    let mut found = Headers {
        segs: Vec::with_capacity(firsts.len()),
        log_id: None,
        unfinished: None,
    };
    for (i, &first) in firsts.iter().enumerate() {
        let name = segment_name(first);
        let len = st.len(&name).map_err(io("read a segment's length"))?;
        let mut hb = [0u8; SEGMENT_HEADER_BYTES as usize];
        let n = st
            .read_at(&name, 0, &mut hb)
            .map_err(io("read a segment header"))?;
        let newest = i + 1 == firsts.len();
        match judge_header(
            SegmentHeader::decode(&hb[..n]),
            first,
            newest,
            len,
            found.log_id,
        ) {
            Ok(Header::Unfinished) => found.unfinished = Some((name, len)),
            Ok(Header::Segment { log_id }) => {
                found.log_id = Some(log_id);
                found.segs.push((first, len));
            }
            Err(reason) => {
                return Err(Error::Corrupted {
                    segment: name,
                    offset: 0,
                    reason,
                });
            }
        }
    }
    Ok(found)
}

/// What a segment's header says of it.
#[derive(Debug, PartialEq, Eq)]
enum Header {
    /// A segment of the log whose id this is.
    Segment { log_id: u64 },
    /// The newest segment, with no valid header and nothing after it: it was being
    /// created when the process stopped, and holds nothing.
    Unfinished,
}

/// The segment named for position `first` (the `newest`, or not), `len` bytes long,
/// its header `decoded`, in a log whose segments so far carry `log_id`; or why it is
/// damage.
fn judge_header(
    decoded: Result<SegmentHeader, FormatError>,
    first: Lsn,
    newest: bool,
    len: u64,
    log_id: Option<u64>,
) -> Result<Header, String> {
    match decoded {
        // Records are written only after a new segment's header is synced.
        Err(_) if newest && len <= SEGMENT_HEADER_BYTES => Ok(Header::Unfinished),
        Err(reason) => Err(reason.to_string()),
        Ok(h) if h.first != first => Err(format!(
            "the header names position {}, the file name {first}",
            h.first
        )),
        Ok(h) if log_id.is_some_and(|id| id != h.log_id) => {
            Err("this segment belongs to another log (its log id differs)".into())
        }
        Ok(h) => Ok(Header::Segment { log_id: h.log_id }),
    }
}

/// What scanning found: records, each segment's logical end (an offset in it), and a
/// torn tail to cut.
struct Scanned {
    records: u64,
    ends: Vec<u64>,
    cut: Option<Cut>,
}

struct Cut {
    name: String,
    /// Where the tail starts (the log's end, as an offset in the newest segment).
    at: u64,
    file_len: u64,
    reason: String,
}

/// Scan `segs` (first position, file length). A segment before the newest ends where
/// the next one begins: what follows there is zeroes the writer filled ahead or what
/// a spare it was made from held. The newest ends where its batches stop.
fn scan(st: &dyn Storage, segs: &[(Lsn, u64)]) -> Result<Scanned, Error> {
    let io = |what| move |e| Error::io(what, e);
    let mut found = Scanned {
        records: 0,
        ends: Vec::with_capacity(segs.len()),
        cut: None,
    };
    for (i, &(first, len)) in segs.iter().enumerate() {
        let name = segment_name(first);
        let stop = segs
            .get(i + 1)
            .map_or(len, |next| next.0.saturating_sub(first).min(len));
        let newest = i + 1 == segs.len();
        let mut off = SEGMENT_HEADER_BYTES;
        while off < stop {
            let reason =
                match read_batch(st, &name, first, off, stop).map_err(io("read a segment"))? {
                    BatchRead::Valid { frames, extent } => {
                        found.records += format::frames(&frames).expect("checked").len() as u64;
                        off += extent;
                        continue;
                    }
                    BatchRead::Bad(reason) => reason,
                };
            let tail = judge_bad_batch(
                newest,
                || all_zero(st, &name, off, len),
                || valid_batch_after(st, &name, first, off, len),
            )
            .map_err(io("read a segment"))?;
            match tail {
                Tail::End => {}
                Tail::Damage { follows } => {
                    return Err(Error::Corrupted {
                        segment: name,
                        offset: off,
                        reason: match follows {
                            Some(at) => {
                                format!("{reason}, and a durable batch follows at byte {at}")
                            }
                            None => reason,
                        },
                    });
                }
                Tail::Cut => {
                    found.cut = Some(Cut {
                        name: name.clone(),
                        at: off,
                        file_len: len,
                        reason,
                    });
                }
            }
            break;
        }
        found.ends.push(off.min(len));
    }
    Ok(found)
}

/// What follows a batch that does not check out.
#[derive(Debug, PartialEq, Eq)]
enum Tail {
    /// Only zeroes: the log (or this segment) ends here.
    End,
    /// Synced records may follow (a valid batch at `follows`, or in a later segment):
    /// damage, never skipped.
    Damage { follows: Option<u64> },
    /// The newest segment's last batch, torn by a crash (or a spare's old bytes): cut.
    Cut,
}

/// Guarantee 3: a bad batch in the `newest` segment or not, given whether only zeroes
/// follow it and the offset of a valid batch after it (each read only when needed:
/// the second scans up to a whole segment).
fn judge_bad_batch(
    newest: bool,
    only_zeroes_follow: impl FnOnce() -> io::Result<bool>,
    valid_batch_after: impl FnOnce() -> io::Result<Option<u64>>,
) -> io::Result<Tail> {
    if only_zeroes_follow()? {
        return Ok(Tail::End);
    }
    // Only the newest segment can have a torn tail: the writer syncs a segment before
    // it creates the next.
    if !newest {
        return Ok(Tail::Damage { follows: None });
    }
    // The writer has at most one batch written and not synced: a valid batch after a
    // bad one was synced after it was written.
    Ok(match valid_batch_after()? {
        Some(at) => Tail::Damage { follows: Some(at) },
        None => Tail::Cut,
    })
}

/// Where the chain of segments (first position, logical end in it) breaks: the end
/// of one and the start of the next, which must be equal.
fn chain_break(segs: &[(Lsn, u64)]) -> Option<(Lsn, Lsn)> {
    segs.windows(2)
        .map(|w| (w[0].0 + w[0].1, w[1].0))
        .find(|(ended, next)| ended != next)
}

/// The spares to keep, oldest first, and those to remove. Only spares this log retired
/// are kept: they held positions below its `oldest` segment, so none of their old
/// batches can name a position the log will write. A spare from anywhere else (a log
/// reset by deleting its segments, a copy) might, and is removed; so are any beyond
/// `spares_max`.
fn sort_spares(spares: Vec<Lsn>, oldest: Option<Lsn>, spares_max: usize) -> (Vec<Lsn>, Vec<Lsn>) {
    let (keep, mut removed): (Vec<Lsn>, Vec<Lsn>) = spares
        .into_iter()
        .partition(|&f| oldest.is_some_and(|o| f < o));
    removed.extend(keep.iter().skip(spares_max));
    (keep.into_iter().take(spares_max).collect(), removed)
}

/// A new log: its first segment, with a random log id; returns the id.
fn create(st: &dyn Storage) -> Result<u64, Error> {
    let io = |what| move |e| Error::io(what, e);
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
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    const H: u64 = SEGMENT_HEADER_BYTES;

    fn header(first: Lsn, log_id: u64) -> Result<SegmentHeader, FormatError> {
        Ok(SegmentHeader { first, log_id })
    }

    #[test]
    fn only_the_newest_segment_may_be_unfinished_and_only_if_it_holds_nothing() {
        let bad = || Err::<SegmentHeader, _>(FormatError::NotASegment);
        assert_eq!(
            judge_header(bad(), 64, true, H, Some(7)),
            Ok(Header::Unfinished)
        );
        assert_eq!(
            judge_header(bad(), 64, true, 0, None),
            Ok(Header::Unfinished)
        );
        // Something after the header: records were written after it was synced.
        assert!(judge_header(bad(), 64, true, H + 1, Some(7)).is_err());
        assert!(judge_header(bad(), 64, false, H, Some(7)).is_err());
    }

    #[test]
    fn a_header_must_name_its_own_position_and_the_logs_id() {
        assert_eq!(
            judge_header(header(64, 7), 64, false, 4096, None),
            Ok(Header::Segment { log_id: 7 })
        );
        assert_eq!(
            judge_header(header(64, 7), 64, true, 4096, Some(7)),
            Ok(Header::Segment { log_id: 7 })
        );
        let e = judge_header(header(128, 7), 64, false, 4096, Some(7)).unwrap_err();
        assert!(e.contains("names position 128"), "{e}");
        let e = judge_header(header(64, 8), 64, false, 4096, Some(7)).unwrap_err();
        assert!(e.contains("another log"), "{e}");
    }

    /// `judge_bad_batch` with what follows the bad batch, counting the looks at it.
    fn judge(newest: bool, zeroes: bool, valid_after: Option<u64>) -> (Tail, u32) {
        let looks = Cell::new(0);
        let tail = judge_bad_batch(
            newest,
            || {
                looks.set(looks.get() + 1);
                Ok(zeroes)
            },
            || {
                looks.set(looks.get() + 1);
                Ok(valid_after)
            },
        )
        .unwrap();
        (tail, looks.get())
    }

    #[test]
    fn a_torn_tail_is_cut_and_damage_before_a_durable_batch_is_refused() {
        // Zeroes after the last batch: the end, wherever it is (space filled ahead).
        assert_eq!(judge(true, true, Some(800)), (Tail::End, 1));
        assert_eq!(judge(false, true, None), (Tail::End, 1));
        // A bad batch before a later segment: the segment was synced before the next
        // one was made, so it is damage; no need to look further.
        assert_eq!(
            judge(false, false, None),
            (Tail::Damage { follows: None }, 1)
        );
        // The newest segment: a torn tail, unless a valid batch follows it.
        assert_eq!(judge(true, false, None), (Tail::Cut, 2));
        assert_eq!(
            judge(true, false, Some(800)),
            (Tail::Damage { follows: Some(800) }, 2)
        );
    }

    #[test]
    fn a_read_error_while_judging_is_an_error_not_a_verdict() {
        let e = judge_bad_batch(true, || Ok(false), || Err(io::Error::other("disk gone")));
        assert!(e.is_err());
    }

    #[test]
    fn segments_must_chain_end_to_start() {
        assert_eq!(chain_break(&[]), None);
        assert_eq!(chain_break(&[(0, 500)]), None);
        assert_eq!(chain_break(&[(0, 500), (500, 300), (800, H)]), None);
        assert_eq!(chain_break(&[(0, 500), (600, 300)]), Some((500, 600)));
        assert_eq!(
            chain_break(&[(0, 500), (500, 300), (700, H)]),
            Some((800, 700))
        );
    }

    #[test]
    fn only_spares_below_the_oldest_segment_are_kept_up_to_the_limit() {
        let (keep, removed) = sort_spares(vec![10, 20, 30, 40, 50], Some(40), 2);
        assert_eq!(keep, vec![10, 20]);
        assert_eq!(removed, vec![40, 50, 30]);
        // No segment yet: no spare can be known to be this log's.
        let (keep, removed) = sort_spares(vec![10, 20], None, 16);
        assert!(keep.is_empty());
        assert_eq!(removed, vec![10, 20]);
        let (keep, removed) = sort_spares(vec![10, 20], Some(30), 0);
        assert!(keep.is_empty());
        assert_eq!(removed, vec![10, 20]);
    }
}
