//! The limits and intervals the shipper's rooms share, each with what happens at it (the
//! scheduler's own pace and polls stay beside it in `shipper`; the wire's limits are in
//! `crate::proto`).

use std::time::Duration;

/// A transaction with more page bytes than this is not copied into memory when scanned;
/// its frames are read again (and verified) when shipped.
pub const TXN_INLINE_BYTES_MAX: u64 = 8 << 20;
/// Page bytes held in memory for transactions not yet acknowledged; scanning pauses at
/// this until acknowledgements come back.
pub const UNACKED_BYTES_MAX: u64 = 64 << 20;
/// Default WAL bytes not acknowledged before the lineage is given up: about 60 s of
/// 1,000 two-frame transactions per second at 4 KiB pages, with room to spare.
pub const WAL_MAX_BYTES: u64 = 1 << 30;
/// Default frames in the WAL before it is folded (SQLite's own autocheckpoint default).
pub const FOLD_MIN_FRAMES: u32 = 1000;
/// Default niceness of the shipper's threads (see `ShipperConfig::nice`).
pub const NICE: i32 = 10;
/// How often a step re-checks what rarely changes: the file's identity, its header's
/// change counter, the `-wal` file's identity, the WAL cap. A step per commit cannot
/// afford a stat of each every time; a file replaced in between fails the continuity
/// proof anyway (its WAL has other salts).
pub(crate) const IDENTITY_INTERVAL: Duration = Duration::from_millis(50);

// Scanning holds at most UNACKED_BYTES_MAX in memory, and a transaction inlined whole
// must fit in it.
const _: () = assert!(TXN_INLINE_BYTES_MAX <= UNACKED_BYTES_MAX);
