//! The server's log (docs/flow-server.md §6, §7): every shard's records and every grant's
//! epoch in one ferry-log, with group commit across shards, and per shard the index that
//! maps its positions to the log's.
//!
//! Records on the server's log (ferry-log kinds; kind 1 is the embedded engine's):
//! - kind 2, a shard's record: `shard u32 ‖ epoch u64 ‖ position u64 ‖ kind u8 ‖ bytes`,
//!   `position` being the shard's count of records before it;
//! - kind 3, a grant's epoch: `shard u32 ‖ epoch u64 ‖ session u128`, durable before the
//!   grant is sent;
//! - kind 4, the server's shape: `shards u32`, the first record of a new log.
//!
//! A shard's records before its *base* are in its checkpoint (`checkpoints.rs`); the
//! log's segments below every shard's base are retired, so the shape and the epochs
//! are also kept in `DIR/shards/epochs` (written before segments are retired). The
//! index of runs (`index.rs`) is fed from here at open and from the server's appends.

use ferry_flow::log::{Error, Log, Lsn};
use ferry_flow::remote::proto::{Rec, Refused};
use std::collections::VecDeque;
use std::sync::Arc;

pub const SHARD_RECORD: u8 = 2;
pub const EPOCH_RECORD: u8 = 3;
pub const SHAPE_RECORD: u8 = 4;

/// One shard's stream, as the server keeps it.
#[derive(Debug, Default)]
struct Stream {
    /// From the newest epoch record: the epoch and the session granted it.
    epoch: u64,
    holder: Option<u128>,
    /// Records before this position are in the shard's checkpoint.
    base: u64,
    /// Where a read for the record at `base` may start in the log.
    base_lsn: Lsn,
    /// Each record's end in the log (where a read for the next one starts), its CRC32C
    /// and its length (to tell a record sent again from a different one at the same
    /// position), by position from `base`.
    index: Vec<(Lsn, u32, u32)>,
    /// Records appended and not yet durable: (end in the log, position after it).
    pending: VecDeque<(Lsn, u64)>,
    /// Every record before this position is durable.
    durable: u64,
}

/// The server's log with each shard's stream (module doc).
pub struct Store {
    log: Arc<Log>,
    streams: Vec<Stream>,
}

/// What opening found.
#[derive(Debug)]
pub struct Opened {
    /// Each shard's epoch and the session its newest epoch record names.
    pub epochs: Vec<(u64, Option<u128>)>,
    /// Records read back.
    pub records: u64,
}

fn corrupted(lsn: Lsn, reason: String) -> Error {
    Error::Corrupted {
        segment: "(the flow server's log)".into(),
        offset: lsn,
        reason,
    }
}

impl Store {
    /// Open the log (recovered already by `Log::open*`) and read it back, handing each
    /// shard record to `on_record` (shard, kind, bytes). A new log gets the shape
    /// record; an existing one must have been made for `shards` shards.
    /// `bases` are where each shard's checkpoint ends; `kept` the shape and epochs kept
    /// beside the log (the log's own may be retired).
    pub fn open(
        log: Arc<Log>,
        shards: u32,
        bases: &[u64],
        kept: Option<&Kept>,
        on_record: &mut dyn FnMut(u32, u8, &[u8]),
    ) -> Result<(Store, Opened), Error> {
        let mut streams: Vec<Stream> = (0..shards as usize)
            .map(|k| Stream {
                base: bases.get(k).copied().unwrap_or(0),
                base_lsn: log.start_lsn(),
                ..Stream::default()
            })
            .collect();
        if let Some(kept) = kept {
            for (s, &(epoch, holder)) in streams.iter_mut().zip(&kept.epochs) {
                (s.epoch, s.holder) = (epoch, holder);
            }
        }
        let mut shape = kept.map(|k| k.shards);
        let mut records = 0u64;
        let mut bad = None;
        log.read(log.start_lsn(), |r| {
            if bad.is_some() {
                return;
            }
            records += 1;
            let p = r.payload;
            match r.kind {
                SHAPE_RECORD if p.len() == 4 => {
                    let n = u32::from_be_bytes(p.try_into().unwrap());
                    if shape.is_some_and(|k| k != n) {
                        bad = Some(corrupted(
                            r.lsn,
                            format!("the log is shaped for {n} shards, DIR/shards/epochs for {shape:?}"),
                        ));
                    }
                    shape = Some(n);
                }
                SHARD_RECORD if p.len() >= 21 => {
                    let shard = u32::from_be_bytes(p[..4].try_into().unwrap());
                    let position = u64::from_be_bytes(p[12..20].try_into().unwrap());
                    let Some(s) = streams.get_mut(shard as usize) else {
                        bad = Some(corrupted(r.lsn, format!("a record of shard {shard}")));
                        return;
                    };
                    // Folded into the shard's checkpoint already.
                    if position < s.base {
                        return;
                    }
                    let next = s.base + s.index.len() as u64;
                    if position != next {
                        bad = Some(corrupted(
                            r.lsn,
                            format!(
                                "shard {shard}'s record at position {position}, where {next} was next"
                            ),
                        ));
                        return;
                    }
                    s.index
                        .push((r.end, crc32c::crc32c(&p[20..]), (p.len() - 20) as u32));
                    on_record(shard, p[20], &p[21..]);
                }
                EPOCH_RECORD if p.len() == 28 => {
                    let shard = u32::from_be_bytes(p[..4].try_into().unwrap());
                    let Some(s) = streams.get_mut(shard as usize) else {
                        bad = Some(corrupted(r.lsn, format!("an epoch of shard {shard}")));
                        return;
                    };
                    let epoch = u64::from_be_bytes(p[4..12].try_into().unwrap());
                    // Epochs only rise: one kept beside the log may be newer.
                    if epoch >= s.epoch {
                        s.epoch = epoch;
                        s.holder = Some(u128::from_be_bytes(p[12..28].try_into().unwrap()));
                    }
                }
                kind => {
                    bad = Some(corrupted(
                        r.lsn,
                        format!("a record of kind {kind} and {} bytes", p.len()),
                    ))
                }
            }
        })?;
        if let Some(e) = bad {
            return Err(e);
        }
        match shape {
            Some(n) if n != shards => {
                return Err(Error::Invalid(format!(
                    "this server's log was made for {n} shards, not {shards}: start it with \
                     --shards {n} (runs are placed by shard, so the count cannot change)"
                )));
            }
            Some(_) => {}
            // Durable with the first grant's epoch record, which comes after it: a log
            // that lost it in a crash lost everything after it too, and starts again.
            None if records == 0 => {
                log.append(SHAPE_RECORD, &shards.to_be_bytes())?;
            }
            None => {
                return Err(corrupted(
                    log.start_lsn(),
                    "a log with records but no shape record".into(),
                ));
            }
        }
        for s in &mut streams {
            s.durable = s.base + s.index.len() as u64;
        }
        let epochs = streams.iter().map(|s| (s.epoch, s.holder)).collect();
        Ok((Store { log, streams }, Opened { epochs, records }))
    }

    pub fn log(&self) -> &Arc<Log> {
        &self.log
    }

    /// Where the shard's records end (durable or not).
    pub fn end(&self, shard: u32) -> u64 {
        let s = &self.streams[shard as usize];
        s.base + s.index.len() as u64
    }

    /// Where the shard's checkpoint ends: its records before this are not in the log.
    pub fn base(&self, shard: u32) -> u64 {
        self.streams[shard as usize].base
    }

    /// Each shard's epoch and the session its newest epoch record names.
    pub fn epochs(&self) -> Vec<(u64, Option<u128>)> {
        self.streams.iter().map(|s| (s.epoch, s.holder)).collect()
    }

    /// The shard's records before `base` are now in its checkpoint, and every shard's
    /// records from `base` on lie at or after `base_lsn` in the log: forget their index.
    pub fn set_base(&mut self, shard: u32, base: u64, base_lsn: Lsn) {
        let s = &mut self.streams[shard as usize];
        let drop = base.saturating_sub(s.base).min(s.index.len() as u64) as usize;
        s.index.drain(..drop);
        s.base = s.base.max(base);
        s.base_lsn = base_lsn;
    }

    /// Every record of the shard before this is durable.
    pub fn durable(&self, shard: u32) -> u64 {
        self.streams[shard as usize].durable
    }

    /// Append `records` of `shard`, the first at position `first`, under `epoch` (the
    /// caller checked the fence). Records the shard already has at their positions with
    /// the same bytes are taken as sent again and skipped; different bytes, or a first
    /// position past the end, is a gap. Returns where the last new record ends in the
    /// log, if any was new.
    pub fn append(
        &mut self,
        shard: u32,
        epoch: u64,
        first: u64,
        records: &[Rec],
    ) -> Result<Option<Lsn>, AppendError> {
        let s = &mut self.streams[shard as usize];
        let end = s.base + s.index.len() as u64;
        if first > end {
            return Err(AppendError::Refused(Refused::PositionGap {
                shard,
                expected: end,
            }));
        }
        let mut last = None;
        let mut payload = Vec::new();
        for (i, rec) in records.iter().enumerate() {
            let position = first + i as u64;
            payload.clear();
            payload.push(rec.kind);
            payload.extend_from_slice(&rec.bytes);
            let crc = crc32c::crc32c(&payload);
            // Folded into the checkpoint: durable, and sent again.
            if position < s.base {
                continue;
            }
            if let Some(&(_, had, len)) = s.index.get((position - s.base) as usize) {
                if (had, len as usize) != (crc, payload.len()) {
                    return Err(AppendError::Refused(Refused::PositionGap {
                        shard,
                        expected: end,
                    }));
                }
                continue;
            }
            let mut framed = Vec::with_capacity(20 + payload.len());
            framed.extend_from_slice(&shard.to_be_bytes());
            framed.extend_from_slice(&epoch.to_be_bytes());
            framed.extend_from_slice(&position.to_be_bytes());
            framed.extend_from_slice(&payload);
            let log_end = self.log.append(SHARD_RECORD, &framed)?;
            s.index.push((log_end, crc, payload.len() as u32));
            s.pending.push_back((log_end, position + 1));
            last = Some(log_end);
        }
        Ok(last)
    }

    /// Append the epoch record of a grant; returns its end (send the grant once durable).
    pub fn epoch_record(&mut self, shard: u32, epoch: u64, session: u128) -> Result<Lsn, Error> {
        let mut p = Vec::with_capacity(28);
        p.extend_from_slice(&shard.to_be_bytes());
        p.extend_from_slice(&epoch.to_be_bytes());
        p.extend_from_slice(&session.to_be_bytes());
        let end = self.log.append(EPOCH_RECORD, &p)?;
        let s = &mut self.streams[shard as usize];
        s.epoch = epoch;
        s.holder = Some(session);
        Ok(end)
    }

    /// The log is durable up to `durable`: the shards whose durable position moved, and
    /// where to.
    pub fn advance(&mut self, durable: Lsn) -> Vec<(u32, u64)> {
        let mut moved = Vec::new();
        for (i, s) in self.streams.iter_mut().enumerate() {
            let mut to = None;
            while let Some(&(end, position)) = s.pending.front() {
                if end > durable {
                    break;
                }
                s.pending.pop_front();
                to = Some(position);
            }
            if let Some(position) = to {
                s.durable = position;
                moved.push((i as u32, position));
            }
        }
        moved
    }

    /// What reading a page of the shard's durable records from position `from` needs,
    /// taken under the server's lock; the reading itself ([`Page::read`]) goes without
    /// it.
    pub fn page(&self, shard: u32, from: u64) -> Option<Page> {
        let s = &self.streams[shard as usize];
        // Before the base: in the checkpoint, which the reader fetches first.
        let lsn = match from {
            n if n < s.base => return None,
            n if n == s.base => s.base_lsn,
            n if n <= s.durable => s.index[(n - s.base) as usize - 1].0,
            _ => 0,
        };
        Some(Page {
            log: self.log.clone(),
            shard,
            from,
            durable: s.durable,
            lsn,
        })
    }
}

/// A page of one shard's records to read (see [`Store::page`]).
pub struct Page {
    log: Arc<Log>,
    shard: u32,
    from: u64,
    durable: u64,
    lsn: Lsn,
}

impl Page {
    /// The records from `from`, as many as fit in `max_bytes` as a page's frame carries
    /// them (at least one, if there is one); whether they reach the shard's durable end.
    pub fn read(&self, max_bytes: u32) -> Result<(Vec<Rec>, bool), Error> {
        let (shard, durable) = (self.shard, self.durable);
        if self.from >= durable {
            return Ok((Vec::new(), true));
        }
        let mut out = Vec::new();
        let mut bytes = 0usize;
        let mut next = self.from;
        let mut bad = None;
        self.log.read_while(self.lsn, |r| {
            if r.kind != SHARD_RECORD || r.payload.len() < 21 {
                return true;
            }
            let p = r.payload;
            if u32::from_be_bytes(p[..4].try_into().unwrap()) != shard {
                return true;
            }
            let position = u64::from_be_bytes(p[12..20].try_into().unwrap());
            // Before the page (read from a base that the log still holds older records
            // of).
            if position < next {
                return true;
            }
            if position != next {
                bad = Some(corrupted(
                    r.lsn,
                    format!("shard {shard}'s record {position} where {next} was next"),
                ));
                return false;
            }
            // As the page's frame will carry it: a kind, a length and the bytes.
            let size = 5 + p.len() - 21;
            if !out.is_empty() && bytes + size > max_bytes as usize {
                return false;
            }
            bytes += size;
            out.push(Rec {
                kind: p[20],
                bytes: p[21..].to_vec(),
            });
            next += 1;
            next < durable && bytes < max_bytes as usize
        })?;
        if let Some(e) = bad {
            return Err(e);
        }
        Ok((out, next >= durable))
    }
}

/// What the server keeps beside its log, for when the log's first segments are
/// retired: the shard count and each shard's epoch and holder (`DIR/shards/epochs`).
#[derive(Debug, Clone, PartialEq)]
pub struct Kept {
    pub shards: u32,
    pub epochs: Vec<(u64, Option<u128>)>,
}

/// Why an append was not taken.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    #[error(transparent)]
    Refused(Refused),
    #[error(transparent)]
    Log(#[from] Error),
}
