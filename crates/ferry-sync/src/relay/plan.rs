//! Planning a batch of notes: what each replica should hold now against what it holds,
//! and the difference as outgoing parts. Runs inside the pass's REPEATABLE READ
//! transaction; it writes the server's held state (`rows`, `held`, `points`) as it goes,
//! so later tables in the same pass see their parents' new placement.
//!
//! 1. Tables are planned in index order, parents first (`Spec::tables`).
//! 2. Broadcast rows: one version per row and partition (`rows`); the part for a
//!    partition is shared by all its replicas.
//! 3. Per-replica rows: should (the rule, now) against held (`held`); a row held but no
//!    longer owed stays while a row the replica holds points at it (`points`).
//! 4. When a row's replicas change, its followers are planned in the same pass.
//! 5. Closure: every row sent brings the parents the replica lacks; parents only closure
//!    kept are released once nothing the replica holds points at them.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use sqlx::{PgConnection, Row};
use uuid::Uuid;

use super::out::{ReplicaOut, RowRef};
use super::read::{self, Fetched, Filter};
use super::spec::{RouteSpec, Spec, TableSpec, split_key_text};
use crate::value::{Affinity, Value};

/// The replicas a pass sends to (its relay shard's), by id and by partition, and their
/// audiences.
#[derive(Clone, Debug, Default)]
pub struct Following {
    /// The relay shard planning (docs/sync-scale.md §2): whose `rows` versions it keeps.
    pub shard: i32,
    pub partition_of: HashMap<Uuid, String>,
    pub by_partition: HashMap<String, Vec<Uuid>>,
    /// Only replicas that have an audience.
    pub audience_of: HashMap<Uuid, String>,
}

impl Following {
    pub fn insert(&mut self, id: Uuid, partition: String, audience: Option<String>) {
        self.by_partition
            .entry(partition.clone())
            .or_default()
            .push(id);
        self.partition_of.insert(id, partition);
        if let Some(a) = audience {
            self.audience_of.insert(id, a);
        }
    }

    /// Whether replica `r` is followed and holds `table` (its audience's, or every
    /// audience's).
    pub fn receives(&self, r: &Uuid, table: &TableSpec) -> bool {
        self.partition_of.contains_key(r)
            && table.reaches(self.audience_of.get(r).map(String::as_str))
    }

    /// The replicas of partition `part` that hold `table`.
    pub fn in_partition<'a>(
        &'a self,
        part: &str,
        table: &'a TableSpec,
    ) -> impl Iterator<Item = &'a Uuid> + 'a {
        self.by_partition
            .get(part)
            .into_iter()
            .flatten()
            .filter(move |r| table.reaches(self.audience_of.get(*r).map(String::as_str)))
    }
}

/// Something that may free a closure-only parent on a replica.
#[derive(Debug)]
enum Release {
    /// A row left the replica (table, key): what it pointed at may be free.
    Row(Uuid, usize, String),
    /// A parent (relation, key) lost a pointer.
    Parent(Uuid, String, String),
}

/// A pass's planner: accumulates outgoing parts and writes held state.
pub struct Planner<'a> {
    pub spec: &'a Spec,
    pub pass: i64,
    pub following: &'a Following,
    pub out: BTreeMap<Uuid, ReplicaOut>,
    /// Per table, keys still to plan in this pass (followers are added as parents move).
    work: Vec<BTreeSet<String>>,
    /// Rows sent to a replica in this pass, for closure: (replica, table, row).
    sent: Vec<(Uuid, usize, Fetched)>,
    /// Rows that left a replica, and parents that lost a pointer: closure-only parents
    /// among them may now be free.
    released: Vec<Release>,
    /// Per relation, its pending and parked notes as this pass's snapshot has them
    /// (`record_pending_sent`), read once a pass: `None` inside means a whole-table note.
    pending: HashMap<String, Option<HashSet<String>>>,
}

impl<'a> Planner<'a> {
    pub fn new(spec: &'a Spec, pass: i64, following: &'a Following) -> Planner<'a> {
        Planner {
            spec,
            pass,
            following,
            out: BTreeMap::new(),
            work: vec![BTreeSet::new(); spec.tables.len()],
            sent: Vec::new(),
            released: Vec::new(),
            pending: HashMap::new(),
        }
    }

    /// Queues a changed key of a table.
    pub fn note(&mut self, table: usize, key: String) {
        self.work[table].insert(key);
    }

    /// Plans every queued key, table by table, then closure and releases.
    pub async fn run(&mut self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        for t in 0..self.spec.tables.len() {
            let keys: Vec<String> = std::mem::take(&mut self.work[t]).into_iter().collect();
            for chunk in keys.chunks(1000) {
                if self.spec.tables[t].is_broadcast() {
                    self.broadcast(conn, t, chunk).await?;
                } else {
                    self.per_replica(conn, t, chunk).await?;
                }
            }
        }
        self.closure(conn).await?;
        self.release(conn).await?;
        // A row a heal or a provisioning sent from the held state at the start of the
        // pass, and that a note then took away, must not stay: the last decision wins.
        for (r, out) in self.out.iter_mut() {
            for (t, table_out) in out.tables.iter_mut() {
                table_out.settle(&self.spec.tables[*t].key_columns());
            }
            out.audience = self.following.audience_of.get(r).cloned();
        }
        Ok(())
    }

    /// Step 2: broadcast rows.
    async fn broadcast(
        &mut self,
        conn: &mut PgConnection,
        t: usize,
        keys: &[String],
    ) -> Result<(), sqlx::Error> {
        let table = &self.spec.tables[t];
        let rows = read::rows(conn, self.spec, table, Filter::Keys(keys)).await?;
        let now: HashMap<&str, &Fetched> = rows
            .iter()
            .filter(|r| r.shown)
            .map(|r| (r.key.as_str(), r))
            .collect();
        let before: Vec<(String, String)> = sqlx::query(
            "SELECT part, key FROM ferry_sync.rows WHERE shard = $3 AND relation = $1 AND key = ANY($2) AND NOT gone",
        )
        .bind(&table.relation)
        .bind(keys)
        .bind(self.following.shard)
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
        let mut parts: HashMap<String, (Vec<RowRef>, Vec<RowRef>)> = HashMap::new();
        let (mut w_part, mut w_key, mut w_gone) = (Vec::new(), Vec::new(), Vec::new());
        for (part, key) in &before {
            let stays = now.get(key.as_str()).is_some_and(|r| &r.partition == part);
            if !stays {
                let Some(k) = key_values(self.spec, t, key) else {
                    continue;
                };
                parts.entry(part.clone()).or_default().0.push(k);
                w_part.push(part.clone());
                w_key.push(key.clone());
                w_gone.push(true);
            }
        }
        for row in now.values() {
            parts
                .entry(row.partition.clone())
                .or_default()
                .1
                .push(row.values.clone());
            w_part.push(row.partition.clone());
            w_key.push(row.key.clone());
            w_gone.push(false);
        }
        sqlx::query(
            "INSERT INTO ferry_sync.rows (shard, relation, part, key, rv, gone)
             SELECT $6, $1, p, k, $2, g FROM unnest($3::text[], $4::text[], $5::bool[]) AS x(p, k, g)
             ON CONFLICT (shard, relation, part, key) DO UPDATE SET rv = excluded.rv, gone = excluded.gone",
        )
        .bind(&table.relation)
        .bind(self.pass)
        .bind(&w_part)
        .bind(&w_key)
        .bind(&w_gone)
        .bind(self.following.shard)
        .execute(&mut *conn)
        .await?;
        // Replicas that hold some of these rows per row, because their own rows point at
        // them (closure across partitions), and the pointers that keep them.
        let holders = held_of(conn, self.following, &table.relation, keys).await?;
        let pointed: HashSet<(Uuid, String)> = sqlx::query(
            "SELECT replica, key FROM ferry_sync.points WHERE relation = $1 AND key = ANY($2)",
        )
        .bind(&table.relation)
        .bind(keys)
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
        // Every row read, shown or not: a row `active` hides still travels to a replica
        // whose rows point at it.
        let any: HashMap<&str, &Fetched> = rows.iter().map(|r| (r.key.as_str(), r)).collect();
        let mut kept: Vec<(Uuid, String, bool)> = Vec::new();
        for (part, (deletes, upserts)) in parts {
            let deletes = Arc::new(deletes);
            let upserts = Arc::new(upserts);
            for r in self.following.in_partition(&part, table) {
                let o = self.out.entry(*r).or_default().table(t);
                o.upserts.extend(upserts.iter().cloned());
                for k in deletes.iter() {
                    let key = super::record::key_text_of(k, &(0..k.len()).collect::<Vec<_>>());
                    match any.get(key.as_str()) {
                        // Leaving the replica's partition while its own rows point at it:
                        // it stays, held per row.
                        Some(row) if pointed.contains(&(*r, key.clone())) => {
                            o.upserts.push(row.values.clone());
                            kept.push((*r, key, false));
                        }
                        _ => o.delete(key, k.clone()),
                    }
                }
            }
        }
        let mut dropped: Vec<(Uuid, String)> = Vec::new();
        let mut taken_back: Vec<(String, String)> = Vec::new();
        for (key, hs) in &holders {
            for (r, _) in hs {
                let rpart = self.following.partition_of.get(r);
                match any.get(key.as_str()) {
                    Some(row) if row.shown && rpart == Some(&row.partition) => {
                        dropped.push((*r, key.clone()))
                    }
                    Some(row) => {
                        if !kept.iter().any(|(kr, kk, _)| kr == r && kk == key) {
                            self.out
                                .entry(*r)
                                .or_default()
                                .table(t)
                                .upserts
                                .push(row.values.clone());
                        }
                    }
                    None => {
                        if let Some(k) = key_values(self.spec, t, key) {
                            self.out
                                .entry(*r)
                                .or_default()
                                .table(t)
                                .delete(key.clone(), k);
                        }
                        if let Some(part) = rpart {
                            taken_back.push((part.clone(), key.clone()));
                        }
                        dropped.push((*r, key.clone()));
                    }
                }
            }
        }
        write_held(conn, &table.relation, &kept, &dropped).await?;
        for (part, key) in &taken_back {
            let at = (self.following.shard, self.pass);
            tombstone(conn, &table.relation, part, key, at).await?;
        }
        for row in rows.iter().filter(|r| r.shown) {
            for r in self.following.in_partition(&row.partition, table) {
                if !self.spec.tables[t].parents.is_empty() {
                    self.sent.push((*r, t, row.clone()));
                }
            }
        }
        // Followers of broadcast rows are planned with them: their placement is the
        // parent's partition, which may just have changed.
        self.queue_followers(conn, t, keys).await
    }

    /// Step 3: per-replica rows.
    async fn per_replica(
        &mut self,
        conn: &mut PgConnection,
        t: usize,
        keys: &[String],
    ) -> Result<(), sqlx::Error> {
        let table = &self.spec.tables[t];
        let rows = read::rows(conn, self.spec, table, Filter::Keys(keys)).await?;
        let by_key: HashMap<&str, &Fetched> = rows.iter().map(|r| (r.key.as_str(), r)).collect();
        let held = held_of(conn, self.following, &table.relation, keys).await?;
        let mut moved: Vec<String> = Vec::new();
        let mut held_set: Vec<(Uuid, String, bool)> = Vec::new();
        let mut held_drop: Vec<(Uuid, String)> = Vec::new();
        for key in keys {
            let row = by_key.get(key.as_str()).copied();
            let should: BTreeSet<Uuid> = match row {
                Some(r) if r.shown => self.should(conn, t, r).await?,
                _ => BTreeSet::new(),
            };
            let holders = held.get(key).cloned().unwrap_or_default();
            let by_rule_before: BTreeSet<Uuid> = holders
                .iter()
                .filter(|(_, b)| *b)
                .map(|(r, _)| *r)
                .collect();
            if by_rule_before != should {
                moved.push(key.clone());
            }
            for r in &should {
                let row = row.expect("should is empty without a row");
                self.out
                    .entry(*r)
                    .or_default()
                    .table(t)
                    .upserts
                    .push(row.values.clone());
                self.sent.push((*r, t, row.clone()));
                held_set.push((*r, key.clone(), true));
            }
            for (r, _) in holders.iter().filter(|(r, _)| !should.contains(r)) {
                match row {
                    Some(row) if pointed_at(conn, *r, &table.relation, key).await? => {
                        self.out
                            .entry(*r)
                            .or_default()
                            .table(t)
                            .upserts
                            .push(row.values.clone());
                        self.sent.push((*r, t, row.clone()));
                        held_set.push((*r, key.clone(), false));
                    }
                    _ => {
                        if let Some(k) = key_values(self.spec, t, key) {
                            self.out
                                .entry(*r)
                                .or_default()
                                .table(t)
                                .delete(key.clone(), k);
                        }
                        held_drop.push((*r, key.clone()));
                        self.released.push(Release::Row(*r, t, key.clone()));
                    }
                }
            }
        }
        write_held(conn, &table.relation, &held_set, &held_drop).await?;
        if !moved.is_empty() {
            self.queue_followers(conn, t, &moved).await?;
        }
        Ok(())
    }

    /// The replicas a row's own rule sends it to now.
    async fn should(
        &self,
        conn: &mut PgConnection,
        t: usize,
        row: &Fetched,
    ) -> Result<BTreeSet<Uuid>, sqlx::Error> {
        let table = &self.spec.tables[t];
        Ok(match &table.route {
            RouteSpec::Assigned { .. } => row
                .assigned
                .as_deref()
                .and_then(|a| Uuid::parse_str(a).ok())
                .filter(|r| self.following.receives(r, table))
                .into_iter()
                .collect(),
            RouteSpec::Follows { parent } => {
                let Some(pk) = &row.parents[*parent] else {
                    return Ok(BTreeSet::new());
                };
                let p = &self.spec.tables[table.parents[*parent].table];
                if p.is_broadcast() {
                    let parts: Vec<String> = sqlx::query_scalar(
                        "SELECT part FROM ferry_sync.rows WHERE shard = $3 AND relation = $1 AND key = $2 AND NOT gone",
                    )
                    .bind(&p.relation)
                    .bind(pk)
                    .bind(self.following.shard)
                    .fetch_all(&mut *conn)
                    .await?;
                    parts
                        .iter()
                        .flat_map(|part| self.following.in_partition(part, table).copied())
                        .collect()
                } else {
                    let ids: Vec<Uuid> = sqlx::query_scalar(
                        "SELECT replica FROM ferry_sync.held WHERE relation = $1 AND key = $2 AND by_rule",
                    )
                    .bind(&p.relation)
                    .bind(pk)
                    .fetch_all(&mut *conn)
                    .await?;
                    ids.into_iter()
                        .filter(|r| self.following.receives(r, table))
                        .collect()
                }
            }
            RouteSpec::Grouped { .. } | RouteSpec::Routed { .. } => {
                super::route::replicas_of(conn, self.spec, t, &row.key)
                    .await?
                    .into_iter()
                    .filter(|r| self.following.receives(r, table))
                    .collect()
            }
            RouteSpec::Closure | RouteSpec::Broadcast { .. } => BTreeSet::new(),
        })
    }

    /// Step 4: queue the rows of `follows` tables that point at these keys of table `t`.
    async fn queue_followers(
        &mut self,
        conn: &mut PgConnection,
        t: usize,
        keys: &[String],
    ) -> Result<(), sqlx::Error> {
        for (child, slot) in self.spec.followers(t) {
            let rows = read::rows(
                conn,
                self.spec,
                &self.spec.tables[child],
                Filter::Parents(slot, keys),
            )
            .await?;
            self.work[child].extend(rows.into_iter().map(|r| r.key));
        }
        Ok(())
    }

    /// Step 5a: parents the replicas lack travel with the rows that point at them.
    async fn closure(&mut self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        let mut seen: HashSet<(Uuid, usize, String)> = HashSet::new();
        while let Some((r, t, row)) = self.sent.pop() {
            let table = &self.spec.tables[t];
            let mut points: Vec<(String, String)> = Vec::new();
            for (slot, parent) in table.parents.iter().enumerate() {
                let Some(pk) = &row.parents[slot] else {
                    continue;
                };
                let p = parent.table;
                let pt = &self.spec.tables[p];
                if table.is_broadcast() {
                    // A broadcast row's parents are broadcast too (Spec::build), held by
                    // every replica of their partition.
                    continue;
                }
                points.push((pt.relation.clone(), pk.clone()));
                if !seen.insert((r, p, pk.clone())) || holds(conn, r, &pt.relation, pk).await? {
                    continue;
                }
                let parents =
                    read::rows(conn, self.spec, pt, Filter::Keys(std::slice::from_ref(pk))).await?;
                let Some(prow) = parents.into_iter().next() else {
                    continue;
                };
                // A broadcast parent of the replica's own partition is held by its rule; one
                // of another partition (or one `active` hides) travels per row, like any
                // closure parent.
                if pt.is_broadcast()
                    && prow.shown
                    && self.following.partition_of.get(&r) == Some(&prow.partition)
                {
                    continue;
                }
                self.out
                    .entry(r)
                    .or_default()
                    .table(p)
                    .upserts
                    .push(prow.values.clone());
                write_held(conn, &pt.relation, &[(r, pk.clone(), false)], &[]).await?;
                self.sent.push((r, p, prow));
            }
            if !table.is_broadcast() {
                for (relation, key) in
                    set_points(conn, r, &table.relation, &row.key, &points).await?
                {
                    self.released.push(Release::Parent(r, relation, key));
                }
            }
        }
        Ok(())
    }

    /// Step 5b: closure-only parents nothing held points at any more go.
    async fn release(&mut self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        while let Some(release) = self.released.pop() {
            let (r, t, key) = match release {
                Release::Row(r, t, key) => (r, t, key),
                Release::Parent(r, relation, key) => {
                    self.release_parent(conn, r, &relation, &key).await?;
                    continue;
                }
            };
            let relation = &self.spec.tables[t].relation;
            let freed: Vec<(String, String)> = sqlx::query(
                "DELETE FROM ferry_sync.points WHERE replica = $1 AND child_relation = $2 AND child_key = $3
                 RETURNING relation, key",
            )
            .bind(r)
            .bind(relation)
            .bind(&key)
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
            for (prel, pkey) in freed {
                self.release_parent(conn, r, &prel, &pkey).await?;
            }
        }
        Ok(())
    }

    async fn release_parent(
        &mut self,
        conn: &mut PgConnection,
        r: Uuid,
        relation: &str,
        key: &str,
    ) -> Result<(), sqlx::Error> {
        if pointed_at(conn, r, relation, key).await? {
            return Ok(());
        }
        let gone: Option<bool> = sqlx::query_scalar(
            "DELETE FROM ferry_sync.held WHERE replica = $1 AND relation = $2 AND key = $3 AND NOT by_rule RETURNING true",
        )
        .bind(r)
        .bind(relation)
        .bind(key)
        .fetch_optional(&mut *conn)
        .await?;
        if gone.is_some()
            && let Some(p) = self.spec.table(relation)
        {
            if self.spec.tables[p].is_broadcast() {
                let part = self
                    .following
                    .partition_of
                    .get(&r)
                    .cloned()
                    .unwrap_or_default();
                let by_rule: bool = sqlx::query_scalar(
                    "SELECT EXISTS (SELECT 1 FROM ferry_sync.rows WHERE shard = $4 AND relation = $1 AND part = $2 AND key = $3 AND NOT gone)",
                )
                .bind(relation)
                .bind(&part)
                .bind(key)
                .bind(self.following.shard)
                .fetch_one(&mut *conn)
                .await?;
                if by_rule {
                    return Ok(());
                }
                // A catch-up of the replica's partition sends that partition's tombstones
                // only: without one here, a take-back in a dropped outbox is never resent.
                if !part.is_empty() {
                    let at = (self.following.shard, self.pass);
                    tombstone(conn, relation, &part, key, at).await?;
                }
            }
            if let Some(k) = key_values(self.spec, p, key) {
                // An upsert of the same row earlier in this pass (it was kept for a pointer
                // that has just gone) does not outlive the delete (`TableOut::settle`).
                self.out
                    .entry(r)
                    .or_default()
                    .table(p)
                    .delete(key.to_string(), k);
            }
            self.released.push(Release::Row(r, p, key.to_string()));
        }
        Ok(())
    }
}

/// The typed key values of a key text, by the table's key columns' affinities.
pub fn key_values(spec: &Spec, t: usize, key: &str) -> Option<RowRef> {
    let table = &spec.tables[t];
    let cols = table.key_columns();
    let parts = split_key_text(key, cols.len())?;
    let mut values = Vec::with_capacity(cols.len());
    for (i, part) in cols.iter().zip(parts) {
        values.push(match table.columns[*i].affinity {
            Affinity::Integer => Value::Int(part.parse().ok()?),
            _ => Value::Text(part),
        });
    }
    Some(Arc::new(values))
}

/// The holders of these keys among `following`'s replicas: another relay shard's are its
/// own to plan (docs/sync-scale.md §2).
async fn held_of(
    conn: &mut PgConnection,
    following: &Following,
    relation: &str,
    keys: &[String],
) -> Result<HashMap<String, Vec<(Uuid, bool)>>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT key, replica, by_rule FROM ferry_sync.held WHERE relation = $1 AND key = ANY($2)",
    )
    .bind(relation)
    .bind(keys)
    .fetch_all(&mut *conn)
    .await?;
    let mut out: HashMap<String, Vec<(Uuid, bool)>> = HashMap::new();
    for row in rows {
        let r: Uuid = row.get(1);
        if !following.partition_of.contains_key(&r) {
            continue;
        }
        out.entry(row.get(0))
            .or_default()
            .push((row.get(1), row.get(2)));
    }
    Ok(out)
}

/// Records (replica, key) as held (`by_rule` as given) and drops the others.
pub async fn write_held(
    conn: &mut PgConnection,
    relation: &str,
    set: &[(Uuid, String, bool)],
    drop: &[(Uuid, String)],
) -> Result<(), sqlx::Error> {
    if !set.is_empty() {
        let (r, k, b): (Vec<Uuid>, Vec<String>, Vec<bool>) = set
            .iter()
            .map(|(r, k, b)| (*r, k.clone(), *b))
            .collect::<(Vec<_>, Vec<_>, Vec<_>)>();
        sqlx::query(
            "INSERT INTO ferry_sync.held (replica, relation, key, seq, by_rule)
             SELECT r, $1, k, 0, b FROM unnest($2::uuid[], $3::text[], $4::bool[]) AS x(r, k, b)
             ON CONFLICT (replica, relation, key) DO UPDATE SET by_rule = excluded.by_rule, seq = 0",
        )
        .bind(relation)
        .bind(r)
        .bind(k)
        .bind(b)
        .execute(&mut *conn)
        .await?;
    }
    if !drop.is_empty() {
        let (r, k): (Vec<Uuid>, Vec<String>) = drop.iter().map(|(r, k)| (*r, k.clone())).unzip();
        sqlx::query(
            "DELETE FROM ferry_sync.held h USING unnest($2::uuid[], $3::text[]) AS x(r, k)
             WHERE h.replica = x.r AND h.relation = $1 AND h.key = x.k",
        )
        .bind(relation)
        .bind(r)
        .bind(k)
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

async fn holds(
    conn: &mut PgConnection,
    r: Uuid,
    relation: &str,
    key: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM ferry_sync.held WHERE replica = $1 AND relation = $2 AND key = $3)")
        .bind(r)
        .bind(relation)
        .bind(key)
        .fetch_one(&mut *conn)
        .await
}

async fn pointed_at(
    conn: &mut PgConnection,
    r: Uuid,
    relation: &str,
    key: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM ferry_sync.points WHERE replica = $1 AND relation = $2 AND key = $3)")
        .bind(r)
        .bind(relation)
        .bind(key)
        .fetch_one(&mut *conn)
        .await
}

/// Records that a broadcast row held per row (closure) left a replica of `part`, where it
/// is not held by the partition's rule: a tombstone, so a catch-up of `part`'s replicas
/// from before this pass takes it back too. A replica of `part` that still points at the
/// row gets it again from that catch-up's closure, after the delete.
async fn tombstone(
    conn: &mut PgConnection,
    relation: &str,
    part: &str,
    key: &str,
    (shard, pass): (i32, i64),
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO ferry_sync.rows (shard, relation, part, key, rv, gone) VALUES ($5, $1, $2, $3, $4, true)
         ON CONFLICT (shard, relation, part, key) DO UPDATE SET rv = excluded.rv, gone = true",
    )
    .bind(relation)
    .bind(part)
    .bind(key)
    .bind(pass)
    .bind(shard)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Replaces what a held row points at; returns the parents it no longer points at.
async fn set_points(
    conn: &mut PgConnection,
    r: Uuid,
    child: &str,
    child_key: &str,
    points: &[(String, String)],
) -> Result<Vec<(String, String)>, sqlx::Error> {
    let old: Vec<(String, String)> = sqlx::query(
        "DELETE FROM ferry_sync.points WHERE replica = $1 AND child_relation = $2 AND child_key = $3 RETURNING relation, key",
    )
    .bind(r)
    .bind(child)
    .bind(child_key)
    .fetch_all(&mut *conn)
    .await?
    .iter()
    .map(|row| (row.get(0), row.get(1)))
    .collect();
    for (rel, key) in points {
        sqlx::query(
            "INSERT INTO ferry_sync.points (replica, relation, key, child_relation, child_key)
             VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING",
        )
        .bind(r)
        .bind(rel)
        .bind(key)
        .bind(child)
        .bind(child_key)
        .execute(&mut *conn)
        .await?;
    }
    Ok(old.into_iter().filter(|p| !points.contains(p)).collect())
}

/// How a replica's new chain is filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provision {
    /// Everything its rules route to it: every table swept.
    Full,
    /// It held everything up to `since` (a pass number): broadcast tables carry only rows
    /// and tombstones recorded after it; per-replica tables are swept.
    CatchUp { since: i64 },
}

impl Planner<'_> {
    /// Starts a new chain for replica `r` (docs/sync-protocol.md §1.4, §7.5). Its held state is
    /// rebuilt from what the chain sends.
    pub async fn provision(
        &mut self,
        conn: &mut PgConnection,
        r: Uuid,
        how: Provision,
    ) -> Result<(), sqlx::Error> {
        let partition = self
            .following
            .partition_of
            .get(&r)
            .cloned()
            .unwrap_or_default();
        for sql in [
            "DELETE FROM ferry_sync.held WHERE replica = $1",
            "DELETE FROM ferry_sync.points WHERE replica = $1",
        ] {
            sqlx::query(sql).bind(r).execute(&mut *conn).await?;
        }
        if how == Provision::Full {
            sqlx::query("DELETE FROM ferry_sync.quarantine WHERE replica = $1")
                .bind(r)
                .execute(&mut *conn)
                .await?;
        }
        let out = self.out.entry(r).or_default();
        *out = ReplicaOut {
            chain_start: true,
            ..ReplicaOut::default()
        };
        let mut by_rule: Vec<Vec<String>> = vec![Vec::new(); self.spec.tables.len()];
        for t in 0..self.spec.tables.len() {
            let table = &self.spec.tables[t];
            if !self.following.receives(&r, table) {
                continue;
            }
            if let (RouteSpec::Broadcast { .. }, Provision::CatchUp { since }) = (&table.route, how)
            {
                self.catch_up_broadcast(conn, r, t, &partition, since)
                    .await?;
                continue;
            }
            let rows = match &table.route {
                RouteSpec::Broadcast { partition: Some(_) } => {
                    read::rows(conn, self.spec, table, Filter::Partition(&partition)).await?
                }
                RouteSpec::Broadcast { partition: None } => {
                    read::rows(conn, self.spec, table, Filter::All).await?
                }
                RouteSpec::Assigned { .. } => {
                    read::rows(conn, self.spec, table, Filter::Assigned(&r.to_string())).await?
                }
                RouteSpec::Follows { parent } => {
                    let p = table.parents[*parent].table;
                    let keys = std::mem::take(&mut by_rule[p]);
                    let rows =
                        read::rows(conn, self.spec, table, Filter::Parents(*parent, &keys)).await?;
                    by_rule[p] = keys;
                    rows
                }
                RouteSpec::Grouped { .. } | RouteSpec::Routed { .. } => {
                    let keys = super::route::keys_for(conn, self.spec, t, r).await?;
                    read::rows(conn, self.spec, table, Filter::Keys(&keys)).await?
                }
                RouteSpec::Closure => Vec::new(),
            };
            let rows: Vec<Fetched> = rows.into_iter().filter(|row| row.shown).collect();
            let o = self.out.entry(r).or_default().table(t);
            o.sweep_start = true;
            o.sweep_end = true;
            o.upserts.extend(rows.iter().map(|row| row.values.clone()));
            by_rule[t] = rows.iter().map(|row| row.key.clone()).collect();
            if table.is_broadcast() {
                let keys = std::mem::take(&mut by_rule[t]);
                self.record_pending_sent(conn, &table.relation, &partition, &keys)
                    .await?;
                by_rule[t] = keys;
            }
            if !table.is_broadcast() {
                let set: Vec<(Uuid, String, bool)> =
                    rows.iter().map(|row| (r, row.key.clone(), true)).collect();
                write_held(conn, &table.relation, &set, &[]).await?;
            }
            if !table.parents.is_empty() {
                self.sent.extend(rows.into_iter().map(|row| (r, t, row)));
            }
        }
        Ok(())
    }

    /// A snapshot reads a broadcast table as it is, which can be ahead of the held state: a
    /// row whose note is still pending (batches are bounded) is sent now, though `rows` does
    /// not yet place it in the partition. If its note then moves it to another partition,
    /// planning finds no entry here and sends this partition no tombstone, and the replica
    /// keeps it (the walk's seed 44: docs/notes/2026-12-06-walk-seed-44.md). So the keys this
    /// snapshot sent that have a pending or parked note are placed in the partition now
    /// (every key when a whole-table note is pending); entries already there stay as they are.
    async fn record_pending_sent(
        &mut self,
        conn: &mut PgConnection,
        relation: &str,
        partition: &str,
        sent: &[String],
    ) -> Result<(), sqlx::Error> {
        if !self.pending.contains_key(relation) {
            // Notes name the Postgres table, or this entry alone (`Spec::noted`).
            let noted_as = self
                .spec
                .table(relation)
                .map_or(relation, |t| self.spec.tables[t].noted_as.as_str());
            let notes: Vec<(String, String)> = sqlx::query_as(
                "SELECT DISTINCT kind, key FROM ferry_sync.notes WHERE relation IN ($1, $2)",
            )
            .bind(noted_as)
            .bind(relation)
            .fetch_all(&mut *conn)
            .await?;
            let keys = (!notes.iter().any(|(kind, _)| kind == "table"))
                .then(|| notes.into_iter().map(|(_, key)| key).collect());
            self.pending.insert(relation.to_string(), keys);
        }
        let keys: Vec<String> = match &self.pending[relation] {
            None => sent.to_vec(),
            Some(noted) if noted.is_empty() => return Ok(()),
            Some(noted) => sent
                .iter()
                .filter(|k| noted.contains(*k))
                .cloned()
                .collect(),
        };
        if keys.is_empty() {
            return Ok(());
        }
        sqlx::query(
            "INSERT INTO ferry_sync.rows (shard, relation, part, key, rv, gone)
             SELECT $5, $1, $2, k, $3, false FROM unnest($4::text[]) AS k
             ON CONFLICT (shard, relation, part, key) DO UPDATE SET rv = excluded.rv, gone = false
             WHERE ferry_sync.rows.gone",
        )
        .bind(relation)
        .bind(partition)
        .bind(self.pass)
        .bind(&keys)
        .bind(self.following.shard)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }

    /// A broadcast table's share of a catch-up: what changed after `since`, once each.
    async fn catch_up_broadcast(
        &mut self,
        conn: &mut PgConnection,
        r: Uuid,
        t: usize,
        partition: &str,
        since: i64,
    ) -> Result<(), sqlx::Error> {
        let table = &self.spec.tables[t];
        let changed: Vec<(String, bool)> = sqlx::query(
            "SELECT key, gone FROM ferry_sync.rows WHERE shard = $4 AND relation = $1 AND part = $2 AND rv > $3",
        )
        .bind(&table.relation)
        .bind(partition)
        .bind(since)
        .bind(self.following.shard)
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
        let live: Vec<String> = changed
            .iter()
            .filter(|(_, gone)| !gone)
            .map(|(k, _)| k.clone())
            .collect();
        let rows = read::rows(conn, self.spec, table, Filter::Keys(&live)).await?;
        let o = self.out.entry(r).or_default().table(t);
        for (key, _) in changed.iter().filter(|(_, gone)| *gone) {
            if let Some(k) = key_values(self.spec, t, key) {
                o.delete(key.clone(), k);
            }
        }
        o.upserts.extend(
            rows.iter()
                .filter(|row| row.shown)
                .map(|row| row.values.clone()),
        );
        Ok(())
    }
}

/// The rows replica `r` (of `partition`) should hold in table `t`, as the server records
/// it, leaving out rows quarantined for it: what a digest is compared with and what a
/// table heal sends.
/// A broadcast table's rows by its rule, per (table, partition), read once in a pass
/// (one snapshot): every replica of the partition should hold the same ones, so 100
/// replicas' digests cost one read of the table, not 100.
pub type ByRule = HashMap<(usize, String), Arc<Vec<Fetched>>>;

pub async fn should_rows(
    conn: &mut PgConnection,
    spec: &Spec,
    r: Uuid,
    partition: &str,
    t: usize,
    by_rule_read: Option<&mut ByRule>,
) -> Result<Vec<Fetched>, sqlx::Error> {
    let table = &spec.tables[t];
    // Rows held per row: all of a per-replica table's, and a broadcast table's rows of
    // other partitions that the replica's own rows point at (closure).
    let keys: Vec<String> =
        sqlx::query_scalar("SELECT key FROM ferry_sync.held WHERE replica = $1 AND relation = $2")
            .bind(r)
            .bind(&table.relation)
            .fetch_all(&mut *conn)
            .await?;
    let mut rows = read::rows(conn, spec, table, Filter::Keys(&keys)).await?;
    if let RouteSpec::Broadcast { partition: p } = &table.route {
        let cache_key = (t, partition.to_string());
        let by_rule = match by_rule_read.as_ref().and_then(|c| c.get(&cache_key)) {
            Some(rows) => rows.clone(),
            None => {
                let read = Arc::new(match p {
                    Some(_) => read::rows(conn, spec, table, Filter::Partition(partition)).await?,
                    None => read::rows(conn, spec, table, Filter::All).await?,
                });
                if let Some(cache) = by_rule_read {
                    cache.insert(cache_key, read.clone());
                }
                read
            }
        };
        let seen: HashSet<String> = rows.iter().map(|row| row.key.clone()).collect();
        rows.extend(
            by_rule
                .iter()
                .filter(|row| row.shown && !seen.contains(&row.key))
                .cloned(),
        );
    }
    let quarantined: HashSet<String> = sqlx::query_scalar(
        "SELECT key FROM ferry_sync.quarantine WHERE replica = $1 AND relation = $2",
    )
    .bind(r)
    .bind(&table.relation)
    .fetch_all(&mut *conn)
    .await?
    .into_iter()
    .collect();
    rows.retain(|row| !quarantined.contains(&row.key));
    Ok(rows)
}

impl Planner<'_> {
    /// Resends one table to replica `r` inside its chain, with a sweep, so the replica ends
    /// with exactly what the server records it holding (docs/sync-protocol.md §1.3).
    pub async fn heal_table(
        &mut self,
        conn: &mut PgConnection,
        r: Uuid,
        t: usize,
    ) -> Result<(), sqlx::Error> {
        let partition = self
            .following
            .partition_of
            .get(&r)
            .cloned()
            .unwrap_or_default();
        let rows = should_rows(conn, self.spec, r, &partition, t, None).await?;
        let o = self.out.entry(r).or_default().table(t);
        o.sweep_start = true;
        o.sweep_end = true;
        o.upserts.extend(rows.iter().map(|row| row.values.clone()));
        Ok(())
    }
}
