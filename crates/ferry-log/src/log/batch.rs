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
        Batches {
            open_start: end,
            seg,
            end,
            ..Batches::default()
        }
    }

    /// The end of the last record appended.
    pub(super) fn end(&self) -> Lsn {
        self.end
    }

    pub(super) fn pending_bytes(&self) -> u64 {
        self.pending_bytes
    }

    /// Copy a frame of `kind` and `payload` (whose checksum is `crc`) into the open
    /// batch; returns the position just past it. A segment the record starts is pushed
    /// onto `segments`.
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
            self.seg = next;
            segments.push(next);
            self.open_start = next + SEGMENT_HEADER_BYTES;
            self.open_creates_segment = true;
        }
        let at = self.open.push(kind, crc, payload);
        let end = self.open_start + at + frame;
        self.end = end;
        self.open_pending += frame;
        self.pending_bytes += frame;
        end
    }

    /// Everything appended and not yet taken, closed, in log order.
    pub(super) fn take(&mut self) -> Vec<Sealed> {
        if !self.open.is_empty() {
            self.seal_open();
        }
        self.sealed.drain(..).collect()
    }

    /// `batches` were written (or failed to be): their bytes are no longer pending.
    /// Their buffers are kept for the next batches, or put in `freed` to be freed
    /// after the caller lets go of the lock (a large one is an munmap).
    pub(super) fn written(&mut self, batches: Vec<Sealed>, freed: &mut Vec<Vec<u8>>) {
        self.pending_bytes -= batches.iter().map(|b| b.pending).sum::<u64>();
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
