//! Operating conditions: long readers on the replica (C8), a full disk on the receiver
//! (C11), rapid create/drop/recreate of one name (C12).

mod common;

use common::*;
use ferry_testkit::workload::{self, Writer, WriterConfig};
use ferry_testkit::{Rng, wait_until};
use rusqlite::{Connection, OpenFlags};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

// C8. Guards against readers on the standby stalling replication (walship answers 503
// while a reader blocks its generation change): a read transaction held for seconds,
// across an in-place base, must keep its snapshot while shipping goes on behind it.
#[test]
fn a_long_reader_on_the_replica_keeps_its_snapshot_and_does_not_stall_shipping() {
    let mut rig = Rig::new("c8");
    rig.start_receiver();
    rig.start_shipper();
    let writer = Writer::start(
        &rig.db("a"),
        WriterConfig {
            rate: 300,
            ..WriterConfig::default()
        },
    );
    assert!(wait_until(Duration::from_secs(20), || rig
        .replica_txns("a")
        > 50));
    let reader = rig.replica("a");
    reader.execute_batch("BEGIN").unwrap();
    let held = workload::txns(&reader);
    let seen_at_start = workload::verify(&reader).unwrap();

    // An in-place base while the reader holds its snapshot: lose the shipper's state.
    rig.kill_shipper();
    std::fs::remove_file(rig.primary.join(".ferry-ship").join("a.json")).unwrap();
    rig.start_shipper();

    let mut max_behind = 0u64;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(100));
        let now = workload::txns(&rig.replica("a"));
        max_behind = max_behind.max(writer.written.load(Ordering::SeqCst).saturating_sub(now));
    }
    assert_eq!(workload::txns(&reader), held, "the held snapshot moved");
    assert_eq!(workload::verify(&reader).unwrap(), seen_at_start);
    reader.execute_batch("COMMIT").unwrap();
    assert!(
        max_behind < 600,
        "shipping stalled behind the reader: {max_behind} transactions behind"
    );
    let last = writer.stop();
    rig.wait_synced("a", last, Duration::from_secs(30));
    rig.assert_equal("a");
    assert!(rig.db_status("a").unwrap().bases.values().sum::<u64>() >= 1);
}

/// A tmpfs mounted over a directory for the length of a test.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path, mib: u64) -> Tmpfs {
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir)
            .status()
            .expect("running mount");
        assert!(
            status.success(),
            "the disk-full test mounts a small tmpfs and needs root for it"
        );
        Tmpfs(dir.to_path_buf())
    }

    fn grow(&self, mib: u64) {
        let status = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={mib}m")])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(status.success());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

// C11. Guards against a full disk on the standby corrupting the replica or losing its
// place: the receiver refuses with "disk full", the replica stays whole at its last
// position, and shipping resumes by itself once space is freed.
#[test]
fn a_full_disk_on_the_receiver_harms_nothing_and_shipping_resumes() {
    let mut rig = Rig::new("c11");
    let disk = Tmpfs::mount(&rig.standby, 24);
    rig.start_receiver();
    rig.start_shipper();
    let writer = Writer::start(
        &rig.db("a"),
        WriterConfig {
            rate: 300,
            rows: 4,
            payload: 3000,
            ..WriterConfig::default()
        },
    );
    let full = wait_until(Duration::from_secs(60), || {
        rig.db_status("a")
            .and_then(|d| d.last_error)
            .is_some_and(|e| e.contains("full"))
    });
    assert!(
        full,
        "the receiver's disk never filled: {:?}\n{}",
        rig.db_status("a"),
        tail(&rig.receiver_log())
    );
    // While full: the replica is whole and readable at its last position.
    let r = rig.replica("a");
    assert_eq!(workload::integrity(&r), "ok");
    workload::verify(&r).unwrap();
    drop(r);
    let stuck = rig.position("a").unwrap().seq;
    // The shipper keeps stepping (retrying against the full disk) before space is freed.
    let steps = rig.db_status("a").map_or(0, |d| d.steps);
    assert!(
        wait_until(Duration::from_secs(30), || rig
            .db_status("a")
            .is_some_and(|d| d.steps >= steps + 3)),
        "the shipper stopped stepping: {:?}",
        rig.db_status("a")
    );
    disk.grow(400);
    let last = writer.stop();
    rig.wait_synced("a", last, Duration::from_secs(60));
    rig.assert_equal("a");
    assert!(rig.position("a").unwrap().seq > stuck);
    let d = rig.db_status("a").unwrap();
    assert_eq!(
        d.bases.values().sum::<u64>(),
        1,
        "a full disk cost a base: {:?}",
        d.bases
    );
    rig.stop_receiver();
    rig.stop_shipper();
    drop(disk);
}

// C12. Guards against a name's replica resurrecting an older database: the same name is
// created, dropped and recreated quickly with different content; every incarnation is
// shipped from a base and the replica ends equal to the last one.
#[test]
fn rapid_create_drop_recreate_of_one_name_never_resurrects_an_old_replica() {
    let mut rng = Rng::from_env("c12");
    let mut rig = Rig::new("c12");
    rig.start_receiver();
    rig.start_shipper();
    let watcher = Watcher::start(rig.replica_path("c"), false);
    for round in 0..12u64 {
        let conn = workload::open_app(&rig.db("c"), true).unwrap();
        let mut wrng = Rng::new(rng.next_u64());
        let n = rng.range(3, 30);
        for _ in 0..n {
            workload::write(
                &conn,
                &mut wrng,
                workload::Shape::Rows {
                    rows: 3,
                    payload: 200,
                },
            )
            .unwrap();
        }
        let chain = workload::verify(&conn).unwrap();
        drop(conn);
        if round % 3 == 0 {
            // Let this one arrive before dropping it.
            assert!(wait_until(Duration::from_secs(20), || {
                Connection::open_with_flags(rig.replica_path("c"), OpenFlags::SQLITE_OPEN_READ_ONLY)
                    .ok()
                    .and_then(|c| workload::verify(&c).ok())
                    == Some(chain)
            }));
        } else {
            std::thread::sleep(Duration::from_millis(rng.range(0, 60)));
        }
        for s in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(rig.primary.join(format!("c.db{s}")));
        }
    }
    let conn = workload::open_app(&rig.db("c"), true).unwrap();
    let mut wrng = Rng::new(rng.next_u64());
    for _ in 0..40 {
        workload::write(
            &conn,
            &mut wrng,
            workload::Shape::Rows {
                rows: 3,
                payload: 200,
            },
        )
        .unwrap();
    }
    drop(conn);
    rig.wait_synced("c", 40, Duration::from_secs(30));
    rig.assert_equal("c");
    watcher.stop();
}
