//! Faults users met from outside, each against real components: a network blip between
//! a relay and NATS, nats-server 2.9 without a configured stream, a topic no stream
//! covers, a database user without privileges, Postgres restarting, rows written around
//! the enqueue checks, and relay totals across restarts. Each test opens with the
//! failure it guards against; none asserts on time (limits below are deadlines for
//! "eventually", not measurements).

mod common;

use common::*;
use ferry_core::{Class, Classify};
use ferry_outbox::relay::RelayConfig;
use ferry_outbox::transport::{TransportOptions, nats::JetStream};
use ferry_outbox::{Db, Message, Store};
use std::sync::atomic::Ordering;
use std::time::Duration;

// Guards against a short network blip stopping a relay for up to 30 s and holding its
// messages away from healthy relays: every failed publish of one batch used to count as
// another failure in a row (opening the breaker to its cap, each failure replacing the
// pause), and the caught messages went back due only at the pause's end. Relay A
// publishes to JetStream through a fault proxy, relay B directly. With A mid-drain, the
// proxy cuts A's connection and refuses new ones. A's breaker opens once for the whole
// batch (later openings only after failed probes); every message A caught is back,
// claimable at once, no attempt spent; B delivers everything while A is still cut off;
// when the proxy lets A through again, A's probe closes its breaker and A delivers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_blip_opens_the_breaker_once_and_a_healthy_relay_takes_what_it_caught() {
    let f = JetStreamOutbox::start("FERRYBLIP").await;
    let store = &f.store;
    let target: std::net::SocketAddr = nats_url().trim_start_matches("nats://").parse().unwrap();
    let proxy = ferry_testkit::proxy::FaultProxy::start(target);
    let options = f.options();
    // max_attempts 2: an outage that spent attempts would park messages.
    let config = RelayConfig {
        batch: 256,
        window: 64,
        max_attempts: 2,
        poll: Duration::from_millis(200),
        ..RelayConfig::default()
    };
    let mut ledger = write_to(&f.app, &f.topic, 3000, 50, 100).await;
    let via_proxy = format!("nats://127.0.0.1:{}", proxy.port());
    let (a, running_a) = start_relay(store, &via_proxy, config.clone(), options.clone()).await;
    assert!(
        eventually(Duration::from_secs(30), || a.status().published >= 300).await,
        "A did not start publishing: {:?}",
        a.status()
    );
    // The blip: A's connection breaks at its next bytes; reconnections are refused.
    proxy.faults().refuse.store(true, Ordering::SeqCst);
    proxy.faults().cut_after.store(1, Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(30), || a.status().breaker_open).await,
        "A's breaker did not open: {:?}",
        a.status()
    );
    // A settles what it caught (its in-flight acknowledgements end with the connection).
    let Db::Pg(pool) = store.db() else {
        unreachable!()
    };
    let mut settled = false;
    for _ in 0..300 {
        let leased: i64 =
            sqlx::query_scalar("SELECT count(*) FROM ferry_outbox.messages WHERE state = 1")
                .fetch_one(pool)
                .await
                .unwrap();
        if leased == 0 {
            settled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(settled, "A never settled its caught batch");
    let (waiting, spent): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE next_attempt_at > now()), count(*) FILTER (WHERE attempts > 0) \
         FROM ferry_outbox.messages WHERE state = 0",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        waiting, 0,
        "messages caught by the outage must be claimable at once by other relays"
    );
    assert_eq!(spent, 0, "an outage spent attempts");
    let st = a.status();
    assert_eq!(
        st.breaker_openings,
        1 + st.breaker_probes_failed,
        "the outage opened the breaker once; only failed probes open it again: {st:?}"
    );
    assert!(
        st.unavailable + st.uncertain > 1,
        "A caught more than one message: {st:?}"
    );
    // B, whose path to NATS is fine, delivers everything while A is still cut off.
    let (b, running_b) = start_relay(store, &nats_url(), fast_config(), options.clone()).await;
    assert!(drained(store, Duration::from_secs(60)).await);
    assert!(b.status().published > 0);
    assert!(a.status().breaker_open, "A was never let through again");
    running_b.stop().await.unwrap();
    // The network comes back: A probes, closes its breaker and delivers alone.
    proxy.faults().refuse.store(false, Ordering::SeqCst);
    let more = write_to(&f.app, &f.topic, 20, 5, 4).await;
    ledger.committed.extend(more.committed);
    ledger.rolled_back.extend(more.rolled_back);
    assert!(drained(store, Duration::from_secs(60)).await);
    assert!(
        eventually(Duration::from_secs(10), || !a.status().breaker_open).await,
        "{:?}",
        a.status()
    );
    running_a.stop().await.unwrap();
    let st = a.status();
    assert_eq!(st.breaker_openings, 1 + st.breaker_probes_failed, "{st:?}");
    assert_eq!(st.parked + st.retried, 0, "{st:?}");
    ledger.check(&f.received().await);
    f.finish().await;
}

// Guards against a relay without a configured stream refusing to start on nats-server
// 2.9 ("does not answer JetStream requests … is it started with -js?" while JetStream
// was on): the start-up check read the account info with a reply type that requires
// fields 2.9 does not send. The check now reads only whether the reply is an error, and
// the relay starts and publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_without_a_stream_setting_starts_on_this_nats_server_and_publishes() {
    let t = JetStream::connect(&nats_url(), &TransportOptions::default())
        .await
        .unwrap_or_else(|e| panic!("a relay without a stream setting did not start: {e}"));
    drop(t);
    let f = JetStreamOutbox::start("FERRYNOSTREAM").await;
    let (_relay, running) = start_relay(
        &f.store,
        &nats_url(),
        fast_config(),
        TransportOptions::default(),
    )
    .await;
    let ledger = write_to(&f.app, &f.topic, 40, 4, 3).await;
    assert!(drained(&f.store, Duration::from_secs(30)).await);
    running.stop().await.unwrap();
    ledger.check(&f.received().await);
    f.finish().await;
}

// Guards against a topic no stream covers slowing every other topic: its publish got
// "no responders", was taken for an outage, never spent an attempt (so never parked) and
// reopened the relay-wide pause at every retry. Now, with JetStream answering, it is the
// message's own refusal: it spends attempts and is parked with an error naming the
// subject and what to do, the breaker never opens, and every other topic flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_no_stream_covers_is_parked_naming_the_subject_while_others_flow() {
    let f = JetStreamOutbox::start("FERRYUNCOVERED").await;
    let store = &f.store;
    let nowhere = format!("{}_NOT_COVERED.orders", f.stream);
    let config = RelayConfig {
        max_attempts: 2,
        ..fast_config()
    };
    let (relay, running) =
        start_relay(store, &nats_url(), config, TransportOptions::default()).await;
    let lost = Message::new(nowhere.clone(), b"lost".to_vec()).ordered_by("lost");
    f.app
        .write(std::slice::from_ref(&lost), true)
        .await
        .unwrap();
    let ledger = write_to(&f.app, &f.topic, 60, 6, 3).await;
    assert!(
        eventually(Duration::from_secs(30), || relay.status().parked == 1).await,
        "the uncovered message was not parked: {:?}",
        relay.status()
    );
    assert!(drained(store, Duration::from_secs(30)).await);
    let st = store.status().await.unwrap();
    assert_eq!(st.parked, 1, "{st:?}");
    let p = &st.parked_messages[0];
    assert_eq!(p.topic, nowhere);
    assert_eq!(p.attempts, 2, "{p:?}");
    let error = p.last_error.as_deref().unwrap();
    assert!(
        error.contains(&format!("takes subject {nowhere}")) && error.contains("create a stream"),
        "{error}"
    );
    running.stop().await.unwrap();
    let rs = relay.status();
    assert_eq!(
        rs.breaker_openings, 0,
        "a message's refusal opened the breaker: {rs:?}"
    );
    ledger.check(&f.received().await);
    f.finish().await;
}

// Guards against a relay retrying a permission error forever (it used to retry every
// database error): a relay whose database user may read the outbox but not update it
// stops with a permanent error naming the table and the privileges leasing needs, and
// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_user_lacks_a_privilege_stops_naming_the_table_and_privilege() {
    let db = TestDb::create().await;
    let store = pg_store(&db).await;
    let app = App::open(&store).await;
    let ledger = write_to(&app, "orders.created", 10, 2, 2).await;
    let role = unique("ferry_ro");
    let Db::Pg(pool) = store.db() else {
        unreachable!()
    };
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("GRANT USAGE ON SCHEMA ferry_outbox TO {role}"),
        format!("GRANT SELECT ON ALL TABLES IN SCHEMA ferry_outbox TO {role}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(pool)
            .await
            .unwrap();
    }
    let url = db.url.replacen("postgres@", &format!("{role}@"), 1);
    let limited = Store::connect(&url).await.unwrap();
    let sink = RunningSink::start(None).await;
    let (_relay, running) = start_relay(
        &limited,
        &sink.url,
        fast_config(),
        TransportOptions::default(),
    )
    .await;
    let e = running
        .join()
        .await
        .expect_err("the relay went on without UPDATE");
    let text = e.to_string();
    assert_eq!(e.class(), Class::Permanent, "{text}");
    assert!(
        text.contains("permission denied for table messages")
            && text.contains("UPDATE on ferry_outbox.messages")
            && !text.contains(" at line "),
        "{text}"
    );
    let st = store.status().await.unwrap();
    assert_eq!(st.pending as usize, ledger.committed.len(), "{st:?}");
    assert!(sink.sink.received().is_empty());
    limited.close().await;
    for sql in [format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(pool)
            .await
            .unwrap();
    }
}

// Guards the other side of the same rule, and what a person reads: a user that does not
// exist is a permanent error saying where, as whom, and what to check (not Postgres's
// source line); a server that is down is transient.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_as_a_missing_user_says_where_as_whom_and_what_to_check() {
    let url = format!("{}/postgres", pg_admin_url()).replacen("postgres@", "nobody@", 1);
    let e = Store::connect(&url).await.expect_err("nobody connected");
    let text = e.to_string();
    assert_eq!(e.class(), Class::Permanent, "{text}");
    assert!(
        text.starts_with(&format!("cannot connect to Postgres at {url} as nobody: "))
            && text.contains(r#"role "nobody" does not exist"#)
            && text.contains("check the user and password in the database URL")
            && !text.contains(" at line "),
        "{text}"
    );
    let port = ferry_testkit::free_port();
    let e = Store::connect(&format!("postgres://postgres@127.0.0.1:{port}/x"))
        .await
        .expect_err("nothing listens there");
    assert!(e.is_transient(), "{e}");
}

// Guards against a relay that gives up, or loses or repeats messages, when its Postgres
// restarts: the statements in flight fail as transient, the relay backs off and resumes
// by itself, and nothing is lost or stored twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_resumes_by_itself_when_its_postgres_restarts() {
    let scratch = ferry_testkit::Scratch::new("outbox-pg-restart");
    let pg = ferry_testkit::servers::PrivatePg::start(scratch.path());
    let store = Store::connect(&pg.url("postgres")).await.unwrap();
    store.install().await.unwrap();
    let app = App::open(&store).await;
    let sink = RunningSink::start(None).await;
    let (relay, running) = start_relay(
        &store,
        &sink.url,
        fast_config(),
        TransportOptions::default(),
    )
    .await;
    let mut ledger = write_workload(&app, 40, 4, 90).await;
    assert!(drained(&store, Duration::from_secs(30)).await);
    pg.down("fast");
    assert!(
        eventually(Duration::from_secs(30), || relay.status().db_errors > 0).await,
        "the relay never noticed the database was gone"
    );
    pg.up();
    let mut more = None;
    for _ in 0..50 {
        if let Ok(l) =
            tokio::time::timeout(Duration::from_secs(5), write_workload(&app, 40, 4, 91)).await
        {
            more = Some(l);
            break;
        }
    }
    let more = more.expect("the app could not write after the restart");
    ledger.committed.extend(more.committed);
    ledger.rolled_back.extend(more.rolled_back);
    assert!(drained(&store, Duration::from_secs(60)).await);
    assert!(
        !running.is_finished(),
        "a transient error stopped the relay"
    );
    running.stop().await.unwrap();
    ledger.check(&sink.sink.received());
}

// Guards against one row written around the enqueue checks (headers that are not a
// JSON object) stopping every relay: the row is parked without being published, its
// error saying what is wrong, and everything else flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_with_unreadable_headers_is_parked_without_publishing() {
    let dir = ferry_testkit::Scratch::new("outbox-bad-headers");
    let store = sqlite_store(&dir).await;
    let app = App::open(&store).await;
    let Db::Sqlite(pool) = store.db() else {
        unreachable!()
    };
    sqlx::query(
        "INSERT INTO ferry_outbox_messages (message_id, topic, payload, headers, next_attempt_at, enqueued_at) \
         VALUES ('bad-headers', 'orders.created', x'00', '[1, 2]', 0, 0)",
    )
    .execute(pool)
    .await
    .unwrap();
    let sink = RunningSink::start(None).await;
    let (relay, running) = start_relay(
        &store,
        &sink.url,
        fast_config(),
        TransportOptions::default(),
    )
    .await;
    let ledger = write_workload(&app, 30, 3, 92).await;
    assert!(drained(&store, Duration::from_secs(30)).await);
    running.stop().await.unwrap();
    let st = store.status().await.unwrap();
    assert_eq!(st.parked, 1, "{st:?}");
    let error = st.parked_messages[0].last_error.as_deref().unwrap();
    assert!(
        error.contains("parked without publishing") && error.contains("not a JSON object"),
        "{error}"
    );
    assert_eq!(relay.status().parked, 1);
    ledger.check(&sink.sink.received());
}

// Guards against relay totals that vanish with the relay (they lived only in each
// process's /status): duplicates and publishes are recorded per relay, survive the
// relay stopping, and a relay restarted under the same name folds its old row into
// "(retired)" instead of overwriting it. On both stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_totals_survive_restarts_and_count_duplicates() {
    // Postgres to JetStream, where a repeated message id is acknowledged as duplicate.
    let f = JetStreamOutbox::start("FERRYTOTALS").await;
    let (store, app, topic) = (&f.store, &f.app, &f.topic);
    let options = f.options();
    let mut owners = Vec::new();
    for round in 0..2 {
        // The stream already holds this id: the relay's publish is a duplicate.
        let id = unique("dup");
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", id.as_str());
        f.js.publish_with_headers(topic.clone(), h, "x".into())
            .await
            .unwrap()
            .await
            .unwrap();
        let msgs = vec![
            Message::new(topic.clone(), b"x".to_vec()).with_id(id),
            Message::new(topic.clone(), b"y".to_vec()),
        ];
        app.write(&msgs, true).await.unwrap();
        let config = RelayConfig {
            owner: format!("relay-{round}"),
            ..fast_config()
        };
        let (relay, running) = start_relay(store, &nats_url(), config, options.clone()).await;
        assert!(drained(store, Duration::from_secs(30)).await);
        running.stop().await.unwrap();
        owners.push(relay.status().owner);
    }
    let st = store.status().await.unwrap();
    assert_eq!(st.relay_totals.duplicates, 2, "{st:?}");
    assert_eq!(st.relay_totals.published, 4, "{st:?}");
    assert_eq!(st.relays.len(), 2, "{st:?}");
    assert!(st.relays.iter().all(|r| r.stopped), "{st:?}");
    // relay-0 again: its earlier row is retired, its totals kept.
    let config = RelayConfig {
        owner: owners[0].clone(),
        ..fast_config()
    };
    let (_relay, running) = start_relay(store, &nats_url(), config, options).await;
    app.write(&[Message::new(topic.clone(), b"z".to_vec())], true)
        .await
        .unwrap();
    assert!(drained(store, Duration::from_secs(30)).await);
    running.stop().await.unwrap();
    let st = store.status().await.unwrap();
    assert_eq!(st.relay_totals.duplicates, 2, "{st:?}");
    assert_eq!(st.relay_totals.published, 5, "{st:?}");
    let mut names: Vec<&str> = st.relays.iter().map(|r| r.owner.as_str()).collect();
    names.sort();
    assert_eq!(names, ["(retired)", "relay-0", "relay-1"], "{st:?}");
    f.finish().await;

    // SQLite to a webhook: the same through SQLite's statements.
    let dir = ferry_testkit::Scratch::new("outbox-totals");
    let store = sqlite_store(&dir).await;
    let app = App::open(&store).await;
    let sink = RunningSink::start(None).await;
    for _ in 0..2 {
        let config = RelayConfig {
            owner: "embedded".into(),
            ..fast_config()
        };
        let (_relay, running) =
            start_relay(&store, &sink.url, config, TransportOptions::default()).await;
        app.write(&[Message::new("orders.created", b"x".to_vec())], true)
            .await
            .unwrap();
        assert!(drained(&store, Duration::from_secs(30)).await);
        running.stop().await.unwrap();
    }
    let st = store.status().await.unwrap();
    assert_eq!(st.relay_totals.published, 2, "{st:?}");
    let mut names: Vec<&str> = st.relays.iter().map(|r| r.owner.as_str()).collect();
    names.sort();
    assert_eq!(names, ["(retired)", "embedded"], "{st:?}");
}
