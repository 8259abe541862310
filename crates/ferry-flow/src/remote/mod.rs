//! Server mode (docs/flow-server.md): the frames a worker and the server exchange
//! (`proto`, pure) and how they travel over a stream (`io`). The worker's side of the
//! connection is built on them next (§15).

pub mod io;
pub mod proto;
