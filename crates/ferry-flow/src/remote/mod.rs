//! Server mode (docs/flow-server.md): the frames a worker and the server exchange.
//! The worker's side of the connection is built on them next (§14).

pub mod proto;
