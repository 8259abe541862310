//! The replica: applies the server's messages to a SQLite file and reports where it
//! stands. `docs/sync.md`, "Replica", is the contract; this is its only implementation.
//!
//! A frame is received in these steps:
//!
//! 1. Open it ([`crate::wire::open`]): check the seal, decode, check limits. A refused
//!    frame changes nothing but the gap (step 3); a later protocol changes nothing at
//!    all (the replica waits for an upgrade).
//! 2. Decide where it falls in the chain ([`state::follow`]): a redelivery is
//!    `AlreadyApplied`; a message that does not follow the last applied one (and does not
//!    start a chain) is a `Gap`.
//! 3. A gap is recorded in `_ferry_sync_state.gap` in one small transaction. From then on
//!    nothing applies until a message starts a chain (a full snapshot).
//! 4. Check the message against the replica's schema (names, widths, keys): one that
//!    cannot apply is refused like a bad frame (step 3).
//! 5. Apply it in ONE transaction ([`apply`]): tables, sweep starts, deletes (children
//!    first), upserts (parents first), sweep ends, then the new chain position. Rows the
//!    replica's own constraints or triggers refuse become rejections; rows its own rows
//!    still reference are retired; everything else applies.
//! 6. Report ([`Replica::up`]): the last applied message (with its stamp), the gap, the
//!    rejections not yet reported and, at the end of the chain, per-table digests.
//!
//! What is persisted, all in the replica's own file (WAL, `synchronous=FULL`): the chain
//! position, the gap, the tables' columns, sweep progress, rejections and retirements
//! ([`state::install`] lists the tables). What a crash leaves:
//!
//! - before step 3's or step 5's COMMIT: nothing of the message; the transport did not
//!   get an acknowledgement, so the same frame comes again and applies then;
//! - after step 5's COMMIT, before the report: the message is applied; its redelivery is
//!   `AlreadyApplied`, and the next report carries the position;
//! - after a report, before [`Replica::reported`]: the rejections are reported again
//!   (the server takes them as idempotent, keyed by table and key).
//!
//! Readers on other connections keep reading the previous state until the COMMIT (WAL).

mod apply;
mod codec;
mod digest;
mod live;
mod run;
mod state;
mod status;
mod tables;
mod up;
mod wishes;

pub use live::{Live, LiveStatus, LiveTotals};
pub use run::{Downlink, LinkBack, Position, RunEnd, RunError, RunSettings, TransportError};
pub use state::{SCHEMA_VERSION, install};
pub use status::{ReplicaStatus, Standing, TableRows, read_status};
pub use up::{UPLOAD_ROWS, UpError, UpSettings, UpStatus, UpTurn, Uplink, Uploader, up_status};
pub use wishes::{CarryOut, Direct, Outcome, Round, Wish};

use crate::wire::{Down, Limits, Refused, Up};
use ferry_core::{Class, Classify};
use rusqlite::Connection;
use std::path::Path;
use std::time::Duration;

/// How long the engine's connection waits for another writer before a storage step fails
/// as busy (transient): long enough for a host's short write transactions, short enough
/// that a stuck writer shows up as an error within one report interval of `run`.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// What became of one frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Received {
    /// Applied and committed. `tables`: each part's table and the rows it took (upserts,
    /// deletes and retirements, and rows its sweep removed).
    Applied {
        seq: u64,
        tables: Vec<(String, usize)>,
    },
    /// At or below the last applied message of this epoch: acknowledged, not applied.
    AlreadyApplied { seq: u64 },
    /// Does not follow the chain; nothing applies until a message starts a chain.
    Gap { seq: u64 },
    /// A frame or message that cannot be applied (bad seal, malformed, does not fit the
    /// replica's tables). Nothing applied; recorded as a gap.
    Refused { reason: String },
    /// A later protocol than this build speaks: nothing changes, not even the gap; the
    /// replica needs an upgrade.
    LaterProtocol(u16),
}

/// A replica's SQLite file, with the engine's connection to it.
pub struct Replica {
    conn: Connection,
    seal_key: [u8; 32],
    limits: Limits,
    /// Set after an I/O error: SQLite may not know what reached the disk, so this
    /// connection does no more work and the host reopens (STYLE: no retried fsync).
    broken: bool,
    /// The heard time last written to the file (see [`Replica::heard`]).
    heard_written_ms: Option<u64>,
    /// What carries the server's wishes out ([`Replica::carry_out_wishes`]).
    wish_handler: Box<dyn CarryOut + Send>,
    /// Shared with the uploader: the server is back ([`Replica::set_link_back`]).
    link_back: Option<std::sync::Arc<LinkBack>>,
}

/// A heard time is written at most this often (wall ms): each write is a commit, an
/// fsync under `synchronous=FULL`, and a replica fetching 25 times a second spent as
/// much on recording that it heard the server as on applying what it heard. Status
/// needs seconds (`offline` is a minute of silence by default).
const HEARD_WRITE_EVERY_MS: u64 = 1_000;

impl Replica {
    /// Opens (or creates) the replica's file: WAL, `synchronous=FULL` so a committed
    /// message survives power loss, foreign keys on so a delete its own rows forbid is
    /// seen (and retired), and installs the engine's tables.
    pub fn open(path: &Path, seal_key: [u8; 32]) -> Result<Replica, ReplicaError> {
        let conn = Connection::open(path).map_err(|e| ReplicaError::storage("opening", e))?;
        Replica::with_connection(conn, seal_key)
    }

    /// As [`Replica::open`], over a connection the host opened (the same settings are set).
    pub fn with_connection(conn: Connection, seal_key: [u8; 32]) -> Result<Replica, ReplicaError> {
        conn.busy_timeout(BUSY_TIMEOUT)
            .map_err(|e| ReplicaError::storage("setting the busy timeout", e))?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
            .map_err(|e| ReplicaError::storage("setting WAL mode", e))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(ReplicaError::NotWal { mode });
        }
        conn.execute_batch("PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;")
            .map_err(|e| ReplicaError::storage("setting synchronous and foreign keys", e))?;
        install(&conn)?;
        Ok(Replica {
            conn,
            seal_key,
            limits: Limits::default(),
            broken: false,
            heard_written_ms: None,
            wish_handler: Box::new(Direct),
            link_back: None,
        })
    }

    /// What carries the server's wishes out from now on (by default [`Direct`]: write the
    /// wished columns). The loop offers it every open wish after each turn.
    pub fn set_wish_handler(&mut self, handler: Box<dyn CarryOut + Send>) {
        self.wish_handler = handler;
    }

    /// Shares `link` with the uploader beside this loop ([`Uploader::set_link_back`]):
    /// when either hears the server again after a failure, the other stops waiting out
    /// its backoff.
    pub fn set_link_back(&mut self, link: std::sync::Arc<LinkBack>) {
        self.link_back = Some(link);
    }

    /// Offers each wish not finally answered to the handler and records the answers
    /// (docs/sync-up.md §7); between messages, never inside one.
    pub fn carry_out_wishes(&mut self) -> Result<Round, ReplicaError> {
        wishes::carry_out(
            &self.conn,
            self.wish_handler.as_mut(),
            ferry_core::seams::wall_ms(),
        )
    }

    /// The engine's connection, for the host's reads, functions and hooks. Writing to the
    /// `_ferry_sync_*` tables through it breaks the replica's record of itself.
    pub fn conn(&self) -> &Connection {
        &self.conn
    }

    /// Steps 1 to 5 for one frame as carried. `Ok` means the transport may acknowledge it
    /// (every outcome is settled in the file); `Err` means it must not (nothing changed,
    /// the frame comes again).
    pub fn receive(&mut self, frame: &[u8]) -> Result<Received, ReplicaError> {
        self.check_usable()?;
        match crate::wire::open(frame, &self.seal_key, &self.limits) {
            Ok(down) => self.receive_down(down),
            Err(Refused::LaterProtocol(protocol)) => Ok(Received::LaterProtocol(protocol)),
            Err(refused) => self.refuse(refused.to_string(), None),
        }
    }

    /// Steps 2 to 5 for a message already opened.
    pub fn receive_down(&mut self, down: Down) -> Result<Received, ReplicaError> {
        self.check_usable()?;
        let result = self.receive_checked(down);
        self.note_io(&result);
        result
    }

    fn receive_checked(&mut self, down: Down) -> Result<Received, ReplicaError> {
        let now = state::State::read(&self.conn)?;
        let seq = down.head.seq;
        match state::follow(&now, &down.head) {
            state::Step::AlreadyApplied => Ok(Received::AlreadyApplied { seq }),
            state::Step::Gap => {
                state::record_gap(&self.conn, seq)?;
                Ok(Received::Gap { seq })
            }
            state::Step::Apply { start } => {
                if let Err(reason) = tables::check_message(&self.conn, &down)? {
                    return self.refuse(reason, Some(seq));
                }
                let taken = apply::apply(&self.conn, &down, start, ferry_core::seams::wall_ms())?;
                Ok(Received::Applied { seq, tables: taken })
            }
        }
    }

    /// Frames that follow each other, applied in ONE transaction (one commit, one fsync
    /// under `synchronous=FULL`, instead of one per message) when every one opens, follows
    /// the chain (or was applied already) and applies cleanly: `Some` with what each did.
    /// Anything else (a refusal, a gap, a later protocol, a row whose trigger rolls back)
    /// rolls the whole transaction back and answers `None`, having applied nothing: the
    /// caller receives the frames one at a time, which handles each case. Each message is
    /// still applied whole or not at all; a crash before the commit leaves none of them.
    pub fn receive_many(
        &mut self,
        frames: &[Vec<u8>],
    ) -> Result<Option<Vec<Received>>, ReplicaError> {
        self.check_usable()?;
        let result = self.receive_many_inner(frames);
        if !self.conn.is_autocommit() {
            // Anything but a commit ends here: nothing of the batch remains.
            let _ = self.conn.execute_batch("ROLLBACK");
        }
        self.note_io(&result);
        result
    }

    fn receive_many_inner(
        &mut self,
        frames: &[Vec<u8>],
    ) -> Result<Option<Vec<Received>>, ReplicaError> {
        let s = |e| ReplicaError::storage("applying messages", e);
        self.conn.execute_batch("BEGIN IMMEDIATE").map_err(s)?;
        let mut received = Vec::with_capacity(frames.len());
        for frame in frames {
            let Ok(down) = crate::wire::open(frame, &self.seal_key, &self.limits) else {
                return Ok(None);
            };
            let now = state::State::read(&self.conn)?;
            let seq = down.head.seq;
            match state::follow(&now, &down.head) {
                state::Step::AlreadyApplied => received.push(Received::AlreadyApplied { seq }),
                state::Step::Gap => return Ok(None),
                state::Step::Apply { start } => {
                    if tables::check_message(&self.conn, &down)?.is_err() {
                        return Ok(None);
                    }
                    let now_ms = ferry_core::seams::wall_ms();
                    match apply::apply_nested(&self.conn, &down, start, now_ms)? {
                        Some(tables) => received.push(Received::Applied { seq, tables }),
                        None => return Ok(None),
                    }
                }
            }
        }
        self.conn
            .execute_batch("COMMIT")
            .map_err(|e| ReplicaError::storage("committing messages", e))?;
        Ok(Some(received))
    }

    /// A frame or message that cannot apply: the chain cannot continue past it, so it is a
    /// gap at its seq (or, unknown, the next one), unless a gap is already recorded.
    fn refuse(&mut self, reason: String, seq: Option<u64>) -> Result<Received, ReplicaError> {
        let result = (|| {
            let now = state::State::read(&self.conn)?;
            state::record_gap(&self.conn, seq.unwrap_or(now.seq.saturating_add(1)))?;
            Ok(Received::Refused { reason })
        })();
        self.note_io(&result);
        result
    }

    /// Step 6: the report, with digests when the replica is at the end of its chain as far
    /// as it knows (no gap, no sweep under way).
    pub fn up(&self) -> Result<Up, ReplicaError> {
        digest::up(&self.conn, true)
    }

    /// The report without digests, which read every synced row: for the frequent reports
    /// between digests.
    pub fn up_without_digests(&self) -> Result<Up, ReplicaError> {
        digest::up(&self.conn, false)
    }

    /// The transport took `up`: its rejections are reported (each unless a later message
    /// refused the same row again since).
    pub fn reported(&mut self, up: &Up) -> Result<(), ReplicaError> {
        self.check_usable()?;
        let result = digest::reported(&self.conn, up);
        self.note_io(&result);
        result
    }

    /// The transport answered at `at_ms` (wall time): what `status` shows as heard,
    /// written at most once per [`HEARD_WRITE_EVERY_MS`] (at once when the clock moved
    /// back).
    pub fn heard(&mut self, at_ms: u64) -> Result<(), ReplicaError> {
        self.check_usable()?;
        if self
            .heard_written_ms
            .is_some_and(|w| at_ms >= w && at_ms - w < HEARD_WRITE_EVERY_MS)
        {
            return Ok(());
        }
        let result = state::record_heard(&self.conn, at_ms);
        self.note_io(&result);
        if result.is_ok() {
            self.heard_written_ms = Some(at_ms);
        }
        result
    }

    /// Where the replica stands, for people and health checks.
    pub fn status(&self) -> Result<ReplicaStatus, ReplicaError> {
        status::status(&self.conn)
    }

    fn check_usable(&self) -> Result<(), ReplicaError> {
        if self.broken {
            return Err(ReplicaError::PreviousIo);
        }
        Ok(())
    }

    fn note_io<T>(&mut self, result: &Result<T, ReplicaError>) {
        if let Err(e) = result
            && e.is_io()
        {
            self.broken = true;
        }
    }
}

/// Why the replica could not do what it was asked. Refused frames and rows are values
/// (`Received`, rejections), not errors: an error means nothing changed.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("replica storage failed while {doing}: {source}")]
    Storage {
        doing: &'static str,
        #[source]
        source: rusqlite::Error,
    },
    #[error(
        "the replica file's engine tables are version {found}, later than this build knows \
         ({known}); run a ferry that knows version {found}, or restore the file"
    )]
    LaterSchema { found: i64, known: i64 },
    #[error(
        "the replica file could not be put in WAL mode (it stays {mode}); use a file on a \
         local file system, not an in-memory database"
    )]
    NotWal { mode: String },
    #[error("the replica file's engine state is damaged: {0}; reprovision the replica")]
    Damaged(String),
    #[error(
        "an earlier I/O error left this replica connection unsure of what reached the disk; \
         reopen the replica"
    )]
    PreviousIo,
}

impl ReplicaError {
    pub(crate) fn storage(doing: &'static str, source: rusqlite::Error) -> ReplicaError {
        ReplicaError::Storage { doing, source }
    }

    fn is_io(&self) -> bool {
        matches!(self, ReplicaError::Storage { source, .. }
            if source.sqlite_error_code() == Some(rusqlite::ErrorCode::SystemIoFailure))
    }
}

impl Classify for ReplicaError {
    fn class(&self) -> Class {
        match self {
            ReplicaError::Storage { source, .. } => sqlite_class(source),
            ReplicaError::LaterSchema { .. } | ReplicaError::NotWal { .. } => Class::Permanent,
            ReplicaError::PreviousIo => Class::Permanent,
            ReplicaError::Damaged(_) => Class::Corrupted,
        }
    }
}

/// Storage failures a retry can cure (full disk, I/O, a busy lock, a read-only moment)
/// are transient; a damaged file is corrupted; the rest (SQL the replica's schema does not
/// accept) needs a person.
fn sqlite_class(e: &rusqlite::Error) -> Class {
    use rusqlite::ErrorCode as C;
    match e.sqlite_error_code() {
        Some(
            C::DiskFull
            | C::SystemIoFailure
            | C::DatabaseBusy
            | C::DatabaseLocked
            | C::ReadOnly
            | C::OutOfMemory
            | C::CannotOpen
            | C::OperationInterrupted,
        ) => Class::Transient,
        Some(C::DatabaseCorrupt | C::NotADatabase) => Class::Corrupted,
        Some(_) => Class::Permanent,
        None => match e {
            rusqlite::Error::InvalidColumnType(..)
            | rusqlite::Error::FromSqlConversionFailure(..)
            | rusqlite::Error::IntegralValueOutOfRange(..) => Class::Corrupted,
            _ => Class::Permanent,
        },
    }
}
