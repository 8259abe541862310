//! Operating an engine from outside its process (docs/flow.md §7). The engine owns its
//! directory (the log's lock), so other processes never open the log: the engine keeps
//! a status file there, and takes requests (signal, cancel) dropped into `inbox/`,
//! answering each in `replies/`. A request left while no engine runs is applied when
//! the next one opens the directory.
//!
//! The status file is advisory: renamed into place (readers never see half of it) but
//! not fsynced, so it costs the log no disk syncs. The engine writes it when it opens,
//! when it closes, and when asked (`Request::Status`, which `ferry flow list` sends to
//! a running engine): nothing is spent on it while nobody looks.

use crate::journal::Json;
use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub const STATUS_FILE: &str = "status.json";
pub const INBOX: &str = "inbox";
pub const REPLIES: &str = "replies";

/// What `status.json` holds (the engine writes it from borrowed runs).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Status<R = RunView> {
    /// The engine's process.
    pub pid: u32,
    /// False once the engine closed (the last status it wrote).
    pub open: bool,
    pub written_ms: u64,
    /// How long opening took (log recovery and replay of every run's journal).
    pub recovery_ms: f64,
    pub recovered_records: u64,
    pub resumed: usize,
    pub log: LogView,
    pub runs: Vec<R>,
    /// `Engine::metrics` when the file was written (Prometheus text; `ferry flow
    /// metrics` prints it). Empty from an engine older than this field.
    #[serde(default)]
    pub metrics: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LogView {
    pub records: u64,
    pub syncs: u64,
    pub durable: u64,
    pub end: u64,
    pub segments: usize,
    /// Segments made from retired ones (ferry-log's spares) since the engine opened.
    #[serde(default)]
    pub segments_reused: u64,
    /// How long the log's writer took to write and sync what filled, p50 and p99 since
    /// the engine opened (upper bounds of power-of-two buckets, µs); absent before the
    /// first write. What the disk gives the engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_p50_us: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_p99_us: Option<u64>,
}

/// One run in the status file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunView {
    pub id: String,
    pub workflow: String,
    pub generation: u32,
    /// running, finished, failed, cancelled or parked.
    pub state: String,
    /// The output (finished), the error (failed) or the reason (parked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<Json>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// What the run last published (`ctx.publish`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub published: Option<Json>,
    pub pending_signals: usize,
}

/// A request to a running engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Signal {
        run: String,
        name: String,
        value: Json,
    },
    Cancel {
        run: String,
    },
    /// Write the status file now (the engine writes it only when asked, when it opens
    /// and when it closes: a status kept current all the time cost the shards 5× in
    /// p99 latency at 20,000 workflows/s).
    Status,
    /// Answer with the engine's metrics (Prometheus text) as the reply's message:
    /// unlike a status, it lists no runs, so it costs the same with a million of them.
    Metrics,
}

/// The engine's answer to one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    pub message: String,
}

/// Why the status, metrics or an answer of an engine directory could not be had.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// No engine ever opened the directory (or it is another kind of directory).
    #[error(
        "{} does not exist: no flow engine has opened {} (or it is another kind of \
         directory)", path.display(), dir.display()
    )]
    NoStatus { dir: PathBuf, path: PathBuf },
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// The status file is not what this build writes (damaged, or another version).
    #[error("{} does not parse: {reason}", path.display())]
    Unreadable { path: PathBuf, reason: String },
    /// The engine runs but did not answer in time (busy, or stopping): ask again.
    #[error("the engine (pid {pid}) did not answer within {timeout:?}")]
    NoAnswer { pid: u32, timeout: Duration },
    /// The engine answered with a refusal.
    #[error("the engine (pid {pid}): {message}")]
    Refused { pid: u32, message: String },
    /// The engine that last opened the directory wrote no metrics (it predates them).
    #[error("the engine that last opened {} wrote no metrics: it predates them", dir.display())]
    NoMetrics { dir: PathBuf },
}

impl ferry_core::Classify for AdminError {
    fn class(&self) -> ferry_core::Class {
        use ferry_core::Class;
        match self {
            AdminError::Io { source, .. } => source.class(),
            AdminError::NoAnswer { .. } => Class::Transient,
            AdminError::Unreadable { .. } => Class::Corrupted,
            AdminError::NoStatus { .. }
            | AdminError::Refused { .. }
            | AdminError::NoMetrics { .. } => Class::Permanent,
        }
    }
}

/// Read `dir`'s status file.
pub fn read_status(dir: &Path) -> Result<Status, AdminError> {
    let path = dir.join(STATUS_FILE);
    let bytes = std::fs::read(&path).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            AdminError::NoStatus {
                dir: dir.to_path_buf(),
                path: path.clone(),
            }
        } else {
            AdminError::Io {
                what: "read",
                path: path.clone(),
                source: e,
            }
        }
    })?;
    serde_json::from_slice(&bytes).map_err(|e| AdminError::Unreadable {
        path,
        reason: e.to_string(),
    })
}

/// Leave `req` in `dir`'s inbox, as [`send`] does, reporting where it failed.
fn ask(dir: &Path, req: &Request) -> Result<String, AdminError> {
    send(dir, req).map_err(|e| AdminError::Io {
        what: "leave a request in",
        path: dir.join(INBOX),
        source: e,
    })
}

/// The status of `dir`: fresh from its engine if one runs (asked for and waited up to
/// `timeout`), else the last one an engine wrote.
pub fn fresh_status(dir: &Path, timeout: Duration) -> Result<Status, AdminError> {
    let st = read_status(dir)?;
    if !engine_alive(&st) {
        return Ok(st);
    }
    let id = ask(dir, &Request::Status)?;
    match wait_reply(dir, &id, timeout) {
        Some(_) => read_status(dir),
        None => Err(AdminError::NoAnswer {
            pid: st.pid,
            timeout,
        }),
    }
}

/// The metrics of `dir`'s engine (Prometheus text), and whether they are fresh from a
/// running engine (asked for and waited up to `timeout`) or the last an engine wrote.
pub fn fresh_metrics(dir: &Path, timeout: Duration) -> Result<(String, bool), AdminError> {
    let st = read_status(dir)?;
    if !engine_alive(&st) {
        if st.metrics.is_empty() {
            return Err(AdminError::NoMetrics {
                dir: dir.to_path_buf(),
            });
        }
        return Ok((st.metrics, false));
    }
    let id = ask(dir, &Request::Metrics)?;
    match wait_reply(dir, &id, timeout) {
        Some(r) if r.ok => Ok((r.message, true)),
        Some(r) => Err(AdminError::Refused {
            pid: st.pid,
            message: r.message,
        }),
        None => Err(AdminError::NoAnswer {
            pid: st.pid,
            timeout,
        }),
    }
}

/// Is the engine that wrote `status` still running?
pub fn engine_alive(status: &Status) -> bool {
    // SAFETY: kill with signal 0 only checks that the process exists.
    status.open && unsafe { libc::kill(status.pid as libc::pid_t, 0) } == 0
}

/// Leave `req` in `dir`'s inbox (durably); returns its id, for [`wait_reply`].
pub fn send(dir: &Path, req: &Request) -> io::Result<String> {
    let inbox = dir.join(INBOX);
    std::fs::create_dir_all(&inbox)?;
    let id = format!(
        "{:020}-{}",
        ferry_core::seams::wall_ns(),
        std::process::id()
    );
    let bytes = serde_json::to_vec(req).expect("requests serialize");
    ferry_core::fs::write_atomic(&inbox.join(format!("{id}.json")), &bytes)?;
    Ok(id)
}

/// How long ago request `id` was made (its id starts with the time in ns).
pub(crate) fn age(id: &str) -> Duration {
    let made = id
        .split('-')
        .next()
        .and_then(|t| t.parse::<u128>().ok())
        .unwrap_or(0);
    let now = ferry_core::seams::wall_ns();
    Duration::from_nanos(now.saturating_sub(made).min(u64::MAX as u128) as u64)
}

/// Wait up to `timeout` for the reply to request `id`; takes it out of `replies/`.
pub fn wait_reply(dir: &Path, id: &str, timeout: Duration) -> Option<Reply> {
    let path = dir.join(REPLIES).join(format!("{id}.json"));
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(bytes) = std::fs::read(&path)
            && let Ok(reply) = serde_json::from_slice::<Reply>(&bytes)
        {
            let _ = std::fs::remove_file(&path);
            return Some(reply);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The requests waiting in `dir`'s inbox, oldest first (unreadable ones answered at
/// once with what is wrong).
pub(crate) fn pending(dir: &Path) -> Vec<(String, Result<Request, String>)> {
    let Ok(entries) = std::fs::read_dir(dir.join(INBOX)) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter_map(|n| n.strip_suffix(".json").map(str::to_string))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|id| {
            let path = dir.join(INBOX).join(format!("{id}.json"));
            let req = std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| {
                    serde_json::from_slice(&b)
                        .map_err(|e| format!("the request does not parse: {e}"))
                });
            (id, req)
        })
        .collect()
}

/// Answer request `id` and take it out of the inbox.
pub(crate) fn answer(dir: &Path, id: &str, reply: &Reply) -> io::Result<()> {
    let replies = dir.join(REPLIES);
    std::fs::create_dir_all(&replies)?;
    let bytes = serde_json::to_vec(reply).expect("replies serialize");
    write_quietly(&replies.join(format!("{id}.json")), &bytes)?;
    std::fs::remove_file(dir.join(INBOX).join(format!("{id}.json")))
}

/// Remove replies nobody collected (a CLI that timed out) once older than `age`.
pub(crate) fn prune_replies(dir: &Path, age: Duration) {
    let Ok(entries) = std::fs::read_dir(dir.join(REPLIES)) else {
        return;
    };
    for e in entries.filter_map(|e| e.ok()) {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|a| a > age);
        if old {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Write `bytes` to `path` through a rename, without syncing (advisory files only).
pub(crate) fn write_quietly(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut tmp: PathBuf = path.to_path_buf();
    tmp.set_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
