//! The way up (docs/sync-up.md §4.2, §4.3): an [`Upload`], replica to server, and the
//! [`Filed`] that answers it.
//!
//! One lane's turn, step by step:
//! 1. The replica reads its noted rows as they are now into table parts, gives the upload
//!    an id above its last (docs/sync-up.md §3.2), and encodes it ([`encode_upload`]).
//! 2. The server reads it ([`decode_upload`]), files the rows under the replica the
//!    transport authenticated, and answers ([`encode_filed`]): the id, its filing count for
//!    that replica, and the rows it refused for good, sealed with the replica's seal key.
//! 3. The replica opens the answer ([`open_filed`]); only a `Filed` whose seal checks may
//!    make it forget the notes it sent under that id.
//!
//! Nothing here is persisted and nothing does I/O. A crash between two steps loses
//! nothing: the notes stay until the replica commits step 3, and filing the same rows
//! again changes nothing (docs/sync-up.md §8).
//!
//! An upload (integers big-endian, varints as in [`crate::value`]):
//! 1. 4 bytes: the magic `FSW1` ([`MAGIC_UPLOAD`]).
//! 2. 2 bytes: the protocol ([`PROTOCOL`]); a later one is [`Refused::LaterProtocol`].
//! 3. 2 bytes: flags; bit 0 restated (journal entries sent again after the server lost
//!    filings, docs/sync-up.md §3.3); bit 1 the body is zstd-compressed (over
//!    [`COMPRESS_ABOVE_BYTES`](super::COMPRESS_ABOVE_BYTES) and only when smaller); the
//!    other bits 0.
//! 4. 8 bytes: the upload id, never 0, above the replica's earlier ones.
//! 5. 8 bytes: the last filing count a `Filed` told the replica (0: none yet).
//! 6. The lane's name, as a table name: varint length, then 1..=[`NAME_BYTES_MAX`](super::NAME_BYTES_MAX) bytes
//!    of UTF-8 without NUL.
//! 7. A body (`wire/body.rs`): one part per table, its columns as the replica has them,
//!    deletes (keys) and upserts (rows as they are now). No part has flags (no sweep, and
//!    no table to create), and the parts together hold at most [`UPLOAD_ROWS_MAX`] rows.
//! 8. Nothing after; at most [`UPLOAD_BYTES_MAX`] bytes in all, and the body at most that
//!    once decompressed.
//!
//! A `Filed`:
//! 1. 4 bytes: the magic `FSF1` ([`MAGIC_FILED`]).
//! 2. 2 bytes: the protocol, as in an upload.
//! 3. 2 bytes: flags; bit 0, a list of dropped rows follows the refused ones; bit 1, the
//!    upload was stale (8 bytes, the newest id filed, follow the lists); others 0.
//! 4. 8 bytes: the id of the upload it answers, never 0.
//! 5. 8 bytes: the server's filing count for this replica after this filing.
//! 6. 8 bytes: refile after: 0, or the count the server had when the upload showed it lost
//!    filings; the replica uploads its journal's entries above it again.
//! 7. A varint count of refused rows, at most [`FILED_REFUSED_MAX`]; each as a rejection
//!    in a report, without its seq: the table (as a table name), a varint count of key
//!    values (1..=[`COLUMNS_MAX`]) and the values, and the reason (varint length, at most
//!    [`REASON_BYTES_MAX`] bytes of UTF-8; the server cuts longer ones).
//! 8. Only with flag bit 0: a varint count of dropped rows, laid out as refused rows:
//!    edits of a two-way table's row the replica no longer holds on the server's side (it
//!    was deleted or taken back). The refused and dropped rows together are at most
//!    [`FILED_REFUSED_MAX`].
//! 9. 16 bytes: the seal, the first 16 bytes of HMAC-SHA256 keyed by the replica's seal
//!    key over `ferry-sync filed`, the replica's 16-byte id and every byte above.
//! 10. Nothing after; at most [`FILED_BYTES_MAX`] bytes in all.
//!
//! [`open_filed`] checks the size, magic, protocol and flags, then the seal (in constant
//! time, [`Refused::BadFiledSeal`]), then the fields: a byte changed past the flags is
//! refused as a bad seal, whatever it breaks. The replica's id in the seal means a `Filed`
//! for one replica cannot make another forget, even under a shared token.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use super::body::{self, Carrier, check_lane_name, check_table_name, write_str};
use super::frame::check_protocol;
use super::reader::Reader;
use super::{
    COLUMNS_MAX, FILED_BYTES_MAX, FILED_REFUSED_MAX, Fault, PROTOCOL, REASON_BYTES_MAX, Refused,
    Rule, Sweep, TablePart, UPLOAD_BYTES_MAX, UPLOAD_ROWS_MAX,
};
use crate::value::{self, EncodeError, Value};

/// The first four bytes of every upload.
pub const MAGIC_UPLOAD: [u8; 4] = *b"FSW1";

/// The first four bytes of every `Filed`.
pub const MAGIC_FILED: [u8; 4] = *b"FSF1";

/// What a `Filed`'s seal covers first, so that no other message sealed with the same key
/// can pass for one; a new label is a new protocol.
const FILED_SEAL_LABEL: &[u8] = b"ferry-sync filed";

/// Upload flag bit 0: the rows are journal entries sent again.
const FLAG_RESTATED: u16 = 1;
/// Upload flag bit 1: the body is zstd-compressed (as a message down's, when it pays).
const FLAG_UPLOAD_ZSTD: u16 = 2;

/// `Filed` flag bit 0: a list of dropped rows follows the refused ones.
const FLAG_DROPPED: u16 = 1;
/// `Filed` flag bit 1: the upload was stale; the newest id filed follows the lists.
const FLAG_STALE: u16 = 2;

/// Offsets of the fixed fields both messages open with.
const AT_PROTOCOL: usize = 4;
const AT_FLAGS: usize = 6;

/// A `Filed`'s fixed fields: magic, protocol, flags, id, filing count, refile after.
const FILED_FIXED_BYTES: usize = 32;
const SEAL_BYTES: usize = 16;
/// The shortest `Filed`: its fixed fields, a count of 0 and the seal.
const FILED_BYTES_MIN: usize = FILED_FIXED_BYTES + 1 + SEAL_BYTES;
/// The smallest refused row, for bounding the count by the bytes that remain: a table
/// (2), a key count and one value (2), a reason (1).
const REFUSED_ROW_BYTES_MIN: usize = 5;

/// What a replica wrote to one lane's tables, replica to server.
#[derive(Clone, Debug, PartialEq)]
pub struct Upload {
    /// The rows are journal entries sent again because a `Filed` said the server lost
    /// filings (its "refile after").
    pub restated: bool,
    /// Never 0, and higher than every earlier upload of the replica's (a clock in
    /// microseconds, one past the last at least): the `Filed` that answers names it, the
    /// replica forgets only the notes it recorded under it, and the server answers an
    /// upload older than one it filed [`Filed::stale`].
    pub id: u64,
    /// The last filing count a `Filed` told the replica (0: none yet). One above the
    /// server's own tells it that it lost filings.
    pub filed_n: u64,
    /// The lane, 1..=[`NAME_BYTES_MAX`](super::NAME_BYTES_MAX) bytes without NUL.
    pub lane: String,
    /// One part per table, each with `writes: None` and no sweep; at most
    /// [`UPLOAD_ROWS_MAX`] upserts and deletes over all parts.
    pub parts: Vec<TablePart>,
}

/// The server's answer to an [`Upload`], server to replica.
#[derive(Clone, Debug, PartialEq)]
pub struct Filed {
    /// The id of the upload filed; never 0.
    pub id: u64,
    /// The server's filing count for this replica after this filing.
    pub filed_n: u64,
    /// 0, or the count the server had when the upload showed it lost filings: the replica
    /// uploads its journal's entries above it again.
    pub refile_after: u64,
    /// The rows refused for good, at most [`FILED_REFUSED_MAX`]; the replica sets them
    /// aside. Every other row of the upload was filed (or waits in the server's inbox),
    /// or dropped.
    pub refused: Vec<RefusedRow>,
    /// Edits of two-way rows the server no longer sends this replica (deleted, or taken
    /// back): not filed, and never will be (the server's side wins); the replica forgets
    /// them and counts them. With `refused`, at most [`FILED_REFUSED_MAX`].
    pub dropped: Vec<RefusedRow>,
    /// The upload was older than one the server filed from this replica, whose id this
    /// is (above `id`): nothing was filed and the count did not move (`refile_after` 0,
    /// no rows refused or dropped). The replica forgets nothing and sends the rows again
    /// under an id past this one (docs/sync-up.md §4.3).
    pub stale: Option<u64>,
}

/// A row of an upload the server refused for good, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct RefusedRow {
    pub table: String,
    /// The key's values, in key order; 1..=[`COLUMNS_MAX`] of them.
    pub key: Vec<Value>,
    /// At most [`REASON_BYTES_MAX`] bytes once encoded: [`encode_filed`] cuts it.
    pub reason: String,
}

/// Encodes an upload; refuses (naming the rule) what [`decode_upload`] would: an id of 0,
/// a lane a server refuses, a part with a sweep or `writes`, a part [`body::encode_body`]
/// refuses, more than [`UPLOAD_ROWS_MAX`] rows or more than [`UPLOAD_BYTES_MAX`] bytes.
/// The replica closes an upload within both limits, so either refusal is a bug in its
/// packing.
pub fn encode_upload(upload: &Upload) -> Result<Vec<u8>, EncodeError> {
    check_upload(upload)?;
    let body = body::encode_body(&upload.parts)?;
    // The server decompresses at most UPLOAD_BYTES_MAX: the bound holds for the body
    // as read, whatever it is carried as.
    if body.len() > UPLOAD_BYTES_MAX {
        return Err(upload_too_large(body.len()).into());
    }
    let (carried, compressed) = super::pack_body(body, super::COMPRESS_ABOVE_BYTES);
    let mut out = Vec::with_capacity(64 + carried.len());
    out.extend_from_slice(&MAGIC_UPLOAD);
    out.extend_from_slice(&PROTOCOL.to_be_bytes());
    let mut flags = if upload.restated { FLAG_RESTATED } else { 0 };
    if compressed {
        flags |= FLAG_UPLOAD_ZSTD;
    }
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&upload.id.to_be_bytes());
    out.extend_from_slice(&upload.filed_n.to_be_bytes());
    write_str(&upload.lane, &mut out);
    out.extend_from_slice(&carried);
    if out.len() > UPLOAD_BYTES_MAX {
        return Err(upload_too_large(out.len()).into());
    }
    Ok(out)
}

/// Decodes and checks an upload, refusing at the first failure: its size, magic,
/// protocol (a later one is [`Refused::LaterProtocol`]) and flags; an id of 0; the lane;
/// the body as a message down's, except that no part has flags and the rows stop at
/// [`UPLOAD_ROWS_MAX`] (refused before they are read); anything after it. Pure: a refusal
/// changes nothing.
pub fn decode_upload(bytes: &[u8]) -> Result<Upload, Refused> {
    if bytes.len() > UPLOAD_BYTES_MAX {
        return Err(upload_too_large(bytes.len()).into());
    }
    let mut reader = Reader::new(bytes, "upload");
    let flags = read_head(&mut reader, &MAGIC_UPLOAD, "upload")?;
    if flags & !(FLAG_RESTATED | FLAG_UPLOAD_ZSTD) != 0 {
        return Err(flags_fault(
            flags,
            "only bit 0 (restated) and bit 1 (compressed) for an upload",
        )
        .into());
    }
    let id = read_id(&mut reader)?;
    let filed_n = reader.u64("the filing count")?;
    let lane = reader.str("the lane name")?;
    check_lane_name(lane)?;
    let parts = if flags & FLAG_UPLOAD_ZSTD == 0 {
        let parts = body::read_body(&mut reader, Carrier::Upload)?;
        reader.finish()?;
        parts
    } else {
        let at = reader.at();
        let carried = reader.bytes(reader.remaining(), "the compressed body")?;
        let body = super::frame::unpack(
            carried,
            UPLOAD_BYTES_MAX,
            at,
            "over an upload's limit: the replica sends smaller uploads",
        )?;
        let mut inner = Reader::new(&body, "upload body");
        let parts = body::read_body(&mut inner, Carrier::Upload)?;
        inner.finish()?;
        parts
    };
    Ok(Upload {
        restated: flags & FLAG_RESTATED != 0,
        id,
        filed_n,
        lane: lane.to_string(),
        parts,
    })
}

/// Encodes a `Filed` and seals it for `replica` under its seal key (see the module doc).
/// Reasons longer than [`REASON_BYTES_MAX`] are cut at a character boundary.
///
/// Everything else comes from the upload the server decoded (its id, its tables and
/// keys, at most one refusal per row), so a `Filed` a replica would refuse is a bug in
/// the caller, and stops it here rather than reach a replica that would refuse it and
/// send the same upload forever.
pub fn encode_filed(filed: &Filed, seal_key: &[u8; 32], replica: &[u8; 16]) -> Vec<u8> {
    if let Err(fault) = check_filed(filed) {
        panic!(
            "encode_filed: the server built a Filed a replica refuses: {} [{}]",
            fault.detail, fault.rule
        );
    }
    let rows = filed.refused.len() + filed.dropped.len();
    let mut out = Vec::with_capacity(FILED_BYTES_MIN + 1 + 64 * rows);
    out.extend_from_slice(&MAGIC_FILED);
    out.extend_from_slice(&PROTOCOL.to_be_bytes());
    let mut flags = 0;
    if !filed.dropped.is_empty() {
        flags |= FLAG_DROPPED;
    }
    if filed.stale.is_some() {
        flags |= FLAG_STALE;
    }
    out.extend_from_slice(&flags.to_be_bytes());
    for field in [filed.id, filed.filed_n, filed.refile_after] {
        out.extend_from_slice(&field.to_be_bytes());
    }
    write_keyed_rows(&filed.refused, &mut out);
    if !filed.dropped.is_empty() {
        write_keyed_rows(&filed.dropped, &mut out);
    }
    if let Some(newest) = filed.stale {
        out.extend_from_slice(&newest.to_be_bytes());
    }
    assert!(
        out.len() + SEAL_BYTES <= FILED_BYTES_MAX,
        "encode_filed: a Filed of {} bytes is over FILED_BYTES_MAX ({FILED_BYTES_MAX}), so \
         its keys are larger than the upload it answers could hold",
        out.len() + SEAL_BYTES
    );
    let seal = filed_seal(seal_key, replica, &out);
    out.extend_from_slice(&seal);
    out
}

/// Checks a `Filed` and reads it, refusing at the first failure: its size ([`FILED_BYTES_MAX`]),
/// magic, protocol (a later one is [`Refused::LaterProtocol`]) and flags; the seal for
/// `replica` under `seal_key`, in constant time ([`Refused::BadFiledSeal`]); then an id of
/// 0, the refused rows within their limits, and anything between them and the seal. Pure:
/// a refusal changes nothing, and a `Filed` that passes the seal came from the server.
pub fn open_filed(bytes: &[u8], seal_key: &[u8; 32], replica: &[u8; 16]) -> Result<Filed, Refused> {
    if bytes.len() > FILED_BYTES_MAX {
        return Err(Fault::new(
            Rule::FiledTooLarge,
            format!(
                "the Filed is {} bytes, over {FILED_BYTES_MAX}: no answer to an upload is so \
                 large; nothing was forgotten, and the upload goes up again",
                bytes.len()
            ),
        )
        .into());
    }
    let flags = read_head(&mut Reader::new(bytes, "Filed"), &MAGIC_FILED, "Filed")?;
    if flags & !(FLAG_DROPPED | FLAG_STALE) != 0 {
        return Err(flags_fault(
            flags,
            "only bit 0 (dropped rows follow) and bit 1 (stale) for a Filed",
        )
        .into());
    }
    if bytes.len() < FILED_BYTES_MIN {
        return Err(Fault::new(
            Rule::Truncated,
            format!(
                "the Filed is {} bytes, shorter than the {FILED_BYTES_MIN} of its fixed \
                 fields, a count and its seal",
                bytes.len()
            ),
        )
        .into());
    }
    let (sealed, seal) = bytes.split_at(bytes.len() - SEAL_BYTES);
    if filed_mac(seal_key, replica)
        .chain_update(sealed)
        .verify_truncated_left(seal)
        .is_err()
    {
        return Err(Refused::BadFiledSeal);
    }
    let mut reader = Reader::new(sealed, "Filed");
    reader.bytes(AT_FLAGS + 2, "the magic, protocol and flags")?;
    let id = read_id(&mut reader)?;
    let filed_n = reader.u64("the filing count")?;
    let refile_after = reader.u64("refile after")?;
    let refused = read_refused_rows(&mut reader, "refused", FILED_REFUSED_MAX)?;
    let dropped = if flags & FLAG_DROPPED == 0 {
        Vec::new()
    } else {
        let at = reader.at();
        let dropped = read_refused_rows(&mut reader, "dropped", FILED_REFUSED_MAX - refused.len())?;
        if dropped.is_empty() {
            // One encoding per Filed: without dropped rows the flag is 0.
            return Err(Fault::new(
                Rule::RefusedRowsMax,
                format!(
                    "the dropped row count at byte {at} is 0, but flag bit 0 says dropped rows \
                     follow"
                ),
            )
            .into());
        }
        dropped
    };
    let stale = if flags & FLAG_STALE == 0 {
        None
    } else {
        Some(reader.u64("the newest upload filed")?)
    };
    let filed = Filed {
        id,
        filed_n,
        refile_after,
        refused,
        dropped,
        stale,
    };
    reader.finish()?;
    check_stale(&filed)?;
    Ok(filed)
}

/// The checks [`decode_upload`] makes of what is not the body; [`body::encode_body`]
/// makes the rest.
fn check_upload(upload: &Upload) -> Result<(), Fault> {
    if upload.id == 0 {
        return Err(Fault::new(
            Rule::UploadIdZero,
            "the upload id is 0; an id is random and never 0, so that 0 names no upload",
        ));
    }
    check_lane_name(&upload.lane)?;
    let mut rows = 0;
    for (index, part) in upload.parts.iter().enumerate() {
        if part.writes.is_some() || part.sweep != Sweep::default() {
            return Err(Fault::new(
                Rule::UploadPartFlags,
                format!(
                    "table part {} ({:?}) has writes {:?} and sweep {:?}; a part of an upload \
                     has neither: it carries rows a replica wrote, never a sweep or a table \
                     to create",
                    index + 1,
                    part.table,
                    part.writes,
                    part.sweep
                ),
            ));
        }
        rows += part.deletes.len() + part.upserts.len();
    }
    if rows > UPLOAD_ROWS_MAX {
        return Err(Fault::new(
            Rule::UploadRowsMax,
            format!(
                "the upload holds {rows} rows, over {UPLOAD_ROWS_MAX}: send the rest in \
                 another upload"
            ),
        ));
    }
    Ok(())
}

/// The checks [`open_filed`] makes that the encoder cannot meet by construction.
fn check_filed(filed: &Filed) -> Result<(), Fault> {
    if filed.id == 0 {
        return Err(Fault::new(
            Rule::UploadIdZero,
            "the upload id is 0, which names no upload",
        ));
    }
    check_stale(filed)?;
    if filed.refused.len() + filed.dropped.len() > FILED_REFUSED_MAX {
        return Err(Fault::new(
            Rule::RefusedRowsMax,
            format!(
                "it refuses {} rows and drops {}, over {FILED_REFUSED_MAX} together, one per \
                 row of the largest upload",
                filed.refused.len(),
                filed.dropped.len()
            ),
        ));
    }
    let rows = (filed.refused.iter().map(|r| ("refused", r)))
        .chain(filed.dropped.iter().map(|r| ("dropped", r)));
    for (index, (what, row)) in rows.enumerate() {
        let within = |f: Fault| f.within(format_args!("{what} row {}", index + 1));
        check_table_name(&row.table).map_err(within)?;
        if row.key.is_empty() || row.key.len() > COLUMNS_MAX {
            return Err(within(Fault::new(
                Rule::RejectionKeyLen,
                format!(
                    "its key has {} values; a key has 1..={COLUMNS_MAX}",
                    row.key.len()
                ),
            )));
        }
    }
    Ok(())
}

/// Reads the magic (which must be `magic`; `what` names the message) and the protocol,
/// and returns the flags for the caller to check.
fn read_head(reader: &mut Reader<'_>, magic: &[u8; 4], what: &str) -> Result<u16, Refused> {
    let found: [u8; 4] = reader.array("the magic")?;
    if found != *magic {
        return Err(Fault::new(
            Rule::Magic,
            format!(
                "the magic at byte 0 is \"{}\", not \"{}\": this is not a ferry-sync {what}",
                found.escape_ascii(),
                magic.escape_ascii()
            ),
        )
        .into());
    }
    check_protocol(reader.u16("the protocol")?, AT_PROTOCOL)?;
    Ok(reader.u16("the flags")?)
}

fn flags_fault(flags: u16, defined: &str) -> Fault {
    Fault::new(
        Rule::Flags,
        format!("the flags at byte {AT_FLAGS} are {flags:#06x}; protocol 1 defines {defined}"),
    )
}

fn read_id(reader: &mut Reader<'_>) -> Result<u64, Fault> {
    let at = reader.at();
    let id = reader.u64("the upload id")?;
    if id == 0 {
        return Err(Fault::new(
            Rule::UploadIdZero,
            format!("the upload id at byte {at} is 0; an id is random and never 0"),
        ));
    }
    Ok(id)
}

/// A stale answer files nothing: it refuses, drops and asks for nothing, and the newest
/// upload it names is newer than the one it answers.
fn check_stale(filed: &Filed) -> Result<(), Fault> {
    let Some(newest) = filed.stale else {
        return Ok(());
    };
    if newest <= filed.id {
        return Err(Fault::new(
            Rule::StaleNotOlder,
            format!(
                "it answers upload {} as stale, older than upload {newest}, which is not newer",
                filed.id
            ),
        ));
    }
    if !filed.refused.is_empty() || !filed.dropped.is_empty() || filed.refile_after != 0 {
        return Err(Fault::new(
            Rule::StaleNotOlder,
            "a stale answer files nothing, yet it refuses or drops rows or asks for the journal",
        ));
    }
    Ok(())
}

/// Reads a count of `what` ("refused" or "dropped") rows, at most `max`, and the rows.
fn read_refused_rows(
    reader: &mut Reader<'_>,
    what: &str,
    max: usize,
) -> Result<Vec<RefusedRow>, Fault> {
    let count_at = reader.at();
    let name = format!("the {what} row count");
    let count = reader.varint(&name)?;
    if count > max as u64 {
        return Err(Fault::new(
            Rule::RefusedRowsMax,
            format!(
                "{name} at byte {count_at} is {count}, over {max}: refused and dropped rows \
                 together are at most {FILED_REFUSED_MAX}, one per row of the largest upload"
            ),
        ));
    }
    let count = reader.count_checked(count, &name, REFUSED_ROW_BYTES_MIN, count_at)?;
    let mut rows = Vec::with_capacity(count);
    for number in 1..=count {
        let row =
            read_refused_row(reader).map_err(|f| f.within(format_args!("{what} row {number}")))?;
        rows.push(row);
    }
    Ok(rows)
}

/// Writes a count and the rows, each as a rejection in a report without its seq.
fn write_keyed_rows(rows: &[RefusedRow], out: &mut Vec<u8>) {
    value::encode_varint(rows.len() as u64, out);
    for row in rows {
        write_str(&row.table, out);
        value::encode_varint(row.key.len() as u64, out);
        for key_value in &row.key {
            value::write_value(key_value, out);
        }
        write_str(cut_reason(&row.reason), out);
    }
}

/// Reads one refused row, checked as a rejection in a report is.
fn read_refused_row(reader: &mut Reader<'_>) -> Result<RefusedRow, Fault> {
    let (table, key, reason) = super::up::read_keyed_reason(reader, "server")?;
    Ok(RefusedRow { table, key, reason })
}

fn upload_too_large(len: usize) -> Fault {
    Fault::new(
        Rule::UploadTooLarge,
        format!(
            "the upload is {len} bytes, over {UPLOAD_BYTES_MAX}: the replica must send fewer \
             rows at a time"
        ),
    )
}

/// `reason` cut to at most [`REASON_BYTES_MAX`] bytes, at a character boundary.
fn cut_reason(reason: &str) -> &str {
    let mut end = reason.len().min(REASON_BYTES_MAX);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

type HmacSha256 = Hmac<Sha256>;

/// The seal's MAC before the sealed bytes: keyed by the seal key, over the label and the
/// replica's id.
fn filed_mac(seal_key: &[u8; 32], replica: &[u8; 16]) -> HmacSha256 {
    <HmacSha256 as KeyInit>::new_from_slice(seal_key)
        .expect("HMAC takes keys of any length")
        .chain_update(FILED_SEAL_LABEL)
        .chain_update(replica)
}

fn filed_seal(seal_key: &[u8; 32], replica: &[u8; 16], sealed: &[u8]) -> [u8; 16] {
    let tag = filed_mac(seal_key, replica)
        .chain_update(sealed)
        .finalize()
        .into_bytes();
    tag[..SEAL_BYTES]
        .try_into()
        .expect("an HMAC-SHA256 tag is 32 bytes")
}
