//! `ferry sync replica --metrics-listen`: the running replica's own /metrics and /status,
//! with real processes (a `ferry sync serve`, a `ferry sync replica`) over a real
//! Postgres.
//!
//! Guards against a replica whose standing nobody can read: its file alone cannot tell
//! `synced` from `offline` (`ferry sync replica status` says to ask the running replica),
//! so the running replica must say it, and say `offline` once its server is gone.

#[path = "../../ferry-sync/tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::time::Duration;

use common::{SHOP_RULES, SHOP_SCHEMA, TestDb};
use ferry_sync::enroll;
use ferry_sync::rules::Rules;
use ferry_testkit::proc::Proc;
use ferry_testkit::{Scratch, free_port, wait_until};
use uuid::Uuid;

fn ferry() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_ferry"))
}

/// GET `path` on 127.0.0.1:`port`; `None` until something answers 200.
fn get(port: u16, path: &str) -> Option<String> {
    let agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(5)))
        .http_status_as_error(true)
        .build()
        .new_agent();
    agent
        .get(&format!("http://127.0.0.1:{port}{path}"))
        .call()
        .ok()?
        .body_mut()
        .read_to_string()
        .ok()
}

fn status(port: u16) -> Option<serde_json::Value> {
    serde_json::from_str(&get(port, "/status")?).ok()
}

/// The value of an unlabelled sample, or of `name{labels}`.
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_running_replica_serves_its_metrics_and_standing() {
    let scratch = Scratch::new("sync-replica-metrics");
    let db = TestDb::new("replica_metrics").await;
    db.exec(SHOP_SCHEMA).await;
    let rules_file = scratch.path().join("rules.toml");
    std::fs::write(&rules_file, SHOP_RULES).unwrap();
    let rules = Rules::parse(SHOP_RULES, &rules_file).unwrap();
    ferry_sync::schema::install(&db.pool, &rules).await.unwrap();
    let store = Uuid::new_v4();
    db.exec(&format!(
        "INSERT INTO stores (id, region) VALUES ('{store}', 'north');
         INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 20) g;"
    ))
    .await;
    let token = enroll::new_token();
    let mut conn = db.pool.acquire().await.unwrap();
    enroll::enroll(&mut conn, store, &token).await.unwrap();
    drop(conn);
    let token_file = scratch.path().join("token");
    std::fs::write(&token_file, &token).unwrap();

    let (serve_port, metrics_port) = (free_port(), free_port());
    let server = format!("http://127.0.0.1:{serve_port}");
    let serve = Proc::spawn(
        "serve",
        ferry(),
        &[
            "sync",
            "serve",
            "--rules",
            rules_file.to_str().unwrap(),
            "--db",
            &db.url,
            "--listen",
            &format!("127.0.0.1:{serve_port}"),
            "--idle-ms",
            "50",
        ],
        &[("FERRY_LOG", "info")],
        &scratch.path().join("serve.log"),
    );
    // The address comes from the environment, as every flag of `ferry sync` can.
    let metrics_listen = format!("127.0.0.1:{metrics_port}");
    let replica_db = scratch.path().join("store.db");
    let replica = Proc::spawn(
        "replica",
        ferry(),
        &[
            "sync",
            "replica",
            "--server",
            &server,
            "--db",
            replica_db.to_str().unwrap(),
            "--id",
            &store.to_string(),
            "--token-file",
            token_file.to_str().unwrap(),
            "--wait-ms",
            "200",
            "--keepalive-ms",
            "1000",
            "--offline-after-ms",
            "1000",
        ],
        &[
            ("FERRY_LOG", "info"),
            ("FERRY_SYNC_METRICS_LISTEN", &metrics_listen),
        ],
        &scratch.path().join("replica.log"),
    );
    let logs = || {
        format!(
            "serve:\n{}\nreplica:\n{}",
            serve.log_text(),
            replica.log_text()
        )
    };

    // Synced, with the products, in its own words.
    let synced = |s: &serde_json::Value| {
        s["standing"] == "synced"
            && s["tables"]
                .as_array()
                .is_some_and(|t| t.iter().any(|t| t["name"] == "products" && t["rows"] == 20))
    };
    assert!(
        wait_until(Duration::from_secs(60), || status(metrics_port)
            .is_some_and(|s| synced(&s))),
        "the replica never said synced: {:?}\n{}",
        status(metrics_port),
        logs()
    );
    let metrics = get(metrics_port, "/metrics").unwrap();
    let st = status(metrics_port).unwrap();
    let seq = st["seq"].as_u64().unwrap();
    assert!(seq >= 1, "{st}");
    assert!(
        st["heard_at_ms"].is_u64() && st["heard_ago_ms"].is_u64(),
        "{st}"
    );
    assert_eq!(st["offline_after_ms"], 1000, "{st}");
    assert!(st["totals"]["applied"].as_u64().unwrap() >= 1, "{st}");
    assert!(st["totals"]["bytes"].as_u64().unwrap() > 0, "{st}");
    assert_eq!(
        sample(&metrics, "ferry_sync_replica_standing{standing=\"synced\"}"),
        Some(1.0),
        "{metrics}"
    );
    for other in ["not_provisioned", "awaiting_fix", "catching_up", "offline"] {
        let name = format!("ferry_sync_replica_standing{{standing=\"{other}\"}}");
        assert_eq!(sample(&metrics, &name), Some(0.0), "{metrics}");
    }
    assert_eq!(
        sample(&metrics, "ferry_sync_replica_applied_seq"),
        Some(seq as f64),
        "{metrics}"
    );
    assert!(sample(&metrics, "ferry_sync_replica_messages_applied_total").unwrap() >= 1.0);
    assert!(sample(&metrics, "ferry_sync_replica_bytes_received_total").unwrap() > 0.0);
    assert_eq!(sample(&metrics, "ferry_sync_replica_gaps_total"), Some(0.0));
    assert_eq!(
        sample(&metrics, "ferry_sync_replica_refused_total"),
        Some(0.0)
    );
    assert_eq!(sample(&metrics, "ferry_sync_replica_rejections"), Some(0.0));
    assert!(sample(&metrics, "ferry_sync_replica_heard_ago_seconds").is_some());

    // The server's side (`ferry sync status`, JSON and text): the store confirmed every
    // product of its region, by its mark, once the relay handled its report.
    let server_status = || {
        let (code, out, err) =
            ferry_testkit::proc::run(ferry(), &["sync", "status", "--db", &db.url, "--json"], &[]);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let products = |s: &serde_json::Value| {
        s["replicas"][0]["tables"]
            .as_array()?
            .iter()
            .find(|t| t["table"] == "public.products")
            .cloned()
    };
    assert!(
        wait_until(Duration::from_secs(60), || products(&server_status())
            .is_some_and(|p| p["confirmed"] == 20 && p["covered"] == true)),
        "the server never counted the products confirmed: {}",
        server_status()
    );
    let p = products(&server_status()).unwrap();
    assert_eq!(
        (&p["kind"], &p["rows"], &p["pending"], &p["quarantined"]),
        (
            &serde_json::json!("broadcast"),
            &serde_json::json!(20),
            &serde_json::json!(0),
            &serde_json::json!(0)
        ),
        "{p}"
    );
    let (code, text, err) =
        ferry_testkit::proc::run(ferry(), &["sync", "status", "--db", &db.url], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        text.contains("mark covers latest") && text.contains("public.products"),
        "{text}"
    );
    let line = text
        .lines()
        .find(|l| l.contains("public.products"))
        .unwrap();
    assert!(
        line.contains("broadcast") && line.contains("20/20") && line.contains("yes"),
        "{text}"
    );

    // The server gone, the replica says offline once --offline-after-ms passed.
    serve.kill9();
    assert!(
        wait_until(Duration::from_secs(60), || status(metrics_port)
            .is_some_and(|s| s["standing"] == "offline")),
        "the replica never said offline: {:?}\nreplica:\n{}",
        status(metrics_port),
        replica.log_text()
    );
    let metrics = get(metrics_port, "/metrics").unwrap();
    assert_eq!(
        sample(
            &metrics,
            "ferry_sync_replica_standing{standing=\"offline\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    assert!(sample(&metrics, "ferry_sync_replica_failures_total").unwrap() >= 1.0);
    assert_eq!(
        replica.term(Duration::from_secs(30)),
        Some(0),
        "the replica stops cleanly on SIGTERM"
    );
    db.drop_db().await;
}

/// The flags and their variables are in `--help`.
#[test]
fn replica_help_names_the_metrics_address_and_its_variable() {
    let (code, out, err) = ferry_testkit::proc::run(ferry(), &["sync", "replica", "--help"], &[]);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "--metrics-listen",
        "FERRY_SYNC_METRICS_LISTEN",
        "/metrics",
        "--offline-after-ms",
        "--wait-ms",
    ] {
        assert!(out.contains(needle), "{needle} missing from:\n{out}");
    }
}

/// The way up through real processes (docs/sync-up.md): the store's app writes a sale into
/// the replica's file while `ferry sync replica` runs; the uploader beside its loop sends
/// it, and the `ferry sync serve` answering files it into Postgres under the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sale_written_on_the_store_is_filed_on_the_server() {
    a_sale_filed(false).await;
}

/// As above, with NATS JetStream between them (docs/sync-nats.md): `ferry sync serve
/// --nats` bridges, `ferry sync replica --server nats://…` follows its durable consumer
/// and uploads through the up stream; serve's /metrics counts what its bridge carried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sale_written_on_the_store_is_filed_on_the_server_over_nats() {
    a_sale_filed(true).await;
}

async fn a_sale_filed(over_nats: bool) {
    use common::up::{RECORDS_RULES, RECORDS_SCHEMA};
    let scratch = Scratch::new("sync-replica-records");
    let nats = over_nats.then(|| ferry_testkit::servers::PrivateNats::start(scratch.path()));
    let db = TestDb::new("replica_records").await;
    db.exec(&format!("{SHOP_SCHEMA}{RECORDS_SCHEMA}")).await;
    let rules_text = format!("{SHOP_RULES}{RECORDS_RULES}");
    let rules_file = scratch.path().join("rules.toml");
    std::fs::write(&rules_file, &rules_text).unwrap();
    let rules = Rules::parse(&rules_text, &rules_file).unwrap();
    ferry_sync::schema::install(&db.pool, &rules).await.unwrap();
    let store = Uuid::new_v4();
    db.exec(&format!(
        "INSERT INTO stores (id, region) VALUES ('{store}', 'north')"
    ))
    .await;
    let token = enroll::new_token();
    let mut conn = db.pool.acquire().await.unwrap();
    enroll::enroll(&mut conn, store, &token).await.unwrap();
    drop(conn);
    let token_file = scratch.path().join("token");
    std::fs::write(&token_file, &token).unwrap();
    let serve_port = free_port();
    let listen = format!("127.0.0.1:{serve_port}");
    let mut serve_args = vec![
        "sync",
        "serve",
        "--rules",
        rules_file.to_str().unwrap(),
        "--db",
        &db.url,
        "--listen",
        &listen,
    ];
    let nats_url = nats.as_ref().map(|n| n.url());
    if let Some(url) = &nats_url {
        serve_args.extend(["--nats", url]);
    }
    let serve = Proc::spawn(
        "serve",
        ferry(),
        &serve_args,
        &[("FERRY_LOG", "info")],
        &scratch.path().join("serve.log"),
    );
    let server = nats_url
        .clone()
        .unwrap_or_else(|| format!("http://127.0.0.1:{serve_port}"));
    let replica_db = scratch.path().join("store.db");
    let replica = Proc::spawn(
        "replica",
        ferry(),
        &[
            "sync",
            "replica",
            "--server",
            &server,
            "--db",
            replica_db.to_str().unwrap(),
            "--id",
            &store.to_string(),
            "--token-file",
            token_file.to_str().unwrap(),
        ],
        &[("FERRY_LOG", "info")],
        &scratch.path().join("replica.log"),
    );
    let logs = || {
        format!(
            "serve:\n{}\nreplica:\n{}",
            serve.log_text(),
            replica.log_text()
        )
    };
    // The snapshot creates `sales` on the store.
    let has_sales = || {
        rusqlite::Connection::open(&replica_db)
            .and_then(|c| {
                c.query_row(
                    "SELECT count(*) FROM sqlite_schema WHERE name = 'sales'",
                    [],
                    |r| r.get::<_, i64>(0),
                )
            })
            .is_ok_and(|n| n == 1)
    };
    assert!(
        wait_until(Duration::from_secs(60), has_sales),
        "the store never got its sales table\n{}",
        logs()
    );
    let sale = Uuid::new_v4();
    let app = rusqlite::Connection::open(&replica_db).unwrap();
    app.busy_timeout(Duration::from_secs(5)).unwrap();
    app.execute(
        "INSERT INTO sales (id, store_id, amount, note) VALUES (?1, ?2, 1250, 'till 3')",
        rusqlite::params![sale.to_string(), store.to_string()],
    )
    .unwrap();
    let filed = || async {
        sqlx::query_as::<_, (String, i64, String)>(
            "SELECT store_id::text, amount, note FROM sales WHERE id = $1",
        )
        .bind(sale)
        .fetch_optional(&db.pool)
        .await
        .unwrap()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while filed().await.is_none() {
        assert!(
            std::time::Instant::now() < deadline,
            "the sale was never filed\n{}",
            logs()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        filed().await,
        Some((store.to_string(), 1250, "till 3".to_string()))
    );
    // Once the Filed came back, the store says nothing is left to file.
    let unfiled = || {
        let (code, out, _) = ferry_testkit::proc::run(
            ferry(),
            &[
                "sync",
                "replica",
                "status",
                "--db",
                replica_db.to_str().unwrap(),
                "--json",
            ],
            &[],
        );
        (code == 0)
            .then(|| serde_json::from_str::<serde_json::Value>(&out).ok())
            .flatten()
            .and_then(|s| s["unfiled"].as_u64())
    };
    assert!(
        wait_until(Duration::from_secs(60), || unfiled() == Some(0)),
        "the store still has rows to file: {:?}\n{}",
        unfiled(),
        logs()
    );
    if over_nats {
        let metrics = get(serve_port, "/metrics").unwrap_or_default();
        for name in [
            "ferry_sync_nats_frames_total",
            "ferry_sync_nats_uploads_total",
            "ferry_sync_nats_reports_total",
        ] {
            assert!(
                sample(&metrics, name).is_some_and(|n| n >= 1.0),
                "{name} counts what the bridge carried:\n{metrics}"
            );
        }
    }
    let replica_log = replica.log_text();
    assert_eq!(
        replica.term(Duration::from_secs(30)),
        Some(0),
        "the replica stops cleanly on SIGTERM:\n{replica_log}"
    );
    assert_eq!(serve.term(Duration::from_secs(30)), Some(0));
    db.drop_db().await;
}
