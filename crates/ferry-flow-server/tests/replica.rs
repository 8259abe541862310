//! The replicated log's writer (docs/flow-server-replica.md §4) against a NATS server of
//! the test's own (a stream of one replica): the NATS server is SIGKILLed and started
//! again while appends are in flight. The flow server sends again what the stream lacks
//! and acknowledges everything in the end; a server rebuilt from the stream alone holds
//! every record once, in order, byte for byte (a record twice in the stream would break
//! its positions, and the rebuilt server would not open).

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

fn rec(shard: u32, position: u64) -> Rec {
    Rec {
        kind: 1,
        bytes: format!("shard {shard} record {position}").into_bytes(),
    }
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
}
