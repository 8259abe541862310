//! ferry-outbox: a transactional outbox. The app enqueues a message in its own database
//! transaction ([`enqueue`]); relays ([`relay::Relay`]) lease batches, publish them to a
//! [`transport::Transport`] (NATS JetStream, an HTTP webhook, or your own), and settle
//! them under a fenced lease. Postgres and SQLite. The contract is `docs/outbox.md`.
#![forbid(unsafe_code)]

mod breaker;
pub mod enqueue;
pub mod error;
pub mod message;
pub mod relay;
pub mod schema;
pub mod sink;
pub mod status;
pub mod store;
pub mod totals;
pub mod transport;

pub use enqueue::{Enqueued, OutboxConnection, enqueue, enqueue_many};
pub use error::{ConnectError, DbError};
pub use message::{EnqueueError, Limits, Message};
pub use relay::{Relay, RelayConfig, RelayError};
pub use store::{Db, Store};
pub use transport::TransportError;
