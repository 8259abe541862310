//! The replicated log (docs/flow-server-replica.md) against a NATS server of the test's
//! own (streams of one replica): its writer with the NATS server SIGKILLed and started
//! again while appends are in flight (the flow server sends again what the stream lacks
//! and acknowledges everything in the end; a server rebuilt from the stream alone holds
//! every record once, in order, byte for byte: a record twice in the stream would break
//! its positions, and the rebuilt server would not open); the stream's format read back
//! from messages written by hand; a directory used without the stream left alone.

mod common;

use ferry_core::seams::{Rng, SplitMix64};
use ferry_flow::log::Config as LogConfig;
use ferry_flow::remote::proto::{Rec, Resume};
use ferry_flow_server::peer::{Peer, append, hello};
use ferry_flow_server::replica::{Replica, ReplicaSettings};
use ferry_flow_server::server::{Server, Settings};
use ferry_testkit::Scratch;
use ferry_testkit::servers::PrivateNats;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

const SHARDS: u32 = 4;
/// Long enough that the raw peer (which does not ping) keeps its shards through the
/// NATS server's restart.
const LEASE: Duration = Duration::from_secs(20);

async fn open(dir: &Path, nats: &str) -> Server {
    let mut replica = Replica::connect(&ReplicaSettings {
        url: nats.to_string(),
        stream: "FLOW_T".into(),
        replicas: 1,
        lease: LEASE,
    })
    .await
    .unwrap();
    replica.acquire().await.unwrap();
    replica.restore(dir, LogConfig::default()).await.unwrap();
    let settings = Settings {
        shards: SHARDS,
        lease: LEASE,
        ping_every: Duration::from_secs(1),
        stuck_after: Duration::from_secs(60),
        ..Settings::default()
    };
    Server::open_replicated(dir, settings, LogConfig::default(), replica).unwrap()
}

/// Every 40th record is 1 MiB: more than a message holds, so its batch is cut into
/// parts.
fn rec(shard: u32, position: u64) -> Rec {
    let mut bytes = format!("shard {shard} record {position}").into_bytes();
    if position % 40 == 39 {
        bytes.resize(1 << 20, b'x');
    }
    Rec { kind: 1, bytes }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_restart_under_appends_loses_and_doubles_nothing() {
    let scratch = Scratch::new("flow-replica-nats");
    let mut nats = PrivateNats::start(scratch.path());
    let url = nats.url();
    let socket = scratch.path().join("a.sock");
    let running = common::serve(open(&scratch.path().join("a"), &url).await, &socket);
    let session = 0x7e57_u128;
    let (mut peer, _) = Peer::hello(&socket, hello(session, "", vec![]))
        .await
        .unwrap();
    let mut epochs = BTreeMap::new();
    let mut sent: BTreeMap<u32, Vec<Rec>> = BTreeMap::new();
    for g in peer.grants(SHARDS as usize).await {
        epochs.insert(g.shard, g.epoch);
        sent.insert(g.shard, Vec::new());
    }
    let mut rng = SplitMix64::seeded(8);
    for i in 0..400 {
        // Down for longer than an acknowledgement is awaited (5 s): what was in
        // flight is read back and sent again.
        if i == 150 {
            nats.kill();
        }
        if i == 250 {
            tokio::time::sleep(Duration::from_secs(6)).await;
            nats.up();
        }
        let shard = rng.below(u64::from(SHARDS)) as u32;
        let s = sent.get_mut(&shard).unwrap();
        let first = s.len() as u64;
        let records: Vec<Rec> = (first..first + 1 + rng.below(3))
            .map(|p| rec(shard, p))
            .collect();
        s.extend(records.iter().cloned());
        peer.send(append(shard, epochs[&shard], first, records))
            .await
            .unwrap();
        if i % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // Everything acknowledged in the end: what the restart cut short was sent again.
    let all = tokio::time::timeout(Duration::from_secs(60), async {
        for (&shard, s) in &sent {
            peer.durable_to(shard, s.len() as u64).await;
        }
    })
    .await;
    assert!(all.is_ok(), "not every append was acknowledged within 60 s");
    drop(peer);
    // Stopping gives the lock up: the next server takes it at once.
    running.stop().await;
    let socket = scratch.path().join("b.sock");
    let running = common::serve(open(&scratch.path().join("b"), &url).await, &socket);
    let resume = epochs
        .iter()
        .map(|(&shard, &epoch)| Resume {
            shard,
            epoch,
            acked: sent[&shard].len() as u64,
        })
        .collect();
    let (mut peer, welcome) = Peer::hello(&socket, hello(session, "", resume))
        .await
        .unwrap();
    assert_eq!(welcome.grants.len(), SHARDS as usize);
    for g in &welcome.grants {
        assert_eq!(g.epoch, epochs[&g.shard]);
        assert_eq!(g.end, sent[&g.shard].len() as u64, "shard {}", g.shard);
        let back = peer.read_all(g.shard, g.epoch, 4096).await;
        assert_eq!(back, sent[&g.shard], "shard {} byte for byte", g.shard);
    }
    drop(peer);
    running.stop().await;
    // A server started with another shard count refuses before it takes over.
    let mut replica = Replica::connect(&ReplicaSettings {
        url: url.clone(),
        stream: "FLOW_T".into(),
        replicas: 1,
        lease: LEASE,
    })
    .await
    .unwrap();
    replica.expect_shards(SHARDS * 2);
    replica.acquire().await.unwrap();
    let err = replica
        .restore(&scratch.path().join("c"), LogConfig::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("made for 4 shards, not 8"), "{err}");
    replica.release().await;
}

/// Rebuild `dir` from the stream (taking the lock, then giving it up) and read its log
/// back: each record's kind and payload.
async fn rebuilt(settings: &ReplicaSettings, dir: &Path) -> Vec<(u8, Vec<u8>)> {
    let mut replica = Replica::connect(settings).await.unwrap();
    replica.acquire().await.unwrap();
    replica.restore(dir, LogConfig::default()).await.unwrap();
    replica.release().await;
    let (log, _) = ferry_flow::log::Log::open_dir(&dir.join("log"), LogConfig::default()).unwrap();
    let mut back = Vec::new();
    log.read(log.start_lsn(), |r| back.push((r.kind, r.payload.to_vec())))
        .unwrap();
    log.close().unwrap();
    back
}

/// A message as docs/flow-server-replica.md §3 lays it out.
fn message(kind: u8, writer: u128, bytes: &[u8]) -> Vec<u8> {
    let mut m = vec![kind];
    m.extend_from_slice(&writer.to_be_bytes());
    m.extend_from_slice(bytes);
    m
}

/// Records as a batch carries them.
fn records(rs: &[(u8, &[u8])]) -> Vec<u8> {
    let mut b = Vec::new();
    for (kind, payload) in rs {
        b.push(*kind);
        b.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        b.extend_from_slice(payload);
    }
    b
}

/// Guards docs/flow-server-replica.md §3: a batch cut into parts counts at its last
/// part; a batch a takeover interrupts is void, and so is a deposed writer's part that
/// lands after the takeover. The stream is written by hand, then rebuilt into a log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_writers_late_part_and_an_unfinished_batch_are_void() {
    let scratch = Scratch::new("flow-replica-format");
    let nats = PrivateNats::start(scratch.path());
    let settings = ReplicaSettings {
        url: nats.url(),
        stream: "FLOW_F".into(),
        replicas: 1,
        lease: Duration::from_secs(5),
    };
    // Connecting creates the stream.
    drop(Replica::connect(&settings).await.unwrap());
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let (a, b) = (0xaa_u128, 0xbb_u128);
    let one = records(&[(7, b"a1"), (7, b"a2")]);
    let two = records(&[(7, b"a3")]);
    let three = records(&[(7, b"b1"), (7, b"b2")]);
    let stream = vec![
        message(3, a, b""),
        message(1, a, &one[..4]),
        message(2, a, &one[4..]),
        // Cut short by b's takeover: void.
        message(1, a, &two[..3]),
        message(3, b, b""),
        // a's late part, after b took over: void.
        message(2, a, &two[3..]),
        message(1, b, &three[..5]),
        message(2, b, &three[5..]),
    ];
    for m in stream {
        js.publish("ferry.flow.FLOW_F", m.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let back = rebuilt(&settings, &scratch.path().join("c")).await;
    assert_eq!(
        back,
        vec![
            (7, b"a1".to_vec()),
            (7, b"a2".to_vec()),
            (7, b"b1".to_vec()),
            (7, b"b2".to_vec())
        ]
    );
}

/// A server on `dir` without the stream.
fn local(dir: &Path) -> Server {
    let settings = Settings {
        shards: SHARDS,
        ..Settings::default()
    };
    Server::open(dir, settings, LogConfig::default()).unwrap()
}

/// Guards docs/flow-server-replica.md §2 ("not guaranteed"): a directory a server used
/// without --replicate is refused, not emptied, when the stream is empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_used_without_the_stream_is_refused_not_removed() {
    let scratch = Scratch::new("flow-replica-dir");
    let nats = PrivateNats::start(scratch.path());
    let dir = scratch.path().join("server");
    local(&dir).shutdown().await;
    let mut replica = Replica::connect(&ReplicaSettings {
        url: nats.url(),
        stream: "FLOW_D".into(),
        replicas: 1,
        lease: Duration::from_secs(5),
    })
    .await
    .unwrap();
    replica.acquire().await.unwrap();
    let err = replica
        .restore(&dir, LogConfig::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("holds a flow server's log and stream FLOW_D is empty"),
        "{err}"
    );
    replica.release().await;
    // Still there: the server opens it as it was.
    local(&dir).shutdown().await;
}

/// Guards docs/flow-server-replica.md §4 step 4 on the writer's side: a deposed
/// server's part landing after this server's takeover makes its first part's sequence
/// wrong; the server reads the stream back, skips that part, and sends its batch (two
/// parts) after it; rebuilt, the stream holds the batch whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_writers_late_part_is_stepped_over_by_the_new_writer() {
    let scratch = Scratch::new("flow-replica-stray");
    let nats = PrivateNats::start(scratch.path());
    let settings = ReplicaSettings {
        url: nats.url(),
        stream: "FLOW_W".into(),
        replicas: 1,
        lease: Duration::from_secs(5),
    };
    let mut w = Replica::connect(&settings).await.unwrap();
    w.acquire().await.unwrap();
    w.restore(&scratch.path().join("w"), LogConfig::default())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.publish("ferry.flow.FLOW_W", message(1, 0xdead, b"late").into())
        .await
        .unwrap()
        .await
        .unwrap();
    let big = vec![b'y'; 1 << 20];
    let batch = records(&[(7, &big), (7, b"z")]);
    w.queue(&batch, 4242);
    let mut end = None;
    for _ in 0..10 {
        w.send().await.unwrap();
        match w.acked().await {
            Ok(Some(e)) => {
                end = Some(e);
                break;
            }
            Ok(None) => {}
            Err(_) => end = w.recover().await.unwrap().or(end),
        }
    }
    assert_eq!(end, Some(4242), "the batch is in the stream");
    w.release().await;
    let back = rebuilt(&settings, &scratch.path().join("r")).await;
    assert_eq!(back, vec![(7, big), (7, b"z".to_vec())]);
}
