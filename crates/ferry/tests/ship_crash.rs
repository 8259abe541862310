//! Crashes at every step (docs/ship.md §6): SIGKILL of the shipper and the receiver at
//! random moments, torn and damaged WAL tails, and crash images of a running receiver.
//! Every test ends with the replica equal to the primary, verified by the workload's hash
//! chain, and a watcher that saw only whole transactions and never went backwards.

mod common;

use common::*;
use ferry_testkit::workload::{self, Writer, WriterConfig};
use ferry_testkit::{Rng, wait_until};
use rusqlite::Connection;
use std::time::Duration;

/// Fill a primary with `n` transactions before anything ships, so bases take a while.
fn prefill(rig: &Rig, name: &str, n: u64, payload: u64) {
    let conn = workload::open_app(&rig.db(name), true).unwrap();
    let mut rng = Rng::new(11);
    for _ in 0..n {
        workload::write(&conn, &mut rng, workload::Shape::Rows { rows: 8, payload }).unwrap();
    }
}

// C1. Guards against a shipper crash leaving a wrong replica or a torn state file: SIGKILL
// at random moments, mid-batch, mid-base (its state deleted so restarts take bases) and
// mid-fold (folds every 100 frames), while the app writes throughout.
#[test]
fn shipper_killed_mid_batch_mid_base_and_mid_fold() {
    let mut rng = Rng::from_env("c1");
    let mut rig = Rig::new("c1");
    rig.ship_args = vec!["--fold-min-frames".into(), "100".into()];
    prefill(&rig, "a", 2000, 1500);
    rig.start_receiver();
    rig.start_shipper();
    let watcher = Watcher::start(rig.replica_path("a"), true);
    let writer = Writer::start(
        &rig.db("a"),
        WriterConfig {
            rate: 300,
            seed: rng.next_u64(),
            ..WriterConfig::default()
        },
    );
    for i in 0..14 {
        std::thread::sleep(Duration::from_millis(rng.range(30, 400)));
        rig.kill_shipper();
        if i % 4 == 1 {
            // Lose the state: the next run must send a base, which the next kill may cut.
            let _ = std::fs::remove_file(rig.primary.join(".ferry-ship").join("a.json"));
        }
        std::thread::sleep(Duration::from_millis(rng.range(0, 200)));
        rig.start_shipper();
    }
    let last = writer.stop();
    rig.wait_synced("a", last, Duration::from_secs(60));
    rig.assert_equal("a");
    let (verified, _) = watcher.stop();
    assert!(verified > 0);
    let log = rig.shipper_log();
    assert!(!log.contains("panicked"), "{}", tail(&log));
}

// C2. Guards against a receiver crash losing or half-applying a transaction: SIGKILL at
// random moments while it applies groups and spools transactions split into parts; after
// each restart the shipper resumes from the receiver's position, never needing a base.
#[test]
fn receiver_killed_mid_apply_and_mid_parts_resumes_without_a_base() {
    let mut rng = Rng::from_env("c2");
    let mut rig = Rig::new("c2");
    rig.start_receiver();
    rig.start_shipper();
    let watcher = Watcher::start(rig.replica_path("a"), true);
    let writer = Writer::start(
        &rig.db("a"),
        WriterConfig {
            rate: 150,
            big_percent: 3,
            big_bytes: 5 << 20,
            seed: rng.next_u64(),
            ..WriterConfig::default()
        },
    );
    assert!(
        wait_until(Duration::from_secs(30), || rig
            .position("a")
            .is_some_and(|p| p.seq > 10)),
        "nothing was applied before the kills: {:?}",
        rig.db_status("a")
    );
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(rng.range(50, 500)));
        rig.kill_receiver();
        std::thread::sleep(Duration::from_millis(rng.range(0, 300)));
        rig.start_receiver();
    }
    let last = writer.stop();
    rig.wait_synced("a", last, Duration::from_secs(90));
    rig.assert_equal("a");
    watcher.stop();
    let d = rig.db_status("a").unwrap();
    assert_eq!(
        d.bases.values().sum::<u64>(),
        1,
        "receiver restarts cost a base: {:?}",
        d.bases
    );
}

// C3a. Guards against shipping a torn or damaged tail of the primary's WAL: whatever the
// damage in the last frame, the replica must equal what SQLite itself recovers, which is
// everything up to the previous commit.
#[test]
fn a_torn_or_damaged_primary_wal_tail_is_never_shipped() {
    let mut rng = Rng::from_env("c3a");
    let mut rig = Rig::new("c3a");
    let template = rig.scratch.dir("template");
    {
        let conn = workload::open_app(&template.join("t.db"), true).unwrap();
        for _ in 0..40 {
            workload::write(
                &conn,
                &mut rng,
                workload::Shape::Rows {
                    rows: 3,
                    payload: 300,
                },
            )
            .unwrap();
        }
    }
    let wal = std::fs::read(template.join("t.db-wal")).unwrap();
    let db = std::fs::read(template.join("t.db")).unwrap();
    let frame = 24 + 4096;
    let frames = (wal.len() - 32) / frame;
    let last_frame = 32 + (frames - 1) * frame;
    let variants: Vec<(&str, Vec<u8>)> = vec![
        ("cut-in-header", wal[..last_frame + 10].to_vec()),
        (
            "cut-in-page",
            wal[..last_frame + 24 + rng.range(1, 4000) as usize].to_vec(),
        ),
        ("flip-page", {
            let mut w = wal.clone();
            w[last_frame + 24 + rng.range(0, 4096) as usize] ^= 0x5a;
            w
        }),
        ("flip-header", {
            let mut w = wal.clone();
            w[last_frame + rng.range(0, 8) as usize] ^= 0x01;
            w
        }),
        ("flip-salt", {
            let mut w = wal.clone();
            w[last_frame + 9] ^= 0x80;
            w
        }),
    ];
    for (name, w) in &variants {
        std::fs::write(rig.db(name), &db).unwrap();
        std::fs::write(rig.primary.join(format!("{name}.db-wal")), w).unwrap();
    }
    rig.start_receiver();
    rig.start_shipper();
    for (name, _) in &variants {
        let expected = workload::txns(&Connection::open(rig.db(name)).unwrap());
        assert!(
            expected < 40,
            "{name}: SQLite should have dropped the damaged last transaction"
        );
        rig.wait_synced(name, expected, Duration::from_secs(30));
        rig.assert_equal(name);
    }
}

// C3b. Guards against a receiver trusting a damaged tail of its own WAL: garbage after
// the last frame (a write in flight at the crash) is dropped by recovery and shipping
// resumes from the recorded position.
#[test]
fn garbage_after_the_replica_wal_is_dropped_on_restart() {
    let mut rig = Rig::new("c3b");
    rig.start_receiver();
    rig.start_shipper();
    let writer = Writer::start(
        &rig.db("a"),
        WriterConfig {
            rate: 200,
            ..WriterConfig::default()
        },
    );
    assert!(wait_until(Duration::from_secs(30), || rig
        .position("a")
        .is_some_and(|p| p.seq > 50)));
    let before = rig.position("a").unwrap().seq;
    rig.kill_receiver();
    let wal = replica_wal(&rig, "a");
    let mut bytes = std::fs::read(&wal).unwrap();
    bytes.extend_from_slice(&Rng::new(5).bytes(6000));
    std::fs::write(&wal, bytes).unwrap();
    rig.start_receiver();
    // The restarted receiver recovered past the garbage and applies again.
    assert!(
        wait_until(Duration::from_secs(30), || rig
            .position("a")
            .is_some_and(|p| p.seq > before)),
        "the receiver did not apply after its restart: {:?}",
        rig.position("a")
    );
    let last = writer.stop();
    rig.wait_synced("a", last, Duration::from_secs(30));
    rig.assert_equal("a");
}

fn replica_wal(rig: &Rig, name: &str) -> std::path::PathBuf {
    rig.standby.join(format!("{name}.db-wal"))
}

// C3c. Guards against a receiver whose files, at any instant, could not be recovered to
// an exact position: crash images taken by freezing it (SIGSTOP) and copying its
// directory must each recover to a replica that verifies and whose recorded position
// matches its content exactly (transactions in the replica minus seq is constant within
// a generation).
#[test]
fn crash_images_of_a_running_receiver_recover_to_exact_positions() {
    let mut rng = Rng::from_env("c3c");
    let mut rig = Rig::new("c3c");
    rig.start_receiver();
    rig.start_shipper();
    let writer = Writer::start(
        &rig.db("a"),
        WriterConfig {
            rate: 400,
            seed: rng.next_u64(),
            ..WriterConfig::default()
        },
    );
    assert!(wait_until(Duration::from_secs(20), || rig
        .position("a")
        .is_some_and(|p| p.seq > 10)));
    let mut images = Vec::new();
    for i in 0..8 {
        std::thread::sleep(Duration::from_millis(rng.range(20, 300)));
        rig.receiver().stop();
        let image = rig.scratch.path().join(format!("image-{i}"));
        copy_dir(&rig.standby, &image);
        rig.receiver().cont();
        images.push(image);
    }
    let last = writer.stop();
    rig.wait_synced("a", last, Duration::from_secs(30));
    let live = rig.position("a").unwrap();
    let offset = workload::txns(&rig.replica("a")) as i64 - live.seq as i64;
    rig.stop_receiver();
    for image in images {
        let receiver = ferry_ship::Receiver::open(ferry_ship::ReceiverConfig::new(&image)).unwrap();
        let pos = receiver
            .position("a")
            .unwrap()
            .expect("the image holds a replica");
        drop(receiver);
        let c = Connection::open(image.join("a.db")).unwrap();
        assert_eq!(workload::integrity(&c), "ok", "{}", image.display());
        let v = workload::verify(&c).unwrap_or_else(|e| panic!("{}: {e}", image.display()));
        assert_eq!(pos.generation, live.generation);
        assert_eq!(
            v.txns as i64 - pos.seq as i64,
            offset,
            "{}: position {} does not match its content",
            image.display(),
            pos.seq
        );
    }
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else if e.file_name() != "receiver.lock" {
            let _ = std::fs::copy(e.path(), target);
        }
    }
}

// C1/C2, the base. Guards against a base cut by either side's death leaving a replica
// half replaced: the receiver is killed while a base streams in, then the shipper while
// the next one streams out; each time the replica is either the old one or whole, and
// it ends equal to the primary.
#[test]
fn a_base_cut_by_either_side_dying_leaves_the_old_replica_or_the_new_one() {
    let mut rig = Rig::new("base-kill");
    prefill(&rig, "a", 3000, 1500);
    rig.start_receiver();
    rig.start_shipper();
    let in_flight = |rig: &Rig| {
        rig.db_status("a")
            .is_some_and(|d| d.base_progress.is_some_and(|(sent, _)| sent > 0))
    };
    assert!(
        wait_until(Duration::from_secs(30), || in_flight(&rig)),
        "no base was seen in flight"
    );
    rig.kill_receiver();
    rig.start_receiver();
    let w = Writer::start(
        &rig.db("a"),
        WriterConfig {
            rate: 100,
            ..WriterConfig::default()
        },
    );
    assert!(w.wait_written(30, Duration::from_secs(30)));
    rig.kill_shipper();
    // Lose the shipper's state so that it sends a base again, and cut that one too.
    let _ = std::fs::remove_file(rig.primary.join(".ferry-ship").join("a.json"));
    rig.start_shipper();
    if wait_until(Duration::from_secs(30), || in_flight(&rig)) {
        rig.kill_shipper();
        rig.start_shipper();
    }
    let last = w.stop();
    rig.wait_synced("a", last, Duration::from_secs(60));
    rig.assert_equal("a");
}
