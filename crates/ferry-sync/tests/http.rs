//! The built-in transport's refusals over real HTTP (docs/sync-protocol.md §2.1): a real `serve`
//! router on a loopback port, a real Postgres, requests as a replica's client or a
//! stranger would send them.
//!
//! Guards against a serve that hands one replica's messages to a caller without its
//! token, stores a report from one, stores a report over the limit or one that does not
//! decode, or answers any of these with a body that does not say what was refused and
//! what to do.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::Shop;
use ferry_sync::relay::RelayStats;
use ferry_sync::serve::{REPORT_BYTES_MAX, Serve};
use ferry_sync::{enroll, wire};
use uuid::Uuid;

/// A serve process's routes on a loopback port, on a pool of their own (its listener
/// holds a connection for good, which would keep the test's pool from closing); they stop
/// with the test.
async fn start_serve(db_url: &str) -> String {
    let pool = sqlx::PgPool::connect(db_url).await.unwrap();
    let serve = Serve::new(pool, Arc::new(RelayStats::default()))
        .await
        .expect("listening for outbox notifications");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, serve.router()).await });
    url
}

/// One answer: status, body as text.
struct Answer {
    status: u16,
    body: String,
    www_authenticate: Option<String>,
}

impl Answer {
    /// The `error` of a JSON refusal.
    fn error(&self) -> String {
        let v: serde_json::Value = serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("a refusal is JSON ({e}): {}", self.body));
        v["error"].as_str().expect("an error field").to_string()
    }
}

/// A request as the replica's client sends it (ureq, on a blocking thread).
async fn call(method: &'static str, url: String, token: Option<String>, body: Vec<u8>) -> Answer {
    tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .new_agent();
        let auth = token.map(|t| format!("Bearer {t}"));
        let mut resp = match method {
            "GET" => {
                let mut req = agent.get(&url);
                if let Some(a) = &auth {
                    req = req.header("authorization", a);
                }
                req.call()
            }
            _ => {
                let mut req = agent
                    .post(&url)
                    .header("content-type", "application/x-ferry-sync-report");
                if let Some(a) = &auth {
                    req = req.header("authorization", a);
                }
                req.send(&body[..])
            }
        }
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"));
        Answer {
            status: resp.status().as_u16(),
            www_authenticate: resp
                .headers()
                .get("www-authenticate")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            body: resp.body_mut().read_to_string().unwrap_or_default(),
        }
    })
    .await
    .unwrap()
}

/// Replica `id`'s stored report and when it came, if any.
async fn stored(shop: &Shop, id: Uuid) -> Option<(Vec<u8>, String)> {
    sqlx::query_as("SELECT up, received_at::text FROM ferry_sync.reports WHERE replica = $1")
        .bind(id)
        .fetch_optional(&shop.db.pool)
        .await
        .unwrap()
}

/// Enrolls store `id` again under a token the test knows (`Shop` keeps only seal keys).
async fn token_for(shop: &Shop, id: Uuid) -> String {
    let token = enroll::new_token();
    let mut conn = shop.db.pool.acquire().await.unwrap();
    enroll::enroll(&mut conn, id, &token).await.unwrap();
    token
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_strangers_and_bad_reports_and_says_what_to_do() {
    let mut shop = Shop::new("http").await;
    let north = shop.store("north").await;
    let south = shop.store("south").await;
    let north_token = token_for(&shop, north).await;
    let south_token = token_for(&shop, south).await;
    shop.db
        .exec("INSERT INTO products VALUES (1, 'nut', 1, 'north'), (2, 'bolt', 2, 'south')")
        .await;
    shop.passes().await;
    let url = start_serve(&shop.db.url).await;
    let messages = |id: Uuid| format!("{url}/v1/replicas/{id}/messages?after=0&max=16");
    let reports = |id: Uuid| format!("{url}/v1/replicas/{id}/reports");

    // Its own token: north's messages are served.
    let own = call("GET", messages(north), Some(north_token.clone()), vec![]).await;
    assert_eq!(own.status, 200, "{}", own.body);

    // No token, a wrong one, and south's token for north's messages: 401, with the way
    // out, and no frame.
    let none = call("GET", messages(north), None, vec![]).await;
    assert_eq!(none.status, 401);
    assert_eq!(none.www_authenticate.as_deref(), Some("Bearer"));
    assert!(none.error().contains("no bearer token"), "{}", none.body);
    assert!(
        none.error()
            .contains(&format!("ferry sync enroll --replica {north}")),
        "{}",
        none.body
    );
    for token in [enroll::new_token(), south_token.clone()] {
        let refused = call("GET", messages(north), Some(token), vec![]).await;
        assert_eq!(refused.status, 401, "{}", refused.body);
        assert!(
            refused.error().contains("wrong bearer token")
                && refused.error().contains("nothing was served or stored")
                && refused
                    .error()
                    .contains(&format!("ferry sync enroll --replica {north}")),
            "{}",
            refused.body
        );
    }
    // An id nobody enrolled reads as a wrong token: which replicas exist is not told.
    let stranger = call(
        "GET",
        messages(Uuid::new_v4()),
        Some(north_token.clone()),
        vec![],
    )
    .await;
    assert_eq!(stranger.status, 401);
    assert!(
        stranger.error().contains("wrong bearer token"),
        "{}",
        stranger.body
    );

    // A good report is stored; it is what every refusal below must leave in place.
    let up = wire::encode_up(&shop.replicas[&north].up().unwrap());
    let ok = call(
        "POST",
        reports(north),
        Some(north_token.clone()),
        up.clone(),
    )
    .await;
    assert_eq!(ok.status, 204, "{}", ok.body);
    let before = stored(&shop, north)
        .await
        .expect("the good report is stored");
    assert_eq!(before.0, up);

    // Reports with no token, a wrong one, or south's token for north: 401, nothing
    // stored (north's report unchanged, south has none).
    let forged = wire::encode_up(&wire::Up {
        applied: None,
        gap: 99,
        rejections: vec![],
        digests: vec![],
    });
    for token in [None, Some(enroll::new_token()), Some(south_token.clone())] {
        let refused = call("POST", reports(north), token, forged.clone()).await;
        assert_eq!(refused.status, 401, "{}", refused.body);
        assert!(refused.error().contains("bearer token"), "{}", refused.body);
    }
    assert_eq!(stored(&shop, north).await.as_ref(), Some(&before));
    assert_eq!(stored(&shop, south).await, None);

    // Over the limit: 413 with the limit and what to check; nothing stored. Without a
    // token the same body is a 401: the token is checked first.
    let huge = vec![0u8; REPORT_BYTES_MAX + 1];
    let too_large = call(
        "POST",
        reports(north),
        Some(north_token.clone()),
        huge.clone(),
    )
    .await;
    assert_eq!(too_large.status, 413, "{}", too_large.body);
    assert!(
        too_large
            .error()
            .contains(&format!("over {REPORT_BYTES_MAX} bytes"))
            && too_large.error().contains("nothing was stored")
            && too_large.error().contains("same ferry"),
        "{}",
        too_large.body
    );
    let anonymous = call("POST", reports(north), None, huge).await;
    assert_eq!(anonymous.status, 401, "{}", anonymous.body);
    assert_eq!(stored(&shop, north).await.as_ref(), Some(&before));

    // Not a report: 400 naming the broken rule, with what to check; nothing stored.
    let mut truncated = up.clone();
    truncated.truncate(up.len() - 1);
    for body in [b"not a report".to_vec(), truncated, vec![]] {
        let malformed = call("POST", reports(north), Some(north_token.clone()), body).await;
        assert_eq!(malformed.status, 400, "{}", malformed.body);
        let error = malformed.error();
        assert!(
            error.starts_with("the report was not stored: ")
                && error.contains('[')
                && error.contains("same ferry"),
            "{error}"
        );
    }
    assert_eq!(stored(&shop, north).await.as_ref(), Some(&before));
    shop.finish().await;
}

/// Guards: a serve that stops (SIGTERM in `ferry sync serve`) answers its open long polls
/// at once, empty, instead of holding the shutdown for up to their 30 s wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_serve_ends_its_long_polls_at_once() {
    let mut shop = Shop::new("http_stop").await;
    let north = shop.store("north").await;
    shop.settle().await;
    // A token the test knows, enrolled after north is provisioned: no message is sealed
    // under the new key, and none is needed.
    let token = token_for(&shop, north).await;
    let at = shop.replicas[&north].status().unwrap();
    let epoch = at.epoch.expect("north is provisioned");
    let pool = sqlx::PgPool::connect(&shop.db.url).await.unwrap();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let serve = Serve::new(pool, Arc::new(RelayStats::default()))
        .await
        .unwrap()
        .stop_on(stop_rx);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, serve.router()).await });
    // From where north stands, with nothing new: the poll waits.
    let poll = tokio::spawn(call(
        "GET",
        format!(
            "{url}/v1/replicas/{north}/messages?after={}&epoch={}&max=16&wait_ms=30000",
            at.seq,
            Uuid::parse_str(&epoch).unwrap()
        ),
        Some(token),
        vec![],
    ));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!poll.is_finished(), "the long poll waits while serve runs");
    let asked = std::time::Instant::now();
    stop_tx.send(true).unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), poll)
        .await
        .expect("the long poll ends within 5 s of the stop, not its 30 s wait")
        .unwrap();
    assert_eq!(answer.status, 204, "{}", answer.body);
    assert!(asked.elapsed() < Duration::from_secs(2));
}

/// docs/sync-up.md §4.4: an upload without the store's own token, over the limit, that
/// does not decode, or naming a table nobody files is refused, says what to do, and files
/// nothing; a good one is answered with a `Filed` only that store can open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_are_filed_only_for_their_own_store_and_refusals_file_nothing() {
    use common::up::{RECORDS_RULES, RECORDS_SCHEMA};
    let mut shop = Shop::new_with(
        "http_up",
        &format!("{}{RECORDS_SCHEMA}", common::SHOP_SCHEMA),
        &format!("{}{RECORDS_RULES}", common::SHOP_RULES),
    )
    .await;
    let north = shop.store("north").await;
    let south = shop.store("south").await;
    let north_token = token_for(&shop, north).await;
    let south_token = token_for(&shop, south).await;
    let pool = sqlx::PgPool::connect(&shop.db.url).await.unwrap();
    let serve = Serve::new(pool, Arc::new(RelayStats::default()))
        .await
        .unwrap()
        .file_into(shop.spec.records.clone(), Default::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, serve.router()).await });
    let uploads = |id: Uuid| format!("{url}/v1/replicas/{id}/uploads");
    let sale = Uuid::new_v4();
    let part = |table: &str| wire::TablePart {
        table: table.into(),
        columns: shop
            .spec
            .records
            .iter()
            .find(|r| r.name == "sales")
            .unwrap()
            .wire_columns(),
        sweep: wire::Sweep::default(),
        deletes: vec![],
        upserts: vec![vec![
            ferry_sync::value::Value::Text(sale.to_string()),
            ferry_sync::value::Value::Null,
            ferry_sync::value::Value::Int(5),
            ferry_sync::value::Value::Null,
        ]],
        writes: None,
    };
    let upload = |table: &str| {
        wire::encode_upload(&wire::Upload {
            restated: false,
            id: 7,
            filed_n: 0,
            lane: "sales".into(),
            parts: vec![part(table)],
        })
        .unwrap()
    };
    let filed = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM sales")
            .fetch_one(&shop.db.pool)
            .await
            .unwrap()
    };
    for token in [None, Some(enroll::new_token()), Some(south_token.clone())] {
        let refused = call("POST", uploads(north), token, upload("sales")).await;
        assert_eq!(refused.status, 401, "{}", refused.body);
    }
    let huge = call(
        "POST",
        uploads(north),
        Some(north_token.clone()),
        vec![0; wire::UPLOAD_BYTES_MAX + 1],
    )
    .await;
    assert_eq!(huge.status, 413, "{}", huge.body);
    assert!(huge.error().contains("nothing was filed"), "{}", huge.body);
    let garbage = call(
        "POST",
        uploads(north),
        Some(north_token.clone()),
        b"FSW1 no".to_vec(),
    )
    .await;
    assert_eq!(garbage.status, 400, "{}", garbage.body);
    assert!(garbage.error().contains("same ferry"), "{}", garbage.body);
    let unknown = call(
        "POST",
        uploads(north),
        Some(north_token.clone()),
        upload("products"),
    )
    .await;
    assert_eq!(unknown.status, 400, "{}", unknown.body);
    assert!(unknown.error().contains("same rules"), "{}", unknown.body);
    assert_eq!(filed().await, 0, "no refusal filed anything");

    let ok = tokio::task::spawn_blocking({
        let (url, token, body) = (uploads(north), north_token.clone(), upload("sales"));
        move || {
            let agent = ureq::Agent::config_builder()
                .http_status_as_error(false)
                .build()
                .new_agent();
            let mut resp = agent
                .post(&url)
                .header("authorization", &format!("Bearer {token}"))
                .send(&body[..])
                .unwrap();
            (
                resp.status().as_u16(),
                resp.body_mut().read_to_vec().unwrap(),
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(ok.0, 200);
    let north_key = wire::seal_key(north_token.as_bytes());
    let answer =
        wire::open_filed(&ok.1, &north_key, north.as_bytes()).expect("north opens its Filed");
    assert_eq!((answer.id, answer.filed_n, answer.refile_after), (7, 1, 0));
    assert!(
        wire::open_filed(
            &ok.1,
            &wire::seal_key(south_token.as_bytes()),
            south.as_bytes()
        )
        .is_err(),
        "south cannot take north's Filed for its own"
    );
    let store: String = sqlx::query_scalar("SELECT store_id::text FROM sales")
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert_eq!(
        store,
        north.to_string(),
        "filed under the store the token named"
    );
    shop.finish().await;
}

/// A token serve has checked is taken for `CHECKED_FOR` without asking the database
/// again; a new token from `ferry sync enroll` works at once, and the one it replaced
/// stops working within `CHECKED_FOR`. A wrong token is never remembered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_token_stops_working_within_the_check_window_and_the_new_one_works_at_once() {
    let mut shop = Shop::new("http_tokens").await;
    let north = shop.store("north").await;
    let old = token_for(&shop, north).await;
    shop.passes().await;
    let url = start_serve(&shop.db.url).await;
    let messages = format!("{url}/v1/replicas/{north}/messages?after=0&max=16&wait_ms=0");
    assert_eq!(
        call("GET", messages.clone(), Some(old.clone()), vec![])
            .await
            .status,
        200
    );
    let wrong = call("GET", messages.clone(), Some(enroll::new_token()), vec![]).await;
    assert_eq!(wrong.status, 401, "{}", wrong.body);

    let new = token_for(&shop, north).await;
    assert_eq!(
        call("GET", messages.clone(), Some(new.clone()), vec![])
            .await
            .status,
        200
    );
    tokio::time::sleep(ferry_sync::serve::CHECKED_FOR + Duration::from_millis(200)).await;
    let stale = call("GET", messages.clone(), Some(old), vec![]).await;
    assert_eq!(stale.status, 401, "the replaced token: {}", stale.body);
    assert_eq!(call("GET", messages, Some(new), vec![]).await.status, 200);
    shop.finish().await;
}
