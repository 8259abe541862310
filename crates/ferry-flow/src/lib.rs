//! ferry-flow: durable execution for ordinary async Rust (docs/flow.md is the
//! contract).
//!
//! The rooms, from the bottom up:
//! - `journal` (what a run records, framed in ferry-log) and `replay` (the cursor that
//!   checks a run's code against its journal): pure.
//! - `api`: the types an application names (workflows, signals, errors, limits).
//! - `journal_log`: the seam between the engine and the log it journals to; `durable`:
//!   the one way to wait for durability.
//! - `run`: one run's state and its `Host` trait, the only interface through which `ctx`
//!   (what workflow code calls) reaches the engine.
//! - `registry` (the runs map's entries), `job` (runs handed to shards), `shared` (the
//!   engine's shared state and what callers do to runs), `lifecycle` (a run's
//!   generations and end), `shard` (the executor), `recovery` (replay after a restart,
//!   [`read_journal`]), `checkpoint` and `upkeep` (compaction, the status file and the
//!   request inbox; `admin` is their file protocol), `metrics`.
//! - `builder` (settings, `open`) and `engine` ([`Engine`], [`RunHandle`]) on top.
//! - `remote`: server mode's protocol (docs/flow-server.md), pure.
//!
//! ferry-log's types an application may need (its settings, errors, storage seam) are
//! re-exported here, so an app depends on ferry-flow alone.

pub mod admin;
mod api;
mod builder;
mod calls;
mod checkpoint;
mod ctx;
mod durable;
mod engine;
mod holder;
mod job;
pub mod journal;
pub mod journal_log;
mod lifecycle;
mod metrics;
mod recovery;
mod registry;
pub mod remote;
pub mod replay;
mod run;
mod shard;
mod shared;
mod upkeep;

pub use api::{
    FlowError, Limit, Limits, Recovery, RunInfo, RunStatus, Signal, StepError, Workflow,
};
pub use builder::{DEFAULT_MAX_RUNNING, EngineBuilder, SHARDS_MAX, default_shards};
pub use checkpoint::{CheckpointError, ShardCheckpoint};
pub use ctx::{Ctx, Retry, Step, StepCtx};
pub use engine::{Engine, RunHandle};
pub use ferry_core::{Class, Classify, ConfigError};
/// ferry-log whole, for a [`JournalLog`] implementation (its `Lsn`, `Follower`, `Record`).
pub use ferry_log as log;
pub use ferry_log::sim::SimStorage;
pub use ferry_log::{
    Config as LogConfig, Error as LogError, FileStorage, Stats as LogStats, Storage,
};
pub use journal::{Entry, Outcome, Record};
pub use journal_log::JournalLog;
pub use recovery::{FinishedRun, Journal, read_journal, read_journal_on};
pub use shared::shard_of;
