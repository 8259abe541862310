//! Guards the one command-line grammar (ARCHITECTURE.md, "The command line"): every
//! verb of every engine answers `--help`; a flag is read from `FERRY_<ENGINE>_<FLAG>`;
//! the spellings and variable names from before the grammar still work, each with a
//! warning that names the new one, so scripts written for them keep running.

use ferry_testkit::proc;
use std::path::Path;

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

fn ferry(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    proc::run(Path::new(FERRY), args, env)
}

#[test]
fn every_verb_answers_help_with_its_variables() {
    let verbs: &[(&str, &[&str])] = &[
        (
            "ship",
            &["send", "status", "receive", "replicas", "promote"],
        ),
        (
            "outbox",
            &[
                "install", "relay", "status", "requeue", "discard", "pause", "resume",
            ],
        ),
        ("flow", &["list", "show", "metrics", "signal", "cancel"]),
    ];
    for (engine, verbs) in verbs {
        for verb in *verbs {
            let (code, out, err) = ferry(&[engine, verb, "--help"], &[]);
            assert_eq!(code, 0, "ferry {engine} {verb} --help: {err}");
            let prefix = format!("FERRY_{}_", engine.to_uppercase());
            assert!(
                out.contains(&prefix),
                "ferry {engine} {verb}: no flag reads {prefix}*:\n{out}"
            );
            for line in out.lines().filter(|l| l.contains("[env: FERRY_")) {
                assert!(
                    line.contains(&format!("[env: {prefix}")),
                    "ferry {engine} {verb}: a flag reads another engine's variable: {line}"
                );
            }
        }
    }
    let (code, out, _) = ferry(&["demo", "--help"], &[]);
    assert_eq!(code, 0);
    assert!(out.contains("FERRY_DEMO_WRITE_MS"), "{out}");
}

#[test]
fn a_flag_comes_from_its_engines_variable() {
    let scratch = ferry_testkit::Scratch::new("cli-env");
    let dir = scratch.path().join("no-engine-here");
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    // The flow engine's directory from FERRY_FLOW_DIR: the error names it, so it was read.
    let (code, _, err) = ferry(&["flow", "list"], &[("FERRY_FLOW_DIR", d)]);
    assert_ne!(code, 0);
    assert!(
        err.contains(d) && err.contains("no flow engine has opened"),
        "{err}"
    );
}

#[test]
fn old_spellings_and_variables_still_work_and_say_the_new_ones() {
    let scratch = ferry_testkit::Scratch::new("cli-old");
    let dir = scratch.path().join("standby");
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.to_str().unwrap();
    // `ferry receive status` is `ferry ship replicas`, and --dir came from FERRY_DIR: the
    // answer (no replicas there) names the directory.
    let (code, _, err) = ferry(&["receive", "status", "--json"], &[("FERRY_DIR", d)]);
    assert_ne!(code, 0);
    assert!(
        err.contains(d) && err.contains("holds no replicas"),
        "{err}"
    );
    assert!(
        err.contains("`ferry receive status` is now `ferry ship replicas`"),
        "{err}"
    );
    assert!(err.contains("FERRY_DIR is now FERRY_SHIP_DIR"), "{err}");
    // The new spelling and variable give the same answer and say nothing of the kind.
    let (code, _, err) = ferry(&["ship", "replicas", "--json"], &[("FERRY_SHIP_DIR", d)]);
    assert_ne!(code, 0);
    assert!(
        err.contains(d) && err.contains("holds no replicas"),
        "{err}"
    );
    assert!(!err.contains("is now"), "{err}");
    // A new variable wins over an old one.
    let other = scratch.path().join("other");
    let (code, _, err) = ferry(
        &["flow", "list"],
        &[
            ("FERRY_FLOW_DIR", other.to_str().unwrap()),
            ("FERRY_TIMEOUT_MS", "5"),
            ("FERRY_FLOW_TIMEOUT_MS", "7"),
        ],
    );
    assert_ne!(code, 0);
    assert!(!err.contains("FERRY_TIMEOUT_MS is now"), "{err}");
}
