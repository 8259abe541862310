//! ferry-flow: durable execution for ordinary async Rust (docs/flow.md).
//!
//! Built so far: the journal (what a run records, how it is framed in ferry-log) and the
//! replay cursor that checks a run's code against its journal. The engine that runs
//! workflows on shards comes next (docs/flow.md marks what is planned).

pub mod journal;
pub mod replay;
