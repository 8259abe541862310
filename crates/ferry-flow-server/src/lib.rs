//! ferry-flow's server mode, the server's side (docs/flow-server.md is the contract).
//!
//! - `lease`: the lease table, pure (§5.1).
//! - `store`: the server's log, every shard's records and every grant's epoch in one
//!   ferry-log, with each shard's positions (§6).
//! - `server`: connections, the table and the store driven by them, the task that
//!   answers `Durable` once a sync covers an append (§4–§8), and calls across shards
//!   (§9).
//! - `index`: the runs, from durable records (list, show, result; §10).
//! - `http`: the HTTP/JSON API (§10).
//!
//! - `peer`: a worker's end of a connection with no engine behind it, for tests and
//!   probes.
//!
//! - `checkpoints`: each shard's checkpoint, and retiring the log below them (§7).
//! - `replica`: the log kept in a JetStream stream too, the lock and the takeover of a
//!   standby server (docs/flow-server-replica.md).
//!
//! Not built yet (§15): the outbox for calls made by runs.

pub mod checkpoints;
pub mod http;
pub mod index;
pub mod lease;
pub mod peer;
pub mod replica;
pub mod server;
pub mod store;
