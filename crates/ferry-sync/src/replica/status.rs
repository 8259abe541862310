//! Where a replica stands, for people, on-device UIs and health checks.
//!
//! What the file knows (position, gap, tables, rejections, retirements) is read in
//! [`status`]; whether the replica is synced, catching up or offline also needs what the
//! transport knows, which the caller passes to [`ReplicaStatus::standing`].

use super::{ReplicaError, state::State, tables};
use rusqlite::{Connection, ErrorCode};

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
        if let Some(known) = self.standing {
            return known;
        }
        match last_fetch_ok_ms {
            Some(at) if now_ms.saturating_sub(at) <= offline_after_ms => {
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
    let standing = if state.gap != 0 || rejections > 0 {
        Some(Standing::AwaitingFix)
    } else if state.epoch.is_none() {
        Some(Standing::NotProvisioned)
    } else {
        None
    };
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
