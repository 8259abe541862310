//! What ferry's engines really share, and nothing else.
//!
//! - [`error`]: every error is classified by what the caller does next.
//! - [`backoff`]: exponential backoff with full jitter, driven by the [`seams::Rng`] seam.
//! - [`epoch`]: fencing tokens; a stale writer gets [`epoch::Fence::Stale`], a value.
//! - [`seams`]: the clock and randomness seams tests drive.
//! - [`fs`]: atomic file writes with directory fsync, and directory locks.
//! - [`metrics`]: counters, gauges and histograms rendered as Prometheus text.
//! - [`sync`]: taking a lock whose holder panicked.
#![forbid(unsafe_code)]

pub mod backoff;
pub mod epoch;
pub mod error;
pub mod fs;
pub mod metrics;
pub mod seams;
pub mod sync;

pub use error::{Class, Classify, ConfigError};
