//! What waits for the receiver's acknowledgement, and the requests that carry it
//! (docs/ship.md §3.4 steps 2–3, §5.2). Pure: the WAL is read through [`ReadAt`] (for
//! large transactions kept as frame references), and the receiver's answers come in as
//! values.
//!
//! 1. Each transaction a scan finds gets the next seq and waits in [`Batch::unacked`].
//! 2. [`Batch::build`] encodes records from `acked + 1` (part `resume_part`) up to
//!    `batch_bytes_max`; a transaction above `PART_BYTES_MAX` goes in parts.
//! 3. [`Batch::acknowledge`] takes the receiver's position: what it holds leaves the
//!    queue, unless its checksum shows another history.
//!
//! Nothing here is persisted: after a restart the receiver's position is asked again and
//! the WAL scanned from the saved cursor.

use super::limits::UNACKED_BYTES_MAX;
use crate::proto::{self, BATCH_BYTES_MAX, PART_BYTES_MAX, Position, RecordHeader};
use crate::wal::{self, Cursor, Pages, ReadAt, Txn};
use std::collections::VecDeque;
use std::io;
use std::time::{Duration, Instant};

/// A scanned transaction waiting for its acknowledgement.
#[derive(Debug)]
pub struct Unacked {
    pub seq: u64,
    pub txn: Txn,
    /// The shipper's wall clock when it first saw the commit (carried in the record).
    pub observed_ms: u64,
    /// When it was seen, for the lag in status.
    pub seen: Instant,
}

/// The queue of transactions not yet acknowledged, and where the receiver stands.
#[derive(Debug)]
pub struct Batch {
    /// In seq order, every seq above `acked`. Private: the counts below follow it through
    /// `push`, `pop_front` and `clear` alone.
    unacked: VecDeque<Unacked>,
    /// Page bytes held in `unacked`; at most `UNACKED_BYTES_MAX` plus one transaction.
    unacked_bytes: u64,
    /// WAL bytes of the transactions in `unacked`.
    unacked_wal_bytes: u64,
    /// How many of `unacked` are kept as frame references: counted rather than walked,
    /// since every step asks (`all_inline`, for the fold).
    framed: usize,
    /// Seq the next scanned transaction gets.
    pub next_seq: u64,
    /// Highest seq the receiver holds (may be ahead of what was scanned after a restart).
    /// Only rises within a generation.
    pub acked: u64,
    /// Next part of transaction `acked + 1` the receiver expects.
    pub resume_part: u32,
    /// The receiver's WAL checksum at `acked` (0: unknown).
    pub acked_checksum: u64,
    /// Bytes per request: `BATCH_BYTES_MAX`, halved on 413 down to `PART_BYTES_MAX`.
    pub batch_bytes_max: usize,
    /// The receiver's position is known and checked (after a probe or a base).
    pub probed: bool,
}

/// A request body and what it carries.
#[derive(Debug, PartialEq, Eq)]
pub struct Body {
    pub bytes: Vec<u8>,
    /// Transactions whose last part it carries.
    pub txns: u64,
    pub page_bytes: u64,
}

/// What an acknowledgement did.
#[derive(Debug, PartialEq, Eq)]
pub enum Acked {
    /// The receiver holds up to its position; `through`: the last transaction of ours it
    /// now holds, and the WAL position after it (None if none of ours was newly held).
    Moved { through: Option<(u64, Cursor)> },
    /// The receiver holds less than it acknowledged before: its replica was lost.
    Regressed { held: u64, acked: u64 },
    /// The receiver's transaction `seq` carries another checksum than ours: its history
    /// forked. `through` as for `Moved`, up to the transaction before.
    Forked {
        seq: u64,
        through: Option<(u64, Cursor)>,
    },
}

impl Batch {
    /// A queue after a restart at the acknowledged seq `acked`.
    pub fn new(acked: u64) -> Batch {
        Batch {
            unacked: VecDeque::new(),
            unacked_bytes: 0,
            unacked_wal_bytes: 0,
            framed: 0,
            // Saturating: `acked` comes from the state file, and a damaged one must not
            // stop the shipper (the seq counter's own check catches a real wrap).
            next_seq: acked.saturating_add(1),
            acked,
            resume_part: 0,
            acked_checksum: 0,
            batch_bytes_max: BATCH_BYTES_MAX,
            probed: false,
        }
    }

    /// Forget what waits: a base will carry it.
    pub fn clear(&mut self) {
        self.unacked.clear();
        self.unacked_bytes = 0;
        self.unacked_wal_bytes = 0;
        self.framed = 0;
    }

    /// After a base: the receiver holds seq 0 of a new generation, with `checksum`.
    pub fn restart_at_base(&mut self, checksum: u64) {
        self.clear();
        self.next_seq = 1;
        self.acked = 0;
        self.resume_part = 0;
        self.probed = true;
        self.acked_checksum = checksum;
    }

    /// Page bytes a scan may still hold in memory.
    pub fn budget(&self) -> u64 {
        UNACKED_BYTES_MAX.saturating_sub(self.unacked_bytes)
    }

    /// The seq for the next transaction scanned.
    pub fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq = seq
            .checked_add(1)
            .expect("a seq counter never wraps: 2^64 transactions in one generation");
        seq
    }

    /// Queue a transaction the receiver does not hold.
    pub fn push(&mut self, u: Unacked) {
        assert!(
            u.seq > self.acked && self.unacked.back().is_none_or(|b| b.seq < u.seq),
            "the queue holds rising seqs above the acknowledged one ({} after {:?}, acked {})",
            u.seq,
            self.unacked.back().map(|b| b.seq),
            self.acked
        );
        self.unacked_bytes += u.txn.page_bytes();
        self.unacked_wal_bytes += u.txn.wal_bytes;
        self.framed += usize::from(is_framed(&u.txn));
        self.unacked.push_back(u);
    }

    /// The oldest transaction waiting leaves the queue.
    fn pop_front(&mut self) -> Option<Unacked> {
        let u = self.unacked.pop_front()?;
        self.unacked_bytes -= u.txn.page_bytes();
        self.unacked_wal_bytes -= u.txn.wal_bytes;
        self.framed -= usize::from(is_framed(&u.txn));
        Some(u)
    }

    /// How many transactions wait.
    pub fn len(&self) -> usize {
        self.unacked.len()
    }

    pub fn is_empty(&self) -> bool {
        self.unacked.is_empty()
    }

    /// Page bytes of the transactions waiting.
    pub fn unacked_bytes(&self) -> u64 {
        self.unacked_bytes
    }

    /// Every waiting transaction is held in memory (none kept as frame references, which
    /// need the WAL until they are shipped).
    pub fn all_inline(&self) -> bool {
        self.framed == 0
    }

    /// WAL bytes of the transactions waiting.
    pub fn lag_wal_bytes(&self) -> u64 {
        self.unacked_wal_bytes
    }

    /// Age of the oldest transaction waiting.
    pub fn lag(&self, now: Instant) -> Duration {
        self.unacked
            .front()
            .map_or(Duration::ZERO, |u| now.saturating_duration_since(u.seen))
    }

    /// A 413: halve the batch, down to a part. False if it cannot shrink further.
    pub fn shrink(&mut self) -> bool {
        if self.batch_bytes_max <= PART_BYTES_MAX {
            return false;
        }
        self.batch_bytes_max = (self.batch_bytes_max / 2).max(PART_BYTES_MAX);
        true
    }

    /// Records from `acked + 1` (part `resume_part`) up to `batch_bytes_max`, at least
    /// one. Transactions kept as frame references are read back from `wal` and verified;
    /// None if a frame no longer validates (the WAL was rewritten under the scan).
    pub fn build(
        &self,
        page_size: u32,
        wal: Option<&(impl ReadAt + ?Sized)>,
    ) -> io::Result<Option<Body>> {
        let pages_per_part = (PART_BYTES_MAX / page_size as usize).max(1);
        let mut body = Vec::new();
        let (mut txns, mut page_bytes) = (0u64, 0u64);
        'txns: for u in &self.unacked {
            let first_part = if u.seq == self.acked + 1 {
                self.resume_part as usize
            } else {
                0
            };
            let read_back;
            let pages: Vec<(u32, &[u8])> = match &u.txn.pages {
                Pages::Inline(p) => p.iter().map(|(n, d)| (*n, &d[..])).collect(),
                Pages::Frames(refs) => {
                    let Some(f) = wal else { return Ok(None) };
                    read_back = match wal::read_frames(f, refs)? {
                        Some(p) => p,
                        None => return Ok(None),
                    };
                    read_back.iter().map(|(n, d)| (*n, &d[..])).collect()
                }
            };
            let chunks: Vec<&[(u32, &[u8])]> = if pages.is_empty() {
                vec![&pages[..]]
            } else {
                pages.chunks(pages_per_part).collect()
            };
            for (part, chunk) in chunks.iter().enumerate().skip(first_part) {
                let len = proto::record_bytes(page_size, chunk.len());
                if !body.is_empty() && body.len() + len > self.batch_bytes_max {
                    break 'txns;
                }
                let last = part + 1 == chunks.len();
                let h = RecordHeader {
                    seq: u.seq,
                    part: part as u32,
                    last,
                    commit_pages: if last { u.txn.commit_size } else { 0 },
                    page_count: chunk.len() as u32,
                    observed_ms: u.observed_ms,
                    wal_checksum: pack(u.txn.end.checksum),
                };
                proto::encode_record(&mut body, &h, chunk.iter().copied());
                page_bytes += chunk.len() as u64 * page_size as u64;
                if last {
                    txns += 1;
                }
            }
        }
        Ok(Some(Body {
            bytes: body,
            txns,
            page_bytes,
        }))
    }

    /// Take the receiver's position `pos` (of our generation and epoch: the caller checks
    /// that): what it holds leaves the queue, unless the checksum at its seq shows another
    /// history than ours.
    pub fn acknowledge(&mut self, pos: &Position) -> Acked {
        if pos.seq < self.acked {
            return Acked::Regressed {
                held: pos.seq,
                acked: self.acked,
            };
        }
        self.acked = pos.seq;
        self.acked_checksum = pos.checksum;
        self.resume_part = pos.pending_part;
        let mut through = None;
        while self.unacked.front().is_some_and(|u| u.seq <= self.acked) {
            let u = self.pop_front().expect("checked");
            if u.seq == self.acked && !same_history(pack(u.txn.end.checksum), pos.checksum) {
                return Acked::Forked {
                    seq: u.seq,
                    through,
                };
            }
            through = Some((u.seq, u.txn.end));
        }
        Acked::Moved { through }
    }
}

/// Is the transaction kept as frame references (its pages read back from the WAL when
/// shipped)?
fn is_framed(txn: &Txn) -> bool {
    matches!(txn.pages, Pages::Frames(_))
}

/// A checksum as the wire carries it.
pub fn pack(c: wal::Checksum) -> u64 {
    ((c.0 as u64) << 32) | c.1 as u64
}

/// Does the receiver's checksum for a transaction match ours? 0 means the receiver does
/// not know (it has held nothing since its base was taken from an empty WAL).
pub fn same_history(ours: u64, theirs: u64) -> bool {
    theirs == 0 || ours == theirs
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::testing::WalBuilder;
    use crate::wal::{Salts, ScanLimits};
    use ferry_core::epoch::Epoch;
    use ferry_core::seams::{Rng, SplitMix64};

    const PS: u32 = 4096;

    /// Transactions scanned from a WAL of `sizes[i]` pages each; those above
    /// `inline_max` page bytes kept as frame references.
    fn scanned(sizes: &[u32], inline_max: u64) -> (WalBuilder, Vec<Txn>) {
        let mut w = WalBuilder::new(PS, Salts(1, 2), false);
        for (t, &n) in sizes.iter().enumerate() {
            for p in 1..=n {
                w.frame(p, if p == n { n } else { 0 }, t as u8);
            }
        }
        let limits = ScanLimits {
            txn_inline_bytes_max: inline_max,
            budget_bytes: u64::MAX,
        };
        let txns = wal::scan(&w.bytes, &w.header().start(), limits)
            .unwrap()
            .txns;
        (w, txns)
    }

    fn queue(txns: Vec<Txn>) -> Batch {
        let mut b = Batch::new(0);
        for txn in txns {
            let seq = b.take_seq();
            b.push(Unacked {
                seq,
                txn,
                observed_ms: 0,
                seen: Instant::now(),
            });
        }
        b
    }

    fn position(seq: u64, checksum: u64, pending_part: u32) -> Position {
        Position {
            name: "a".into(),
            epoch: Epoch(0),
            generation: 1,
            seq,
            pending_part,
            page_size: PS,
            pages: 0,
            promoted: false,
            checksum,
        }
    }

    fn headers(body: &Body) -> Vec<(u64, u32, bool)> {
        proto::decode_records(&body.bytes, PS)
            .unwrap()
            .iter()
            .map(|r| (r.header.seq, r.header.part, r.header.last))
            .collect()
    }

    // Guards against a transaction larger than a part being lost or sent whole: it goes
    // in parts of PART_BYTES_MAX, and a batch ends at BATCH_BYTES_MAX.
    #[test]
    fn a_large_transaction_goes_in_parts_and_a_batch_ends_at_its_limit() {
        let per_part = (PART_BYTES_MAX / PS as usize) as u32;
        let (w, txns) = scanned(&[1, per_part * 2 + 1, 1], u64::MAX);
        let b = queue(txns);
        let body = b.build(PS, Some(&w.bytes)).unwrap().unwrap();
        assert_eq!(
            headers(&body),
            vec![(1, 0, true), (2, 0, false)],
            "the next part would pass the batch's 8 MiB"
        );
        assert_eq!(body.txns, 1);
        let mut small = queue(scanned(&[1, 1, 1], u64::MAX).1);
        small.batch_bytes_max = 1;
        let body = small.build(PS, None::<&[u8]>).unwrap().unwrap();
        assert_eq!(
            headers(&body),
            vec![(1, 0, true)],
            "at least one record goes"
        );
    }

    // Guards against resending parts the receiver spooled, or skipping one: a batch
    // resumes at the part the receiver expects.
    #[test]
    fn a_batch_resumes_at_the_part_the_receiver_expects() {
        let per_part = (PART_BYTES_MAX / PS as usize) as u32;
        let (w, txns) = scanned(&[per_part * 2 + 1, 1], u64::MAX);
        let mut b = queue(txns);
        assert_eq!(
            b.acknowledge(&position(0, 0, 2)),
            Acked::Moved { through: None }
        );
        let body = b.build(PS, Some(&w.bytes)).unwrap().unwrap();
        assert_eq!(headers(&body), vec![(1, 2, true), (2, 0, true)]);
        assert_eq!(body.txns, 2);
    }

    // Guards against shipping a page that changed on disk after the scan: a transaction
    // kept as frame references is read back verified, and a rewritten frame owes a base.
    #[test]
    fn frames_read_back_must_still_validate() {
        let (w, txns) = scanned(&[3], 0);
        assert!(matches!(txns[0].pages, Pages::Frames(_)));
        let b = queue(txns);
        let body = b.build(PS, Some(&w.bytes)).unwrap().unwrap();
        let records = proto::decode_records(&body.bytes, PS).unwrap();
        assert_eq!(records[0].pages.len(), 3);
        let mut changed = w.bytes.clone();
        changed[wal::frame_offset(PS, 2) as usize + 100] ^= 1;
        assert_eq!(b.build(PS, Some(&changed)).unwrap(), None);
        assert_eq!(b.build(PS, None::<&[u8]>).unwrap(), None, "no WAL to read");
    }

    // Guards against trusting a receiver that holds another history: what it holds leaves
    // the queue only while its checksum is ours.
    #[test]
    fn an_acknowledgement_moves_the_queue_or_shows_a_fork() {
        let (_, txns) = scanned(&[1, 1, 1], u64::MAX);
        let ends: Vec<Cursor> = txns.iter().map(|t| t.end).collect();
        let mut b = queue(txns);
        let bytes = b.unacked_bytes;
        assert_eq!(
            b.acknowledge(&position(2, pack(ends[1].checksum), 0)),
            Acked::Moved {
                through: Some((2, ends[1]))
            }
        );
        assert_eq!((b.unacked.len(), b.unacked_bytes), (1, bytes / 3));
        assert_eq!(
            b.acknowledge(&position(1, 0, 0)),
            Acked::Regressed { held: 1, acked: 2 }
        );
        assert_eq!(
            b.acknowledge(&position(3, 12345, 0)),
            Acked::Forked {
                seq: 3,
                through: None
            }
        );
        let mut unknown = queue(scanned(&[1], u64::MAX).1);
        assert!(
            matches!(
                unknown.acknowledge(&position(1, 0, 0)),
                Acked::Moved { through: Some(_) }
            ),
            "a checksum of 0 is not known, not another history"
        );
    }

    /// What a walk of the queue gives for the counts `Batch` keeps: page bytes, WAL bytes,
    /// and whether every transaction is held in memory.
    fn walked(b: &Batch) -> (u64, u64, bool) {
        (
            b.unacked.iter().map(|u| u.txn.page_bytes()).sum(),
            b.unacked.iter().map(|u| u.txn.wal_bytes).sum(),
            b.unacked
                .iter()
                .all(|u| matches!(u.txn.pages, Pages::Inline(_))),
        )
    }

    // Guards the counts every step reads (the fold's `all_inline`, the lag, the page
    // bytes) against drifting from the queue they count: checked against a walk after
    // each of a seeded run of pushes, acknowledgements (forks included), clears and bases.
    #[test]
    fn the_counts_kept_match_a_walk_of_the_queue() {
        let (_, pool) = scanned(&[1, 3, 1, 4, 2, 1, 5], 2 * PS as u64);
        assert!(pool.iter().any(is_framed) && !pool.iter().all(is_framed));
        let mut rng = SplitMix64::seeded(7);
        let mut b = Batch::new(0);
        for _ in 0..2000 {
            match rng.below(16) {
                0..=8 => {
                    let txn = pool[rng.below(pool.len() as u64) as usize].clone();
                    let seq = b.take_seq();
                    b.push(Unacked {
                        seq,
                        txn,
                        observed_ms: 0,
                        seen: Instant::now(),
                    });
                }
                9..=13 => {
                    let seq = b.acked + rng.below(b.len() as u64 + 1);
                    // Now and then a checksum not ours: the queue forks there.
                    let checksum = if rng.below(4) == 0 { 12345 } else { 0 };
                    b.acknowledge(&position(seq, checksum, 0));
                }
                14 => b.clear(),
                _ => b.restart_at_base(0),
            }
            assert_eq!(
                (b.unacked_bytes(), b.lag_wal_bytes(), b.all_inline()),
                walked(&b)
            );
        }
    }

    #[test]
    fn a_413_halves_the_batch_down_to_a_part() {
        let mut b = Batch::new(0);
        assert!(b.shrink());
        assert_eq!(b.batch_bytes_max, BATCH_BYTES_MAX / 2);
        while b.shrink() {}
        assert_eq!(b.batch_bytes_max, PART_BYTES_MAX);
    }

    #[test]
    #[should_panic(expected = "never wraps")]
    fn the_seq_counter_never_wraps() {
        let mut b = Batch::new(u64::MAX - 1);
        b.take_seq();
    }
}
