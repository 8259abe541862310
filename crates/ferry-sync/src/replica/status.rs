//! Where a replica stands, for people, on-device UIs and health checks.
//!
//! What the file knows (position, gap, tables, rejections, retirements) is read in
//! [`status`]; whether the replica is synced, catching up or offline also needs what the
//! transport knows, which the caller passes to [`ReplicaStatus::standing`] (a running
//! replica's [`super::Live`] does).

use super::{ReplicaError, state::State, tables};
use rusqlite::{Connection, ErrorCode, OpenFlags};
use std::path::Path;

/// A replica's state as its file holds it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ReplicaStatus {
    /// The server installation's epoch (hex), `None` before the first message applied.
    pub epoch: Option<String>,
    /// The last applied message's seq (0: none yet).
    pub seq: u64,
    /// The seq of a message that did not follow (0: none).
    pub gap: u64,
    pub applied_at_ms: Option<u64>,
    pub heard_at_ms: Option<u64>,
    pub tables: Vec<TableRows>,
    /// Rows refused and recorded (reported or not).
    pub rejections: u64,
    /// Rows the server deleted that the replica's own rows still reference.
    pub retired: u64,
    /// The way up (docs/sync-up.md): rows written and not yet filed, and rows set aside
    /// (refused for good; tried again by a new build).
    pub unfiled: u64,
    pub set_aside: u64,
    /// Edits of two-way rows the server dropped (it had deleted the row or taken it back).
    pub dropped: u64,
    /// An alarm: filings (from, to) a restored server lost that the journal no longer
    /// held (docs/sync-up.md §6).
    pub beyond_journal: Option<(u64, u64)>,
    /// What the file alone says about the standing: `awaiting_fix` (a gap, or
    /// rejections outstanding) or `not_provisioned` (no chain started);
    /// `None` when it takes the transport to tell (see [`ReplicaStatus::standing`]).
    pub standing: Option<Standing>,
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct TableRows {
    pub name: String,
    pub rows: u64,
}

/// A replica's standing, in the words an on-device UI shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Standing {
    /// No chain started yet: waiting for the first snapshot.
    NotProvisioned,
    /// A message did not follow (nothing applies until the server sends a snapshot), or
    /// rows the replica refused are outstanding (`docs/sync.md` §9).
    AwaitingFix,
    /// Reachable, with messages still to apply.
    CatchingUp,
    /// Reachable and at the end of its chain.
    Synced,
    /// No fetch succeeded within `offline_after_ms`.
    Offline,
}

impl Standing {
    /// Every standing, in the order metrics list them.
    pub const ALL: [Standing; 5] = [
        Standing::NotProvisioned,
        Standing::AwaitingFix,
        Standing::CatchingUp,
        Standing::Synced,
        Standing::Offline,
    ];

    /// The name JSON and metrics use (`synced`, `catching_up`, …).
    pub fn name(self) -> &'static str {
        match self {
            Standing::NotProvisioned => "not_provisioned",
            Standing::AwaitingFix => "awaiting_fix",
            Standing::CatchingUp => "catching_up",
            Standing::Synced => "synced",
            Standing::Offline => "offline",
        }
    }

    /// What the file alone says: a gap or outstanding rejections are `awaiting_fix`, no
    /// chain yet is `not_provisioned`; `None` when it takes the transport to tell.
    pub(crate) fn of_file(provisioned: bool, gap: u64, rejections: u64) -> Option<Standing> {
        if gap != 0 || rejections > 0 {
            Some(Standing::AwaitingFix)
        } else if !provisioned {
            Some(Standing::NotProvisioned)
        } else {
            None
        }
    }

    /// The full standing from what the file says (`file`, from [`Standing::of_file`]) and
    /// what the transport knows; see [`ReplicaStatus::standing`].
    pub(crate) fn judge(
        file: Option<Standing>,
        last_fetch_ok_ms: Option<u64>,
        caught_up: bool,
        now_ms: u64,
        offline_after_ms: u64,
    ) -> Standing {
        if let Some(known) = file {
            return known;
        }
        match last_fetch_ok_ms {
            // abs_diff: a heard time ahead of the clock (the clock set back since) is not
            // "just now"; the next answered fetch stamps the clock's own time again.
            Some(at) if now_ms.abs_diff(at) <= offline_after_ms => {
                if caught_up {
                    Standing::Synced
                } else {
                    Standing::CatchingUp
                }
            }
            _ => Standing::Offline,
        }
    }
}

impl ReplicaStatus {
    /// The full standing. What the file says comes first (a gap or no chain yet are facts
    /// the transport cannot change); then `offline` if no fetch succeeded within
    /// `offline_after_ms` of `now_ms`; then `catching_up` unless the last fetch found
    /// nothing more to apply (`caught_up`); else `synced`.
    pub fn standing(
        &self,
        last_fetch_ok_ms: Option<u64>,
        caught_up: bool,
        now_ms: u64,
        offline_after_ms: u64,
    ) -> Standing {
        Standing::judge(
            self.standing,
            last_fetch_ok_ms,
            caught_up,
            now_ms,
            offline_after_ms,
        )
    }
}

/// The status of the replica file at `path`, read on a read-only connection of its own:
/// what a process beside the running replica (its /status, a health check) reads while
/// the replica writes (WAL: it sees the last committed message). Counting each table's
/// rows reads every row, as `ferry sync replica status` does.
pub fn read_status(path: &Path) -> Result<ReplicaStatus, ReplicaError> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(|e| ReplicaError::storage("opening the replica file to read its status", e))?;
    conn.busy_timeout(super::BUSY_TIMEOUT)
        .map_err(|e| ReplicaError::storage("setting the busy timeout", e))?;
    status(&conn)
}

pub(crate) fn status(conn: &Connection) -> Result<ReplicaStatus, ReplicaError> {
    let state = State::read(conn)?;
    let s = |e| ReplicaError::storage("reading the replica's status", e);
    let mut rows = Vec::new();
    for (name, _) in tables::recorded(conn)? {
        let count = conn.query_row(
            &format!("SELECT COUNT(*) FROM {}", tables::quote(&name)),
            [],
            |r| r.get::<_, i64>(0),
        );
        let count = match count {
            Ok(n) => n as u64,
            // The host dropped the table: it holds nothing.
            Err(e) if e.sqlite_error_code() == Some(ErrorCode::Unknown) => 0,
            Err(e) => return Err(s(e)),
        };
        rows.push(TableRows { name, rows: count });
    }
    let count = |sql: &str| conn.query_row(sql, [], |r| r.get::<_, i64>(0)).map_err(s);
    let rejections = count("SELECT COUNT(*) FROM _ferry_sync_rejections")? as u64;
    let standing = Standing::of_file(state.epoch.is_some(), state.gap, rejections);
    Ok(ReplicaStatus {
        epoch: state
            .epoch
            .map(|e| e.iter().map(|b| format!("{b:02x}")).collect()),
        seq: state.seq,
        gap: state.gap,
        applied_at_ms: state.applied_at_ms,
        heard_at_ms: state.heard_at_ms,
        tables: rows,
        rejections,
        retired: count("SELECT COUNT(*) FROM _ferry_sync_retired")? as u64,
        unfiled: count("SELECT COUNT(*) FROM _ferry_sync_up WHERE aside IS NULL")? as u64,
        set_aside: count("SELECT COUNT(*) FROM _ferry_sync_up WHERE aside IS NOT NULL")? as u64,
        dropped: count("SELECT coalesce(sum(dropped), 0) FROM _ferry_sync_two_way")? as u64,
        beyond_journal: super::up::up_status(conn)?.beyond_journal,
        standing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(standing: Option<Standing>) -> ReplicaStatus {
        ReplicaStatus {
            epoch: None,
            seq: 3,
            gap: 0,
            applied_at_ms: None,
            heard_at_ms: None,
            tables: vec![],
            rejections: 0,
            retired: 0,
            unfiled: 0,
            set_aside: 0,
            dropped: 0,
            beyond_journal: None,
            standing,
        }
    }

    #[test]
    fn standing_puts_the_file_first_then_the_link() {
        let s = at(None);
        assert_eq!(
            s.standing(Some(1_000), true, 2_000, 5_000),
            Standing::Synced
        );
        assert_eq!(
            s.standing(Some(1_000), false, 2_000, 5_000),
            Standing::CatchingUp
        );
        assert_eq!(
            s.standing(Some(1_000), true, 7_000, 5_000),
            Standing::Offline
        );
        assert_eq!(s.standing(None, true, 7_000, 5_000), Standing::Offline);
        let gap = at(Some(Standing::AwaitingFix));
        assert_eq!(
            gap.standing(Some(1_000), true, 2_000, 5_000),
            Standing::AwaitingFix
        );
    }
}
