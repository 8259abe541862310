//! What a batch covers (docs/log.md §2, §3). Pure: no I/O, no locks (the caller holds
//! the lock appends take).
//!
//! 1. `push` copies a record's frame into the open batch and returns the position just
//!    past it. A frame that would take the open batch (padded) past its segment's end
//!    closes that batch first, and the record starts the next segment where the closed
//!    batch ends, after the new segment's header.
//! 2. `take` closes the open batch and hands the writer every batch closed since it
//!    last took, in log order.
//! 3. `written` takes the bytes of the batches the writer wrote off the bytes pending,
//!    which lets appends waiting at `pending_bytes_max` go on, and keeps their buffers
//!    for the next batches.
//!
//! Nothing here is persisted: a crash loses the open batch and those taken and not
//! yet synced, none of which was reported durable.

use crate::Lsn;
use crate::format::{BatchBuf, FRAME_HEADER_BYTES, SEGMENT_HEADER_BYTES, align};
use std::collections::VecDeque;

/// A batch closed and waiting for the writer.
pub(super) struct Sealed {
    /// The segment it goes to (its first position).
    pub(super) seg: Lsn,
    /// The first batch of a segment the writer has still to create.
    pub(super) creates_segment: bool,
    /// Where it starts in its segment.
    pub(super) offset: u64,
    /// A header's room and the frames until the writer seals them (`format::seal`),
    /// then the bytes to write.
    pub(super) bytes: Vec<u8>,
    /// Where it ends, padding included: where the next batch of its segment starts.
    pub(super) end: Lsn,
    /// Frame bytes it takes off `pending_bytes` once written.
    pub(super) pending: u64,
}

/// At most this many buffers of written batches are kept for reuse, each at most
/// `SPARE_BYTES_MAX` (a burst's large batch is not held on to).
const SPARE_MAX: usize = 4;
const SPARE_BYTES_MAX: usize = 1 << 20;

/// The open batch, the batches closed for the writer, and the positions and byte
/// counts they carry.
#[derive(Default)]
pub(super) struct Batches {
    open: BatchBuf,
    /// Where the open batch starts.
    open_start: Lsn,
    open_pending: u64,
    /// The open batch is the first of a segment the writer has still to create.
    open_creates_segment: bool,
    /// The segment the open batch goes to.
    seg: Lsn,
    sealed: VecDeque<Sealed>,
    /// The end of the last record appended.
    end: Lsn,
    /// Frame bytes appended and not yet written: appends wait while this reaches
    /// `pending_bytes_max`.
    pending_bytes: u64,
    /// Buffers of batches written, kept for the next batches: a batch's buffer grows
    /// to its size once, not in every cycle (and under the lock appends take).
    spare: Vec<Vec<u8>>,
}

impl Batches {
    /// Batches of a log whose newest segment starts at `seg` and which ends at `end`.
    pub(super) fn new(seg: Lsn, end: Lsn) -> Batches {
        // A batch's offset in its segment is `open_start - seg`: a log whose end lay
        // before its newest segment's header would write batches over it.
        assert!(
            end >= seg + SEGMENT_HEADER_BYTES,
            "the log ends at or after its newest segment's header ({end} < {seg} + header)"
        );
        Batches {
            open_start: end,
            seg,
            end,
            ..Batches::default()
        }
    }

    /// The end of the last record appended.
    #[inline]
    pub(super) fn end(&self) -> Lsn {
        self.end
    }

    #[inline]
    pub(super) fn pending_bytes(&self) -> u64 {
        self.pending_bytes
    }

    /// Where the open batch starts: every batch before it is closed, taken by the
    /// writer or waiting for it. The writer never writes past it.
    #[inline]
    pub(super) fn closed_end(&self) -> Lsn {
        self.open_start
    }

    /// Copy a frame of `kind` and `payload` (whose checksum is `crc`) into the open
    /// batch; returns the position just past it. A segment the record starts is pushed
    /// onto `segments`.
    #[inline]
    pub(super) fn push(
        &mut self,
        kind: u8,
        crc: u32,
        payload: &[u8],
        segment_bytes: u64,
        segments: &mut Vec<Lsn>,
    ) -> Lsn {
        let frame = FRAME_HEADER_BYTES + payload.len() as u64;
        // A batch never spans segments: if this frame (with the batch's padding) would
        // pass the segment's end, the next segment starts where the last batch ends.
        if self.open_start + align(self.open.len() + frame) > self.seg + segment_bytes {
            let next = if self.open.is_empty() {
                self.open_start
            } else {
                self.seal_open()
            };
            // The segment list is ascending, and a batch's offset is `open_start - seg`.
            assert!(next > self.seg, "segments start at rising positions");
            self.seg = next;
            segments.push(next);
            self.open_start = next + SEGMENT_HEADER_BYTES;
            self.open_creates_segment = true;
        }
        let at = self.open.push(kind, crc, payload);
        let end = self.open_start + at + frame;
        // A waiter is released once `durable` reaches the position it was given: a
        // position that fell back could be reported durable before it was written.
        assert!(end > self.end, "append positions only rise");
        self.end = end;
        self.open_pending += frame;
        // Bounded by pending_bytes_max plus one record, far below u64: a wrap would
        // let appends past the backpressure and then wrap `written` below zero.
        self.pending_bytes = self
            .pending_bytes
            .checked_add(frame)
            .expect("pending_bytes never wraps");
        end
    }

    /// Everything appended and not yet taken, closed, in log order.
    #[inline]
    pub(super) fn take(&mut self) -> Vec<Sealed> {
        if !self.open.is_empty() {
            self.seal_open();
        }
        self.sealed.drain(..).collect()
    }

    /// `batches` were written (or failed to be): their bytes are no longer pending.
    /// Their buffers are kept for the next batches, or put in `freed` to be freed
    /// after the caller lets go of the lock (a large one is an munmap).
    #[inline]
    pub(super) fn written(&mut self, batches: Vec<Sealed>, freed: &mut Vec<Vec<u8>>) {
        let taken: u64 = batches.iter().map(|b| b.pending).sum();
        // In release a wrap here would be silent: pending_bytes near u64::MAX stops
        // every append at the backpressure for ever.
        assert!(
            taken <= self.pending_bytes,
            "the writer takes off pending_bytes only what appends added ({taken} > {})",
            self.pending_bytes
        );
        self.pending_bytes -= taken;
        for b in batches {
            if self.spare.len() < SPARE_MAX && b.bytes.capacity() <= SPARE_BYTES_MAX {
                let mut bytes = b.bytes;
                bytes.clear();
                self.spare.push(bytes);
            } else {
                freed.push(b.bytes);
            }
        }
    }

    /// The log refuses writes: batches closed and not taken will never be written.
    pub(super) fn drop_sealed(&mut self) {
        self.sealed.clear();
    }

    /// Close the open batch (which holds at least one record) for the writer, which
    /// seals it (`format::seal`: the checksum over every frame) once it has let go of
    /// the lock appends take; returns where the next batch starts.
    fn seal_open(&mut self) -> Lsn {
        let batch = std::mem::replace(
            &mut self.open,
            BatchBuf {
                bytes: self.spare.pop().unwrap_or_default(),
                records: 0,
            },
        );
        let bytes = batch.bytes;
        let end = self.open_start + align(bytes.len() as u64);
        self.sealed.push_back(Sealed {
            seg: self.seg,
            creates_segment: std::mem::take(&mut self.open_creates_segment),
            offset: self.open_start - self.seg,
            bytes,
            end,
            pending: std::mem::take(&mut self.open_pending),
        });
        self.open_start = end;
        end
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{self, BATCH_HEADER_BYTES, BatchHeader, frame_crc};
    use ferry_core::seams::{Rng, SplitMix64};

    /// Push `payload` as a record of kind 1.
    fn push(b: &mut Batches, payload: &[u8], segment_bytes: u64, segments: &mut Vec<Lsn>) -> Lsn {
        b.push(1, frame_crc(1, payload), payload, segment_bytes, segments)
    }

    /// Every batch taken, sealed and read back as the reader reads it: (its position,
    /// the end of each record in it).
    fn read_back(batches: &mut [Sealed]) -> Vec<(Lsn, Vec<Lsn>)> {
        batches
            .iter_mut()
            .map(|b| {
                let lsn = b.seg + b.offset;
                format::seal(&mut b.bytes, lsn);
                let h = BatchHeader::decode(&b.bytes).unwrap();
                assert_eq!(h.lsn, lsn);
                assert_eq!(lsn + h.extent(), b.end, "a batch ends where its bytes end");
                let frames = &b.bytes[BATCH_HEADER_BYTES as usize..][..h.frames_len as usize];
                let ends = format::frames(frames)
                    .unwrap()
                    .iter()
                    .map(|f| lsn + BATCH_HEADER_BYTES + f.end as u64)
                    .collect();
                (lsn, ends)
            })
            .collect()
    }

    #[test]
    fn batches_cover_each_record_once_in_order_and_never_span_a_segment() {
        // Against the reader's view: every position push returned is the end of a
        // record in a batch taken, in order; batches follow one another with no hole,
        // a new segment starting exactly where the last batch of the one before ended.
        const SEGMENT: u64 = 1024;
        let mut rng = SplitMix64::seeded(7);
        let mut b = Batches::new(0, SEGMENT_HEADER_BYTES);
        let mut segments = vec![0];
        let mut returned = Vec::new();
        let mut read = Vec::new();
        let mut written = SEGMENT_HEADER_BYTES;
        for round in 0..200 {
            for _ in 0..rng.below(6) {
                let payload = vec![round as u8; rng.below(300) as usize];
                returned.push(push(&mut b, &payload, SEGMENT, &mut segments));
            }
            let mut taken = b.take();
            for t in &taken {
                let start = t.seg + t.offset;
                if t.creates_segment {
                    assert_eq!(
                        t.seg, written,
                        "a segment starts where the last batch ended"
                    );
                    assert_eq!(t.offset, SEGMENT_HEADER_BYTES);
                } else {
                    assert_eq!(start, written, "a batch starts where the last one ended");
                }
                assert!(t.end <= t.seg + SEGMENT, "a batch never spans segments");
                written = t.end;
            }
            assert_eq!(b.closed_end(), written);
            for (_, ends) in read_back(&mut taken) {
                read.extend(ends);
            }
            let mut freed = Vec::new();
            b.written(taken, &mut freed);
        }
        assert_eq!(read, returned);
        assert!(returned.windows(2).all(|w| w[0] < w[1]));
        assert!(segments.len() > 10, "the records filled many segments");
        assert!(segments.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn pending_bytes_count_frames_until_they_are_written() {
        let mut b = Batches::new(0, SEGMENT_HEADER_BYTES);
        let mut segments = vec![0];
        push(&mut b, &[1; 10], 4096, &mut segments);
        push(&mut b, &[2; 20], 4096, &mut segments);
        assert_eq!(b.pending_bytes(), 2 * FRAME_HEADER_BYTES + 30);
        let first = b.take();
        push(&mut b, &[3; 5], 4096, &mut segments);
        let mut freed = Vec::new();
        b.written(first, &mut freed);
        assert_eq!(b.pending_bytes(), FRAME_HEADER_BYTES + 5);
        let second = b.take();
        b.written(second, &mut freed);
        assert_eq!(b.pending_bytes(), 0);
        assert!(
            freed.is_empty(),
            "small buffers are kept for the next batches"
        );
    }

    #[test]
    fn a_record_too_large_for_the_rest_of_its_segment_starts_the_next() {
        // The open batch is closed at its padded end, and the record is the first of a
        // segment that starts there.
        let mut b = Batches::new(0, SEGMENT_HEADER_BYTES);
        let mut segments = vec![0];
        let first = push(&mut b, &[0; 900], 1024, &mut segments);
        let batch_end = align(first);
        let second = push(&mut b, &[0; 200], 1024, &mut segments);
        assert_eq!(segments, vec![0, batch_end]);
        let expected = batch_end + SEGMENT_HEADER_BYTES + BATCH_HEADER_BYTES;
        assert_eq!(second, expected + FRAME_HEADER_BYTES + 200);
        let taken = b.take();
        assert_eq!(taken.len(), 2);
        assert!(taken[1].creates_segment && !taken[0].creates_segment);
    }

    #[test]
    #[should_panic(expected = "the writer takes off pending_bytes only what appends added")]
    fn giving_back_more_than_is_pending_stops_rather_than_wraps() {
        let mut b = Batches::new(0, SEGMENT_HEADER_BYTES);
        let mut segments = vec![0];
        push(&mut b, &[1; 10], 4096, &mut segments);
        let mut taken = b.take();
        taken[0].pending += 1;
        b.written(taken, &mut Vec::new());
    }
}
