//! Handling what replicas reported (docs/sync-protocol.md §1.6), inside the pass.
//!
//! 1. Take every report not yet handled (a rolled-back pass leaves them unhandled).
//! 2. Check the stamp of the message the replica says it applied last, then decide:
//!    another epoch → provision; a stamp of ours we have no record of → the server was
//!    restored (new epoch); less than it confirmed before → the replica was restored
//!    (provision); more → a confirmation (prune the outbox, advance its marks).
//! 3. A gap the outbox cannot fill → catch up by a new chain.
//! 4. Rejections → quarantine for that replica.
//! 5. Digests, when the replica confirmed everything recorded for it and none were
//!    compared within `digest_every`: a table with no note pending or parked whose count
//!    or fingerprint differs from what the server says the replica holds is healed
//!    (resent with a sweep, in-chain).

use std::collections::{HashMap, HashSet};

use sqlx::{PgConnection, Row};
use uuid::Uuid;

use super::plan::Provision;
use super::record::{Epoch, key_text_of};
use super::spec::Spec;
use crate::wire;

/// What the pass must do after the reports.
#[derive(Debug, Default)]
pub struct Decisions {
    /// Replicas to start a new chain for.
    pub provision: HashMap<Uuid, Provision>,
    /// A confirmation proved this installation was restored from an older copy.
    pub new_epoch: bool,
    pub confirmed: usize,
    /// Tables whose digest disagreed: (replica, table index), healed in-chain.
    pub heal: Vec<(Uuid, usize)>,
}

pub async fn handle(
    conn: &mut PgConnection,
    spec: &Spec,
    epoch: &Epoch,
    digest_every: std::time::Duration,
    (shard, shards): (i32, i32),
) -> Result<Decisions, sqlx::Error> {
    let mut decisions = Decisions::default();
    let mut reads = Reads {
        shard,
        ..Reads::default()
    };
    // Read, not updated: serve processes update these rows as reports arrive, and a
    // REPEATABLE READ pass that updated one of them concurrently would fail whole. What
    // the pass handled is recorded in `replicas.handled_n`, which only the relay writes.
    let reports = sqlx::query(
        "SELECT r.replica, r.up, r.n, c.audience FROM ferry_sync.reports r JOIN ferry_sync.replicas c ON c.id = r.replica
         WHERE r.n > c.handled_n AND ($2 = 1 OR ferry_sync.shard_of(r.replica, $2) = $1)",
    )
    .bind(shard)
    .bind(shards)
    .fetch_all(&mut *conn)
    .await?;
    let handled: Vec<(Uuid, i64)> = reports.iter().map(|r| (r.get(0), r.get(2))).collect();
    if !handled.is_empty() {
        sqlx::query(
            "UPDATE ferry_sync.replicas c SET handled_n = x.n FROM unnest($1::uuid[], $2::int8[]) AS x(id, n) WHERE c.id = x.id",
        )
        .bind(handled.iter().map(|h| h.0).collect::<Vec<_>>())
        .bind(handled.iter().map(|h| h.1).collect::<Vec<_>>())
        .execute(&mut *conn)
        .await?;
    }
    for row in reports {
        let r: Uuid = row.get(0);
        let bytes: Vec<u8> = row.get(1);
        let audience: Option<String> = row.get(3);
        let audience = audience.as_deref();
        let Ok(up) = wire::decode_up(&bytes, &wire::Limits::default()) else {
            tracing::warn!(replica = %r, "a stored report no longer decodes; ignored");
            continue;
        };
        one(conn, spec, epoch, r, audience, &up, &mut decisions).await?;
        let to = Replica { id: r, audience };
        compare_digests(
            conn,
            spec,
            to,
            &up,
            digest_every,
            &mut reads,
            &mut decisions,
        )
        .await?;
    }
    Ok(decisions)
}

/// The replica a report came from, and its audience (which tables its names mean).
#[derive(Clone, Copy)]
struct Replica<'a> {
    id: Uuid,
    audience: Option<&'a str>,
}

async fn one(
    conn: &mut PgConnection,
    spec: &Spec,
    epoch: &Epoch,
    r: Uuid,
    audience: Option<&str>,
    up: &wire::Up,
    decisions: &mut Decisions,
) -> Result<(), sqlx::Error> {
    let Some(chain) = sqlx::query(
        "SELECT last_seq, confirmed_seq, confirmed_nonce, confirmed_pass, standing FROM ferry_sync.replicas WHERE id = $1",
    )
    .bind(r)
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(());
    };
    let last_seq: i64 = chain.get(0);
    let confirmed_seq: i64 = chain.get(1);
    let confirmed_nonce: i64 = chain.get(2);
    let confirmed_pass: i64 = chain.get(3);
    let standing: String = chain.get(4);
    if standing == "new" || standing == "retired" {
        return Ok(());
    }
    let position = match &up.applied {
        None => {
            if confirmed_seq > 0 {
                tracing::warn!(replica = %r, "replica reports having applied nothing after confirming seq {confirmed_seq}: restored from an older copy or emptied; provisioning it again");
                decisions.provision.insert(r, Provision::Full);
            }
            0
        }
        Some(a) if a.epoch != *epoch.id.as_bytes() => {
            if !chain_start_pending(conn, r).await? {
                decisions.provision.insert(r, Provision::Full);
            }
            return Ok(());
        }
        Some(a) if !wire::verify_stamp(&epoch.secret, r.as_bytes(), a) => {
            tracing::warn!(replica = %r, seq = a.seq, "report's stamp does not verify: forged or corrupted; ignored");
            return Ok(());
        }
        Some(a) => {
            let seq = a.seq as i64;
            let nonce = a.nonce as i64;
            if seq > last_seq || (seq == confirmed_seq && nonce != confirmed_nonce) {
                tracing::error!(replica = %r, seq, last_seq, "a replica confirmed a message this installation stamped but has no record of: the server was restored from an older copy; taking a new epoch and provisioning every replica");
                decisions.new_epoch = true;
                return Ok(());
            }
            if seq < confirmed_seq {
                tracing::warn!(replica = %r, seq, confirmed_seq, "replica confirms less than before: restored from an older copy; provisioning it again");
                decisions.provision.insert(r, Provision::Full);
                return Ok(());
            }
            if seq > confirmed_seq {
                match outbox_nonce(conn, r, seq).await? {
                    Some(n) if n == nonce => {
                        confirm(conn, r, seq, nonce, confirmed_pass).await?;
                        decisions.confirmed += 1;
                    }
                    _ => {
                        tracing::error!(replica = %r, seq, "a confirmed message's nonce is not the one recorded: the server was restored; taking a new epoch");
                        decisions.new_epoch = true;
                        return Ok(());
                    }
                }
            }
            seq
        }
    };
    // Whether or not it saw a gap: a replica behind its chain whose next message the
    // outbox no longer holds (dropped past its bound) can only be caught up.
    if position < last_seq
        && outbox_nonce(conn, r, position + 1).await?.is_none()
        && !decisions.provision.contains_key(&r)
        && !chain_start_pending(conn, r).await?
    {
        let since: i64 =
            sqlx::query_scalar("SELECT confirmed_pass FROM ferry_sync.replicas WHERE id = $1")
                .bind(r)
                .fetch_one(&mut *conn)
                .await?;
        decisions.provision.insert(r, Provision::CatchUp { since });
    }
    quarantine_rejections(conn, spec, Replica { id: r, audience }, up).await
}

/// Whether the replica's outbox holds a chain start it has not confirmed yet.
async fn chain_start_pending(conn: &mut PgConnection, r: Uuid) -> Result<bool, sqlx::Error> {
    let heads: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT head FROM ferry_sync.outbox WHERE replica = $1")
            .bind(r)
            .fetch_all(&mut *conn)
            .await?;
    Ok(heads.iter().any(|h| h.len() >= 64 && h[56..64] == [0u8; 8]))
}

async fn outbox_nonce(
    conn: &mut PgConnection,
    r: Uuid,
    seq: i64,
) -> Result<Option<i64>, sqlx::Error> {
    let head: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT head FROM ferry_sync.outbox WHERE replica = $1 AND seq = $2")
            .bind(r)
            .bind(seq)
            .fetch_optional(&mut *conn)
            .await?;
    Ok(head
        .filter(|h| h.len() >= 56)
        .map(|h| i64::from_be_bytes(h[48..56].try_into().expect("8 bytes"))))
}

async fn confirm(
    conn: &mut PgConnection,
    r: Uuid,
    seq: i64,
    nonce: i64,
    confirmed_pass: i64,
) -> Result<(), sqlx::Error> {
    // Bodies no message names any more go in the relay's sweep (`sweep_bodies`).
    let pruned = sqlx::query(
        "DELETE FROM ferry_sync.outbox WHERE replica = $1 AND seq <= $2 RETURNING pass",
    )
    .bind(r)
    .bind(seq)
    .fetch_all(&mut *conn)
    .await?;
    let pass = pruned
        .iter()
        .map(|row| row.get::<i64, _>(0))
        .max()
        .unwrap_or(confirmed_pass)
        .max(confirmed_pass);
    // Until the replica confirms the chain start that follows, what it confirms is of the
    // chain being replaced: for a replica being provisioned (a move, a reopening) the
    // passes of those messages are not a mark in what it must now hold, and a catch-up
    // started from them would miss rows. Its position advances; its mark and standing
    // wait for the chain start.
    if chain_start_pending(conn, r).await? {
        sqlx::query(
            "UPDATE ferry_sync.replicas SET confirmed_seq = $2, confirmed_nonce = $3, confirmed_at = now() WHERE id = $1",
        )
        .bind(r)
        .bind(seq)
        .bind(nonce)
        .execute(&mut *conn)
        .await?;
        return Ok(());
    }
    sqlx::query(
        "UPDATE ferry_sync.replicas SET confirmed_seq = $2, confirmed_nonce = $3, confirmed_pass = $4,
         confirmed_at = now(), standing = 'following' WHERE id = $1",
    )
    .bind(r)
    .bind(seq)
    .bind(nonce)
    .bind(pass)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

async fn quarantine_rejections(
    conn: &mut PgConnection,
    spec: &Spec,
    replica: Replica<'_>,
    up: &wire::Up,
) -> Result<(), sqlx::Error> {
    let r = replica.id;
    for rejection in &up.rejections {
        let Some(t) = spec.named(&rejection.table, replica.audience) else {
            continue;
        };
        let table = &spec.tables[t];
        let key_cols: Vec<usize> = (0..rejection.key.len()).collect();
        sqlx::query(
            "INSERT INTO ferry_sync.quarantine (replica, relation, key, cause, reason) VALUES ($1, $2, $3, 'replica', $4)
             ON CONFLICT (replica, relation, key) DO UPDATE SET reason = excluded.reason, at = now()",
        )
        .bind(r)
        .bind(&table.relation)
        .bind(key_text_of(&rejection.key, &key_cols))
        .bind(&rejection.reason)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// Step 5. A table is compared only when nothing the server knows of is still on its way
/// to the replica, so that a difference means the replica really holds something else:
///
/// - no message recorded for the replica is unconfirmed (`confirmed_seq = last_seq`), so
///   every pass's decision for it is in what it applied;
/// - no note for the table is pending or parked (`deferred`). What the server says the
///   replica should hold (`should_rows`) is the held state, which only passes change,
///   read with current content, plus, for a broadcast table, the partition's current
///   rows: the one thing that changes it without a pass is a write to that very table,
///   and every such write leaves a note on it in the same transaction, so this pass's
///   snapshot sees both or neither. Notes on other tables (a parent's move, a group, a
///   route, a replica) change the held state only when planned, so they need not wait.
///   A write to a table that only a `from` or `active` view reads notes nothing here; a
///   difference it makes is real, since no pass would resend it, and is what the heal
///   is for.
///
/// Comparing without the second condition healed, by a table's worth of bytes, every
/// table written between a replica's report and the pass that handled it. A table whose
/// notes never run out (writes every pass) waits for a quiet pass; a replica's
/// `digest_at` is stamped only when some table was compared, so the next report tries
/// again.
/// What one pass's digest comparisons read once and share: the relations with notes
/// pending, and broadcast tables' rows by rule.
#[derive(Default)]
struct Reads {
    /// The relay shard comparing.
    shard: i32,
    deferred: Option<HashSet<String>>,
    by_rule: super::plan::ByRule,
}

async fn compare_digests(
    conn: &mut PgConnection,
    spec: &Spec,
    replica: Replica<'_>,
    up: &wire::Up,
    every: std::time::Duration,
    reads: &mut Reads,
    decisions: &mut Decisions,
) -> Result<(), sqlx::Error> {
    let r = replica.id;
    if up.digests.is_empty() || decisions.new_epoch || decisions.provision.contains_key(&r) {
        return Ok(());
    }
    // `digest_at` is the server's wall clock. A stamp later than now means the clock was
    // set back since it was taken; counting from it would suspend comparisons (the safety
    // net) for as long as the clock was wrong, a year for a clock a year ahead. Such a
    // stamp is due: one comparison too many costs a read, one too few a missed heal.
    let due: Option<(String,)> = sqlx::query_as(
        "SELECT coalesce(partition, '') FROM ferry_sync.replicas
         WHERE id = $1 AND standing = 'following' AND confirmed_seq = last_seq
           AND (digest_at IS NULL OR digest_at <= now() - make_interval(secs => $2)
                OR digest_at > now())",
    )
    .bind(r)
    .bind(every.as_secs_f64())
    .fetch_optional(&mut *conn)
    .await?;
    let Some((partition,)) = due else {
        return Ok(());
    };
    let deferred = match &mut reads.deferred {
        Some(noted) => noted,
        None => reads
            .deferred
            .insert(noted_relations(conn, reads.shard).await?),
    };
    let mut compared = false;
    for digest in &up.digests {
        let Some(t) = spec.named(&digest.table, replica.audience) else {
            continue;
        };
        let table = &spec.tables[t];
        if deferred.contains(&table.noted_as) || deferred.contains(&table.relation) {
            continue;
        }
        compared = true;
        let rows = super::plan::should_rows(conn, spec, r, &partition, t, Some(&mut reads.by_rule))
            .await?;
        let mut print = crate::value::Fingerprint::default();
        for row in &rows {
            print.add(&row.values);
        }
        if (print.rows, print.sum) != (digest.rows, digest.fingerprint) {
            tracing::warn!(replica = %r, table = %digest.table, server_rows = print.rows, replica_rows = digest.rows,
                "a replica's digest differs from what it should hold; resending that table");
            decisions.heal.push((r, t));
        }
    }
    if compared {
        sqlx::query("UPDATE ferry_sync.replicas SET digest_at = now() WHERE id = $1")
            .bind(r)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// The relations with a note pending or parked: their digests wait (`compare_digests`).
/// Read once per pass, and only when some replica's digests are due: the notes table is
/// small between passes, but holds a whole bulk load while one is planned.
async fn noted_relations(
    conn: &mut PgConnection,
    shard: i32,
) -> Result<HashSet<String>, sqlx::Error> {
    // This shard's notes: another shard's backlog is no note this one has yet to plan.
    let relations: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT relation FROM ferry_sync.notes WHERE shard = $1")
            .bind(shard)
            .fetch_all(&mut *conn)
            .await?;
    Ok(relations.into_iter().collect())
}
