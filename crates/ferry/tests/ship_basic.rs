//! ferry-ship end to end with real processes: shipping under load, promotion with the old
//! primary still shipping (C10), clean shutdown, status and metrics.

mod common;

use common::*;
use ferry_testkit::workload::{self, Writer, WriterConfig};
use ferry_testkit::{proc, wait_until};
use std::sync::atomic::Ordering;
use std::time::Duration;

// Guards against split brain after a failover: once a replica is promoted, the old
// primary's shipper must be refused for its epoch (never overwriting the new lineage), and
// the promoted copy must equal the primary at the last acknowledged commit.
#[test]
fn promotion_under_load_fences_the_old_primary_and_equals_the_last_ack() {
    let mut rig = Rig::new("promote");
    rig.start_receiver();
    rig.start_shipper();
    let watcher = Watcher::start(rig.replica_path("app"), true);
    let writer = Writer::start(
        &rig.db("app"),
        WriterConfig {
            rate: 300,
            ..WriterConfig::default()
        },
    );
    // Ship under load for a while: until the replica shows 600 transactions.
    assert!(
        wait_until(Duration::from_secs(60), || rig.replica_txns("app") >= 600),
        "shipping under load stalled: {:?}",
        rig.db_status("app")
    );
    let last = writer.stop();
    rig.wait_synced("app", last, Duration::from_secs(30));
    rig.assert_equal("app");
    let (verified, highest) = watcher.stop();
    assert!(
        verified > 10 && highest > 0,
        "the watcher checked {verified} snapshots up to {highest}"
    );

    // Promote while the shipper still runs and the app keeps writing.
    let writer = Writer::start(
        &rig.db("app"),
        WriterConfig {
            rate: 200,
            seed: 2,
            ..WriterConfig::default()
        },
    );
    // Promote once the replica holds some of the new writer's transactions, so that the
    // promoted copy must show them.
    assert!(
        wait_until(Duration::from_secs(30), || rig.replica_txns("app")
            > last + 30),
        "the second writer's transactions did not ship: {:?}",
        rig.db_status("app")
    );
    let promoted = rig.scratch.path().join("new-primary").join("app.db");
    let (code, out, err) = proc::run(
        ferry(),
        &[
            "ship",
            "promote",
            "--dir",
            rig.standby.to_str().unwrap(),
            "app",
            "--to",
            promoted.to_str().unwrap(),
            "--json",
        ],
        &[],
    );
    assert_eq!(code, 0, "promote failed: {err}");
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["epoch"], 1);
    let acked_seq = report["seq"].as_u64().unwrap();
    let written = writer.stop();

    // The promoted copy is a normal read-write database holding a verified prefix of
    // the primary's history: exactly what the receiver had acknowledged.
    let copy = rusqlite::Connection::open(&promoted).unwrap();
    assert_eq!(workload::integrity(&copy), "ok");
    let v = workload::verify(&copy).unwrap();
    assert!(
        v.txns <= written && v.txns > last,
        "promoted at {} of {written}",
        v.txns
    );
    let mut rng = ferry_testkit::Rng::new(9);
    workload::write(
        &copy,
        &mut rng,
        workload::Shape::Rows {
            rows: 2,
            payload: 50,
        },
    )
    .unwrap();
    drop(copy);

    // The old primary's shipper is fenced and says so; the receiver holds no replica.
    assert!(
        wait_until(Duration::from_secs(20), || rig
            .db_status("app")
            .is_some_and(|d| d.state == "fenced")),
        "the old shipper was not fenced: {:?}",
        rig.db_status("app")
    );
    let d = rig.db_status("app").unwrap();
    assert!(
        d.last_error.as_deref().unwrap_or("").contains("fenced"),
        "{:?}",
        d.last_error
    );
    let pos = rig.position("app").unwrap();
    assert!(
        pos.promoted && pos.epoch.0 == 1 && pos.generation == 0,
        "{pos:?}"
    );
    assert!(
        !rig.replica_path("app").exists(),
        "the promoted replica was not moved out"
    );
    assert!(acked_seq > 0);

    // A shipper started on the promoted database ships with the new epoch, which the
    // receiver accepts with a base.
    let state = ferry_ship::ship_state::load(
        &promoted
            .parent()
            .unwrap()
            .join(".ferry-ship")
            .join("app.json"),
    )
    .unwrap()
    .unwrap();
    assert_eq!(state.epoch.0, 1);
    assert!(rig.stop_shipper().is_some());
}

// Guards against a shipper that cannot be stopped cleanly or that loses its place: SIGTERM
// must save the state, and a restart must resume from the WAL without a new base.
#[test]
fn sigterm_saves_state_and_a_restart_resumes_without_a_base() {
    let mut rig = Rig::new("sigterm");
    rig.start_receiver();
    rig.start_shipper();
    let writer = Writer::start(
        &rig.db("a"),
        WriterConfig {
            rate: 200,
            ..WriterConfig::default()
        },
    );
    assert!(
        wait_until(Duration::from_secs(30), || rig.replica_txns("a") >= 100),
        "nothing shipped before the stop: {:?}",
        rig.db_status("a")
    );
    assert_eq!(
        rig.stop_shipper(),
        Some(0),
        "the shipper did not exit cleanly on SIGTERM"
    );
    // The app writes on while no shipper runs: the restarted one must resume from its
    // saved state with a backlog to ship, not only new commits.
    let at_stop = writer.written.load(Ordering::SeqCst);
    assert!(writer.wait_written(at_stop + 50, Duration::from_secs(30)));
    let backlog = writer.written.load(Ordering::SeqCst);
    rig.start_shipper();
    assert!(
        wait_until(Duration::from_secs(30), || rig.replica_txns("a") >= backlog),
        "the restarted shipper did not ship the backlog: {:?}",
        rig.db_status("a")
    );
    let last = writer.stop();
    rig.wait_synced("a", last, Duration::from_secs(30));
    rig.assert_equal("a");
    let d = rig.db_status("a").unwrap();
    assert_eq!(
        d.bases.values().sum::<u64>(),
        0,
        "a restart after SIGTERM sent a base: {:?}",
        d.bases
    );

    let metrics = ureq::get(&format!("http://127.0.0.1:{}/metrics", rig.metrics_port))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    for m in [
        "ferry_ship_lag_transactions{db=\"a\"} 0",
        "ferry_ship_lag_seconds",
        "ferry_ship_transactions_total{db=\"a\"}",
    ] {
        assert!(metrics.contains(m), "metrics lack {m}:\n{metrics}");
    }
    let rmetrics = ureq::get(&format!("{}/metrics", rig.receiver_url()))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    assert!(
        rmetrics.contains("ferry_receive_seq{db=\"a\"}"),
        "{rmetrics}"
    );

    // Status commands, live and offline, human and JSON.
    let url = format!("http://127.0.0.1:{}", rig.metrics_port);
    let (code, out, err) = proc::run(ferry(), &["ship", "status", "--url", &url], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("LAG TX") && out.contains("idle"), "{out}");
    let (code, out, _) = proc::run(
        ferry(),
        &["ship", "replicas", "--url", &rig.receiver_url(), "--json"],
        &[],
    );
    assert_eq!(code, 0);
    let s: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(s["replicas"][0]["name"], "a");
    assert_eq!(
        rig.stop_receiver(),
        Some(0),
        "the receiver did not exit cleanly on SIGTERM"
    );
    let (code, out, err) = proc::run(
        ferry(),
        &["receive", "status", "--dir", rig.standby.to_str().unwrap()],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("replica"), "{out}");
    assert_eq!(rig.stop_shipper(), Some(0));
    let (code, out, err) = proc::run(
        ferry(),
        &["ship", "status", "--dir", rig.primary.to_str().unwrap()],
        &[],
    );
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("a ") && out.contains("no"), "{out}");
}
