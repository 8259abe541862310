//! `ferry outbox` operators' commands as a person or a script runs them: JSON from
//! status, requeue, discard, pause and resume, and the relays' totals in status after
//! the relays have stopped.

#[path = "../../ferry-outbox/tests/common/mod.rs"]
mod common;

use common::*;
use ferry_outbox::Message;
use ferry_outbox::relay::RelayConfig;
use ferry_outbox::sink::Faults;
use ferry_outbox::transport::TransportOptions;
use std::path::Path;
use std::time::Duration;

fn ferry(args: &[&str]) -> String {
    let (code, stdout, stderr) =
        ferry_testkit::proc::run(Path::new(env!("CARGO_BIN_EXE_ferry")), args, &[]);
    assert!(code == 0, "{args:?} failed: {stderr}");
    stdout
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = ferry(args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?} printed no JSON ({e}): {out}"))
}

// Guards against operators' commands that a script cannot read (only status had
// --json) and a status that knew nothing of what relays did once they stopped (their
// counters lived in each relay's /status only): a relay parks a message and stops;
// status shows its totals, as text and JSON; requeue, discard, pause and resume answer
// in JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_print_json_and_status_shows_relay_totals() {
    let scratch = ferry_testkit::Scratch::new("outbox-cli");
    let db = format!("sqlite:{}", scratch.path().join("app.db").display());
    let store = sqlite_store(&scratch).await;
    let app = App::open(&store).await;
    let sink = RunningSink::start(None).await;
    let poison = Message::new("orders.created", b"p".to_vec()).ordered_by("bad");
    sink.sink.set_faults(Faults {
        refuse: [(poison.message_id.clone(), 422)].into(),
        ..Faults::default()
    });
    app.write(std::slice::from_ref(&poison), true)
        .await
        .unwrap();
    let ledger = write_workload(&app, 12, 2, 5).await;
    let park_it = || async {
        let config = RelayConfig {
            owner: "cli-relay".into(),
            max_attempts: 1,
            ..fast_config()
        };
        let (relay, running) =
            start_relay(&store, &sink.url, config, TransportOptions::default()).await;
        assert!(
            eventually(Duration::from_secs(30), || relay.status().parked == 1).await,
            "{:?}",
            relay.status()
        );
        assert!(drained(&store, Duration::from_secs(30)).await);
        running.stop().await.unwrap();
    };
    park_it().await;

    let st = json(&["outbox", "status", "--db", &db, "--json"]);
    assert_eq!(st["parked"], 1, "{st}");
    let totals = &st["relay_totals"];
    assert_eq!(totals["published"], ledger.committed.len(), "{st}");
    assert_eq!(totals["parked"], 1, "{st}");
    for field in [
        "duplicates",
        "unavailable",
        "uncertain",
        "fenced",
        "db_errors",
        "breaker_openings",
    ] {
        assert_eq!(totals[field], 0, "{field}: {st}");
    }
    assert_eq!(st["relays"][0]["owner"], "cli-relay", "{st}");
    assert_eq!(st["relays"][0]["stopped"], true, "{st}");
    let text = ferry(&["outbox", "status", "--db", &db]);
    assert!(
        text.contains(&format!(
            "relays, all time: published {}",
            ledger.committed.len()
        )) && text.contains("cli-relay"),
        "{text}"
    );

    let r = json(&["outbox", "requeue", "--db", &db, "--all-parked", "--json"]);
    assert_eq!(r, serde_json::json!({"requeued": 1}));
    park_it().await;
    let id = poison.message_id.as_str();
    let r = json(&["outbox", "discard", "--db", &db, "--id", id, "--json"]);
    assert_eq!(r, serde_json::json!({"discarded": 1}));
    let r = json(&["outbox", "pause", "--db", &db, "--topic", "t", "--json"]);
    assert_eq!(r, serde_json::json!({"topic": "t", "paused": true}));
    assert_eq!(store.status().await.unwrap().paused_topics, ["t"]);
    let r = json(&["outbox", "resume", "--db", &db, "--topic", "t", "--json"]);
    assert_eq!(r, serde_json::json!({"topic": "t", "paused": false}));
    let st = json(&["outbox", "status", "--db", &db, "--json"]);
    assert_eq!(st["parked"], 0, "{st}");
    assert_eq!(st["relay_totals"]["parked"], 2, "{st}");
    let owners: Vec<&str> = st["relays"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["owner"].as_str().unwrap())
        .collect();
    assert!(
        owners.contains(&"(retired)") && owners.contains(&"cli-relay"),
        "{st}"
    );
}
