//! Server mode (docs/flow-server.md): the frames a worker and the server exchange
//! (`proto`, pure), how they travel over a stream (`io`), and the worker's connection with
//! each shard's journal stream (`worker`).

pub mod io;
pub mod proto;
pub mod worker;
