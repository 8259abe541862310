//! What a base is (docs/ship.md §3.6): why one is owed, its progress, and the stream
//! that carries it (header, pages read from `sqlite_dbpage` in a pinned read
//! transaction, trailer). Taking and sending one is `snapshot`'s.

use crate::proto::{self, BaseHeader};
use rusqlite::Connection;
use std::io::{self, Read};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a base was taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum BaseReason {
    /// Nothing was ever shipped (or the state was lost).
    First,
    /// The database file was replaced (new inode, or a foreign change counter).
    Replaced,
    /// The WAL was reset in a way that cannot be proven clean.
    Reset,
    /// The WAL below the cursor changed (a lost unsynced tail, or damage).
    Rewritten,
    /// The peer was away past the WAL cap.
    WalCap,
    /// The receiver has no replica, another generation, or less than was acknowledged.
    PeerLost,
    /// The page size changed.
    PageSize,
}

impl BaseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            BaseReason::First => "first",
            BaseReason::Replaced => "replaced",
            BaseReason::Reset => "reset",
            BaseReason::Rewritten => "rewritten",
            BaseReason::WalCap => "wal_cap",
            BaseReason::PeerLost => "peer_lost",
            BaseReason::PageSize => "page_size",
        }
    }
}

/// A base owed, and one in flight.
#[derive(Debug)]
pub struct BaseOwed {
    /// Why the owed base is owed (for status and metrics); None when none is, or the
    /// reason is the first base.
    pub reason: Option<BaseReason>,
    /// Bytes of the base in flight and its size, shared with status.
    pub progress: Arc<BaseProgress>,
}

/// Streams a base: header, pages from `sqlite_dbpage` in the pinned read transaction,
/// trailer.
pub(super) struct BaseReader<'c> {
    conn: &'c Connection,
    header: BaseHeader,
    head: Vec<u8>,
    next_pgno: u32,
    crc: u32,
    buf: Vec<u8>,
    at: usize,
    done: bool,
    progress: Arc<BaseProgress>,
    pub(super) error: Option<io::Error>,
}

impl<'c> BaseReader<'c> {
    pub(super) fn new(
        conn: &'c Connection,
        header: BaseHeader,
        progress: Arc<BaseProgress>,
    ) -> Self {
        BaseReader {
            conn,
            head: header.encode().to_vec(),
            header,
            next_pgno: 1,
            crc: 0,
            buf: Vec::new(),
            at: 0,
            done: false,
            progress,
            error: None,
        }
    }

    fn refill(&mut self) -> io::Result<()> {
        self.at = 0;
        if !self.head.is_empty() {
            self.buf = std::mem::take(&mut self.head);
            return Ok(());
        }
        if self.next_pgno <= self.header.page_count {
            let page: Vec<u8> = self
                .conn
                .prepare_cached("SELECT data FROM sqlite_dbpage WHERE pgno = ?1")
                .and_then(|mut s| s.query_row([self.next_pgno], |r| r.get(0)))
                .map_err(|e| {
                    io::Error::other(format!("reading page {} for the base: {e}", self.next_pgno))
                })?;
            if page.len() != self.header.page_size as usize {
                return Err(io::Error::other(format!(
                    "page {} has {} bytes, not {}",
                    self.next_pgno,
                    page.len(),
                    self.header.page_size
                )));
            }
            self.crc = crc32c::crc32c_append(self.crc, &page);
            self.buf = page;
            self.next_pgno += 1;
            return Ok(());
        }
        if !self.done {
            self.done = true;
            self.buf = proto::base_trailer(self.crc).to_vec();
            return Ok(());
        }
        self.buf.clear();
        Ok(())
    }
}

impl Read for BaseReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.at >= self.buf.len() {
            if let Err(e) = self.refill() {
                self.error = Some(io::Error::new(e.kind(), e.to_string()));
                return Err(e);
            }
            if self.buf.is_empty() {
                return Ok(0);
            }
        }
        let n = out.len().min(self.buf.len() - self.at);
        out[..n].copy_from_slice(&self.buf[self.at..self.at + n]);
        self.at += n;
        self.progress.sent.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Progress of a base in flight, readable by status while the step runs.
#[derive(Debug, Default)]
pub struct BaseProgress {
    pub sent: AtomicU64,
    /// 0 when no base is in flight.
    pub total: AtomicU64,
}

impl BaseProgress {
    pub(super) fn start(&self, total: u64) {
        self.sent.store(0, Ordering::Relaxed);
        self.total.store(total, Ordering::Relaxed);
    }
    pub(super) fn clear(&self) {
        self.total.store(0, Ordering::Relaxed);
    }
    /// `(sent, total)` while a base is in flight.
    pub fn get(&self) -> Option<(u64, u64)> {
        let total = self.total.load(Ordering::Relaxed);
        (total > 0).then(|| (self.sent.load(Ordering::Relaxed), total))
    }
}
