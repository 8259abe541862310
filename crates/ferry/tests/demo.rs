//! `ferry demo`, the README's first command, run whole (shorter than its defaults): it
//! must keep passing its own checks, the flow part's SIGKILL included. Guards against
//! the demo rotting while every engine's own tests pass.

use ferry_testkit::Scratch;
use std::process::Command;

#[test]
fn the_demo_passes_its_own_checks() {
    let scratch = Scratch::new("demo");
    let dir = scratch.dir("work");
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["demo", "--seconds", "2", "--outbox-orders", "500"])
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
    ] {
        assert!(stdout.contains(line), "no {line:?} in:\n{stdout}");
    }
    assert!(stdout.lines().any(|l| l == "OK"), "{stdout}");
}
