//! ferry-flow: durable execution for ordinary async Rust (docs/flow.md).
//!
//! `journal`: what a run records and how it is framed in ferry-log; `replay`: the
//! cursor that checks a run's code against its journal; `engine`: runs, shards, recovery,
//! cancellation, continue-as-new, limits; `ctx`: what workflow code calls; `durable`:
//! how a shard's tasks wait for the log; `journal_log`: the seam between the engine
//! and the log it journals to. docs/flow.md marks what is planned.

pub mod admin;
mod api;
mod builder;
mod checkpoint;
mod ctx;
mod durable;
mod engine;
mod job;
pub mod journal;
pub mod journal_log;
mod lifecycle;
mod metrics;
mod recovery;
mod registry;
pub mod replay;
mod run;
mod shard;
mod shared;
mod upkeep;

pub use api::{FlowError, Limit, Limits, Recovery, RunInfo, RunStatus, Signal, Workflow};
pub use builder::{DEFAULT_MAX_RUNNING, EngineBuilder};
pub use ctx::{Ctx, Retry, Step, StepCtx};
pub use engine::{Engine, RunHandle};
pub use journal::Outcome;
pub use journal_log::JournalLog;
pub use recovery::{read_journal, read_journal_on};
