//! A relay's settings ([`RelayConfig`]), their limits, and the check that runs once in
//! [`super::Relay::new`] (and that a caller may run first, before connecting anything):
//! an error names the setting, its value and the limit.

use ferry_core::ConfigError;
use ferry_core::seams::{Clock, SystemClock};
use std::sync::Arc;
use std::time::Duration;

/// How a relay runs. Checked by [`RelayConfig::check`], which [`super::Relay::new`] runs.
#[derive(Clone)]
pub struct RelayConfig {
    /// This relay's name in `lease_owner` and in the totals (host, pid and a random
    /// suffix by default).
    pub owner: String,
    /// Relay loops in this process.
    pub lanes: usize,
    /// Messages per lease.
    pub batch: u32,
    /// Publishes in flight per lane.
    pub window: usize,
    pub lease: Duration,
    /// Message-attributable refusals before a message is parked.
    pub max_attempts: i32,
    /// The backstop poll (also how soon a due retry is noticed).
    pub poll: Duration,
    /// Transport failures in a row that open the breaker.
    pub breaker_failures: u32,
    /// Every time the relay reads (deadlines, the breaker's pause, SQLite's times: the
    /// relay sets it on its store). Tests drive it; tokio's sleeps stay tokio's.
    pub clock: Arc<dyn Clock>,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            owner: default_owner(),
            lanes: 1,
            batch: 256,
            window: 64,
            lease: Duration::from_secs(30),
            max_attempts: 10,
            poll: Duration::from_secs(1),
            breaker_failures: 5,
            clock: Arc::new(SystemClock),
        }
    }
}

impl std::fmt::Debug for RelayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayConfig")
            .field("owner", &self.owner)
            .field("lanes", &self.lanes)
            .field("batch", &self.batch)
            .field("window", &self.window)
            .field("lease", &self.lease)
            .field("max_attempts", &self.max_attempts)
            .field("poll", &self.poll)
            .field("breaker_failures", &self.breaker_failures)
            .finish()
    }
}

/// A lease shorter than a second cannot cover one publish timeout.
pub(super) const LEASE_MIN: Duration = Duration::from_secs(1);
pub(super) const LANES_MAX: usize = 64;
pub(super) const BATCH_MAX: u32 = 10_000;
pub(super) const WINDOW_MAX: usize = 4096;
/// How often a relay records its counters (crate::totals): a relay killed between two
/// records loses at most this much of them from `ferry outbox status`.
pub const TOTALS_EVERY: Duration = Duration::from_secs(5);

pub(super) fn default_owner() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    format!(
        "{host}-{}-{:04x}",
        std::process::id(),
        ferry_core::seams::random_nonzero_u64() & 0xffff
    )
}

impl RelayConfig {
    /// Check the settings (as [`super::Relay::new`] does): the error names the setting,
    /// its value and the limit. Pure, so a caller can check before connecting anything.
    pub fn check(&self) -> Result<(), ConfigError> {
        let c = self;
        if c.lanes == 0 || c.lanes > LANES_MAX {
            return Err(ConfigError::new(
                "lanes",
                c.lanes,
                format!("must be between 1 and {LANES_MAX}"),
            ));
        }
        if c.batch == 0 || c.batch > BATCH_MAX {
            return Err(ConfigError::new(
                "batch",
                c.batch,
                format!("must be between 1 and {BATCH_MAX}"),
            ));
        }
        if c.window == 0 || c.window > WINDOW_MAX {
            return Err(ConfigError::new(
                "window",
                c.window,
                format!("must be between 1 and {WINDOW_MAX}"),
            ));
        }
        if c.lease < LEASE_MIN {
            return Err(ConfigError::new(
                "lease",
                format!("{} ms", c.lease.as_millis()),
                format!(
                    "must be at least {} ms: a shorter lease cannot cover one publish",
                    LEASE_MIN.as_millis()
                ),
            ));
        }
        if c.max_attempts < 1 {
            return Err(ConfigError::new(
                "max_attempts",
                c.max_attempts,
                "must be at least 1",
            ));
        }
        if c.breaker_failures < 1 {
            return Err(ConfigError::new(
                "breaker_failures",
                c.breaker_failures,
                "must be at least 1",
            ));
        }
        if c.poll.is_zero() {
            return Err(ConfigError::new(
                "poll",
                "0 ms",
                "must be at least 1 ms: an idle relay would spin",
            ));
        }
        Ok(())
    }
}
