//! The wire format between shipper and receiver (docs/ship-protocol.md §1). Pure: bytes in, values
//! out, every malformed input a [`BodyError`] that names what and where.
//!
//! A `txns` body is a sequence of records, each one transaction or one part of one
//! (little-endian):
//!
//! ```text
//!  0 magic "FSTR"     4 seq u64        12 part u32       16 flags u32 (1 = last part)
//! 20 commit_pages u32 24 page_count u32 28 observed_ms u64
//! 36 wal_checksum u64 (the primary's cumulative WAL checksum at the commit frame)
//! 44 page_count × (pgno u32, page)     end crc32c u32 over everything before it
//! ```
//!
//! A base body is a 64-byte [`BaseHeader`], the pages in order, and an 8-byte trailer
//! (crc32c of the pages, `"FEND"`).

use ferry_core::epoch::Epoch;
use serde::{Deserialize, Serialize};

/// Page bytes per `txns` request the shipper sends. At 8 MiB a request is a few ms on a
/// LAN and well below the receiver's 64 MiB body limit; a bigger backlog goes in several
/// requests.
pub const BATCH_BYTES_MAX: usize = 8 << 20;
/// Page bytes per record. A transaction larger than this is sent in parts, which the
/// receiver spools until the last one arrives.
pub const PART_BYTES_MAX: usize = 4 << 20;
/// The receiver's default largest `txns` body: twice the shipper's batch and more, so a
/// receiver shared with shippers configured larger still takes their requests. At the
/// limit the receiver answers 413 and the shipper halves its batch.
pub const BODY_BYTES_MAX: u64 = 64 << 20;

// A part plus its record overhead must fit in a batch, or a large transaction could never
// be sent; and a batch must fit in the receiver's default body limit with room to spare.
const _: () = assert!(PART_BYTES_MAX + (64 << 10) <= BATCH_BYTES_MAX);
const _: () = assert!((BATCH_BYTES_MAX as u64) * 2 <= BODY_BYTES_MAX);

pub const RECORD_MAGIC: [u8; 4] = *b"FSTR";
pub const RECORD_HEADER_BYTES: usize = 44;
pub const RECORD_TRAILER_BYTES: usize = 4;
pub const FLAG_LAST_PART: u32 = 1;

/// The header of one record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    /// Transaction number in the generation (the base is 0, the first transaction 1).
    pub seq: u64,
    /// Part number within the transaction, from 0.
    pub part: u32,
    pub last: bool,
    /// Database size in pages after the commit; meaningful on the last part only.
    pub commit_pages: u32,
    pub page_count: u32,
    /// The shipper's wall clock (ms since 1970) when it first saw the commit.
    pub observed_ms: u64,
    /// The primary's cumulative WAL checksum at the transaction's commit frame. It names
    /// the whole history up to this transaction: a shipper that restarts behind the
    /// receiver compares it to tell the same history from a rewritten one.
    pub wal_checksum: u64,
}

/// One decoded record; pages borrow from the body.
#[derive(Debug)]
pub struct Record<'a> {
    pub header: RecordHeader,
    pub pages: Vec<(u32, &'a [u8])>,
}

/// Bytes a record with `pages` pages of `page_size` takes.
pub fn record_bytes(page_size: u32, pages: usize) -> usize {
    RECORD_HEADER_BYTES + pages * (4 + page_size as usize) + RECORD_TRAILER_BYTES
}

/// Append one record to `out`. Pages must be in ascending page order.
pub fn encode_record<'p>(
    out: &mut Vec<u8>,
    h: &RecordHeader,
    pages: impl IntoIterator<Item = (u32, &'p [u8])>,
) {
    let start = out.len();
    out.extend_from_slice(&RECORD_MAGIC);
    out.extend_from_slice(&h.seq.to_le_bytes());
    out.extend_from_slice(&h.part.to_le_bytes());
    out.extend_from_slice(&(if h.last { FLAG_LAST_PART } else { 0 }).to_le_bytes());
    out.extend_from_slice(&h.commit_pages.to_le_bytes());
    out.extend_from_slice(&h.page_count.to_le_bytes());
    out.extend_from_slice(&h.observed_ms.to_le_bytes());
    out.extend_from_slice(&h.wal_checksum.to_le_bytes());
    let mut written = 0u32;
    for (pgno, page) in pages {
        out.extend_from_slice(&pgno.to_le_bytes());
        out.extend_from_slice(page);
        written += 1;
    }
    assert_eq!(
        written, h.page_count,
        "a record's page_count must match the pages given"
    );
    let crc = crc32c::crc32c(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// Why a body was refused. Each names the record and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("the body is empty: a txns request carries at least one record")]
    Empty,
    #[error(
        "record {index} at byte {offset} is truncated: the body ended inside it (a cut connection?); resend it"
    )]
    Truncated { index: usize, offset: usize },
    #[error(
        "record {index} at byte {offset} does not start with the record magic: the body is not ferry records"
    )]
    Magic { index: usize, offset: usize },
    #[error(
        "record {index} (seq {seq}, part {part}) failed its CRC32C: the body was damaged in transit; resend it"
    )]
    Crc { index: usize, seq: u64, part: u32 },
    #[error("record {index} (seq {seq}, part {part}) is malformed: {what}")]
    Malformed {
        index: usize,
        seq: u64,
        part: u32,
        what: String,
    },
}

impl ferry_core::Classify for BodyError {
    /// Bytes damaged or cut in transit fail validation (the shipper resends them); a body
    /// that is well carried but not well formed fails the same way every time.
    fn class(&self) -> ferry_core::Class {
        match self {
            BodyError::Crc { .. } | BodyError::Truncated { .. } => ferry_core::Class::Corrupted,
            _ => ferry_core::Class::Permanent,
        }
    }
}

/// Why a base stream's header or trailer was refused. It has no class of its own: the
/// receiver, where it meets one, refuses a bad header as corrupt and a bad trailer as an
/// invalid base, whatever the variant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BaseError {
    #[error("the base ended inside its {BASE_HEADER_BYTES}-byte header")]
    ShortHeader,
    #[error("the base does not start with the base magic: it is not a ferry base stream")]
    Magic,
    #[error("the base header failed its CRC32C: damaged in transit")]
    HeaderCrc,
    #[error("the base's page size {0} is not a SQLite page size")]
    PageSize(u32),
    #[error("the base's generation is 0; generations are non-zero")]
    Generation,
    #[error("the base ended without its trailer: the upload was cut short")]
    NoTrailer,
    #[error("the base's pages failed their CRC32C: damaged in transit")]
    PagesCrc,
}

/// Decode and validate every record of a body. Nothing is returned unless all of it is
/// well formed, so a damaged body changes nothing.
pub fn decode_records(body: &[u8], page_size: u32) -> Result<Vec<Record<'_>>, BodyError> {
    if body.is_empty() {
        return Err(BodyError::Empty);
    }
    let mut records = Vec::new();
    let mut offset = 0;
    while offset < body.len() {
        let index = records.len();
        let rest = &body[offset..];
        if rest.len() < RECORD_HEADER_BYTES + RECORD_TRAILER_BYTES {
            return Err(BodyError::Truncated { index, offset });
        }
        if rest[0..4] != RECORD_MAGIC {
            return Err(BodyError::Magic { index, offset });
        }
        let h = RecordHeader {
            seq: le64(rest, 4),
            part: le32(rest, 12),
            last: le32(rest, 16) & FLAG_LAST_PART != 0,
            commit_pages: le32(rest, 20),
            page_count: le32(rest, 24),
            observed_ms: le64(rest, 28),
            wal_checksum: le64(rest, 36),
        };
        let len = (h.page_count as usize)
            .checked_mul(4 + page_size as usize)
            .and_then(|n| n.checked_add(RECORD_HEADER_BYTES + RECORD_TRAILER_BYTES))
            .ok_or(BodyError::Truncated { index, offset })?;
        if rest.len() < len {
            return Err(BodyError::Truncated { index, offset });
        }
        let crc = le32(rest, len - RECORD_TRAILER_BYTES);
        if crc32c::crc32c(&rest[..len - RECORD_TRAILER_BYTES]) != crc {
            return Err(BodyError::Crc {
                index,
                seq: h.seq,
                part: h.part,
            });
        }
        let malformed = |what: String| BodyError::Malformed {
            index,
            seq: h.seq,
            part: h.part,
            what,
        };
        if h.seq == 0 {
            return Err(malformed("seq 0 is the base, never a transaction".into()));
        }
        if h.last && h.commit_pages == 0 {
            return Err(malformed(
                "the last part of a transaction must carry the database size".into(),
            ));
        }
        let mut pages = Vec::with_capacity(h.page_count as usize);
        let mut at = RECORD_HEADER_BYTES;
        for _ in 0..h.page_count {
            let pgno = le32(rest, at);
            if pgno == 0 || pages.last().is_some_and(|(prev, _)| *prev >= pgno) {
                return Err(malformed(format!(
                    "page numbers must rise from 1 (found {pgno})"
                )));
            }
            if h.last && pgno > h.commit_pages {
                return Err(malformed(format!(
                    "page {pgno} is beyond the committed size {}",
                    h.commit_pages
                )));
            }
            pages.push((pgno, &rest[at + 4..at + 4 + page_size as usize]));
            at += 4 + page_size as usize;
        }
        records.push(Record { header: h, pages });
        offset += len;
    }
    Ok(records)
}

pub const BASE_MAGIC: [u8; 8] = *b"FSBASE01";
pub const BASE_HEADER_BYTES: usize = 64;
pub const BASE_TRAILER_MAGIC: [u8; 4] = *b"FEND";
pub const BASE_TRAILER_BYTES: usize = 8;

/// The header of a base stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BaseHeader {
    pub page_size: u32,
    pub page_count: u32,
    pub epoch: Epoch,
    pub generation: u64,
    /// Always 0 today: a base starts its generation.
    pub seq: u64,
    pub observed_ms: u64,
    /// The primary's cumulative WAL checksum where the base was taken (0 if the WAL was
    /// empty).
    pub wal_checksum: u64,
}

impl BaseHeader {
    pub fn encode(&self) -> [u8; BASE_HEADER_BYTES] {
        let mut b = [0u8; BASE_HEADER_BYTES];
        b[0..8].copy_from_slice(&BASE_MAGIC);
        b[8..12].copy_from_slice(&self.page_size.to_le_bytes());
        b[12..16].copy_from_slice(&self.page_count.to_le_bytes());
        b[16..24].copy_from_slice(&self.epoch.0.to_le_bytes());
        b[24..32].copy_from_slice(&self.generation.to_le_bytes());
        b[32..40].copy_from_slice(&self.seq.to_le_bytes());
        b[40..48].copy_from_slice(&self.observed_ms.to_le_bytes());
        b[48..56].copy_from_slice(&self.wal_checksum.to_le_bytes());
        let crc = crc32c::crc32c(&b[..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<BaseHeader, BaseError> {
        if b.len() < BASE_HEADER_BYTES {
            return Err(BaseError::ShortHeader);
        }
        if b[0..8] != BASE_MAGIC {
            return Err(BaseError::Magic);
        }
        if crc32c::crc32c(&b[..60]) != le32(b, 60) {
            return Err(BaseError::HeaderCrc);
        }
        let h = BaseHeader {
            page_size: le32(b, 8),
            page_count: le32(b, 12),
            epoch: Epoch(le64(b, 16)),
            generation: le64(b, 24),
            seq: le64(b, 32),
            observed_ms: le64(b, 40),
            wal_checksum: le64(b, 48),
        };
        if !crate::wal::valid_page_size(h.page_size) {
            return Err(BaseError::PageSize(h.page_size));
        }
        if h.generation == 0 {
            return Err(BaseError::Generation);
        }
        Ok(h)
    }

    /// Bytes of the whole stream: header, pages, trailer.
    pub fn stream_bytes(&self) -> u64 {
        BASE_HEADER_BYTES as u64
            + self.page_count as u64 * self.page_size as u64
            + BASE_TRAILER_BYTES as u64
    }
}

/// The trailer that closes a base stream.
pub fn base_trailer(pages_crc: u32) -> [u8; BASE_TRAILER_BYTES] {
    let mut t = [0u8; BASE_TRAILER_BYTES];
    t[0..4].copy_from_slice(&pages_crc.to_le_bytes());
    t[4..8].copy_from_slice(&BASE_TRAILER_MAGIC);
    t
}

/// Check a trailer against the CRC of the pages received.
pub fn check_base_trailer(t: &[u8], pages_crc: u32) -> Result<(), BaseError> {
    if t.len() != BASE_TRAILER_BYTES || t[4..8] != BASE_TRAILER_MAGIC {
        return Err(BaseError::NoTrailer);
    }
    if le32(t, 0) != pages_crc {
        return Err(BaseError::PagesCrc);
    }
    Ok(())
}

/// What a receiver holds for one database.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Position {
    pub name: String,
    pub epoch: Epoch,
    /// 0 when there is no replica.
    pub generation: u64,
    pub seq: u64,
    /// The next part expected of transaction `seq + 1` (0 when none is pending).
    pub pending_part: u32,
    pub page_size: u32,
    pub pages: u32,
    /// The replica was promoted: only a base with a newer epoch starts a new one.
    pub promoted: bool,
    /// `wal_checksum` of the last transaction applied (or of the base).
    #[serde(default)]
    pub checksum: u64,
}

/// Machine-readable reason of a refusal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Code {
    Fenced,
    NeedsBase,
    Behind,
    BadRequest,
    Corrupt,
    TooLarge,
    Unauthorized,
    NotFound,
    Busy,
    StorageFull,
    Internal,
}

/// Every non-200 reply.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    /// A sentence for a person: what happened, to what, what to do.
    pub error: String,
    pub code: Code,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<Position>,
}

/// Query of `POST /v1/replicas/NAME/txns`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct TxnsQuery {
    pub epoch: u64,
    pub generation: u64,
    pub page_size: u32,
}

/// Query of `POST /v1/replicas/NAME/base` and `DELETE /v1/replicas/NAME`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct EpochQuery {
    pub epoch: u64,
    #[serde(default)]
    pub generation: u64,
}

/// Reply of `GET /v1/replicas`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReplicaList {
    pub replicas: Vec<Position>,
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("callers check lengths"))
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("callers check lengths"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body() -> Vec<u8> {
        let p1 = vec![1u8; 512];
        let p2 = vec![2u8; 512];
        let mut out = Vec::new();
        let h = RecordHeader {
            seq: 1,
            part: 0,
            last: true,
            commit_pages: 3,
            page_count: 2,
            observed_ms: 5,
            wal_checksum: 9,
        };
        encode_record(&mut out, &h, [(1, p1.as_slice()), (3, p2.as_slice())]);
        let h2 = RecordHeader {
            seq: 2,
            part: 0,
            last: false,
            commit_pages: 0,
            page_count: 0,
            observed_ms: 6,
            wal_checksum: 0,
        };
        encode_record(&mut out, &h2, []);
        out
    }

    #[test]
    fn records_round_trip() {
        let b = body();
        let r = decode_records(&b, 512).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].header.seq, 1);
        assert_eq!(r[0].pages[1].0, 3);
        assert_eq!(r[0].pages[1].1[0], 2);
        assert!(!r[1].header.last);
        assert_eq!(b.len(), record_bytes(512, 2) + record_bytes(512, 0));
    }

    // Guards against applying a damaged or cut body: any flipped byte or any truncation
    // must be refused as a whole, with the record named.
    #[test]
    fn any_damage_or_truncation_is_refused() {
        let b = body();
        for i in 0..b.len() {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            assert!(decode_records(&bad, 512).is_err(), "flip at {i} accepted");
        }
        for cut in 1..b.len() {
            if cut == record_bytes(512, 2) {
                continue; // a whole first record is a valid body
            }
            assert!(
                decode_records(&b[..cut], 512).is_err(),
                "cut at {cut} accepted"
            );
        }
        let e = decode_records(&b, 1024).unwrap_err();
        assert!(
            matches!(e, BodyError::Truncated { .. } | BodyError::Crc { .. }),
            "{e}"
        );
    }

    #[test]
    fn base_header_round_trips_and_damage_is_named() {
        let h = BaseHeader {
            page_size: 4096,
            page_count: 3,
            epoch: Epoch(2),
            generation: 9,
            seq: 0,
            observed_ms: 1,
            wal_checksum: 4,
        };
        let b = h.encode();
        assert_eq!(BaseHeader::decode(&b).unwrap(), h);
        let mut bad = b;
        bad[13] ^= 1;
        assert_eq!(BaseHeader::decode(&bad), Err(BaseError::HeaderCrc));
        assert!(BaseError::HeaderCrc.to_string().contains("CRC32C"));
        assert!(check_base_trailer(&base_trailer(7), 7).is_ok());
        assert!(check_base_trailer(&base_trailer(7), 8).is_err());
        assert!(
            check_base_trailer(&[0; 3], 8)
                .unwrap_err()
                .to_string()
                .contains("cut short")
        );
    }
}
