//! What the engine counts, rendered as Prometheus text by [`crate::Engine::metrics`]
//! (docs/flow.md §7). Counters run from the engine's open; the gauge of runs by state
//! is kept as runs change state, so a scrape never walks the runs map.

use crate::api::{Recovery, RunStatus};
use crate::journal::Outcome;
use ferry_core::metrics::Exposition;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Where a run stands, as the `state` label says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum State {
    Running,
    Parked,
    Finished,
    Failed,
    Cancelled,
}

impl State {
    const ALL: [State; 5] = [
        State::Running,
        State::Parked,
        State::Finished,
        State::Failed,
        State::Cancelled,
    ];

    pub(crate) fn of(s: &RunStatus) -> State {
        match s {
            RunStatus::Running => State::Running,
            RunStatus::Parked(_) => State::Parked,
            RunStatus::Finished(Outcome::Ok(_)) => State::Finished,
            RunStatus::Finished(Outcome::Err(_)) => State::Failed,
            RunStatus::Finished(Outcome::Cancelled) => State::Cancelled,
        }
    }

    fn label(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Parked => "parked",
            State::Finished => "finished",
            State::Failed => "failed",
            State::Cancelled => "cancelled",
        }
    }
}

/// How a step's attempt ended.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Attempt {
    Ok,
    Error,
    TimedOut,
}

/// On a cache line of its own: every shard counts every step here.
#[derive(Default)]
#[repr(align(64))]
struct Line<T>(T);

#[derive(Default)]
pub(crate) struct Counters {
    /// Runs in the runs map by [`State`], finished ones until retention drops them.
    runs: [AtomicI64; 5],
    /// Transitions into each state since the engine opened (runs recovered in a state
    /// do not count: they entered it before).
    entered: [AtomicU64; 5],
    continued: AtomicU64,
    /// Step attempts by how they ended: ok, error, timed out.
    attempts: Line<[AtomicU64; 3]>,
    /// Runs waiting for a place to run on their shard (`EngineBuilder::max_running`).
    waiting: Line<AtomicI64>,
    signals: AtomicU64,
    cancels: AtomicU64,
    compactions: AtomicU64,
    compaction_errors: AtomicU64,
    compaction_us: AtomicU64,
    expired: AtomicU64,
    retired: AtomicU64,
}

impl Counters {
    /// A run enters the map in `s`: started now (`fresh`), or recovered.
    pub(crate) fn added(&self, s: &RunStatus, fresh: bool) {
        let i = State::of(s) as usize;
        self.runs[i].fetch_add(1, Ordering::Relaxed);
        if fresh {
            self.entered[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A run leaves the map (retention) or is replaced in it.
    pub(crate) fn removed(&self, s: &RunStatus) {
        self.runs[State::of(s) as usize].fetch_sub(1, Ordering::Relaxed);
    }

    /// A run in the map goes from `from` to `to`.
    pub(crate) fn moved(&self, from: &RunStatus, to: &RunStatus) {
        let (a, b) = (State::of(from), State::of(to));
        if a != b {
            self.runs[a as usize].fetch_sub(1, Ordering::Relaxed);
            self.runs[b as usize].fetch_add(1, Ordering::Relaxed);
            self.entered[b as usize].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn continued(&self) {
        self.continued.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn attempt(&self, how: Attempt) {
        self.attempts.0[how as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// A run starts (`+1`) or stops (`-1`) waiting for a place to run.
    pub(crate) fn waiting(&self, d: i64) {
        self.waiting.0.fetch_add(d, Ordering::Relaxed);
    }

    pub(crate) fn signal(&self) {
        self.signals.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn cancel(&self) {
        self.cancels.fetch_add(1, Ordering::Relaxed);
    }

    /// Compaction dropped `n` finished runs whose retention ended.
    pub(crate) fn expired(&self, n: usize) {
        self.expired.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// A compaction ended: how long it took and the segments it retired; or it failed.
    pub(crate) fn compacted(&self, took: std::time::Duration, result: Result<usize, ()>) {
        self.compaction_us
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
        match result {
            Ok(retired) => {
                self.compactions.fetch_add(1, Ordering::Relaxed);
                self.retired.fetch_add(retired as u64, Ordering::Relaxed);
            }
            Err(()) => {
                self.compaction_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Runs in the map in state `s` now.
    #[cfg(test)]
    fn runs_in(&self, s: State) -> i64 {
        self.runs[s as usize].load(Ordering::Relaxed)
    }

    pub(crate) fn render(&self, recovery: &Recovery, log: &ferry_log::Stats) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut e = Exposition::new();
        for s in State::ALL {
            e.gauge(
                "ferry_flow_runs",
                "Runs the engine holds, by state (finished ones until their retention ends).",
                &[("state", s.label())],
                {
                    let n = self.runs[s as usize].load(Ordering::Relaxed);
                    debug_assert!(n >= 0, "{} runs {}", n, s.label());
                    n as f64
                },
            );
        }
        for s in State::ALL {
            e.counter(
                "ferry_flow_runs_entered_total",
                "Runs that entered each state since the engine opened (running: started).",
                &[("state", s.label())],
                get(&self.entered[s as usize]),
            );
        }
        for (how, a) in ["ok", "error", "timeout"].iter().zip(&self.attempts.0) {
            e.counter(
                "ferry_flow_step_attempts_total",
                "Step bodies run, by how the attempt ended (replayed steps do not run).",
                &[("result", how)],
                get(a),
            );
        }
        let counters: [(&str, &str, u64); 12] = [
            (
                "ferry_flow_runs_continued_total",
                "Generations ended by continue-as-new.",
                get(&self.continued),
            ),
            (
                "ferry_flow_signals_total",
                "Signals journaled for runs.",
                get(&self.signals),
            ),
            (
                "ferry_flow_cancels_total",
                "Cancellation requests journaled.",
                get(&self.cancels),
            ),
            (
                "ferry_flow_compactions_total",
                "Compactions done: a checkpoint written and the segments it covers retired (docs/flow.md §5).",
                get(&self.compactions),
            ),
            (
                "ferry_flow_compaction_errors_total",
                "Compactions that failed (the log keeps what they would have retired).",
                get(&self.compaction_errors),
            ),
            (
                "ferry_flow_runs_expired_total",
                "Finished runs dropped once their retention ended.",
                get(&self.expired),
            ),
            (
                "ferry_flow_log_segments_retired_total",
                "Log segments retired by compaction.",
                get(&self.retired),
            ),
            (
                "ferry_flow_log_records_total",
                "Records appended to the log.",
                log.records,
            ),
            (
                "ferry_flow_log_syncs_total",
                "fdatasync calls by the log's writer.",
                log.syncs,
            ),
            (
                "ferry_flow_log_batches_total",
                "Batches the log's writer wrote.",
                log.batches,
            ),
            (
                "ferry_flow_log_written_bytes_total",
                "Bytes the log's writer wrote.",
                log.bytes_written,
            ),
            (
                "ferry_flow_log_segments_reused_total",
                "Segments made from retired ones (spares) rather than created.",
                log.segments_reused,
            ),
        ];
        for (name, help, v) in counters {
            e.counter(name, help, &[], v);
        }
        e.counter_f64(
            "ferry_flow_compaction_seconds_total",
            "Time spent compacting, on the engine's admin thread.",
            &[],
            get(&self.compaction_us) as f64 / 1e6,
        );
        let gauges: [(&str, &str, f64); 7] = [
            (
                "ferry_flow_runs_waiting",
                "Runs waiting for a place among their shard's running runs (max_running): new ones, and ones back from a sleep, signal, child or backoff.",
                self.waiting.0.load(Ordering::Relaxed) as f64,
            ),
            (
                "ferry_flow_recovered_records",
                "Log records read when the engine opened.",
                recovery.log_records as f64,
            ),
            (
                "ferry_flow_recovery_seconds",
                "How long the engine took to open: log recovery and replay of every run.",
                recovery.elapsed.as_secs_f64(),
            ),
            (
                "ferry_flow_recovery_torn_bytes",
                "Bytes of a torn tail the log cut when the engine opened (a write a crash cut short, never acknowledged).",
                recovery.torn_bytes as f64,
            ),
            (
                "ferry_flow_resumed_runs",
                "Unfinished runs the engine resumed when it opened.",
                recovery.resumed as f64,
            ),
            (
                "ferry_flow_log_segments",
                "Segments the log holds.",
                log.segments as f64,
            ),
            (
                "ferry_flow_log_pending_bytes",
                "Bytes appended and not yet durable.",
                log.end.saturating_sub(log.durable) as f64,
            ),
        ];
        for (name, help, v) in gauges {
            e.gauge(name, help, &[], v);
        }
        e.histogram_log2(
            "ferry_flow_log_write_seconds",
            "The log writer's cycles (a write and an fdatasync of what filled): what the disk gives each step.",
            &[],
            &log.write_us,
        );
        e.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_move_between_gauges_and_count_entries() {
        let c = Counters::default();
        let ok = RunStatus::Finished(Outcome::Ok(serde_json::Value::Null));
        c.added(&RunStatus::Running, true);
        c.added(&RunStatus::Running, true);
        c.added(&RunStatus::Parked("x".into()), false);
        c.moved(&RunStatus::Running, &ok);
        c.moved(&ok, &ok);
        c.removed(&ok);
        assert_eq!(c.runs_in(State::Running), 1);
        assert_eq!(c.runs_in(State::Parked), 1);
        assert_eq!(c.runs_in(State::Finished), 0);
        let text = c.render(
            &Recovery {
                elapsed: std::time::Duration::from_millis(5),
                log_records: 3,
                resumed: 1,
                torn_bytes: 0,
            },
            &ferry_log::Stats::default(),
        );
        assert!(text.contains("ferry_flow_runs{state=\"running\"} 1\n"));
        assert!(text.contains("ferry_flow_runs_entered_total{state=\"running\"} 2\n"));
        assert!(text.contains("ferry_flow_runs_entered_total{state=\"finished\"} 1\n"));
        assert!(text.contains("ferry_flow_runs_entered_total{state=\"parked\"} 0\n"));
        assert!(text.contains("ferry_flow_recovery_seconds 0.005\n"));
        assert!(text.contains("ferry_flow_log_write_seconds_bucket{le=\"+Inf\"} 0\n"));
    }
}
