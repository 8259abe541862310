//! ferry-flow: durable execution for ordinary async Rust (docs/flow.md).
//!
//! Built so far: the journal (what a run records, how it is framed in ferry-log), the
//! replay cursor that checks a run's code against its journal, and a first slice of the
//! engine: typed workflows, idempotent starts, durable steps with output holding,
//! results, recovery by replay, nondeterminism parking, shards over one shared log.
//! docs/flow.md marks what is planned.

mod engine;
pub mod journal;
pub mod replay;

pub use engine::{
    Ctx, Engine, EngineBuilder, FlowError, Retry, RunHandle, RunStatus, Signal, Step, StepCtx,
    Workflow,
};
