//! Seams for what tests must control: time and randomness.
//!
//! Production code takes a `&dyn Clock` / `&mut dyn Rng` (or the defaults below) so a test
//! can drive time or replay a seed. Neither seam does I/O.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Monotonic time for deadlines and durations, wall time for what people read.
pub trait Clock: Send + Sync {
    fn now(&self) -> Instant;
    fn wall_ms(&self) -> u64;
}

/// The real clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
    fn wall_ms(&self) -> u64 {
        wall_ms()
    }
}

/// A clock that stands still at `at`, with wall time `wall_ms`: only what is not time
/// (an idle, a close) can end a wait on it.
#[derive(Clone, Copy, Debug)]
pub struct StillClock {
    pub at: Instant,
    pub wall_ms: u64,
}

impl Clock for StillClock {
    fn now(&self) -> Instant {
        self.at
    }
    fn wall_ms(&self) -> u64 {
        self.wall_ms
    }
}

/// A clock `step` later at every read, from `start`: a wait of any length on it ends in
/// a few reads. `reads` counts them. Wall time reads 0.
#[derive(Debug)]
pub struct SteppingClock {
    pub start: Instant,
    pub step: Duration,
    pub reads: AtomicU64,
}

impl SteppingClock {
    pub fn new(start: Instant, step: Duration) -> SteppingClock {
        SteppingClock {
            start,
            step,
            reads: AtomicU64::new(0),
        }
    }
}

impl Clock for SteppingClock {
    fn now(&self) -> Instant {
        let n = self.reads.fetch_add(1, Ordering::SeqCst);
        self.start
            + self.step * u32::try_from(n).expect("a test reads a clock fewer than 2^32 times")
    }
    fn wall_ms(&self) -> u64 {
        0
    }
}

/// Milliseconds since the Unix epoch by the system clock (0 if it is before 1970).
pub fn wall_ms() -> u64 {
    (wall_ns() / 1_000_000) as u64
}

/// Nanoseconds since the Unix epoch by the system clock (0 if it is before 1970): for
/// names that sort by when they were made.
pub fn wall_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_nanos()
}

/// A source of random u64s. `SplitMix64` is the default: small, fast, and reproducible
/// from a seed, which is all ferry needs (ids, jitter); nothing here is cryptographic.
pub trait Rng: Send {
    fn next_u64(&mut self) -> u64;

    /// Uniform in `0..n` (n > 0), by multiply-shift; the bias is below 2^-32 for the n
    /// ferry uses.
    fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::below needs a positive bound");
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// The next u64 that is not 0, for ids and generations where 0 means none.
    fn nonzero_u64(&mut self) -> u64 {
        loop {
            let v = self.next_u64();
            if v != 0 {
                return v;
            }
        }
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014).
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn seeded(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// Seeded from the clock, the process id and a stack address: different in every
    /// process and every call, which is what generations and jitter need.
    pub fn from_entropy() -> Self {
        let local = 0u8;
        let addr = &local as *const u8 as u64;
        let nanos = wall_ns() as u64;
        let mut s = SplitMix64::seeded(nanos ^ (u64::from(std::process::id()) << 32) ^ addr);
        s.next_u64();
        s
    }
}

impl Rng for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// A random non-zero u64, for ids that must not collide across processes.
pub fn random_nonzero_u64() -> u64 {
    SplitMix64::from_entropy().nonzero_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_and_below_stays_in_range() {
        let mut a = SplitMix64::seeded(7);
        let mut b = SplitMix64::seeded(7);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
            assert!(a.below(10) < 10);
            b.below(10);
        }
    }

    #[test]
    fn nonzero_u64_skips_zeros() {
        struct Script(Vec<u64>);
        impl Rng for Script {
            fn next_u64(&mut self) -> u64 {
                self.0.remove(0)
            }
        }
        let mut r = Script(vec![0, 0, 5, 0]);
        assert_eq!(r.nonzero_u64(), 5);
        assert_eq!(r.0, vec![0], "stops at the first non-zero");
    }
}
