//! The report up, replica to server; the layout is in the module doc of [`crate::wire`].
//! Encoding is the replica's (it keeps within the limits: at most [`REJECTIONS_MAX`]
//! rejections and [`DIGESTS_MAX`] digests, reasons cut to [`REASON_BYTES_MAX`] bytes);
//! decoding is the server's, and refuses whatever breaks them.

use super::body::{check_table_name, write_str};
use super::frame::{NONCE_MAX, check_protocol};
use super::reader::Reader;
use super::{
    Applied, COLUMNS_MAX, DIGESTS_MAX, Digest, Fault, Limits, PROTOCOL, REASON_BYTES_MAX,
    REJECTIONS_MAX, Refused, Rejection, Rule, UP_BYTES_MAX, Up,
};
use crate::value;

/// The first four bytes of every report up.
pub const MAGIC_UP: [u8; 4] = *b"FSU1";

/// Smallest encodings, for bounding counts by the bytes that remain: a rejection is a
/// table (2), a key count and one value (2), a reason (1) and a seq (8); a digest is a
/// table (2) and two u64 (16).
const REJECTION_BYTES_MIN: usize = 13;
const DIGEST_BYTES_MIN: usize = 18;

/// Encodes a report. The replica keeps it within the limits the server enforces (see the
/// module doc); a key value that is NaN, which `Value` never holds, is written by its
/// bits and refused by the server.
pub fn encode_up(up: &Up) -> Vec<u8> {
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(&MAGIC_UP);
    out.extend_from_slice(&PROTOCOL.to_be_bytes());
    out.extend_from_slice(&[0, 0]);
    match &up.applied {
        None => out.push(0),
        Some(applied) => {
            out.push(1);
            out.extend_from_slice(&applied.epoch);
            out.extend_from_slice(&applied.seq.to_be_bytes());
            out.extend_from_slice(&applied.nonce.to_be_bytes());
            out.extend_from_slice(&applied.body_hash);
            out.extend_from_slice(&applied.stamp);
        }
    }
    out.extend_from_slice(&up.gap.to_be_bytes());
    value::encode_varint(up.rejections.len() as u64, &mut out);
    for rejection in &up.rejections {
        write_str(&rejection.table, &mut out);
        value::encode_varint(rejection.key.len() as u64, &mut out);
        for key_value in &rejection.key {
            value::write_value(key_value, &mut out);
        }
        write_str(&rejection.reason, &mut out);
        out.extend_from_slice(&rejection.seq.to_be_bytes());
    }
    value::encode_varint(up.digests.len() as u64, &mut out);
    for digest in &up.digests {
        write_str(&digest.table, &mut out);
        out.extend_from_slice(&digest.rows.to_be_bytes());
        out.extend_from_slice(&digest.fingerprint.to_be_bytes());
    }
    out
}

/// Decodes and checks a report: size ([`UP_BYTES_MAX`]), magic, protocol (a later one is
/// [`Refused::LaterProtocol`]), flags and reserved 0, the applied fields (seq >= 1, nonce
/// in 1..=2^63-1), the rejections and digests within their limits, nothing after.
///
/// `_limits` is the replica's frame limits, taken for symmetry with [`open`](super::open);
/// protocol v1 bounds a report by [`UP_BYTES_MAX`] alone.
pub fn decode_up(bytes: &[u8], _limits: &Limits) -> Result<Up, Refused> {
    if bytes.len() > UP_BYTES_MAX {
        return Err(Fault::new(
            Rule::UpTooLarge,
            format!(
                "the report is {} bytes, over {UP_BYTES_MAX}: the replica must report \
                 fewer rejections at a time",
                bytes.len()
            ),
        )
        .into());
    }
    let mut reader = Reader::new(bytes, "report");
    read_fixed(&mut reader)?;
    let applied = read_applied(&mut reader)?;
    let gap = reader.u64("the gap")?;
    let rejections = read_rejections(&mut reader)?;
    let digests = read_digests(&mut reader)?;
    reader.finish()?;
    Ok(Up {
        applied,
        gap,
        rejections,
        digests,
    })
}

fn read_fixed(reader: &mut Reader<'_>) -> Result<(), Refused> {
    let magic: [u8; 4] = reader.array("the magic")?;
    if magic != MAGIC_UP {
        return Err(Fault::new(
            Rule::Magic,
            format!(
                "the magic at byte 0 is \"{}\", not \"FSU1\": this is not a ferry-sync report",
                magic.escape_ascii()
            ),
        )
        .into());
    }
    check_protocol(reader.u16("the protocol")?, 4)?;
    let flags = reader.u8("the flags")?;
    if flags != 0 {
        return Err(Fault::new(
            Rule::Flags,
            format!("the flags at byte 6 are {flags:#04x}; protocol 1 defines none for reports"),
        )
        .into());
    }
    let reserved = reader.u8("the reserved byte")?;
    if reserved != 0 {
        return Err(Fault::new(
            Rule::Reserved,
            format!("the reserved byte at byte 7 is {reserved}, not 0"),
        )
        .into());
    }
    Ok(())
}

fn read_applied(reader: &mut Reader<'_>) -> Result<Option<Applied>, Fault> {
    let present_at = reader.at();
    match reader.u8("the applied-present byte")? {
        0 => return Ok(None),
        1 => {}
        other => {
            return Err(Fault::new(
                Rule::AppliedByte,
                format!("the applied-present byte at byte {present_at} is {other}; it is 0 or 1"),
            ));
        }
    }
    let epoch = reader.array("the applied epoch")?;
    let seq_at = reader.at();
    let seq = reader.u64("the applied seq")?;
    if seq == 0 {
        return Err(Fault::new(
            Rule::SeqZero,
            format!("the applied seq at byte {seq_at} is 0; a chain counts from 1"),
        ));
    }
    let nonce_at = reader.at();
    let nonce = reader.u64("the applied nonce")?;
    if nonce == 0 || nonce > NONCE_MAX {
        return Err(Fault::new(
            Rule::NonceRange,
            format!("the applied nonce at byte {nonce_at} is {nonce}, outside 1..=2^63-1"),
        ));
    }
    Ok(Some(Applied {
        epoch,
        seq,
        nonce,
        body_hash: reader.array("the applied body_hash")?,
        stamp: reader.array("the applied stamp")?,
    }))
}

fn read_rejections(reader: &mut Reader<'_>) -> Result<Vec<Rejection>, Fault> {
    let count_at = reader.at();
    let count = reader.varint("the rejection count")?;
    if count > REJECTIONS_MAX as u64 {
        return Err(Fault::new(
            Rule::RejectionsMax,
            format!(
                "the rejection count at byte {count_at} is {count}, over {REJECTIONS_MAX}: the \
                 replica must report the rest later"
            ),
        ));
    }
    let count =
        reader.count_checked(count, "the rejection count", REJECTION_BYTES_MIN, count_at)?;
    let mut rejections = Vec::with_capacity(count);
    for number in 1..=count {
        let rejection =
            read_rejection(reader).map_err(|f| f.within(format_args!("rejection {number}")))?;
        rejections.push(rejection);
    }
    Ok(rejections)
}

fn read_rejection(reader: &mut Reader<'_>) -> Result<Rejection, Fault> {
    let (table, key, reason) = read_keyed_reason(reader, "replica")?;
    Ok(Rejection {
        table,
        key,
        reason,
        seq: reader.u64("the seq")?,
    })
}

/// A row named with a reason, as rejections up and a `Filed`'s refused rows carry it:
/// the table, its key values (1..=[`COLUMNS_MAX`]) and the reason (at most
/// [`REASON_BYTES_MAX`] bytes, which `cutter`, the side that writes it, cuts to).
pub(super) fn read_keyed_reason(
    reader: &mut Reader<'_>,
    cutter: &str,
) -> Result<(String, Vec<value::Value>, String), Fault> {
    let table = reader.str("the table")?;
    check_table_name(table)?;
    let key_at = reader.at();
    let key_len = reader.varint("the key length")?;
    if key_len == 0 || key_len > COLUMNS_MAX as u64 {
        return Err(Fault::new(
            Rule::RejectionKeyLen,
            format!(
                "the key length at byte {key_at} is {key_len}; a key has 1..={COLUMNS_MAX} values"
            ),
        ));
    }
    let key_len = reader.count_checked(key_len, "the key length", 1, key_at)?;
    let mut key = Vec::with_capacity(key_len);
    for part in 1..=key_len {
        key.push(reader.value(&format!("key value {part}"))?);
    }
    let reason_at = reader.at();
    let reason = reader.str("the reason")?;
    if reason.len() > REASON_BYTES_MAX {
        return Err(Fault::new(
            Rule::ReasonLen,
            format!(
                "the reason at byte {reason_at} is {} bytes, over {REASON_BYTES_MAX}: the \
                 {cutter} cuts reasons to that",
                reason.len()
            ),
        ));
    }
    Ok((table.to_string(), key, reason.to_string()))
}

fn read_digests(reader: &mut Reader<'_>) -> Result<Vec<Digest>, Fault> {
    let count_at = reader.at();
    let count = reader.varint("the digest count")?;
    if count > DIGESTS_MAX as u64 {
        return Err(Fault::new(
            Rule::DigestsMax,
            format!(
                "the digest count at byte {count_at} is {count}, over {DIGESTS_MAX}, one per table"
            ),
        ));
    }
    let count = reader.count_checked(count, "the digest count", DIGEST_BYTES_MIN, count_at)?;
    let mut digests = Vec::with_capacity(count);
    for number in 1..=count {
        let within = |f: Fault| f.within(format_args!("digest {number}"));
        let table = reader.str("the table").map_err(within)?;
        check_table_name(table).map_err(within)?;
        digests.push(Digest {
            table: table.to_string(),
            rows: reader.u64("the rows").map_err(within)?,
            fingerprint: reader.u64("the fingerprint").map_err(within)?,
        });
    }
    Ok(digests)
}
