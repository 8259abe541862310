//! What more than one of ferry-flow's test binaries needs.

use ferry_flow::journal::{Entry, Record};
use std::collections::{BTreeMap, BTreeSet};

/// Every (run, step) whose result a journal holds, for workflows whose steps are named
/// `s0`, `s1`, …: what the crash tests check against their ledgers (an acknowledged
/// step must never run again).
pub fn steps_held(journal: BTreeMap<String, Vec<Record>>) -> BTreeSet<(String, u32)> {
    let mut held = BTreeSet::new();
    for (run, records) in journal {
        for r in records {
            if let Entry::Step { name, .. } = r.entry {
                let step = name.strip_prefix('s').and_then(|n| n.parse().ok());
                held.insert((run.clone(), step.expect("steps are named s0, s1, …")));
            }
        }
    }
    held
}
