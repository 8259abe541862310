//! The server over a real Unix socket and a real log on disk, spoken to frame by frame
//! (docs/flow-server.md §4–§8): grants once epochs are durable, pipelined appends
//! acknowledged once synced and read back in pages, the fence, a resend acknowledged and
//! not written twice, a resume at the same epoch, a restart that keeps epochs and
//! records, and bad input refused by name.

use ferry_flow::log::{Config as LogConfig, Log};
use ferry_flow::remote::proto::*;
use ferry_flow_server::peer::{Peer, append, hello};
use ferry_flow_server::server::{Server, Settings, token_hash};
use ferry_flow_server::store::{EPOCH_RECORD, SHARD_RECORD};
use ferry_testkit::Scratch;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixListener;

fn settings(shards: u32) -> Settings {
    Settings {
        shards,
        lease: Duration::from_millis(600),
        ping_every: Duration::from_millis(100),
        stuck_after: Duration::from_secs(5),
        ..Settings::default()
    }
}

struct Running {
    server: Arc<Server>,
    socket: PathBuf,
    accept: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn stop(self) {
        self.accept.abort();
        let _ = self.accept.await;
        Arc::into_inner(self.server)
            .expect("only the test holds the server")
            .shutdown()
            .await;
    }
}

fn start(dir: &Path, settings: Settings) -> Running {
    let server =
        Arc::new(Server::open(&dir.join("server"), settings, LogConfig::default()).unwrap());
    let socket = dir.join(format!("s-{}.sock", rand_tag()));
    let listener = UnixListener::bind(&socket).unwrap();
    server.start();
    let s = server.connector();
    let accept = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(s.connection(stream));
        }
    });
    Running {
        server,
        socket,
        accept,
    }
}

fn rand_tag() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

fn recs(tag: &str, n: usize) -> Vec<Rec> {
    (0..n)
        .map(|i| Rec {
            kind: 1,
            bytes: format!("{tag}-{i}").into_bytes(),
        })
        .collect()
}

/// Guards §5.1 and §6: a worker is granted every shard once the epochs are durable;
/// appends sent back to back are acknowledged once synced, and read back in pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_are_acknowledged_once_durable_and_read_back_in_pages() {
    let scratch = Scratch::new("flow-server-append");
    let run = start(scratch.path(), settings(2));
    let (mut a, welcome) = Peer::hello(&run.socket, hello(1, "", vec![]))
        .await
        .unwrap();
    assert_eq!(welcome.shards, 2);
    assert!(
        welcome.grants.is_empty(),
        "new grants come once their epochs are durable"
    );
    let mut granted = a.grants(2).await;
    granted.sort_by_key(|g| g.shard);
    assert_eq!(
        granted
            .iter()
            .map(|g| (g.shard, g.epoch, g.end))
            .collect::<Vec<_>>(),
        vec![(0, 1, 0), (1, 1, 0)]
    );
    // Pipelined: three appends without waiting for answers.
    a.send(append(0, 1, 0, recs("a", 3))).await.unwrap();
    a.send(append(1, 1, 0, recs("b", 1))).await.unwrap();
    a.send(append(0, 1, 3, recs("c", 2))).await.unwrap();
    a.durable_to(0, 5).await;
    let back = a.read_all(0, 1, 5).await;
    let mut want = recs("a", 3);
    want.extend(recs("c", 2));
    assert_eq!(back, want, "in order, across pages of one or two records");
    assert_eq!(a.read_all(1, 1, 1 << 20).await, recs("b", 1));
    run.stop().await;
}

/// Guards guarantee 1 and §5.2: once a silent worker's shards are granted to another,
/// its appends are refused as stale, and no record of the old epoch follows the new
/// epoch's record in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_epoch_is_refused_and_none_of_its_records_follow_the_new_grant() {
    let scratch = Scratch::new("flow-server-stale");
    let run = start(scratch.path(), settings(1));
    let (mut a, _) = Peer::hello(&run.socket, hello(1, "", vec![]))
        .await
        .unwrap();
    assert_eq!(a.grants(1).await[0].epoch, 1);
    a.send(append(0, 1, 0, recs("a", 2))).await.unwrap();
    a.durable_to(0, 2).await;
    // B stands by and pings; A falls silent (it never pings).
    let (mut b, _) = Peer::hello(&run.socket, hello(2, "", vec![]))
        .await
        .unwrap();
    let pinger = tokio::spawn(async move {
        let mut got = None;
        while got.is_none() {
            b.send(Body::Ping(vec![])).await.unwrap();
            let f = tokio::time::timeout(Duration::from_millis(100), b.recv()).await;
            if let Ok(Some(Frame {
                body: Body::Grant(g),
                ..
            })) = f
            {
                got = Some(g[0].clone());
            }
        }
        (b, got.unwrap())
    });
    let (mut b, g) = pinger.await.unwrap();
    assert_eq!((g.shard, g.epoch, g.end), (0, 2, 2));
    // A wakes: its append is refused, typed, and changes nothing.
    a.send(append(0, 1, 2, recs("late", 1))).await.unwrap();
    let r = a.refusal().await;
    assert_eq!(r, Refused::Stale { shard: 0, held: 2 });
    assert!(r.is_fenced());
    b.send(append(0, 2, 2, recs("b", 1))).await.unwrap();
    b.durable_to(0, 3).await;
    let back = b.read_all(0, 2, 1 << 20).await;
    assert_eq!(back.len(), 3);
    assert_eq!(back[2], recs("b", 1)[0]);
    run.stop().await;
    // The log itself: after epoch 2's record, only epoch 2's records.
    let (log, _) = Log::open_dir(&scratch.path().join("server/log"), LogConfig::default()).unwrap();
    let mut newest = 0u64;
    log.read(0, |r| {
        let p = r.payload;
        match r.kind {
            EPOCH_RECORD => newest = u64::from_be_bytes(p[4..12].try_into().unwrap()),
            SHARD_RECORD => {
                let epoch = u64::from_be_bytes(p[4..12].try_into().unwrap());
                assert_eq!(
                    epoch, newest,
                    "a record of epoch {epoch} after epoch {newest}'s grant"
                );
            }
            _ => {}
        }
    })
    .unwrap();
    assert_eq!(newest, 2);
}

/// Guards guarantee 5 and §8.1: a worker that comes back within its lease resumes at the
/// same epoch; records it sends again are acknowledged, not written twice; different
/// bytes at a position the shard has are a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_within_the_lease_resumes_and_resent_records_are_not_written_twice() {
    let scratch = Scratch::new("flow-server-resume");
    let run = start(scratch.path(), settings(1));
    let (mut a, _) = Peer::hello(&run.socket, hello(7, "", vec![]))
        .await
        .unwrap();
    a.grants(1).await;
    a.send(append(0, 1, 0, recs("a", 3))).await.unwrap();
    a.durable_to(0, 3).await;
    a.confirm(0, 1).await;
    drop(a); // the connection is cut
    let (mut a, welcome) = Peer::hello(
        &run.socket,
        hello(
            7,
            "",
            vec![Resume {
                shard: 0,
                epoch: 1,
                acked: 1,
            }],
        ),
    )
    .await
    .unwrap();
    assert_eq!(
        welcome.grants,
        vec![Granted {
            shard: 0,
            epoch: 1,
            checkpoint: 0,
            end: 3
        }]
    );
    // It sends again from what it saw acknowledged (1), plus one new record.
    let mut again = recs("a", 3)[1..].to_vec();
    again.push(Rec {
        kind: 1,
        bytes: b"new".to_vec(),
    });
    a.send(append(0, 1, 1, again)).await.unwrap();
    a.durable_to(0, 4).await;
    let back = a.read_all(0, 1, 1 << 20).await;
    assert_eq!(back.len(), 4, "{back:?}");
    assert_eq!(back[3].bytes, b"new");
    // Other bytes at a position the shard has: a gap, nothing written.
    a.send(append(0, 1, 2, recs("other", 1))).await.unwrap();
    assert_eq!(
        a.refusal().await,
        Refused::PositionGap {
            shard: 0,
            expected: 4
        }
    );
    // A first position past the end: a gap too.
    a.send(append(0, 1, 9, recs("x", 1))).await.unwrap();
    assert_eq!(
        a.refusal().await,
        Refused::PositionGap {
            shard: 0,
            expected: 4
        }
    );
    assert_eq!(a.read_all(0, 1, 1 << 20).await.len(), 4);
    run.stop().await;
}

/// Guards §7: a restarted server keeps every shard's records and epochs, and its last
/// holder resumes at the same epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_keeps_records_and_epochs_for_the_last_holder() {
    let scratch = Scratch::new("flow-server-restart");
    let run = start(scratch.path(), settings(2));
    let (mut a, _) = Peer::hello(&run.socket, hello(3, "", vec![]))
        .await
        .unwrap();
    a.grants(2).await;
    a.send(append(1, 1, 0, recs("kept", 4))).await.unwrap();
    a.durable_to(1, 4).await;
    drop(a);
    run.stop().await;

    let run = start(scratch.path(), settings(2));
    assert_eq!(run.server.holders(), vec![(1, Some(3)), (1, Some(3))]);
    let (mut a, welcome) = Peer::hello(
        &run.socket,
        hello(
            3,
            "",
            vec![Resume {
                shard: 1,
                epoch: 1,
                acked: 4,
            }],
        ),
    )
    .await
    .unwrap();
    assert_eq!(welcome.grants.len(), 1);
    assert_eq!((welcome.grants[0].epoch, welcome.grants[0].end), (1, 4));
    assert_eq!(a.read_all(1, 1, 1 << 20).await, recs("kept", 4));
    // The shard it did not name is granted again at the next epoch, once a lease has
    // passed since the restart (its holder might have been running it).
    let g = a.ping_until_grants(1, Duration::from_millis(100)).await;
    assert_eq!((g[0].shard, g[0].epoch), (0, 2));
    run.stop().await;

    // Opened with another shard count: refused, saying which.
    let e = Server::open(
        &scratch.path().join("server"),
        settings(3),
        LogConfig::default(),
    )
    .err()
    .expect("a different shard count is refused");
    assert!(e.to_string().contains("made for 2 shards"), "{e}");
}

/// Guards "bad input gets a clear error and changes nothing": a wrong token, a frame
/// that is not a Hello first, bytes that are not a frame, another protocol version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_by_name_and_the_connection_closed() {
    let scratch = Scratch::new("flow-server-bad");
    let run = start(
        scratch.path(),
        Settings {
            tokens: vec![token_hash("s3cret")],
            ..settings(1)
        },
    );
    let mut p = Peer::connect(&run.socket).await.unwrap();
    p.send(Body::Hello(hello(1, "wrong", vec![])))
        .await
        .unwrap();
    assert_eq!(p.refusal().await, Refused::Unauthorized);
    assert!(p.recv().await.is_none(), "closed");

    let mut p = Peer::connect(&run.socket).await.unwrap();
    p.send(Body::Ping(vec![])).await.unwrap();
    assert!(
        matches!(p.refusal().await, Refused::Malformed { what } if what.contains("first frame must be a Hello"))
    );
    assert!(p.recv().await.is_none());

    let mut p = Peer::connect(&run.socket).await.unwrap();
    p.stream
        .write_all(&[0, 0, 0, 9, 250, 0, 0, 0, 0, 0, 0, 0, 1])
        .await
        .unwrap();
    assert!(
        matches!(p.refusal().await, Refused::Malformed { what } if what.contains("frame's type: 250"))
    );
    assert!(p.recv().await.is_none());

    let mut p = Peer::connect(&run.socket).await.unwrap();
    p.send(Body::Hello(Hello {
        version: 9,
        ..hello(1, "s3cret", vec![])
    }))
    .await
    .unwrap();
    assert_eq!(
        p.refusal().await,
        Refused::Version {
            supported: PROTOCOL
        }
    );

    // Before a Hello, a frame may not announce more than 64 KiB.
    let mut p = Peer::connect(&run.socket).await.unwrap();
    p.stream
        .write_all(&(1u32 << 20).to_be_bytes())
        .await
        .unwrap();
    assert!(
        matches!(p.refusal().await, Refused::Malformed { what } if what.contains("over the 65536 bytes allowed here"))
    );
    assert!(p.recv().await.is_none());

    // A client may call, but not act for a worker.
    let mut p = Peer::connect(&run.socket).await.unwrap();
    p.send(Body::Hello(Hello {
        role: Role::Client,
        ..hello(77, "s3cret", vec![])
    }))
    .await
    .unwrap();
    p.until(|b| matches!(b, Body::Welcome(_))).await;
    p.send(Body::Release {
        shard: 0,
        epoch: 1,
        end: 0,
    })
    .await
    .unwrap();
    assert!(
        matches!(p.refusal().await, Refused::Malformed { what } if what.contains("a client holds no shards"))
    );
    assert!(p.recv().await.is_none());

    // Nothing of the above held a shard: the right token is granted epoch 1.
    let (mut a, _) = {
        let mut p = Peer::connect(&run.socket).await.unwrap();
        p.send(Body::Hello(hello(1, "s3cret", vec![])))
            .await
            .unwrap();
        p.until(|b| matches!(b, Body::Welcome(_))).await;
        (p, ())
    };
    assert_eq!(a.grants(1).await[0].epoch, 1);
    // A shard number out of range is refused, and the connection goes on.
    for body in [
        Body::Release {
            shard: 5000,
            epoch: 1,
            end: 0,
        },
        Body::Recover {
            shard: 5000,
            epoch: 1,
            from: 0,
            max_bytes: 10,
        },
        append(5000, 1, 0, vec![]),
    ] {
        a.send(body).await.unwrap();
        assert_eq!(a.refusal().await, Refused::NotHeld { shard: 5000 });
    }
    // A second Hello is malformed: refused, and nothing after it is applied.
    a.send(Body::Hello(hello(1, "s3cret", vec![])))
        .await
        .unwrap();
    // The server may have refused and closed already: the write can then fail (a broken
    // pipe), and what it carried is never applied either way.
    let _ = a
        .send(append(
            0,
            1,
            0,
            vec![Rec {
                kind: 1,
                bytes: b"after".to_vec(),
            }],
        ))
        .await;
    assert!(
        matches!(a.refusal().await, Refused::Malformed { what } if what.contains("a second Hello"))
    );
    assert!(a.recv().await.is_none());
    assert_eq!(run.server.status().shards[0].records, 0);
    run.stop().await;
}

/// Guards §7's page size: a Recover asking for more than 1 MiB gets at most 1 MiB of
/// records (and one record at least), counted as the page's frame carries them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_pages_are_capped_whatever_is_asked() {
    let scratch = Scratch::new("flow-server-pages");
    let run = start(scratch.path(), settings(1));
    let (mut a, _) = Peer::hello(&run.socket, hello(1, "", vec![]))
        .await
        .unwrap();
    a.grants(1).await;
    let big = vec![7u8; 300 << 10];
    let records: Vec<Rec> = (0..8)
        .map(|_| Rec {
            kind: 1,
            bytes: big.clone(),
        })
        .collect();
    a.send(append(0, 1, 0, records)).await.unwrap();
    a.durable_to(0, 8).await;
    a.send(Body::Recover {
        shard: 0,
        epoch: 1,
        from: 0,
        max_bytes: u32::MAX,
    })
    .await
    .unwrap();
    let Body::Records(page) = a.until(|b| matches!(b, Body::Records(_))).await else {
        unreachable!()
    };
    assert_eq!(
        page.records.len(),
        3,
        "three records of 300 KiB fit in 1 MiB, a fourth does not"
    );
    assert!(!page.last);
    // A page asked smaller than one record still carries one.
    a.send(Body::Recover {
        shard: 0,
        epoch: 1,
        from: 3,
        max_bytes: 1,
    })
    .await
    .unwrap();
    let Body::Records(page) = a.until(|b| matches!(b, Body::Records(_))).await else {
        unreachable!()
    };
    assert_eq!((page.first, page.records.len()), (3, 1));
    run.stop().await;
}
