//! What a shipper shows of itself: its status, each database's, Prometheus metrics, and
//! the saved state read from a directory no shipper runs in.

use super::error::OfflineError;
use crate::ship_state::{ShipState, StateError};
use ferry_core::epoch::Epoch;
use ferry_core::metrics::Exposition;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// Status of a shipper.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShipperStatus {
    pub dir: String,
    pub peer: String,
    pub uptime_secs: u64,
    pub databases: Vec<DbStatus>,
}

/// Status of one shipped database.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct DbStatus {
    pub name: String,
    /// idle, shipping, base owed, sending base, retrying, fenced, error, gone.
    pub state: String,
    pub epoch: Epoch,
    pub generation: u64,
    pub acked_seq: u64,
    pub head_seq: u64,
    pub lag_transactions: u64,
    /// WAL bytes of the transactions not yet acknowledged.
    pub lag_bytes: u64,
    /// Age of the oldest transaction not yet acknowledged.
    pub lag_seconds: f64,
    pub wal_bytes: u64,
    /// Consecutive failed steps.
    pub failures: u32,
    pub last_error: Option<String>,
    /// Bases sent, by reason.
    pub bases: BTreeMap<String, u64>,
    pub folds: u64,
    pub transactions_shipped: u64,
    pub body_bytes_shipped: u64,
    pub page_bytes_shipped: u64,
    pub base_bytes_shipped: u64,
    /// Bytes sent and total of a base in flight.
    pub base_progress: Option<(u64, u64)>,
    pub last_ack_ms: Option<u64>,
    /// Steps run since the database was opened for shipping.
    #[serde(default)]
    pub steps: u64,
    /// Scans that stopped at a valid commit SQLite had not published (one being
    /// published, or one whose writer died in it) and left it alone (docs/ship.md §3.2).
    #[serde(default)]
    pub unpublished_seen: u64,
}

/// Prometheus text for a shipper's status.
pub fn metrics(status: &ShipperStatus) -> String {
    let mut e = Exposition::new();
    type Field = fn(&DbStatus) -> f64;
    let gauges: &[(&str, &str, Field)] = &[
        (
            "ferry_ship_lag_transactions",
            "Transactions committed but not acknowledged.",
            |d| d.lag_transactions as f64,
        ),
        (
            "ferry_ship_lag_bytes",
            "WAL bytes of transactions not acknowledged.",
            |d| d.lag_bytes as f64,
        ),
        (
            "ferry_ship_lag_seconds",
            "Age of the oldest transaction not acknowledged.",
            |d| d.lag_seconds,
        ),
        (
            "ferry_ship_wal_bytes",
            "Size of the primary's WAL file.",
            |d| d.wal_bytes as f64,
        ),
        (
            "ferry_ship_epoch",
            "Fencing epoch the database ships with.",
            |d| d.epoch.0 as f64,
        ),
        (
            "ferry_ship_acked_seq",
            "Last transaction the receiver acknowledged.",
            |d| d.acked_seq as f64,
        ),
        ("ferry_ship_failures", "Consecutive failed steps.", |d| {
            d.failures as f64
        }),
        (
            "ferry_ship_fenced",
            "1 if the receiver fenced this primary.",
            |d| (d.state == "fenced") as u8 as f64,
        ),
    ];
    for (name, help, f) in gauges {
        for d in &status.databases {
            e.gauge(name, help, &[("db", &d.name)], f(d));
        }
    }
    let counters: &[(&str, &str, Field)] = &[
        (
            "ferry_ship_transactions_total",
            "Transactions acknowledged by the receiver.",
            |d| d.transactions_shipped as f64,
        ),
        (
            "ferry_ship_body_bytes_total",
            "Bytes of txns request bodies acknowledged.",
            |d| d.body_bytes_shipped as f64,
        ),
        ("ferry_ship_base_bytes_total", "Bytes of bases sent.", |d| {
            d.base_bytes_shipped as f64
        }),
        ("ferry_ship_folds_total", "WAL folds completed.", |d| {
            d.folds as f64
        }),
    ];
    for (name, help, f) in counters {
        for d in &status.databases {
            e.counter(name, help, &[("db", &d.name)], f(d) as u64);
        }
    }
    for d in &status.databases {
        for (reason, n) in &d.bases {
            e.counter(
                "ferry_ship_bases_total",
                "Bases sent, by reason.",
                &[("db", &d.name), ("reason", reason)],
                *n,
            );
        }
    }
    e.finish()
}

/// A database's name and its saved state (or why it could not be read).
pub type SavedState = (String, Result<ShipState, StateError>);

/// The on-disk view of a shipper directory, for `ferry ship status` without a running
/// shipper: each database's persisted state.
pub fn offline_status(dir: &Path) -> Result<Vec<SavedState>, OfflineError> {
    let state_dir = dir.join(".ferry-ship");
    let rd = std::fs::read_dir(&state_dir).map_err(|source| OfflineError {
        dir: dir.to_path_buf(),
        source,
    })?;
    let mut out: Vec<_> = rd
        .flatten()
        .filter_map(|e| {
            let f = e.file_name();
            let name = f.to_str()?.strip_suffix(".json")?.to_string();
            crate::names::validate(&name).ok()?;
            let path = e.path();
            let st = crate::ship_state::load(&path).and_then(|s| {
                // Listed a moment ago, gone now: say so as a read that found nothing.
                s.ok_or_else(|| StateError::Read {
                    path,
                    source: std::io::ErrorKind::NotFound.into(),
                })
            });
            Some((name, st))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}
