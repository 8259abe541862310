//! Checking a run's code against its journal (docs/flow.md §1.3 and §3).
//!
//! A run's code runs again from the start after every restart. Each context call takes
//! the next position and must find there an entry of its own kind and name; the entries
//! there (a step's failed attempts, then its result; a timer set, then fired) are what
//! the call replays. Past the journal's end the run executes for real and the engine
//! journals what happens at the positions this hands out. A call that finds something
//! else is nondeterminism: the run is parked with the position and both descriptions.

use crate::journal::{Entry, Record, ValueKind};

/// A context call, as the cursor sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call<'a> {
    Step(&'a str),
    Sleep,
    WaitFor(&'a str),
    Child(&'a str),
    Value(ValueKind),
    ContinueAsNew,
}

impl Call<'_> {
    pub fn describe(&self) -> String {
        match self {
            Call::Step(n) => format!("step {n:?}"),
            Call::Sleep => "sleep".into(),
            Call::WaitFor(n) => format!("wait_for {n:?}"),
            Call::Child(w) => format!("child {w:?}"),
            Call::Value(k) => format!("{k:?}").to_lowercase(),
            Call::ContinueAsNew => "continue_as_new".into(),
        }
    }

    /// Does `first`, the first entry at a position, answer this call?
    fn answered_by(&self, first: &Entry) -> bool {
        match (self, first) {
            // A cancellation observed at a suspension point answers whatever call was
            // suspended there.
            (
                Call::Step(_) | Call::Sleep | Call::WaitFor(_) | Call::Child(_),
                Entry::CancelSeen,
            ) => true,
            (Call::Step(n), Entry::Step { name, .. } | Entry::StepAttempt { name, .. }) => {
                n == name
            }
            (Call::Sleep, Entry::TimerSet { .. } | Entry::TimerRefused { .. }) => true,
            (Call::WaitFor(n), Entry::WaitStarted { name, .. } | Entry::Waited { name, .. }) => {
                n == name
            }
            (Call::Child(w), Entry::ChildStarted { workflow, .. }) => w == workflow,
            (Call::Value(k), Entry::Value { kind, .. }) => k == kind,
            (Call::ContinueAsNew, Entry::ContinuedAsNew { .. }) => true,
            _ => false,
        }
    }
}

/// The run's code took another path than its journal.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "nondeterminism at position {position}: the journal holds {journal}, the code now makes \
     {code}; deploy code that takes the recorded path (guard new calls with ctx.patched), or \
     cancel the run"
)]
pub struct Nondeterminism {
    pub position: u32,
    pub journal: String,
    pub code: String,
}

/// What a call found at its position.
#[derive(Debug, PartialEq, Eq)]
pub enum Slot<'a> {
    /// Replaying: the entries recorded at `pos`, oldest first (never empty).
    Recorded { pos: u32, entries: &'a [Entry] },
    /// Past the journal's end: execute, and journal what happens at `pos`.
    Fresh { pos: u32 },
}

/// A run's journal for its current generation, by position, and the cursor over it.
#[derive(Debug, Default)]
pub struct Replay {
    /// `positions[p]`: the entries at position p (p 0 is `Started`).
    positions: Vec<Vec<Entry>>,
    /// Arrivals from outside, in journal order (signals, cancellation requests).
    arrivals: Vec<Entry>,
    next: u32,
    /// How many positions the journal held (`positions` is emptied once the cursor
    /// has passed them all: a run parked for days keeps no copy of its journal).
    journaled: u32,
    /// The first mismatch. It sticks: code that catches the error and goes on must
    /// not run (or journal) anything against a journal it no longer lines up with.
    diverged: Option<Nondeterminism>,
}

impl Replay {
    /// Build from one run's records of one generation, in log order.
    pub fn new(records: impl IntoIterator<Item = Record>) -> Replay {
        let mut r = Replay {
            next: 1,
            ..Replay::default()
        };
        for rec in records {
            match rec.pos {
                None => r.arrivals.push(rec.entry),
                Some(p) => {
                    let p = p as usize;
                    if r.positions.len() <= p {
                        r.positions.resize_with(p + 1, Vec::new);
                    }
                    r.positions[p].push(rec.entry);
                }
            }
        }
        r.journaled = r.positions.len() as u32;
        r
    }

    /// The `Started` entry, if the journal has one (not after the cursor left the
    /// journal: see `call`).
    pub fn started(&self) -> Option<&Entry> {
        self.positions.first().and_then(|e| e.first())
    }

    /// The last entry at the highest position journaled (a generation's end, if it
    /// ended).
    pub fn last(&self) -> Option<&Entry> {
        self.positions.iter().rev().find_map(|p| p.last())
    }

    /// The number of positions journaled: where an entry appended after all of them
    /// goes.
    pub fn len(&self) -> u32 {
        self.journaled
    }

    pub fn is_empty(&self) -> bool {
        self.journaled == 0
    }

    /// Entries journaled at positions (what the history limit counts).
    pub fn entries(&self) -> u32 {
        self.positions.iter().map(|p| p.len() as u32).sum()
    }

    /// Signals consumed by the waits journaled, by name.
    pub fn consumed_by_name(&self) -> std::collections::BTreeMap<String, u32> {
        let mut m = std::collections::BTreeMap::new();
        for e in self.positions.iter().flatten() {
            if let Entry::Waited { name, got: Some(_) } = e {
                *m.entry(name.clone()).or_default() += 1;
            }
        }
        m
    }

    /// Did the run observe its cancellation in this generation?
    pub fn cancel_seen(&self) -> bool {
        self.positions
            .iter()
            .flatten()
            .any(|e| matches!(e, Entry::CancelSeen))
    }

    pub fn arrivals(&self) -> &[Entry] {
        &self.arrivals
    }

    /// The arrivals, taken out (the engine keeps them in the run's inbox).
    pub fn take_arrivals(&mut self) -> Vec<Entry> {
        std::mem::take(&mut self.arrivals)
    }

    /// Is the cursor still inside the journal?
    pub fn replaying(&self) -> bool {
        (self.next as usize) < self.positions.len()
    }

    /// Take the next position for `call`.
    pub fn call(&mut self, call: Call<'_>) -> Result<Slot<'_>, Nondeterminism> {
        self.check()?;
        let pos = self.next;
        self.next += 1;
        if pos >= self.journaled {
            // Past the journal: what it held is never looked at again.
            self.positions = Vec::new();
        }
        match self.positions.get(pos as usize) {
            None => Ok(Slot::Fresh { pos }),
            Some(entries) => match entries.first() {
                Some(first) if call.answered_by(first) => Ok(Slot::Recorded { pos, entries }),
                Some(first) => {
                    let n = Nondeterminism {
                        position: pos,
                        journal: first.describe(),
                        code: call.describe(),
                    };
                    self.diverged = Some(n.clone());
                    Err(n)
                }
                // A hole: positions are journaled in order, so this is a bug or damage;
                // refuse rather than guess.
                None => {
                    let n = Nondeterminism {
                        position: pos,
                        journal: "nothing (a gap in the journal)".into(),
                        code: call.describe(),
                    };
                    self.diverged = Some(n.clone());
                    Err(n)
                }
            },
        }
    }

    /// The first mismatch, if the code and the journal parted ways.
    pub fn check(&self) -> Result<(), Nondeterminism> {
        match &self.diverged {
            Some(n) => Err(n.clone()),
            None => Ok(()),
        }
    }

    /// Give back position `pos`, just taken by a fresh call that journaled nothing (it
    /// failed a limit): the next call takes it, so the journal has no hole.
    pub fn give_back(&mut self, pos: u32) {
        if self.next == pos + 1 && pos >= self.journaled {
            self.next = pos;
        }
    }

    /// The position the next call will take.
    pub fn next_pos(&self) -> u32 {
        self.next
    }

    /// `ctx.patched(id)`. Replaying, true if the position holds this patch (taken), else
    /// false and the position is left for the next call: the run started before the
    /// patch and keeps its old path. Past the journal's end: true, at the position
    /// returned, where the engine journals `Patch { id }`.
    pub fn patched(&mut self, id: &str) -> (bool, Option<u32>) {
        if self.diverged.is_some() {
            return (false, None);
        }
        let pos = self.next;
        match self.positions.get(pos as usize).and_then(|e| e.first()) {
            None if !self.replaying() => {
                self.next += 1;
                (true, Some(pos))
            }
            Some(Entry::Patch { id: recorded }) if recorded == id => {
                self.next += 1;
                (true, None)
            }
            _ => (false, None),
        }
    }

    /// The code returned. Replaying, the journal must not hold more calls than the code
    /// made; the position of the `Finished` entry (recorded or to journal).
    pub fn finish(&mut self) -> Result<Slot<'_>, Nondeterminism> {
        self.check()?;
        let pos = self.next;
        match self.positions.get(pos as usize).and_then(|e| e.first()) {
            None => Ok(Slot::Fresh { pos }),
            Some(Entry::Finished { .. } | Entry::Parked { .. } | Entry::ContinuedAsNew { .. }) => {
                Ok(Slot::Recorded {
                    pos,
                    entries: &self.positions[pos as usize],
                })
            }
            Some(other) => {
                let n = Nondeterminism {
                    position: pos,
                    journal: other.describe(),
                    code: "the end of the workflow".into(),
                };
                self.diverged = Some(n.clone());
                Err(n)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::Outcome;
    use serde_json::json;

    fn rec(pos: Option<u32>, entry: Entry) -> Record {
        Record {
            run: "r".into(),
            generation: 0,
            pos,
            entry,
        }
    }

    fn started() -> Record {
        rec(
            Some(0),
            Entry::Started {
                workflow: "w".into(),
                input: json!(1),
                parent: None,
                consumed: Default::default(),
                cancel_seen: false,
            },
        )
    }

    fn journal() -> Replay {
        Replay::new([
            started(),
            rec(
                Some(1),
                Entry::StepAttempt {
                    name: "charge".into(),
                    attempt: 1,
                    error: "503".into(),
                    retry_at_ms: 10,
                },
            ),
            rec(
                Some(1),
                Entry::Step {
                    name: "charge".into(),
                    outcome: Outcome::Ok(json!("ch_1")),
                    attempts: 2,
                },
            ),
            rec(
                None,
                Entry::Signal {
                    name: "review".into(),
                    value: json!(true),
                    key: None,
                },
            ),
            rec(Some(2), Entry::TimerSet { fire_at_ms: 99 }),
            rec(Some(2), Entry::TimerFired),
        ])
    }

    #[test]
    fn the_same_calls_replay_then_run_fresh() {
        let mut r = journal();
        assert!(matches!(r.started(), Some(Entry::Started { .. })));
        assert_eq!(r.arrivals().len(), 1);
        match r.call(Call::Step("charge")).unwrap() {
            Slot::Recorded { pos: 1, entries } => assert_eq!(entries.len(), 2),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            r.call(Call::Sleep).unwrap(),
            Slot::Recorded { pos: 2, .. }
        ));
        assert!(!r.replaying());
        assert_eq!(r.call(Call::Step("ship")).unwrap(), Slot::Fresh { pos: 3 });
        assert_eq!(r.finish().unwrap(), Slot::Fresh { pos: 4 });
    }

    #[test]
    fn another_path_is_named_with_its_position() {
        let mut r = journal();
        let e = r.call(Call::Step("refund")).unwrap_err();
        assert_eq!(e.position, 1);
        assert_eq!(e.journal, "step \"charge\"");
        assert_eq!(e.code, "step \"refund\"");
        assert!(e.to_string().contains("ctx.patched"));

        let mut r = journal();
        r.call(Call::Step("charge")).unwrap();
        let e = r.finish().unwrap_err();
        assert_eq!((e.position, e.journal.as_str()), (2, "sleep"));
    }

    #[test]
    fn a_mismatch_sticks_so_code_that_catches_it_goes_nowhere() {
        let mut r = journal();
        assert!(r.call(Call::Step("refund")).is_err());
        // The code caught the error and calls on: every call, patch and the end refuse.
        let again = r.call(Call::Sleep).unwrap_err();
        assert_eq!(again.position, 1);
        assert_eq!(r.patched("x"), (false, None));
        assert_eq!(r.finish().unwrap_err().position, 1);
    }

    #[test]
    fn patches_keep_old_runs_on_their_path() {
        // An old run (journaled before the patch existed): the patch is false and takes
        // no position, so the recorded step still matches.
        let mut old = journal();
        assert_eq!(old.patched("new-fraud-check"), (false, None));
        assert!(matches!(
            old.call(Call::Step("charge")).unwrap(),
            Slot::Recorded { .. }
        ));

        // A new run: true, journaled at the position handed out; replayed, true again.
        let mut new = Replay::new([started()]);
        assert_eq!(new.patched("new-fraud-check"), (true, Some(1)));
        let mut replayed = Replay::new([
            started(),
            rec(
                Some(1),
                Entry::Patch {
                    id: "new-fraud-check".into(),
                },
            ),
        ]);
        assert_eq!(replayed.patched("new-fraud-check"), (true, None));
        assert_eq!(
            replayed.call(Call::Step("fraud")).unwrap(),
            Slot::Fresh { pos: 2 }
        );
    }

    #[test]
    fn a_cancellation_seen_answers_the_suspended_call() {
        let mut r = Replay::new([
            started(),
            rec(None, Entry::CancelRequested),
            rec(Some(1), Entry::CancelSeen),
        ]);
        match r.call(Call::WaitFor("review")).unwrap() {
            Slot::Recorded { entries, .. } => assert_eq!(entries[0], Entry::CancelSeen),
            other => panic!("{other:?}"),
        }
    }
}
