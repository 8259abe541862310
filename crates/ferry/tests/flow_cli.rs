//! `ferry flow list|show|metrics|signal|cancel` against an engine running in this test process
//! (the CLI runs as its own process and reaches the engine only through the directory),
//! and the same requests left while no engine runs, applied when one opens.

use ferry_flow::{Ctx, Engine, FlowError, Signal, Workflow};
use ferry_testkit::{Scratch, eventually};
use std::path::Path;
use std::process::Command;

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");
static ORDER: Workflow<u32, String> = Workflow::new("order");
static GO: Signal<String> = Signal::new("go");

fn open(dir: &Path) -> Engine {
    Engine::builder(dir)
        .register(ORDER, |ctx: Ctx, n: u32| async move {
            ctx.publish(&format!("order {n} waiting"))?;
            match ctx.wait_for(GO, None).await {
                Ok(v) => Ok(format!("order {n}: {}", v.unwrap_or_default())),
                Err(FlowError::Cancelled) => Err(FlowError::Cancelled),
                Err(e) => Err(e),
            }
        })
        .open()
        .unwrap()
}

fn ferry(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(FERRY).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_show_signal_and_cancel_reach_a_running_engine() {
    let scratch = Scratch::new("flow-cli");
    let dir = scratch.dir("flow");
    let d = dir.to_str().unwrap();
    let engine = open(&dir);
    for n in 0..3 {
        engine.start(ORDER, &format!("o{n}"), &n).await.unwrap();
    }
    eventually("the status file", || {
        ferry(&["flow", "list", "--dir", d])
            .1
            .contains("3 runs: 3 running")
    })
    .await;

    // signal and cancel run in a blocking thread: the engine answers from its own.
    let dd = d.to_string();
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        ferry(&["flow", "signal", "--dir", &dd, "o0", "go", "\"post\""])
    })
    .await
    .unwrap();
    assert!(ok, "{err}");
    assert!(out.contains("delivered"), "{out}");
    let dd = d.to_string();
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        ferry(&["flow", "cancel", "--dir", &dd, "o1", "--json"])
    })
    .await
    .unwrap();
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["ok"].as_bool(), v["queued"].as_bool()),
        (Some(true), Some(false)),
        "applied by the running engine: {out}"
    );
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("cancellation of \"o1\" requested"),
        "{out}"
    );
    assert_eq!(
        engine.run::<String>("o0").unwrap().result().await.unwrap(),
        "order 0: post"
    );
    assert!(matches!(
        engine.run::<String>("o1").unwrap().result().await,
        Err(FlowError::Cancelled)
    ));
    eventually("the status to show both", || {
        ferry(&["flow", "list", "--dir", d])
            .1
            .contains("1 running, 1 finished, 0 failed, 1 cancelled")
    })
    .await;
    let (ok, out, _) = ferry(&["flow", "list", "--dir", d, "--state", "cancelled"]);
    assert!(ok && out.contains("o1") && !out.contains("o0 "), "{out}");
    let (ok, out, _) = ferry(&["flow", "show", "--dir", d, "o0"]);
    assert!(ok, "{out}");
    assert!(out.contains("state      finished"), "{out}");
    assert!(out.contains("output     order 0: post"), "{out}");
    let (ok, out, _) = ferry(&["flow", "show", "--dir", d, "o2", "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["state"], "running");
    assert_eq!(v["published"], "order 2 waiting");
    let (ok, out, _) = ferry(&["flow", "list", "--dir", d, "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["runs"].as_array().unwrap().len(), 3);
    assert!(v["recovery_ms"].as_f64().is_some());
    let (ok, out, err) = ferry(&["flow", "metrics", "--dir", d]);
    assert!(ok, "{err}");
    assert!(
        out.contains("ferry_flow_runs{state=\"running\"} 1\n")
            && out.contains("ferry_flow_runs{state=\"cancelled\"} 1\n")
            && out.contains("ferry_flow_signals_total 1\n")
            && out.contains("# TYPE ferry_flow_log_write_seconds histogram"),
        "{out}"
    );
    assert!(
        err.is_empty(),
        "a running engine's metrics need no warning: {err}"
    );

    // Bad input: told what and where, nothing changed.
    let (ok, _, err) = ferry(&["flow", "show", "--dir", d, "nope"]);
    assert!(!ok && err.contains("no run \"nope\""), "{err}");
    let (ok, _, err) = ferry(&["flow", "signal", "--dir", d, "o2", "go", "not json"]);
    assert!(!ok && err.contains("is not JSON"), "{err}");
    let (ok, _, err) = ferry(&["flow", "list", "--dir", d, "--state", "weird"]);
    assert!(!ok && err.contains("not one of"), "{err}");
    let dd = d.to_string();
    let (ok, _, err) = tokio::task::spawn_blocking(move || {
        ferry(&["flow", "signal", "--dir", &dd, "ghost", "go"])
    })
    .await
    .unwrap();
    assert!(!ok && err.contains("no run \"ghost\""), "{err}");
    let (ok, _, err) = ferry(&[
        "flow",
        "list",
        "--dir",
        scratch.dir("empty").to_str().unwrap(),
    ]);
    assert!(!ok && err.contains("no flow engine has opened"), "{err}");
    assert_eq!(engine.status("o2"), Some(ferry_flow::RunStatus::Running));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_left_while_no_engine_runs_is_applied_when_one_opens() {
    let scratch = Scratch::new("flow-cli-queued");
    let dir = scratch.dir("flow");
    let d = dir.to_str().unwrap();
    {
        let engine = open(&dir);
        engine.start(ORDER, "late", &7).await.unwrap();
    }
    let (ok, out, err) = ferry(&["flow", "list", "--dir", d]);
    assert!(ok, "{err}");
    assert!(out.starts_with("no engine running"), "{out}");
    let (ok, out, err) = ferry(&["flow", "metrics", "--dir", d]);
    assert!(ok, "{err}");
    assert!(err.contains("no engine runs"), "{err}");
    assert!(
        out.contains("ferry_flow_runs{state=\"running\"} 1\n"),
        "{out}"
    );
    let (ok, out, err) = ferry(&[
        "flow",
        "signal",
        "--dir",
        d,
        "late",
        "go",
        "\"later\"",
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["ok"].as_bool(), v["queued"].as_bool()),
        (Some(true), Some(true))
    );
    let engine = open(&dir);
    assert_eq!(
        engine
            .run::<String>("late")
            .unwrap()
            .result()
            .await
            .unwrap(),
        "order 7: later"
    );
}
