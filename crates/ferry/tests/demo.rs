//! `ferry demo`, the README's first command, run whole (shorter than its defaults): it
//! must keep passing its own checks, the flow part's SIGKILL included. Guards against
//! the demo rotting while every engine's own tests pass. Run with `--json`: its figures
//! on stdout, its sentences on stderr.

use ferry_testkit::Scratch;
use std::process::Command;

#[test]
fn the_demo_passes_its_own_checks() {
    let scratch = Scratch::new("demo");
    let dir = scratch.dir("work");
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "demo",
            "--json",
            "--write-ms",
            "2000",
            "--outbox-orders",
            "500",
        ])
        .args(["--flow-orders", "60", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the demo failed:\n{stdout}\n{stderr}");
    for line in [
        "the old primary's shipper after promotion: fenced",
        "every committed event arrived once: yes",
        "orders finished:          60 of 60",
        "none called again",
        "orders wrong:             0",
        "its answer \"applied\" was filed",
        "sales stood on the server once each",
    ] {
        assert!(stderr.contains(line), "no {line:?} in:\n{stderr}");
    }
    assert!(stderr.lines().any(|l| l == "OK"), "{stderr}");
    let doc: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON document");
    assert_eq!(doc["ok"], true, "{doc}");
    assert_eq!(doc["ship"]["promoted_equal"], true, "{doc}");
    assert_eq!(doc["ship"]["old_primary_fenced"], true, "{doc}");
    assert_eq!(doc["outbox"]["missing"], 0, "{doc}");
    assert_eq!(doc["outbox"]["rolled_back_delivered"], 0, "{doc}");
    assert_eq!(doc["flow"]["finished"], 60, "{doc}");
    assert_eq!(doc["flow"]["orders_wrong"], 0, "{doc}");
    assert_eq!(doc["flow_server"]["orders_wrong"], 0, "{doc}");
    assert_eq!(doc["sync"]["wish_answer"], "applied", "{doc}");
    assert!(
        doc["sync"]["sales_lost_by_the_restore"].as_i64() > Some(0),
        "the restore took sales away for the journals to bring back: {doc}"
    );
}
