//! The log on real files: round trips across segments and reopenings, group commit under
//! many appending threads, torn tails and damage written into real segment files, limits,
//! the directory lock, and a writer process SIGKILLed mid-stream.

use ferry_log::{Config, Error, Log};
use ferry_testkit::Scratch;
use std::io::{BufRead, BufReader};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn small() -> Config {
    Config {
        segment_bytes: 16 << 10,
        record_bytes_max: 4 << 10,
        pending_bytes_max: 1 << 20,
        ..Config::default()
    }
}

fn all(log: &Log) -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    log.read(log.start_lsn(), |r| out.push((r.kind, r.payload.to_vec())))
        .unwrap();
    out
}

/// The names in `dir` that end with `suffix`, sorted.
fn names(dir: &std::path::Path, suffix: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(suffix))
        .collect();
    v.sort();
    v
}

fn segments(dir: &std::path::Path) -> Vec<String> {
    names(dir, ".seg")
}

#[test]
fn records_survive_reopening_across_segments_and_retirement() {
    let scratch = Scratch::new("log-roundtrip");
    let dir = scratch.dir("log");
    let want: Vec<(u8, Vec<u8>)> = (0..400u32)
        .map(|i| ((i % 250) as u8 + 1, vec![i as u8; (i as usize * 7) % 300]))
        .collect();
    let mut ends = Vec::new();
    {
        let (log, rec) = Log::open_dir(&dir, small()).unwrap();
        assert_eq!((rec.records, rec.torn_bytes), (0, 0));
        for (k, p) in &want {
            ends.push(log.append(*k, p).unwrap());
        }
        let end = log.flush().unwrap();
        assert_eq!(end, *ends.last().unwrap());
        assert!(log.durable_lsn() >= end);
        assert_eq!(all(&log), want);
        log.close().unwrap();
    }
    assert!(
        segments(&dir).len() > 3,
        "small segments roll: {:?}",
        segments(&dir)
    );
    let (log, rec) = Log::open_dir(&dir, small()).unwrap();
    assert_eq!(rec.records, want.len() as u64);
    assert_eq!(rec.torn_bytes, 0);
    assert_eq!(all(&log), want);
    // Reading from a record's position starts at that record.
    let mut from_100 = Vec::new();
    log.read(ends[99], |r| from_100.push(r.payload.to_vec()))
        .unwrap();
    assert_eq!(from_100.len(), 300);
    assert_eq!(from_100[0], want[100].1);

    // Retire below record 299's end: whole segments below it go, the rest reads.
    let before = segments(&dir).len();
    let removed = log.retire_below(ends[299]).unwrap();
    assert!(removed > 0);
    assert_eq!(segments(&dir).len(), before - removed);
    let kept = all(&log);
    assert!(kept.len() >= 100 && kept.len() < 400);
    assert_eq!(kept[..], want[400 - kept.len()..]);
    assert!(matches!(log.read(0, |_| {}), Err(Error::Invalid(_))));
    drop(log);
    let (log, _) = Log::open_dir(&dir, small()).unwrap();
    assert_eq!(all(&log), kept);
}

fn spares(dir: &std::path::Path) -> Vec<String> {
    names(dir, ".spare")
}

fn two_spares() -> Config {
    Config {
        spare_segments: 2,
        ..small()
    }
}

/// A retirement keeps no more spares than it retires segments (the next interval's
/// likely need), up to `spare_segments`: a log written slowly does not hold a full
/// quota of disk for spares it will not use, one written fast keeps enough for all.
#[test]
fn a_retirement_keeps_as_many_spares_as_it_retires_up_to_the_limit() {
    let scratch = Scratch::new("log-spares-need");
    let dir = scratch.dir("log");
    let config = Config {
        segment_bytes: 4096,
        record_bytes_max: 1024,
        spare_segments: 5,
        ..Config::default()
    };
    let (log, _) = Log::open_dir(&dir, config).unwrap();
    // Write until `n` more segments exist, then retire all but the newest.
    let grow_and_retire = |n: usize| {
        let target = log.stats().segments + n;
        while log.stats().segments < target {
            log.append(1, &[9u8; 1000]).unwrap();
            log.flush().unwrap();
        }
        // A batch in the newest segment, so every older one may go.
        log.append(1, &[9u8; 10]).unwrap();
        log.flush().unwrap();
        log.retire_below(log.durable_lsn()).unwrap()
    };
    let retired = grow_and_retire(2);
    assert_eq!(spares(&dir).len(), retired.min(5), "retired {retired}");
    // Written fast: many segments between two retirements; the limit holds.
    let retired = grow_and_retire(9);
    assert!(retired >= 9, "retired {retired}");
    assert_eq!(spares(&dir).len(), 5);
    // Written slowly: the spares made most of the next segment; one retired adds none
    // beyond what one interval needs.
    let before = spares(&dir).len();
    grow_and_retire(1);
    assert!(
        spares(&dir).len() <= before,
        "{} spares kept after retiring one segment, {before} before",
        spares(&dir).len()
    );
    log.close().unwrap();
}

#[test]
fn retired_segments_are_reused_and_what_they_held_is_never_read() {
    let scratch = Scratch::new("log-reuse");
    let dir = scratch.dir("log");
    let record = |i: u32| {
        (
            (i % 250) as u8 + 1,
            vec![(i % 251) as u8; 100 + (i as usize * 13) % 400],
        )
    };
    let (log, _) = Log::open_dir(&dir, two_spares()).unwrap();
    let mut ends = Vec::new();
    for i in 0..300 {
        let (k, p) = record(i);
        ends.push(log.append(k, &p).unwrap());
    }
    log.flush().unwrap();
    // Two retired segments become spares; any more are removed.
    let retired = log.retire_below(ends[250]).unwrap();
    assert!(retired >= 3, "retired {retired}");
    assert_eq!(spares(&dir).len(), 2);
    let files = || segments(&dir).len() + spares(&dir).len();
    let before = files();
    // The next segments are made from the spares: no file is created for them, and
    // what they held (older batches, at other positions) lies after their batches.
    let mut want: Vec<(u8, Vec<u8>)> = Vec::new();
    let from = log.end_lsn();
    let mut i = 300;
    while log.stats().segments_reused < 2 || !spares(&dir).is_empty() || files() == before {
        let (k, p) = record(i);
        log.append(k, &p).unwrap();
        want.push((k, p));
        i += 1;
        if i % 20 == 0 {
            log.flush().unwrap();
        }
        assert!(i < 2000, "the spares were not reused: {:?}", log.stats());
    }
    // One more segment past the last reused one, so reused segments are not the newest.
    let seg_count = segments(&dir).len();
    while segments(&dir).len() == seg_count {
        let (k, p) = record(i);
        log.append(k, &p).unwrap();
        want.push((k, p));
        i += 1;
        log.flush().unwrap();
    }
    let read = |log: &Log, from| {
        let mut out = Vec::new();
        log.read(from, |r| out.push((r.kind, r.payload.to_vec())))
            .unwrap();
        out
    };
    assert_eq!(read(&log, from), want);
    log.close().unwrap();
    // Reopening reads every reused segment up to where the next begins.
    let (log, rec) = Log::open_dir(&dir, two_spares()).unwrap();
    assert_eq!(rec.torn_bytes, 0);
    assert_eq!(read(&log, from), want);
    // A reused segment that is the newest when the process dies: what follows its end
    // (the spare's old bytes) is cut, and nothing after the end is read.
    let retired = log.retire_below(log.end_lsn()).unwrap();
    assert!(retired > 0);
    assert!(!spares(&dir).is_empty());
    let from = log.end_lsn();
    let mut want = Vec::new();
    let reused = log.stats().segments_reused;
    while log.stats().segments_reused == reused {
        let (k, p) = record(i);
        log.append(k, &p).unwrap();
        want.push((k, p));
        i += 1;
        log.flush().unwrap();
    }
    // What a killed process leaves: its files as they are, with no clean close to cut
    // the reused segment at the end.
    let copy = scratch.dir("killed");
    for f in segments(&dir).into_iter().chain(spares(&dir)) {
        std::fs::copy(dir.join(&f), copy.join(&f)).unwrap();
    }
    let (killed, rec) = Log::open_dir(&copy, two_spares()).unwrap();
    assert!(rec.torn_bytes > 0, "the old bytes after the end are cut");
    assert_eq!(read(&killed, from), want);
    drop(killed);
    // A clean close cuts it there itself: the next open has nothing to cut.
    log.close().unwrap();
    let (log, rec) = Log::open_dir(&dir, two_spares()).unwrap();
    assert_eq!(rec.torn_bytes, 0);
    assert_eq!(read(&log, from), want);
}

#[test]
fn one_sync_covers_many_appenders() {
    let scratch = Scratch::new("log-group");
    let (log, _) = Log::open_dir(&scratch.dir("log"), Config::default()).unwrap();
    let log = Arc::new(log);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let log = log.clone();
            std::thread::spawn(move || {
                for i in 0..200u32 {
                    let end = log.append(1, &[t as u8, i as u8]).unwrap();
                    log.wait_durable(end).unwrap();
                    assert!(log.durable_lsn() >= end);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stats = log.stats();
    assert_eq!(stats.records, 1600);
    // Eight writers each waiting for their record: syncs are shared.
    assert!(stats.syncs < stats.records, "{stats:?}");
    assert_eq!(all(&log).len(), 1600);
}

#[test]
fn a_cycle_trace_keeps_each_cycle_in_order_and_only_while_asked() {
    let scratch = Scratch::new("log-trace");
    let (log, _) = Log::open_dir(&scratch.dir("log"), Config::default()).unwrap();
    let durable = |payload: &[u8]| {
        let end = log.append(1, payload).unwrap();
        log.wait_durable(end).unwrap();
        end
    };
    durable(b"before");
    assert!(log.take_cycles().is_empty(), "off by default");
    // Records waited for one at a time: one cycle each. A cycle is kept after its wake,
    // so the one before (or after) may be kept too: each cycle is known by the record
    // it made durable (it publishes the end of its last batch, at or past the record's).
    let run = |capacity: usize| {
        log.trace_cycles(capacity);
        let ends: Vec<_> = (0..5u8).map(|i| durable(&[i])).collect();
        let fence = durable(b"fence");
        let (cycles, later): (Vec<_>, Vec<_>) = log
            .take_cycles()
            .into_iter()
            .filter(|c| c.end >= ends[0])
            .partition(|c| c.end < fence);
        assert!(later.len() <= 1, "only the fence's cycle: {later:?}");
        (ends, cycles)
    };
    let (ends, cycles) = run(10);
    assert_eq!(cycles.len(), ends.len(), "{cycles:?}");
    for (c, w) in cycles.iter().zip(ends.windows(2)) {
        assert!(c.end >= w[0] && c.end < w[1], "{c:?} {ends:?}");
    }
    assert!(cycles[4].end >= ends[4]);
    for c in &cycles {
        assert!(c.began <= c.followed && c.followed <= c.taken, "{c:?}");
        assert!(c.taken <= c.synced && c.synced <= c.woke, "{c:?}");
        assert_eq!(c.batches, 1);
    }
    assert!(cycles.windows(2).all(|w| w[0].woke <= w[1].began));
    // Two kept: the newest.
    let (ends, cycles) = run(2);
    assert!(
        cycles.len() <= 2 && cycles.iter().all(|c| c.end >= ends[3]),
        "{cycles:?}"
    );
    log.trace_cycles(0);
    durable(b"after");
    assert!(log.take_cycles().is_empty(), "off again");
}

/// A log whose writer waits up to `follow` for its followers, one follower of it, and a
/// runtime to wait on it from.
fn following(
    scratch: &Scratch,
    follow: Duration,
) -> (Log, ferry_log::Follower, tokio::runtime::Runtime) {
    let config = Config {
        follow,
        ..Config::default()
    };
    let (log, _) = Log::open_dir(&scratch.dir("log"), config).unwrap();
    let follower = log.follower();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    (log, follower, rt)
}

#[test]
fn after_a_sync_the_writer_waits_for_the_followers_it_woke() {
    let scratch = Scratch::new("log-follow");
    // Long enough that only the follower going idle ends the writer's wait.
    let (log, follower, rt) = following(&scratch, Duration::from_secs(30));
    rt.block_on(async {
        let first = log.append(1, b"a").unwrap();
        log.durable_following(first, &follower).await.unwrap();
        // Woken by that sync, the follower replies with two records, a pause apart:
        // the writer waits for it, so both go in the next batch.
        let batches = log.stats().batches;
        log.append(1, b"b").unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let end = log.append(1, b"c").unwrap();
        assert!(log.durable_lsn() < end, "nothing written while it works");
        follower.idle();
        log.durable(end).await.unwrap();
        assert_eq!(log.stats().batches, batches + 1);
        // Idle twice, or idle when not woken: nothing to undo.
        follower.idle();
        let end = log.append(1, b"d").unwrap();
        log.durable(end).await.unwrap();
    });
    assert_eq!(all(&log).len(), 4);
}

#[test]
fn a_follower_that_never_goes_idle_delays_the_writer_at_most_its_follow() {
    let scratch = Scratch::new("log-follow-stuck");
    let (log, follower, rt) = following(&scratch, Duration::from_millis(100));
    for i in 0..3u8 {
        // Woken each time, never idle: every sync after waits out the follow, no more.
        let end = log.append(1, &[i]).unwrap();
        rt.block_on(log.durable_following(end, &follower)).unwrap();
    }
    let end = log.append(1, b"other").unwrap();
    log.wait_durable(end).unwrap();
    // Closing while the writer waits for the follower ends the wait.
    let end = log.append(1, b"last").unwrap();
    log.close().unwrap();
    let (log, _) = Log::open_dir(&scratch.dir("log"), Config::default()).unwrap();
    assert!(
        log.durable_lsn() >= end,
        "the last record survived the close"
    );
    assert_eq!(all(&log).len(), 5);
}

/// Guards the wiring of the writer's clock: its wait for a follower that never goes
/// idle must end when the clock it was given says `follow` has passed. Read from the
/// system clock, each of these syncs would wait an hour.
#[test]
fn the_writers_wait_for_followers_reads_the_clock_it_was_given() {
    let scratch = Scratch::new("log-follow-clock");
    let storage = ferry_log::FileStorage::open(&scratch.dir("log")).unwrap();
    let config = Config {
        follow: Duration::from_secs(3600),
        ..Config::default()
    };
    // An hour later at every read.
    let clock = Arc::new(ferry_core::seams::SteppingClock::new(
        Instant::now(),
        Duration::from_secs(3600),
    ));
    let (log, _) = Log::open_with_clock(Arc::new(storage), config, clock.clone()).unwrap();
    let follower = log.follower();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for i in 0..3u8 {
        let end = log.append(1, &[i]).unwrap();
        rt.block_on(log.durable_following(end, &follower)).unwrap();
    }
    let end = log.append(1, b"other").unwrap();
    log.wait_durable(end).unwrap();
    assert!(
        clock.reads.load(std::sync::atomic::Ordering::SeqCst) >= 2,
        "the writer read the clock"
    );
    log.close().unwrap();
}

#[test]
fn async_waiters_resolve_when_durable() {
    let scratch = Scratch::new("log-async");
    let (log, _) = Log::open_dir(&scratch.dir("log"), Config::default()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut ends = Vec::new();
        for i in 0..100u8 {
            ends.push(log.append(2, &[i]).unwrap());
        }
        for end in ends {
            log.durable(end).await.unwrap();
            assert!(log.durable_lsn() >= end);
        }
        assert!(matches!(
            log.durable(log.end_lsn() + 100).await,
            Err(Error::Invalid(_))
        ));
    });
}

#[test]
fn a_torn_tail_on_disk_is_cut_and_damage_before_durable_records_is_refused() {
    let scratch = Scratch::new("log-torn");
    let dir = scratch.dir("log");
    let good = {
        let (log, _) = Log::open_dir(&dir, small()).unwrap();
        for i in 0..5u8 {
            let end = log.append(3, &[i; 50]).unwrap();
            log.wait_durable(end).unwrap();
        }
        log.durable_lsn()
    };
    let seg = dir.join("00000000000000000000.seg");
    // The writer keeps zeroes ahead of the end: a clean reopen keeps them.
    let filled = std::fs::metadata(&seg).unwrap().len();
    assert!(filled > good);
    {
        let (_, rec) = Log::open_dir(&dir, small()).unwrap();
        assert_eq!((rec.end, rec.torn_bytes, rec.records), (good, 0, 5));
    }
    // A write the crash cut: half a batch header and some bytes, over the zeroes.
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[good as usize..good as usize + 11]
        .copy_from_slice(&[0x46, 0x4c, 0x42, 0x31, 9, 9, 9, 0, 1, 2, 3]);
    std::fs::write(&seg, &bytes).unwrap();
    {
        let (log, rec) = Log::open_dir(&dir, small()).unwrap();
        assert_eq!(
            rec.torn_bytes,
            filled - good,
            "the torn write and the zeroes after it"
        );
        assert_eq!(rec.records, 5);
        assert_eq!(all(&log).len(), 5);
    }
    assert_eq!(
        std::fs::metadata(&seg).unwrap().len(),
        good,
        "the tail was cut"
    );

    // Damage inside the first record, with four durable batches after it.
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[32 + 24 + 9 + 10] ^= 0xff;
    std::fs::write(&seg, &bytes).unwrap();
    match Log::open_dir(&dir, small()) {
        Err(e @ Error::Corrupted { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("00000000000000000000.seg at byte 32"), "{msg}");
            assert!(msg.contains("restore"), "{msg}");
        }
        Ok(_) => panic!("a damaged log opened"),
        Err(e) => panic!("wrong error: {e}"),
    }
    // Refusing changed nothing.
    assert_eq!(std::fs::read(&seg).unwrap(), bytes);
}

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    let scratch = Scratch::new("log-bad");
    let dir = scratch.dir("log");
    let (log, _) = Log::open_dir(&dir, small()).unwrap();
    let end = log.append(1, b"kept").unwrap();
    assert!(matches!(
        log.append(1, &vec![0u8; 5000]),
        Err(Error::TooLarge {
            len: 5000,
            max: 4096
        })
    ));
    assert!(matches!(log.append(0, b"x"), Err(Error::Invalid(_))));
    assert_eq!(log.end_lsn(), end);
    match Log::open_dir(&dir, small()) {
        Err(e) => assert!(e.to_string().contains("locked by another process"), "{e}"),
        Ok(_) => panic!("a second open of a locked log succeeded"),
    }
    let bad = Config {
        segment_bytes: 4096,
        record_bytes_max: 8192,
        pending_bytes_max: 1,
        ..Config::default()
    };
    match Log::open_dir(&scratch.dir("other"), bad) {
        Err(Error::Config(e)) => assert_eq!(e.setting, "record_bytes_max", "{e}"),
        other => panic!(
            "a record larger than a segment accepted: {:?}",
            other.map(|_| ())
        ),
    }
    let too_many_spares = Config {
        spare_segments: 65,
        ..small()
    };
    match Log::open_dir(&scratch.dir("other"), too_many_spares) {
        Err(Error::Config(e)) => {
            assert_eq!(
                (e.setting, e.value.as_str()),
                ("spare_segments", "65"),
                "{e}"
            )
        }
        other => panic!("65 spares accepted: {:?}", other.map(|_| ())),
    }
    log.close().unwrap();
    let (log, _) = Log::open_dir(&dir, small()).unwrap();
    assert_eq!(all(&log), vec![(1, b"kept".to_vec())]);
}

/// The child side of `sigkill_mid_stream_loses_nothing_acknowledged` (this test binary,
/// run again with FERRY_LOG_CHILD_DIR set).
fn child_appends_until_killed(dir: String) {
    let (log, _) = Log::open_dir(std::path::Path::new(&dir), small()).unwrap();
    let log = Arc::new(log);
    let mut start = 0u64;
    log.read(log.start_lsn(), |_| start += 1).unwrap();
    // Four threads append numbered records in turn; each prints an index once durable.
    let next = Arc::new(std::sync::Mutex::new(start));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (log, next) = (log.clone(), next.clone());
            std::thread::spawn(move || {
                loop {
                    let (i, end) = {
                        let mut n = next.lock().unwrap();
                        let i = *n;
                        *n += 1;
                        (i, log.append(1, &i.to_le_bytes()).unwrap())
                    };
                    log.wait_durable(end).unwrap();
                    println!("acked {i}");
                }
            })
        })
        .collect();
    // The threads never return: the parent SIGKILLs this process.
    for t in threads {
        let _ = t.join();
    }
}

#[test]
fn sigkill_mid_stream_loses_nothing_acknowledged() {
    if let Ok(dir) = std::env::var("FERRY_LOG_CHILD_DIR") {
        return child_appends_until_killed(dir);
    }
    let scratch = Scratch::new("log-kill");
    let dir = scratch.dir("log");
    let exe = std::env::current_exe().unwrap();
    let mut acked_max = None;
    for round in 0..3 {
        let mut child = std::process::Command::new(&exe)
            .args([
                "--exact",
                "sigkill_mid_stream_loses_nothing_acknowledged",
                "--nocapture",
            ])
            .env("FERRY_LOG_CHILD_DIR", &dir)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut seen = 0;
        while seen < 2000 + round * 500 && Instant::now() < deadline {
            let Some(Ok(line)) = lines.next() else { break };
            if let Some(i) = line.strip_prefix("acked ") {
                let i: u64 = i.parse().unwrap();
                acked_max = Some(acked_max.map_or(i, |m: u64| m.max(i)));
                seen += 1;
            }
        }
        assert!(seen > 0, "the child acknowledged nothing");
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let (log, rec) = Log::open_dir(&dir, small()).unwrap();
        let mut indexes = Vec::new();
        log.read(log.start_lsn(), |r| {
            indexes.push(u64::from_le_bytes(r.payload.try_into().unwrap()))
        })
        .unwrap();
        assert_eq!(rec.records as usize, indexes.len());
        // Numbers are taken in append order, so the log holds exactly 0..n.
        for (pos, i) in indexes.iter().enumerate() {
            assert_eq!(
                *i, pos as u64,
                "round {round}: record {pos} holds index {i}"
            );
        }
        let max = acked_max.unwrap();
        assert!(
            indexes.len() as u64 > max,
            "round {round}: index {max} was acknowledged, the log holds {} records",
            indexes.len()
        );
    }
}
