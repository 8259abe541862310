//! Taking and sending a base (docs/ship.md §3.6): a page-exact snapshot of the primary at a known commit,
//! streamed to the receiver, taken without a TRUNCATE checkpoint.
//!
//! 1. Scan the WAL to its end without any lock (most of it), then `BEGIN IMMEDIATE` on
//!    `barrier` and scan the rest (cursor `E`).
//! 2. `BEGIN` on `main` and read `sqlite_master`: the read snapshot is pinned at `E`.
//! 3. `ROLLBACK` the barrier: writers go on; what they commit is seq 1, 2, … of the new
//!    generation.
//! 4. Pick a new random generation; persist the state with `needs_base = true` and the new
//!    generation *before* sending anything, so a restart never reuses a generation for
//!    different content.
//! 5. Stream pages 1..N from `sqlite_dbpage` inside `main`'s read transaction, with a
//!    header and a CRC32C trailer.
//! 6. On 200, `needs_base = false`, acked = 0; persist; end the read transaction.
//!
//! A crash before 6 leaves `needs_base` persisted: the next run takes a new snapshot.

use super::base::{BaseReader, BaseReason};
use super::batch::pack;
use super::client::{Client, Reply};
use super::error::StepError;
use super::files::fingerprint;
use super::track::{Next, Track};
use crate::proto::{BaseHeader, Code, EpochQuery};
use crate::ship_state::{self as state, Fingerprint, ShipState};
use crate::sqlite::WalIndexEnd;
use crate::wal::{self, Cursor, Stop};
use ferry_core::seams::Rng;
use std::io;

/// The end of a WAL scan and the page-1 change counters seen on the way.
type Tail = (Option<Cursor>, Option<(u32, u32)>);

/// What a base snapshot pinned.
struct Snapshot {
    cursor: Option<Cursor>,
    counters: Option<(u32, u32)>,
    page_count: u32,
    page_size: u32,
    fingerprint: Fingerprint,
}

impl Track {
    /// Take a base and send it (docs/ship.md §3.6).
    pub(super) fn send_base(&mut self, client: &Client) -> Result<Next, StepError> {
        let reason = self.base.reason.unwrap_or(BaseReason::First);
        let snap = self.snapshot()?;
        let result = self.send_snapshot(client, &snap, reason);
        let _ = self.files.main.execute_batch("ROLLBACK");
        self.files.ran_statement();
        self.base.progress.clear();
        result
    }

    fn send_snapshot(
        &mut self,
        client: &Client,
        snap: &Snapshot,
        reason: BaseReason,
    ) -> Result<Next, StepError> {
        let generation = self.rng.nonzero_u64();
        self.st = ShipState {
            version: state::VERSION,
            epoch: self.st.epoch,
            generation,
            acked_seq: 0,
            cursor: snap.cursor,
            main: if snap.cursor.is_none() {
                Some(snap.fingerprint)
            } else {
                None
            },
            db: Some(self.files.db),
            needs_base: true,
            counters: snap.counters,
            // The snapshot was pinned at the end SQLite had published.
            published: snap.cursor.map(|c| WalIndexEnd {
                salts: c.salts,
                frame: c.frame,
            }),
        };
        self.save()?;
        let header = BaseHeader {
            page_size: snap.page_size,
            page_count: snap.page_count,
            epoch: self.st.epoch,
            generation,
            seq: 0,
            observed_ms: self.wall_ms(),
            wal_checksum: snap.cursor.map_or(0, |c| pack(c.checksum)),
        };
        let total = header.stream_bytes();
        tracing::info!(db = %self.name, reason = reason.as_str(), pages = snap.page_count, bytes = total, "sending a base");
        self.base.progress.start(total);
        let mut reader = BaseReader::new(&self.files.main, header, self.base.progress.clone());
        let started = self.now();
        let reply = client
            .send_base(
                &self.name,
                EpochQuery {
                    epoch: self.st.epoch.0,
                    generation,
                },
                total,
                &mut reader,
            )
            .map_err(|e| StepError::Peer(e.0))?;
        if let Some(e) = reader.error.take() {
            return Err(StepError::Io(e));
        }
        match reply {
            Reply::Ok(pos) if pos.generation == generation => {
                // Position first, then the durable flag: if saving fails, the base is
                // owed again rather than shipping from a cursor the base already covers.
                self.st.needs_base = false;
                if let Err(e) = self.save() {
                    self.st.needs_base = true;
                    return Err(e);
                }
                let checksum = pack(snap.cursor.map_or(wal::Checksum(0, 0), |c| c.checksum));
                self.based(snap.cursor, checksum);
                *self.stats.bases.entry(reason.as_str()).or_default() += 1;
                self.stats.base_bytes += total;
                let secs = self.now().saturating_duration_since(started).as_secs_f64();
                tracing::info!(db = %self.name, reason = reason.as_str(), bytes = total, secs, "base installed on the receiver");
                Ok(Next::Again)
            }
            Reply::Ok(pos) => Err(StepError::Peer(format!(
                "the receiver answered the base with generation {:#x}, not {generation:#x}",
                pos.generation
            ))),
            Reply::Refused { status, refusal } if refusal.code == Code::Fenced => {
                self.on_refusal(status, refusal)
            }
            Reply::Refused { status, refusal } => Err(StepError::Peer(format!(
                "receiver refused the base (HTTP {status}): {}",
                refusal.error
            ))),
        }
    }

    /// Pin a read snapshot at a known WAL position (docs/ship.md §3.6 steps 1–3). The
    /// read transaction on `main` stays open; the caller ends it.
    fn snapshot(&mut self) -> Result<Snapshot, StepError> {
        // Read most of the WAL before taking the write lock, so writers wait only for the
        // tail that arrives meanwhile.
        let pre = Some(self.scan_to_end(None, false)?);
        self.files.barrier.execute_batch("BEGIN IMMEDIATE")?;
        let pinned = (|| -> Result<Snapshot, StepError> {
            let (cursor, counters) = self.scan_to_end(pre, true)?;
            let main = &self.files.main;
            main.execute_batch("BEGIN")?;
            main.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))?;
            let page_count: u32 = main.query_row("PRAGMA page_count", [], |r| r.get(0))?;
            let page_size: u32 = main.query_row("PRAGMA page_size", [], |r| r.get(0))?;
            let counter = self.files.main_counter()?;
            let counters = match (counter, counters) {
                (Some(c), Some((_, hi))) => Some((c, hi.max(c))),
                (Some(c), None) => Some((c, c)),
                (None, x) => x,
            };
            Ok(Snapshot {
                cursor,
                counters,
                page_count,
                page_size,
                fingerprint: fingerprint(&self.files.path)?,
            })
        })();
        let _ = self.files.barrier.execute_batch("ROLLBACK");
        if pinned.is_err() {
            let _ = self.files.main.execute_batch("ROLLBACK");
        }
        pinned
    }

    /// Scan the current WAL cycle to the end of what SQLite published, keeping only
    /// positions (no page images). Continues from `from` when the cycle is the same and its
    /// cursor still holds. `pinned`: the caller holds the write lock, so that end stands
    /// still and must be read from the wal-index itself, naming this cycle: it is where
    /// the snapshot that follows will read.
    fn scan_to_end(&mut self, from: Option<Tail>, pinned: bool) -> Result<Tail, StepError> {
        let Some(f) = self.files.wal_file()? else {
            return Ok((None, None));
        };
        let Some(Ok(h)) = wal::read_header(f)? else {
            return Ok((None, None));
        };
        if pinned {
            match crate::sqlite::wal_index_end(&self.files.main) {
                // Nothing published: the snapshot reads the main file alone, and whatever
                // the WAL holds (a writer's frames spilled and rolled back, or one that died
                // starting a cycle) is not in it; frames to come start a cycle of their own.
                Some(now) if now.frame == 0 => return Ok((None, None)),
                Some(now) if now.salts == h.salts => {}
                _ => {
                    return Err(StepError::Io(io::Error::other(
                        "SQLite's wal-index cannot be read, or names another cycle than the WAL \
                         with frames published; retrying",
                    )));
                }
            }
        }
        let end = self.published_end(h.salts);
        let f = self.files.wal().expect("wal_file opened it");
        let (mut cursor, mut counters) = (h.start(), None);
        if let Some((Some(c), cs)) = from
            && c.salts == h.salts
            && wal::cursor_holds(f, &c)?
        {
            cursor = c;
            counters = cs;
        }
        let published = wal::Upto {
            src: f,
            len: wal::frame_offset(h.page_size, end.max(cursor.frame) + 1),
        };
        let found = wal::scan(&published, &cursor, wal::POSITIONS_ONLY)?;
        for t in &found.txns {
            for c in &t.page1_counters {
                counters = Some(match counters {
                    Some((lo, hi)) => (lo.min(*c), hi.max(*c)),
                    None => (*c, *c),
                });
            }
        }
        debug_assert!(found.stop == Stop::End, "an unlimited scan ends at the end");
        Ok((Some(found.end), counters))
    }
}
