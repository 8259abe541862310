//! The receiver as a library, fed records directly: cases too precise to provoke through a
//! shipper.

use ferry_core::epoch::Epoch;
use ferry_ship::proto::{self, BaseHeader, RecordHeader, TxnsQuery};
use ferry_ship::{Receiver, ReceiverConfig};
use rusqlite::Connection;
use std::path::Path;
use std::sync::Arc;

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ferry-receiver-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A base stream of a small database with `rows` rows, and its page count.
fn base_stream(dir: &Path, generation: u64, rows: usize) -> (Vec<u8>, u32) {
    let conn = Connection::open(dir.join("primary.db")).unwrap();
    conn.execute_batch("PRAGMA journal_mode=WAL; CREATE TABLE t(x BLOB);")
        .unwrap();
    for _ in 0..rows {
        conn.execute("INSERT INTO t VALUES (randomblob(3000))", [])
            .unwrap();
    }
    let pages: Vec<Vec<u8>> = conn
        .prepare("SELECT data FROM sqlite_dbpage ORDER BY pgno")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let h = BaseHeader {
        page_size: 4096,
        page_count: pages.len() as u32,
        epoch: Epoch(0),
        generation,
        seq: 0,
        observed_ms: 0,
        wal_checksum: 0,
    };
    let mut body = h.encode().to_vec();
    let mut crc = 0;
    for p in &pages {
        crc = crc32c::crc32c_append(crc, p);
        body.extend_from_slice(p);
    }
    body.extend_from_slice(&proto::base_trailer(crc));
    (body, pages.len() as u32)
}

fn record(out: &mut Vec<u8>, seq: u64, part: u32, last: bool, size: u32, pages: &[(u32, u8)]) {
    let images: Vec<(u32, Vec<u8>)> = pages
        .iter()
        .map(|(n, fill)| (*n, vec![*fill; 4096]))
        .collect();
    let h = RecordHeader {
        seq,
        part,
        last,
        commit_pages: if last { size } else { 0 },
        page_count: images.len() as u32,
        observed_ms: 0,
        wal_checksum: seq,
    };
    proto::encode_record(out, &h, images.iter().map(|(n, d)| (*n, d.as_slice())));
}

fn page(db: &Path, pgno: u32) -> Vec<u8> {
    Connection::open(db)
        .unwrap()
        .query_row(
            "SELECT data FROM sqlite_dbpage WHERE pgno = ?1",
            [pgno],
            |r| r.get(0),
        )
        .unwrap()
}

/// A receiver in `dir/standby` with a replica "a" installed from a base of `rows` rows at
/// `generation`, the query of requests that follow it, and the replica's page count.
fn standby(dir: &Path, generation: u64, rows: usize) -> (Arc<Receiver>, TxnsQuery, u32) {
    let (base, size) = base_stream(dir, generation, rows);
    let receiver = Receiver::open(ReceiverConfig::new(dir.join("standby"))).unwrap();
    receiver
        .apply_base("a", Epoch(0), generation, &mut base.as_slice())
        .unwrap();
    let q = TxnsQuery {
        epoch: 0,
        generation,
        page_size: 4096,
    };
    (receiver, q, size)
}

// Guards against a finished transaction in parts reading its pages from the spool of the
// next one: a request that completes one multi-part transaction and starts another must
// apply the first before the spool is replaced.
#[test]
fn a_request_finishing_one_transaction_in_parts_and_starting_another_keeps_both() {
    let dir = scratch("parts");
    let (receiver, q, size) = standby(&dir, 7, 40);
    assert!(size > 12);

    let mut first = Vec::new();
    record(&mut first, 1, 0, true, size, &[(2, 0x11)]);
    record(&mut first, 2, 0, false, size, &[(3, 0x22), (4, 0x22)]);
    let p = receiver.apply_txns("a", q, &first).unwrap();
    assert_eq!((p.seq, p.pending_part), (1, 1));

    let mut second = Vec::new();
    record(&mut second, 2, 1, true, size, &[(5, 0x23), (6, 0x23)]);
    record(
        &mut second,
        3,
        0,
        false,
        size,
        &[(7, 0x33), (8, 0x33), (9, 0x33), (10, 0x33)],
    );
    record(&mut second, 3, 1, true, size, &[(11, 0x34), (12, 0x34)]);
    let p = receiver.apply_txns("a", q, &second).unwrap();
    assert_eq!(p.seq, 3);
    assert_eq!(
        p.checksum, 3,
        "the position keeps the checksum of the last transaction"
    );

    let db = dir.join("standby").join("a.db");
    for (pgno, fill) in [
        (2, 0x11),
        (3, 0x22),
        (4, 0x22),
        (5, 0x23),
        (6, 0x23),
        (7, 0x33),
        (10, 0x33),
        (11, 0x34),
        (12, 0x34),
    ] {
        assert!(
            page(&db, pgno).iter().all(|b| *b == fill),
            "page {pgno} does not hold {fill:#x}"
        );
    }
    drop(receiver);
    std::fs::remove_dir_all(&dir).unwrap();
}

// Guards against a resend being applied twice or out of order: records the replica holds
// are skipped, and a request that does not follow is refused with the position.
#[test]
fn resends_are_skipped_and_gaps_are_refused_with_the_position() {
    let dir = scratch("resend");
    let (receiver, q, size) = standby(&dir, 9, 20);
    let mut body = Vec::new();
    record(&mut body, 1, 0, true, size, &[(2, 1)]);
    record(&mut body, 2, 0, true, size, &[(3, 2)]);
    assert_eq!(receiver.apply_txns("a", q, &body).unwrap().seq, 2);
    assert_eq!(
        receiver.apply_txns("a", q, &body).unwrap().seq,
        2,
        "a resend is idempotent"
    );
    let mut gap = Vec::new();
    record(&mut gap, 5, 0, true, size, &[(4, 5)]);
    let refusal = receiver.apply_txns("a", q, &gap).unwrap_err();
    assert_eq!(refusal.0.code, proto::Code::Behind);
    assert_eq!(refusal.0.position.unwrap().seq, 2);
    let stale = TxnsQuery {
        epoch: 0,
        generation: 8,
        page_size: 4096,
    };
    assert_eq!(
        receiver.apply_txns("a", stale, &body).unwrap_err().0.code,
        proto::Code::NeedsBase
    );
    drop(receiver);
    std::fs::remove_dir_all(&dir).unwrap();
}

// Guards against applying a forked history: a request whose record at the receiver's own
// position carries another WAL checksum than the one applied is refused whole, before the
// records after it can land on a state they do not follow.
#[test]
fn a_request_from_a_forked_history_is_refused() {
    let dir = scratch("fork");
    let (receiver, q, size) = standby(&dir, 11, 20);
    let mut body = Vec::new();
    record(&mut body, 1, 0, true, size, &[(2, 1)]);
    record(&mut body, 2, 0, true, size, &[(3, 2)]);
    assert_eq!(receiver.apply_txns("a", q, &body).unwrap().seq, 2);
    let before = page(&dir.join("standby").join("a.db"), 4);

    let mut forked = Vec::new();
    let images = [vec![7u8; 4096]];
    let h = RecordHeader {
        seq: 2,
        part: 0,
        last: true,
        commit_pages: size,
        page_count: 1,
        observed_ms: 0,
        wal_checksum: 99,
    };
    proto::encode_record(&mut forked, &h, [(3u32, images[0].as_slice())]);
    record(&mut forked, 3, 0, true, size, &[(4, 3)]);
    let refusal = receiver.apply_txns("a", q, &forked).unwrap_err();
    assert_eq!(
        refusal.0.code,
        proto::Code::NeedsBase,
        "{}",
        refusal.0.error
    );
    assert!(refusal.0.error.contains("forked"), "{}", refusal.0.error);
    assert_eq!(
        page(&dir.join("standby").join("a.db"), 4),
        before,
        "a refused request changed the replica"
    );
    drop(receiver);
    std::fs::remove_dir_all(&dir).unwrap();
}

// Guards against a replica's WAL growing for as long as transactions keep arriving: a
// checkpoint on a connection of its own never reaches the WAL's end while groups commit,
// and SQLite restarts a WAL only from there. Under a steady stream, with a reader polling,
// the WAL must restart again and again.
#[test]
fn a_replica_wal_restarts_under_a_steady_stream_of_transactions() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    let dir = scratch("restart");
    let (receiver, q, size) = standby(&dir, 3, 40);
    receiver.start_checkpointer();
    let db = dir.join("standby").join("a.db");
    let wal = dir.join("standby").join("a.db-wal");
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (db, stop) = (db.clone(), stop.clone());
        std::thread::spawn(move || {
            let c = Connection::open(&db).unwrap();
            while !stop.load(Ordering::Relaxed) {
                let _: Vec<u8> = c
                    .query_row("SELECT data FROM sqlite_dbpage WHERE pgno = 1", [], |r| {
                        r.get(0)
                    })
                    .unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };

    // Back to back, eight pages a transaction, for three seconds and at least six
    // checkpoints' worth of pages. The WAL header's checkpoint sequence (bytes 12..16)
    // counts its restarts.
    let limit = ferry_ship::receiver::replica::CHECKPOINT_BYTES;
    let restarts_of = |wal: &Path| -> Option<[u8; 4]> {
        use std::os::unix::fs::FileExt;
        let mut seq = [0u8; 4];
        let f = std::fs::File::open(wal).ok()?;
        f.read_exact_at(&mut seq, 12).ok()?;
        Some(seq)
    };
    let (mut seq, mut written, mut wal_max, mut restarts) = (0u64, 0u64, 0u64, 0);
    let mut last = restarts_of(&wal);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) || written < 6 * limit {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "applying is stuck"
        );
        seq += 1;
        let pages: Vec<(u32, u8)> = (0..8)
            .map(|i| (2 + (seq as u32 * 8 + i) % (size - 2), seq as u8))
            .collect();
        let mut body = Vec::new();
        record(&mut body, seq, 0, true, size, &pages);
        receiver.apply_txns("a", q, &body).unwrap();
        written += 8 * 4096;
        wal_max = wal_max.max(std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0));
        let now = restarts_of(&wal);
        if now != last {
            restarts += 1;
            last = now;
        }
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    assert!(
        restarts >= 3,
        "the replica's WAL restarted {restarts} times in {:?} of back-to-back transactions \
         ({written} bytes of pages; the WAL reached {wal_max} bytes)",
        start.elapsed()
    );
    drop(receiver);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Copy a receiver directory's files to `to`, leaving out SQLite's `-shm` files: what a
/// second process, opening the copy first, rebuilds its index from.
fn copy_without_shm(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_without_shm(&e.path(), &to.join(&name));
        } else if !name.ends_with("-shm") {
            std::fs::copy(e.path(), to.join(&name)).unwrap();
        }
    }
}

// Guards against a group that recovery decided had not committed coming back later. A
// receiver killed inside SQLite's commit can leave the group's frames whole and synced in
// the replica's `-wal` while the index in `-shm` (kept alive by a reader holding the
// replica open) does not count them yet: every connection opened meanwhile sees the state
// before the group, and recovery decides "not committed". Once every connection closes,
// the next to open rebuilds the index from the `-wal` and finds the group: the replica then
// holds content the position record says it does not, and readers see it. Recovery must
// make its decision final before it records it.
#[test]
fn a_group_decided_uncommitted_never_comes_back_from_the_replica_wal() {
    use std::os::unix::fs::FileExt;

    let dir = scratch("orphan");
    let (receiver, q, size) = standby(&dir, 5, 20);
    let mut first = Vec::new();
    record(&mut first, 1, 0, true, size, &[(2, 0x11)]);
    assert_eq!(receiver.apply_txns("a", q, &first).unwrap().seq, 1);
    let standby_dir = dir.join("standby");
    let db = standby_dir.join("a.db");
    // A reader of the replica, read-only as docs/ship.md advises, holding it open
    // throughout: its `-shm` stays alive, and when it is the last to close it cannot
    // checkpoint the `-wal` away.
    let reader =
        Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let seen: Vec<u8> = reader
        .query_row("SELECT data FROM sqlite_dbpage WHERE pgno = 2", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert!(seen.iter().all(|b| *b == 0x11));
    drop(receiver);

    // The crash image: the same replica with seq 2 committed into its `-wal` by a process
    // that never updated this `-shm`, and the position record that commit left (post = 2,
    // with the intent).
    let twin = dir.join("twin");
    copy_without_shm(&standby_dir, &twin);
    // Held open so that no connection of the twin's receiver is ever the last one: the last
    // to close checkpoints the WAL and deletes it, and the next commit would start a new
    // WAL instead of appending to this one.
    let twin_holder = Connection::open(twin.join("a.db")).unwrap();
    twin_holder
        .query_row("SELECT count(*) FROM sqlite_dbpage", [], |r| {
            r.get::<_, i64>(0)
        })
        .unwrap();
    let twin_receiver = Receiver::open(ReceiverConfig::new(&twin)).unwrap();
    let mut second = Vec::new();
    record(&mut second, 2, 0, true, size, &[(3, 0x22), (4, 0x22)]);
    assert_eq!(twin_receiver.apply_txns("a", q, &second).unwrap().seq, 2);
    let wal = std::fs::read(twin.join("a.db-wal")).unwrap();
    let state = std::fs::read(twin.join(".ferry").join("a.state")).unwrap();
    drop(twin_receiver);
    drop(twin_holder);
    std::fs::OpenOptions::new()
        .write(true)
        .open(standby_dir.join("a.db-wal"))
        .unwrap()
        .write_all_at(&wal, 0)
        .unwrap();
    std::fs::write(standby_dir.join(".ferry").join("a.state"), &state).unwrap();

    // Recovery, with the reader still holding the replica open.
    let receiver = Receiver::open(ReceiverConfig::new(&standby_dir)).unwrap();
    let decided = receiver.position("a").unwrap().unwrap().seq;
    assert_eq!(
        decided, 1,
        "the crash image was not made: recovery saw seq 2 committed"
    );
    drop(receiver);
    drop(reader);

    // Every connection is closed: the next one rebuilds the index from the `-wal`.
    let holds_seq_2 = page(&db, 3).iter().all(|b| *b == 0x22);
    assert_eq!(
        holds_seq_2,
        decided == 2,
        "recovery recorded seq {decided}, but the replica, once reopened, {} seq 2",
        if holds_seq_2 {
            "holds"
        } else {
            "does not hold"
        }
    );
    // And the receiver reopened on it agrees, and goes on from there.
    let receiver = Receiver::open(ReceiverConfig::new(&standby_dir)).unwrap();
    assert_eq!(receiver.position("a").unwrap().unwrap().seq, decided);
    let mut both = Vec::new();
    record(&mut both, 2, 0, true, size, &[(3, 0x22), (4, 0x22)]);
    record(&mut both, 3, 0, true, size, &[(5, 0x33)]);
    assert_eq!(receiver.apply_txns("a", q, &both).unwrap().seq, 3);
    drop(receiver);
    for (pgno, fill) in [(2, 0x11), (3, 0x22), (4, 0x22), (5, 0x33)] {
        assert!(
            page(&db, pgno).iter().all(|b| *b == fill),
            "page {pgno} does not hold {fill:#x}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// Guards the clock seam: a receiver reads time only through ReceiverConfig::clock, so a
// test that drives the clock sees it in what the receiver reports (the stamp of the last
// apply, the lag from the shipper's observation to it, the uptime).
#[test]
fn the_receiver_reads_time_through_its_clock() {
    let dir = scratch("clock");
    let (base, size) = base_stream(&dir, 4, 10);
    let mut config = ReceiverConfig::new(dir.join("standby"));
    config.clock = Arc::new(ferry_core::seams::StillClock {
        at: std::time::Instant::now(),
        wall_ms: 1_000_000,
    });
    let receiver = Receiver::open(config).unwrap();
    receiver
        .apply_base("a", Epoch(0), 4, &mut base.as_slice())
        .unwrap();
    let h = RecordHeader {
        seq: 1,
        part: 0,
        last: true,
        commit_pages: size,
        page_count: 1,
        observed_ms: 999_250,
        wal_checksum: 1,
    };
    let mut body = Vec::new();
    let image = vec![0x42u8; 4096];
    proto::encode_record(&mut body, &h, [(2u32, image.as_slice())]);
    let q = TxnsQuery {
        epoch: 0,
        generation: 4,
        page_size: 4096,
    };
    receiver.apply_txns("a", q, &body).unwrap();
    let status = receiver.status();
    let a = &status.replicas[0];
    assert_eq!(a.last_apply_ms, Some(1_000_000));
    assert_eq!(a.lag_ms, Some(750));
    assert_eq!(status.uptime_secs, 0, "the clock stood still");
    drop(receiver);
    std::fs::remove_dir_all(&dir).unwrap();
}
