//! The frame of a message down: its head (fixed fields, stamp and seal), packing the
//! body, and [`open`], the replica's checks in order. The layout is in the module doc of
//! [`crate::wire`].

use std::borrow::Cow;
use std::io::Read as _;

use hmac::{Hmac, KeyInit, Mac};
use sha2::{Digest as _, Sha256};

use super::{
    Applied, ChainHead, Down, Limits, PROTOCOL, Refused, Rule, TablePart, body, reader::Reader,
};
use crate::value::EncodeError;

/// Bytes of a frame's head: 4 magic, 2 protocol, 1 flags, 1 reserved, 16 replica, 16
/// epoch, 4 × 8 chain fields, 4 body_len, 32 body_hash, 16 stamp, 16 seal.
pub const HEAD_LEN: usize = 140;

/// The first four bytes of every frame down.
pub const MAGIC_DOWN: [u8; 4] = *b"FSD1";

/// The largest nonce: 2^63 - 1, so a nonce fits a Postgres `bigint` where the server
/// keeps it, and 0 stays free to mean "no predecessor".
pub const NONCE_MAX: u64 = i64::MAX as u64;

/// What the seal key is derived with from a replica's token; a new derivation is a new
/// protocol.
const SEAL_KEY_LABEL: &[u8] = b"ferry-sync seal v1";

/// Flag bit 0: the body is zstd-compressed.
const FLAG_COMPRESSED: u8 = 1;

/// zstd's compression level for bodies: 3, its default, compresses rows of text some 3:1
/// at hundreds of MB/s; higher levels cost the server more than the link saves.
const ZSTD_LEVEL: i32 = 3;

/// The largest zstd window a replica accepts is the smallest power of two at least
/// `body_max`, and at least 2^20 (bodies of 512 KiB use a window of 2^19 to 2^21 at level
/// 3): so a hostile frame header cannot make the decoder reserve more than about twice
/// `body_max` for its window.
const ZSTD_WINDOW_LOG_MIN: u32 = 20;
/// zstd's own bound on the window (ZSTD_WINDOWLOG_MAX_64).
const ZSTD_WINDOW_LOG_MAX: u32 = 31;

/// Bytes read from the decompressor at a time while bounding the output by `body_max`.
const UNPACK_CHUNK_BYTES: usize = 64 * 1024;

/// Offsets of the head's fields (see the table in [`crate::wire`]).
const AT_PROTOCOL: usize = 4;
const AT_FLAGS: usize = 6;
const AT_RESERVED: usize = 7;
const AT_BODY_LEN: usize = 72;
const AT_BODY_HASH: usize = 76;
const AT_STAMP: usize = 108;
const AT_SEAL: usize = 124;

// The seal is the head's last field, and the fields above tile the head.
const _: () = assert!(AT_SEAL + 16 == HEAD_LEN);
const _: () = assert!(AT_STAMP + 16 == AT_SEAL && AT_BODY_HASH + 32 == AT_STAMP);

type HmacSha256 = Hmac<Sha256>;

/// A replica's seal key: HMAC-SHA256 keyed by its token over `ferry-sync seal v1`. The
/// server and the replica derive it alike; the token itself never keys a seal.
pub fn seal_key(token: &[u8]) -> [u8; 32] {
    let mut mac = hmac(token);
    mac.update(SEAL_KEY_LABEL);
    mac.finalize().into_bytes().into()
}

/// Packs a body for carrying: zstd at level 3 when it is longer than `compress_above`
/// bytes and compressing makes it smaller; otherwise the body itself. Returns the body as
/// carried and whether it is compressed.
pub fn pack_body(body: Vec<u8>, compress_above: usize) -> (Vec<u8>, bool) {
    if body.len() <= compress_above {
        return (body, false);
    }
    match zstd::bulk::compress(&body, ZSTD_LEVEL) {
        Ok(packed) if packed.len() < body.len() => (packed, true),
        // An error compressing an in-memory buffer is zstd's (out of memory); the body
        // still travels, uncompressed.
        _ => (body, false),
    }
}

/// SHA-256 of the body as carried, which the head carries and the stamp covers.
pub fn body_hash(carried: &[u8]) -> [u8; 32] {
    Sha256::digest(carried).into()
}

/// The stamp: the first 16 bytes of HMAC-SHA256 keyed by the epoch secret over
/// replica ‖ epoch ‖ seq ‖ nonce ‖ body_hash (integers big-endian).
pub fn stamp(
    secret: &[u8; 32],
    replica: &[u8; 16],
    epoch: &[u8; 16],
    seq: u64,
    nonce: u64,
    body_hash: &[u8; 32],
) -> [u8; 16] {
    let mac = stamp_mac(secret, replica, epoch, seq, nonce, body_hash);
    first_16(&mac.finalize().into_bytes())
}

/// Checks the stamp a replica echoes (constant time): true when this server's epoch
/// `secret` stamped a message for `replica` with these fields.
pub fn verify_stamp(secret: &[u8; 32], replica: &[u8; 16], applied: &Applied) -> bool {
    let mac = stamp_mac(
        secret,
        replica,
        &applied.epoch,
        applied.seq,
        applied.nonce,
        &applied.body_hash,
    );
    mac.verify_truncated_left(&applied.stamp).is_ok()
}

/// Encodes a head for one replica: the fixed fields, the stamp (returned too, for the
/// server to record) and the seal over all that precedes it. A frame is the head followed
/// by the body as carried (`body_len` bytes hashing to `body_hash`).
///
/// The chain fields are the server's own: one that breaks the rules [`open`] checks
/// (seq 0, a nonce out of range, `prev` not before `seq`, half a predecessor) is a bug in
/// the caller, and stops it here rather than reach a replica that would refuse it.
pub fn encode_head(
    head: &ChainHead,
    compressed: bool,
    body_len: u32,
    body_hash: &[u8; 32],
    secret: &[u8; 32],
    seal_key: &[u8; 32],
) -> ([u8; HEAD_LEN], [u8; 16]) {
    if let Err(fault) = check_chain(head) {
        panic!(
            "encode_head: the server built a chain head a replica refuses: {}",
            fault.detail
        );
    }
    let stamp = stamp(
        secret,
        &head.replica,
        &head.epoch,
        head.seq,
        head.nonce,
        body_hash,
    );
    let mut bytes = [0u8; HEAD_LEN];
    let mut at = 0;
    let mut put = |field: &[u8]| {
        bytes[at..at + field.len()].copy_from_slice(field);
        at += field.len();
    };
    put(&MAGIC_DOWN);
    put(&PROTOCOL.to_be_bytes());
    put(&[if compressed { FLAG_COMPRESSED } else { 0 }, 0]);
    put(&head.replica);
    put(&head.epoch);
    put(&head.seq.to_be_bytes());
    put(&head.nonce.to_be_bytes());
    put(&head.prev.to_be_bytes());
    put(&head.prev_nonce.to_be_bytes());
    put(&body_len.to_be_bytes());
    put(body_hash);
    put(&stamp);
    let seal = seal(seal_key, &bytes[..AT_SEAL]);
    bytes[AT_SEAL..].copy_from_slice(&seal);
    (bytes, stamp)
}

/// Encodes a whole frame for one replica: [`encode_body`](super::encode_body), then
/// [`pack_body`] above [`COMPRESS_ABOVE_BYTES`](super::COMPRESS_ABOVE_BYTES), then
/// [`encode_head`]. Returns the frame and its stamp. A server sending one body to many
/// replicas packs it once and calls [`encode_head`] per replica instead.
pub fn encode_down(
    head: &ChainHead,
    parts: &[TablePart],
    secret: &[u8; 32],
    seal_key: &[u8; 32],
) -> Result<(Vec<u8>, [u8; 16]), EncodeError> {
    let body = body::encode_body(parts)?;
    let (carried, compressed) = pack_body(body, super::COMPRESS_ABOVE_BYTES);
    let body_len = u32::try_from(carried.len()).map_err(|_| EncodeError::Invalid {
        rule: Rule::FrameTooLarge.name(),
        detail: format!(
            "a body of {} bytes as carried, past body_len's 4 GiB: split the message",
            carried.len()
        ),
    })?;
    let hash = body_hash(&carried);
    let (head_bytes, stamp) = encode_head(head, compressed, body_len, &hash, secret, seal_key);
    let mut frame = Vec::with_capacity(HEAD_LEN + carried.len());
    frame.extend_from_slice(&head_bytes);
    frame.extend_from_slice(&carried);
    Ok((frame, stamp))
}

/// Checks a frame and decodes it, in this order, refusing at the first failure:
/// 1. at least [`HEAD_LEN`] bytes; the magic; the protocol (a later one is
///    [`Refused::LaterProtocol`], 0 is malformed); the flags; the reserved byte;
/// 2. `body_len` is the length after the head, and the frame is within
///    `limits.frame_max`;
/// 3. the seal, in constant time ([`Refused::BadSeal`]);
/// 4. the body's SHA-256 against `body_hash` ([`Refused::BadBody`]);
/// 5. the chain fields: seq >= 1, nonce in 1..=[`NONCE_MAX`], prev < seq, prev and
///    prev_nonce both 0 or both not, prev_nonce <= [`NONCE_MAX`];
/// 6. decompression (when flagged), never producing more than `limits.body_max` bytes;
/// 7. the body ([`decode_body`](super::decode_body)).
///
/// Pure: a refusal changes nothing, and a frame that passes step 3 came from the server.
pub fn open(frame: &[u8], seal_key: &[u8; 32], limits: &Limits) -> Result<Down, Refused> {
    let compressed = check_fixed(frame, limits)?;
    let head_bytes = &frame[..HEAD_LEN];
    let carried = &frame[HEAD_LEN..];
    if hmac(seal_key)
        .chain_update(&head_bytes[..AT_SEAL])
        .verify_truncated_left(&head_bytes[AT_SEAL..])
        .is_err()
    {
        return Err(Refused::BadSeal);
    }
    let hash: [u8; 32] = field(head_bytes, AT_BODY_HASH);
    if body_hash(carried) != hash {
        return Err(Refused::BadBody);
    }
    let head = read_chain_head(head_bytes);
    check_chain(&head)?;
    const OVER: &str =
        "this replica's body_max: raise body_max or have the server pack smaller bodies";
    let body = if compressed {
        Cow::Owned(unpack(carried, limits.body_max, HEAD_LEN, OVER)?)
    } else if carried.len() > limits.body_max {
        return Err(body_too_large(carried.len(), limits.body_max, OVER).into());
    } else {
        Cow::Borrowed(carried)
    };
    let parts = body::decode_body(&body)?;
    Ok(Down {
        head,
        parts,
        stamp: field(head_bytes, AT_STAMP),
        body_hash: hash,
    })
}

/// Step 1 and 2 of [`open`]; returns whether the body is compressed.
fn check_fixed(frame: &[u8], limits: &Limits) -> Result<bool, Refused> {
    if frame.len() < HEAD_LEN {
        return Err(malformed(
            Rule::FrameShort,
            format!(
                "the frame is {} bytes, shorter than its {HEAD_LEN}-byte head",
                frame.len()
            ),
        ));
    }
    let mut reader = Reader::new(&frame[..HEAD_LEN], "frame");
    let magic: [u8; 4] = reader.array("the magic")?;
    if magic != MAGIC_DOWN {
        return Err(malformed(
            Rule::Magic,
            format!(
                "the magic at byte 0 is \"{}\", not \"FSD1\": this is not a ferry-sync message down",
                magic.escape_ascii()
            ),
        ));
    }
    check_protocol(reader.u16("the protocol")?, AT_PROTOCOL)?;
    let flags = reader.u8("the flags")?;
    if flags & !FLAG_COMPRESSED != 0 {
        return Err(malformed(
            Rule::Flags,
            format!(
                "the flags at byte {AT_FLAGS} are {flags:#04x}; protocol 1 defines only bit 0 (compressed)"
            ),
        ));
    }
    let reserved = reader.u8("the reserved byte")?;
    if reserved != 0 {
        return Err(malformed(
            Rule::Reserved,
            format!("the reserved byte at byte {AT_RESERVED} is {reserved}, not 0"),
        ));
    }
    let body_len = u32::from_be_bytes(field(frame, AT_BODY_LEN));
    let after_head = frame.len() - HEAD_LEN;
    if u64::from(body_len) != after_head as u64 {
        return Err(malformed(
            Rule::BodyLen,
            format!(
                "body_len at byte {AT_BODY_LEN} is {body_len}, but {after_head} bytes follow the head"
            ),
        ));
    }
    if frame.len() > limits.frame_max {
        return Err(malformed(
            Rule::FrameTooLarge,
            format!(
                "the frame is {} bytes, over this replica's frame_max of {}: raise frame_max or \
                 have the server pack smaller bodies",
                frame.len(),
                limits.frame_max
            ),
        ));
    }
    Ok(flags & FLAG_COMPRESSED != 0)
}

/// Refuses protocol 0 and (distinctly) a later protocol; `at` is the field's offset.
pub(super) fn check_protocol(protocol: u16, at: usize) -> Result<(), Refused> {
    if protocol == 0 {
        return Err(malformed(
            Rule::ProtocolZero,
            format!("the protocol at byte {at} is 0, which no side speaks"),
        ));
    }
    if protocol > PROTOCOL {
        return Err(Refused::LaterProtocol(protocol));
    }
    Ok(())
}

/// Step 5 of [`open`]: the chain fields' own rules (not whether they follow anything).
fn check_chain(head: &ChainHead) -> Result<(), super::Fault> {
    use super::Fault;
    if head.seq == 0 {
        return Err(Fault::new(
            Rule::SeqZero,
            "seq (byte 40) is 0; a chain counts from 1",
        ));
    }
    if head.nonce == 0 || head.nonce > NONCE_MAX {
        return Err(Fault::new(
            Rule::NonceRange,
            format!("nonce (byte 48) is {}, outside 1..=2^63-1", head.nonce),
        ));
    }
    if head.prev >= head.seq {
        return Err(Fault::new(
            Rule::PrevNotBeforeSeq,
            format!(
                "prev (byte 56) is {}, not before seq {}",
                head.prev, head.seq
            ),
        ));
    }
    if (head.prev == 0) != (head.prev_nonce == 0) {
        return Err(Fault::new(
            Rule::PrevNoncePair,
            format!(
                "prev (byte 56) is {} but prev_nonce (byte 64) is {}; both are 0 (a chain's \
                 start) or neither is",
                head.prev, head.prev_nonce
            ),
        ));
    }
    if head.prev_nonce > NONCE_MAX {
        return Err(Fault::new(
            Rule::PrevNonceRange,
            format!("prev_nonce (byte 64) is {}, over 2^63-1", head.prev_nonce),
        ));
    }
    Ok(())
}

/// Decompresses a body, refusing as soon as it would pass `body_max` bytes: the output
/// grows in chunks, never past `body_max`, and zstd's window is bounded (see
/// [`ZSTD_WINDOW_LOG_MIN`]), so a zip bomb costs at most about that much memory.
/// `at`: where the body starts, and `over`: what to do when it is too large, for the
/// refusal's words.
pub(super) fn unpack(
    carried: &[u8],
    body_max: usize,
    at: usize,
    over: &str,
) -> Result<Vec<u8>, Refused> {
    let zstd_error = |e: std::io::Error| {
        malformed(
            Rule::Zstd,
            format!(
                "the body (byte {at} on) is flagged compressed but zstd cannot decompress it: {e}"
            ),
        )
    };
    let mut decoder = zstd::stream::read::Decoder::with_buffer(carried).map_err(zstd_error)?;
    decoder
        .window_log_max(window_log(body_max))
        .map_err(zstd_error)?;
    let mut body = Vec::new();
    let mut chunk = vec![0u8; UNPACK_CHUNK_BYTES];
    loop {
        let read = match decoder.read(&mut chunk) {
            Ok(0) => return Ok(body),
            Ok(read) => read,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(zstd_error(e)),
        };
        let len = body.len() + read;
        if len > body_max {
            return Err(body_too_large(len, body_max, over).into());
        }
        if body.capacity() < len {
            // Double, as Vec would, but never past body_max.
            let target = len.max(body.capacity() * 2).min(body_max);
            body.reserve_exact(target - body.len());
        }
        body.extend_from_slice(&chunk[..read]);
    }
}

fn window_log(body_max: usize) -> u32 {
    let log = body_max.max(1).next_power_of_two().trailing_zeros();
    log.clamp(ZSTD_WINDOW_LOG_MIN, ZSTD_WINDOW_LOG_MAX)
}

fn body_too_large(len: usize, body_max: usize, over: &str) -> super::Fault {
    super::Fault::new(
        Rule::BodyTooLarge,
        format!("the body decompresses to more than {body_max} bytes (at least {len}), {over}"),
    )
}

fn read_chain_head(head: &[u8]) -> ChainHead {
    let u64_at = |at| u64::from_be_bytes(field(head, at));
    ChainHead {
        replica: field(head, 8),
        epoch: field(head, 24),
        seq: u64_at(40),
        nonce: u64_at(48),
        prev: u64_at(56),
        prev_nonce: u64_at(64),
    }
}

/// The `N` bytes at `at`; callers pass offsets inside the head, checked long enough.
fn field<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    bytes[at..at + N]
        .try_into()
        .expect("a head field lies inside the head")
}

fn seal(seal_key: &[u8; 32], head: &[u8]) -> [u8; 16] {
    first_16(&hmac(seal_key).chain_update(head).finalize().into_bytes())
}

fn stamp_mac(
    secret: &[u8; 32],
    replica: &[u8; 16],
    epoch: &[u8; 16],
    seq: u64,
    nonce: u64,
    body_hash: &[u8; 32],
) -> HmacSha256 {
    hmac(secret)
        .chain_update(replica)
        .chain_update(epoch)
        .chain_update(seq.to_be_bytes())
        .chain_update(nonce.to_be_bytes())
        .chain_update(body_hash)
}

fn hmac(key: &[u8]) -> HmacSha256 {
    <HmacSha256 as KeyInit>::new_from_slice(key).expect("HMAC takes keys of any length")
}

fn first_16(tag: &[u8]) -> [u8; 16] {
    tag[..16]
        .try_into()
        .expect("an HMAC-SHA256 tag is 32 bytes")
}

fn malformed(rule: Rule, detail: String) -> Refused {
    Refused::Malformed { rule, detail }
}
