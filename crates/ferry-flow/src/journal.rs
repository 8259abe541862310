//! What a run records (docs/flow.md §3) and how a record is framed in ferry-log.
//!
//! A ferry-log record of kind [`RECORD_KIND`] carries one journal record: a small binary
//! header (format version, generation, position, run id) then the entry as JSON. The run
//! id comes first in the key so a reader can skip runs it does not care about without
//! parsing JSON.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The ferry-log record kind of journal records.
pub const RECORD_KIND: u8 = 1;
const FORMAT: u8 = 1;
/// Run ids are the caller's; they are bounded so a record's header stays small.
pub const RUN_ID_MAX: usize = 255;

/// A value journaled as JSON.
pub type Json = serde_json::Value;

/// How a step, child or run ended. Its JSON is also written by hand (`write_outcome`):
/// a change to its serde attributes must be made there too (a test compares the two).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Ok(Json),
    Err(String),
    /// The run observed a cancellation and returned `FlowError::Cancelled`.
    Cancelled,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ValueKind {
    Now,
    Random,
    Uuid,
}

/// One journal entry. Entries that answer a context call sit at that call's position;
/// `Signal` and `CancelRequested` arrive from outside and take no position. `Started`,
/// `Step` and `Finished` are also written by hand (`write_entry`): a change to their
/// serde attributes must be made there too (a test compares the two).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "t", rename_all = "snake_case")]
pub enum Entry {
    /// A generation begins (pos 0). A generation after the first carries what the run
    /// had consumed before it: signals by name, and whether it saw its cancellation.
    Started {
        workflow: String,
        input: Json,
        parent: Option<String>,
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        consumed: BTreeMap<String, u32>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        cancel_seen: bool,
    },
    Step {
        name: String,
        outcome: Outcome,
        attempts: u32,
    },
    StepAttempt {
        name: String,
        attempt: u32,
        error: String,
        retry_at_ms: u64,
    },
    Value {
        kind: ValueKind,
        value: Json,
    },
    TimerSet {
        fire_at_ms: u64,
    },
    TimerFired,
    Signal {
        name: String,
        value: Json,
        /// The sender's key: a signal with a key the run already received is not
        /// delivered again (`Engine::signal_once`, the CLI's requests).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<String>,
    },
    /// `wait_for` began; its deadline (if any) is durable so a timeout survives a crash.
    WaitStarted {
        name: String,
        deadline_ms: Option<u64>,
    },
    /// `wait_for` resolved: the index of the signal consumed (among that name's
    /// arrivals), or None for a timeout.
    Waited {
        name: String,
        got: Option<u32>,
    },
    ChildStarted {
        id: String,
        workflow: String,
    },
    ChildDone {
        outcome: Outcome,
    },
    Patch {
        id: String,
    },
    CancelRequested,
    CancelSeen,
    /// A sleep refused by the timers limit. Unlike the other limits, whether it is hit
    /// depends on how the run's concurrent calls interleaved, which a replay does not
    /// reproduce; so the refusal is journaled and replayed.
    TimerRefused {
        pending: u32,
        max: u32,
    },
    Finished {
        outcome: Outcome,
    },
    ContinuedAsNew {
        input: Json,
    },
    Parked {
        reason: String,
    },
}

impl Entry {
    /// A short name of what the entry answers, for nondeterminism reports: the call kind
    /// and its name where it has one (`step "charge"`, `sleep`, `wait_for "review"`).
    pub fn describe(&self) -> String {
        match self {
            Entry::Started { workflow, .. } => format!("start of {workflow:?}"),
            Entry::Step { name, .. } | Entry::StepAttempt { name, .. } => format!("step {name:?}"),
            Entry::Value { kind, .. } => format!("{kind:?}").to_lowercase(),
            Entry::TimerSet { .. } | Entry::TimerFired => "sleep".into(),
            Entry::Signal { name, .. } => format!("signal {name:?}"),
            Entry::WaitStarted { name, .. } | Entry::Waited { name, .. } => {
                format!("wait_for {name:?}")
            }
            Entry::ChildStarted { workflow, .. } => format!("child {workflow:?}"),
            Entry::ChildDone { .. } => "child".into(),
            Entry::Patch { id } => format!("patch {id:?}"),
            Entry::CancelRequested | Entry::CancelSeen => "cancel".into(),
            Entry::TimerRefused { .. } => "sleep".into(),
            Entry::Finished { .. } => "finish".into(),
            Entry::ContinuedAsNew { .. } => "continue_as_new".into(),
            Entry::Parked { .. } => "parked".into(),
        }
    }
}

/// One journal record: which run, which generation of it, which position, what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub run: String,
    pub generation: u32,
    /// The position of the context call this answers; `None` for arrivals from outside.
    pub pos: Option<u32>,
    pub entry: Entry,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("a journal record is cut short")]
    Short,
    #[error("journal record format {0}; this build reads format {FORMAT}")]
    Format(u8),
    #[error("a journal record's run id is not UTF-8")]
    RunId,
    #[error("a journal record's entry does not parse: {0}")]
    Entry(String),
}

/// What `Record::encode` gives for a record of these parts, from borrowed parts (a
/// `Record` would copy the run id).
pub fn encode(run: &str, generation: u32, pos: Option<u32>, entry: &Entry) -> Vec<u8> {
    // Header and entry in one buffer, sized for a typical entry.
    let mut b = Vec::with_capacity(11 + run.len() + 96);
    encode_into(&mut b, run, generation, pos, entry);
    b
}

/// [`encode`], appended to `b`: a caller that encodes one record after another (a run
/// journaling its steps) reuses one buffer rather than allocating (and growing) one per
/// record.
pub fn encode_into(b: &mut Vec<u8>, run: &str, generation: u32, pos: Option<u32>, entry: &Entry) {
    assert!(run.len() <= RUN_ID_MAX, "run ids are checked at start");
    b.push(FORMAT);
    b.extend_from_slice(&generation.to_le_bytes());
    b.extend_from_slice(&pos.map_or(u32::MAX, |p| p).to_le_bytes());
    b.push(run.len() as u8);
    b.extend_from_slice(run.as_bytes());
    write_entry(b, entry);
}

/// The entry's JSON, byte for byte what `serde_json::to_writer` gives (a test holds
/// every variant to that). The entries every run journals (its start, its steps, its
/// end) are written here; the rest go through serde. The reason is serde_json's string
/// escaping, which looks up every byte of every string in a table: it was a fifth of
/// the instructions of a run of no-op steps (docs/flow.md §4). A string with nothing to
/// escape, the usual case, is copied whole instead.
fn write_entry(b: &mut Vec<u8>, entry: &Entry) {
    match entry {
        Entry::Started {
            workflow,
            input,
            parent,
            consumed,
            cancel_seen,
        } => {
            b.extend_from_slice(br#"{"t":"started","workflow":"#);
            write_str(b, workflow);
            b.extend_from_slice(br#","input":"#);
            write_json(b, input);
            b.extend_from_slice(br#","parent":"#);
            match parent {
                Some(p) => write_str(b, p),
                None => b.extend_from_slice(b"null"),
            }
            if !consumed.is_empty() {
                b.extend_from_slice(br#","consumed":{"#);
                for (i, (name, n)) in consumed.iter().enumerate() {
                    if i > 0 {
                        b.push(b',');
                    }
                    write_str(b, name);
                    b.push(b':');
                    b.extend_from_slice(itoa::Buffer::new().format(*n).as_bytes());
                }
                b.push(b'}');
            }
            if *cancel_seen {
                b.extend_from_slice(br#","cancel_seen":true"#);
            }
            b.push(b'}');
        }
        Entry::Step {
            name,
            outcome,
            attempts,
        } => {
            b.extend_from_slice(br#"{"t":"step","name":"#);
            write_str(b, name);
            b.extend_from_slice(br#","outcome":"#);
            write_outcome(b, outcome);
            b.extend_from_slice(br#","attempts":"#);
            b.extend_from_slice(itoa::Buffer::new().format(*attempts).as_bytes());
            b.push(b'}');
        }
        Entry::Finished { outcome } => {
            b.extend_from_slice(br#"{"t":"finished","outcome":"#);
            write_outcome(b, outcome);
            b.push(b'}');
        }
        _ => serde_json::to_writer(b, entry).expect("entries always serialize"),
    }
}

fn write_outcome(b: &mut Vec<u8>, outcome: &Outcome) {
    match outcome {
        Outcome::Ok(v) => {
            b.extend_from_slice(br#"{"ok":"#);
            write_json(b, v);
            b.push(b'}');
        }
        Outcome::Err(e) => {
            b.extend_from_slice(br#"{"err":"#);
            write_str(b, e);
            b.push(b'}');
        }
        Outcome::Cancelled => b.extend_from_slice(br#""cancelled""#),
    }
}

fn write_json(b: &mut Vec<u8>, v: &Json) {
    match v {
        Json::Null => b.extend_from_slice(b"null"),
        Json::Bool(true) => b.extend_from_slice(b"true"),
        Json::Bool(false) => b.extend_from_slice(b"false"),
        Json::Number(n) => serde_json::to_writer(b, n).expect("numbers always serialize"),
        Json::String(s) => write_str(b, s),
        Json::Array(items) => {
            b.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    b.push(b',');
                }
                write_json(b, item);
            }
            b.push(b']');
        }
        Json::Object(fields) => {
            b.push(b'{');
            for (i, (k, item)) in fields.iter().enumerate() {
                if i > 0 {
                    b.push(b',');
                }
                write_str(b, k);
                b.push(b':');
                write_json(b, item);
            }
            b.push(b'}');
        }
    }
}

/// A JSON string: copied whole when no byte of it needs escaping (JSON escapes `"`,
/// `\` and the control bytes below 0x20, and serde_json nothing else), else serde's.
fn write_str(b: &mut Vec<u8>, s: &str) {
    // A fold with no early exit, which the compiler turns into 16 bytes at a time (SSE2).
    let plain = s.bytes().fold(true, |plain, c| {
        plain & (c >= 0x20) & (c != b'"') & (c != b'\\')
    });
    if plain {
        b.reserve(s.len() + 2);
        b.push(b'"');
        b.extend_from_slice(s.as_bytes());
        b.push(b'"');
    } else {
        serde_json::to_writer(b, s).expect("strings always serialize");
    }
}

impl Record {
    /// The bytes of the ferry-log record. Run ids longer than `RUN_ID_MAX` are refused
    /// before anything is written (`engine.start` checks).
    pub fn encode(&self) -> Vec<u8> {
        encode(&self.run, self.generation, self.pos, &self.entry)
    }

    pub fn decode(b: &[u8]) -> Result<Record, DecodeError> {
        let p = Record::peek(b)?;
        let entry =
            serde_json::from_slice(p.entry_json).map_err(|e| DecodeError::Entry(e.to_string()))?;
        Ok(Record {
            run: p.run.to_string(),
            generation: p.generation,
            pos: p.pos,
            entry,
        })
    }

    /// The header alone, and the entry's JSON unparsed (compaction reads every record).
    pub fn peek(b: &[u8]) -> Result<Peek<'_>, DecodeError> {
        if b.len() < 10 {
            return Err(DecodeError::Short);
        }
        if b[0] != FORMAT {
            return Err(DecodeError::Format(b[0]));
        }
        let generation = u32::from_le_bytes(b[1..5].try_into().expect("4 bytes"));
        let pos = u32::from_le_bytes(b[5..9].try_into().expect("4 bytes"));
        let n = b[9] as usize;
        let rest = &b[10..];
        if rest.len() < n {
            return Err(DecodeError::Short);
        }
        let run = std::str::from_utf8(&rest[..n]).map_err(|_| DecodeError::RunId)?;
        Ok(Peek {
            run,
            generation,
            pos: (pos != u32::MAX).then_some(pos),
            entry_json: &rest[n..],
        })
    }
}

/// A record's header, borrowed, with its entry still JSON.
#[derive(Clone, Copy, Debug)]
pub struct Peek<'a> {
    pub run: &'a str,
    pub generation: u32,
    pub pos: Option<u32>,
    pub entry_json: &'a [u8],
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn records_round_trip() {
        let records = [
            Record {
                run: "order-42".into(),
                generation: 0,
                pos: Some(0),
                entry: Entry::Started {
                    workflow: "checkout".into(),
                    input: json!({"sku": "a", "qty": 2}),
                    parent: None,
                    consumed: BTreeMap::from([("review".to_string(), 2)]),
                    cancel_seen: true,
                },
            },
            Record {
                run: "order-42".into(),
                generation: 3,
                pos: Some(7),
                entry: Entry::Step {
                    name: "charge".into(),
                    outcome: Outcome::Err("card declined".into()),
                    attempts: 5,
                },
            },
            Record {
                run: "r".into(),
                generation: 0,
                pos: None,
                entry: Entry::Signal {
                    name: "review".into(),
                    value: json!(true),
                    key: Some("req-1".into()),
                },
            },
        ];
        for r in records {
            assert_eq!(Record::decode(&r.encode()).unwrap(), r);
        }
    }

    /// `write_entry` writes some entries itself rather than through serde: if its bytes
    /// differed from serde's, records would still decode, but a format documented as
    /// serde's JSON would quietly be two. Every variant, and strings drawn from each kind
    /// of byte JSON treats apart, must come out as serde_json writes them.
    #[test]
    fn entries_are_written_as_serde_writes_them() {
        // xorshift: strings drawn from what JSON escapes, what it does not, and UTF-8.
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let pieces = [
            "a", "Z09", "\"", "\\", "\n", "\u{1}", "\u{1f}", " ", "\u{7f}", "é", "😀", "/",
        ];
        let text = |next: &mut dyn FnMut() -> u64, n: u64| -> String {
            let len = next() % n;
            (0..len)
                .map(|_| pieces[(next() % pieces.len() as u64) as usize])
                .collect()
        };
        // One of every variant, and each branch of the hand-written ones, whatever the
        // draws below give.
        let mut entries = vec![
            Entry::StepAttempt {
                name: "s".into(),
                attempt: 2,
                error: "e".into(),
                retry_at_ms: 9,
            },
            Entry::Value {
                kind: ValueKind::Uuid,
                value: json!("x"),
            },
            Entry::TimerSet { fire_at_ms: 1 },
            Entry::TimerFired,
            Entry::Signal {
                name: "n".into(),
                value: json!([]),
                key: None,
            },
            Entry::WaitStarted {
                name: "n".into(),
                deadline_ms: Some(3),
            },
            Entry::Waited {
                name: "n".into(),
                got: None,
            },
            Entry::ChildStarted {
                id: "c".into(),
                workflow: "w".into(),
            },
            Entry::ChildDone {
                outcome: Outcome::Ok(json!(1)),
            },
            Entry::Patch { id: "p".into() },
            Entry::CancelRequested,
            Entry::CancelSeen,
            Entry::TimerRefused { pending: 1, max: 1 },
            Entry::ContinuedAsNew { input: json!({}) },
            Entry::Parked { reason: "r".into() },
            Entry::Finished {
                outcome: Outcome::Cancelled,
            },
            Entry::Finished {
                outcome: Outcome::Ok(json!([[1, [2.5]], {"a": [true, null]}])),
            },
            Entry::Finished {
                outcome: Outcome::Err("no\n\"way\"".into()),
            },
            Entry::Step {
                name: "".into(),
                outcome: Outcome::Ok(json!(false)),
                attempts: u32::MAX,
            },
            Entry::Step {
                name: "s".into(),
                outcome: Outcome::Err("".into()),
                attempts: 0,
            },
            Entry::Step {
                name: "s".into(),
                outcome: Outcome::Cancelled,
                attempts: 1,
            },
            Entry::Started {
                workflow: "w".into(),
                input: json!(-7),
                parent: Some("p".into()),
                consumed: BTreeMap::from([("a".into(), 1), ("b\"".into(), 0)]),
                cancel_seen: true,
            },
            Entry::Started {
                workflow: "w".into(),
                input: json!(null),
                parent: None,
                consumed: BTreeMap::new(),
                cancel_seen: false,
            },
        ];
        for _ in 0..500 {
            let value = json!({
                text(&mut next, 6): [text(&mut next, 8), 1, -2, 3.5, u64::MAX, i64::MIN, 1e300, true, false, null],
                text(&mut next, 6): {text(&mut next, 4): {}, "e": [], "s": text(&mut next, 40)},
                "n": (next() % 1000) as f64 / 7.0,
            });
            let outcome = match next() % 3 {
                0 => Outcome::Ok(value.clone()),
                1 => Outcome::Err(text(&mut next, 30)),
                _ => Outcome::Cancelled,
            };
            entries.push(Entry::Started {
                workflow: text(&mut next, 10),
                input: value.clone(),
                parent: (next() % 2 == 0).then(|| text(&mut next, 10)),
                consumed: (0..next() % 3)
                    .map(|_| (text(&mut next, 8), next() as u32))
                    .collect(),
                cancel_seen: next() % 2 == 0,
            });
            entries.push(Entry::Step {
                name: text(&mut next, 12),
                outcome: outcome.clone(),
                attempts: next() as u32,
            });
            entries.push(Entry::Step {
                name: "noop".into(),
                outcome: Outcome::Ok(json!(text(&mut next, 64))),
                attempts: 1,
            });
            entries.push(Entry::Finished { outcome });
            entries.push(Entry::Signal {
                name: text(&mut next, 8),
                value,
                key: Some(text(&mut next, 8)),
            });
        }
        for entry in entries {
            let mut ours = Vec::new();
            write_entry(&mut ours, &entry);
            assert_eq!(ours, serde_json::to_vec(&entry).unwrap(), "{entry:?}");
        }
        // Every ASCII character, and a few beyond, inside a string: `write_str` must
        // judge plain exactly what serde_json does not escape.
        let chars = (0u8..0x80)
            .map(char::from)
            .chain(['\u{80}', '\u{2028}', '\u{fffd}']);
        for c in chars {
            let s = format!("a{c}b");
            let mut ours = Vec::new();
            write_str(&mut ours, &s);
            assert_eq!(ours, serde_json::to_vec(&s).unwrap(), "{c:?}");
        }
    }

    #[test]
    fn bad_bytes_are_named() {
        assert_eq!(Record::decode(&[1, 2]), Err(DecodeError::Short));
        let mut b = Record {
            run: "x".into(),
            generation: 0,
            pos: Some(1),
            entry: Entry::TimerFired,
        }
        .encode();
        b[0] = 9;
        assert_eq!(Record::decode(&b), Err(DecodeError::Format(9)));
        b[0] = FORMAT;
        let last = b.len() - 1;
        b[last] = b'!';
        assert!(matches!(Record::decode(&b), Err(DecodeError::Entry(_))));
    }
}
