//! The appender side (docs/log.md §3): a record goes into the open batch and its
//! position comes back at once; appends wait only while `pending_bytes_max` bytes are
//! appended and not yet written (backpressure).
//!
//! 1. Refuse kind 0 and a payload over `record_bytes_max`, before anything changes.
//! 2. Compute the frame's checksum, with no lock held.
//! 3. Under the lock appends take: refuse if the log is poisoned or closing; wait on
//!    `space` while `pending_bytes_max` is reached (never in a driven log).
//! 4. Copy the frame into the open batch (`Batches::push`), and wake the writer if it
//!    sleeps.
//!
//! Nothing is persisted here: a record is durable once the writer has synced it.

use super::state::Inner;
use crate::format::frame_crc;
use crate::{Error, Lsn};
use ferry_core::sync::lock;

/// See `Log::append`.
pub(super) fn append(inner: &Inner, kind: u8, payload: &[u8]) -> Result<Lsn, Error> {
    if kind == 0 {
        return Err(Error::Invalid("record kind 0 is reserved".into()));
    }
    if payload.len() > inner.config.record_bytes_max as usize {
        return Err(Error::TooLarge {
            len: payload.len(),
            max: inner.config.record_bytes_max,
        });
    }
    let crc = frame_crc(kind, payload);
    let mut guard = lock(&inner.shared);
    loop {
        if let Some(cause) = &guard.poisoned {
            return Err(Error::PreviousIo {
                cause: cause.clone(),
            });
        }
        if guard.closing {
            return Err(Error::Closed);
        }
        if guard.batches.pending_bytes() < inner.config.pending_bytes_max || inner.driven {
            break;
        }
        guard = ferry_core::sync::wait(&inner.space, guard);
    }
    let s = &mut *guard;
    let end = s.batches.push(
        kind,
        crc,
        payload,
        inner.config.segment_bytes,
        &mut s.segments,
    );
    s.stats.records += 1;
    let wake = s.writer_asleep;
    drop(guard);
    if wake {
        inner.work.notify_one();
    }
    Ok(end)
}
