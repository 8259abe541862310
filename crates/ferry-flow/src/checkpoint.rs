//! Compaction and retention (docs/flow.md §5). Everything the log holds before a
//! position is folded into a checkpoint file: the records replay needs for every
//! unfinished run (its current generation's, and every arrival), and the outcome of
//! every run finished within the retention period. Once the checkpoint is durable, the
//! log's segments below that position are retired. Open loads the newest checkpoint and
//! reads the log from its position.
//!
//! File `checkpoint-<lsn, 20 digits>`, written whole through a rename with fsyncs:
//! magic `FERRYCKP`, format (u32), lsn (u64), finished runs as JSON (u32 length, bytes),
//! active records (u32 count, then each as u32 length and the journal record's bytes,
//! exactly as the log carried them), CRC32C of everything before it (u32). All integers
//! little-endian.

use crate::journal::{DecodeError, Entry, Outcome, Record};
use ferry_log::Lsn;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"FERRYCKP";

/// Why a checkpoint, or a record folded into one, cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("not a ferry-flow checkpoint")]
    NotACheckpoint,
    #[error("its checksum does not match (damaged)")]
    Checksum,
    #[error("format {0}; this build reads format {FORMAT}")]
    Format(u32),
    #[error("it is cut short")]
    Short,
    #[error("bytes after the last record")]
    Trailing,
    #[error("its finished runs do not parse: {0}")]
    Finished(serde_json::Error),
    #[error("a record that looks finished does not decode as such")]
    NotFinished,
    #[error("run {run:?}: {source}")]
    Record { run: String, source: DecodeError },
    #[error(transparent)]
    Decode(#[from] DecodeError),
}
const FORMAT: u32 = 1;
const PREFIX: &str = "checkpoint-";

/// A finished run kept for the retention period.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Done {
    pub workflow: String,
    pub parent: Option<String>,
    pub generation: u32,
    pub outcome: Outcome,
    /// When compaction first saw it finished (ms since the epoch): retention counts
    /// from here.
    pub finished_ms: u64,
    /// The keys of keyed signals it received: a sender retrying one after the run
    /// finished is told it was delivered. (Absent in checkpoints written before keys
    /// were kept: those runs answer such a retry as undelivered.)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<String>,
}

/// An unfinished run's records that replay needs.
#[derive(Debug, Default)]
pub(crate) struct Active {
    generation: u32,
    records: Vec<Vec<u8>>,
}

/// Everything the log held before `lsn`, folded.
#[derive(Debug, Default)]
pub(crate) struct Folded {
    pub lsn: Lsn,
    pub active: BTreeMap<String, Active>,
    pub finished: BTreeMap<String, Done>,
}

impl Folded {
    /// Fold one journal record (a ferry-log payload of kind `RECORD_KIND`).
    pub fn fold(&mut self, payload: &[u8], now_ms: u64) -> Result<(), CheckpointError> {
        let rec = Record::peek(payload)?;
        if self.finished.contains_key(rec.run) {
            // Nothing reaches a finished run (signals and cancellations are refused).
            return Ok(());
        }
        let a = self.active.entry(rec.run.to_string()).or_default();
        if let Some(_pos) = rec.pos {
            if rec.generation > a.generation {
                // A new generation: the previous one's positions are never replayed.
                a.records
                    .retain(|r| Record::peek(r).is_ok_and(|p| p.pos.is_none()));
                a.generation = rec.generation;
            } else if rec.generation < a.generation {
                return Ok(());
            }
        }
        if rec.entry_json.starts_with(br#"{"t":"finished""#) {
            let Entry::Finished { outcome } = Record::decode(payload)?.entry else {
                return Err(CheckpointError::NotFinished);
            };
            let generation = a.generation;
            let started = a.records.iter().find_map(|r| {
                let r = Record::decode(r).ok()?;
                (r.pos == Some(0) && r.generation == generation).then_some(r.entry)
            });
            let (workflow, parent) = match started {
                Some(Entry::Started {
                    workflow, parent, ..
                }) => (workflow, parent),
                _ => ("?".to_string(), None),
            };
            let keys = a
                .records
                .iter()
                .filter_map(|r| match Record::decode(r).ok()?.entry {
                    Entry::Signal { key, .. } => key,
                    _ => None,
                })
                .collect();
            let run = rec.run.to_string();
            self.active.remove(&run);
            self.finished.insert(
                run,
                Done {
                    workflow,
                    parent,
                    generation,
                    outcome,
                    finished_ms: now_ms,
                    keys,
                },
            );
            return Ok(());
        }
        a.records.push(payload.to_vec());
        Ok(())
    }

    /// Forget finished runs older than `retention_ms`; their ids. A child whose parent
    /// is unfinished is kept: the parent's replay waits for its outcome.
    pub fn expire(&mut self, now_ms: u64, retention_ms: u64) -> Vec<String> {
        let old: Vec<String> = self
            .finished
            .iter()
            .filter(|(_, d)| now_ms.saturating_sub(d.finished_ms) >= retention_ms)
            .filter(|(_, d)| {
                d.parent
                    .as_ref()
                    .is_none_or(|p| !self.active.contains_key(p))
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in &old {
            self.finished.remove(id);
        }
        old
    }

    /// Every active run's records, decoded, by run.
    pub fn active_records(&self) -> Result<BTreeMap<String, Vec<Record>>, CheckpointError> {
        let mut out = BTreeMap::new();
        for (run, a) in &self.active {
            let recs = a
                .records
                .iter()
                .map(|r| {
                    Record::decode(r).map_err(|source| CheckpointError::Record {
                        run: run.clone(),
                        source,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            out.insert(run.clone(), recs);
        }
        Ok(out)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&FORMAT.to_le_bytes());
        b.extend_from_slice(&self.lsn.to_le_bytes());
        let finished = serde_json::to_vec(&self.finished).expect("outcomes serialize");
        b.extend_from_slice(&(finished.len() as u32).to_le_bytes());
        b.extend_from_slice(&finished);
        let count: usize = self.active.values().map(|a| a.records.len()).sum();
        b.extend_from_slice(&(count as u32).to_le_bytes());
        for r in self.active.values().flat_map(|a| &a.records) {
            b.extend_from_slice(&(r.len() as u32).to_le_bytes());
            b.extend_from_slice(r);
        }
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Folded, CheckpointError> {
        if b.len() < 8 + 4 + 8 + 4 + 4 + 4 || &b[..8] != MAGIC {
            return Err(CheckpointError::NotACheckpoint);
        }
        let (body, crc) = b.split_at(b.len() - 4);
        if crc32c::crc32c(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(CheckpointError::Checksum);
        }
        let mut r = Reader { b: body, at: 8 };
        let format = r.u32()?;
        if format != FORMAT {
            return Err(CheckpointError::Format(format));
        }
        let lsn = r.u64()?;
        let n = r.u32()? as usize;
        let finished = serde_json::from_slice(r.take(n)?).map_err(CheckpointError::Finished)?;
        let mut folded = Folded {
            lsn,
            active: BTreeMap::new(),
            finished,
        };
        for _ in 0..r.u32()? {
            let n = r.u32()? as usize;
            let rec = r.take(n)?;
            let p = Record::peek(rec)?;
            let a = folded.active.entry(p.run.to_string()).or_default();
            if p.pos.is_some() {
                a.generation = a.generation.max(p.generation);
            }
            a.records.push(rec.to_vec());
        }
        if r.at != body.len() {
            return Err(CheckpointError::Trailing);
        }
        Ok(folded)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CheckpointError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end = end.ok_or(CheckpointError::Short)?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, CheckpointError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, CheckpointError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

/// A shard's checkpoint on the flow server (docs/flow-server.md §7): an embedded
/// engine's fold and file, its position a place in the shard's stream of records (the
/// count of records it covers) rather than in a log.
#[derive(Debug, Default)]
pub struct ShardCheckpoint {
    pub(crate) folded: Folded,
}

impl ShardCheckpoint {
    pub fn decode(bytes: &[u8]) -> Result<ShardCheckpoint, CheckpointError> {
        Folded::decode(bytes).map(|folded| ShardCheckpoint { folded })
    }

    pub fn encode(&self) -> Vec<u8> {
        self.folded.encode()
    }

    /// How many of the shard's records it covers.
    pub fn position(&self) -> u64 {
        self.folded.lsn
    }

    /// Fold the shard's record at `position` (the next one: records before it are in).
    pub fn fold(
        &mut self,
        position: u64,
        kind: u8,
        payload: &[u8],
        now_ms: u64,
    ) -> Result<(), CheckpointError> {
        if kind == crate::journal::RECORD_KIND {
            self.folded.fold(payload, now_ms)?;
        }
        self.folded.lsn = position + 1;
        Ok(())
    }

    /// Pass over the shard's record at `position` without folding it (it did not fold).
    pub fn skip(&mut self, position: u64) {
        self.folded.lsn = position + 1;
    }

    /// Forget runs finished longer than `retention_ms` ago; their ids.
    pub fn expire(&mut self, now_ms: u64, retention_ms: u64) -> Vec<String> {
        self.folded.expire(now_ms, retention_ms)
    }

    /// The unfinished runs' records it keeps, as the log carried them.
    pub fn active_records(&self) -> impl Iterator<Item = &[u8]> {
        self.folded
            .active
            .values()
            .flat_map(|a| a.records.iter().map(Vec::as_slice))
    }

    /// The finished runs it keeps: id, workflow, parent, generation, outcome.
    pub fn finished(&self) -> impl Iterator<Item = (&str, &str, Option<&str>, u32, &Outcome)> {
        self.folded.finished.iter().map(|(id, d)| {
            (
                id.as_str(),
                d.workflow.as_str(),
                d.parent.as_deref(),
                d.generation,
                &d.outcome,
            )
        })
    }

    /// Where the checkpoint of `position` lives in `dir`.
    pub fn path(dir: &Path, position: u64) -> PathBuf {
        path(dir, position)
    }

    /// Remove what writes a crash cut short left in `dir`.
    pub fn remove_leftovers(dir: &Path) {
        remove_leftovers(dir)
    }

    /// The checkpoints in `dir` (a missing one: none), oldest first.
    pub fn list(dir: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
        match list(dir) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            r => r,
        }
    }
}

pub(crate) fn path(dir: &Path, lsn: Lsn) -> PathBuf {
    dir.join(format!("{PREFIX}{lsn:020}"))
}

/// Remove temporary files of checkpoint writes a crash cut short.
pub(crate) fn remove_leftovers(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(|e| e.ok()) {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(PREFIX) && name.contains(".tmp-") {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The checkpoints in `dir`, oldest first.
pub(crate) fn list(dir: &Path) -> std::io::Result<Vec<(Lsn, PathBuf)>> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let Some(name) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if let Some(lsn) = name
            .strip_prefix(PREFIX)
            .filter(|d| d.len() == 20)
            .and_then(|d| d.parse::<Lsn>().ok())
        {
            v.push((lsn, e.path()));
        }
    }
    v.sort();
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(run: &str, generation: u32, pos: Option<u32>, entry: Entry) -> Vec<u8> {
        Record {
            run: run.into(),
            generation,
            pos,
            entry,
        }
        .encode()
    }

    fn started(run: &str, generation: u32) -> Vec<u8> {
        rec(
            run,
            generation,
            Some(0),
            Entry::Started {
                workflow: "w".into(),
                input: json!(generation),
                parent: None,
                consumed: Default::default(),
                cancel_seen: false,
            },
        )
    }

    #[test]
    fn folding_keeps_what_replay_needs_and_round_trips() {
        let mut f = Folded::default();
        let signal = rec(
            "a",
            0,
            None,
            Entry::Signal {
                name: "s".into(),
                value: json!(1),
                key: Some("k".into()),
            },
        );
        for r in [
            started("a", 0),
            rec("a", 0, Some(1), Entry::TimerFired),
            signal.clone(),
            started("a", 1),
            started("b", 0),
            rec(
                "b",
                0,
                Some(1),
                Entry::Finished {
                    outcome: Outcome::Ok(json!("done")),
                },
            ),
        ] {
            f.fold(&r, 1_000).unwrap();
        }
        f.lsn = 4096;
        // a: generation 1 only, plus every arrival; b: finished.
        assert_eq!(f.active["a"].records, vec![signal, started("a", 1)]);
        assert_eq!(f.finished["b"].outcome, Outcome::Ok(json!("done")));
        assert_eq!(f.finished["b"].workflow, "w");
        let back = Folded::decode(&f.encode()).unwrap();
        assert_eq!(back.lsn, 4096);
        assert_eq!(back.active["a"].records, f.active["a"].records);
        assert_eq!(back.active["a"].generation, 1);
        assert_eq!(back.finished, f.finished);

        let mut bytes = f.encode();
        bytes[30] ^= 1;
        assert!(matches!(
            Folded::decode(&bytes),
            Err(CheckpointError::Checksum)
        ));
        assert_eq!(f.expire(1_000 + 59, 60), Vec::<String>::new());
        assert_eq!(f.expire(1_000 + 60, 60), vec!["b".to_string()]);
    }

    /// A finished run keeps the keys of the keyed signals it received (a retried
    /// `signal_once` is told it was delivered), and a checkpoint written before keys
    /// were kept still reads (as a run that keeps none).
    #[test]
    fn a_finished_run_keeps_its_signal_keys_and_old_checkpoints_still_read() {
        let mut f = Folded::default();
        let signal = |key: Option<&str>| {
            rec(
                "a",
                0,
                None,
                Entry::Signal {
                    name: "s".into(),
                    value: json!(1),
                    key: key.map(str::to_string),
                },
            )
        };
        for r in [
            started("a", 0),
            signal(Some("k1")),
            signal(None),
            signal(Some("k2")),
            rec(
                "a",
                0,
                Some(1),
                Entry::Finished {
                    outcome: Outcome::Ok(json!(null)),
                },
            ),
        ] {
            f.fold(&r, 1_000).unwrap();
        }
        assert_eq!(f.finished["a"].keys, vec!["k1".to_string(), "k2".into()]);
        let back = Folded::decode(&f.encode()).unwrap();
        assert_eq!(back.finished["a"].keys, f.finished["a"].keys);
        let old: BTreeMap<String, Done> = serde_json::from_str(
            r#"{"x":{"workflow":"w","parent":null,"generation":0,"outcome":{"ok":null},"finished_ms":5}}"#,
        )
        .unwrap();
        assert!(old["x"].keys.is_empty());
    }
}
