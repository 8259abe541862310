//! Protocol v1: what travels between the server and a replica. `docs/sync.md`,
//! "Protocol", is the contract; this module is its only implementation.
//!
//! Down, a replica receives [`Down`] messages, one chain per replica: each names its
//! predecessor by `(prev, prev_nonce)`, so a replica applies a message only if it follows
//! the last one it applied, or if it starts a chain (`prev == 0`, a full snapshot). Each
//! carries two tags:
//! - `seal`: HMAC-SHA256 (first 16 bytes) keyed by the replica's seal key, over the header
//!   and the SHA-256 of the body as carried. The replica checks it before anything else;
//!   a bad seal is refused and changes nothing.
//! - `stamp`: HMAC-SHA256 (first 16 bytes) keyed by the server's epoch secret, over the
//!   replica id, epoch, sequence, nonce and the body's hash. The replica cannot check it;
//!   it echoes it in its confirmation, which proves to the server that this installation
//!   issued the message (and lets a restored server recognise a seal it has no record of).
//!
//! Up, a replica sends [`Up`] reports: what it applied last (echoing the stamp), gaps,
//! rejections and digests. The transport authenticates the replica; an `Up` is not sealed.
//!
//! A message down, step by step:
//! 1. The server encodes the tables' parts into a body ([`encode_body`]; layout in
//!    `wire/body.rs`) and packs it ([`pack_body`]): zstd level 3 when the body is over
//!    [`COMPRESS_ABOVE_BYTES`] and compressing makes it smaller.
//! 2. It hashes the body as carried ([`body_hash`]) and encodes one head per replica
//!    ([`encode_head`]): the stamp under the epoch secret, then the seal under that
//!    replica's seal key ([`seal_key`] of its token). A frame is head ‖ body, so one body
//!    is stored once and shared by every replica it goes to. [`encode_down`] does 1 and 2
//!    for one replica.
//! 3. The replica opens the frame ([`open`]): sizes and fixed fields, the seal, the body's
//!    hash, the chain fields, decompression bounded by [`Limits::body_max`], then the
//!    body. Every check refuses with a [`Refused`] that names the field and offset; open
//!    is pure, so a refusal changes nothing.
//! 4. The replica applies the parts (not here) and reports [`Up`] ([`encode_up`]).
//! 5. The server reads the report ([`decode_up`]) and checks the echoed stamp
//!    ([`verify_stamp`]) before it believes the replica holds what the report says.
//!
//! The frame, big-endian, [`HEAD_LEN`] bytes of head then the body:
//!
//! | offset | bytes | field |
//! |---|---|---|
//! | 0 | 4 | magic `FSD1` |
//! | 4 | 2 | protocol ([`PROTOCOL`]) |
//! | 6 | 1 | flags: bit 0 the body is zstd-compressed; the others 0 |
//! | 7 | 1 | reserved, 0 |
//! | 8 | 16 | replica |
//! | 24 | 16 | epoch |
//! | 40 | 8 | seq |
//! | 48 | 8 | nonce |
//! | 56 | 8 | prev |
//! | 64 | 8 | prev_nonce |
//! | 72 | 4 | body_len, bytes as carried |
//! | 76 | 32 | body_hash, SHA-256 of the body as carried |
//! | 108 | 16 | stamp |
//! | 124 | 16 | seal, over bytes 0..124 |
//! | 140 | body_len | body |
//!
//! The report up: magic `FSU1`, protocol u16, flags u8 = 0, reserved u8 = 0; applied
//! present (0 or 1), then if 1 epoch 16, seq u64, nonce u64, body_hash 32, stamp 16;
//! gap u64; a varint count of rejections, each table (varint length + UTF-8), a varint
//! count of key values and the values, reason (varint length + UTF-8), seq u64; a varint
//! count of digests, each table, rows u64, fingerprint u64. Nothing may follow.
//!
//! The way up (docs/sync-up.md §4): a replica sends what it wrote as an [`Upload`]
//! ([`encode_upload`], [`decode_upload`]): a lane's rows in a body as above, one part per
//! table; the server answers [`Filed`] ([`encode_filed`], [`open_filed`]), sealed with
//! the replica's seal key so that only the server can make a replica forget its notes.
//! Both layouts are in `wire/upload.rs`.
//!
//! Nothing here is persisted and nothing does I/O; decoding never panics on what a peer
//! sends, and never allocates more than the bytes it was given justify (counts are checked
//! against the bytes that remain) or, decompressing, more than `body_max`.

mod body;
mod frame;
mod reader;
mod up;
mod upload;

pub use body::{decode_body, encode_body};
pub use frame::{
    HEAD_LEN, MAGIC_DOWN, NONCE_MAX, body_hash, encode_down, encode_head, open, pack_body,
    seal_key, stamp, verify_stamp,
};
pub use up::{MAGIC_UP, decode_up, encode_up};
pub use upload::{
    Filed, MAGIC_FILED, MAGIC_UPLOAD, RefusedRow, Upload, decode_upload, encode_filed,
    encode_upload, open_filed,
};

use crate::value::{Affinity, Value};

/// The protocol number every message carries. A replica that receives a later one applies
/// nothing and waits for an upgrade; a change of meaning or a new part bumps it.
pub const PROTOCOL: u16 = 1;

/// Which replica, which installation, which place in the chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainHead {
    pub replica: [u8; 16],
    /// The server installation's epoch (a uuid); a restored server takes a new one.
    pub epoch: [u8; 16],
    /// 1, 2, 3, … within (replica, epoch); never 0.
    pub seq: u64,
    /// Random, 1..=2^63-1: tells a renumbering (restored server) from a redelivery.
    pub nonce: u64,
    /// The predecessor's seq, or 0 when this message starts a chain (a full snapshot).
    pub prev: u64,
    /// The predecessor's nonce, or 0 when `prev == 0`.
    pub prev_nonce: u64,
}

/// A column of a table part: name, affinity, nullability and place in the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Column {
    pub name: String,
    pub affinity: Affinity,
    pub not_null: bool,
    /// 0 when not part of the key; 1, 2, … for the key's parts in order.
    pub key_part: u8,
}

/// What a table part asks the replica to do with the rows it does not name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Sweep {
    /// Start remembering the keys this and later parts of the table name.
    pub start: bool,
    /// Delete (or retire) every row of the table no part named since `start`.
    pub end: bool,
}

/// One table's changes in a message. Every part carries its columns, so a replica can
/// create or widen the table from any part (replicas need no code).
#[derive(Clone, Debug, PartialEq)]
pub struct TablePart {
    /// The replica-side table name.
    pub table: String,
    pub columns: Vec<Column>,
    pub sweep: Sweep,
    /// Keys to delete: each holds the key parts' values, in key order.
    pub deletes: Vec<Vec<Value>>,
    /// Rows to insert or overwrite: each holds one value per column, in column order.
    pub upserts: Vec<Vec<Value>>,
    /// `Some` when the replica writes this table, or columns of it (docs/sync-up.md
    /// §4.1). Such a part only creates or widens the table; it has no sweep flags, deletes
    /// or upserts. Always `None` in an upload.
    pub writes: Option<Writes>,
}

/// What a part that announces a replica-written table says of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Writes {
    /// The lane (1..=[`NAME_BYTES_MAX`] bytes, no NUL) its writes go up in.
    pub lane: String,
    /// 0: the replica writes whole rows (a `record` table). Otherwise a two-way table:
    /// the server sends its rows, and the last `owned` columns of the part are the
    /// replica's (never key columns); the others are the server's.
    pub owned: usize,
    /// On a chain start the replica sends every row of the table again, and the server
    /// takes them whatever their version: settings and wish answers (docs/sync-up.md §7).
    pub restate: bool,
}

impl Writes {
    /// A `record` table's: whole rows, in `lane`.
    pub fn record(lane: impl Into<String>) -> Writes {
        Writes {
            lane: lane.into(),
            owned: 0,
            restate: false,
        }
    }
}

/// A message down, as decoded and checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Down {
    pub head: ChainHead,
    /// Tables in apply order (parents first). Deletes of all parts go first, children
    /// first (reverse order), then upserts, parents first.
    pub parts: Vec<TablePart>,
    /// The stamp to echo in the confirmation.
    pub stamp: [u8; 16],
    /// SHA-256 of the body as carried, which the stamp covers; echoed with it.
    pub body_hash: [u8; 32],
}

/// What a replica applied last, as the server must see it to verify the stamp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Applied {
    pub epoch: [u8; 16],
    pub seq: u64,
    pub nonce: u64,
    pub body_hash: [u8; 32],
    pub stamp: [u8; 16],
}

/// A row the replica refused to take, and why (its own constraint or trigger).
#[derive(Clone, Debug, PartialEq)]
pub struct Rejection {
    pub table: String,
    pub key: Vec<Value>,
    pub reason: String,
    pub seq: u64,
}

/// Count and content fingerprint of one table as the replica holds it after `seq`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Digest {
    pub table: String,
    pub rows: u64,
    pub fingerprint: u64,
}

/// A report up.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Up {
    /// The last message applied; `None` before the first.
    pub applied: Option<Applied>,
    /// The seq of a message that did not follow (0: none). The replica applies nothing
    /// more until a snapshot starts a chain.
    pub gap: u64,
    pub rejections: Vec<Rejection>,
    /// Sent only when the replica is at the end of its chain (nothing unapplied known).
    pub digests: Vec<Digest>,
}

/// Bytes of a frame as carried that a replica opens by default: 16 MiB. The server
/// closes a body at [`BODY_TARGET_BYTES`] (512 KiB), so an ordinary frame is 32 times
/// smaller; the rest is room for one oversized row, which packs alone. A larger frame is
/// refused (`frame-too-large`) and the server must send smaller ones.
pub const FRAME_BYTES_MAX: usize = 16 * 1024 * 1024;

/// Bytes of a body once decompressed that a replica takes by default: 64 MiB, four times
/// [`FRAME_BYTES_MAX`], so a full frame of text compressed 4:1 still opens, while a zip
/// bomb stops here (`body-too-large`) having allocated no more than this.
pub const BODY_BYTES_MAX: usize = 64 * 1024 * 1024;

/// Bytes the server packs into one body before it closes it: 512 KiB. With
/// [`ROWS_PER_MESSAGE_MAX`] rows that is 524 bytes a row; a replica applies a message in
/// one transaction, so this bounds how long a replica's writers wait on one message (a
/// few milliseconds of SQLite inserts) and what a redelivery costs. A single row larger
/// than this travels alone.
pub const BODY_TARGET_BYTES: usize = 512 * 1024;

/// Rows (upserts and deletes together) the server packs into one message: 1000. Narrow
/// rows (a few dozen bytes, 1000 rows being some 50 KiB) reach this before
/// [`BODY_TARGET_BYTES`]; it bounds a replica's transaction in rows as the target bounds
/// it in bytes.
pub const ROWS_PER_MESSAGE_MAX: usize = 1000;

/// Bodies of at most 4096 bytes travel uncompressed: zstd's frame costs some 10 bytes
/// and a compressor context (about 1 MiB at level 3) per call, which for a body of a few
/// rows saves less than the 140-byte head, while a body past one page of rows usually
/// halves. Above it the server compresses, and keeps the result only if smaller.
pub const COMPRESS_ABOVE_BYTES: usize = 4096;

/// Bytes of a report up that the server reads: 4 MiB. [`REJECTIONS_MAX`]
/// rejections fit if they average under 419 bytes (4 MiB / 10 000): a table name, a key
/// and a reason of a few hundred bytes. A replica with more to report trims its
/// rejections (they are reported again later); a larger report is refused (`up-too-large`).
pub const UP_BYTES_MAX: usize = 4 * 1024 * 1024;

/// Rejections in one report: 10 000, ten messages' worth of rows at
/// [`ROWS_PER_MESSAGE_MAX`]. More is refused (`rejections-max`).
pub const REJECTIONS_MAX: usize = 10_000;

/// Digests in one report, one per table: 1 000. A report at this limit is about 1000 ×
/// (64 + 16) = 80 KB, well within [`UP_BYTES_MAX`]. More is refused (`digests-max`).
pub const DIGESTS_MAX: usize = 1_000;

/// Bytes of an upload that the server reads: 1 MiB. With [`UPLOAD_ROWS_MAX`] rows that is
/// about 1 KiB a row; the replica closes an upload at whichever limit it reaches first.
/// The server files an upload in one transaction, so this bounds what one filing writes
/// and what a resend costs. A larger upload is refused (`upload-too-large`, HTTP 413); a
/// single row larger than this cannot go up, and the replica sets it aside
/// (docs/sync-up.md §3.2).
pub const UPLOAD_BYTES_MAX: usize = 1 << 20;

/// Rows (upserts and deletes together, over all parts) in one upload: 1 000, as
/// [`ROWS_PER_MESSAGE_MAX`] bounds a message down, so a filing transaction is as long as
/// an apply. More is refused (`upload-rows-max`) before anything is allocated for them.
pub const UPLOAD_ROWS_MAX: usize = 1_000;

/// Refused rows in one `Filed`: at most one per row of the upload it answers, so
/// [`UPLOAD_ROWS_MAX`]. More is refused (`refused-rows-max`).
pub const FILED_REFUSED_MAX: usize = UPLOAD_ROWS_MAX;

/// Bytes of a `Filed` that a replica reads: 3 MiB. Its refused rows repeat keys of the
/// upload it answers, at most [`UPLOAD_BYTES_MAX`] (1 MiB) of them, and each adds at most
/// a table name (1 + 63 bytes), a key count (2), a reason's length (2) and the reason
/// (1 024): 1 000 × 1 092 = 1 092 000 bytes; with 32 bytes of fixed fields, 2 of count
/// and 16 of seal, 2 140 626 bytes in all, some 2.04 MiB. A larger `Filed` is refused
/// (`filed-too-large`): the replica forgets nothing and sends the upload again.
pub const FILED_BYTES_MAX: usize = 3 << 20;

/// Bytes of a rejection's reason: 1024, enough for SQLite's constraint message; the
/// replica cuts longer ones at a character boundary. Longer is refused (`reason-len`).
pub const REASON_BYTES_MAX: usize = 1024;

/// Bytes of a table or column name: 63, Postgres's NAMEDATALEN less its NUL, so every
/// name a Postgres catalog holds fits and no replica name can be longer.
pub const NAME_BYTES_MAX: usize = 63;

/// Columns of a table part: 1000. Postgres allows 1600 and SQLite 2000 by default; 1000
/// leaves SQLite room for the replica's own bookkeeping columns. Also bounds a key.
pub const COLUMNS_MAX: usize = 1000;

/// Table names a replica keeps for itself (compared ignoring ASCII case): SQLite's own,
/// and ferry-sync's bookkeeping tables.
pub const RESERVED_TABLE_PREFIXES: [&str; 2] = ["sqlite_", "_ferry_sync"];

// An ordinary body and its head fit a frame twice over; the default body limit holds any
// frame's body even uncompressed; a report holds every digest.
const _: () = assert!(HEAD_LEN + 2 * BODY_TARGET_BYTES <= FRAME_BYTES_MAX);
const _: () = assert!(FRAME_BYTES_MAX <= BODY_BYTES_MAX);
const _: () = assert!(COMPRESS_ABOVE_BYTES < BODY_TARGET_BYTES);
const _: () = assert!(DIGESTS_MAX * (NAME_BYTES_MAX + 1 + 16) < UP_BYTES_MAX);
const _: () = assert!(COLUMNS_MAX <= u16::MAX as usize);
// A Filed holds a refusal of every row of the largest upload, each with the longest
// reason; the rows' count and a key's length fit two varint bytes.
const _: () = assert!(
    UPLOAD_BYTES_MAX + FILED_REFUSED_MAX * (1 + NAME_BYTES_MAX + 2 + 2 + REASON_BYTES_MAX) + 50
        <= FILED_BYTES_MAX
);
const _: () = assert!(FILED_REFUSED_MAX < 1 << 14 && COLUMNS_MAX < 1 << 14);

/// Limits a replica enforces when it opens a message; [`Limits::default`] holds the named
/// defaults. Checked before anything is allocated for the message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of a frame as carried (head included); default [`FRAME_BYTES_MAX`].
    pub frame_max: usize,
    /// Bytes of a body once decompressed; default [`BODY_BYTES_MAX`].
    pub body_max: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            frame_max: FRAME_BYTES_MAX,
            body_max: BODY_BYTES_MAX,
        }
    }
}

/// Why a message was refused. Nothing was taken from it: [`open`], [`decode_up`],
/// [`decode_upload`] and [`open_filed`] are pure. What the receiver does next depends on
/// the variant:
/// - [`Refused::LaterProtocol`]: wait for an upgrade; the message is fine for a newer side.
/// - [`Refused::BadSeal`], [`Refused::BadBody`]: damaged in transit or not meant for this
///   replica; wait for redelivery, and if every message is refused so, check the token.
/// - [`Refused::BadFiledSeal`]: a `Filed` damaged in transit or not meant for this
///   replica; forget nothing, and send the upload again next turn.
/// - [`Refused::Malformed`]: the sender broke protocol v1 (a bug to report), or a size
///   limit of this side is below what the sender packs (raise the limit).
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum Refused {
    #[error(
        "message refused: it speaks protocol {0}, later than this side's protocol {PROTOCOL}; \
         nothing was taken from it: upgrade ferry here, and the message will be sent again"
    )]
    LaterProtocol(u16),
    #[error(
        "message refused: its seal (bytes 124..140) does not match this replica's seal key, \
         so it was sealed for another token or damaged in transit; nothing was applied: if \
         every message is refused so, check that the replica's token is the server's"
    )]
    BadSeal,
    #[error(
        "message refused: its body does not hash to the body_hash (bytes 76..108) its seal \
         covers, so it was damaged in transit; nothing was applied: it will be sent again"
    )]
    BadBody,
    #[error(
        "Filed refused: its seal (its last 16 bytes) does not match this replica's seal key \
         and id, so it was sealed for another replica or token, or damaged in transit; no \
         note was forgotten: the upload goes up again next turn; if every Filed is refused \
         so, check that the replica's token is the server's"
    )]
    BadFiledSeal,
    #[error("message refused: {detail} [{rule}]; nothing was taken from it")]
    Malformed { rule: Rule, detail: String },
}

impl Refused {
    /// A short stable name for the refusal: the rule's name for [`Refused::Malformed`],
    /// `later-protocol`, `bad-seal`, `bad-body` or `bad-filed-seal` otherwise. The malformed corpus
    /// (`tests/golden/malformed.txt`) names its expected refusals so.
    pub fn kind(&self) -> &'static str {
        match self {
            Refused::LaterProtocol(_) => "later-protocol",
            Refused::BadSeal => "bad-seal",
            Refused::BadBody => "bad-body",
            Refused::BadFiledSeal => "bad-filed-seal",
            Refused::Malformed { rule, .. } => rule.name(),
        }
    }
}

/// The rules of protocol v1 a message can break, one per check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rule {
    /// A frame shorter than [`HEAD_LEN`].
    FrameShort,
    /// Not `FSD1` (down), `FSU1` (report up), `FSW1` (upload) or `FSF1` (`Filed`).
    Magic,
    /// Protocol 0, which no side ever spoke.
    ProtocolZero,
    /// A flag bit protocol v1 does not define.
    Flags,
    /// The reserved byte is not 0.
    Reserved,
    /// `body_len` is not the number of bytes after the head.
    BodyLen,
    /// A frame over [`Limits::frame_max`].
    FrameTooLarge,
    /// `seq` is 0.
    SeqZero,
    /// A nonce outside 1..=[`NONCE_MAX`].
    NonceRange,
    /// `prev` is not below `seq`.
    PrevNotBeforeSeq,
    /// Exactly one of `prev` and `prev_nonce` is 0.
    PrevNoncePair,
    /// `prev_nonce` over [`NONCE_MAX`].
    PrevNonceRange,
    /// A compressed body zstd cannot decompress.
    Zstd,
    /// A body over [`Limits::body_max`] once decompressed.
    BodyTooLarge,
    /// The bytes end inside a field.
    Truncated,
    /// A varint with a last byte of 0 after its first.
    VarintOverlong,
    /// A varint of more than 10 bytes or past `u64::MAX`.
    VarintOverflow,
    /// A value tag other than 0..=4.
    ValueTag,
    /// A name or text that is not UTF-8.
    NotUtf8,
    /// A real value that is NaN.
    RealNan,
    /// A part flag bit other than sweep start (bit 0), sweep end (bit 1), the replica
    /// writes the table (bit 2), two-way (bit 3) and restate (bit 4).
    SweepFlags,
    /// A table name of 0 or more than [`NAME_BYTES_MAX`] bytes.
    TableNameLen,
    /// A table, column or lane name holding a NUL.
    NameNul,
    /// A table name starting with one of [`RESERVED_TABLE_PREFIXES`].
    TableNameReserved,
    /// 0 or more than [`COLUMNS_MAX`] columns.
    ColumnCount,
    /// A column name of 0 or more than [`NAME_BYTES_MAX`] bytes.
    ColumnNameLen,
    /// Two columns whose names differ only in ASCII case, or not at all.
    ColumnNameDuplicate,
    /// An affinity byte other than 1..=4.
    Affinity,
    /// A not_null byte other than 0 or 1.
    NotNullByte,
    /// A table part whose columns have no key part.
    NoKey,
    /// Two columns with the same key part.
    KeyPartDuplicate,
    /// A key part past the number of key columns (so some lower part is missing).
    KeyPartGap,
    /// A Null in a not_null column.
    NullInNotNull,
    /// A count larger than the bytes that remain could hold.
    CountExceedsBytes,
    /// Bytes after the end of the message.
    TrailingBytes,
    /// A report over [`UP_BYTES_MAX`].
    UpTooLarge,
    /// An applied-present byte other than 0 or 1.
    AppliedByte,
    /// More than [`REJECTIONS_MAX`] rejections.
    RejectionsMax,
    /// More than [`DIGESTS_MAX`] digests.
    DigestsMax,
    /// A reason over [`REASON_BYTES_MAX`] bytes.
    ReasonLen,
    /// A rejection's or refused row's key of 0 or more than [`COLUMNS_MAX`] values.
    RejectionKeyLen,
    /// A part that says the replica writes its table (flag bit 2) with a sweep flag, a
    /// delete or an upsert; two-way (bit 3) or restate (bit 4) without bit 2; or a count of the replica's
    /// columns that is 0, not below the column count, or takes in a key column.
    ReplicaWrittenPart,
    /// A lane name of 0 or more than [`NAME_BYTES_MAX`] bytes.
    LaneNameLen,
    /// An upload over [`UPLOAD_BYTES_MAX`].
    UploadTooLarge,
    /// An upload id of 0, in an upload or the `Filed` answering it.
    UploadIdZero,
    /// A part of an upload with any part flag (a sweep, or the replica writes the table).
    UploadPartFlags,
    /// An upload of more than [`UPLOAD_ROWS_MAX`] rows.
    UploadRowsMax,
    /// A `Filed` over [`FILED_BYTES_MAX`].
    FiledTooLarge,
    /// A stale `Filed` whose newest upload is not newer than the one it answers, or that
    /// refuses, drops or asks for something (a stale answer files nothing).
    StaleNotOlder,
    /// A `Filed` with more than [`FILED_REFUSED_MAX`] refused and dropped rows together,
    /// or flag bit 0 (dropped rows follow) with none.
    RefusedRowsMax,
}

impl Rule {
    /// Every rule, for tests that check a corpus covers them all.
    pub const ALL: [Rule; 50] = [
        Rule::FrameShort,
        Rule::Magic,
        Rule::ProtocolZero,
        Rule::Flags,
        Rule::Reserved,
        Rule::BodyLen,
        Rule::FrameTooLarge,
        Rule::SeqZero,
        Rule::NonceRange,
        Rule::PrevNotBeforeSeq,
        Rule::PrevNoncePair,
        Rule::PrevNonceRange,
        Rule::Zstd,
        Rule::BodyTooLarge,
        Rule::Truncated,
        Rule::VarintOverlong,
        Rule::VarintOverflow,
        Rule::ValueTag,
        Rule::NotUtf8,
        Rule::RealNan,
        Rule::SweepFlags,
        Rule::TableNameLen,
        Rule::NameNul,
        Rule::TableNameReserved,
        Rule::ColumnCount,
        Rule::ColumnNameLen,
        Rule::ColumnNameDuplicate,
        Rule::Affinity,
        Rule::NotNullByte,
        Rule::NoKey,
        Rule::KeyPartDuplicate,
        Rule::KeyPartGap,
        Rule::NullInNotNull,
        Rule::CountExceedsBytes,
        Rule::TrailingBytes,
        Rule::UpTooLarge,
        Rule::AppliedByte,
        Rule::RejectionsMax,
        Rule::DigestsMax,
        Rule::ReasonLen,
        Rule::RejectionKeyLen,
        Rule::ReplicaWrittenPart,
        Rule::LaneNameLen,
        Rule::UploadTooLarge,
        Rule::UploadIdZero,
        Rule::UploadPartFlags,
        Rule::UploadRowsMax,
        Rule::FiledTooLarge,
        Rule::RefusedRowsMax,
        Rule::StaleNotOlder,
    ];

    /// The rule's stable name (kebab case), as [`Refused::kind`] gives it.
    pub fn name(self) -> &'static str {
        match self {
            Rule::FrameShort => "frame-short",
            Rule::Magic => "magic",
            Rule::ProtocolZero => "protocol-zero",
            Rule::Flags => "flags",
            Rule::Reserved => "reserved",
            Rule::BodyLen => "body-len",
            Rule::FrameTooLarge => "frame-too-large",
            Rule::SeqZero => "seq-zero",
            Rule::NonceRange => "nonce-range",
            Rule::PrevNotBeforeSeq => "prev-not-before-seq",
            Rule::PrevNoncePair => "prev-nonce-pair",
            Rule::PrevNonceRange => "prev-nonce-range",
            Rule::Zstd => "zstd",
            Rule::BodyTooLarge => "body-too-large",
            Rule::Truncated => "truncated",
            Rule::VarintOverlong => "varint-overlong",
            Rule::VarintOverflow => "varint-overflow",
            Rule::ValueTag => "value-tag",
            Rule::NotUtf8 => "not-utf8",
            Rule::RealNan => "real-nan",
            Rule::SweepFlags => "sweep-flags",
            Rule::TableNameLen => "table-name-len",
            Rule::NameNul => "name-nul",
            Rule::TableNameReserved => "table-name-reserved",
            Rule::ColumnCount => "column-count",
            Rule::ColumnNameLen => "column-name-len",
            Rule::ColumnNameDuplicate => "column-name-duplicate",
            Rule::Affinity => "affinity",
            Rule::NotNullByte => "not-null-byte",
            Rule::NoKey => "no-key",
            Rule::KeyPartDuplicate => "key-part-duplicate",
            Rule::KeyPartGap => "key-part-gap",
            Rule::NullInNotNull => "null-in-not-null",
            Rule::CountExceedsBytes => "count-exceeds-bytes",
            Rule::TrailingBytes => "trailing-bytes",
            Rule::UpTooLarge => "up-too-large",
            Rule::AppliedByte => "applied-byte",
            Rule::RejectionsMax => "rejections-max",
            Rule::DigestsMax => "digests-max",
            Rule::ReasonLen => "reason-len",
            Rule::RejectionKeyLen => "rejection-key-len",
            Rule::ReplicaWrittenPart => "replica-written-part",
            Rule::LaneNameLen => "lane-name-len",
            Rule::UploadTooLarge => "upload-too-large",
            Rule::UploadIdZero => "upload-id-zero",
            Rule::UploadPartFlags => "upload-part-flags",
            Rule::UploadRowsMax => "upload-rows-max",
            Rule::FiledTooLarge => "filed-too-large",
            Rule::RefusedRowsMax => "refused-rows-max",
            Rule::StaleNotOlder => "stale-not-older",
        }
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A broken rule and where, before it becomes a [`Refused`] or an
/// [`crate::value::EncodeError`]; decoding adds context as the error travels out.
#[derive(Debug)]
pub(crate) struct Fault {
    pub(crate) rule: Rule,
    pub(crate) detail: String,
}

impl Fault {
    pub(crate) fn new(rule: Rule, detail: impl Into<String>) -> Fault {
        Fault {
            rule,
            detail: detail.into(),
        }
    }

    /// Prefixes the detail with where it happened ("table part 2 (\"orders\")").
    pub(crate) fn within(self, context: impl std::fmt::Display) -> Fault {
        Fault {
            rule: self.rule,
            detail: format!("{context}: {}", self.detail),
        }
    }
}

impl From<Fault> for Refused {
    fn from(fault: Fault) -> Refused {
        Refused::Malformed {
            rule: fault.rule,
            detail: fault.detail,
        }
    }
}

impl From<Fault> for crate::value::EncodeError {
    fn from(fault: Fault) -> crate::value::EncodeError {
        crate::value::EncodeError::Invalid {
            rule: fault.rule.name(),
            detail: fault.detail,
        }
    }
}
