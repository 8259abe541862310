//! What more than one of ferry-flow's test binaries needs.

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
