//! What the log counts since it opened (`Log::stats`), and the writer's cycles by
//! duration, as operators and the benchmark read them.

use crate::Lsn;

/// Counters since the log was opened.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    pub records: u64,
    /// Batches written: one write each (two when a batch starts a segment).
    pub batches: u64,
    pub syncs: u64,
    pub bytes_written: u64,
    pub durable: Lsn,
    pub end: Lsn,
    pub segments: usize,
    /// Segments made from a retired one kept as a spare, rather than created.
    pub segments_reused: u64,
    /// The writer's cycles (writing and syncing what filled) by how long they took:
    /// `write_us_log2[i]` counts cycles of 2^i to 2^(i+1) µs (the first also those under
    /// 1 µs, the last those longer). What the disk gives the log, as operators and the
    /// benchmark read it.
    pub write_us_log2: [u64; WRITE_BUCKETS],
    /// Microseconds spent in those cycles, in all.
    pub write_us: u64,
}

/// Buckets of [`Stats::write_us_log2`]: up to 2^23 µs, about 8 s.
pub const WRITE_BUCKETS: usize = 24;

impl Stats {
    /// The bucket of a cycle that took `us` microseconds.
    pub fn write_bucket(us: u64) -> usize {
        (u64::BITS - us.max(1).leading_zeros() - 1).min(WRITE_BUCKETS as u32 - 1) as usize
    }

    /// The upper bound in µs of the bucket where `q` (0 to 1) of the cycles counted in
    /// `buckets` end: `q = 0.99` says 99% of them took less. None with no cycles.
    pub fn write_quantile_us(buckets: &[u64; WRITE_BUCKETS], q: f64) -> Option<u64> {
        let total: u64 = buckets.iter().sum();
        if total == 0 {
            return None;
        }
        let want = (q * total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in buckets.iter().enumerate() {
            seen += n;
            if seen >= want {
                return Some(1 << (i + 1));
            }
        }
        Some(1 << WRITE_BUCKETS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cycle_is_counted_in_the_bucket_of_its_power_of_two() {
        assert_eq!(Stats::write_bucket(0), 0, "under 1 µs goes in the first");
        assert_eq!(Stats::write_bucket(1), 0);
        assert_eq!(Stats::write_bucket(2), 1);
        assert_eq!(Stats::write_bucket(3), 1);
        assert_eq!(Stats::write_bucket(1024), 10);
        assert_eq!(Stats::write_bucket(1 << 23), WRITE_BUCKETS - 1);
        assert_eq!(
            Stats::write_bucket(u64::MAX),
            WRITE_BUCKETS - 1,
            "longer: the last"
        );
    }

    #[test]
    fn a_quantile_is_the_upper_bound_of_the_bucket_where_it_falls() {
        let mut b = [0u64; WRITE_BUCKETS];
        assert_eq!(Stats::write_quantile_us(&b, 0.5), None);
        b[Stats::write_bucket(300)] = 98; // 256-512 µs
        b[Stats::write_bucket(5000)] = 2; // 4096-8192 µs
        assert_eq!(Stats::write_quantile_us(&b, 0.5), Some(512));
        assert_eq!(Stats::write_quantile_us(&b, 0.98), Some(512));
        assert_eq!(Stats::write_quantile_us(&b, 0.99), Some(8192));
        assert_eq!(
            Stats::write_quantile_us(&b, 0.0),
            Some(512),
            "at least one cycle"
        );
    }
}
