//! Exponential backoff with full jitter (AWS architecture blog, "Exponential Backoff And
//! Jitter"): the n-th consecutive failure waits a uniform time in `0..min(cap, base·2^n)`,
//! never less than `floor`. Full jitter spreads retries of many clients so a peer coming
//! back is not hit by all of them at once.

use crate::seams::Rng;
use std::time::Duration;

/// Backoff settings. Checked once by [`Backoff::new`].
#[derive(Clone, Copy, Debug)]
pub struct Backoff {
    base: Duration,
    cap: Duration,
    floor: Duration,
}

/// Failures beyond this do not grow the window further (2^20 · base is far past any cap).
const EXPONENT_MAX: u32 = 20;

impl Backoff {
    /// `floor <= base <= cap`, or the caller's settings are nonsense: panics, because these
    /// are constants in code, not user input.
    pub const fn new(base: Duration, cap: Duration, floor: Duration) -> Self {
        assert!(floor.as_nanos() <= base.as_nanos() && base.as_nanos() <= cap.as_nanos());
        Backoff { base, cap, floor }
    }

    /// How long to wait after `failures` consecutive failures (1 = the first failure).
    pub fn delay(&self, failures: u32, rng: &mut dyn Rng) -> Duration {
        if failures == 0 {
            return Duration::ZERO;
        }
        let exp = (failures - 1).min(EXPONENT_MAX);
        let window = self.base.saturating_mul(1 << exp).min(self.cap);
        let nanos = window.as_nanos().min(u64::MAX as u128) as u64;
        let jittered = Duration::from_nanos(if nanos == 0 { 0 } else { rng.below(nanos + 1) });
        jittered.max(self.floor)
    }

    /// The largest delay this backoff can return.
    pub fn cap(&self) -> Duration {
        self.cap
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seams::SplitMix64;

    #[test]
    fn delays_grow_to_the_cap_and_stay_above_the_floor() {
        let b = Backoff::new(
            Duration::from_millis(50),
            Duration::from_secs(30),
            Duration::from_millis(10),
        );
        let mut rng = SplitMix64::seeded(1);
        assert_eq!(b.delay(0, &mut rng), Duration::ZERO);
        for failures in 1..100 {
            let d = b.delay(failures, &mut rng);
            assert!(
                d >= Duration::from_millis(10) && d <= Duration::from_secs(30),
                "{d:?}"
            );
        }
        let window_1 = (0..200).map(|_| b.delay(1, &mut rng)).max().unwrap();
        assert!(window_1 <= Duration::from_millis(50));
    }
}
