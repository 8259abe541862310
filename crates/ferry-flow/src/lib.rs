//! ferry-flow: durable execution for ordinary async Rust (docs/flow.md).
//!
//! `journal`: what a run records and how it is framed in ferry-log; `replay`: the
//! cursor that checks a run's code against its journal; `engine`: runs, shards, recovery,
//! cancellation, continue-as-new, limits; `ctx`: what workflow code calls; `durable`:
//! how a shard's tasks wait for the log; `journal_log`: the seam between the engine
//! and the log it journals to. docs/flow.md marks what is planned.

pub mod admin;
mod checkpoint;
mod ctx;
mod durable;
mod engine;
pub mod journal;
pub mod journal_log;
mod metrics;
pub mod replay;

pub use ctx::{Ctx, Retry, Step, StepCtx};
pub use engine::{
    DEFAULT_MAX_RUNNING, Engine, EngineBuilder, FlowError, Limit, Limits, Recovery, RunHandle,
    RunInfo, RunStatus, Signal, Workflow, read_journal, read_journal_on,
};
pub use journal::Outcome;
pub use journal_log::JournalLog;
