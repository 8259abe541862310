//! The server's index of runs (docs/flow-server.md §10): what list, show and result
//! answer, with no worker connected. It is built from each shard's journal records as
//! they become durable (and from the whole log at start), so it never shows what a
//! crash could take back.
//!
//! Two entries move a run: `Started` (a run, or a generation of it, begins) and
//! `Finished`. A record costs the index a look at its header and the first bytes of its
//! entry, made before the server's lock is taken ([`updates_of`]). A parked run shows as
//! running: parking is not journaled (each recovery decides it anew, on the worker).

use ferry_flow::journal::{Entry, Json, Outcome, RECORD_KIND, Record};
use ferry_flow::remote::proto::Rec;
use serde::Deserialize;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// One run as the server's index knows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunSummary {
    pub id: String,
    pub workflow: String,
    pub shard: u32,
    pub generation: u32,
    /// running, parked, finished, failed or cancelled (as `ferry flow list` says them).
    /// Parked is not durable: it is what the shard's holder said (§10).
    pub state: &'static str,
    /// The output (finished), the error (failed) or why it is parked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<Json>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

impl RunSummary {
    pub fn finished(&self) -> bool {
        matches!(self.state, "finished" | "failed" | "cancelled")
    }

    /// Finished, or parked: nothing happens to it until someone acts.
    pub fn settled(&self) -> bool {
        self.finished() || self.state == "parked"
    }
}

/// What one record changes.
#[derive(Debug)]
pub struct Update(Change);

#[derive(Debug)]
enum Change {
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
}

/// A `Started` entry without its input (which may be large, and the index does not keep).
#[derive(Deserialize)]
struct StartedHead {
    workflow: String,
    parent: Option<String>,
}

/// The index (module doc).
#[derive(Default)]
pub struct Index {
    runs: BTreeMap<String, RunSummary>,
    /// Per shard: updates from records appended and not yet durable, with the position
    /// after their record.
    pending: Vec<VecDeque<(u64, Update)>>,
    /// The runs shown parked, by shard: running again once the shard is granted anew.
    parked: BTreeSet<(u32, String)>,
}

/// What each of `records` would do to the index: read before the server's lock is
/// taken, handed to [`Index::appended`] for the records that turn out new.
pub fn updates_of(records: &[Rec]) -> Vec<Option<Update>> {
    records
        .iter()
        .map(|r| update_of(r.kind, &r.bytes))
        .collect()
}

/// What a record does to the index, if anything. Cheap for the records that do nothing
/// (nearly all): the entry's tag is its first field.
fn update_of(kind: u8, bytes: &[u8]) -> Option<Update> {
    if kind != RECORD_KIND {
        return None;
    }
    let peek = Record::peek(bytes).ok()?;
    let json = peek.entry_json;
    let change = if json.starts_with(b"{\"t\":\"started\"") {
        let head: StartedHead = serde_json::from_slice(json).ok()?;
        Change::Started {
            run: peek.run.to_string(),
            generation: peek.generation,
            workflow: head.workflow,
            parent: head.parent,
        }
    } else if json.starts_with(b"{\"t\":\"finished\"") {
        match Record::decode(bytes).ok()?.entry {
            Entry::Finished { outcome } => Change::Finished {
                run: peek.run.to_string(),
                outcome,
            },
            _ => return None,
        }
    } else {
        return None;
    };
    Some(Update(change))
}

impl Index {
    pub fn new(shards: u32) -> Index {
        Index {
            runs: BTreeMap::new(),
            pending: (0..shards).map(|_| VecDeque::new()).collect(),
            parked: BTreeSet::new(),
        }
    }

    /// A durable record of `shard` (read back at start): applied at once.
    pub fn durable_record(&mut self, shard: u32, kind: u8, bytes: &[u8]) {
        if let Some(u) = update_of(kind, bytes) {
            self.apply(shard, u);
        }
    }

    /// A run a checkpoint keeps as finished (read at start).
    pub fn finished_run(
        &mut self,
        shard: u32,
        id: &str,
        workflow: &str,
        parent: Option<&str>,
        generation: u32,
        outcome: &Outcome,
    ) {
        self.apply(
            shard,
            Update(Change::Started {
                run: id.to_string(),
                generation,
                workflow: workflow.to_string(),
                parent: parent.map(str::to_string),
            }),
        );
        self.apply(
            shard,
            Update(Change::Finished {
                run: id.to_string(),
                outcome: outcome.clone(),
            }),
        );
    }

    /// Runs the checkpoints no longer keep (finished longer than the retention ago).
    pub fn forget(&mut self, ids: &[String]) {
        for id in ids {
            if self.runs.get(id).is_some_and(RunSummary::finished) {
                self.runs.remove(id);
            }
        }
    }

    /// A record appended to `shard`, ending at `position`, with what it does
    /// ([`updates_of`]): applied once that is durable.
    pub fn appended(&mut self, shard: u32, position: u64, update: Update) {
        if let Some(p) = self.pending.get_mut(shard as usize) {
            p.push_back((position, update));
        }
    }

    /// Every record of `shard` before `position` is durable. The runs that finished are
    /// pushed to `ended` (their result waiters look again).
    pub fn durable(&mut self, shard: u32, position: u64, ended: &mut Vec<String>) {
        while let Some(p) = self.pending.get_mut(shard as usize)
            && p.front().is_some_and(|(end, _)| *end <= position)
        {
            let (_, u) = p.pop_front().expect("looked at it");
            if let Change::Finished { run, .. } = &u.0 {
                ended.push(run.clone());
            }
            self.apply(shard, u);
        }
    }

    fn apply(&mut self, shard: u32, u: Update) {
        match u.0 {
            Change::Started {
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
            Change::Finished { run, outcome } => {
                self.parked.remove(&(shard, run.clone()));
                if let Some(e) = self.runs.get_mut(&run) {
                    (e.state, e.detail) = match outcome {
                        Outcome::Ok(v) => ("finished", Some(v)),
                        Outcome::Err(error) => ("failed", Some(Json::String(error))),
                        Outcome::Cancelled => ("cancelled", None),
                    };
                }
            }
        }
    }

    /// The holder of `shard` parked `run`: shown parked, with `reason`, until the run
    /// ends or the shard is granted anew. False if the run is not running there.
    pub fn parked(&mut self, shard: u32, run: &str, reason: String) -> bool {
        let Some(e) = self.runs.get_mut(run) else {
            return false;
        };
        if e.shard != shard || e.state != "running" {
            return false;
        }
        e.state = "parked";
        e.detail = Some(Json::String(reason));
        self.parked.insert((shard, run.to_string()));
        true
    }

    /// `shard` was granted anew: its parked runs are running again until the new
    /// holder says otherwise.
    pub fn granted(&mut self, shard: u32) {
        let mut back = self.parked.split_off(&(shard, String::new()));
        let later = back.split_off(&(shard + 1, String::new()));
        self.parked.extend(later);
        for (_, run) in back {
            if let Some(e) = self.runs.get_mut(&run)
                && e.state == "parked"
            {
                e.state = "running";
                e.detail = None;
            }
        }
    }

    pub fn get(&self, run: &str) -> Option<&RunSummary> {
        self.runs.get(run)
    }

    /// Runs by id, in a state if given, from after `after`, at most `limit`.
    pub fn list(&self, state: Option<&str>, after: Option<&str>, limit: usize) -> Vec<RunSummary> {
        use std::ops::Bound::{Excluded, Unbounded};
        let from = after.map_or(Unbounded, |a| Excluded(a.to_string()));
        self.runs
            .range((from, Unbounded))
            .map(|(_, r)| r)
            .filter(|r| state.is_none_or(|s| r.state == s))
            .take(limit)
            .cloned()
            .collect()
    }

    pub fn len(&self) -> usize {
        self.runs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }
}
