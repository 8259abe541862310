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

/// Limits a replica enforces when it opens a message (TODO: wire helper fills in).
#[derive(Clone, Debug)]
pub struct Limits {
    /// Bytes of a frame as carried.
    pub frame_max: usize,
    /// Bytes of a body once decompressed.
    pub body_max: usize,
}

/// Why a replica refused a frame. Nothing was applied.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Refused {
    #[error("message refused: {0}")]
    Malformed(String),
}

/// Checks a frame's seal and decodes it. (Stub: the wire module implements it.)
pub fn open(_frame: &[u8], _seal_key: &[u8; 32], _limits: &Limits) -> Result<Down, Refused> {
    todo!("wire::open")
}
