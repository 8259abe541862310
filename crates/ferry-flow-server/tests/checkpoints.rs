//! Checkpoints on the server (docs/flow-server.md §7), with real worker engines: a
//! compaction folds every shard's records into its checkpoint and retires the log
//! below; a new holder recovers from the checkpoint and the records after it (finished
//! runs keep their results and ids, waiting ones resume, no step body runs twice); a
//! restarted server reads its checkpoints, epochs and the rest of its log back; runs
//! finished longer than the retention ago are forgotten.

mod common;

use common::{close, more_than_once, open_worker};
use ferry_flow::log::Config as LogConfig;
use ferry_flow::{Ctx, FlowError, Signal, Workflow};
use ferry_flow_server::server::Settings;
use ferry_testkit::{Scratch, eventually};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

static ORDER: Workflow<u32, u64> = Workflow::new("order");
static GO: Signal<u32> = Signal::new("go");

/// How many times each step's body ran, by key.
static RAN: Mutex<BTreeMap<String, u32>> = Mutex::new(BTreeMap::new());

async fn order(ctx: Ctx, n: u32) -> Result<u64, FlowError> {
    let charged: u64 = ctx
        .step("charge", |s| async move {
            *RAN.lock().unwrap().entry(s.key().to_string()).or_default() += 1;
            // A little weight, so that the log fills segments.
            Ok(u64::from(n) * 10)
        })
        .await?;
    let go = ctx.wait_for(GO, None).await?.unwrap_or(0);
    Ok(charged + u64::from(go))
}

fn small_segments() -> LogConfig {
    LogConfig {
        segment_bytes: 64 << 10,
        record_bytes_max: 32 << 10,
        ..LogConfig::default()
    }
}

/// Guards §7: checkpoints, retirement, recovery from them by a new holder and by a
/// restarted server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_holder_and_a_restarted_server_recover_from_checkpoints() {
    const SHARDS: u32 = 2;
    const RUNS: u32 = 200;
    let scratch = Scratch::new("flow-checkpoints");
    let socket = scratch.path().join("s.sock");
    let settings = || Settings {
        compact_bytes: u64::MAX,
        record_max: 16 << 10,
        ..common::long_lease(SHARDS)
    };
    let server = common::start_with_log(scratch.path(), &socket, settings(), small_segments());
    let a = open_worker(&scratch.dir("a"), &socket, |b| b.register(ORDER, order)).await;
    eventually("a to hold every shard", || {
        a.held_shards().len() == SHARDS as usize
    })
    .await;
    let id = |i: u32| format!("cp-{i:03}");
    for i in 0..RUNS {
        a.start(ORDER, &id(i), &i).await.unwrap();
    }
    // Half finish; half wait for their signal.
    for i in 0..RUNS / 2 {
        a.signal(&id(i), GO, &1).await.unwrap();
    }
    for i in 0..RUNS / 2 {
        assert_eq!(
            a.run::<u64>(&id(i)).unwrap().result().await.unwrap(),
            u64::from(i) * 10 + 1
        );
    }
    eventually("every charge", || {
        RAN.lock()
            .unwrap()
            .keys()
            .filter(|k| k.starts_with("cp-"))
            .count()
            == RUNS as usize
    })
    .await;
    let log_start = |s: &ferry_flow_server::server::Server| s.status().log.segments;
    let segments_before = log_start(&server.server);
    let s = server.server.clone();
    let done = tokio::task::spawn_blocking(move || s.compact())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.moved.len(), SHARDS as usize, "{done:?}");
    assert!(
        log_start(&server.server) < segments_before,
        "segments retired: {} before, {} after",
        segments_before,
        log_start(&server.server)
    );
    // Records after the checkpoint: one more run.
    a.start(ORDER, "after", &7).await.unwrap();
    // A new holder: from the checkpoints and the records after them.
    close(a).await;
    let b = open_worker(&scratch.dir("b"), &socket, |b| b.register(ORDER, order)).await;
    eventually("b to hold every shard", || {
        b.held_shards().len() == SHARDS as usize
    })
    .await;
    // A finished run keeps its result and its id: starting it again returns it.
    let again = b.start(ORDER, &id(3), &999).await.unwrap();
    assert_eq!(again.result().await.unwrap(), 31);
    for i in RUNS / 2..RUNS {
        b.signal(&id(i), GO, &2).await.unwrap();
    }
    b.signal("after", GO, &2).await.unwrap();
    for i in RUNS / 2..RUNS {
        assert_eq!(
            b.run::<u64>(&id(i)).unwrap().result().await.unwrap(),
            u64::from(i) * 10 + 2
        );
    }
    assert_eq!(b.run::<u64>("after").unwrap().result().await.unwrap(), 72);
    close(b).await;
    // Once the server took every hand-back in (and b's session is gone: a shard handed
    // back may be granted to b again as it leaves, at a higher epoch), nothing moves.
    eventually("every shard free", || {
        server.server.holders().iter().all(|h| h.1.is_none())
    })
    .await;
    // A restarted server: checkpoints, kept epochs and the log's rest.
    let epochs: Vec<u64> = server.server.holders().iter().map(|h| h.0).collect();
    server.stop().await;
    let server = common::start_with_log(scratch.path(), &socket, settings(), small_segments());
    let again: Vec<u64> = server.server.holders().iter().map(|h| h.0).collect();
    assert_eq!(again, epochs, "epochs survive the retired segments");
    let runs = server.server.runs(Some("finished"), None, 1000);
    assert_eq!(runs.len(), RUNS as usize + 1);
    let c = open_worker(&scratch.dir("c"), &socket, |b| b.register(ORDER, order)).await;
    eventually("c to hold every shard", || {
        c.held_shards().len() == SHARDS as usize
    })
    .await;
    assert_eq!(
        c.run::<u64>(&id(150)).unwrap().result().await.unwrap(),
        1502
    );
    assert_eq!(
        more_than_once(&RAN),
        Vec::<(String, u32)>::new(),
        "no step body ran twice"
    );
    close(c).await;
    server.stop().await;
}

/// Guards §7's retention: runs finished longer than the retention ago leave the
/// checkpoints and the index; unfinished ones stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_runs_past_the_retention_are_forgotten() {
    let scratch = Scratch::new("flow-checkpoints-retention");
    let socket = scratch.path().join("s.sock");
    let settings = Settings {
        compact_bytes: u64::MAX,
        retention: Duration::ZERO,
        ..common::long_lease(1)
    };
    let server = common::start_with(scratch.path(), &socket, settings);
    let a = open_worker(&scratch.dir("a"), &socket, |b| b.register(ORDER, order)).await;
    eventually("a to hold the shard", || a.held_shards().len() == 1).await;
    a.start(ORDER, "done", &1).await.unwrap();
    a.start(ORDER, "waiting", &2).await.unwrap();
    a.signal("done", GO, &0).await.unwrap();
    a.run::<u64>("done").unwrap().result().await.unwrap();
    let s = server.server.clone();
    let done = tokio::task::spawn_blocking(move || s.compact())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.expired, vec!["done".to_string()]);
    assert!(server.server.run("done").is_none());
    assert_eq!(server.server.run("waiting").unwrap().state, "running");
    close(a).await;
    server.stop().await;
}
