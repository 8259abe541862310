//! Metrics in the Prometheus text format (version 0.0.4).
//!
//! Engines keep their own counters (atomics in their structs) and render them at scrape
//! time through [`Exposition`], which writes each family's `# HELP` and `# TYPE` once.
//! [`Histogram`] accumulates observations in fixed buckets without a lock.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// A Prometheus text document being written.
#[derive(Default)]
pub struct Exposition {
    out: String,
    last_family: String,
}

/// One label pair.
pub type Label<'a> = (&'a str, &'a str);

impl Exposition {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn counter(
        &mut self,
        name: &str,
        help: &str,
        labels: &[Label<'_>],
        value: u64,
    ) -> &mut Self {
        self.family(name, help, "counter");
        self.sample(name, labels, value as f64);
        self
    }

    pub fn gauge(&mut self, name: &str, help: &str, labels: &[Label<'_>], value: f64) -> &mut Self {
        self.family(name, help, "gauge");
        self.sample(name, labels, value);
        self
    }

    /// A counter whose value is not a whole number (seconds, say).
    pub fn counter_f64(
        &mut self,
        name: &str,
        help: &str,
        labels: &[Label<'_>],
        value: f64,
    ) -> &mut Self {
        self.family(name, help, "counter");
        self.sample(name, labels, value);
        self
    }

    pub fn histogram(
        &mut self,
        name: &str,
        help: &str,
        labels: &[Label<'_>],
        h: &Histogram,
    ) -> &mut Self {
        let counts: Vec<u64> = h
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        // Observations above the last bound are counted only in the total.
        let above = h
            .count
            .load(Ordering::Relaxed)
            .saturating_sub(counts.iter().sum::<u64>());
        let counts: Vec<u64> = counts.into_iter().chain([above]).collect();
        let sum = h.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        self.histogram_counts(name, help, labels, h.bounds, &counts, sum)
    }

    /// A histogram kept elsewhere: `counts[i]` observations at most `bounds[i]` (and
    /// above the bound before it), and one more count than bounds, for those above
    /// every bound; `sum` of every observation.
    pub fn histogram_counts(
        &mut self,
        name: &str,
        help: &str,
        labels: &[Label<'_>],
        bounds: &[f64],
        counts: &[u64],
        sum: f64,
    ) -> &mut Self {
        assert_eq!(
            counts.len(),
            bounds.len() + 1,
            "a count per bound, and one above"
        );
        self.family(name, help, "histogram");
        let mut cumulative = 0;
        for (bound, n) in bounds.iter().zip(counts) {
            cumulative += n;
            let le = format!("{bound}");
            let mut with_le: Vec<Label<'_>> = labels.to_vec();
            with_le.push(("le", &le));
            self.sample(&format!("{name}_bucket"), &with_le, cumulative as f64);
        }
        let count: u64 = counts.iter().sum();
        let mut with_le: Vec<Label<'_>> = labels.to_vec();
        with_le.push(("le", "+Inf"));
        self.sample(&format!("{name}_bucket"), &with_le, count as f64);
        self.sample(&format!("{name}_sum"), labels, sum);
        self.sample(&format!("{name}_count"), labels, count as f64);
        self
    }

    pub fn finish(self) -> String {
        self.out
    }

    fn family(&mut self, name: &str, help: &str, kind: &str) {
        if self.last_family != name {
            let _ = writeln!(self.out, "# HELP {name} {help}");
            let _ = writeln!(self.out, "# TYPE {name} {kind}");
            self.last_family = name.to_string();
        }
    }

    fn sample(&mut self, name: &str, labels: &[Label<'_>], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value}");
    }
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A histogram of durations in seconds with fixed upper bounds.
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_micros: AtomicU64,
}

/// Bounds for latencies from 100 µs to 10 s.
pub const LATENCY_BOUNDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        assert!(
            bounds.windows(2).all(|w| w[0] < w[1]),
            "histogram bounds must rise"
        );
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn latency() -> Self {
        Self::new(LATENCY_BOUNDS)
    }

    pub fn observe(&self, d: std::time::Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|b| secs <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add(d.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }
}

/// Durations counted in power-of-two buckets of microseconds: bucket `i` counts those of
/// 2^i to 2^(i+1) µs (the first also those under 1 µs, the last also those longer), with
/// their sum. Plain counts, for a histogram its owner updates under a lock it holds
/// anyway (ferry-log's writer); its quantiles are bucket upper bounds, which is as much
/// as operators read from it (a p99 of "under 512 µs").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Log2Histogram<const N: usize> {
    pub counts: [u64; N],
    pub sum_us: u64,
}

impl<const N: usize> Default for Log2Histogram<N> {
    fn default() -> Self {
        Log2Histogram {
            counts: [0; N],
            sum_us: 0,
        }
    }
}

impl<const N: usize> Log2Histogram<N> {
    const _BUCKETS: () = assert!(N >= 2 && N <= 63, "2 to 63 power-of-two buckets");

    /// The bucket of a duration of `us` microseconds.
    pub fn bucket(us: u64) -> usize {
        let () = Self::_BUCKETS;
        (u64::BITS - us.max(1).leading_zeros() - 1).min(N as u32 - 1) as usize
    }

    pub fn record(&mut self, us: u64) {
        self.counts[Self::bucket(us)] += 1;
        self.sum_us = self.sum_us.saturating_add(us);
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The upper bound in µs of the bucket where `q` (0 to 1) of the durations end:
    /// `q = 0.99` says 99% of them took less. None with none counted.
    pub fn quantile_us(&self, q: f64) -> Option<u64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let want = (q * total as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.counts.iter().enumerate() {
            seen += n;
            if seen >= want {
                return Some(1 << (i + 1));
            }
        }
        Some(1 << N)
    }

    /// What was counted since `earlier`, a copy of this histogram taken before.
    pub fn since(&self, earlier: &Self) -> Self {
        let mut d = *self;
        for (c, e) in d.counts.iter_mut().zip(earlier.counts) {
            *c = c.checked_sub(e).expect("a histogram's counts only rise");
        }
        d.sum_us = d.sum_us.saturating_sub(earlier.sum_us);
        d
    }

    /// The upper bounds in seconds of every bucket but the last (which has none).
    pub fn bounds_seconds() -> Vec<f64> {
        (1..N).map(|i| (1u64 << i) as f64 / 1e6).collect()
    }
}

impl Exposition {
    /// A [`Log2Histogram`] of durations, in seconds.
    pub fn histogram_log2<const N: usize>(
        &mut self,
        name: &str,
        help: &str,
        labels: &[Label<'_>],
        h: &Log2Histogram<N>,
    ) -> &mut Self {
        let bounds = Log2Histogram::<N>::bounds_seconds();
        self.histogram_counts(
            name,
            help,
            labels,
            &bounds,
            &h.counts,
            h.sum_us as f64 / 1e6,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn families_are_announced_once_and_buckets_are_cumulative() {
        let h = Histogram::latency();
        h.observe(Duration::from_micros(50));
        h.observe(Duration::from_millis(3));
        let mut e = Exposition::new();
        e.counter("ferry_x_total", "X.", &[("db", "a")], 1);
        e.counter("ferry_x_total", "X.", &[("db", "b\"")], 2);
        e.histogram("ferry_lat_seconds", "Latency.", &[], &h);
        let text = e.finish();
        assert_eq!(text.matches("# TYPE ferry_x_total counter").count(), 1);
        assert!(text.contains("ferry_x_total{db=\"b\\\"\"} 2"));
        assert!(text.contains("ferry_lat_seconds_bucket{le=\"0.0001\"} 1"));
        assert!(text.contains("ferry_lat_seconds_bucket{le=\"0.005\"} 2"));
        assert!(text.contains("ferry_lat_seconds_count 2"));
    }

    #[test]
    fn log2_buckets_hold_powers_of_two_and_quantiles_are_their_upper_bounds() {
        type H = Log2Histogram<24>;
        assert_eq!(H::bucket(0), 0, "under 1 µs goes in the first");
        assert_eq!(H::bucket(1), 0);
        assert_eq!(H::bucket(3), 1);
        assert_eq!(H::bucket(1023), 9);
        assert_eq!(H::bucket(1024), 10);
        assert_eq!(H::bucket(u64::MAX), 23, "longer: the last");
        let mut h = H::default();
        assert_eq!(h.quantile_us(0.5), None);
        for _ in 0..98 {
            h.record(300); // 256-512 µs
        }
        let before = h;
        h.record(5000); // 4096-8192 µs
        h.record(5000);
        assert_eq!(h.quantile_us(0.0), Some(512), "at least one");
        assert_eq!(h.quantile_us(0.5), Some(512));
        assert_eq!(h.quantile_us(0.98), Some(512));
        assert_eq!(h.quantile_us(0.99), Some(8192));
        assert_eq!(h.since(&before).count(), 2);
        assert_eq!(h.since(&before).sum_us, 10_000);
        let mut e = Exposition::new();
        e.histogram_log2("ferry_w_seconds", "W.", &[], &h);
        let text = e.finish();
        assert!(
            text.contains("ferry_w_seconds_bucket{le=\"0.000512\"} 98"),
            "{text}"
        );
        assert!(text.contains("ferry_w_seconds_count 100"), "{text}");
    }
}
