//! The acceptance rule for `POST …/txns` (docs/ship.md §4.4): which request a receiver
//! takes, at which position, epoch and WAL checksum, and what it does with each record.
//! Pure: it reads the position and the records' headers and answers with a plan or a
//! [`Rejection`]; the slot carries the plan out (spool, apply) and words the refusal.
//!
//! The rule, in order, before anything is applied:
//! 1. (token, name, query: the HTTP layer)
//! 2. An epoch below the replica's is fenced.
//! 3. No replica, another generation, or a newer epoch: a base is needed.
//! 4. Another page size: a base is needed (admission comes before parsing: a body framed
//!    for another page size would only fail to parse).
//! 5. (the body parses and every record's CRC32C holds: `proto::decode_records`)
//! 6. Records the replica holds are skipped, so a resend is idempotent; a record at the
//!    replica's own position whose WAL checksum differs means the primary's history forked
//!    (a base is needed); the first record that does not follow ends the usable prefix,
//!    and a request with nothing that follows is refused as behind, with the position.
//!
//! [`plan`] decides all of step 6 before the first page is written, so a request refused
//! there changes nothing.

use super::state::Pos;
use crate::proto::RecordHeader;
use ferry_core::epoch::{Epoch, Fence};

/// Why a request is refused. Each carries the values its message names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rejection {
    /// Step 2: the request's epoch is below the replica's.
    Fenced { epoch: Epoch, held: Epoch },
    /// Step 3: the request's epoch is above the replica's: only a base starts it.
    NewerEpoch { epoch: Epoch, held: Epoch },
    /// Step 3: there is no replica to apply to.
    NoReplica,
    /// Step 3: the request continues another lineage.
    OtherGeneration { generation: u64, held: u64 },
    /// Step 4.
    PageSize { page_size: u32, held: u32 },
    /// Step 6: the shipper's transaction at the replica's position is not the one applied.
    Forked { seq: u64, theirs: u64, ours: u64 },
    /// Step 6: nothing in the request follows the replica's position.
    Behind { seq: u64, part: u32 },
}

/// Step 2 alone: what a base or a delete must pass.
pub fn fence(held: Epoch, epoch: Epoch) -> Result<(), Rejection> {
    match Fence::check(epoch, held) {
        Fence::Stale { held } => Err(Rejection::Fenced { epoch, held }),
        Fence::Current | Fence::Newer { .. } => Ok(()),
    }
}

/// Steps 2 to 4 for a request at `epoch`, `generation` and (for `txns`) `page_size`,
/// against the position `held`; `replica_open`: the replica is open to apply to.
pub fn admit(
    held: &Pos,
    replica_open: bool,
    epoch: Epoch,
    generation: u64,
    page_size: Option<u32>,
) -> Result<(), Rejection> {
    match Fence::check(epoch, held.epoch) {
        Fence::Stale { held } => return Err(Rejection::Fenced { epoch, held }),
        Fence::Newer { held } => return Err(Rejection::NewerEpoch { epoch, held }),
        Fence::Current => {}
    }
    if !held.has_replica() || !replica_open {
        return Err(Rejection::NoReplica);
    }
    if generation != held.generation {
        return Err(Rejection::OtherGeneration {
            generation,
            held: held.generation,
        });
    }
    if let Some(page_size) = page_size
        && page_size != held.page_size
    {
        return Err(Rejection::PageSize {
            page_size,
            held: held.page_size,
        });
    }
    Ok(())
}

/// A transaction being received in parts: its seq and the next part expected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Partial {
    pub seq: u64,
    pub next_part: u32,
}

/// What to do with the records of a request, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Record `i` is a whole transaction: it is ready.
    Whole(usize),
    /// Record `index` is a part of a transaction: spool it (part 0 starts a new spool);
    /// `last`: the transaction is then complete and ready, its pages in the spool.
    Part { index: usize, last: bool },
    /// Apply every transaction made ready so far: the next step starts a new spool, and a
    /// finished transaction in parts reads its pages from the old one.
    Flush,
}

/// What [`plan`] decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// The seqs the steps make ready, in order: always `held.seq + 1` onwards, without a
    /// gap. Applying the plan moves the replica to the last of them.
    pub ready: Vec<u64>,
}

/// Step 6: which records of a request (well formed, in the order sent) follow the
/// position `held`, given the transaction `partial` being received in parts.
///
/// A `Flush` moves the position the later records are compared against, as applying
/// would: a record at that position is checked against the checksum of the transaction
/// flushed, not of the one held before the request.
pub fn plan(
    held: &Pos,
    partial: Option<Partial>,
    records: &[RecordHeader],
) -> Result<Plan, Rejection> {
    let (mut at_seq, mut at_checksum) = (held.seq, held.checksum);
    let mut next_seq = held.seq + 1;
    let mut partial = partial;
    // Ready but not flushed: (seq, checksum).
    let mut unflushed: Option<(u64, u64)> = None;
    let mut out = Plan::default();
    let mut gap = None;
    for (index, h) in records.iter().enumerate() {
        let expected_part = match partial {
            Some(p) if p.seq == next_seq => p.next_part,
            _ => 0,
        };
        if h.seq == at_seq && h.last && !same_history(h.wal_checksum, at_checksum) {
            // The shipper's transaction at our position is not the one applied: its
            // primary's history forked (a lost tail rewritten). Nothing after it can
            // follow what we hold.
            return Err(Rejection::Forked {
                seq: h.seq,
                theirs: h.wal_checksum,
                ours: at_checksum,
            });
        }
        if h.seq < next_seq || (h.seq == next_seq && h.part < expected_part) {
            continue; // held already: a resend
        }
        if h.seq != next_seq || h.part != expected_part {
            gap = Some((h.seq, h.part));
            break;
        }
        if h.part == 0 && h.last {
            out.steps.push(Step::Whole(index));
            out.ready.push(h.seq);
            unflushed = Some((h.seq, h.wal_checksum));
            next_seq += 1;
            continue;
        }
        if h.part == 0
            && let Some((seq, checksum)) = unflushed.take()
        {
            out.steps.push(Step::Flush);
            (at_seq, at_checksum) = (seq, checksum);
        }
        out.steps.push(Step::Part {
            index,
            last: h.last,
        });
        partial = Some(Partial {
            seq: h.seq,
            next_part: h.part + 1,
        });
        if h.last {
            out.ready.push(h.seq);
            unflushed = Some((h.seq, h.wal_checksum));
            next_seq += 1;
        }
    }
    if out.steps.is_empty()
        && let Some((seq, part)) = gap
    {
        return Err(Rejection::Behind { seq, part });
    }
    Ok(out)
}

/// Two WAL checksums name the same history, or one of them is unknown (0).
pub fn same_history(a: u64, b: u64) -> bool {
    a == 0 || b == 0 || a == b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::receiver::state::FLAG_HAS_REPLICA;
    use ferry_core::seams::{Rng, SplitMix64};

    fn held(seq: u64, checksum: u64) -> Pos {
        Pos {
            epoch: Epoch(2),
            generation: 7,
            seq,
            page_size: 4096,
            flags: FLAG_HAS_REPLICA,
            checksum,
        }
    }

    /// A record header: transaction `seq` (checksum = seq * 10), part `part`.
    fn rec(seq: u64, part: u32, last: bool) -> RecordHeader {
        RecordHeader {
            seq,
            part,
            last,
            commit_pages: if last { 5 } else { 0 },
            page_count: 1,
            observed_ms: 0,
            wal_checksum: seq * 10,
        }
    }

    #[test]
    fn admission_checks_epoch_then_replica_then_generation_then_page_size() {
        let h = held(3, 30);
        assert_eq!(admit(&h, true, Epoch(2), 7, Some(4096)), Ok(()));
        assert_eq!(
            admit(&h, true, Epoch(1), 8, Some(512)),
            Err(Rejection::Fenced {
                epoch: Epoch(1),
                held: Epoch(2)
            }),
            "an older epoch is fenced whatever else is wrong"
        );
        assert_eq!(
            admit(&h, true, Epoch(3), 7, Some(4096)),
            Err(Rejection::NewerEpoch {
                epoch: Epoch(3),
                held: Epoch(2)
            })
        );
        assert_eq!(
            admit(&h, false, Epoch(2), 8, None),
            Err(Rejection::NoReplica),
            "a replica that is not open cannot be applied to"
        );
        let none = Pos { flags: 0, ..h };
        assert_eq!(
            admit(&none, true, Epoch(2), 7, None),
            Err(Rejection::NoReplica)
        );
        assert_eq!(
            admit(&h, true, Epoch(2), 8, Some(512)),
            Err(Rejection::OtherGeneration {
                generation: 8,
                held: 7
            })
        );
        assert_eq!(
            admit(&h, true, Epoch(2), 7, Some(8192)),
            Err(Rejection::PageSize {
                page_size: 8192,
                held: 4096
            })
        );
        assert_eq!(
            admit(&h, true, Epoch(2), 7, None),
            Ok(()),
            "a base has no page size"
        );
        assert_eq!(fence(Epoch(2), Epoch(2)), Ok(()));
        assert_eq!(
            fence(Epoch(2), Epoch(5)),
            Ok(()),
            "a base may bring a newer epoch"
        );
        assert!(matches!(
            fence(Epoch(2), Epoch(1)),
            Err(Rejection::Fenced { .. })
        ));
    }

    // Guards against a resend being applied twice: what the replica holds is skipped, and
    // only what follows is made ready, in order.
    #[test]
    fn held_records_are_skipped_and_the_rest_follows_in_order() {
        let records = [
            rec(2, 0, true),
            rec(3, 0, true),
            rec(4, 0, true),
            rec(5, 0, true),
        ];
        let p = plan(&held(3, 30), None, &records).unwrap();
        assert_eq!(p.steps, vec![Step::Whole(2), Step::Whole(3)]);
        assert_eq!(p.ready, vec![4, 5]);
        let all_held = plan(&held(5, 50), None, &records).unwrap();
        assert_eq!(
            all_held,
            Plan::default(),
            "a resend of what is held is a no-op"
        );
    }

    // Guards against applying past a hole: the first record that does not follow ends the
    // usable prefix; with no prefix the request is refused with where to resume.
    #[test]
    fn a_gap_ends_the_prefix_and_a_request_with_no_prefix_is_behind() {
        let p = plan(
            &held(3, 30),
            None,
            &[rec(4, 0, true), rec(6, 0, true), rec(7, 0, true)],
        )
        .unwrap();
        assert_eq!(p.ready, vec![4], "nothing after the gap is taken");
        assert_eq!(
            plan(&held(3, 30), None, &[rec(6, 0, true)]),
            Err(Rejection::Behind { seq: 6, part: 0 })
        );
        assert_eq!(
            plan(&held(3, 30), None, &[rec(4, 1, true)]),
            Err(Rejection::Behind { seq: 4, part: 1 }),
            "a part with no spool to follow is behind"
        );
    }

    // Guards against a transaction in parts resuming at the wrong part: the spool says
    // which part comes next; parts below it are resends.
    #[test]
    fn parts_resume_where_the_spool_stands() {
        let spooled = Partial {
            seq: 4,
            next_part: 2,
        };
        let records = [
            rec(4, 0, false),
            rec(4, 1, false),
            rec(4, 2, false),
            rec(4, 3, true),
        ];
        let p = plan(&held(3, 30), Some(spooled), &records).unwrap();
        assert_eq!(
            p.steps,
            vec![
                Step::Part {
                    index: 2,
                    last: false
                },
                Step::Part {
                    index: 3,
                    last: true
                }
            ]
        );
        assert_eq!(p.ready, vec![4]);
        assert_eq!(
            plan(&held(3, 30), Some(spooled), &[rec(4, 3, true)]),
            Err(Rejection::Behind { seq: 4, part: 3 })
        );
        let stale = Partial {
            seq: 9,
            next_part: 5,
        };
        let p = plan(&held(3, 30), Some(stale), &[rec(4, 0, false)]).unwrap();
        assert_eq!(
            p.steps,
            vec![Step::Part {
                index: 0,
                last: false
            }],
            "a spool of another transaction is replaced from part 0"
        );
    }

    // Guards against a finished transaction in parts reading its pages from the spool of
    // the next: what is ready is applied before a new spool begins.
    #[test]
    fn ready_transactions_are_flushed_before_a_new_spool_begins() {
        let records = [
            rec(4, 0, true),
            rec(5, 0, false),
            rec(5, 1, true),
            rec(6, 0, false),
            rec(6, 1, true),
            rec(7, 0, true),
        ];
        let p = plan(&held(3, 30), None, &records).unwrap();
        use Step::*;
        assert_eq!(
            p.steps,
            vec![
                Whole(0),
                Flush,
                Part {
                    index: 1,
                    last: false
                },
                Part {
                    index: 2,
                    last: true
                },
                Flush,
                Part {
                    index: 3,
                    last: false
                },
                Part {
                    index: 4,
                    last: true
                },
                Whole(5)
            ]
        );
        assert_eq!(p.ready, vec![4, 5, 6, 7]);
    }

    // Guards against applying a forked history: a record at the replica's position with
    // another checksum refuses the whole request, before anything in it is applied.
    #[test]
    fn a_record_at_the_position_with_another_checksum_is_a_fork() {
        let mut other = rec(3, 0, true);
        other.wal_checksum = 99;
        assert_eq!(
            plan(&held(3, 30), None, &[other, rec(4, 0, true)]),
            Err(Rejection::Forked {
                seq: 3,
                theirs: 99,
                ours: 30
            })
        );
        assert!(
            plan(&held(3, 0), None, &[other, rec(4, 0, true)]).is_ok(),
            "0: not known"
        );
        let mut unknown = other;
        unknown.wal_checksum = 0;
        assert!(plan(&held(3, 30), None, &[unknown]).is_ok());
        let mut part = other;
        part.last = false;
        assert!(
            plan(&held(3, 30), None, &[part]).is_ok(),
            "only a last part carries the transaction's checksum"
        );
        // After a flush, the position compared against is the transaction flushed.
        let mut late = rec(4, 0, true);
        late.wal_checksum = 41;
        assert_eq!(
            plan(
                &held(3, 30),
                None,
                &[rec(4, 0, true), rec(5, 0, false), late]
            ),
            Err(Rejection::Forked {
                seq: 4,
                theirs: 41,
                ours: 40
            })
        );
    }

    /// Against a reference model: for random positions, spools and requests made of
    /// resends, parts and gaps, what the plan makes ready is always the run of seqs right
    /// after the position, and never skips a part.
    #[test]
    fn what_is_ready_always_follows_the_position_without_a_gap() {
        let mut rng = SplitMix64::seeded(44);
        for _ in 0..2000 {
            let pos = rng.below(5);
            let partial = (rng.below(3) == 0).then(|| Partial {
                seq: pos + 1,
                next_part: rng.below(3) as u32,
            });
            let mut records = Vec::new();
            let mut seq = pos.saturating_sub(rng.below(3)).max(1);
            while records.len() < 8 {
                let parts = 1 + rng.below(3) as u32;
                for part in 0..parts {
                    records.push(rec(seq, part, part + 1 == parts));
                }
                seq += 1 + u64::from(rng.below(6) == 0);
            }
            let Ok(p) = plan(&held(pos, pos * 10), partial, &records) else {
                continue;
            };
            let expected: Vec<u64> = (pos + 1..).take(p.ready.len()).collect();
            assert_eq!(p.ready, expected, "{records:?} from {pos} ({partial:?})");
            for step in &p.steps {
                if let Step::Part { index, .. } = *step
                    && records[index].part > 0
                {
                    let prev = p.steps.iter().any(|s| {
                        matches!(*s, Step::Part { index: i, .. }
                            if records[i].seq == records[index].seq
                                && records[i].part + 1 == records[index].part)
                    });
                    let resumed = partial.is_some_and(|q| {
                        q.seq == records[index].seq && q.next_part == records[index].part
                    });
                    assert!(
                        prev || resumed,
                        "part {index} of {records:?} follows nothing"
                    );
                }
            }
        }
    }
}
