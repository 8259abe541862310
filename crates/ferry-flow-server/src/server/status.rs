//! What the server shows: `/status` (JSON) and `/metrics` (Prometheus text).

use super::{Server, session_tag};
use std::sync::atomic::Ordering::Relaxed;

/// What `/status` answers (version 1): each shard's epoch, holder and records, each
/// worker, and the log's figures.
#[derive(Debug, serde::Serialize)]
pub struct Status {
    pub version: u32,
    pub shards: Vec<ShardStatus>,
    pub workers: Vec<WorkerStatus>,
    pub log: LogStatus,
}

#[derive(Debug, serde::Serialize)]
pub struct ShardStatus {
    pub shard: u32,
    pub epoch: u64,
    /// The holding session, in hex; none while free (or fenced after a revoke).
    pub holder: Option<String>,
    /// The holder was sent its grant: the epoch is durable (until then the shard is
    /// the holder's, but the holder does not know it yet).
    pub granted: bool,
    pub records: u64,
    pub durable: u64,
}

#[derive(Debug, serde::Serialize)]
pub struct WorkerStatus {
    pub session: String,
    pub name: String,
    pub connected: bool,
    pub shards: Vec<u32>,
}

#[derive(Debug, serde::Serialize)]
pub struct LogStatus {
    pub durable: u64,
    pub end: u64,
    pub segments: usize,
    pub syncs: u64,
    pub records: u64,
}

impl Server {
    /// The `/status` answer.
    pub fn status(&self) -> Status {
        let state = ferry_core::sync::lock(&self.inner.state);
        let shards = (0..self.inner.settings.shards)
            .map(|shard| {
                let (epoch, holder) = state.table.holder(shard);
                ShardStatus {
                    shard,
                    epoch,
                    holder: holder.map(session_tag),
                    granted: holder.is_some()
                        && !state.grants.iter().any(|g| g.2 == shard)
                        && !state.unsent.contains(&shard),
                    records: state.store.end(shard),
                    durable: state.store.durable(shard),
                }
            })
            .collect();
        let workers = state
            .table
            .sessions()
            .into_iter()
            .map(|(id, connected)| WorkerStatus {
                session: session_tag(id),
                name: state.names.get(&id).cloned().unwrap_or_default(),
                connected,
                shards: state.table.held_by(id).iter().map(|h| h.shard).collect(),
            })
            .collect();
        let st = self.inner.log.stats();
        Status {
            version: 1,
            shards,
            workers,
            log: LogStatus {
                durable: st.durable,
                end: st.end,
                segments: st.segments,
                syncs: st.syncs,
                records: st.records,
            },
        }
    }

    /// `/metrics`: Prometheus text (0.0.4).
    pub fn metrics(&self) -> String {
        let status = self.status();
        let c = &self.inner.counts;
        let held = status.shards.iter().filter(|s| s.holder.is_some()).count();
        let connected = status.workers.iter().filter(|w| w.connected).count();
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (labels, v) in samples {
                out.push_str(&format!("{name}{labels} {v}\n"));
            }
        };
        metric(
            "ferry_flow_server_shards",
            "gauge",
            "shards, and how many are held",
            &[
                ("{state=\"held\"}", held as u64),
                ("{state=\"free\"}", (status.shards.len() - held) as u64),
            ],
        );
        metric(
            "ferry_flow_server_workers",
            "gauge",
            "workers the lease table knows, connected or within their lease",
            &[
                ("{connected=\"true\"}", connected as u64),
                (
                    "{connected=\"false\"}",
                    (status.workers.len() - connected) as u64,
                ),
            ],
        );
        metric(
            "ferry_flow_server_grants_total",
            "counter",
            "shards granted at a new epoch",
            &[("", c.grants.load(Relaxed))],
        );
        metric(
            "ferry_flow_server_resumes_total",
            "counter",
            "shards a reconnecting worker resumed at the same epoch",
            &[("", c.resumes.load(Relaxed))],
        );
        metric(
            "ferry_flow_server_revokes_total",
            "counter",
            "shards taken from a worker, by reason",
            &[
                ("{reason=\"expired\"}", c.revokes_expired.load(Relaxed)),
                ("{reason=\"stuck\"}", c.revokes_stuck.load(Relaxed)),
                ("{reason=\"rebalance\"}", c.revokes_rebalance.load(Relaxed)),
            ],
        );
        metric(
            "ferry_flow_server_releases_total",
            "counter",
            "shards workers handed back",
            &[("", c.releases.load(Relaxed))],
        );
        metric(
            "ferry_flow_server_records_total",
            "counter",
            "records appended, and records sent again that were already held",
            &[
                ("{kind=\"new\"}", c.records.load(Relaxed)),
                ("{kind=\"again\"}", c.records_again.load(Relaxed)),
            ],
        );
        metric(
            "ferry_flow_server_refused_total",
            "counter",
            "requests refused: fenced (a stale epoch or a shard not held) or other",
            &[
                ("{kind=\"fenced\"}", c.refused_fenced.load(Relaxed)),
                ("{kind=\"other\"}", c.refused_other.load(Relaxed)),
            ],
        );
        metric(
            "ferry_flow_server_log_syncs_total",
            "counter",
            "syncs of the server's log (each covers every shard's records since the last)",
            &[("", status.log.syncs)],
        );
        metric(
            "ferry_flow_server_log_durable_bytes",
            "gauge",
            "the log's durable position",
            &[("", status.log.durable)],
        );
        out
    }
}
