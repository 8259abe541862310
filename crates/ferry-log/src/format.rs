//! The bytes on disk (docs/log.md §2). Everything is little-endian.
//!
//! A segment is a 32-byte header followed by batches. A batch is what the writer wrote
//! with one `write`: a 24-byte header, then frames, then zeroes up to a multiple of 8.
//! A frame is one record: length, checksum, kind, payload.

use std::ops::Range;

/// Why bytes on disk are not a segment header, a batch header or a batch's frames.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("the segment header is short ({0} bytes)")]
    SegmentHeaderShort(usize),
    #[error("not a ferry-log segment (bad magic)")]
    NotASegment,
    #[error("the segment header fails its checksum")]
    SegmentHeaderChecksum,
    #[error("segment format version {0}; this build reads version {FORMAT_VERSION}")]
    Version(u32),
    #[error("short batch header")]
    BatchHeaderShort,
    #[error("zeroes where a batch should start")]
    Zeroes,
    #[error("no batch header here (bad magic)")]
    NoBatch,
    #[error("the batch header's reserved field is not zero")]
    Reserved,
    #[error("a frame header at {0} is cut short")]
    FrameHeaderShort(usize),
    #[error("the frame at {at} claims {len} bytes, more than the batch holds")]
    FrameTooLong { at: usize, len: usize },
    #[error("the frame at {0} fails its checksum")]
    FrameChecksum(usize),
}

pub const SEGMENT_MAGIC: &[u8; 8] = b"FERRYLOG";
pub const FORMAT_VERSION: u32 = 1;
pub const SEGMENT_HEADER_BYTES: u64 = 32;
/// "FLB1" read as a little-endian u32.
pub const BATCH_MAGIC: u32 = u32::from_le_bytes(*b"FLB1");
pub const BATCH_HEADER_BYTES: u64 = 24;
pub const FRAME_HEADER_BYTES: u64 = 9;
/// Batches start at multiples of this (a recovery scan looks for headers only there).
pub const ALIGN: u64 = 8;

pub fn align(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

/// A segment file's name: its first LSN, zero-padded to 20 digits.
pub fn segment_name(first: u64) -> String {
    format!("{first:020}.seg")
}

/// The first LSN a segment file's name gives, or None for any other file.
pub fn parse_segment_name(name: &str) -> Option<u64> {
    parse_digits(name.strip_suffix(".seg")?)
}

/// A retired segment kept for reuse (docs/log.md §3): the first LSN it had, and
/// `.spare`. Recovery reads no spare as part of the log.
pub fn spare_name(first: u64) -> String {
    format!("{first:020}.spare")
}

/// The first LSN a spare's name gives, or None for any other file.
pub fn parse_spare_name(name: &str) -> Option<u64> {
    parse_digits(name.strip_suffix(".spare")?)
}

fn parse_digits(digits: &str) -> Option<u64> {
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentHeader {
    pub first: u64,
    pub log_id: u64,
}

impl SegmentHeader {
    pub fn encode(&self) -> [u8; SEGMENT_HEADER_BYTES as usize] {
        let mut b = [0u8; SEGMENT_HEADER_BYTES as usize];
        b[0..8].copy_from_slice(SEGMENT_MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[12..20].copy_from_slice(&self.first.to_le_bytes());
        b[20..28].copy_from_slice(&self.log_id.to_le_bytes());
        let crc = crc32c::crc32c(&b[0..28]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<SegmentHeader, FormatError> {
        if b.len() < SEGMENT_HEADER_BYTES as usize {
            return Err(FormatError::SegmentHeaderShort(b.len()));
        }
        if &b[0..8] != SEGMENT_MAGIC {
            return Err(FormatError::NotASegment);
        }
        if crc32c::crc32c(&b[0..28]) != u32_at(b, 28) {
            return Err(FormatError::SegmentHeaderChecksum);
        }
        let version = u32_at(b, 8);
        if version != FORMAT_VERSION {
            return Err(FormatError::Version(version));
        }
        Ok(SegmentHeader {
            first: u64_at(b, 12),
            log_id: u64_at(b, 20),
        })
    }
}

/// A batch being filled: header placeholder, then frames.
#[derive(Debug, Default)]
pub struct BatchBuf {
    pub bytes: Vec<u8>,
    pub records: u64,
}

impl BatchBuf {
    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    /// Bytes the batch holds so far, header included, padding not.
    pub fn len(&self) -> u64 {
        if self.bytes.is_empty() {
            BATCH_HEADER_BYTES
        } else {
            self.bytes.len() as u64
        }
    }

    /// Append one frame whose checksum is `crc` (`frame_crc` of the same kind and
    /// payload: computed before, so not under the lock appends take); returns its offset
    /// from the batch's start.
    pub fn push(&mut self, kind: u8, crc: u32, payload: &[u8]) -> u64 {
        if self.bytes.is_empty() {
            self.bytes.resize(BATCH_HEADER_BYTES as usize, 0);
        }
        let at = self.bytes.len() as u64;
        self.bytes
            .extend_from_slice(&(payload.len() as u32).to_le_bytes());
        self.bytes.extend_from_slice(&crc.to_le_bytes());
        self.bytes.push(kind);
        self.bytes.extend_from_slice(payload);
        self.records += 1;
        at
    }
}

/// Fill in the header of a batch's bytes (`BatchBuf::bytes`: a header's room, then
/// frames) for a batch starting at `lsn`, and pad them to `align` of their length.
pub fn seal(bytes: &mut Vec<u8>, lsn: u64) {
    let frames = bytes.len() as u64 - BATCH_HEADER_BYTES;
    let mut h = [0u8; BATCH_HEADER_BYTES as usize];
    h[0..4].copy_from_slice(&BATCH_MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&(frames as u32).to_le_bytes());
    h[8..16].copy_from_slice(&lsn.to_le_bytes());
    let crc = crc32c::crc32c_append(
        crc32c::crc32c(&h[0..16]),
        &bytes[BATCH_HEADER_BYTES as usize..],
    );
    h[16..20].copy_from_slice(&crc.to_le_bytes());
    bytes[..BATCH_HEADER_BYTES as usize].copy_from_slice(&h);
    let padded = align(bytes.len() as u64) as usize;
    bytes.resize(padded, 0);
}

/// A batch header as read.
#[derive(Clone, Copy, Debug)]
pub struct BatchHeader {
    pub frames_len: u64,
    pub lsn: u64,
    pub crc: u32,
}

impl BatchHeader {
    pub fn decode(b: &[u8]) -> Result<BatchHeader, FormatError> {
        if b.len() < BATCH_HEADER_BYTES as usize {
            return Err(FormatError::BatchHeaderShort);
        }
        if b[..BATCH_HEADER_BYTES as usize].iter().all(|&x| x == 0) {
            return Err(FormatError::Zeroes);
        }
        if u32_at(b, 0) != BATCH_MAGIC {
            return Err(FormatError::NoBatch);
        }
        if u32_at(b, 20) != 0 {
            return Err(FormatError::Reserved);
        }
        Ok(BatchHeader {
            frames_len: u64::from(u32_at(b, 4)),
            lsn: u64_at(b, 8),
            crc: u32_at(b, 16),
        })
    }

    /// Does `frames` (exactly `frames_len` bytes) match this header's checksum?
    pub fn matches(&self, header: &[u8], frames: &[u8]) -> bool {
        crc32c::crc32c_append(crc32c::crc32c(&header[0..16]), frames) == self.crc
    }

    /// The batch's length on disk, header and padding included.
    pub fn extent(&self) -> u64 {
        align(BATCH_HEADER_BYTES + self.frames_len)
    }
}

/// One frame found in a batch's frame bytes.
#[derive(Clone, Debug)]
pub struct FrameAt {
    pub kind: u8,
    /// The payload's range within the frame bytes.
    pub payload: Range<usize>,
    /// The frame's offset within the frame bytes.
    pub at: usize,
    pub end: usize,
}

/// A frame's checksum: CRC32C over its length (little-endian u32), kind and payload.
pub fn frame_crc(kind: u8, payload: &[u8]) -> u32 {
    // Length and kind in one piece: each call into crc32c costs a few hundred
    // instructions before its first byte, more than a small record's payload.
    let mut head = [0u8; 5];
    head[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    head[4] = kind;
    crc32c::crc32c_append(crc32c::crc32c(&head), payload)
}

/// Split a batch's frame bytes into frames, checking each one.
pub fn frames(buf: &[u8]) -> Result<Vec<FrameAt>, FormatError> {
    let mut out = Vec::new();
    let mut at = 0usize;
    let h = FRAME_HEADER_BYTES as usize;
    while at < buf.len() {
        if buf.len() - at < h {
            return Err(FormatError::FrameHeaderShort(at));
        }
        let len = u32_at(buf, at) as usize;
        let crc = u32_at(buf, at + 4);
        let kind = buf[at + 8];
        if buf.len() - at - h < len {
            return Err(FormatError::FrameTooLong { at, len });
        }
        let payload = at + h..at + h + len;
        if frame_crc(kind, &buf[payload.clone()]) != crc {
            return Err(FormatError::FrameChecksum(at));
        }
        out.push(FrameAt {
            kind,
            payload: payload.clone(),
            at,
            end: payload.end,
        });
        at = payload.end;
    }
    Ok(out)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("four bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("eight bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_others_are_ignored() {
        assert_eq!(segment_name(42), "00000000000000000042.seg");
        assert_eq!(parse_segment_name(&segment_name(42)), Some(42));
        assert_eq!(parse_segment_name("lock"), None);
        assert_eq!(parse_segment_name("42.seg"), None);
        assert_eq!(parse_spare_name(&spare_name(42)), Some(42));
        assert_eq!(parse_segment_name(&spare_name(42)), None);
        assert_eq!(parse_spare_name(&segment_name(42)), None);
    }

    #[test]
    fn segment_header_round_trips_and_detects_damage() {
        let h = SegmentHeader {
            first: 4096,
            log_id: 7,
        };
        let mut b = h.encode();
        assert_eq!(SegmentHeader::decode(&b).unwrap(), h);
        b[13] ^= 1;
        assert!(
            SegmentHeader::decode(&b)
                .unwrap_err()
                .to_string()
                .contains("checksum")
        );
    }

    #[test]
    fn a_batch_seals_checks_and_splits_into_its_frames() {
        let mut batch = BatchBuf::default();
        assert_eq!(
            batch.push(1, frame_crc(1, b"hello"), b"hello"),
            BATCH_HEADER_BYTES
        );
        batch.push(2, frame_crc(2, b""), b"");
        batch.push(3, frame_crc(3, &[7u8; 100]), &[7u8; 100]);
        let mut bytes = batch.bytes;
        seal(&mut bytes, 1000);
        assert_eq!(bytes.len() as u64 % ALIGN, 0);
        let h = BatchHeader::decode(&bytes).unwrap();
        assert_eq!(h.lsn, 1000);
        assert_eq!(h.extent(), bytes.len() as u64);
        let frames_bytes =
            &bytes[BATCH_HEADER_BYTES as usize..(BATCH_HEADER_BYTES + h.frames_len) as usize];
        assert!(h.matches(&bytes, frames_bytes));
        let fs = frames(frames_bytes).unwrap();
        assert_eq!(fs.len(), 3);
        assert_eq!(
            (fs[0].kind, &frames_bytes[fs[0].payload.clone()]),
            (1, &b"hello"[..])
        );
        assert_eq!(fs[1].payload.len(), 0);
        assert_eq!(fs[2].payload.len(), 100);

        let mut bad = frames_bytes.to_vec();
        bad[12] ^= 0x40;
        assert!(!h.matches(&bytes, &bad));
        assert!(frames(&bad).unwrap_err().to_string().contains("checksum"));
    }
}
