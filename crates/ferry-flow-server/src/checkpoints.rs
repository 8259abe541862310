//! Each shard's checkpoint on the server, and retiring the log below them
//! (docs/flow-server.md §7).
//!
//! One fold per shard (`ferry_flow::ShardCheckpoint`: the embedded engine's rules, its
//! position a count of the shard's records) is kept in memory. A compaction:
//!
//! 1. reads the log's durable records once, from where the last compaction stopped, and
//!    folds each into its shard's fold (a record that does not fold is skipped and
//!    reported: it could not be replayed either);
//! 2. for each shard whose fold moved (or that a failed compaction left unwritten):
//!    expires its runs finished longer than `retention` ago and writes it whole to a
//!    new file, `DIR/shards/<k>/checkpoint-<position>` (atomically; a file is never
//!    rewritten, and the one before it is kept for a fetch under way);
//! 3. writes the shape and epochs (`DIR/shards/epochs`);
//! 4. retires the log's segments below where step 1 read.
//!
//! A crash before step 4 retires nothing: the next compaction, or the next start, reads
//! those records again and skips what a checkpoint holds. A failure of a step leaves
//! the rest undone (retried later): nothing is retired that is not on disk.
//! Directories are created and made durable at open.

use crate::store::Kept;
use ferry_flow::log::{Error as LogError, Log, Lsn};
use ferry_flow::{CheckpointError, ShardCheckpoint};
use std::path::{Path, PathBuf};

/// Why a compaction or an open of the checkpoints failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointsError {
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} is damaged: {source}; restore the server's directory from a copy", path.display())]
    Damaged {
        path: PathBuf,
        source: CheckpointError,
    },
    #[error("{} is damaged: {reason}; restore the server's directory from a copy", path.display())]
    Kept { path: PathBuf, reason: String },
    #[error(
        "shard {shard}'s record at log position {lsn} is its {position}th, where the {expected}th was next"
    )]
    Gap {
        shard: u32,
        lsn: Lsn,
        position: u64,
        expected: u64,
    },
    #[error(transparent)]
    Log(#[from] LogError),
}

/// Every shard's checkpoint (module doc).
pub struct Checkpoints {
    dir: PathBuf,
    folds: Vec<ShardCheckpoint>,
    /// The position of each shard's checkpoint on disk.
    written: Vec<u64>,
    /// Every shard's durable records before this position in the log are folded.
    read: Lsn,
}

/// What a compaction did.
#[derive(Debug, Default)]
pub struct Compacted {
    /// The shards whose checkpoint moved, and to which position.
    pub moved: Vec<(u32, u64)>,
    /// Where the records not folded begin in the log.
    pub read: Lsn,
    /// Runs finished longer than the retention ago, forgotten.
    pub expired: Vec<String>,
    /// Records that did not fold (shard, position), left out.
    pub skipped: Vec<(u32, u64)>,
}

impl Checkpoints {
    /// Load each shard's newest checkpoint from `dir` (`DIR/shards`, created durably if
    /// new); `start` is where the log now starts (records before it are in the
    /// checkpoints).
    pub fn open(dir: &Path, shards: u32, start: Lsn) -> Result<Checkpoints, CheckpointsError> {
        let io = |what, path: &Path| {
            let path = path.to_path_buf();
            move |source| CheckpointsError::Io { what, path, source }
        };
        if !dir.join(format!("{}", shards - 1)).is_dir() {
            for k in 0..shards {
                std::fs::create_dir_all(shard_dir(dir, k)).map_err(io("create", dir))?;
            }
            ferry_core::fs::fsync_dir(dir).map_err(io("sync", dir))?;
            let parent = ferry_core::fs::parent_dir(dir);
            ferry_core::fs::fsync_dir(&parent).map_err(io("sync", &parent))?;
        }
        let mut folds = Vec::with_capacity(shards as usize);
        for k in 0..shards {
            let sdir = shard_dir(dir, k);
            ShardCheckpoint::remove_leftovers(&sdir);
            let found = ShardCheckpoint::list(&sdir).map_err(|source| CheckpointsError::Io {
                what: "list",
                path: sdir.clone(),
                source,
            })?;
            let fold = match found.last() {
                None => ShardCheckpoint::default(),
                Some((position, path)) => {
                    let bytes = std::fs::read(path).map_err(|source| CheckpointsError::Io {
                        what: "read",
                        path: path.clone(),
                        source,
                    })?;
                    let fold = ShardCheckpoint::decode(&bytes).map_err(|source| {
                        CheckpointsError::Damaged {
                            path: path.clone(),
                            source,
                        }
                    })?;
                    if fold.position() != *position {
                        return Err(CheckpointsError::Kept {
                            path: path.clone(),
                            reason: format!(
                                "its name says {position}, its content {}",
                                fold.position()
                            ),
                        });
                    }
                    fold
                }
            };
            folds.push(fold);
        }
        Ok(Checkpoints {
            dir: dir.to_path_buf(),
            written: folds.iter().map(ShardCheckpoint::position).collect(),
            folds,
            read: start,
        })
    }

    /// Where each shard's checkpoint ends.
    pub fn bases(&self) -> Vec<u64> {
        self.folds.iter().map(ShardCheckpoint::position).collect()
    }

    pub fn shard(&self, k: u32) -> &ShardCheckpoint {
        &self.folds[k as usize]
    }

    /// Fold what the log made durable since the last compaction (up to `upto`: with a
    /// replicated log, what the stream has too), expire finished runs
    /// older than `retention_ms`, and write the checkpoints that changed. The caller
    /// writes the epochs ([`write_kept`]) and then retires the log below `read`.
    pub fn compact(
        &mut self,
        log: &Log,
        upto: Lsn,
        now_ms: u64,
        retention_ms: u64,
    ) -> Result<Compacted, CheckpointsError> {
        let mut bad = None;
        let mut skipped = Vec::new();
        let folds = &mut self.folds;
        // Where the records folded end (a record past `upto` stops the read unread).
        let mut read = self.read;
        log.read_while(self.read, |r| {
            if r.end > upto {
                return false;
            }
            read = r.end;
            if r.kind != crate::store::SHARD_RECORD || r.payload.len() < 21 || bad.is_some() {
                return true;
            }
            let p = r.payload;
            let shard = u32::from_be_bytes(p[..4].try_into().expect("4 bytes"));
            let position = u64::from_be_bytes(p[12..20].try_into().expect("8 bytes"));
            let Some(fold) = folds.get_mut(shard as usize) else {
                return true;
            };
            // Folded before (the log kept the segment it shares with newer records).
            if position < fold.position() {
                return true;
            }
            if position > fold.position() {
                bad = Some(CheckpointsError::Gap {
                    shard,
                    lsn: r.lsn,
                    position,
                    expected: fold.position(),
                });
                return true;
            }
            if let Err(e) = fold.fold(position, p[20], &p[21..], now_ms) {
                // Nothing could replay it either: skipped, so that the log does not
                // grow for ever behind it.
                tracing::error!(shard, lsn = r.lsn, error = %e, "ferry flow server: a record that does not fold is left out of the shard's checkpoint");
                skipped.push((shard, position));
                fold.skip(position);
            }
            true
        })?;
        if let Some(e) = bad {
            return Err(e);
        }
        let mut done = Compacted {
            read,
            skipped,
            ..Compacted::default()
        };
        for (k, fold) in self.folds.iter_mut().enumerate() {
            let position = fold.position();
            // A file is never rewritten: expiry waits for the shard's next records.
            if position == self.written[k] {
                continue;
            }
            done.expired.extend(fold.expire(now_ms, retention_ms));
            let sdir = shard_dir(&self.dir, k as u32);
            std::fs::create_dir_all(&sdir).map_err(|source| CheckpointsError::Io {
                what: "create",
                path: sdir.clone(),
                source,
            })?;
            let path = ShardCheckpoint::path(&sdir, position);
            ferry_core::fs::write_atomic(&path, &fold.encode()).map_err(|source| {
                CheckpointsError::Io {
                    what: "write",
                    path: path.clone(),
                    source,
                }
            })?;
            // The one before it stays, for a fetch under way; older ones go.
            if let Ok(found) = ShardCheckpoint::list(&sdir) {
                let n = found.len();
                for (_, old) in found.into_iter().take(n.saturating_sub(2)) {
                    let _ = std::fs::remove_file(old);
                }
            }
            self.written[k] = position;
            done.moved.push((k as u32, position));
        }
        self.read = read;
        Ok(done)
    }
}

fn shard_dir(dir: &Path, k: u32) -> PathBuf {
    dir.join(k.to_string())
}

/// The file of shard `k`'s checkpoint at `position` under `dir` (`DIR/shards`).
pub fn path(dir: &Path, k: u32, position: u64) -> PathBuf {
    ShardCheckpoint::path(&shard_dir(dir, k), position)
}

/// The file that keeps the shape and epochs beside the log.
pub fn kept_path(dir: &Path) -> PathBuf {
    dir.join("epochs")
}

/// Write the shape and epochs (before the log's segments that hold their records are
/// retired): one line `shards N`, then one per shard `EPOCH HOLDER` (32 hex digits,
/// or `-`).
pub fn write_kept(dir: &Path, kept: &Kept) -> Result<(), CheckpointsError> {
    let mut text = format!("shards {}\n", kept.shards);
    for (epoch, holder) in &kept.epochs {
        match holder {
            Some(h) => text.push_str(&format!("{epoch} {h:032x}\n")),
            None => text.push_str(&format!("{epoch} -\n")),
        }
    }
    let path = kept_path(dir);
    std::fs::create_dir_all(dir).map_err(|source| CheckpointsError::Io {
        what: "create",
        path: dir.to_path_buf(),
        source,
    })?;
    ferry_core::fs::write_atomic(&path, text.as_bytes()).map_err(|source| CheckpointsError::Io {
        what: "write",
        path,
        source,
    })
}

/// Read what [`write_kept`] wrote; `None` if it never did.
pub fn read_kept(dir: &Path) -> Result<Option<Kept>, CheckpointsError> {
    let path = kept_path(dir);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CheckpointsError::Io {
                what: "read",
                path,
                source,
            });
        }
    };
    let bad = |reason: &str| CheckpointsError::Kept {
        path: path.clone(),
        reason: reason.to_string(),
    };
    let mut lines = text.lines();
    let shards: u32 = lines
        .next()
        .and_then(|l| l.strip_prefix("shards "))
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| bad("its first line is not `shards N`"))?;
    let mut epochs = Vec::new();
    for line in lines {
        let (epoch, holder) = line
            .split_once(' ')
            .ok_or_else(|| bad("a line is not `EPOCH HOLDER`"))?;
        let epoch: u64 = epoch.parse().map_err(|_| bad("an epoch is not a number"))?;
        let holder = match holder {
            "-" => None,
            h => Some(u128::from_str_radix(h, 16).map_err(|_| bad("a holder is not hex"))?),
        };
        epochs.push((epoch, holder));
    }
    if epochs.len() != shards as usize {
        return Err(bad("it does not list every shard"));
    }
    Ok(Some(Kept { shards, epochs }))
}
