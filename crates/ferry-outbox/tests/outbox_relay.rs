//! The relay end to end, against real SQLite files, a real Postgres, a real NATS
//! JetStream and a real HTTP endpoint. Every scenario ends with the ledger check: each
//! committed message arrived once, nothing rolled back arrived, and each key arrived in
//! commit order.

mod common;

use common::*;
use ferry_outbox::relay::RelayConfig;
use ferry_outbox::sink::Faults;
use ferry_outbox::store::Select;
use ferry_outbox::transport::TransportOptions;
use ferry_outbox::{Db, Message, Store};
use std::time::Duration;

// The embedded default: SQLite to a webhook. Guards against lost, duplicated, reordered
// or rolled-back messages on the plain path, with the app writing while the relay runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_to_a_webhook_delivers_every_committed_message_once_in_key_order() {
    let dir = ferry_testkit::Scratch::new("outbox-sqlite");
    let store = sqlite_store(&dir).await;
    let app = App::open(&store).await;
    let sink = RunningSink::start(Some(b"s3cret".to_vec())).await;
    let options = TransportOptions {
        webhook_secret: Some(b"s3cret".to_vec()),
        ..TransportOptions::default()
    };
    let (relay, running) = start_relay(&store, &sink.url, fast_config(), options).await;
    let ledger = write_workload(&app, 400, 12, 1).await;
    assert!(drained(&store, Duration::from_secs(30)).await);
    running.stop().await.unwrap();
    ledger.check(&sink.sink.received());
    assert_eq!(sink.sink.bad_signatures(), 0);
    let st = relay.status();
    assert_eq!(st.fenced, 0);
    assert_eq!(st.parked, 0);
}

// Postgres to JetStream, with three relays racing on one table. Guards against two
// relays publishing one message (beyond what the stream deduplicates), and against
// per-key order breaking when keys move between relays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_postgres_relays_racing_to_jetstream_keep_key_order_without_duplicates() {
    let f = JetStreamOutbox::start("FERRY").await;
    let options = f.options();
    let mut relays = Vec::new();
    for _ in 0..3 {
        relays.push(start_relay(&f.store, &nats_url(), fast_config(), options.clone()).await);
    }
    // Every message on a topic the test's own stream covers.
    let ledger = {
        let mut l = common::Ledger::default();
        let mut rng = ferry_core::seams::SplitMix64::seeded(3);
        use ferry_core::seams::Rng;
        for t in 0..300 {
            let key = format!("k{}", rng.below(10));
            let m = Message::new(f.topic.clone(), format!("{t}").into_bytes()).ordered_by(key);
            let commit = t % 9 != 4;
            f.app.write(std::slice::from_ref(&m), commit).await.unwrap();
            if commit {
                l.committed.push(m)
            } else {
                l.rolled_back.push(m)
            }
        }
        l
    };
    assert!(drained(&f.store, Duration::from_secs(60)).await);
    for (_, running) in relays {
        running.stop().await.unwrap();
    }
    let got = f.received().await;
    ledger.check(&got);
    f.finish().await;
}

// Guards against a poison message blocking everything (or being retried forever): the
// endpoint refuses one message; it is parked after its attempts with the error, later
// messages of its key wait behind it, every other key flows; requeued after the fix, it
// and its key's backlog go through in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_parked_while_other_keys_flow_and_requeue_delivers_it_in_order() {
    let dir = ferry_testkit::Scratch::new("outbox-poison");
    let store = sqlite_store(&dir).await;
    let app = App::open(&store).await;
    let sink = RunningSink::start(None).await;
    let poison = Message::new("orders", b"poison".to_vec()).ordered_by("bad");
    let after = Message::new("orders", b"after".to_vec()).ordered_by("bad");
    sink.sink.set_faults(Faults {
        refuse: [(poison.message_id.clone(), 422)].into(),
        ..Faults::default()
    });
    let config = RelayConfig {
        max_attempts: 2,
        ..fast_config()
    };
    let (relay, running) =
        start_relay(&store, &sink.url, config, TransportOptions::default()).await;
    app.write(std::slice::from_ref(&poison), true)
        .await
        .unwrap();
    app.write(std::slice::from_ref(&after), true).await.unwrap();
    let mut ledger = write_workload(&app, 60, 5, 4).await;
    // Everything but the poison and the one behind it arrives.
    let want = ledger.committed.len();
    assert!(
        eventually(Duration::from_secs(30), || sink.sink.received().len()
            == want)
        .await
    );
    assert!(
        eventually(Duration::from_secs(30), || relay.status().parked == 1).await,
        "the poison message was not parked: {:?}",
        relay.status()
    );
    let st = store.status().await.unwrap();
    assert_eq!(st.parked, 1);
    assert_eq!(st.parked_messages[0].message_id, poison.message_id);
    assert!(
        st.parked_messages[0]
            .last_error
            .as_deref()
            .unwrap()
            .contains("HTTP 422"),
        "{st:?}"
    );
    assert_eq!(st.pending, 1, "the message behind the poison waits: {st:?}");
    assert!(
        !sink
            .sink
            .received()
            .iter()
            .any(|r| r.message_id == after.message_id)
    );
    // The endpoint is fixed; the operator requeues.
    sink.sink.set_faults(Faults::default());
    assert_eq!(
        store
            .requeue(&Select::MessageIds(vec![poison.message_id.clone()]))
            .await
            .unwrap(),
        1
    );
    relay.wake();
    assert!(drained(&store, Duration::from_secs(30)).await);
    running.stop().await.unwrap();
    ledger.committed.push(poison);
    ledger.committed.push(after);
    // Received order per key: the fixed key arrives poison then after.
    ledger.check(&sink.sink.received());
}

// Guards against an outage turning into parked messages (ai-crew-sync parks everything
// after a few minutes of broker outage): the endpoint answers 503 to everything, then
// goes away altogether, then comes back; nothing is parked, no attempt is spent, and
// everything arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_outage_spends_no_attempts_and_heals_by_itself() {
    let db = TestDb::create().await;
    let store = pg_store(&db).await;
    let app = App::open(&store).await;
    let sink = RunningSink::start(None).await;
    let config = RelayConfig {
        max_attempts: 2,
        ..fast_config()
    };
    let (relay, running) =
        start_relay(&store, &sink.url, config, TransportOptions::default()).await;
    sink.sink.set_faults(Faults {
        all: Some(503),
        ..Faults::default()
    });
    let mut ledger = write_workload(&app, 40, 4, 5).await;
    assert!(
        eventually(Duration::from_secs(10), || relay.status().breaker_open).await,
        "{:?}",
        relay.status()
    );
    let (s, port) = sink.stop().await;
    ledger
        .committed
        .extend(write_workload(&app, 40, 4, 6).await.committed);
    // The endpoint stays away until two more of the relay's probes have failed, more
    // than two attempts' retries would take (waited for, not timed: the breaker's pause
    // grows with each opening, so how many probes fit in a fixed stretch depends on the
    // machine's load); it parks nothing meanwhile.
    let probes = relay.status().breaker_probes_failed;
    assert!(
        eventually(Duration::from_secs(30), || relay
            .status()
            .breaker_probes_failed
            >= probes + 2)
        .await,
        "{:?}",
        relay.status()
    );
    let st = store.status().await.unwrap();
    assert_eq!(st.parked, 0, "{st:?}");
    s.set_faults(Faults::default());
    let sink = RunningSink::start_on(port, s).await;
    assert!(drained(&store, Duration::from_secs(60)).await);
    running.stop().await.unwrap();
    ledger.check(&sink.sink.received());
    let st = relay.status();
    assert_eq!(st.parked, 0);
    assert_eq!(st.retried, 0, "an outage spent attempts: {st:?}");
    assert!(st.unavailable > 0);
}

// Guards against a lost acknowledgement becoming a duplicate or a loss: the endpoint
// stores a message and never answers; the relay marks it uncertain, presents it again
// under the same Idempotency-Key, and the endpoint's dedup answers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_acknowledgement_is_resolved_by_the_same_id_without_a_duplicate() {
    let dir = ferry_testkit::Scratch::new("outbox-lostack");
    let store = sqlite_store(&dir).await;
    let app = App::open(&store).await;
    let sink = RunningSink::start(None).await;
    let m = Message::new("orders", b"x".to_vec()).ordered_by("a");
    sink.sink.set_faults(Faults {
        lose_ack: [m.message_id.clone()].into(),
        ..Faults::default()
    });
    let options = TransportOptions {
        publish_timeout: Duration::from_millis(500),
        ..TransportOptions::default()
    };
    let (relay, running) = start_relay(&store, &sink.url, fast_config(), options).await;
    app.write(std::slice::from_ref(&m), true).await.unwrap();
    let mut ledger = write_workload(&app, 20, 3, 7).await;
    assert!(drained(&store, Duration::from_secs(30)).await);
    running.stop().await.unwrap();
    ledger.committed.insert(0, m);
    ledger.check(&sink.sink.received());
    assert_eq!(
        sink.sink.duplicates(),
        1,
        "the second presentation is the endpoint's duplicate"
    );
    let st = relay.status();
    assert_eq!(st.uncertain, 1);
    assert_eq!(st.reconciled, 1);
}

// Guards against the two classic ordering bugs of outboxes: a row whose transaction
// commits late being skipped, and a long transaction stalling everything (as reading
// below the snapshot horizon does). Transaction A enqueues to key "slow" and stays open;
// transaction B on "slow" waits behind A's key lock; everything else flows meanwhile.
// When A commits, "slow" arrives A then B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_open_transaction_delays_only_its_own_key_and_keeps_its_order() {
    let db = TestDb::create().await;
    let store = pg_store(&db).await;
    let app = App::open(&store).await;
    let Db::Pg(pool) = store.db() else {
        unreachable!()
    };
    let sink = RunningSink::start(None).await;
    let (_relay, running) = start_relay(
        &store,
        &sink.url,
        fast_config(),
        TransportOptions::default(),
    )
    .await;
    let a = Message::new("orders", b"a".to_vec()).ordered_by("slow");
    let b = Message::new("orders", b"b".to_vec()).ordered_by("slow");
    let mut tx_a = pool.begin().await.unwrap();
    ferry_outbox::enqueue(&mut *tx_a, &a).await.unwrap();
    let b2 = b.clone();
    let app_b = App::Pg(pool.clone());
    let writer_b = tokio::spawn(async move { app_b.write(std::slice::from_ref(&b2), true).await });
    // B's transaction is seen waiting on a lock (A's key row), and has not finished.
    let mut b_waits = false;
    for _ in 0..500 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND datname = current_database()",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            b_waits = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(b_waits, "B never waited for a lock");
    assert!(!writer_b.is_finished(), "B did not wait for A's key lock");
    let mut ledger = write_workload(&app, 50, 5, 50).await;
    let others = ledger.committed.len();
    assert!(
        eventually(Duration::from_secs(20), || sink.sink.received().len()
            == others)
        .await,
        "other keys stalled behind an open transaction"
    );
    tx_a.commit().await.unwrap();
    writer_b.await.unwrap().unwrap();
    ledger.committed.push(a);
    ledger.committed.push(b);
    assert!(drained(&store, Duration::from_secs(20)).await);
    running.stop().await.unwrap();
    ledger.check(&sink.sink.received());
}

// Guards the fence itself: a relay whose lease ran out settles nothing, whatever the
// outcome it reports, and the holder after it settles normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settle_after_the_lease_ran_out_writes_nothing() {
    use ferry_core::epoch::Fence;
    use ferry_outbox::store::{FencedRow, Settle, SettleRow};
    let db = TestDb::create().await;
    let dir = ferry_testkit::Scratch::new("outbox-fence-sqlite");
    for store in [pg_store(&db).await, sqlite_store(&dir).await] {
        let app = App::open(&store).await;
        app.write(&[Message::new("t", b"x".to_vec()).ordered_by("k")], true)
            .await
            .unwrap();
        let first = store
            .lease("one", 10, Duration::from_millis(300))
            .await
            .unwrap();
        assert_eq!(first.len(), 1);
        assert!(
            store
                .lease("two", 10, Duration::from_secs(30))
                .await
                .unwrap()
                .is_empty(),
            "leased twice"
        );
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(store.reclaim_expired().await.unwrap(), 1);
        let second = store
            .lease("two", 10, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(second.len(), 1);
        assert!(
            second[0].uncertain,
            "a message whose holder vanished is uncertain"
        );
        let stale = store
            .settle("one", &[SettleRow::new(&first[0], Settle::Confirmed)])
            .await
            .unwrap();
        assert_eq!(
            stale.fenced,
            vec![FencedRow {
                id: first[0].id,
                fence: Some(Fence::Stale {
                    held: second[0].generation
                })
            }],
            "the stale settle is told it was leased again since"
        );
        assert_eq!(
            store.status().await.unwrap().leased,
            1,
            "the stale settle wrote"
        );
        let ok = store
            .settle("two", &[SettleRow::new(&second[0], Settle::Confirmed)])
            .await
            .unwrap();
        assert_eq!(ok.deleted, 1);
        assert_eq!(store.status().await.unwrap().leased, 0);
    }
}

// Bad input changes nothing: an oversized payload, an ordered message without a key and
// a bad topic are refused at enqueue with the field named, and the transaction holding
// them still commits its other writes; the SQL function refuses the same on Postgres.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_are_refused_at_enqueue_and_nothing_is_written() {
    let db = TestDb::create().await;
    let store = pg_store(&db).await;
    let Db::Pg(pool) = store.db() else {
        unreachable!()
    };
    let mut tx = pool.begin().await.unwrap();
    let big = Message::new("t", vec![0u8; ferry_outbox::message::PAYLOAD_BYTES_MAX + 1]);
    let e = ferry_outbox::enqueue(&mut *tx, &big)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("payload is 1000001 bytes, over the limit of 1000000"),
        "{e}"
    );
    let e = ferry_outbox::enqueue(&mut *tx, &Message::new("a..b", b"x".to_vec()))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a valid subject"), "{e}");
    ferry_outbox::enqueue(&mut *tx, &Message::new("ok", b"x".to_vec()))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(store.status().await.unwrap().pending, 1);
    // The SQL way checks the same limit.
    let e = sqlx::query("SELECT ferry_outbox.enqueue('m1', 't', NULL, false, $1)")
        .bind(vec![0u8; 1_000_001])
        .execute(pool)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("over the limit of 1000000 bytes"), "{e}");
    for headers in ["[]", r#"{"n": 1}"#] {
        let e = sqlx::query("SELECT ferry_outbox.enqueue('m2', 't', NULL, false, 'x', $1::jsonb)")
            .bind(headers)
            .execute(pool)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("headers must be a JSON object"),
            "{headers}: {e}"
        );
    }
    assert_eq!(
        store.status().await.unwrap().pending,
        1,
        "a refused enqueue wrote"
    );
    // Enqueue before install says what to do.
    let fresh = TestDb::create().await;
    let s2 = Store::connect(&fresh.url).await.unwrap();
    let Db::Pg(p2) = s2.db() else { unreachable!() };
    let mut c = p2.acquire().await.unwrap();
    let e = ferry_outbox::enqueue(&mut *c, &Message::new("t", b"x".to_vec()))
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("ferry outbox install"), "{e}");
}

// Guards against an app that retries its transaction (or repeats an id in one batch)
// publishing a message twice: a message id already in the outbox is not enqueued again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_is_idempotent_by_message_id_on_both_stores() {
    use ferry_outbox::Enqueued;
    let db = TestDb::create().await;
    let dir = ferry_testkit::Scratch::new("outbox-idem");
    for store in [pg_store(&db).await, sqlite_store(&dir).await] {
        let m = Message::new("t", b"x".to_vec())
            .ordered_by("k")
            .with_id("same-id");
        let other = Message::new("t", b"y".to_vec()).ordered_by("k");
        let got = match store.db() {
            Db::Pg(p) => {
                let mut tx = p.begin().await.unwrap();
                let r =
                    ferry_outbox::enqueue_many(&mut *tx, &[m.clone(), m.clone(), other.clone()])
                        .await
                        .unwrap();
                let again = ferry_outbox::enqueue(&mut *tx, &m).await.unwrap();
                tx.commit().await.unwrap();
                (r, again)
            }
            Db::Sqlite(p) => {
                let mut tx = p.begin().await.unwrap();
                let r =
                    ferry_outbox::enqueue_many(&mut *tx, &[m.clone(), m.clone(), other.clone()])
                        .await
                        .unwrap();
                let again = ferry_outbox::enqueue(&mut *tx, &m).await.unwrap();
                tx.commit().await.unwrap();
                (r, again)
            }
        };
        assert!(matches!(got.0[0], Enqueued::New { .. }), "{got:?}");
        assert_eq!(got.0[1], Enqueued::AlreadyThere, "{got:?}");
        assert!(matches!(got.0[2], Enqueued::New { .. }), "{got:?}");
        assert_eq!(got.1, Enqueued::AlreadyThere);
        assert_eq!(store.status().await.unwrap().pending, 2);
        // And the key's order is the order given.
        let leased = store.lease("t", 10, Duration::from_secs(5)).await.unwrap();
        assert_eq!(leased.len(), 1, "only the head of the key is claimable");
        assert_eq!(leased[0].message_id, "same-id");
    }
}

// Guards against a slow transport costing duplicates or fences: every publish takes
// 300 ms with two in flight, so a batch of 16 takes 2.4 s against a 1 s lease; the lease
// must be extended while the batch publishes, and nothing is presented twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_transport_keeps_its_leases_extended_and_sends_nothing_twice() {
    let dir = ferry_testkit::Scratch::new("outbox-slow");
    let store = sqlite_store(&dir).await;
    let app = App::open(&store).await;
    let sink = RunningSink::start(None).await;
    sink.sink.set_faults(Faults {
        delay: Some(Duration::from_millis(300)),
        ..Faults::default()
    });
    let config = RelayConfig {
        batch: 16,
        window: 2,
        lease: Duration::from_secs(1),
        ..fast_config()
    };
    let options = TransportOptions {
        publish_timeout: Duration::from_millis(450),
        ..TransportOptions::default()
    };
    let (relay, running) = start_relay(&store, &sink.url, config, options).await;
    let ledger = write_workload(&app, 15, 8, 60).await;
    assert!(drained(&store, Duration::from_secs(60)).await);
    running.stop().await.unwrap();
    ledger.check(&sink.sink.received());
    let st = relay.status();
    assert_eq!(
        st.fenced, 0,
        "a lease ran out under a slow transport: {st:?}"
    );
    assert_eq!(
        sink.sink.duplicates(),
        0,
        "a message was presented twice: {st:?}"
    );
}

// Guards against a lost JetStream acknowledgement becoming a duplicate in the stream:
// a proxy holds the publish back past the relay's timeout, so the stream stores it but
// the relay hears nothing; the relay marks it uncertain and presents the same
// Nats-Msg-Id again, which the stream acknowledges as a duplicate. The stream holds it
// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_jetstream_acknowledgement_is_resolved_by_the_stream_s_dedup() {
    use std::sync::atomic::Ordering;
    let f = JetStreamOutbox::start("FERRYACK").await;
    let target: std::net::SocketAddr = nats_url().trim_start_matches("nats://").parse().unwrap();
    let proxy = ferry_testkit::proxy::FaultProxy::start(target);
    let options = TransportOptions {
        publish_timeout: Duration::from_millis(900),
        ..f.options()
    };
    let url = format!("nats://127.0.0.1:{}", proxy.port());
    let (relay, running) = start_relay(&f.store, &url, fast_config(), options).await;
    proxy.faults().delay_ms.store(2000, Ordering::SeqCst);
    let m = Message::new(f.topic.clone(), b"x".to_vec()).ordered_by("a");
    f.app.write(std::slice::from_ref(&m), true).await.unwrap();
    assert!(
        eventually(Duration::from_secs(10), || relay.status().uncertain > 0).await,
        "the held-back publish did not time out: {:?}",
        relay.status()
    );
    proxy.faults().delay_ms.store(0, Ordering::SeqCst);
    assert!(drained(&f.store, Duration::from_secs(30)).await);
    running.stop().await.unwrap();
    let st = relay.status();
    assert_eq!(st.reconciled, 1, "{st:?}");
    let mut stream = f.js.get_stream(&f.stream).await.unwrap();
    let info = stream.info().await.unwrap();
    assert_eq!(
        info.state.messages, 1,
        "the stream stored the message {} times",
        info.state.messages
    );
    f.finish().await;
}
