//! The writer: group commit (docs/log.md §3).
//!
//! 1. Wait, up to `Config::follow`, for the followers the last sync woke to go idle
//!    (`follow`).
//! 2. Take every batch appended since the last look, under the lock appends take;
//!    sleep on `work` if there is none.
//! 3. Seal them (each header's checksum over its frames) with the lock let go.
//! 4. Write them, creating a segment where one begins (the old one synced first, the
//!    new one's header synced and the directory synced before its first batch), and
//!    top up the zeroes ahead in the same write.
//! 5. `fdatasync` every segment written.
//! 6. Under the lock: publish `durable` = the end of the last batch, then wake exactly
//!    the waits at or below it (`Waiters::release`).
//!
//! A crash before 6 leaves written batches that no one was told are durable: recovery
//! cuts a torn one. A failed write or sync (4, 5) poisons the log: every wait fails,
//! and every later append and sync is refused until the log is reopened (guarantee 4).

use super::batch::Sealed;
use super::follow::wait_for_followers;
use super::space::{Filled, ZEROES, segment_from_spare, top_up};
use super::state::{Inner, Shared};
use super::trace::{Cycle, Marks};
use crate::format::{self, SEGMENT_HEADER_BYTES, SegmentHeader, segment_name};
use crate::{Error, Lsn};
use ferry_core::sync::lock;
use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// What the writer keeps from one cycle to the next (a driven log's holder keeps it
/// for it, in `Log`).
pub(super) struct Writer {
    /// How far the newest segment's file reaches.
    pub(super) filled: Filled,
    /// The end of the last batch written: the next batch starts here, or a segment
    /// does. `durable <= written <= ` the end of the batches closed for the writer
    /// (`Batches::closed_end`): a batch that started elsewhere would leave a hole in
    /// the log, or write over a record.
    written: Lsn,
}

impl Writer {
    /// The writer of a log that ends at `end`, its newest segment's file as `filled`.
    pub(super) fn new(filled: Filled, end: Lsn) -> Writer {
        Writer {
            filled,
            written: end,
        }
    }
}

/// The writer thread: take what filled, write it, sync it, publish, wake who it
/// covers; until the log closes.
pub(super) fn write_loop(inner: &Inner, mut writer: Writer) {
    loop {
        let began = Instant::now();
        wait_for_followers(&inner.follow, inner.config.follow, &*inner.clock);
        let followed = Instant::now();
        let batches: Vec<Sealed> = {
            let mut s = lock(&inner.shared);
            loop {
                let batches = take_batches(&mut s);
                if !batches.is_empty() {
                    break batches;
                }
                if s.closing {
                    let clean = s.poisoned.is_none();
                    drop(s);
                    if clean {
                        cut_reused(inner, &writer.filled);
                    }
                    return;
                }
                s.writer_asleep = true;
                s = ferry_core::sync::wait(&inner.work, s);
                s.writer_asleep = false;
            }
        };
        let taken = Instant::now();
        let marks = Marks {
            began,
            followed,
            taken,
        };
        write_and_publish(inner, batches, &mut writer, marks);
    }
}

/// On a clean close, the newest segment, if made from a spare, loses what the spare
/// held after the log's end: the next open then finds the end followed by nothing, not
/// by bytes it would have to cut as a torn tail.
pub(super) fn cut_reused(inner: &Inner, filled: &Filled) {
    if !filled.reused {
        return;
    }
    // A wrapped length would extend the file rather than cut it.
    let end = (inner.durable.load(Ordering::SeqCst))
        .checked_sub(filled.seg)
        .expect("the log ends in its newest segment");
    let name = segment_name(filled.seg);
    let st = &*inner.storage;
    if let Err(e) = st.truncate(&name, end).and_then(|()| st.sync(&name)) {
        tracing::warn!(segment = %name, "could not cut a reused segment at the log's end: {e}");
    }
}

/// Everything appended and not yet taken, closed (none once the log is poisoned).
pub(super) fn take_batches(s: &mut Shared) -> Vec<Sealed> {
    if s.poisoned.is_some() {
        return Vec::new();
    }
    s.batches.take()
}

/// Write and sync `batches` (at least one), then publish the durable position and wake
/// the waiters it covers; or poison the log and fail every waiter. `marks`: the
/// cycle's moments so far, for the trace.
pub(super) fn write_and_publish(
    inner: &Inner,
    mut batches: Vec<Sealed>,
    writer: &mut Writer,
    marks: Marks,
) {
    for b in &mut batches {
        format::seal(&mut b.bytes, b.seg + b.offset);
    }
    let writing = Instant::now();
    let result = write_batches(inner, &batches, writer);
    let synced = Instant::now();
    let took = (synced - writing).as_micros() as u64;
    let end = batches.last().expect("at least one batch").end;
    let batches_n = batches.len() as u64;
    let bytes: u64 = batches.iter().map(|b| b.bytes.len() as u64).sum();
    // Buffers not kept are freed after the lock is let go (a large one is an munmap).
    let mut freed = Vec::new();
    let mut s = lock(&inner.shared);
    s.batches.written(batches, &mut freed);
    match result {
        Ok((syncs, reused)) => {
            s.stats.batches += batches_n;
            s.stats.syncs += syncs;
            s.stats.segments_reused += reused;
            s.stats.bytes_written += bytes;
            s.stats.write_us.record(took);
            // Only the writer stores `durable`. A position published lower than before
            // would let a wait registered meanwhile see it durable and then not; one
            // past what was closed for the writer, a record not yet written.
            let before = inner.durable.load(Ordering::SeqCst);
            assert!(
                before < end,
                "the durable position only rises ({before} to {end})"
            );
            assert!(
                end <= s.batches.closed_end(),
                "durable <= written <= appended ({end} past {})",
                s.batches.closed_end()
            );
            inner.durable.store(end, Ordering::SeqCst);
            let done = s.waiters.release(end);
            drop(s);
            for w in done {
                // Guarantee 2: a wait never wakes before its position is durable. Checked
                // per wait, where it wakes: the binary search that chose them trusts the
                // queue's order and cannot tell.
                assert!(w.lsn <= end, "a sync releases only the waits it covers");
                // A wait given up (its receiver dropped) wakes no one to wait for.
                if let Some(f) = &w.follower
                    && !w.tx.abandoned()
                {
                    inner.follow.woke(f);
                }
                w.tx.send(Ok(()));
            }
            if inner.trace.on() {
                inner.trace.record(Cycle {
                    began: marks.began,
                    followed: marks.followed,
                    taken: marks.taken,
                    synced,
                    woke: Instant::now(),
                    end,
                    batches: batches_n as u32,
                });
            }
        }
        Err(e) => {
            tracing::error!("the log's write or sync failed; refusing writes until reopened: {e}");
            let cause = Arc::new(e);
            s.poisoned = Some(cause.clone());
            s.batches.drop_sealed();
            let all = s.waiters.take_all();
            drop(s);
            for w in all {
                w.tx.send(Err(Error::Io {
                    what: "make the record durable",
                    source: cause.clone(),
                }));
            }
        }
    }
    inner.space.notify_all();
}

/// Write `batches` (creating segments as they begin) and sync every segment written.
/// Returns the number of syncs and of segments made from spares.
fn write_batches(inner: &Inner, batches: &[Sealed], writer: &mut Writer) -> io::Result<(u64, u64)> {
    let st = &*inner.storage;
    let Writer { filled, written } = writer;
    let mut syncs = 0;
    let mut reused = 0;
    let mut unsynced: Option<Lsn> = None;
    for b in batches {
        let name = segment_name(b.seg);
        // Recovery reads a segment batch by batch from its header, and the log from
        // segment to segment: a batch that did not start where the last one ended
        // would make the records after it unreadable, or overwrite acknowledged ones.
        if b.creates_segment {
            assert!(
                b.seg == *written && b.offset == SEGMENT_HEADER_BYTES,
                "a segment starts where the last batch ended, its first batch after its header"
            );
        } else {
            assert!(
                b.seg + b.offset == *written,
                "batches are written in log order, each where the last one ended"
            );
        }
        if b.creates_segment {
            // The old segment is complete and synced before the new one exists, so only
            // the newest segment can ever have a torn tail.
            if let Some(prev) = unsynced.take() {
                st.sync(&segment_name(prev))?;
                syncs += 1;
            }
            let header = SegmentHeader {
                first: b.seg,
                log_id: inner.log_id,
            }
            .encode();
            *filled = match segment_from_spare(inner, &name, &header) {
                Some(len) => {
                    reused += 1;
                    Filled {
                        seg: b.seg,
                        len,
                        reused: true,
                    }
                }
                None => {
                    st.create(&name)?;
                    st.write_at(&name, 0, &header)?;
                    st.sync(&name)?;
                    Filled {
                        seg: b.seg,
                        len: SEGMENT_HEADER_BYTES,
                        reused: false,
                    }
                }
            };
            st.sync_dir()?;
            syncs += 2;
        }
        st.write_at(&name, b.offset, &b.bytes)?;
        *written = b.end;
        unsynced = Some(b.seg);
        let end = b.offset + b.bytes.len() as u64;
        if filled.seg == b.seg {
            filled.len = filled.len.max(end);
            if let Some(upto) = top_up(filled.len, end, inner.config.segment_bytes) {
                st.write_at(&name, filled.len, &ZEROES[..(upto - filled.len) as usize])?;
                filled.len = upto;
            }
        }
    }
    if let Some(seg) = unsynced {
        st.sync(&segment_name(seg))?;
        syncs += 1;
    }
    Ok((syncs, reused))
}
