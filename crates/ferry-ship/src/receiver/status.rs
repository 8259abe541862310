//! What a receiver shows of itself: status (live, or read from a directory no receiver
//! runs in) and Prometheus metrics.

use super::error::OfflineError;
use super::paths::{self, Paths};
use super::state::{Intent, Pos, StateFile};
use ferry_core::epoch::Epoch;
use ferry_core::metrics::{Exposition, Histogram};
use std::path::Path;

/// Receiver status, for `GET /status` and `ferry receive status`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ReceiverStatus {
    pub dir: String,
    pub uptime_secs: u64,
    pub replicas: Vec<ReplicaStatus>,
}

/// One replica's status.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ReplicaStatus {
    pub name: String,
    pub epoch: Epoch,
    pub generation: u64,
    pub seq: u64,
    pub page_size: u32,
    pub pages: u32,
    pub bytes: u64,
    pub promoted: bool,
    pub has_replica: bool,
    pub pending_part: u32,
    pub transactions: u64,
    pub page_bytes: u64,
    pub bases: u64,
    pub refusals: u64,
    /// Wall-clock ms of the last apply.
    pub last_apply_ms: Option<u64>,
    /// Shipper-observed commit time to apply time of the last applied transaction.
    pub lag_ms: Option<u64>,
    pub last_error: Option<String>,
}

/// Status read straight from a receiver directory, for `ferry receive status --dir` when
/// no receiver runs (safe while one does: each name is read under its flock).
pub fn offline_status(dir: &Path) -> Result<ReceiverStatus, OfflineError> {
    let names = paths::names_in(&dir.join(".ferry")).map_err(|source| OfflineError {
        dir: dir.to_path_buf(),
        source,
    })?;
    // Read-only: recovering here would write a record, and a running receiver would take
    // that for another process's change and drop the transaction it is receiving.
    let mut replicas = Vec::new();
    for name in names {
        let paths = Paths::new(dir, &name);
        let record = StateFile::open(&paths.state).map(|(_, r)| r.unwrap_or_default());
        let bytes = paths.replica_bytes();
        let (pos, last_error) = match record {
            Ok(r) if r.intent == Intent::None => (r.pos, None),
            Ok(r) => (
                r.pos,
                Some(
                    "the last transaction's outcome is resolved when the receiver starts"
                        .to_string(),
                ),
            ),
            Err(e) => (
                Pos::default(),
                Some(format!("cannot read the position record: {e}")),
            ),
        };
        replicas.push(ReplicaStatus {
            name,
            epoch: pos.epoch,
            generation: pos.generation,
            seq: pos.seq,
            page_size: pos.page_size,
            pages: if pos.page_size > 0 {
                (bytes.main / pos.page_size as u64) as u32
            } else {
                0
            },
            bytes: bytes.with_wal,
            promoted: pos.promoted(),
            has_replica: pos.has_replica(),
            pending_part: 0,
            transactions: 0,
            page_bytes: 0,
            bases: 0,
            refusals: 0,
            last_apply_ms: None,
            lag_ms: None,
            last_error,
        });
    }
    Ok(ReceiverStatus {
        dir: dir.display().to_string(),
        uptime_secs: 0,
        replicas,
    })
}

/// Prometheus text for a receiver's status and its apply latencies.
pub(super) fn metrics(status: &ReceiverStatus, apply_latency: &Histogram) -> String {
    let mut e = Exposition::new();
    type Field = fn(&ReplicaStatus) -> f64;
    let gauges: &[(&str, &str, Field)] = &[
        (
            "ferry_receive_seq",
            "Last applied transaction of the generation.",
            |r| r.seq as f64,
        ),
        (
            "ferry_receive_epoch",
            "Fencing epoch of the replica.",
            |r| r.epoch.0 as f64,
        ),
    ];
    for (name, help, f) in gauges {
        for r in &status.replicas {
            e.gauge(name, help, &[("db", &r.name)], f(r));
        }
    }
    type Count = fn(&ReplicaStatus) -> u64;
    let counters: &[(&str, &str, Count)] = &[
        (
            "ferry_receive_transactions_total",
            "Transactions applied.",
            |r| r.transactions,
        ),
        (
            "ferry_receive_page_bytes_total",
            "Page bytes applied.",
            |r| r.page_bytes,
        ),
        ("ferry_receive_bases_total", "Bases installed.", |r| r.bases),
        ("ferry_receive_refusals_total", "Requests refused.", |r| {
            r.refusals
        }),
    ];
    for (name, help, f) in counters {
        for r in &status.replicas {
            e.counter(name, help, &[("db", &r.name)], f(r));
        }
    }
    for r in &status.replicas {
        e.gauge(
            "ferry_receive_lag_seconds",
            "Time from the shipper seeing the last applied commit to its apply (clocks of two machines).",
            &[("db", &r.name)],
            r.lag_ms.unwrap_or(0) as f64 / 1000.0,
        );
    }
    e.histogram(
        "ferry_receive_apply_seconds",
        "Time to apply one txns request.",
        &[],
        apply_latency,
    );
    e.finish()
}
