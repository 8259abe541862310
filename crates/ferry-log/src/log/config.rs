//! A log's limits (docs/log.md §6), checked once when it opens.

use crate::format::{self, BATCH_HEADER_BYTES, FRAME_HEADER_BYTES, SEGMENT_HEADER_BYTES};
use ferry_core::ConfigError;
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

/// The smallest `segment_bytes`: a segment holds its header and at least one batch
/// of one small record, with room to spare.
pub(super) const SEGMENT_BYTES_MIN: u64 = 1 << 10;

/// The largest `segment_bytes`, 1 GiB. A batch's frame length is a u32
/// (docs/log.md §2) and a batch never spans segments, so every batch's length fits it
/// four times over; and each spare kept takes this much disk.
pub(super) const SEGMENT_BYTES_MAX: u64 = 1 << 30;

/// The most retired segments kept as spares: 64 of them is 4 GiB of disk at the
/// default 64 MiB segments, 64 GiB at the largest.
pub(super) const SPARE_SEGMENTS_MAX: usize = 64;

/// What a record takes in a segment besides its payload, at most: the segment's
/// header, its batch's header, its frame's header and the batch's padding (32 + 24 +
/// 9 + 8 = 73 bytes). The largest record must fit in a segment of its own with them.
pub(super) const RECORD_ROOM_BYTES: u64 =
    SEGMENT_HEADER_BYTES + BATCH_HEADER_BYTES + FRAME_HEADER_BYTES + format::ALIGN;

const _: () = assert!(RECORD_ROOM_BYTES < SEGMENT_BYTES_MIN);
const _: () = assert!(SEGMENT_BYTES_MAX <= u32::MAX as u64);

impl Config {
    /// The settings this log cannot use, the first one found, named with its value.
    /// Checked once, before recovery touches anything.
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        if !(SEGMENT_BYTES_MIN..=SEGMENT_BYTES_MAX).contains(&self.segment_bytes) {
            return Err(ConfigError::new(
                "segment_bytes",
                self.segment_bytes,
                format!(
                    "must be between {SEGMENT_BYTES_MIN} (1 KiB) and {SEGMENT_BYTES_MAX} \
                     (1 GiB) bytes"
                ),
            ));
        }
        if u64::from(self.record_bytes_max) + RECORD_ROOM_BYTES > self.segment_bytes {
            return Err(ConfigError::new(
                "record_bytes_max",
                self.record_bytes_max,
                format!(
                    "the largest record, with {RECORD_ROOM_BYTES} bytes of headers and \
                     padding, must fit in one segment (segment_bytes = {}): lower it or \
                     raise segment_bytes",
                    self.segment_bytes
                ),
            ));
        }
        if self.spare_segments > SPARE_SEGMENTS_MAX {
            return Err(ConfigError::new(
                "spare_segments",
                self.spare_segments,
                format!(
                    "must be at most {SPARE_SEGMENTS_MAX} (each spare keeps segment_bytes \
                     of disk)"
                ),
            ));
        }
        if self.pending_bytes_max == 0 {
            return Err(ConfigError::new(
                "pending_bytes_max",
                self.pending_bytes_max,
                "must be above zero: appends wait while this many bytes are not yet \
                 written, so at zero every append would wait for ever",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;
    use ferry_core::{Class, Classify};

    fn refused(config: Config) -> ConfigError {
        config
            .check()
            .expect_err("a setting out of bounds is refused")
    }

    #[test]
    fn the_defaults_and_the_bounds_themselves_are_accepted() {
        Config::default().check().unwrap();
        for segment_bytes in [SEGMENT_BYTES_MIN, SEGMENT_BYTES_MAX] {
            let c = Config {
                segment_bytes,
                record_bytes_max: (SEGMENT_BYTES_MIN - RECORD_ROOM_BYTES) as u32,
                spare_segments: SPARE_SEGMENTS_MAX,
                pending_bytes_max: 1,
                follow: std::time::Duration::ZERO,
            };
            c.check().unwrap();
        }
    }

    #[test]
    fn each_setting_out_of_bounds_is_named_with_its_value() {
        let small = |segment_bytes| Config {
            segment_bytes,
            record_bytes_max: 16,
            ..Config::default()
        };
        for bad in [SEGMENT_BYTES_MIN - 1, SEGMENT_BYTES_MAX + 1] {
            let e = refused(small(bad));
            assert_eq!((e.setting, e.value), ("segment_bytes", bad.to_string()));
        }
        let e = refused(Config {
            segment_bytes: 4096,
            record_bytes_max: (4096 - RECORD_ROOM_BYTES + 1) as u32,
            ..Config::default()
        });
        assert_eq!(e.setting, "record_bytes_max");
        assert!(e.reason.contains("segment_bytes = 4096"), "{e}");
        let e = refused(Config {
            spare_segments: SPARE_SEGMENTS_MAX + 1,
            ..Config::default()
        });
        assert_eq!((e.setting, e.value.as_str()), ("spare_segments", "65"));
        let e = refused(Config {
            pending_bytes_max: 0,
            ..Config::default()
        });
        assert_eq!((e.setting, e.value.as_str()), ("pending_bytes_max", "0"));
    }

    #[test]
    fn a_refused_setting_is_a_permanent_error_of_the_log() {
        let e = Error::from(refused(Config {
            pending_bytes_max: 0,
            ..Config::default()
        }));
        assert_eq!(e.class(), Class::Permanent);
        assert!(e.to_string().contains("pending_bytes_max = 0"), "{e}");
    }
}
