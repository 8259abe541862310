//! ferry-ship: a warm standby for SQLite databases on stock SQLite.
//!
//! A [`shipper::Shipper`] reads committed transactions from each database's `-wal`,
//! proves before every step that the WAL still continues what it shipped, and posts them
//! to a [`receiver::Receiver`], which applies each one atomically to a replica that
//! readers may query. [`receiver::promote`] turns a replica into a primary. The contract
//! is `docs/ship.md`.
// A few calls need `unsafe` (setpriority(2), statx(2), the WAL hook's C API), each
// allowed where it is, with its reasoning; the rest of the crate may not.
#![deny(unsafe_code)]

pub mod names;
pub mod proto;
pub mod quiet;
pub mod receiver;
pub mod ship_state;
pub mod shipper;
pub mod sqlite;
pub mod wal;

pub use receiver::{Receiver, ReceiverConfig, promote};
pub use shipper::{Shipper, ShipperConfig};
pub use sqlite::prepare_connection;
