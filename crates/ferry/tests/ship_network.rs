//! The network between shipper and receiver misbehaving: bodies cut mid-way, connections
//! refused, a slow link. Through a fault proxy, with real processes on both sides.

mod common;

use common::*;
use ferry_testkit::proxy::FaultProxy;
use ferry_testkit::workload::{Writer, WriterConfig};
use ferry_testkit::{Rng, wait_until};
use std::sync::atomic::Ordering;
use std::time::Duration;

// Guards against a request cut mid-body being half applied, and against a flaky or slow
// link costing a base: every fault is retried from the receiver's position, and the
// replica ends equal with the first copy as the only base.
#[test]
fn cut_refused_and_slow_connections_are_retried_and_change_nothing() {
    let mut rng = Rng::from_env("network");
    let mut rig = Rig::new("network");
    rig.start_receiver();
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", rig.port).parse().unwrap());
    rig.peer = proxy.url();
    rig.start_shipper();
    let watcher = Watcher::start(rig.replica_path("a"), true);
    let writer = Writer::start(
        &rig.db("a"),
        WriterConfig {
            rate: 300,
            payload: 2000,
            seed: rng.next_u64(),
            ..Default::default()
        },
    );
    assert!(wait_until(Duration::from_secs(20), || rig
        .replica_txns("a")
        > 20));
    let f = proxy.faults();

    // Cut requests mid-body, at random byte counts: each cut happens before the next.
    for i in 0..8 {
        f.cut_after.store(rng.range(100, 20_000), Ordering::SeqCst);
        assert!(
            wait_until(Duration::from_secs(20), || f
                .cut_after
                .load(Ordering::SeqCst)
                == 0),
            "cut {i} never happened"
        );
    }
    // Refuse every connection for a while: cut the one in use, and wait until the shipper
    // has been refused reconnecting (twice) and says so in its status.
    let connections = f.connections.load(Ordering::SeqCst);
    f.refuse.store(true, Ordering::SeqCst);
    f.cut_after.store(100, Ordering::SeqCst);
    assert!(
        wait_until(Duration::from_secs(20), || {
            f.connections.load(Ordering::SeqCst) >= connections + 2
                && rig.db_status("a").is_some_and(|d| d.failures > 0)
        }),
        "the shipper was never refused: {:?}",
        rig.db_status("a")
    );
    f.refuse.store(false, Ordering::SeqCst);
    // A slow link: shipping goes on through it.
    f.delay_ms.store(40, Ordering::SeqCst);
    let slow_from = rig.replica_txns("a");
    assert!(
        wait_until(Duration::from_secs(30), || rig.replica_txns("a")
            >= slow_from + 10),
        "nothing shipped over the slow link: {:?}",
        rig.db_status("a")
    );
    f.delay_ms.store(0, Ordering::SeqCst);

    let last = writer.stop();
    rig.wait_synced("a", last, Duration::from_secs(60));
    rig.assert_equal("a");
    watcher.stop();
    assert!(
        f.cuts.load(Ordering::SeqCst) >= 9,
        "fewer requests were cut than asked: {}",
        f.cuts.load(Ordering::SeqCst)
    );
    let d = rig.db_status("a").unwrap();
    assert_eq!(
        d.bases.values().sum::<u64>(),
        1,
        "network faults cost a base: {:?}",
        d.bases
    );
    let log = rig.receiver_log();
    assert!(!log.contains("panicked"), "{}", tail(&log));
}
