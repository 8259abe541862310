//! A deterministic simulation of the log on `SimStorage`, from one seed per run: random
//! appends, waits, flushes, retirements, injected write and sync failures, and crashes
//! that keep only what was synced plus a torn part of the rest. After every recovery:
//! every acknowledged record is there, what is there is a contiguous run of what was
//! appended (nothing reordered, duplicated or made up), and a failed write or sync is
//! followed only by refusals.
//!
//! `FERRY_LOG_SEED=N` runs one seed; `FERRY_LOG_SEEDS=N` sets how many (default 300).

use ferry_core::seams::{Rng, SplitMix64};
use ferry_log::sim::SimStorage;
use ferry_log::{Config, Error, Log};
use std::sync::Arc;

fn config() -> Config {
    Config {
        segment_bytes: 4096,
        record_bytes_max: 1024,
        pending_bytes_max: 8 << 10,
        ..Config::default()
    }
}

/// Payload: the record's index, then filler derived from it.
fn payload(index: u64, len: usize) -> Vec<u8> {
    let mut p = index.to_le_bytes().to_vec();
    p.extend((0..len).map(|i| (index as usize * 31 + i) as u8));
    p
}

/// What a run went through, so the suite can check that its faults really happen.
#[derive(Debug, Default)]
struct Seen {
    torn_tails: u64,
    failed_writes_or_syncs: u64,
    retired: u64,
    /// Segments made from retired ones (spares).
    reused: u64,
    segments_max: usize,
    acked: u64,
}

fn run(seed: u64, seen: &mut Seen) -> Result<(), String> {
    let mut rng = SplitMix64::seeded(seed);
    let sim = Arc::new(SimStorage::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    // Every record appended and not known lost, in order: (kind, payload).
    let mut appended: Vec<(u8, Vec<u8>)> = Vec::new();
    // appended[..acked] were reported durable and must survive.
    let mut acked = 0usize;
    for round in 0..10 {
        let at = |what: &str| format!("seed {seed}, round {round}: {what}");
        let (log, recovery) =
            Log::open(sim.clone(), config()).map_err(|e| at(&format!("open failed: {e}")))?;
        seen.torn_tails += u64::from(recovery.torn_bytes > 0);
        seen.segments_max = seen.segments_max.max(recovery.segments);
        if recovery.end != log.durable_lsn() {
            return Err(at("recovery end differs from the durable position"));
        }
        // What survived: a contiguous run of indexes, ending at or after the last acked.
        let mut got: Vec<(u64, u8, Vec<u8>)> = Vec::new();
        log.read(log.start_lsn(), |r| {
            let index = u64::from_le_bytes(r.payload[..8].try_into().unwrap());
            got.push((index, r.kind, r.payload.to_vec()));
        })
        .map_err(|e| at(&format!("read failed: {e}")))?;
        for w in got.windows(2) {
            if w[1].0 != w[0].0 + 1 {
                return Err(at(&format!(
                    "records {} then {}: not contiguous",
                    w[0].0, w[1].0
                )));
            }
        }
        for (index, kind, p) in &got {
            match appended.get(*index as usize) {
                Some((k, want)) if k == kind && want == p => {}
                _ => return Err(at(&format!("record {index} is not what was appended"))),
            }
        }
        let survived = got.last().map_or(0, |g| g.0 as usize + 1);
        if survived < acked {
            return Err(at(&format!(
                "{acked} records were acknowledged, only {survived} survived"
            )));
        }
        // What did not survive was never acknowledged: forget it.
        appended.truncate(survived);
        acked = survived;

        let mut ends: Vec<(usize, u64)> = Vec::new();
        let mut poisoned = false;
        for _ in 0..rng.below(60) + 1 {
            match rng.below(20) {
                0 => sim.fail_write_after(rng.below(3) + 1),
                1 => sim.fail_sync_after(rng.below(3) + 1),
                // Lands in a segment's creation (made from a spare or not) or in a
                // retirement's removal or rename, whichever syncs the directory next.
                6 => sim.fail_sync_dir_after(rng.below(2) + 1),
                2 | 3 => {
                    if let Some(&(i, lsn)) = ends.get(rng.below(ends.len() as u64 + 1) as usize) {
                        match log.wait_durable(lsn) {
                            Ok(()) => {
                                if log.durable_lsn() < lsn {
                                    return Err(at("a waiter woke before its record was durable"));
                                }
                                acked = acked.max(i + 1);
                            }
                            Err(Error::Io { .. } | Error::PreviousIo { .. }) => {
                                poisoned = true;
                                break;
                            }
                            Err(e) => return Err(at(&format!("wait failed oddly: {e}"))),
                        }
                    }
                }
                4 => match log.flush() {
                    Ok(_) => acked = appended.len(),
                    Err(Error::Io { .. } | Error::PreviousIo { .. }) => {
                        poisoned = true;
                        break;
                    }
                    Err(e) => return Err(at(&format!("flush failed oddly: {e}"))),
                },
                5 if acked > 0 => {
                    // Retire below an acknowledged record: as a checkpoint would.
                    let keep_from = ends.first().map_or(0, |e| e.1);
                    seen.retired += log.retire_below(keep_from).unwrap_or(0) as u64;
                }
                _ => {
                    let index = appended.len() as u64;
                    let len = match rng.below(10) {
                        0 => rng.below(1016) as usize,
                        _ => rng.below(120) as usize,
                    };
                    let kind = rng.below(255) as u8 + 1;
                    let p = payload(index, len);
                    match log.append(kind, &p) {
                        Ok(end) => {
                            appended.push((kind, p));
                            ends.push((index as usize, end));
                        }
                        Err(Error::PreviousIo { .. }) => {
                            poisoned = true;
                            break;
                        }
                        Err(e) => return Err(at(&format!("append failed oddly: {e}"))),
                    }
                }
            }
        }
        seen.acked += acked as u64;
        seen.reused += log.stats().segments_reused;
        if poisoned {
            seen.failed_writes_or_syncs += 1;
            // After a failed write or sync, nothing more is accepted.
            match log.append(1, &payload(u64::MAX, 0)) {
                Err(Error::PreviousIo { .. }) => {}
                other => return Err(at(&format!("append after a failed sync: {other:?}"))),
            }
        }
        if !poisoned && rng.below(4) == 0 {
            // A clean close makes everything durable.
            if log.close().is_ok() {
                acked = appended.len();
            }
        } else {
            sim.halt();
            drop(log);
        }
        if rng.below(3) == 0 {
            // Killed without a power loss: what was written stays in the page cache,
            // unsynced; the next open must make it durable before reporting it so, or
            // the power loss of a later round loses it.
            sim.kill();
        } else {
            sim.crash();
        }
    }
    Ok(())
}

#[test]
fn simulated_crashes_never_lose_acknowledged_records() {
    if let Ok(one) = std::env::var("FERRY_LOG_SEED") {
        let seed = one.parse().expect("FERRY_LOG_SEED is a number");
        if let Err(e) = run(seed, &mut Seen::default()) {
            panic!("{e}");
        }
        return;
    }
    let seeds: u64 = std::env::var("FERRY_LOG_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let mut seen = Seen::default();
    for seed in 0..seeds {
        if let Err(e) = run(seed, &mut seen) {
            panic!("{e}\nreproduce with: FERRY_LOG_SEED={seed} cargo test -p ferry-log --test sim");
        }
    }
    eprintln!("{seeds} seeds: {seen:?}");
    if seeds >= 100 {
        assert!(
            seen.torn_tails > 0
                && seen.failed_writes_or_syncs > 0
                && seen.retired > 0
                && seen.reused > 0
                && seen.segments_max > 2,
            "the simulation did not reach every fault it is meant to: {seen:?}"
        );
    }
}

#[test]
fn damage_before_a_durable_batch_is_refused_not_skipped() {
    let sim = Arc::new(SimStorage::new(1));
    let (log, _) = Log::open(sim.clone(), config()).unwrap();
    for i in 0..3u64 {
        let end = log.append(7, &payload(i, 40)).unwrap();
        log.wait_durable(end).unwrap();
    }
    log.close().unwrap();
    // The first batch starts right after the 32-byte segment header; damage its frame.
    sim.flip_bit("00000000000000000000.seg", 32 + 24 + 12, 3);
    match Log::open(sim.clone(), config()) {
        Err(Error::Corrupted {
            segment,
            offset,
            reason,
        }) => {
            assert_eq!(segment, "00000000000000000000.seg");
            assert_eq!(offset, 32);
            assert!(reason.contains("durable batch follows"), "{reason}");
        }
        Ok(_) => panic!("a damaged log opened"),
        Err(e) => panic!("wrong error: {e}"),
    }
}

#[test]
fn damage_to_the_last_batch_is_a_torn_tail() {
    let sim = Arc::new(SimStorage::new(2));
    let (log, _) = Log::open(sim.clone(), config()).unwrap();
    let first = log.append(7, &payload(0, 40)).unwrap();
    log.wait_durable(first).unwrap();
    let second = log.append(7, &payload(1, 40)).unwrap();
    log.wait_durable(second).unwrap();
    log.close().unwrap();
    // The second batch starts where the first one ends, rounded up to 8 bytes: damage a
    // byte of its record's payload (after its 24-byte header and the 9-byte frame header).
    sim.flip_bit(
        "00000000000000000000.seg",
        first.div_ceil(8) * 8 + 24 + 12,
        0,
    );
    let (log, recovery) = Log::open(sim.clone(), config()).unwrap();
    assert!(recovery.torn_bytes > 0);
    assert_eq!(recovery.end, first.div_ceil(8) * 8);
    let mut n = 0;
    log.read(0, |_| n += 1).unwrap();
    assert_eq!(n, 1, "the record before the damaged last batch survives");
}

#[test]
fn a_driven_log_makes_records_durable_only_when_its_driver_writes() {
    let sim = Arc::new(SimStorage::new(7));
    let (log, _) = Log::open_driven(sim.clone(), config()).unwrap();
    let start = log.durable_lsn();
    let mut end = 0;
    // More than pending_bytes_max: a driven log's appends never wait for the disk.
    for i in 0..40 {
        end = log.append(1, &payload(i, 500)).unwrap();
    }
    assert_eq!(
        log.durable_lsn(),
        start,
        "nothing is durable before the driver writes"
    );
    let (writes, syncs) = sim.counts();
    assert!(log.write_pending());
    assert!(log.durable_lsn() >= end);
    let durable = log.durable_lsn();
    assert!(sim.counts().1 > syncs && sim.counts().0 > writes);
    assert!(!log.write_pending(), "nothing left to write");
    // Dropped without a write: what was appended since is lost to a crash; closing
    // writes it.
    log.append(1, &payload(40, 10)).unwrap();
    drop(log);
    sim.crash();
    let (log, rec) = Log::open_driven(sim.clone(), config()).unwrap();
    assert_eq!(rec.end, durable);
    let after = log.append(1, &payload(40, 10)).unwrap();
    log.close().unwrap();
    sim.crash();
    let (_log, rec) = Log::open(sim, config()).unwrap();
    assert!(rec.end >= after);
}

/// How many spare segments the storage holds.
fn spares(sim: &SimStorage) -> usize {
    use ferry_log::Storage;
    sim.list()
        .unwrap()
        .iter()
        .filter(|n| n.ends_with(".spare"))
        .count()
}

/// Power loss with `log` open, then open it again.
fn crash_and_reopen(sim: &Arc<SimStorage>, log: Log, at: &dyn Fn(&str) -> String) -> Log {
    sim.halt();
    drop(log);
    sim.crash();
    Log::open_driven(sim.clone(), config())
        .unwrap_or_else(|e| panic!("{}", at(&format!("reopen: {e}"))))
        .0
}

/// Every record the log holds after a recovery, by index (the payload's first 8 bytes).
fn indexes(log: &Log) -> Vec<u64> {
    let mut got = Vec::new();
    log.read(log.start_lsn(), |r| {
        got.push(u64::from_le_bytes(r.payload[..8].try_into().unwrap()))
    })
    .unwrap();
    got
}

// A retirement whose directory sync failed leaves its removal undecided; the next
// retirement must not remove the segment after it until that one is decided, or a crash
// can bring the first back without the second: a gap ("a segment is missing or was
// cut"), as the random walk found at seeds 200 and 204.
#[test]
fn a_retirement_after_one_whose_directory_sync_failed_leaves_no_gap() {
    // Each of two retirements fails at its first or its second directory sync, whichever
    // follows a removal; the crash then decides every undecided name on its own.
    for seed in 0..32u64 {
        for (first, second) in [(1, 1), (1, 2), (2, 1), (2, 2)] {
            let at = |what: &str| format!("seed {seed}, syncs {first} and {second}: {what}");
            let sim = Arc::new(SimStorage::new(seed));
            let (log, _) = Log::open_driven(sim.clone(), config()).unwrap();
            let mut next = 0u64;
            while log.stats().segments < 8 {
                log.append(1, &payload(next, 300)).unwrap();
                next += 1;
                log.write_pending();
            }
            let appended = indexes(&log);
            for fail in [first, second] {
                let below = log.durable_lsn();
                sim.fail_sync_dir_after(fail);
                let _ = log.retire_below(below);
            }
            let still = indexes(&log);
            let log = crash_and_reopen(&sim, log, &at);
            let got = indexes(&log);
            assert!(
                got.ends_with(&still) && appended.ends_with(&got),
                "{}",
                at(&format!("held {still:?} of {appended:?}, got {got:?}"))
            );
        }
    }
}

#[test]
fn crashes_while_a_segment_becomes_a_spare_or_a_spare_a_segment_lose_nothing() {
    // A driven log, so that the directory sync that fails is the one meant: the
    // retirement's (a segment renamed to a spare) or the new segment's (a spare renamed
    // to it). The crash then keeps the old name, the new one, both or neither.
    for seed in 0..200u64 {
        let at = |what: &str| format!("seed {seed}: {what}");
        let sim = Arc::new(SimStorage::new(seed));
        let (log, _) = Log::open_driven(sim.clone(), config()).unwrap();
        let mut next = 0u64;
        let mut append_until = |log: &Log, pred: &dyn Fn(&Log) -> bool| {
            while !pred(log) {
                log.append(1, &payload(next, 300)).unwrap();
                next += 1;
                log.write_pending();
            }
        };
        // Five segments, the oldest three (or more) retired: each becomes a spare.
        append_until(&log, &|l| l.stats().segments >= 5);
        let retired = log.retire_below(log.durable_lsn()).unwrap();
        assert!(retired >= 3, "{}", at("retired too few"));
        let in_retirement = seed % 2 == 0;
        if in_retirement {
            // One more retirement (of several segments, so it keeps spares again: as
            // many as it retires), its directory sync failing after the first rename.
            append_until(&log, &|l| l.stats().segments >= 5);
            let before = spares(&sim);
            // The retirement's second directory sync: its first comes before any rename.
            sim.fail_sync_dir_after(2);
            assert!(
                log.retire_below(log.durable_lsn()).is_err(),
                "{}",
                at("retire")
            );
            assert_eq!(spares(&sim), before + 1, "{}", at("renamed to a spare"));
        } else {
            // The next segment made from a spare, its directory sync failing.
            let before = log.stats().segments_reused;
            let spares_before = spares(&sim);
            sim.fail_sync_dir_after(1);
            let segments = log.stats().segments;
            while log.stats().segments == segments {
                log.append(1, &payload(next, 300)).unwrap();
                next += 1;
                log.write_pending();
            }
            assert_eq!(
                log.stats().segments_reused,
                before,
                "{}",
                at("a failed creation counts")
            );
            assert_eq!(spares(&sim), spares_before - 1, "{}", at("a spare renamed"));
        }
        let durable = log.durable_lsn();
        let first_kept = log.start_lsn();
        let mut kept = Vec::new();
        log.read(first_kept, |r| {
            if r.end <= durable {
                kept.push(u64::from_le_bytes(r.payload[..8].try_into().unwrap()))
            }
        })
        .unwrap();
        let log = crash_and_reopen(&sim, log, &at);
        let got = indexes(&log);
        assert!(
            kept.iter().all(|k| got.contains(k)),
            "{}",
            at(&format!(
                "acknowledged records lost: kept {kept:?}, got {got:?}"
            ))
        );
        // The log goes on, and reuses what spares survived.
        let from = log.end_lsn();
        for i in 0..60 {
            log.append(1, &payload(1_000_000 + i, 300)).unwrap();
            log.write_pending();
        }
        let mut after = Vec::new();
        log.read(from, |r| {
            after.push(u64::from_le_bytes(r.payload[..8].try_into().unwrap()))
        })
        .unwrap();
        assert_eq!(
            after,
            (1_000_000..1_000_060).collect::<Vec<_>>(),
            "{}",
            at("after")
        );
        log.close().unwrap();
        let (log, rec) = Log::open_driven(sim.clone(), config()).unwrap();
        assert_eq!(
            rec.torn_bytes,
            0,
            "{}",
            at("a clean close leaves nothing to cut")
        );
        assert!(indexes(&log).ends_with(&(1_000_000..1_000_060).collect::<Vec<_>>()));
    }
}

#[test]
fn waiters_registered_out_of_order_each_wake_once_their_position_is_durable() {
    use std::future::Future;
    use std::pin::Pin;
    use std::task::{Context, Poll, Waker};
    type Wait = Pin<Box<dyn Future<Output = Result<(), Error>> + Send>>;
    let ready = |f: &mut Wait| {
        matches!(
            f.as_mut().poll(&mut Context::from_waker(Waker::noop())),
            Poll::Ready(Ok(()))
        )
    };
    let sim = Arc::new(SimStorage::new(11));
    let (log, _) = Log::open_driven(sim, config()).unwrap();
    let ends: Vec<u64> = (0..3)
        .map(|i| log.append(1, &payload(i, 40)).unwrap())
        .collect();
    // Registered newest first, then oldest, then between, then one position twice: each
    // goes to its own place.
    let mut waits: Vec<Wait> = [2, 0, 1, 1]
        .map(|i| Box::pin(log.durable(ends[i])) as Wait)
        .into();
    assert!(
        waits.iter_mut().all(|w| !ready(w)),
        "nothing is durable yet"
    );
    assert!(log.write_pending());
    assert!(waits.iter_mut().all(ready), "every waiter woke");
    let later = log.append(1, &payload(3, 40)).unwrap();
    let mut w: Wait = Box::pin(log.durable(later));
    assert!(
        !ready(&mut w),
        "a record appended after the write waits for the next"
    );
    assert!(log.write_pending());
    assert!(ready(&mut w));
}

#[test]
fn a_failed_write_fails_every_waiter_queued() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let sim = Arc::new(SimStorage::new(12));
    let (log, _) = Log::open_driven(sim.clone(), config()).unwrap();
    let ends: Vec<u64> = (0..3)
        .map(|i| log.append(1, &payload(i, 40)).unwrap())
        .collect();
    let mut waits: Vec<_> = [1, 2, 0, 2].map(|i| Box::pin(log.durable(ends[i]))).into();
    sim.fail_write_after(1);
    log.write_pending();
    for w in &mut waits {
        match w.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Err(Error::Io { .. })) => {}
            other => panic!("a waiter of a failed write got {other:?}"),
        }
    }
    assert!(matches!(
        log.append(1, b"after"),
        Err(Error::PreviousIo { .. })
    ));
}

#[test]
fn the_writers_cycles_are_counted_by_duration() {
    // (The buckets' arithmetic is ferry-core's Log2Histogram, tested there.)
    let sim = Arc::new(SimStorage::new(13));
    let (log, _) = Log::open_driven(sim, config()).unwrap();
    for i in 0..5 {
        log.append(1, &payload(i, 40)).unwrap();
        assert!(log.write_pending());
    }
    let s = log.stats();
    assert_eq!(s.write_us.count(), 5, "one count per cycle");
}

#[test]
fn on_durable_calls_once_durable_at_once_if_already_and_with_the_error_if_never() {
    use std::sync::mpsc;
    let sim = Arc::new(SimStorage::new(3));
    let (log, _) = Log::open(sim.clone(), config()).unwrap();
    let (tx, rx) = mpsc::channel::<(u32, Result<(), String>)>();
    let call = |n: u32| {
        let tx = tx.clone();
        move |r: Result<(), Error>| {
            let _ = tx.send((n, r.map_err(|e| e.to_string())));
        }
    };
    // Called by the writer once the record is durable.
    let end = log.append(7, &payload(0, 40)).unwrap();
    log.on_durable(end, None, call(1));
    let (n, r) = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
    assert_eq!((n, r), (1, Ok(())));
    assert!(log.durable_lsn() >= end);
    // Already durable: called at once, on this thread.
    log.on_durable(end, None, call(2));
    assert_eq!(rx.try_recv().unwrap().0, 2);
    // A sync that fails: called with the error; after it, at once with the error.
    sim.fail_sync_after(1);
    let end = log.append(7, &payload(1, 40)).unwrap();
    log.on_durable(end, None, call(3));
    let (n, r) = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
    assert_eq!(n, 3);
    assert!(r.is_err(), "a failed sync is reported");
    log.on_durable(end, None, call(4));
    let (n, r) = rx.try_recv().unwrap();
    assert_eq!(n, 4);
    assert!(r.is_err(), "a poisoned log reports at once");
}

/// Guards `Log::read_while`: it hands records in order from a position, across segments,
/// stops after the first one it is told to, and says where it stopped.
#[test]
fn read_while_stops_where_it_is_told_and_says_where() {
    let sim = Arc::new(SimStorage::new(7));
    let (log, _) = Log::open_driven(sim, config()).unwrap();
    let mut ends = Vec::new();
    for i in 0..40u64 {
        ends.push(log.append(1, &payload(i, 100)).unwrap());
        log.write_pending();
    }
    assert!(log.stats().segments > 1, "the records span segments");
    let mut seen = Vec::new();
    let upto = log
        .read_while(ends[9], |r| {
            seen.push(u64::from_le_bytes(r.payload[..8].try_into().unwrap()));
            seen.len() < 5
        })
        .unwrap();
    assert_eq!(seen, vec![10, 11, 12, 13, 14]);
    assert_eq!(upto, ends[14]);
    let mut all = 0;
    let upto = log.read_while(0, |_| {
        all += 1;
        true
    });
    assert_eq!((all, upto.unwrap()), (40, log.durable_lsn()));
}
