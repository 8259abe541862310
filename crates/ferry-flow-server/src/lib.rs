//! ferry-flow's server mode, the server's side (docs/flow-server.md is the contract).
//!
//! Built so far: `lease`, the lease table, pure (§5.1). The server around it (the log,
//! epochs, appends, recovery pages, checkpoints per shard) comes next (§14).

pub mod lease;
