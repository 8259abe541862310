//! The worker's connection and shard streams (`ferry_flow::remote::worker`) against the
//! real server over real sockets (docs/flow-server.md §5.3, §6, §8.1): appends through a
//! shard's `JournalLog` wait for the server's acknowledgement; a restarted server is
//! resumed and what it had not acknowledged is sent again, once; a worker cut off stops
//! acting by its deadline, before the shard is granted to another, and is fenced when
//! the network heals.

use ferry_flow::JournalLog;
use ferry_flow::remote::worker::{Event, Worker, WorkerSettings};
mod common;

use common::{LEASE, Running, long_lease, start, start_with};
use ferry_flow_server::peer::{Peer, hello};
use ferry_testkit::Scratch;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Connect a worker from a blocking thread (its connect waits for the welcome).
async fn worker(server: String) -> Arc<Worker> {
    tokio::task::spawn_blocking(move || {
        Arc::new(Worker::connect(WorkerSettings::new(server)).unwrap())
    })
    .await
    .unwrap()
}

/// Events until `n` shards were granted; their (shard, epoch).
async fn granted(w: &Arc<Worker>, n: usize) -> Vec<(u32, u64)> {
    let w = w.clone();
    tokio::task::spawn_blocking(move || {
        let mut got = Vec::new();
        while got.len() < n {
            match w.next_event(Duration::from_secs(10)) {
                Some(Event::Granted { shard, epoch }) => got.push((shard, epoch)),
                Some(_) => {}
                None => panic!("no grant within 10 s (got {got:?})"),
            }
        }
        got.sort();
        got
    })
    .await
    .unwrap()
}

/// Every record of the shard, read back through the stream (pages from the server).
async fn read_back(w: &Arc<Worker>, shard: u32) -> Vec<Vec<u8>> {
    let s = w.stream(shard).unwrap();
    let records = s.records(0).await.unwrap();
    records.into_iter().map(|r| r.bytes).collect()
}

/// Guards §6: a shard's records go to the server as they are appended, a wait resolves
/// once the server said they are durable, and they read back in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_through_a_shard_stream_wait_for_the_servers_acknowledgement() {
    let scratch = Scratch::new("flow-worker-append");
    let socket = scratch.path().join("s.sock");
    let run = start(scratch.path(), &socket, 2);
    let w = worker(format!("unix:{}", socket.display())).await;
    assert_eq!(granted(&w, 2).await, vec![(0, 1), (1, 1)]);
    let s = w.stream(1).unwrap();
    let mut end = 0;
    for i in 0..50u32 {
        end = s.append(1, format!("record {i}").as_bytes()).unwrap();
    }
    assert_eq!(end, 50);
    s.durable(end, None).await.unwrap();
    assert_eq!(s.durable_lsn(), 50);
    // Within a ping the shard has a deadline: it may act.
    assert!(ferry_testkit::wait_until(Duration::from_secs(5), || s.may_act()));
    let back = read_back(&w, 1).await;
    assert_eq!(back.len(), 50);
    assert_eq!(back[49], b"record 49");
    drop(w);
    run.stop().await;
}

/// Guards §8.1 and §7: the server stops with appends unacknowledged and comes back; the
/// worker resumes at the same epoch, sends again what was not acknowledged, and every
/// record is on the server once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_is_resumed_and_nothing_is_lost_or_written_twice() {
    let scratch = Scratch::new("flow-worker-restart");
    let socket = scratch.path().join("s.sock");
    let run = start_with(scratch.path(), &socket, long_lease(1));
    let w = worker(format!("unix:{}", socket.display())).await;
    assert_eq!(granted(&w, 1).await, vec![(0, 1)]);
    let s = w.stream(0).unwrap();
    for i in 0..100u32 {
        s.append(1, format!("r{i}").as_bytes()).unwrap();
    }
    s.durable(100, None).await.unwrap();
    // More, and the server goes away before (all of) them are acknowledged.
    for i in 100..200u32 {
        s.append(1, format!("r{i}").as_bytes()).unwrap();
    }
    run.stop().await;
    for i in 200..250u32 {
        s.append(1, format!("r{i}").as_bytes()).unwrap();
    }
    let run = start_with(scratch.path(), &socket, long_lease(1));
    s.durable(250, None).await.unwrap();
    assert_eq!(s.epoch(), 1, "resumed, not granted anew");
    let back = read_back(&w, 0).await;
    let want: Vec<Vec<u8>> = (0..250u32).map(|i| format!("r{i}").into_bytes()).collect();
    assert_eq!(back, want);
    drop(w);
    run.stop().await;
}

/// A worker reaching the server through a fault proxy, granted the one shard and
/// confirmed in it.
async fn worker_through_proxy(
    run: &Running,
) -> (
    ferry_testkit::proxy::FaultProxy,
    Arc<Worker>,
    Arc<ferry_flow::remote::worker::ShardStream>,
) {
    let proxy = ferry_testkit::proxy::FaultProxy::start(run.tcp);
    let a = worker(format!("127.0.0.1:{}", proxy.port())).await;
    assert_eq!(granted(&a, 1).await, vec![(0, 1)]);
    let s = a.stream(0).unwrap();
    assert!(ferry_testkit::wait_until(Duration::from_secs(5), || s.may_act()));
    (proxy, a, s)
}

/// When the stream stops letting its worker act.
fn when_it_stops_acting(
    s: &Arc<ferry_flow::remote::worker::ShardStream>,
) -> tokio::task::JoinHandle<Instant> {
    let s = s.clone();
    tokio::task::spawn_blocking(move || {
        ferry_testkit::wait_until(Duration::from_secs(10), || !s.may_act());
        Instant::now()
    })
}

/// Guards guarantee 2 and §5.3 (T5's blackhole, T4's fence): a worker whose network
/// goes silent stops acting by its deadline, before the server grants the shard to a
/// standby; when the network heals, its shard is lost and its appends are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_stops_acting_before_the_shard_moves_and_is_fenced_after() {
    let scratch = Scratch::new("flow-worker-cut");
    let socket = scratch.path().join("s.sock");
    let run = start(scratch.path(), &socket, 1);
    let (proxy, a, s) = worker_through_proxy(&run).await;
    // B stands by, pinging.
    let (mut b, _) = Peer::hello(&socket, hello(2, "", vec![])).await.unwrap();
    // The network to A goes silent.
    proxy.faults().blackhole(true);
    let cut = Instant::now();
    let stopped = when_it_stops_acting(&s);
    let g = b.ping_until_grants(1, Duration::from_millis(50)).await;
    let moved = Instant::now();
    assert_eq!((g[0].shard, g[0].epoch), (0, 2));
    let stopped = stopped.await.unwrap();
    assert!(
        stopped < moved,
        "A stopped acting {:?} after the cut, the shard moved at {:?}",
        stopped - cut,
        moved - cut
    );
    assert!(
        moved - cut >= LEASE - Duration::from_millis(150),
        "moved after {:?}",
        moved - cut
    );
    // The network heals: A hears it lost the shard, and can append nothing more.
    proxy.faults().blackhole(false);
    let a2 = a.clone();
    let lost = tokio::task::spawn_blocking(move || {
        loop {
            match a2.next_event(Duration::from_secs(10)) {
                Some(Event::Lost { shard: 0, .. }) => return true,
                Some(_) => continue,
                None => return false,
            }
        }
    })
    .await
    .unwrap();
    assert!(lost);
    let e = s.append(1, b"too late").unwrap_err();
    assert!(matches!(e, ferry_flow::LogError::Fenced(_)), "{e}");
    // B hands the shard back; A is granted it again, as a new stream: the old one stays
    // lost (its appends and waits fail for good).
    let end = b.durable.get(&0).copied().unwrap_or(0);
    b.send(ferry_flow::remote::proto::Body::Release {
        shard: 0,
        epoch: 2,
        end,
    })
    .await
    .unwrap();
    let a2 = a.clone();
    let regranted = tokio::task::spawn_blocking(move || {
        loop {
            match a2.next_event(Duration::from_secs(10)) {
                Some(Event::Granted { shard: 0, epoch }) => return Some(epoch),
                Some(_) => continue,
                None => return None,
            }
        }
    })
    .await
    .unwrap();
    // (Epoch 3 or later: the shard may go to B once more before A, which reconnected
    // after the silence, is the one with room.)
    let regranted = regranted.expect("A is granted the shard again");
    assert!(regranted >= 3);
    let fresh = a.stream(0).unwrap();
    assert_eq!(fresh.epoch(), regranted);
    assert!(s.append(1, b"still too late").is_err());
    assert!(
        s.durable(1, None).await.is_err(),
        "an old wait never resolves Ok"
    );
    let end = fresh.append(1, b"new holder").unwrap();
    fresh.durable(end, None).await.unwrap();
    drop(a);
    drop(b);
    run.stop().await;
}

/// Guards §8.2: a worker hands a shard back only once what it appended is acknowledged;
/// its waits resolve, it appends nothing more, and a standby is granted the shard with
/// every record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_waits_for_acknowledgements_then_hands_the_shard_back() {
    let scratch = Scratch::new("flow-worker-release");
    let socket = scratch.path().join("s.sock");
    let run = start(scratch.path(), &socket, 1);
    let a = worker(format!("unix:{}", socket.display())).await;
    assert_eq!(granted(&a, 1).await, vec![(0, 1)]);
    let s = a.stream(0).unwrap();
    let (mut b, _) = Peer::hello(&socket, hello(2, "", vec![])).await.unwrap();
    let mut end = 0;
    for i in 0..300u32 {
        end = s.append(1, format!("r{i}").as_bytes()).unwrap();
    }
    a.release(0, s.epoch());
    assert!(s.append(1, b"after the release").is_err());
    s.durable(end, None).await.unwrap();
    let g = b.ping_until_grants(1, Duration::from_millis(50)).await;
    assert_eq!((g[0].shard, g[0].epoch, g[0].end), (0, 2, 300));
    assert_eq!(b.read_all(0, 2, 1 << 20).await.len(), 300);
    drop(a);
    drop(b);
    run.stop().await;
}

/// Guards T6 (docs/flow-server.md §5.3): a network that carries the worker's pings but
/// not the server's answers. The server still hears the worker, so it would never take
/// the shard; the worker stops acting by its deadline, hands the shard back itself, and
/// only then is the shard granted to the standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_one_way_fences_itself_and_hands_the_shard_back() {
    let scratch = Scratch::new("flow-worker-oneway");
    let socket = scratch.path().join("s.sock");
    let run = start(scratch.path(), &socket, 1);
    let (proxy, a, s) = worker_through_proxy(&run).await;
    let (mut b, _) = Peer::hello(&socket, hello(2, "", vec![])).await.unwrap();
    // Answers from the server stop reaching A; A's pings still reach the server.
    proxy
        .faults()
        .hold_down
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let cut = Instant::now();
    let stopped = when_it_stops_acting(&s);
    let g = b.ping_until_grants(1, Duration::from_millis(50)).await;
    let moved = Instant::now();
    let stopped = stopped.await.unwrap();
    assert_eq!((g[0].shard, g[0].epoch), (0, 2));
    assert!(
        stopped < moved,
        "A stopped acting {:?} after the cut, the shard moved at {:?}",
        stopped - cut,
        moved - cut
    );
    assert!(stopped - cut <= LEASE, "A fenced itself within the lease");
    proxy
        .faults()
        .hold_down
        .store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(s.append(1, b"too late").is_err());
    drop(a);
    drop(b);
    run.stop().await;
}

/// Guards guarantee 5 (T5): the connection is cut in the middle of a frame carrying
/// appends (the testkit proxy cuts after a byte count); the worker reconnects within
/// its lease, is resumed at the same epoch, sends again what was not acknowledged, and
/// the server holds every record once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_mid_frame_resumes_without_replay() {
    use std::sync::atomic::Ordering::SeqCst;
    let scratch = Scratch::new("flow-worker-cut-mid-frame");
    let socket = scratch.path().join("s.sock");
    let run = start_with(scratch.path(), &socket, long_lease(1));
    // Confirmed by a ping first: a grant never confirmed is not resumed.
    let (proxy, w, s) = worker_through_proxy(&run).await;
    let rec = |i: u32| format!("r{i} {}", "x".repeat(40)).into_bytes();
    for i in 0..100u32 {
        s.append(1, &rec(i)).unwrap();
    }
    s.durable(100, None).await.unwrap();
    // The next 300 records go out as frames of several KiB: the cut lands inside one.
    proxy.faults().cut_after.store(3_001, SeqCst);
    for i in 100..400u32 {
        s.append(1, &rec(i)).unwrap();
    }
    s.durable(400, None).await.unwrap();
    assert_eq!(
        proxy.faults().cuts.load(SeqCst),
        1,
        "the connection was cut"
    );
    assert!(
        proxy.faults().connections.load(SeqCst) >= 2,
        "and made again"
    );
    assert_eq!(s.epoch(), 1, "resumed, not granted anew");
    let back = read_back(&w, 0).await;
    let want: Vec<Vec<u8>> = (0..400u32).map(rec).collect();
    assert_eq!(back, want, "every record once, in order");
    drop(w);
    run.stop().await;
}
