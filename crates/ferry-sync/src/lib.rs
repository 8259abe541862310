//! ferry-sync keeps partial copies of Postgres tables on SQLite replicas. `docs/sync.md`
//! is the contract; this is the map.
//!
//! - [`value`]: the values rows are made of, their canonical key text and their wire
//!   encoding. Pure.
//! - [`wire`]: protocol v1: the sealed messages down (`Down`) and the reports up (`Up`),
//!   their limits, seals and compression. Pure.
//! - [`rules`]: the rules file (TOML): replicas, tables and how each is routed. Pure.
//! - [`catalog`]: what Postgres says about the tables the rules name (columns, types,
//!   keys, foreign keys), mapped to SQLite affinities; refuses what it cannot map.
//! - [`schema`]: the `ferry_sync` schema, the capture triggers and indexes derived from
//!   the rules; `check` and `install`.
//! - [`relay`]: the one process that records: plans notes into each replica's
//!   numbered, sealed messages, under the relay lock.
//! - [`serve`]: the built-in HTTP transport, server side; [`status`]: where replicas stand.
//! - [`file`]: the way up on the server: uploads filed into record tables, the inbox
//!   (`docs/sync-up.md`).
//! - [`replica`]: the SQLite side: applies messages, reports where it stands.
#![forbid(unsafe_code)]

pub mod catalog;
pub mod client;
pub mod enroll;
pub mod file;
pub mod nats;
pub mod relay;
pub mod replica;
pub mod rules;
pub mod schema;
pub mod serve;
pub mod status;
pub mod value;
pub mod wire;
pub mod wish;
