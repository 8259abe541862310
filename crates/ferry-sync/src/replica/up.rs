//! The way up, replica side (docs/sync-up.md §3): the app's writes to the tables the
//! replica writes are noted by triggers, uploaded as the rows are at upload time, and
//! forgotten on the `Filed` that names their latest send; what was filed stays in a
//! bounded journal, uploaded again when the server says it lost filings.
//!
//! An upload, per lane, in these steps:
//!
//! 1. In one read transaction: read up to [`UPLOAD_ROWS`] notes of the lane (journal
//!    entries to restate first) with the `noted` count of each, and each noted row as
//!    it is now; give the upload an id above the last one sent and above the clock in microseconds.
//! 2. Send it ([`Uplink::upload`]); the answer is a sealed `Filed` naming the id.
//! 3. In one write transaction: forget the notes whose `noted` is still what step 1
//!    read (one written again since stays, and goes up again) and journal their rows
//!    under the `Filed`'s count; set aside the rows it refused; store the count; if it
//!    asks, note the journal's entries after its "refile after" again.
//!
//! Nothing is written before the send, so what a crash leaves is the notes, before or
//! after the server filed them: the next turn sends them again under a new id, read
//! afresh, and filing them again changes nothing. Notes are forgotten only in step 3,
//! after a sealed `Filed`. The uploader's commits are not fsynced each
//! (`synchronous=NORMAL`): losing the last of them to a power cut is the same case.
//!
//! Tables (created with the engine's others, `state::install`):
//! - `_ferry_sync_writes`: the tables this replica writes, with their lane;
//! - `_ferry_sync_two_way`: of those, the two-way tables: the columns an upload carries
//!   (the key and the replica's), and how many edits the server dropped;
//! - `_ferry_sync_up`: one note per (table, key): the key as a JSON array, its lane,
//!   `noted` (a count each write raises), whether to send the journal's copy, and why
//!   the row is set aside;
//! - `_ferry_sync_journal`: what was filed, newest per row, under its filing count;
//! - `_ferry_sync_reach`: the highest filing count the journal's bound pruned, and the
//!   filings a restored server lost that the journal no longer held (an alarm);
//! - `_ferry_sync_filed`: the last filing count the server told, and the build that set
//!   rows aside (a new build tries them again).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rusqlite::{Connection, OptionalExtension, params};

use super::codec;
use super::run::{Side, TransportError};
use super::{ReplicaError, tables};
use crate::value::Value;
use crate::wire::{self, Column, TablePart};
use ferry_core::backoff::Backoff;
use ferry_core::seams::SplitMix64;
use ferry_core::{Class, Classify};

/// Rows per upload: the server's limit ([`wire::UPLOAD_ROWS_MAX`]), so one upload is
/// one filing transaction of at most that many rows.
pub const UPLOAD_ROWS: usize = wire::UPLOAD_ROWS_MAX;

/// The transport, replica side, for the way up.
pub trait Uplink {
    /// Sends an encoded upload ([`wire::encode_upload`]); the answer is the server's
    /// encoded, sealed `Filed`.
    fn upload(&mut self, upload: &[u8]) -> Result<Vec<u8>, TransportError>;
}

/// The uploader's settings.
#[derive(Clone, Debug)]
pub struct UpSettings {
    /// How often the uploader looks for the app's writes (`PRAGMA data_version`, which
    /// changes when another connection commits: a look costs no table read).
    pub poll: Duration,
    /// With nothing to send, an empty upload this often, while the journal holds
    /// anything: it carries the filing count, so a server restored from an older copy
    /// is found even when the replica writes nothing.
    pub keepalive: Duration,
    /// Journal rows kept (docs/sync-up.md §3.3).
    pub journal_rows: u64,
    pub backoff: Backoff,
}

impl Default for UpSettings {
    fn default() -> UpSettings {
        UpSettings {
            poll: Duration::from_millis(10),
            keepalive: Duration::from_secs(60),
            journal_rows: 100_000,
            backoff: super::run::BACKOFF,
        }
    }
}

/// The build that last set rows aside: a new one tries them again.
const BUILD: &str = env!("CARGO_PKG_VERSION");

pub(crate) const TABLES: &str = "
CREATE TABLE IF NOT EXISTS _ferry_sync_writes(
    tbl TEXT PRIMARY KEY,
    lane TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS _ferry_sync_two_way(
    tbl TEXT PRIMARY KEY,
    columns TEXT NOT NULL,
    dropped INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS _ferry_sync_up(
    tbl TEXT NOT NULL,
    key TEXT NOT NULL,
    lane TEXT NOT NULL,
    noted INTEGER NOT NULL DEFAULT 1,
    from_journal INTEGER NOT NULL DEFAULT 0,
    aside TEXT,
    UNIQUE(tbl, key));
CREATE TABLE IF NOT EXISTS _ferry_sync_journal(
    tbl TEXT NOT NULL,
    key TEXT NOT NULL,
    n INTEGER NOT NULL,
    row BLOB,
    PRIMARY KEY(tbl, key)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS _ferry_sync_journal_n ON _ferry_sync_journal(n);
CREATE TABLE IF NOT EXISTS _ferry_sync_reach(
    one INTEGER PRIMARY KEY CHECK(one = 1),
    pruned_to INTEGER NOT NULL DEFAULT 0,
    lost_from INTEGER,
    lost_to INTEGER,
    at_ms INTEGER);
INSERT OR IGNORE INTO _ferry_sync_reach(one) VALUES (1);
CREATE TABLE IF NOT EXISTS _ferry_sync_filed(
    one INTEGER PRIMARY KEY CHECK(one = 1),
    n INTEGER NOT NULL DEFAULT 0,
    build TEXT);
INSERT OR IGNORE INTO _ferry_sync_filed(one) VALUES (1);
";

/// Creates table `part` (the replica writes it, or columns of it) if missing, records its
/// lane, and (re)creates the triggers that note the app's writes to it. Inside the apply
/// transaction.
pub(crate) fn announce(
    conn: &Connection,
    part: &TablePart,
    writes: &wire::Writes,
) -> rusqlite::Result<()> {
    let lane = writes.lane.as_str();
    let server_columns = part.columns.len() - writes.owned;
    tables::ensure_with(conn, part, server_columns)?;
    conn.execute(
        "INSERT INTO _ferry_sync_writes(tbl, lane) VALUES (?1, ?2)
         ON CONFLICT(tbl) DO UPDATE SET lane = excluded.lane",
        params![part.table, lane],
    )?;
    let t = tables::quote(&part.table);
    for event in ["insert", "update", "delete"] {
        let name = tables::quote(&format!("_ferry_sync_up_{event}_{}", part.table));
        conn.execute_batch(&format!("DROP TRIGGER IF EXISTS {name};"))?;
    }
    if writes.owned > 0 {
        return announce_two_way(conn, part, server_columns, lane);
    }
    conn.execute(
        "DELETE FROM _ferry_sync_two_way WHERE tbl = ?1",
        [&part.table],
    )?;
    let note = |row: &str| note_sql(part, lane, row);
    for (event, body) in [
        ("insert", note("NEW")),
        // A key change notes the old key too: it reads as gone, and goes up as a delete.
        ("update", format!("{} {}", note("NEW"), note("OLD"))),
        ("delete", note("OLD")),
    ] {
        let name = tables::quote(&format!("_ferry_sync_up_{event}_{}", part.table));
        conn.execute_batch(&format!(
            "CREATE TRIGGER {name} AFTER {} ON {t} BEGIN {body} END;",
            event.to_uppercase()
        ))?;
    }
    Ok(())
}

/// The statement a trigger runs to note row `row`'s key (`NEW` or `OLD`) of `part`.
fn note_sql(part: &TablePart, lane: &str, row: &str) -> String {
    let keys = tables::key_columns(&part.columns)
        .map(|c| format!("{row}.{}", tables::quote(&c.name)))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "INSERT INTO _ferry_sync_up(tbl, key, lane) VALUES ({}, json_array({keys}), {})
         ON CONFLICT(tbl, key) DO UPDATE SET noted = noted + 1, lane = excluded.lane,
         from_journal = CASE from_journal WHEN {RESTATE} THEN {RESTATE} ELSE 0 END, aside = NULL;",
        sql_text(&part.table),
        sql_text(lane)
    )
}

/// A two-way table (docs/sync-up.md §3.1): the replica's columns are the part's after
/// the first `server_columns`. One trigger notes an update that changes any of them;
/// the server's rows come and go by messages, which set only the server's columns.
fn announce_two_way(
    conn: &Connection,
    part: &TablePart,
    server_columns: usize,
    lane: &str,
) -> rusqlite::Result<()> {
    let owned = &part.columns[server_columns..];
    let uploaded: Vec<Column> = tables::key_columns(&part.columns)
        .chain(owned)
        .cloned()
        .collect();
    conn.execute(
        "INSERT INTO _ferry_sync_two_way(tbl, columns) VALUES (?1, ?2)
         ON CONFLICT(tbl) DO UPDATE SET columns = excluded.columns",
        params![part.table, tables::columns_json(&uploaded)],
    )?;
    let names: Vec<String> = owned.iter().map(|c| tables::quote(&c.name)).collect();
    let changed: Vec<String> = names
        .iter()
        .map(|c| format!("OLD.{c} IS NOT NEW.{c}"))
        .collect();
    let name = tables::quote(&format!("_ferry_sync_up_update_{}", part.table));
    conn.execute_batch(&format!(
        "CREATE TRIGGER {name} AFTER UPDATE OF {} ON {} WHEN {} BEGIN {} END;",
        names.join(", "),
        tables::quote(&part.table),
        changed.join(" OR "),
        note_sql(part, lane, "NEW")
    ))
}

/// `_ferry_sync_up.from_journal` of a note that sends the live row, restated: it wins on
/// the server whatever its version (docs/sync-up.md §7). 1 sends the journal's copy.
const RESTATE: i64 = 2;

/// On a chain start, notes every row of a table announced with `restate` again (of a
/// two-way table, the rows where the replica wrote something), marked restated: a
/// server or replica restored from an older copy gets the replica's settings and
/// answers as they are. Inside the apply transaction.
pub(crate) fn restate(
    conn: &Connection,
    part: &TablePart,
    writes: &wire::Writes,
) -> rusqlite::Result<usize> {
    let keys = tables::key_columns(&part.columns)
        .map(|c| tables::quote(&c.name))
        .collect::<Vec<_>>()
        .join(", ");
    let owned: Vec<String> = part.columns[part.columns.len() - writes.owned..]
        .iter()
        .map(|c| format!("{} IS NOT NULL", tables::quote(&c.name)))
        .collect();
    let filter = if owned.is_empty() {
        "1".to_string()
    } else {
        owned.join(" OR ")
    };
    conn.execute(
        &format!(
            "INSERT INTO _ferry_sync_up(tbl, key, lane, from_journal)
             SELECT ?1, json_array({keys}), ?2, {RESTATE} FROM {} WHERE {filter}
             ON CONFLICT(tbl, key) DO UPDATE SET noted = noted + 1, lane = excluded.lane,
             from_journal = {RESTATE}, aside = NULL",
            tables::quote(&part.table)
        ),
        params![part.table, writes.lane],
    )
}

fn sql_text(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// Why the uploader stopped.
#[derive(Debug, thiserror::Error)]
pub enum UpError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Replica(#[from] ReplicaError),
}

impl Classify for UpError {
    fn class(&self) -> Class {
        match self {
            UpError::Transport(e) => e.class(),
            UpError::Replica(e) => e.class(),
        }
    }
}

/// What the way up stands at, for status.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UpStatus {
    /// Rows written and not yet filed.
    pub unfiled: u64,
    /// Rows set aside: refused for good by the server or the transport.
    pub set_aside: u64,
    /// Rows in the journal.
    pub journal: u64,
    /// The last filing count the server told.
    pub filed_n: u64,
    /// Edits of two-way rows the server dropped: it had deleted the row or taken it back.
    pub dropped: u64,
    /// An alarm: the filings (from, to) a restored server lost that the journal no
    /// longer held, so their rows could not be sent again (docs/sync-up.md §6).
    pub beyond_journal: Option<(u64, u64)>,
}

/// The uploader: its own connection to the replica's file, beside the apply loop's.
pub struct Uploader {
    conn: Connection,
    seal_key: [u8; 32],
    replica: [u8; 16],
    /// Per lane, the rows the next upload may take: halved after a permanent refusal
    /// until one row is isolated (docs/sync-up.md §3.2).
    limit: BTreeMap<String, usize>,
    /// The transport took something since the last permanent refusal: a refusal of one
    /// row then means that row, not a dead transport.
    took_since_refusal: bool,
    last_sent: Option<Instant>,
    /// The id of the last upload sent, or the newest a stale answer named: the next is
    /// above both it and the clock (in microseconds), so ids rise across restarts.
    last_id: u64,
    /// Shared with the fetch loop: the server is back ([`Uploader::set_link_back`]).
    link_back: Option<std::sync::Arc<super::LinkBack>>,
    /// The server answered a send since the turn began (to tell the fetch loop).
    answered: bool,
}

/// What one turn did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UpTurn {
    /// Rows the server filed (or refused for good) in this turn.
    pub filed: usize,
    /// Lanes with notes still waiting after this turn.
    pub more: bool,
}

impl Uploader {
    /// Opens the replica's file (the engine's tables installed, as [`super::Replica::open`]
    /// does) for replica `replica` with its seal key.
    pub fn open(
        path: &std::path::Path,
        seal_key: [u8; 32],
        replica: uuid::Uuid,
    ) -> Result<Uploader, ReplicaError> {
        let conn = Connection::open(path).map_err(|e| ReplicaError::storage("opening", e))?;
        conn.busy_timeout(super::BUSY_TIMEOUT)
            .map_err(|e| ReplicaError::storage("setting the busy timeout", e))?;
        // NORMAL: this connection's commits (forgetting notes, the journal) are not
        // fsynced each. A power loss may undo the last of them, which brings the notes
        // back and sends them again, and filing them again changes nothing; what the app
        // wrote is its own connection's commit, as durable as the app made it.
        conn.execute_batch("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;")
            .map_err(|e| ReplicaError::storage("setting WAL mode", e))?;
        super::install(&conn)?;
        let s = |e| ReplicaError::storage("reading the way up's state", e);
        let build: Option<String> = conn
            .query_row("SELECT build FROM _ferry_sync_filed", [], |r| r.get(0))
            .map_err(s)?;
        if build.as_deref().is_some_and(|b| b != BUILD) {
            // A new build may file what the last one could not (docs/sync-up.md §1, 4).
            conn.execute_batch(
                "UPDATE _ferry_sync_up SET aside = NULL WHERE aside IS NOT NULL;
                 UPDATE _ferry_sync_filed SET build = NULL;",
            )
            .map_err(s)?;
        }
        Ok(Uploader {
            conn,
            seal_key,
            replica: *replica.as_bytes(),
            limit: BTreeMap::new(),
            took_since_refusal: true,
            last_sent: None,
            last_id: 0,
            link_back: None,
            answered: false,
        })
    }

    /// Shares `link` with the fetch loop beside this uploader
    /// ([`super::Replica::set_link_back`]): when either hears the server again after a
    /// failure, the other stops waiting out its backoff.
    pub fn set_link_back(&mut self, link: std::sync::Arc<super::LinkBack>) {
        self.link_back = Some(link);
    }

    /// The next upload's id: above the last one and the clock (docs/sync-up.md §4.2).
    fn next_id(&mut self) -> u64 {
        let now = ferry_core::seams::wall_ms().saturating_mul(1_000);
        self.last_id = (self.last_id + 1).max(now);
        self.last_id
    }

    /// Uploads until `stop` is set: a turn whenever another connection committed (the
    /// app wrote, or the apply loop applied), at least every `keepalive` while the journal
    /// holds anything, and after a failure a backoff. Permanent failures end it.
    pub fn run(
        &mut self,
        link: &mut dyn Uplink,
        stop: &AtomicBool,
        settings: &UpSettings,
    ) -> Result<(), UpError> {
        let mut rng = SplitMix64::from_entropy();
        let mut seen: Option<i64> = None;
        let mut epoch = self.epoch()?;
        let mut failures = 0u32;
        while !stop.load(Ordering::SeqCst) {
            let version = self.data_version()?;
            let mut keepalive_due = self
                .last_sent
                .is_none_or(|t| t.elapsed() >= settings.keepalive);
            if seen == Some(version) && failures == 0 && !keepalive_due {
                std::thread::sleep(settings.poll);
                continue;
            }
            seen = Some(version);
            // A new epoch down means the server was restored from an older copy (or
            // installed afresh): check its filing count now, not at the next keepalive.
            let now = self.epoch()?;
            if now != epoch {
                keepalive_due |= epoch.is_some();
                epoch = now;
            }
            // The fetch loop's count before this turn: news after it ends a backoff.
            let heard = self.link_back.as_ref().map(|b| b.other(Side::Up));
            self.answered = false;
            // A keepalive's check fails as a turn does: through the backoff, never out
            // of the loop (a store idle offline with a journal would stop its replica).
            let result = match self.turn(link, settings) {
                Ok(turn) if turn.more => Ok(true), // go on at once
                Ok(turn) if keepalive_due && turn.filed == 0 => self.check_server(link),
                Ok(_) => Ok(false),
                Err(e) => Err(e),
            };
            match result {
                Ok(go_on) => {
                    if failures > 0
                        && self.answered
                        && let Some(back) = &self.link_back
                    {
                        back.heard(Side::Up);
                    }
                    failures = 0;
                    if go_on {
                        seen = None; // the rest, or the journal's entries, at once
                    }
                }
                Err(e) if e.is_transient() => {
                    failures = failures.saturating_add(1);
                    let wait = settings.backoff.delay(failures, &mut rng);
                    tracing::warn!(error = %e, ?wait, "uploading failed; trying again after a backoff");
                    let back =
                        (self.link_back.as_deref().zip(heard)).map(|(b, s)| (b, Side::Up, s));
                    super::run::pause_unless_back(stop, wait, back);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// The epoch of the chain the replica follows, as the apply loop last wrote it.
    fn epoch(&self) -> Result<Option<Vec<u8>>, ReplicaError> {
        self.conn
            .query_row("SELECT epoch FROM _ferry_sync_state", [], |r| r.get(0))
            .map_err(|e| ReplicaError::storage("reading the epoch", e))
    }

    fn data_version(&self) -> Result<i64, ReplicaError> {
        self.conn
            .query_row("PRAGMA data_version", [], |r| r.get(0))
            .map_err(|e| ReplicaError::storage("reading data_version", e))
    }

    /// One upload per lane with notes waiting (docs/sync-up.md §3.2).
    pub fn turn(
        &mut self,
        link: &mut dyn Uplink,
        settings: &UpSettings,
    ) -> Result<UpTurn, UpError> {
        let lanes: Vec<String> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT DISTINCT lane FROM _ferry_sync_up WHERE aside IS NULL ORDER BY lane",
                )
                .map_err(|e| ReplicaError::storage("reading lanes", e))?;
            stmt.query_map([], |r| r.get(0))
                .and_then(|rows| rows.collect::<rusqlite::Result<_>>())
                .map_err(|e| ReplicaError::storage("reading lanes", e))?
        };
        let mut out = UpTurn::default();
        for lane in lanes {
            let limit = *self.limit.get(&lane).unwrap_or(&UPLOAD_ROWS);
            let Some(batch) = self.read_batch(&lane, limit)? else {
                continue;
            };
            let n = batch.notes.len();
            match self.send(link, &batch) {
                Ok(filed) if filed.stale.is_some() => {
                    // Older than an upload the server filed (a transport delivered it
                    // late, or this file was restored): nothing filed, nothing
                    // forgotten; the rows go again now, under an id past the newest.
                    let newest = filed.stale.unwrap_or_default();
                    tracing::info!(
                        lane,
                        id = batch.id,
                        newest,
                        "an upload was stale; sending its rows again"
                    );
                    self.last_id = self.last_id.max(newest);
                    out.more = true;
                }
                Ok(filed) => {
                    self.took_since_refusal = true;
                    self.limit.remove(&lane);
                    self.settle(&batch, &filed, settings)?;
                    out.filed += n;
                    // A full upload leaves more; a server that lost filings has the
                    // journal's entries noted again, to send now.
                    out.more |= n == limit || filed.refile_after > 0;
                }
                Err(TransportError::Refused(reason)) if n > 1 => {
                    // Halve until the row the transport refuses is alone.
                    self.took_since_refusal = false;
                    self.limit.insert(lane.clone(), n / 2);
                    tracing::warn!(lane, rows = n, %reason, "an upload was refused; halving it to find the row");
                    out.more = true;
                }
                Err(TransportError::Refused(reason)) if self.took_since_refusal => {
                    self.took_since_refusal = false;
                    self.set_aside(&batch, &reason)?;
                    self.limit.remove(&lane);
                    out.more = true;
                }
                // One row refused while the transport took nothing else: the transport
                // may be what is broken, so nothing is set aside.
                Err(TransportError::Refused(reason)) => {
                    return Err(TransportError::Unavailable(format!(
                        "the server refused an upload of one row and nothing else got through since: {reason}"
                    ))
                    .into());
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// An empty upload, while the journal holds anything: the filing count alone, so a
    /// server that lost filings (restored from an older copy) is found and answered with
    /// the journal after its count. `run` does this every `keepalive`, and when the
    /// replica's epoch changes. `Ok(true)`: the server lost filings, and the journal's
    /// entries after its count wait to be sent.
    pub fn check_server(&mut self, link: &mut dyn Uplink) -> Result<bool, UpError> {
        let journal: i64 = self
            .conn
            .query_row("SELECT count(*) FROM _ferry_sync_journal", [], |r| r.get(0))
            .map_err(|e| ReplicaError::storage("reading the journal", e))?;
        if journal == 0 {
            self.last_sent = Some(Instant::now());
            return Ok(false);
        }
        let mut filed = None;
        for _ in 0..2 {
            let batch = Batch {
                id: self.next_id(),
                lane: crate::rules::LANE_DEFAULT.to_string(),
                restated: false,
                notes: Vec::new(),
                parts: Vec::new(),
            };
            let answer = self.send(link, &batch)?;
            match answer.stale {
                // Behind the server's newest (this file restored): once more, past it.
                Some(newest) => self.last_id = self.last_id.max(newest),
                None => {
                    self.settle(&batch, &answer, &UpSettings::default())?;
                    filed = Some(answer);
                    break;
                }
            }
        }
        Ok(filed.is_some_and(|f| f.refile_after > 0))
    }

    /// Step 1.
    fn read_batch(&mut self, lane: &str, limit: usize) -> Result<Option<Batch>, ReplicaError> {
        let s = |e| ReplicaError::storage("reading what to upload", e);
        // One read transaction: the `noted` counts and the rows are one snapshot, so a
        // note whose count is unchanged at the Filed was sent as it stands.
        self.conn.execute_batch("BEGIN").map_err(s)?;
        let result = self.read_batch_in_tx(lane, limit);
        let ended = self.conn.execute_batch("COMMIT").map_err(s);
        let batch = result?;
        ended?;
        Ok(batch)
    }

    fn read_batch_in_tx(
        &mut self,
        lane: &str,
        limit: usize,
    ) -> Result<Option<Batch>, ReplicaError> {
        let s = |e| ReplicaError::storage("reading what to upload", e);
        // Rows to restate go first, in uploads of their own (flagged restated): journal
        // copies (1), then live rows (RESTATE).
        let from: i64 = self
            .conn
            .query_row(
                "SELECT coalesce(min(from_journal), 0) FROM _ferry_sync_up
                 WHERE lane = ?1 AND aside IS NULL AND from_journal > 0",
                [lane],
                |r| r.get(0),
            )
            .map_err(s)?;
        let restated = from > 0;
        let notes: Vec<Note> = {
            let mut stmt = self
                .conn
                .prepare_cached(
                    "SELECT rowid, tbl, key, noted FROM _ferry_sync_up
                     WHERE lane = ?1 AND aside IS NULL AND from_journal = ?2 ORDER BY rowid LIMIT ?3",
                )
                .map_err(s)?;
            stmt.query_map(params![lane, from, limit as i64], |r| {
                Ok(Note {
                    rowid: r.get(0)?,
                    table: r.get(1)?,
                    key: r.get(2)?,
                    noted: r.get(3)?,
                })
            })
            .and_then(|rows| rows.collect::<rusqlite::Result<_>>())
            .map_err(s)?
        };
        if notes.is_empty() {
            return Ok(None);
        }
        let recorded: BTreeMap<String, Vec<Column>> =
            tables::recorded(&self.conn)?.into_iter().collect();
        let two_ways = two_way_columns(&self.conn)?;
        let mut parts: BTreeMap<String, TablePart> = BTreeMap::new();
        for note in &notes {
            let two_way = two_ways.contains_key(&note.table);
            let Some(columns) = two_ways.get(&note.table).or(recorded.get(&note.table)) else {
                continue; // a table the server no longer announces: the note waits
            };
            let part = parts
                .entry(note.table.clone())
                .or_insert_with(|| TablePart {
                    table: note.table.clone(),
                    columns: columns.clone(),
                    sweep: wire::Sweep::default(),
                    deletes: Vec::new(),
                    upserts: Vec::new(),
                    writes: None,
                });
            let row = if from == 1 {
                self.journal_row(note)?
            } else {
                self.live_row(note, columns)?
            };
            match row {
                Some(row) => part.upserts.push(row),
                None if !two_way => part.deletes.push(key_values(&note.key)),
                // A two-way row the server took back or deleted: nothing to send, and the
                // note is forgotten with the rest of the upload's.
                None => {}
            }
        }
        Ok(Some(Batch {
            id: self.next_id(),
            lane: lane.to_string(),
            restated,
            notes,
            parts: parts
                .into_values()
                .filter(|p| !p.upserts.is_empty() || !p.deletes.is_empty())
                .collect(),
        }))
    }

    /// The row as it is now, or `None` when it is gone.
    fn live_row(
        &self,
        note: &Note,
        columns: &[Column],
    ) -> Result<Option<Vec<Value>>, ReplicaError> {
        let all: Vec<&Column> = columns.iter().collect();
        let sql = format!(
            "{} WHERE {}",
            tables::select_sql(&note.table, &all),
            json_key_match(columns)
        );
        let mut stmt = self
            .conn
            .prepare_cached(&sql)
            .map_err(|e| ReplicaError::storage("reading a row to upload", e))?;
        stmt.query_row([&note.key], |r| {
            (0..columns.len())
                .map(|i| r.get_ref(i).map(codec::from_sql))
                .collect::<rusqlite::Result<Vec<Value>>>()
        })
        .optional()
        .map_err(|e| ReplicaError::storage("reading a row to upload", e))
    }

    /// The journal's copy of the row (`None`: the journal holds a delete).
    fn journal_row(&self, note: &Note) -> Result<Option<Vec<Value>>, ReplicaError> {
        let row: Option<Option<Vec<u8>>> = self
            .conn
            .query_row(
                "SELECT row FROM _ferry_sync_journal WHERE tbl = ?1 AND key = ?2",
                params![note.table, note.key],
                |r| r.get(0),
            )
            .optional()
            .map_err(|e| ReplicaError::storage("reading the journal", e))?;
        Ok(row.flatten().and_then(|bytes| codec::decode(&bytes)))
    }

    /// Step 2.
    fn send(
        &mut self,
        link: &mut dyn Uplink,
        batch: &Batch,
    ) -> Result<wire::Filed, TransportError> {
        let filed_n: i64 = self
            .conn
            .query_row("SELECT n FROM _ferry_sync_filed", [], |r| r.get(0))
            .map_err(|e| TransportError::Unavailable(format!("reading the filing count: {e}")))?;
        let upload = wire::Upload {
            restated: batch.restated,
            id: batch.id,
            filed_n: filed_n as u64,
            lane: batch.lane.clone(),
            parts: batch.parts.clone(),
        };
        let bytes = wire::encode_upload(&upload)
            .map_err(|e| TransportError::Refused(format!("the upload does not encode: {e}")))?;
        self.last_sent = Some(Instant::now());
        let answer = link.upload(&bytes)?;
        self.answered = true;
        let filed = wire::open_filed(&answer, &self.seal_key, &self.replica).map_err(|e| {
            TransportError::Unavailable(format!(
                "the answer to an upload is not a Filed this replica can trust: {e}"
            ))
        })?;
        if filed.id != batch.id {
            return Err(TransportError::Unavailable(format!(
                "the server answered upload {} with a Filed for {}",
                batch.id, filed.id
            )));
        }
        Ok(filed)
    }

    /// Step 3.
    fn settle(
        &mut self,
        batch: &Batch,
        filed: &wire::Filed,
        settings: &UpSettings,
    ) -> Result<(), ReplicaError> {
        let s = |e| ReplicaError::storage("recording a Filed", e);
        self.conn.execute_batch("BEGIN IMMEDIATE").map_err(s)?;
        let result = self.settle_in_tx(batch, filed, settings);
        let end = if result.is_ok() { "COMMIT" } else { "ROLLBACK" };
        let ended = self.conn.execute_batch(end).map_err(s);
        result.and(ended)
    }

    fn settle_in_tx(
        &mut self,
        batch: &Batch,
        filed: &wire::Filed,
        settings: &UpSettings,
    ) -> Result<(), ReplicaError> {
        let s = |e| ReplicaError::storage("recording a Filed", e);
        let c = &self.conn;
        let mut dropped = std::collections::BTreeSet::new();
        for row in &filed.dropped {
            let key = json_key(c, &row.key)?;
            tracing::warn!(
                table = row.table,
                key,
                reason = row.reason,
                "an edit of a two-way row was dropped by the server"
            );
            c.execute(
                "UPDATE _ferry_sync_two_way SET dropped = dropped + 1 WHERE tbl = ?1",
                [&row.table],
            )
            .map_err(s)?;
            dropped.insert((row.table.clone(), key));
        }
        for refused in &filed.refused {
            let key = json_key(c, &refused.key)?;
            c.execute(
                "UPDATE _ferry_sync_up SET aside = ?3 WHERE tbl = ?1 AND key = ?2",
                params![refused.table, key, refused.reason],
            )
            .map_err(s)?;
            c.execute("UPDATE _ferry_sync_filed SET build = ?1", [BUILD])
                .map_err(s)?;
        }
        // The rows as sent, by (table, key), for the journal.
        let mut sent: BTreeMap<(String, String), Option<Vec<u8>>> = BTreeMap::new();
        for part in &batch.parts {
            let keys = tables::key_positions(&part.columns);
            for row in &part.upserts {
                let key: Vec<Value> = keys.iter().map(|&k| row[k].clone()).collect();
                sent.insert(
                    (part.table.clone(), json_key(c, &key)?),
                    Some(codec::encode(row)),
                );
            }
            for key in &part.deletes {
                sent.insert((part.table.clone(), json_key(c, key)?), None);
            }
        }
        let n = filed.filed_n as i64;
        for note in &batch.notes {
            let forgotten = c
                .execute(
                    "DELETE FROM _ferry_sync_up WHERE rowid = ?1 AND noted = ?2 AND aside IS NULL",
                    params![note.rowid, note.noted],
                )
                .map_err(s)?;
            let at = (note.table.clone(), note.key.clone());
            if forgotten == 1 && dropped.contains(&at) {
                self.clear_dropped(note)?;
            } else if forgotten == 1
                && let Some(row) = sent.get(&at)
            {
                c.execute(
                    "INSERT INTO _ferry_sync_journal(tbl, key, n, row) VALUES (?1, ?2, ?3, ?4)
                     ON CONFLICT(tbl, key) DO UPDATE SET n = excluded.n, row = excluded.row",
                    params![note.table, note.key, n, row],
                )
                .map_err(s)?;
            }
        }
        c.execute("UPDATE _ferry_sync_filed SET n = ?1", [n])
            .map_err(s)?;
        if filed.refile_after > 0 {
            let again = c
                .execute(
                    "INSERT INTO _ferry_sync_up(tbl, key, lane, from_journal)
                     SELECT j.tbl, j.key, coalesce(w.lane, 'main'), 1 FROM _ferry_sync_journal j
                     LEFT JOIN _ferry_sync_writes w ON w.tbl = j.tbl
                     WHERE j.n > ?1
                     ON CONFLICT(tbl, key) DO NOTHING",
                    [filed.refile_after as i64],
                )
                .map_err(s)?;
            tracing::warn!(
                refile_after = filed.refile_after,
                rows = again,
                "the server lost filings (restored from an older copy?): sending the journal after its count again"
            );
            let pruned_to: i64 = c
                .query_row("SELECT pruned_to FROM _ferry_sync_reach", [], |r| r.get(0))
                .map_err(s)?;
            if pruned_to > filed.refile_after as i64 {
                // Filings after the server's count that the journal's bound let go: what
                // they held may be lost, unless written again since (docs/sync-up.md §6).
                tracing::error!(
                    from = filed.refile_after + 1,
                    to = pruned_to,
                    "the server lost filings older than this replica's journal reaches: rows filed in them and not written since cannot be sent again"
                );
                c.execute(
                    "UPDATE _ferry_sync_reach SET lost_from = ?1, lost_to = ?2, at_ms = ?3",
                    params![
                        filed.refile_after as i64 + 1,
                        pruned_to,
                        ferry_core::seams::wall_ms() as i64
                    ],
                )
                .map_err(s)?;
            }
        }
        // The journal's bound: the oldest entries go, and how far it pruned is kept, so a
        // later restore to a count below it is known to be beyond repair from here.
        c.execute(
            "UPDATE _ferry_sync_reach SET pruned_to = max(pruned_to, coalesce(
                (SELECT max(n) FROM _ferry_sync_journal WHERE n < (SELECT n FROM _ferry_sync_journal
                 ORDER BY n DESC LIMIT 1 OFFSET ?1)), 0))",
            [settings.journal_rows as i64],
        )
        .map_err(s)?;
        c.execute(
            "DELETE FROM _ferry_sync_journal WHERE n < (SELECT n FROM _ferry_sync_journal ORDER BY n DESC LIMIT 1 OFFSET ?1)",
            [settings.journal_rows as i64],
        )
        .map_err(s)?;
        Ok(())
    }

    /// A one-row upload the transport refused for good: set aside, with the reason.
    fn set_aside(&mut self, batch: &Batch, reason: &str) -> Result<(), ReplicaError> {
        let s = |e| ReplicaError::storage("setting a row aside", e);
        for note in &batch.notes {
            tracing::warn!(
                table = note.table,
                key = note.key,
                reason,
                "a row was set aside: the transport refuses it"
            );
            self.conn
                .execute(
                    "UPDATE _ferry_sync_up SET aside = ?2 WHERE rowid = ?1",
                    params![note.rowid, reason],
                )
                .map_err(s)?;
        }
        self.conn
            .execute("UPDATE _ferry_sync_filed SET build = ?1", [BUILD])
            .map_err(s)?;
        Ok(())
    }

    /// An edit the server dropped, and no newer one: the replica's columns of the row go
    /// back to empty, as a row held afresh has them (docs/sync-up.md §2), so a replica
    /// that keeps the row (one retired and sent it again, a snapshot that sweeps it in)
    /// does not go on showing a value the server never took. Inside the `Filed`'s
    /// transaction; the note the reset makes is forgotten with it. Not the wishes table:
    /// its answers are stated again on a new chain (§7), and an answer cleared would
    /// offer a withdrawn wish again.
    fn clear_dropped(&self, note: &Note) -> Result<(), ReplicaError> {
        let s = |e| ReplicaError::storage("clearing a dropped edit", e);
        if note.table == crate::rules::WISHES_TABLE {
            return Ok(());
        }
        let Some(columns) = two_way_columns(&self.conn)?.remove(&note.table) else {
            return Ok(());
        };
        let owned: Vec<String> = columns
            .iter()
            .filter(|c| c.key_part == 0)
            .map(|c| format!("{} = NULL", tables::quote(&c.name)))
            .collect();
        if owned.is_empty() {
            return Ok(());
        }
        self.conn
            .execute(
                &format!(
                    "UPDATE {} SET {} WHERE {}",
                    tables::quote(&note.table),
                    owned.join(", "),
                    json_key_match(&columns)
                ),
                [&note.key],
            )
            .map_err(s)?;
        self.conn
            .execute(
                "DELETE FROM _ferry_sync_up WHERE tbl = ?1 AND key = ?2",
                params![note.table, note.key],
            )
            .map_err(s)?;
        Ok(())
    }
}

/// The two-way tables and the columns their uploads carry (the key, then the replica's).
fn two_way_columns(conn: &Connection) -> Result<BTreeMap<String, Vec<Column>>, ReplicaError> {
    let e = |e| ReplicaError::storage("reading the two-way tables", e);
    let mut stmt = conn
        .prepare_cached("SELECT tbl, columns FROM _ferry_sync_two_way")
        .map_err(e)?;
    let rows = stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
        .map_err(e)?;
    let mut out = BTreeMap::new();
    for row in rows {
        let (table, json) = row.map_err(e)?;
        let columns = tables::parse_columns(&json).ok_or_else(|| {
            ReplicaError::Damaged(format!(
                "_ferry_sync_two_way.columns of {table:?} does not parse"
            ))
        })?;
        out.insert(table, columns);
    }
    Ok(out)
}

/// Where the way up stands in the replica's file.
pub fn up_status(conn: &Connection) -> Result<UpStatus, ReplicaError> {
    conn.query_row(
        "SELECT (SELECT count(*) FROM _ferry_sync_up WHERE aside IS NULL),
                (SELECT count(*) FROM _ferry_sync_up WHERE aside IS NOT NULL),
                (SELECT count(*) FROM _ferry_sync_journal),
                (SELECT n FROM _ferry_sync_filed),
                (SELECT coalesce(sum(dropped), 0) FROM _ferry_sync_two_way),
                (SELECT lost_from FROM _ferry_sync_reach), (SELECT lost_to FROM _ferry_sync_reach)",
        [],
        |r| {
            Ok(UpStatus {
                unfiled: r.get::<_, i64>(0)? as u64,
                set_aside: r.get::<_, i64>(1)? as u64,
                journal: r.get::<_, i64>(2)? as u64,
                filed_n: r.get::<_, i64>(3)? as u64,
                dropped: r.get::<_, i64>(4)? as u64,
                beyond_journal: match (r.get::<_, Option<i64>>(5)?, r.get::<_, Option<i64>>(6)?) {
                    (Some(from), Some(to)) => Some((from as u64, to as u64)),
                    _ => None,
                },
            })
        },
    )
    .map_err(|e| ReplicaError::storage("reading the way up's state", e))
}

struct Note {
    rowid: i64,
    table: String,
    /// The key as the trigger wrote it: a JSON array of the key's values.
    key: String,
    noted: i64,
}

struct Batch {
    id: u64,
    lane: String,
    restated: bool,
    notes: Vec<Note>,
    parts: Vec<TablePart>,
}

/// A condition matching the row whose key is `?1`, a JSON key array as the triggers
/// write it.
fn json_key_match(columns: &[Column]) -> String {
    tables::key_columns(columns)
        .enumerate()
        .map(|(i, c)| format!("{} IS json_extract(?1, '$[{i}]')", tables::quote(&c.name)))
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// The key values of a JSON key array (uuids and text as text, integers as integers).
fn key_values(json: &str) -> Vec<Value> {
    match serde_json::from_str::<Vec<serde_json::Value>>(json) {
        Ok(parts) => parts.into_iter().map(codec::from_json).collect(),
        Err(_) => Vec::new(),
    }
}

/// The key's JSON text as the triggers write it (SQLite's own `json_array`).
fn json_key(conn: &Connection, key: &[Value]) -> Result<String, ReplicaError> {
    conn.query_row(
        &format!("SELECT json_array({})", vec!["?"; key.len()].join(", ")),
        rusqlite::params_from_iter(key.iter().map(codec::to_sql)),
        |r| r.get(0),
    )
    .map_err(|e| ReplicaError::storage("writing a key", e))
}
