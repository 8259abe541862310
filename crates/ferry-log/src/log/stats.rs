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
    /// The writer's cycles (writing and syncing what filled) by how long they took, in
    /// ferry-core's power-of-two buckets of microseconds (up to 2^23 µs, about 8 s):
    /// what the disk gives the log, as operators and the benchmark read it.
    pub write_us: WriteHistogram,
}

/// Buckets of [`Stats::write_us`]: up to 2^23 µs, about 8 s.
pub const WRITE_BUCKETS: usize = 24;

/// The writer's cycles by duration.
pub type WriteHistogram = ferry_core::metrics::Log2Histogram<WRITE_BUCKETS>;
