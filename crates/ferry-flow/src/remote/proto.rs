//! Server mode's frames, protocol v1 (docs/flow-server.md §4): what a worker or a client
//! and the server say to each other, and the codec. Pure: no I/O, no clock.
//!
//! A frame on the wire is `u32 length ‖ u8 type ‖ u64 request id ‖ fields`, integers
//! big-endian, strings and byte strings as `u32 length ‖ bytes`, lists as `u32 count ‖
//! items`. Decoding is strict: a frame decodes only if [`encode`] would write exactly
//! those bytes for what it decodes to (no trailing bytes, booleans 0 or 1, known tags,
//! strings in UTF-8), so every frame has one encoding. Nothing is allocated for a
//! length before the bytes it announces are known to be there.

use ferry_core::{Class, Classify};

/// The protocol this build speaks (2: checkpoints are fetched, calls answered).
pub const PROTOCOL: u16 = 2;

/// The most a frame may hold after its length: a record of the largest payload with
/// room for the framing.
pub const FRAME_MAX: usize = (16 << 20) + 64;

/// A frame: the sender's request id (rising; 0 for frames nobody asked for) and what it
/// says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    pub id: u64,
    pub body: Body,
}

/// Who opens a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Holds shards and runs their workflows.
    Worker,
    /// Starts, signals, cancels and reads runs; never holds a shard.
    Client,
}

/// A shard a worker still holds when it reconnects (§8.1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resume {
    pub shard: u32,
    pub epoch: u64,
    /// Every record of the shard before this position is acknowledged durable.
    pub acked: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub role: Role,
    /// Random, kept across one worker's reconnects: what a resume is matched against.
    pub session: u128,
    /// The most shards to hold; 0: all.
    pub max_shards: u32,
    pub token: String,
    pub resume: Vec<Resume>,
    /// For people: the host and process, shown in the server's status.
    pub name: String,
}

/// A shard granted: its epoch, where its checkpoint stands and where its records end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Granted {
    pub shard: u32,
    pub epoch: u64,
    pub checkpoint: u64,
    pub end: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Welcome {
    pub version: u16,
    pub session: u128,
    /// How many shards the server's runs are spread over.
    pub shards: u32,
    pub lease_ms: u32,
    pub ping_ms: u32,
    pub stuck_ms: u32,
    /// The largest record the server takes.
    pub record_max: u32,
    /// Resumed shards first.
    pub grants: Vec<Granted>,
}

/// A shard thread's turn count, for liveness that means progress (§5.4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Turns {
    pub shard: u32,
    pub epoch: u64,
    pub turns: u64,
}

/// A shard the server still counts as the session's, at this epoch: what a `Pong`
/// confirms (docs/flow-server.md §5.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub shard: u32,
    pub epoch: u64,
}

/// One journal record: its ferry-log kind and bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rec {
    pub kind: u8,
    pub bytes: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Append {
    pub shard: u32,
    pub epoch: u64,
    /// The shard's position before the first record: record i ends at `first + i + 1`.
    pub first: u64,
    pub records: Vec<Rec>,
}

/// A page of a shard's records, answering `Recover`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Records {
    pub shard: u32,
    pub epoch: u64,
    /// The position before the first record of the page.
    pub first: u64,
    pub records: Vec<Rec>,
    /// No record follows this page (as of the server's durable end).
    pub last: bool,
}

/// Every record of `shard` before `position` is durable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPos {
    pub shard: u32,
    pub epoch: u64,
    pub position: u64,
}

/// What a call asks of a run (§9).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallKind {
    Start {
        workflow: String,
        id: String,
        input: Vec<u8>,
    },
    Signal {
        id: String,
        name: String,
        value: Vec<u8>,
    },
    Cancel {
        id: String,
    },
    Query {
        id: String,
    },
    /// The run's outcome once it finished, waiting up to `wait_ms` for it: answered by
    /// the server from its index of durable records, not forwarded (§10).
    Result {
        id: String,
        wait_ms: u32,
    },
}

impl CallKind {
    /// The run the call is about.
    pub fn run(&self) -> &str {
        match self {
            CallKind::Start { id, .. }
            | CallKind::Signal { id, .. }
            | CallKind::Cancel { id }
            | CallKind::Query { id }
            | CallKind::Result { id, .. } => id,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    pub kind: CallKind,
    /// What makes a second delivery a no-op: a start's run id, a signal's `signal_once` key.
    pub key: String,
}

/// How a call ended on the run's holder: its JSON answer, or the engine's error kind
/// (`FlowError::kind`) and message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok(Vec<u8>),
    Err { kind: String, message: String },
}

/// Why a shard is taken away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RevokeReason {
    /// The worker's pings stopped for a lease.
    Expired,
    /// The shard's thread stopped turning (§5.4).
    Stuck,
    /// It went to a worker with fewer shards (§8.3), past the drain's time.
    Rebalance,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Body {
    // Worker or client → server.
    Hello(Hello),
    Ping(Vec<Turns>),
    Append(Append),
    Release {
        shard: u32,
        epoch: u64,
        end: u64,
    },
    Recover {
        shard: u32,
        epoch: u64,
        from: u64,
        max_bytes: u32,
    },
    /// A chunk of the shard's checkpoint at `position` (0: the newest), from `offset`.
    Fetch {
        shard: u32,
        epoch: u64,
        position: u64,
        offset: u64,
        max_bytes: u32,
    },
    Call(Call),
    /// The outcome of the server's `Call` with request id `call`.
    Answer {
        call: u64,
        outcome: Outcome,
    },
    /// The holder parked run `run` of the shard it holds at `epoch` (its code does not
    /// replay its journal): the index shows it parked until the shard moves (§10).
    Parked {
        shard: u32,
        epoch: u64,
        run: String,
        reason: String,
    },
    // Server → worker or client.
    Welcome(Welcome),
    /// The answer to a `Ping`: the shards the server still counts as the session's.
    Pong(Vec<Held>),
    Grant(Vec<Granted>),
    Revoke {
        shard: u32,
        epoch: u64,
        reason: RevokeReason,
    },
    Drain {
        shard: u32,
        epoch: u64,
    },
    Durable(Vec<ShardPos>),
    Records(Records),
    /// A chunk of the checkpoint at `position` (0 and no bytes: the shard has none),
    /// from `offset`; `last` once it reaches the file's end.
    Checkpoint {
        shard: u32,
        epoch: u64,
        position: u64,
        offset: u64,
        bytes: Vec<u8>,
        last: bool,
    },
    Released {
        shard: u32,
        epoch: u64,
    },
    /// The refusal of request `to`.
    Refused {
        to: u64,
        refused: Refused,
    },
}

/// A typed refusal (docs/flow-server.md §4.3): never a string to parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("shard {shard} is held under epoch {held}: this worker's hold on it is over")]
    Stale { shard: u32, held: u64 },
    #[error("shard {shard} is not held by this session")]
    NotHeld { shard: u32 },
    #[error(
        "shard {shard}'s records end at {expected}: an append must start there; the shard stops and is recovered again"
    )]
    PositionGap { shard: u32, expected: u64 },
    #[error("a malformed frame ({what}); the connection is closed and nothing in it applied")]
    Malformed { what: String },
    #[error("over the limit of {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("no token, or a wrong one")]
    Unauthorized,
    #[error("the server speaks protocol {supported}")]
    Version { supported: u16 },
    #[error("the server cannot take this now; try again in {retry_after_ms} ms")]
    Unavailable { retry_after_ms: u32 },
    #[error("no worker holds shard {shard}")]
    NoHolder { shard: u32 },
}

impl Refused {
    /// The worker's hold on the shard is over: stop the shard and release nothing more.
    pub fn is_fenced(&self) -> bool {
        matches!(self, Refused::Stale { .. } | Refused::NotHeld { .. })
    }
}

impl Classify for Refused {
    fn class(&self) -> Class {
        match self {
            Refused::Unavailable { .. } | Refused::NoHolder { .. } => Class::Transient,
            Refused::Malformed { .. } => Class::Corrupted,
            _ => Class::Permanent,
        }
    }
}

/// Why bytes are not a frame: the field that broke.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what}")]
pub struct DecodeError {
    pub what: String,
}

fn bad(what: impl Into<String>) -> DecodeError {
    DecodeError { what: what.into() }
}

impl From<DecodeError> for Refused {
    fn from(e: DecodeError) -> Refused {
        Refused::Malformed { what: e.what }
    }
}

// ---- encoding --------------------------------------------------------------------------

struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    fn u128(&mut self, v: u128) {
        self.0.extend_from_slice(&v.to_be_bytes());
    }
    fn bool(&mut self, v: bool) {
        self.u8(u8::from(v));
    }
    fn len(&mut self, n: usize) {
        self.u32(u32::try_from(n).expect("a frame's parts are far below 4 GiB"));
    }
    fn bytes(&mut self, v: &[u8]) {
        self.len(v.len());
        self.0.extend_from_slice(v);
    }
    fn str(&mut self, v: &str) {
        self.bytes(v.as_bytes());
    }
    fn list<T>(&mut self, items: &[T], mut each: impl FnMut(&mut W, &T)) {
        self.len(items.len());
        for item in items {
            each(self, item);
        }
    }
    fn recs(&mut self, records: &[Rec]) {
        self.list(records, |w, r| {
            w.u8(r.kind);
            w.bytes(&r.bytes);
        });
    }
}

// The type byte of each body.
const HELLO: u8 = 1;
const PING: u8 = 2;
const APPEND: u8 = 3;
const RELEASE: u8 = 4;
const RECOVER: u8 = 5;
const CALL: u8 = 6;
const ANSWER: u8 = 7;
const FETCH: u8 = 8;
const PARKED: u8 = 9;
const WELCOME: u8 = 64;
const PONG: u8 = 65;
const GRANT: u8 = 66;
const REVOKE: u8 = 67;
const DRAIN: u8 = 68;
const DURABLE: u8 = 69;
const RECORDS: u8 = 70;
const RELEASED: u8 = 71;
const REFUSED: u8 = 72;
const CHECKPOINT: u8 = 73;

/// The frame's bytes on the wire, its length first.
pub fn encode(frame: &Frame) -> Vec<u8> {
    let mut w = W(Vec::with_capacity(64));
    w.u32(0); // the length, filled in below
    w.u8(type_of(&frame.body));
    w.u64(frame.id);
    fields(&mut w, &frame.body);
    let len = u32::try_from(w.0.len() - 4).expect("a frame is far below 4 GiB");
    w.0[..4].copy_from_slice(&len.to_be_bytes());
    w.0
}

fn type_of(body: &Body) -> u8 {
    match body {
        Body::Hello(_) => HELLO,
        Body::Ping(_) => PING,
        Body::Append(_) => APPEND,
        Body::Release { .. } => RELEASE,
        Body::Recover { .. } => RECOVER,
        Body::Fetch { .. } => FETCH,
        Body::Call(_) => CALL,
        Body::Answer { .. } => ANSWER,
        Body::Parked { .. } => PARKED,
        Body::Welcome(_) => WELCOME,
        Body::Pong(_) => PONG,
        Body::Grant(_) => GRANT,
        Body::Revoke { .. } => REVOKE,
        Body::Drain { .. } => DRAIN,
        Body::Durable(_) => DURABLE,
        Body::Records(_) => RECORDS,
        Body::Checkpoint { .. } => CHECKPOINT,
        Body::Released { .. } => RELEASED,
        Body::Refused { .. } => REFUSED,
    }
}

fn fields(w: &mut W, body: &Body) {
    match body {
        Body::Hello(h) => {
            w.u16(h.version);
            w.u8(match h.role {
                Role::Worker => 1,
                Role::Client => 2,
            });
            w.u128(h.session);
            w.u32(h.max_shards);
            w.str(&h.token);
            w.list(&h.resume, |w, r| {
                w.u32(r.shard);
                w.u64(r.epoch);
                w.u64(r.acked);
            });
            w.str(&h.name);
        }
        Body::Ping(turns) => w.list(turns, |w, t| {
            w.u32(t.shard);
            w.u64(t.epoch);
            w.u64(t.turns);
        }),
        Body::Append(a) => {
            w.u32(a.shard);
            w.u64(a.epoch);
            w.u64(a.first);
            w.recs(&a.records);
        }
        Body::Release { shard, epoch, end } => {
            w.u32(*shard);
            w.u64(*epoch);
            w.u64(*end);
        }
        Body::Fetch {
            shard,
            epoch,
            position,
            offset,
            max_bytes,
        } => {
            w.u32(*shard);
            w.u64(*epoch);
            w.u64(*position);
            w.u64(*offset);
            w.u32(*max_bytes);
        }
        Body::Checkpoint {
            shard,
            epoch,
            position,
            offset,
            bytes,
            last,
        } => {
            w.u32(*shard);
            w.u64(*epoch);
            w.u64(*position);
            w.u64(*offset);
            w.bytes(bytes);
            w.bool(*last);
        }
        Body::Recover {
            shard,
            epoch,
            from,
            max_bytes,
        } => {
            w.u32(*shard);
            w.u64(*epoch);
            w.u64(*from);
            w.u32(*max_bytes);
        }
        Body::Call(c) => {
            match &c.kind {
                CallKind::Start {
                    workflow,
                    id,
                    input,
                } => {
                    w.u8(1);
                    w.str(workflow);
                    w.str(id);
                    w.bytes(input);
                }
                CallKind::Signal { id, name, value } => {
                    w.u8(2);
                    w.str(id);
                    w.str(name);
                    w.bytes(value);
                }
                CallKind::Cancel { id } => {
                    w.u8(3);
                    w.str(id);
                }
                CallKind::Query { id } => {
                    w.u8(4);
                    w.str(id);
                }
                CallKind::Result { id, wait_ms } => {
                    w.u8(5);
                    w.str(id);
                    w.u32(*wait_ms);
                }
            }
            w.str(&c.key);
        }
        Body::Parked {
            shard,
            epoch,
            run,
            reason,
        } => {
            w.u32(*shard);
            w.u64(*epoch);
            w.str(run);
            w.str(reason);
        }
        Body::Answer { call, outcome } => {
            w.u64(*call);
            match outcome {
                Outcome::Ok(json) => {
                    w.u8(1);
                    w.bytes(json);
                }
                Outcome::Err { kind, message } => {
                    w.u8(2);
                    w.str(kind);
                    w.str(message);
                }
            }
        }
        Body::Welcome(wl) => {
            w.u16(wl.version);
            w.u128(wl.session);
            w.u32(wl.shards);
            w.u32(wl.lease_ms);
            w.u32(wl.ping_ms);
            w.u32(wl.stuck_ms);
            w.u32(wl.record_max);
            w.list(&wl.grants, granted);
        }
        Body::Pong(held) => w.list(held, |w, h| {
            w.u32(h.shard);
            w.u64(h.epoch);
        }),
        Body::Grant(grants) => w.list(grants, granted),
        Body::Revoke {
            shard,
            epoch,
            reason,
        } => {
            w.u32(*shard);
            w.u64(*epoch);
            w.u8(match reason {
                RevokeReason::Expired => 1,
                RevokeReason::Stuck => 2,
                RevokeReason::Rebalance => 3,
            });
        }
        Body::Drain { shard, epoch } | Body::Released { shard, epoch } => {
            w.u32(*shard);
            w.u64(*epoch);
        }
        Body::Durable(positions) => w.list(positions, |w, p| {
            w.u32(p.shard);
            w.u64(p.epoch);
            w.u64(p.position);
        }),
        Body::Records(r) => {
            w.u32(r.shard);
            w.u64(r.epoch);
            w.u64(r.first);
            w.recs(&r.records);
            w.bool(r.last);
        }
        Body::Refused { to, refused } => {
            w.u64(*to);
            refusal(w, refused);
        }
    }
}

fn granted(w: &mut W, g: &Granted) {
    w.u32(g.shard);
    w.u64(g.epoch);
    w.u64(g.checkpoint);
    w.u64(g.end);
}

fn refusal(w: &mut W, r: &Refused) {
    match r {
        Refused::Stale { shard, held } => {
            w.u16(1);
            w.u32(*shard);
            w.u64(*held);
        }
        Refused::NotHeld { shard } => {
            w.u16(2);
            w.u32(*shard);
        }
        Refused::PositionGap { shard, expected } => {
            w.u16(3);
            w.u32(*shard);
            w.u64(*expected);
        }
        Refused::Malformed { what } => {
            w.u16(4);
            w.str(what);
        }
        Refused::TooLarge { limit } => {
            w.u16(5);
            w.u64(*limit);
        }
        Refused::Unauthorized => w.u16(6),
        Refused::Version { supported } => {
            w.u16(7);
            w.u16(*supported);
        }
        Refused::Unavailable { retry_after_ms } => {
            w.u16(8);
            w.u32(*retry_after_ms);
        }
        Refused::NoHolder { shard } => {
            w.u16(9);
            w.u32(*shard);
        }
    }
}

// ---- decoding --------------------------------------------------------------------------

struct R<'a> {
    b: &'a [u8],
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        if self.b.len() < n {
            return Err(bad(format!(
                "{what}: {n} bytes needed, {} left",
                self.b.len()
            )));
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.take(2, what)?.try_into().unwrap()))
    }
    fn u32(&mut self, what: &str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn u128(&mut self, what: &str) -> Result<u128, DecodeError> {
        Ok(u128::from_be_bytes(
            self.take(16, what)?.try_into().unwrap(),
        ))
    }
    fn bool(&mut self, what: &str) -> Result<bool, DecodeError> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(bad(format!("{what}: {v} is neither 0 nor 1"))),
        }
    }
    fn bytes(&mut self, what: &str) -> Result<Vec<u8>, DecodeError> {
        let n = self.u32(what)? as usize;
        Ok(self.take(n, what)?.to_vec())
    }
    fn str(&mut self, what: &str) -> Result<String, DecodeError> {
        String::from_utf8(self.bytes(what)?).map_err(|_| bad(format!("{what}: not UTF-8")))
    }
    /// A list whose items take at least `min_item` bytes each: a count the remaining
    /// bytes cannot hold is refused before anything is allocated.
    fn list<T>(
        &mut self,
        what: &str,
        min_item: usize,
        mut each: impl FnMut(&mut R<'a>) -> Result<T, DecodeError>,
    ) -> Result<Vec<T>, DecodeError> {
        let n = self.u32(what)? as usize;
        if n.saturating_mul(min_item) > self.b.len() {
            return Err(bad(format!(
                "{what}: {n} items cannot fit in the {} bytes left",
                self.b.len()
            )));
        }
        let mut items = Vec::with_capacity(n);
        for _ in 0..n {
            items.push(each(self)?);
        }
        Ok(items)
    }
    fn recs(&mut self) -> Result<Vec<Rec>, DecodeError> {
        self.list("records", 5, |r| {
            Ok(Rec {
                kind: r.u8("a record's kind")?,
                bytes: r.bytes("a record's bytes")?,
            })
        })
    }
    fn granted(&mut self) -> Result<Granted, DecodeError> {
        Ok(Granted {
            shard: self.u32("a grant's shard")?,
            epoch: self.u64("a grant's epoch")?,
            checkpoint: self.u64("a grant's checkpoint")?,
            end: self.u64("a grant's end")?,
        })
    }
}

/// How many bytes the frame at the start of `buf` takes, its length prefix included,
/// once its length is there; `Ok(None)`: fewer than 4 bytes yet. A length over
/// [`FRAME_MAX`] or too short for a frame's head is refused before its bytes arrive.
pub fn frame_len(buf: &[u8]) -> Result<Option<usize>, DecodeError> {
    let Some(len) = buf.get(..4) else {
        return Ok(None);
    };
    let len = u32::from_be_bytes(len.try_into().unwrap()) as usize;
    if len > FRAME_MAX {
        return Err(bad(format!(
            "the frame's length {len} is over the most a frame may hold, {FRAME_MAX}"
        )));
    }
    if len < 9 {
        return Err(bad(format!(
            "the frame's length {len} is shorter than a frame's type and id (9)"
        )));
    }
    Ok(Some(4 + len))
}

/// One whole frame, its length prefix included, and nothing after it.
pub fn decode(buf: &[u8]) -> Result<Frame, DecodeError> {
    let Some(total) = frame_len(buf)? else {
        return Err(bad("the frame's length: 4 bytes needed"));
    };
    if buf.len() != total {
        return Err(bad(format!(
            "the frame's length says {total} bytes with its prefix, and {} were given",
            buf.len()
        )));
    }
    let mut r = R { b: &buf[4..] };
    let ty = r.u8("the frame's type")?;
    let id = r.u64("the request id")?;
    let body = match ty {
        HELLO => Body::Hello(Hello {
            version: r.u16("the protocol version")?,
            role: match r.u8("the role")? {
                1 => Role::Worker,
                2 => Role::Client,
                v => {
                    return Err(bad(format!(
                        "the role: {v} is not 1 (worker) or 2 (client)"
                    )));
                }
            },
            session: r.u128("the session")?,
            max_shards: r.u32("max_shards")?,
            token: r.str("the token")?,
            resume: r.list("the resume list", 20, |r| {
                Ok(Resume {
                    shard: r.u32("a resumed shard")?,
                    epoch: r.u64("a resumed epoch")?,
                    acked: r.u64("a resumed position")?,
                })
            })?,
            name: r.str("the name")?,
        }),
        PING => Body::Ping(r.list("the turns", 20, |r| {
            Ok(Turns {
                shard: r.u32("a shard's number")?,
                epoch: r.u64("a shard's epoch")?,
                turns: r.u64("a shard's turns")?,
            })
        })?),
        APPEND => Body::Append(Append {
            shard: r.u32("the shard")?,
            epoch: r.u64("the epoch")?,
            first: r.u64("the first position")?,
            records: r.recs()?,
        }),
        RELEASE => Body::Release {
            shard: r.u32("the shard")?,
            epoch: r.u64("the epoch")?,
            end: r.u64("the end position")?,
        },
        FETCH => Body::Fetch {
            shard: r.u32("the shard")?,
            epoch: r.u64("the epoch")?,
            position: r.u64("the checkpoint's position")?,
            offset: r.u64("the offset")?,
            max_bytes: r.u32("the chunk's size")?,
        },
        CHECKPOINT => Body::Checkpoint {
            shard: r.u32("the shard")?,
            epoch: r.u64("the epoch")?,
            position: r.u64("the checkpoint's position")?,
            offset: r.u64("the offset")?,
            bytes: r.bytes("the chunk")?,
            last: r.bool("whether the chunk is the last")?,
        },
        RECOVER => Body::Recover {
            shard: r.u32("the shard")?,
            epoch: r.u64("the epoch")?,
            from: r.u64("the position to read from")?,
            max_bytes: r.u32("the page's size")?,
        },
        CALL => Body::Call(Call {
            kind: match r.u8("the call's kind")? {
                1 => CallKind::Start {
                    workflow: r.str("the workflow")?,
                    id: r.str("the run id")?,
                    input: r.bytes("the input")?,
                },
                2 => CallKind::Signal {
                    id: r.str("the run id")?,
                    name: r.str("the signal's name")?,
                    value: r.bytes("the signal's value")?,
                },
                3 => CallKind::Cancel {
                    id: r.str("the run id")?,
                },
                4 => CallKind::Query {
                    id: r.str("the run id")?,
                },
                5 => CallKind::Result {
                    id: r.str("the run id")?,
                    wait_ms: r.u32("the wait")?,
                },
                v => return Err(bad(format!("the call's kind: {v} is not 1 to 5"))),
            },
            key: r.str("the call's key")?,
        }),
        PARKED => Body::Parked {
            shard: r.u32("the shard")?,
            epoch: r.u64("the epoch")?,
            run: r.str("the run id")?,
            reason: r.str("the reason")?,
        },
        ANSWER => Body::Answer {
            call: r.u64("the call answered")?,
            outcome: match r.u8("the outcome")? {
                1 => Outcome::Ok(r.bytes("the answer")?),
                2 => Outcome::Err {
                    kind: r.str("the error's kind")?,
                    message: r.str("the error's message")?,
                },
                v => return Err(bad(format!("the outcome: {v} is not 1 (ok) or 2 (error)"))),
            },
        },
        WELCOME => Body::Welcome(Welcome {
            version: r.u16("the protocol version")?,
            session: r.u128("the session")?,
            shards: r.u32("the shard count")?,
            lease_ms: r.u32("lease_ms")?,
            ping_ms: r.u32("ping_ms")?,
            stuck_ms: r.u32("stuck_ms")?,
            record_max: r.u32("record_max")?,
            grants: r.list("the grants", 28, R::granted)?,
        }),
        PONG => Body::Pong(r.list("the shards held", 12, |r| {
            Ok(Held {
                shard: r.u32("a shard's number")?,
                epoch: r.u64("a shard's epoch")?,
            })
        })?),
        GRANT => Body::Grant(r.list("the grants", 28, R::granted)?),
        REVOKE => Body::Revoke {
            shard: r.u32("the shard")?,
            epoch: r.u64("the epoch")?,
            reason: match r.u8("the reason")? {
                1 => RevokeReason::Expired,
                2 => RevokeReason::Stuck,
                3 => RevokeReason::Rebalance,
                v => return Err(bad(format!("the reason: {v} is not 1 to 3"))),
            },
        },
        DRAIN => Body::Drain {
            shard: r.u32("the shard")?,
            epoch: r.u64("the epoch")?,
        },
        DURABLE => Body::Durable(r.list("the positions", 20, |r| {
            Ok(ShardPos {
                shard: r.u32("a shard's number")?,
                epoch: r.u64("a shard's epoch")?,
                position: r.u64("a shard's durable position")?,
            })
        })?),
        RECORDS => Body::Records(Records {
            shard: r.u32("the shard")?,
            epoch: r.u64("the epoch")?,
            first: r.u64("the first position")?,
            records: r.recs()?,
            last: r.bool("whether the page is the last")?,
        }),
        RELEASED => Body::Released {
            shard: r.u32("the shard")?,
            epoch: r.u64("the epoch")?,
        },
        REFUSED => Body::Refused {
            to: r.u64("the request refused")?,
            refused: match r.u16("the refusal")? {
                1 => Refused::Stale {
                    shard: r.u32("the shard")?,
                    held: r.u64("the epoch held")?,
                },
                2 => Refused::NotHeld {
                    shard: r.u32("the shard")?,
                },
                3 => Refused::PositionGap {
                    shard: r.u32("the shard")?,
                    expected: r.u64("the position expected")?,
                },
                4 => Refused::Malformed {
                    what: r.str("what was malformed")?,
                },
                5 => Refused::TooLarge {
                    limit: r.u64("the limit")?,
                },
                6 => Refused::Unauthorized,
                7 => Refused::Version {
                    supported: r.u16("the version supported")?,
                },
                8 => Refused::Unavailable {
                    retry_after_ms: r.u32("retry_after_ms")?,
                },
                9 => Refused::NoHolder {
                    shard: r.u32("the shard")?,
                },
                v => return Err(bad(format!("the refusal: {v} is not 1 to 9"))),
            },
        },
        v => {
            return Err(bad(format!(
                "the frame's type: {v} is not one of protocol v1's"
            )));
        }
    };
    if !r.b.is_empty() {
        return Err(bad(format!(
            "{} bytes after the frame's last field",
            r.b.len()
        )));
    }
    Ok(Frame { id, body })
}
