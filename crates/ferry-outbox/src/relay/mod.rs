//! The relay (docs/outbox.md §4). Each lane repeats:
//!
//! 1. Ask the breaker (crate::breaker) whether to lease: a full batch when closed, one
//!    message (the probe) when half open, nothing while open.
//! 2. Lease up to `batch` claimable messages in one statement (nothing held after it).
//! 3. Publish them with up to `window` in flight, extending the lease at half-life.
//! 4. Settle the batch in one fenced statement: rows the lane no longer holds are
//!    reported fenced and left alone.
//! 5. With nothing claimable, wait for a wake-up (`NOTIFY` on Postgres, a change of
//!    `PRAGMA data_version` on SQLite) or the backstop poll.
//!
//! A crash between any two steps leaves leased rows whose lease runs out; `reclaim`
//! returns them to pending, marked uncertain, and the next presentation carries the same
//! message id, which the transport deduplicates.
//!
//! Database errors: a transient one (the server restarting, a connection cut) backs the
//! lane off with jitter and retries; a permanent one (a missing privilege, the schema
//! not installed) or a corrupted one stops the relay, and [`Relay::run`] returns it.
//!
//! Every few seconds and when it stops, the relay records its counters in the database
//! (crate::totals), for `ferry outbox status`.

mod background;
mod config;
mod handle;
mod lane;
mod stats;

pub use config::{RelayConfig, TOTALS_EVERY};
pub use handle::{Relay, RelayError, Running};
pub use stats::{RelayStatus, Stats};
