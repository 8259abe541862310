//! A log's limits (docs/log.md §6), checked once when it opens.

use crate::Error;
use crate::format::{self, BATCH_HEADER_BYTES, FRAME_HEADER_BYTES, SEGMENT_HEADER_BYTES};
use std::time::Duration;

/// Limits of a log.
#[derive(Clone, Debug)]
pub struct Config {
    /// A batch that would pass this many bytes starts a new segment. Default 64 MiB.
    pub segment_bytes: u64,
    /// The largest record payload. Default 4 MiB.
    pub record_bytes_max: u32,
    /// Appends wait while this many bytes are appended and not yet durable (the disk is
    /// slower than the code). Default 32 MiB.
    pub pending_bytes_max: u64,
    /// After a sync, how long the writer waits for the followers
    /// ([`Follower`](crate::Follower)) it woke to go idle before it takes the next
    /// batch: what they append in reply to the sync then rides the next sync, not the
    /// one after. Zero: never wait. Default 25 µs.
    pub follow: Duration,
    /// At most how many retired segments are kept for later segments to be made from
    /// (each takes `segment_bytes` of disk; docs/log.md §3). A retirement keeps no more
    /// spares than it retires segments: what was written between two retirements is
    /// what the next interval will likely write, so a log written fast keeps up to
    /// this many and one written slowly few. Zero keeps none. Default 16 (1 GiB at the
    /// default segment size, enough for every segment to be a reused one up to about
    /// 100 MB/s of journal retired every 10 s), at most 64.
    pub spare_segments: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            segment_bytes: 64 << 20,
            record_bytes_max: 4 << 20,
            pending_bytes_max: 32 << 20,
            follow: Duration::from_micros(25),
            spare_segments: 16,
        }
    }
}

impl Config {
    pub(super) fn check(&self) -> Result<(), Error> {
        let room = SEGMENT_HEADER_BYTES + BATCH_HEADER_BYTES + FRAME_HEADER_BYTES + format::ALIGN;
        if self.segment_bytes < 1024
            || self.segment_bytes > 1 << 30
            || u64::from(self.record_bytes_max) + room > self.segment_bytes
        {
            return Err(Error::Invalid(format!(
                "segment_bytes {} must be between 1 KiB and 1 GiB and hold the largest record \
                 (record_bytes_max {}) with {room} bytes of headers",
                self.segment_bytes, self.record_bytes_max
            )));
        }
        if self.spare_segments > 64 {
            return Err(Error::Invalid(format!(
                "spare_segments {} must be at most 64",
                self.spare_segments
            )));
        }
        if self.pending_bytes_max == 0 {
            return Err(Error::Invalid(
                "pending_bytes_max must be above zero".into(),
            ));
        }
        Ok(())
    }
}
