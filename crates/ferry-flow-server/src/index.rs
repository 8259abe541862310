//! The server's index of runs (docs/flow-server.md §10): what list, show and result
//! answer, with no worker connected. It is built from each shard's journal records as
//! they become durable (and from the whole log at start), so it never shows what a
//! crash could take back.
//!
//! Only three entries move a run: `Started` (a run, or a generation of it, begins),
//! `Finished` and `Parked`. An append costs the index a look at each record's header and
//! the first bytes of its entry; those three are parsed whole.

use ferry_flow::journal::{Entry, Json, Outcome, RECORD_KIND, Record};
use serde::Serialize;
use std::collections::{HashMap, VecDeque};

/// One run as the server's index knows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunSummary {
    pub id: String,
    pub workflow: String,
    pub shard: u32,
    pub generation: u32,
    /// running, finished, failed, cancelled or parked (as `ferry flow list` says them).
    pub state: &'static str,
    /// The output (finished), the error (failed) or the reason (parked).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<Json>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

impl RunSummary {
    pub fn finished(&self) -> bool {
        matches!(self.state, "finished" | "failed" | "cancelled")
    }
}

/// What one record changes.
#[derive(Debug)]
enum Update {
    Started {
        run: String,
        generation: u32,
        workflow: String,
        parent: Option<String>,
    },
    Finished {
        run: String,
        outcome: Outcome,
    },
    Parked {
        run: String,
        reason: String,
    },
}

/// The index (module doc).
#[derive(Default)]
pub struct Index {
    runs: HashMap<String, RunSummary>,
    /// Per shard: updates from records appended and not yet durable, with the position
    /// after their record.
    pending: Vec<VecDeque<(u64, Update)>>,
}

/// What a record does to the index, if anything. Cheap for the records that do nothing
/// (nearly all): the entry's tag is its first field.
fn update_of(kind: u8, bytes: &[u8]) -> Option<Update> {
    if kind != RECORD_KIND {
        return None;
    }
    let peek = Record::peek(bytes).ok()?;
    let tag = peek.entry_json;
    let moves = [
        &b"{\"t\":\"started\""[..],
        b"{\"t\":\"finished\"",
        b"{\"t\":\"parked\"",
    ]
    .iter()
    .any(|t| tag.starts_with(t));
    if !moves {
        return None;
    }
    let rec = Record::decode(bytes).ok()?;
    Some(match rec.entry {
        Entry::Started {
            workflow, parent, ..
        } => Update::Started {
            run: rec.run,
            generation: rec.generation,
            workflow,
            parent,
        },
        Entry::Finished { outcome } => Update::Finished {
            run: rec.run,
            outcome,
        },
        Entry::Parked { reason } => Update::Parked {
            run: rec.run,
            reason,
        },
        _ => return None,
    })
}

impl Index {
    pub fn new(shards: u32) -> Index {
        Index {
            runs: HashMap::new(),
            pending: (0..shards).map(|_| VecDeque::new()).collect(),
        }
    }

    /// A durable record of `shard` (read back at start): applied at once.
    pub fn durable_record(&mut self, shard: u32, kind: u8, bytes: &[u8]) {
        if let Some(u) = update_of(kind, bytes) {
            self.apply(shard, u);
        }
    }

    /// A record appended to `shard`, ending at `position`: applied once that is durable.
    pub fn appended(&mut self, shard: u32, position: u64, kind: u8, bytes: &[u8]) {
        if let Some(u) = update_of(kind, bytes)
            && let Some(p) = self.pending.get_mut(shard as usize)
        {
            p.push_back((position, u));
        }
    }

    /// Every record of `shard` before `position` is durable. True if a run finished or
    /// parked (result waiters look again).
    pub fn durable(&mut self, shard: u32, position: u64) -> bool {
        let mut ended = false;
        while let Some(p) = self.pending.get_mut(shard as usize)
            && p.front().is_some_and(|(end, _)| *end <= position)
        {
            let (_, u) = p.pop_front().expect("looked at it");
            ended |= !matches!(u, Update::Started { .. });
            self.apply(shard, u);
        }
        ended
    }

    fn apply(&mut self, shard: u32, u: Update) {
        match u {
            Update::Started {
                run,
                generation,
                workflow,
                parent,
            } => {
                let e = self.runs.entry(run.clone()).or_insert_with(|| RunSummary {
                    id: run,
                    workflow: workflow.clone(),
                    shard,
                    generation,
                    state: "running",
                    detail: None,
                    parent: parent.clone(),
                });
                e.workflow = workflow;
                e.generation = generation;
                e.state = "running";
                e.detail = None;
                e.parent = parent;
            }
            Update::Finished { run, outcome } => {
                if let Some(e) = self.runs.get_mut(&run) {
                    (e.state, e.detail) = match outcome {
                        Outcome::Ok(v) => ("finished", Some(v)),
                        Outcome::Err(error) => ("failed", Some(Json::String(error))),
                        Outcome::Cancelled => ("cancelled", None),
                    };
                }
            }
            Update::Parked { run, reason } => {
                if let Some(e) = self.runs.get_mut(&run) {
                    e.state = "parked";
                    e.detail = Some(Json::String(reason));
                }
            }
        }
    }

    pub fn get(&self, run: &str) -> Option<&RunSummary> {
        self.runs.get(run)
    }

    /// Runs by id, in a state if given, from after `after`, at most `limit`.
    pub fn list(&self, state: Option<&str>, after: Option<&str>, limit: usize) -> Vec<RunSummary> {
        let mut v: Vec<&RunSummary> = self
            .runs
            .values()
            .filter(|r| state.is_none_or(|s| r.state == s))
            .filter(|r| after.is_none_or(|a| r.id.as_str() > a))
            .collect();
        v.sort_unstable_by(|a, b| a.id.cmp(&b.id));
        v.into_iter().take(limit).cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.runs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }
}
