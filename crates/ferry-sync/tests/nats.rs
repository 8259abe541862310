//! NATS JetStream as the transport (docs/sync-nats.md), on a real nats-server of the
//! test's own and a real Postgres: two bridges publish every frame once and in order; a
//! store provisioned over its durable consumer writes sales that are filed once each; a
//! replica that stopped between a delivery and its acknowledgement gets those frames
//! back first; a stranger's upload files nothing and is told why; a publish repeated
//! under the same upload id is dropped by JetStream.
//!
//! Guards against: a frame published twice or out of order by racing bridges, an
//! unacknowledged frame lost to a replica's crash (a gap and a needless catch-up), an
//! upload filed under a replica whose token it lacks, and an answer matched to the wrong
//! upload.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::up::{RECORDS_RULES, RECORDS_SCHEMA, server_sales};
use common::{SHOP_RULES, SHOP_SCHEMA, Shop};
use ferry_sync::nats::bridge::Bridge;
use ferry_sync::nats::link::NatsLink;
use ferry_sync::nats::{Names, TOKEN_HEADER, UPLOAD_HEADER};
use ferry_sync::relay::RelayStats;
use ferry_sync::replica::{Downlink, Position, Replica, RunSettings, UpSettings, Uploader};
use ferry_sync::serve::Serve;
use ferry_sync::{enroll, wire};
use ferry_testkit::servers::PrivateNats;
use futures_util::StreamExt;
use uuid::Uuid;

/// A bridge of its own (its own pools and connection to NATS), running until `stop`.
async fn start_bridge(
    shop: &Shop,
    nats: &str,
    names: &Names,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Arc<ferry_sync::nats::bridge::BridgeStats> {
    let pool = sqlx::PgPool::connect(&shop.db.url).await.unwrap();
    let serve = Serve::new(pool, Arc::new(RelayStats::default()))
        .await
        .unwrap()
        .file_into(shop.spec.records.clone(), Default::default());
    let bridge = Bridge::connect(serve, nats, names.clone())
        .await
        .expect("the bridge connects");
    let stats = bridge.stats.clone();
    tokio::spawn(async move { bridge.run(stop).await.expect("the bridge runs") });
    stats
}

/// A store in `region` enrolled under a token the test knows (its file is not the shop's).
async fn enrolled(shop: &Shop, region: &str) -> (Uuid, String) {
    let id = Uuid::new_v4();
    sqlx::query("INSERT INTO stores (id, region) VALUES ($1, $2)")
        .bind(id)
        .bind(region)
        .execute(&shop.db.pool)
        .await
        .unwrap();
    let token = enroll::new_token();
    let mut conn = shop.db.pool.acquire().await.unwrap();
    enroll::enroll(&mut conn, id, &token).await.unwrap();
    (id, token)
}

/// Passes until `done` holds, or panics naming `what` after `limit`.
async fn passes_until(
    shop: &mut Shop,
    what: &str,
    limit: Duration,
    mut done: impl AsyncFnMut(&Shop) -> bool,
) {
    let start = Instant::now();
    while start.elapsed() < limit {
        shop.passes().await;
        if done(shop).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within {limit:?}");
}

/// Ten sales by `store`, amounts `batch * 10 ..`, in one transaction of its app's.
fn sell(app: &rusqlite::Connection, store: Uuid, batch: i64) {
    app.execute_batch("BEGIN").unwrap();
    for i in 0..10 {
        app.execute(
            "INSERT INTO sales (id, store_id, amount) VALUES (?1, ?2, ?3)",
            rusqlite::params![
                Uuid::new_v4().to_string(),
                store.to_string(),
                batch * 10 + i
            ],
        )
        .unwrap();
    }
    app.execute_batch("COMMIT").unwrap();
}

/// Where a replica that took every one of `frames` stands: after the last (docs/sync-protocol.md
/// §1.1 has the head's offsets).
fn after(frames: &[Vec<u8>]) -> Position {
    match frames.last() {
        None => Position {
            epoch: None,
            seq: 0,
            nonce: 0,
        },
        Some(f) => Position {
            epoch: Some(f[24..40].try_into().unwrap()),
            seq: u64::from_be_bytes(f[40..48].try_into().unwrap()),
            nonce: u64::from_be_bytes(f[48..56].try_into().unwrap()),
        },
    }
}

fn count(db: &std::path::Path, sql: &str) -> i64 {
    let Ok(conn) = rusqlite::Connection::open(db) else {
        return -1;
    };
    conn.query_row(sql, [], |r| r.get(0)).unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_over_jetstream_is_provisioned_and_its_sales_are_filed_once_each() {
    let mut shop = Shop::new_with(
        "nats",
        &format!("{SHOP_SCHEMA}{RECORDS_SCHEMA}"),
        &format!("{SHOP_RULES}{RECORDS_RULES}"),
    )
    .await;
    let scratch = ferry_testkit::Scratch::new("sync-nats");
    let nats = PrivateNats::start(scratch.path());
    let names = Names::new("shop.sync").unwrap();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    // Two bridges: both publish, so the fence on the subject's last message is tested.
    let a = start_bridge(&shop, &nats.url(), &names, stop.clone()).await;
    let b = start_bridge(&shop, &nats.url(), &names, stop.clone()).await;

    shop.db
        .exec("INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 300) g")
        .await;
    let (store, token) = enrolled(&shop, "north").await;
    let db = scratch.path().join("store.db");

    // The store's two loops, as `ferry sync replica --server nats://…` runs them.
    let halt = Arc::new(AtomicBool::new(false));
    let (url, n2) = (nats.url(), names.clone());
    let (db2, token2, halt2) = (db.clone(), token.clone(), halt.clone());
    let down = std::thread::spawn(move || {
        let mut link = NatsLink::new(&url, n2, store, &token2).unwrap();
        let mut replica = Replica::open(&db2, wire::seal_key(token2.as_bytes())).unwrap();
        let settings = RunSettings {
            wait: Duration::from_millis(500),
            report_every: Duration::from_millis(100),
            ..RunSettings::default()
        };
        replica.run(&mut link, &halt2, &settings).unwrap();
    });
    passes_until(
        &mut shop,
        "the store provisioned over NATS",
        Duration::from_secs(60),
        async |_| count(&db, "SELECT count(*) FROM products") == 300,
    )
    .await;

    // Changes after provisioning travel too, in many small messages.
    for i in 1..=40 {
        shop.db
            .exec(&format!(
                "UPDATE products SET price = price + 1000 WHERE id = {i}"
            ))
            .await;
        shop.passes().await;
    }
    passes_until(
        &mut shop,
        "the updates over NATS",
        Duration::from_secs(60),
        async |_| {
            count(
                &db,
                "SELECT count(*) FROM products WHERE CAST(price AS REAL) > 1000",
            ) == 40
        },
    )
    .await;

    // The way up: 200 sales in 20 transactions.
    let (url, n2, token2, db2, halt2) = (
        nats.url(),
        names.clone(),
        token.clone(),
        db.clone(),
        halt.clone(),
    );
    let up = std::thread::spawn(move || {
        let mut link = NatsLink::new(&url, n2, store, &token2).unwrap();
        let mut uploader = Uploader::open(&db2, wire::seal_key(token2.as_bytes()), store).unwrap();
        let settings = UpSettings {
            poll: Duration::from_millis(5),
            ..UpSettings::default()
        };
        uploader.run(&mut link, &halt2, &settings).unwrap();
    });
    let app = rusqlite::Connection::open(&db).unwrap();
    app.busy_timeout(Duration::from_secs(5)).unwrap();
    for batch in 0..20 {
        sell(&app, store, batch);
    }
    let pool = shop.db.pool.clone();
    let start = Instant::now();
    loop {
        let sales = server_sales(&pool).await;
        if sales.len() == 200 {
            let mut amounts: Vec<i64> = sales.values().map(|(_, a, _)| *a).collect();
            amounts.sort();
            assert_eq!(
                amounts,
                (0..200).collect::<Vec<_>>(),
                "each sale filed once"
            );
            assert!(sales.values().all(|(s, _, _)| *s == store.to_string()));
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "sales filed: {}",
            sales.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    halt.store(true, Ordering::SeqCst);
    down.join().unwrap();
    up.join().unwrap();

    // Every frame on the store's subject once, in order.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let stream = js.get_stream(names.down_stream()).await.unwrap();
    let mut seqs = Vec::new();
    let mut at = 1;
    while let Ok(m) = stream
        .raw_message_builder()
        .sequence(at)
        .next_by_subject(names.down(store))
        .send()
        .await
    {
        at = m.sequence + 1;
        seqs.push(
            m.headers
                .get("Ferry-Seq")
                .unwrap()
                .as_str()
                .parse::<u64>()
                .unwrap(),
        );
    }
    assert!(seqs.len() > 40, "frames published: {seqs:?}");
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "each frame once, in chain order: {seqs:?}"
    );
    let published = a.frames.load(Ordering::Relaxed) + b.frames.load(Ordering::Relaxed);
    assert_eq!(
        published as usize,
        seqs.len(),
        "the bridges count what they published"
    );

    // A stranger (a wrong token) publishing on the store's subject files nothing, is
    // counted, and gets no answer on the store's subject (an unsealed refusal there could
    // make the store set rows aside). A malformed upload under the right token is
    // answered with the reason.
    let mut answers = client.subscribe(names.filed(store)).await.unwrap();
    client.flush().await.unwrap();
    let upload = wire::Upload {
        restated: false,
        id: 1,
        filed_n: 0,
        lane: "sales".into(),
        parts: vec![],
    };
    let refused = || a.refused.load(Ordering::Relaxed) + b.refused.load(Ordering::Relaxed);
    for (token, body) in [
        ("not-the-token", wire::encode_upload(&upload).unwrap()),
        (token.as_str(), b"not an upload".to_vec()),
    ] {
        let before = refused();
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(TOKEN_HEADER, token);
        headers.insert(UPLOAD_HEADER, "1");
        js.publish_with_headers(names.upload(store), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(3), answers.next()).await;
        if token == "not-the-token" {
            assert!(answer.is_err(), "no answer to a stranger");
        } else {
            let why = answer.expect("an answer").unwrap().headers.unwrap();
            let why = why.get("Ferry-Refused").unwrap().to_string();
            assert!(why.contains("not filed"), "{why}");
        }
        assert_eq!(refused(), before + 1, "the refusal is counted");
    }
    assert_eq!(server_sales(&pool).await.len(), 200);

    // A publish repeated under its upload id is dropped by JetStream's deduplication.
    let mut first = None;
    for _ in 0..2 {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(TOKEN_HEADER, token.as_str());
        headers.insert("Nats-Msg-Id", format!("{store}.up.77").as_str());
        let ack = js
            .publish_with_headers(
                names.upload(store),
                headers,
                wire::encode_upload(&upload).unwrap().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        match first {
            None => first = Some(ack.sequence),
            Some(seq) => assert!(ack.duplicate && ack.sequence == seq, "{ack:?}"),
        }
    }
    let _ = stop_tx.send(true);
    shop.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_not_taken_come_back_after_a_crash_and_from_where_the_replica_stands() {
    let mut shop = Shop::new("nats_ack").await;
    let scratch = ferry_testkit::Scratch::new("sync-nats-ack");
    let nats = PrivateNats::start(scratch.path());
    let names = Names::new("ack.sync").unwrap();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    start_bridge(&shop, &nats.url(), &names, stop).await;
    let (store, token) = enrolled(&shop, "north").await;
    // Ten messages: a snapshot and nine changes, each its own pass.
    shop.db
        .exec("INSERT INTO products VALUES (1, 'nut', 1, 'north')")
        .await;
    shop.passes().await;
    for i in 2..=10 {
        shop.db
            .exec(&format!("UPDATE products SET price = {i} WHERE id = 1"))
            .await;
        shop.passes().await;
    }
    let url = nats.url();
    let (given, again, turns, taken, restored) = tokio::task::spawn_blocking(move || {
        // Where a replica that took every frame handed stands: after the last.
        let fetch_all = |link: &mut NatsLink| {
            let mut frames = Vec::new();
            let start = Instant::now();
            while frames.len() < 10 && start.elapsed() < Duration::from_secs(30) {
                let position = after(&frames);
                frames.extend(link.fetch(position, 4, Duration::from_millis(200)).unwrap());
            }
            frames
        };
        // The first run is given all ten, acknowledging the first batches as it asks for
        // more, and stops before acknowledging the last.
        let mut first = NatsLink::new(&url, names.clone(), store, &token).unwrap();
        let given = fetch_all(&mut first);
        drop(first);
        let names_again = names.clone();
        let mut second = NatsLink::new(&url, names, store, &token).unwrap();
        let wait = Duration::from_millis(200);
        // It stood after frame 8 when it stopped (its file is not part of this test).
        let again = second.fetch(after(&given[..8]), 64, wait).unwrap();
        // A replica that did not take them (cut short, say) asks from the same place: they
        // are read again from the stream; a reading again that moved it nowhere gives the
        // next turn to the consumer (nothing new), and the one after reads them again.
        let turns: Vec<usize> = (0..3)
            .map(|_| second.fetch(after(&given[..8]), 64, wait).unwrap().len())
            .collect();
        let taken = second.fetch(after(&given), 64, wait).unwrap();
        drop(second);
        // A store whose file was restored from an older copy stands after frame 5, before
        // the acknowledgement floor: its frames from there are read again, first.
        let mut third = NatsLink::new(&url, names_again, store, &token).unwrap();
        let restored = third.fetch(after(&given[..5]), 64, wait).unwrap();
        (given, again, turns, taken, restored)
    })
    .await
    .unwrap();
    assert_eq!(given.len(), 10, "every frame was given");
    // Batches of four: the last batch (frames 9 and 10) was never acknowledged.
    assert_eq!(
        again,
        given[8..].to_vec(),
        "the unacknowledged frames come back, first"
    );
    assert_eq!(
        turns,
        [2, 0, 2],
        "read again, the consumer's turn, read again"
    );
    assert!(
        taken.is_empty(),
        "once taken, nothing comes again: {}",
        taken.len()
    );
    assert_eq!(
        restored,
        given[5..].to_vec(),
        "a restored store gets what it lacks"
    );
    let _ = stop_tx.send(true);
    shop.finish().await;
}

/// The NATS server killed (SIGKILL) while the store writes and the server changes rows,
/// and started again on its own store: every sale is filed once, every change arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_killed_mid_traffic_loses_nothing_either_way() {
    let mut shop = Shop::new_with(
        "nats_kill",
        &format!("{SHOP_SCHEMA}{RECORDS_SCHEMA}"),
        &format!("{SHOP_RULES}{RECORDS_RULES}"),
    )
    .await;
    let scratch = ferry_testkit::Scratch::new("sync-nats-kill");
    let mut nats = PrivateNats::start(scratch.path());
    let names = Names::new("kill.sync").unwrap();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    start_bridge(&shop, &nats.url(), &names, stop).await;
    shop.db
        .exec("INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 50) g")
        .await;
    let (store, token) = enrolled(&shop, "north").await;
    let db = scratch.path().join("store.db");
    let halt = Arc::new(AtomicBool::new(false));
    let mut loops = Vec::new();
    for way in ["down", "up"] {
        let (url, names, db, token, halt) = (
            nats.url(),
            names.clone(),
            db.clone(),
            token.clone(),
            halt.clone(),
        );
        loops.push(std::thread::spawn(move || {
            let mut link = NatsLink::new(&url, names, store, &token).unwrap();
            let seal = wire::seal_key(token.as_bytes());
            if way == "down" {
                let settings = RunSettings {
                    wait: Duration::from_millis(300),
                    report_every: Duration::from_millis(100),
                    ..RunSettings::default()
                };
                Replica::open(&db, seal)
                    .unwrap()
                    .run(&mut link, &halt, &settings)
                    .unwrap();
            } else {
                // The file exists once the down loop opened it.
                while !db.exists() {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let settings = UpSettings {
                    poll: Duration::from_millis(5),
                    ..UpSettings::default()
                };
                let mut uploader = Uploader::open(&db, seal, store).unwrap();
                uploader.run(&mut link, &halt, &settings).unwrap();
            }
        }));
    }
    passes_until(
        &mut shop,
        "the store provisioned",
        Duration::from_secs(60),
        async |_| {
            count(&db, "SELECT count(*) FROM sales") == 0
                && count(&db, "SELECT count(*) FROM products") == 50
        },
    )
    .await;
    let app = rusqlite::Connection::open(&db).unwrap();
    app.busy_timeout(Duration::from_secs(5)).unwrap();
    let sell = |batch: i64| sell(&app, store, batch);
    for batch in 0..3 {
        sell(batch);
        shop.db
            .exec(&format!(
                "UPDATE products SET price = 1000 + {batch} WHERE id = {}",
                batch + 1
            ))
            .await;
        shop.passes().await;
    }
    nats.kill();
    // While NATS is away: the store sells, the server changes rows.
    for batch in 3..7 {
        sell(batch);
        shop.db
            .exec(&format!(
                "UPDATE products SET price = 1000 + {batch} WHERE id = {}",
                batch + 1
            ))
            .await;
        shop.passes().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    nats.up();
    for batch in 7..10 {
        sell(batch);
        shop.db
            .exec(&format!(
                "UPDATE products SET price = 1000 + {batch} WHERE id = {}",
                batch + 1
            ))
            .await;
        shop.passes().await;
    }
    let pool = shop.db.pool.clone();
    passes_until(
        &mut shop,
        "every sale filed and every change arrived",
        Duration::from_secs(90),
        async |_| {
            server_sales(&pool).await.len() == 100
                && count(
                    &db,
                    "SELECT count(*) FROM products WHERE CAST(price AS REAL) >= 1000",
                ) == 10
        },
    )
    .await;
    let mut amounts: Vec<i64> = server_sales(&pool)
        .await
        .values()
        .map(|(_, a, _)| *a)
        .collect();
    amounts.sort();
    assert_eq!(
        amounts,
        (0..100).collect::<Vec<_>>(),
        "each sale filed once"
    );
    halt.store(true, Ordering::SeqCst);
    for l in loops {
        l.join().unwrap();
    }
    let _ = stop_tx.send(true);
    shop.finish().await;
}

/// Reports keep their order (docs/sync-nats.md §4): the reports stream keeps the latest
/// per replica, so of two reports waiting for a bridge only the newer is stored. An
/// older one stored after a newer would read to the relay as a replica restored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_two_reports_waiting_only_the_newer_is_stored() {
    let shop = Shop::new("nats_reports").await;
    let scratch = ferry_testkit::Scratch::new("sync-nats-reports");
    let nats = PrivateNats::start(scratch.path());
    let names = Names::new("rep.sync").unwrap();
    let (store, token) = enrolled(&shop, "north").await;
    let pool = sqlx::PgPool::connect(&shop.db.url).await.unwrap();
    let serve = Serve::new(pool, Arc::new(RelayStats::default()))
        .await
        .unwrap();
    // Connected (its streams made), not yet running.
    let bridge = Bridge::connect(serve, &nats.url(), names.clone())
        .await
        .unwrap();
    let replica = Replica::open(
        &scratch.path().join("store.db"),
        wire::seal_key(token.as_bytes()),
    )
    .unwrap();
    let report = wire::encode_up(&replica.up().unwrap());
    drop(replica);
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    for _ in 0..2 {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(TOKEN_HEADER, token.as_str());
        js.publish_with_headers(names.report(store), headers, report.clone().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let stats = bridge.stats.clone();
    tokio::spawn(async move { bridge.run(stop).await.unwrap() });
    let stored = || async {
        sqlx::query_scalar::<_, i64>("SELECT n FROM ferry_sync.reports WHERE replica = $1")
            .bind(store)
            .fetch_optional(&shop.db.pool)
            .await
            .unwrap()
    };
    let start = Instant::now();
    while stored().await.is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the report was never stored"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stored().await, Some(1), "only the newer report was stored");
    assert_eq!(stats.reports.load(Ordering::Relaxed), 1);
    let _ = stop_tx.send(true);
    shop.finish().await;
}

/// A fetch waiting for frames returns at the first one, as HTTP's long poll does, not
/// when its wait ends: a pull asking JetStream for a whole window waits out its expiry
/// unless the window fills, which held every change back by the replica's wait (20 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_fetch_returns_at_the_first_frame() {
    let mut shop = Shop::new("nats_poll").await;
    let scratch = ferry_testkit::Scratch::new("sync-nats-poll");
    let nats = PrivateNats::start(scratch.path());
    let names = Names::new("poll.sync").unwrap();
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    start_bridge(&shop, &nats.url(), &names, stop).await;
    let (store, token) = enrolled(&shop, "north").await;
    shop.db
        .exec("INSERT INTO products VALUES (1, 'nut', 1, 'north')")
        .await;
    shop.passes().await;
    let url = nats.url();
    let waiting = tokio::task::spawn_blocking(move || {
        let mut link = NatsLink::new(&url, names, store, &token).unwrap();
        let none = after(&[]);
        let mut snapshot = Vec::new();
        while snapshot.is_empty() {
            snapshot = link.fetch(none, 64, Duration::from_millis(200)).unwrap();
        }
        let start = Instant::now();
        let frames = link
            .fetch(after(&snapshot), 64, Duration::from_secs(20))
            .unwrap();
        (frames.len(), start.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    shop.db
        .exec("UPDATE products SET price = 2 WHERE id = 1")
        .await;
    shop.passes().await;
    let (frames, took) = waiting.await.unwrap();
    assert_eq!(frames, 1, "the change's frame");
    assert!(
        took < Duration::from_secs(10),
        "returned at the frame, not at the wait's end: {took:?}"
    );
    let _ = stop_tx.send(true);
    shop.finish().await;
}
