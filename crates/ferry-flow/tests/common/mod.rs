//! What more than one of ferry-flow's test binaries needs (each uses some of it).
#![allow(dead_code)]

use ferry_flow::Journal;
use std::collections::BTreeSet;

/// Every (run, step) whose result a journal holds, for workflows whose steps are named
/// `s0`, `s1`, …: what the crash tests check against their ledgers (an acknowledged
/// step must never run again).
pub fn steps_held(journal: &Journal) -> BTreeSet<(String, u32)> {
    journal
        .steps()
        .map(|(run, name, _)| {
            let step = name.strip_prefix('s').and_then(|n| n.parse().ok());
            (run.to_string(), step.expect("steps are named s0, s1, …"))
        })
        .collect()
}

/// Wait until `engine`'s log holds at least `records` records appended since it opened
/// and all of them are durable: what a test means by "let the run journal its wait
/// before the engine goes" (waiting for the thing itself, not for a while).
pub async fn journaled(engine: &ferry_flow::Engine, records: u64) {
    ferry_testkit::eventually(&format!("{records} durable records"), || {
        let s = engine.log_stats();
        s.records >= records && s.durable >= s.end
    })
    .await;
}
