//! Where every replica stands, read in one REPEATABLE READ snapshot
//! (`ferry sync status`, `GET /status`). docs/sync.md §12.
//!
//! A replica is:
//! - `synced`: it confirmed everything recorded for it;
//! - `catching_up`: messages wait for it and it was heard from within `HEARD_RECENTLY`;
//! - `unreachable`: messages wait, and it was heard from, but not recently;
//! - `silent`: it was never heard from;
//! - `unenrolled`: live in the rules but without a token (`ferry sync enroll`);
//! - `retired`: no longer live.
//!
//! And, per mirrored table, how many rows it should hold and how many it confirmed at
//! their latest version ([`TableProgress`], docs/sync.md §5.2):
//! - a broadcast table: the live rows of its partition, less what is set aside for it;
//!   those with `rv` at or below its mark (`confirmed_pass`) are confirmed, the rest
//!   pending; the mark `covers` the table when it reaches the partition's newest version
//!   (deletes included);
//! - a per-row table (assigned, follows, grouped, routed, closure): its `held` entries;
//!   those carried by a message at or below `confirmed_seq` are confirmed, the rest in
//!   flight.
//!
//! A table appears once something is recorded for it; changes not yet planned (notes)
//! are not counted anywhere.
//!
//! What a read costs, all in the one snapshot: one scan of `held` for the replicas shown
//! (one entry per row a replica holds per row, what the per-replica count read before);
//! one scan of `rows` for their partitions (broadcast rows and tombstones, once, whatever
//! the number of replicas); per distinct (partition, mark) among them, an index range
//! over the rows changed since that mark (`rows_since`), so replicas at the same mark
//! share it and a replica far behind costs what a catch-up would read; and the
//! quarantine. Nothing scales with replicas × broadcast rows.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde::Serialize;
use sqlx::{PgPool, Row};

/// Heard from within this long: a replica with messages waiting is catching up, not
/// unreachable. Three report intervals of the replica's keepalive (30 s) would be 90 s;
/// 60 s says "away" sooner for a shop's dashboard.
pub const HEARD_RECENTLY: Duration = Duration::from_secs(60);

/// The version of the status document (`GET /status`, `ferry sync status --json`): a
/// field removed or changing meaning takes a new one; fields are added within one.
pub const STATUS_VERSION: u32 = 1;

/// The most parked notes, inbox rows and quarantined rows a status lists (their counts
/// are whole).
pub const LISTED_MAX: i64 = 50;

#[derive(Clone, Debug, Serialize)]
pub struct Status {
    /// [`STATUS_VERSION`].
    pub version: u32,
    /// The partition the document is scoped to (`None`: every replica).
    pub partition: Option<String>,
    pub epoch: String,
    /// New epochs taken because the server was restored from an older copy (an alarm).
    pub restores: i32,
    pub notes_pending: i64,
    pub notes_parked: i64,
    pub oldest_pending_ms: Option<i64>,
    pub replicas: Vec<ReplicaStanding>,
    /// The oldest parked notes (whatever the partition: a note is the server's), at most
    /// [`LISTED_MAX`].
    pub parked: Vec<ParkedNote>,
    /// Rows of the replicas shown set aside, at most [`LISTED_MAX`], oldest first.
    pub quarantine: Vec<Listed>,
    /// Rows of the replicas shown waiting in the inbox, at most [`LISTED_MAX`], oldest first.
    pub inbox: Vec<Listed>,
}

/// A note the relay parked: a change it could not plan until someone fixes its cause.
#[derive(Clone, Debug, Serialize)]
pub struct ParkedNote {
    pub id: i64,
    pub relation: String,
    pub key: String,
    pub attempts: i32,
    pub error: Option<String>,
    pub parked_ago_ms: Option<i64>,
}

/// A row set aside for a replica (quarantine: `cause` is encode, size or replica) or
/// waiting in its inbox (`cause` is `inbox`, `tries` how often it was filed).
#[derive(Clone, Debug, Serialize)]
pub struct Listed {
    pub replica: String,
    pub relation: String,
    pub key: String,
    pub cause: String,
    pub reason: String,
    pub tries: i32,
}

/// A replica's wishes by where they stand (docs/sync-up.md §7).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WishCounts {
    pub pending: i64,
    pub waiting: i64,
    pub applied: i64,
    pub refused: i64,
    pub superseded: i64,
}

#[derive(Clone, Debug, Serialize)]
pub struct ReplicaStanding {
    pub id: String,
    pub partition: Option<String>,
    /// Its audience (docs/sync-scale.md §1), when the rules name audiences: it holds the
    /// tables of its audience and those of every audience.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audience: Option<String>,
    pub standing: &'static str,
    pub last_seq: i64,
    pub confirmed_seq: i64,
    pub outbox_messages: i64,
    pub outbox_bytes: i64,
    pub oldest_unconfirmed_ms: Option<i64>,
    pub heard_ago_ms: Option<i64>,
    pub held_rows: i64,
    pub quarantined: i64,
    /// Outboxes dropped past their bound (an alarm).
    pub dropped: i32,
    /// The way up (docs/sync-up.md): uploads filed for it, and its rows the database
    /// refused, waiting in the inbox to be filed again (`ferry sync refile`).
    pub filings: i64,
    pub inbox: i64,
    /// The server's wishes for its setting rows, by where they stand.
    pub wishes: WishCounts,
    /// The broadcast mark: every broadcast row of its partition recorded up to this pass
    /// is in a message it confirmed.
    pub confirmed_pass: i64,
    /// Per mirrored table, what it should hold and what it confirmed (none for a retired
    /// replica). Sorted by table, broadcast first.
    pub tables: Vec<TableProgress>,
}

/// One mirrored table on one replica. `rows = confirmed + pending`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TableProgress {
    /// The relation as the rules name it (`public.products`).
    pub table: String,
    /// `broadcast` (held by version and mark) or `per_row` (held per row).
    pub kind: &'static str,
    /// Rows it should hold as recorded so far, less those set aside for it.
    pub rows: i64,
    /// Rows it confirmed at their latest version.
    pub confirmed: i64,
    /// Rows not yet confirmed at their latest version: in a message it has not confirmed
    /// (or, for a broadcast table of a replica still being provisioned, not yet in one).
    pub pending: i64,
    /// Rows set aside for it (quarantine), beside `rows`.
    pub quarantined: i64,
    /// Broadcast: the pass of the partition's newest version of this table, deletes
    /// included (`None` for a per-row table).
    pub latest_pass: Option<i64>,
    /// Broadcast: the mark reaches `latest_pass`, so every change to the table, deletes
    /// included, is confirmed (`None` for a per-row table).
    pub covered: Option<bool>,
}

/// Reads the status, for every replica or one partition's.
pub async fn read(pool: &PgPool, partition: Option<&str>) -> Result<Status, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .execute(&mut *tx)
        .await?;
    let meta = sqlx::query("SELECT epoch::text, restores FROM ferry_sync.meta")
        .fetch_one(&mut *tx)
        .await?;
    let notes = sqlx::query(
        "SELECT count(*) FILTER (WHERE parked_at IS NULL), count(*) FILTER (WHERE parked_at IS NOT NULL),
         (extract(epoch FROM now() - min(noted_at) FILTER (WHERE parked_at IS NULL)) * 1000)::int8
         FROM ferry_sync.notes",
    )
    .fetch_one(&mut *tx)
    .await?;
    let rows = sqlx::query(
        "SELECT c.id::text, c.partition, c.standing, c.seal_key IS NOT NULL, c.last_seq, c.confirmed_seq, c.dropped,
           (SELECT count(*) FROM ferry_sync.outbox o WHERE o.replica = c.id),
           (SELECT coalesce(sum(bytes), 0)::int8 FROM ferry_sync.outbox o WHERE o.replica = c.id),
           (SELECT (extract(epoch FROM now() - min(recorded_at)) * 1000)::int8 FROM ferry_sync.outbox o WHERE o.replica = c.id),
           (SELECT (extract(epoch FROM now() - received_at) * 1000)::int8 FROM ferry_sync.reports r WHERE r.replica = c.id),
           (SELECT count(*) FROM ferry_sync.quarantine q WHERE q.replica = c.id),
           c.confirmed_pass,
           (SELECT coalesce(max(n), 0) FROM ferry_sync.filings f WHERE f.replica = c.id),
           (SELECT count(*) FROM ferry_sync.inbox i WHERE i.replica = c.id),
           c.audience, ferry_sync.shard_of(c.id, (SELECT shards FROM ferry_sync.meta))
         FROM ferry_sync.replicas c WHERE $1::text IS NULL OR c.partition = $1 ORDER BY c.id",
    )
    .bind(partition)
    .fetch_all(&mut *tx)
    .await?;
    let progress = Progress::read(&mut tx, partition).await?;
    let mut wishes: HashMap<String, WishCounts> = HashMap::new();
    for r in sqlx::query(
        "SELECT w.replica::text, CASE WHEN w.answered = w.wish THEN w.outcome ELSE 'pending' END, count(*)
         FROM ferry_sync.wishes w LEFT JOIN ferry_sync.replicas c ON c.id = w.replica
         WHERE $1::text IS NULL OR c.partition = $1 GROUP BY 1, 2",
    )
    .bind(partition)
    .fetch_all(&mut *tx)
    .await?
    {
        let counts = wishes.entry(r.get(0)).or_default();
        let n: i64 = r.get(2);
        match r.get::<Option<String>, _>(1).as_deref() {
            Some("waiting") => counts.waiting += n,
            Some("applied") => counts.applied += n,
            Some("refused") => counts.refused += n,
            Some("superseded") => counts.superseded += n,
            _ => counts.pending += n,
        }
    }
    let parked = sqlx::query(
        "SELECT id, relation, key, attempts, last_error, (extract(epoch FROM now() - parked_at) * 1000)::int8
         FROM ferry_sync.notes WHERE parked_at IS NOT NULL ORDER BY id LIMIT $1",
    )
    .bind(LISTED_MAX)
    .fetch_all(&mut *tx)
    .await?
    .iter()
    .map(|r| ParkedNote {
        id: r.get(0),
        relation: r.get(1),
        key: r.get(2),
        attempts: r.get(3),
        error: r.get(4),
        parked_ago_ms: r.get(5),
    })
    .collect();
    let listed = |sql: &'static str| sqlx::query(sql).bind(partition).bind(LISTED_MAX);
    let to_listed = |r: &sqlx::postgres::PgRow| Listed {
        replica: r.get(0),
        relation: r.get(1),
        key: r.get(2),
        cause: r.get(3),
        reason: r.get(4),
        tries: r.get(5),
    };
    let quarantine = listed(
        "SELECT q.replica::text, q.relation, q.key, q.cause, q.reason, 0
         FROM ferry_sync.quarantine q JOIN ferry_sync.replicas c ON c.id = q.replica
         WHERE $1::text IS NULL OR c.partition = $1 ORDER BY q.at LIMIT $2",
    )
    .fetch_all(&mut *tx)
    .await?
    .iter()
    .map(to_listed)
    .collect();
    let inbox = listed(
        "SELECT i.replica::text, i.relation, i.key, 'inbox', i.reason, i.tries
         FROM ferry_sync.inbox i JOIN ferry_sync.replicas c ON c.id = i.replica
         WHERE $1::text IS NULL OR c.partition = $1 ORDER BY i.at LIMIT $2",
    )
    .fetch_all(&mut *tx)
    .await?
    .iter()
    .map(to_listed)
    .collect();
    tx.commit().await?;
    let replicas = rows
        .iter()
        .map(|r| {
            let id: String = r.get(0);
            let partition: Option<String> = r.get(1);
            let standing: String = r.get(2);
            let enrolled: bool = r.get(3);
            let outbox: i64 = r.get(7);
            let heard: Option<i64> = r.get(10);
            let confirmed_pass: i64 = r.get(12);
            let audience: Option<String> = r.get(15);
            let shard: i32 = r.get(16);
            let standing = judge(&standing, enrolled, outbox, heard);
            let tables = if standing == "retired" {
                Vec::new()
            } else {
                // Broadcast versions are kept per relay shard (docs/sync-scale.md §2).
                let part = format!("{shard}:{}", partition.as_deref().unwrap_or(""));
                progress.of(&id, &part, audience.as_deref(), confirmed_pass)
            };
            ReplicaStanding {
                held_rows: progress.held_rows(&id),
                partition,
                audience,
                standing,
                last_seq: r.get(4),
                confirmed_seq: r.get(5),
                dropped: r.get(6),
                outbox_messages: outbox,
                outbox_bytes: r.get(8),
                oldest_unconfirmed_ms: r.get(9),
                heard_ago_ms: heard,
                quarantined: r.get(11),
                filings: r.get(13),
                inbox: r.get(14),
                wishes: wishes.remove(&id).unwrap_or_default(),
                confirmed_pass,
                tables,
                id,
            }
        })
        .collect();
    Ok(Status {
        version: STATUS_VERSION,
        partition: partition.map(str::to_string),
        epoch: meta.get(0),
        restores: meta.get(1),
        notes_pending: notes.get(0),
        notes_parked: notes.get(1),
        oldest_pending_ms: notes.get(2),
        replicas,
        parked,
        quarantine,
        inbox,
    })
}

fn judge(standing: &str, enrolled: bool, outbox: i64, heard_ago_ms: Option<i64>) -> &'static str {
    if standing == "retired" {
        return "retired";
    }
    if !enrolled {
        return "unenrolled";
    }
    match heard_ago_ms {
        None => "silent",
        Some(_) if outbox == 0 && standing == "following" => "synced",
        // A report stamped ahead of the clock (the server's clock set back since) is not
        // recent: the replica's next report stamps the clock's own time again.
        Some(ms) if (0..=HEARD_RECENTLY.as_millis() as i64).contains(&ms) => "catching_up",
        Some(_) => "unreachable",
    }
}

/// What the per-table progress is computed from, read in the status's snapshot (the
/// module doc says what each read costs).
#[derive(Default)]
struct Progress {
    /// (replica, relation) → (held entries, confirmed ones).
    held: BTreeMap<(String, String), (i64, i64)>,
    /// (`shard:partition`, relation) → (live broadcast rows, newest rv).
    parts: BTreeMap<(String, String), (i64, i64)>,
    /// (`shard:partition`, mark, relation) → live broadcast rows changed after the mark.
    since: HashMap<(String, i64, String), i64>,
    /// (replica, relation) → quarantined live broadcast rows at or below its mark, above
    /// it, and quarantined rows that are not broadcast rows of its partition.
    quarantine: HashMap<(String, String), (i64, i64, i64)>,
}

impl Progress {
    async fn read(
        tx: &mut sqlx::PgConnection,
        partition: Option<&str>,
    ) -> Result<Progress, sqlx::Error> {
        let mut p = Progress::default();
        for r in sqlx::query(
            "SELECT h.replica::text, h.relation, count(*), count(*) FILTER (WHERE h.seq <= c.confirmed_seq)
             FROM ferry_sync.held h JOIN ferry_sync.replicas c ON c.id = h.replica
             WHERE $1::text IS NULL OR c.partition = $1 GROUP BY 1, 2",
        )
        .bind(partition)
        .fetch_all(&mut *tx)
        .await?
        {
            p.held.insert((r.get(0), r.get(1)), (r.get(2), r.get(3)));
        }
        for r in sqlx::query(
            "SELECT shard::text || ':' || part, relation, count(*) FILTER (WHERE NOT gone), max(rv) FROM ferry_sync.rows
             WHERE (shard, part) IN (SELECT ferry_sync.shard_of(id, (SELECT shards FROM ferry_sync.meta)), coalesce(partition, '')
                                     FROM ferry_sync.replicas
                                     WHERE standing <> 'retired' AND ($1::text IS NULL OR partition = $1))
             GROUP BY 1, 2",
        )
        .bind(partition)
        .fetch_all(&mut *tx)
        .await?
        {
            p.parts.insert((r.get(0), r.get(1)), (r.get(2), r.get(3)));
        }
        let relations: Vec<&str> = {
            let mut v: Vec<&str> = p.parts.keys().map(|(_, rel)| rel.as_str()).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        for r in sqlx::query(
            "SELECT m.shard::text || ':' || m.part, m.mark, rel, s.live
             FROM (SELECT DISTINCT ferry_sync.shard_of(id, (SELECT shards FROM ferry_sync.meta)) AS shard,
                          coalesce(partition, '') AS part, confirmed_pass AS mark
                   FROM ferry_sync.replicas
                   WHERE standing <> 'retired' AND ($1::text IS NULL OR partition = $1)) m
             CROSS JOIN unnest($2::text[]) AS rel
             CROSS JOIN LATERAL (SELECT count(*) FILTER (WHERE NOT r.gone) AS live FROM ferry_sync.rows r
                                 WHERE r.shard = m.shard AND r.relation = rel AND r.part = m.part AND r.rv > m.mark) s",
        )
        .bind(partition)
        .bind(&relations)
        .fetch_all(&mut *tx)
        .await?
        {
            p.since.insert((r.get(0), r.get(1), r.get(2)), r.get(3));
        }
        for r in sqlx::query(
            "SELECT q.replica::text, q.relation,
               count(*) FILTER (WHERE r.key IS NOT NULL AND r.rv <= c.confirmed_pass),
               count(*) FILTER (WHERE r.key IS NOT NULL AND r.rv > c.confirmed_pass),
               count(*) FILTER (WHERE r.key IS NULL)
             FROM ferry_sync.quarantine q JOIN ferry_sync.replicas c ON c.id = q.replica
             LEFT JOIN ferry_sync.rows r ON r.shard = ferry_sync.shard_of(c.id, (SELECT shards FROM ferry_sync.meta))
               AND r.relation = q.relation AND r.part = coalesce(c.partition, '')
               AND r.key = q.key AND NOT r.gone
             WHERE $1::text IS NULL OR c.partition = $1 GROUP BY 1, 2",
        )
        .bind(partition)
        .fetch_all(&mut *tx)
        .await?
        {
            p.quarantine
                .insert((r.get(0), r.get(1)), (r.get(2), r.get(3), r.get(4)));
        }
        Ok(p)
    }

    fn held_rows(&self, replica: &str) -> i64 {
        self.held_of(replica).map(|(_, (n, _))| n).sum()
    }

    fn held_of<'a>(&'a self, replica: &'a str) -> impl Iterator<Item = (&'a str, (i64, i64))> + 'a {
        self.held
            .range((replica.to_string(), String::new())..)
            .take_while(move |((r, _), _)| r == replica)
            .map(|((_, rel), n)| (rel.as_str(), *n))
    }

    /// Replica `id`'s tables, for its partition, audience and mark.
    fn of(&self, id: &str, part: &str, audience: Option<&str>, mark: i64) -> Vec<TableProgress> {
        // An audience's entry is kept as `schema.table@audience` (docs/sync-scale.md §1).
        let reaches =
            |rel: &str| crate::rules::reaches(rel.split_once('@').map(|(_, a)| a), audience);
        let quarantine = |rel: &str| {
            self.quarantine
                .get(&(id.to_string(), rel.to_string()))
                .copied()
                .unwrap_or_default()
        };
        let mut out = Vec::new();
        for ((_, rel), &(live, latest)) in self
            .parts
            .iter()
            .filter(|((p, rel), _)| p == part && reaches(rel))
        {
            let changed = self
                .since
                .get(&(part.to_string(), mark, rel.clone()))
                .copied()
                .unwrap_or(0);
            let (q_old, q_new, _) = quarantine(rel);
            let confirmed = live - changed - q_old;
            let pending = changed - q_new;
            out.push(TableProgress {
                table: rel.clone(),
                kind: "broadcast",
                rows: confirmed + pending,
                confirmed,
                pending,
                quarantined: q_old + q_new,
                latest_pass: Some(latest),
                covered: Some(mark >= latest),
            });
        }
        let mut per_row: BTreeMap<&str, (i64, i64, i64)> = BTreeMap::new();
        for (rel, (held, confirmed)) in self.held_of(id) {
            per_row.insert(rel, (held, confirmed, 0));
        }
        for ((r, rel), &(_, _, other)) in &self.quarantine {
            if r == id && other > 0 {
                per_row.entry(rel.as_str()).or_default().2 = other;
            }
        }
        for (rel, (held, confirmed, quarantined)) in per_row {
            out.push(TableProgress {
                table: rel.to_string(),
                kind: "per_row",
                rows: held,
                confirmed,
                pending: held - confirmed,
                quarantined,
                latest_pass: None,
                covered: None,
            });
        }
        out.sort_by(|a, b| a.table.cmp(&b.table).then(a.kind.cmp(b.kind)));
        out
    }
}
