//! The relay: one process at a time turns notes into each replica's numbered messages.
//! `docs/sync-relay.md` §1 is the contract.
//!
//! 1. Take the relay lock on a dedicated connection (`pg_try_advisory_lock`); until then,
//!    stand by and retry every `standby / 5`.
//! 2. Run passes on that connection: each is one REPEATABLE READ transaction that first
//!    checks the lock is still this backend's, then handles reports, plans a batch of
//!    notes, records messages and deletes the notes (`pass`).
//! 3. Wake on `NOTIFY ferry_sync` (a write, a report) or every `idle`.
//! 4. A transient error rolls the pass back and retries after a backoff; a lost lock
//!    connection goes back to step 1. A permanent error halves the batch until the one
//!    note it belongs to is parked (`step`).
//!
//! What a crash leaves: before a pass commits, nothing (notes and reports stay); after,
//! the outbox rows, which every serve process delivers.

pub mod error;
pub mod out;
pub mod pack;
pub mod plan;
pub mod read;
pub mod record;
pub mod reports;
pub mod route;
pub mod spec;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry_core::Classify;
use sqlx::{Connection, PgConnection, Row};
use uuid::Uuid;

pub use error::RelayError;
use plan::{Following, Planner, Provision};
use record::{Chain, Epoch};
use spec::Spec;

/// What the relay says when its transactions run on another backend than its lock.
pub const POOLER: &str = "the relay's transactions do not run on the backend that holds its lock: --db goes through a pooler in transaction mode (pgbouncer pool_mode=transaction, or similar). The relay needs a direct connection or session pooling; other processes (serve --no-relay, status) may use the pooler";

/// The advisory lock key of the relay: "FERRYSYC". Relay shard `k` locks `LOCK_KEY + k`.
pub const LOCK_KEY: i64 = 0x4645_5252_5953_5943;

/// The advisory lock key of relay shard `shard`.
pub fn lock_key(shard: u32) -> i64 {
    LOCK_KEY + i64::from(shard)
}

/// The relay shard replica `id` belongs to, of `shards`: its first four bytes as an
/// unsigned big-endian integer, modulo `shards` (`ferry_sync.shard_of` in SQL).
pub fn shard_of(id: &Uuid, shards: u32) -> u32 {
    let b = id.as_bytes();
    u32::from_be_bytes([b[0], b[1], b[2], b[3]]) % shards.max(1)
}

/// The relay's settings; `RelaySettings::default()` documents each.
#[derive(Clone, Debug)]
pub struct RelaySettings {
    /// Notes planned per pass. Larger passes amortise the per-replica work of a pass
    /// (one outbox row and one chain update per replica) over more changes, and hold
    /// the REPEATABLE READ snapshot longer.
    pub batch: usize,
    /// A standby retries the lock every `standby / 5`, so it takes over within `standby`
    /// of the holder's session ending.
    pub standby: Duration,
    /// Without a notification, the relay looks for notes this often.
    pub idle: Duration,
    /// Pacing (docs/sync-relay.md §1.2): a pass woken by a notification waits until
    /// `pace_per_message` times the messages the previous pass recorded, at most
    /// `pace_max`, has passed since that pass began. What a pass costs downstream (per
    /// replica: an outbox row, a look, a fetch, an apply and its fsync, a confirmation)
    /// is paid per message, so changes that come faster than a pass's fan-out can be
    /// served share a pass and one message per replica. A pass that reached one replica
    /// delays the next by microseconds, one that reached 100 by up to `pace_max`; an
    /// idle relay's first change passes at once.
    pub pace_per_message: Duration,
    pub pace_max: Duration,
    /// Parked notes and quarantined rows are tried again this often (and at start).
    pub retry_every: Duration,
    /// What one message may carry when packing.
    pub budget: pack::Budget,
    /// A replica's outbox past this many messages, or `outbox_bytes_max` bytes, is
    /// dropped and the replica caught up by a new chain (docs/sync-relay.md §1.4): 10,000
    /// messages of a few rows each is days of changes for a shop, and bounds what one
    /// replica that never comes back costs the server.
    pub outbox_messages_max: i64,
    /// A replica's digests are compared at most this often: the comparison reads every
    /// row the replica should hold.
    pub digest_every: Duration,
    pub outbox_bytes_max: i64,
    /// How the inbox's rows are filed again when parked items are retried (at start and
    /// every `retry_every`): as serve files uploads.
    pub file_shape: crate::file::Shape,
    /// The relay shard this relay records for, below the rules' `shards`
    /// (docs/sync-scale.md §2): its replicas, its notes, its lock.
    pub shard: u32,
}

impl Default for RelaySettings {
    fn default() -> Self {
        RelaySettings {
            batch: 500,
            standby: Duration::from_secs(5),
            idle: Duration::from_millis(250),
            pace_per_message: Duration::from_micros(400),
            pace_max: Duration::from_millis(50),
            retry_every: Duration::from_secs(3600),
            outbox_messages_max: 10_000,
            digest_every: Duration::from_secs(600),
            outbox_bytes_max: 256 << 20,
            file_shape: crate::file::Shape::default(),
            shard: 0,
            budget: pack::Budget {
                bytes: crate::wire::BODY_TARGET_BYTES,
                rows: crate::wire::ROWS_PER_MESSAGE_MAX,
            },
        }
    }
}

/// Counters the relay shares with status and metrics.
#[derive(Debug, Default)]
pub struct RelayStats {
    pub holding: AtomicBool,
    /// The relay shard it records for (docs/sync-scale.md §2).
    pub shard: std::sync::atomic::AtomicU32,
    pub passes: AtomicU64,
    pub notes: AtomicU64,
    pub messages: AtomicU64,
    pub bytes: AtomicU64,
    pub parked: AtomicU64,
    pub errors: AtomicU64,
    pub new_epochs: AtomicU64,
    /// Tables resent because a digest disagreed. With no fault injected this stays 0:
    /// a heal in a clean run is a planner bug that the safety net covered.
    pub heals: AtomicU64,
}

/// What one pass did.
#[derive(Clone, Debug, Default)]
pub struct PassReport {
    pub notes: usize,
    pub provisioned: usize,
    pub confirmed: usize,
    pub messages: usize,
    pub bytes: usize,
    /// More notes were waiting than the batch took.
    pub more: bool,
    /// The replicas that got a message.
    pub to: Vec<Uuid>,
}

/// The payload of `NOTIFY ferry_sync_outbox`: the replicas that got messages, as uuids
/// joined by commas, so a serve process wakes only their long polls; empty (wake every
/// one) when they would not fit Postgres's payload limit (8,000 bytes).
pub fn wake_payload(to: &[Uuid]) -> String {
    if to.len() * 37 > 7_900 {
        return String::new();
    }
    to.iter().map(Uuid::to_string).collect::<Vec<_>>().join(",")
}

/// What one step of the relay did (`Relay::step`).
#[derive(Clone, Debug)]
pub enum Step {
    /// A pass committed.
    Passed(PassReport),
    /// A pass failed on some note's data; the next one takes `batch` notes.
    Narrowed { batch: usize },
    /// A pass of one note failed on it: that note (its id) is parked, and the batch is
    /// whole again. `None`: no note was pending, so the failure was not a note's.
    Parked(Option<i64>),
}

/// A test seam: runs inside a pass, after everything is recorded and before the commit.
pub type BeforeCommit = Box<
    dyn FnMut() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync,
>;

pub struct Relay {
    /// Runs before each pass's commit (tests cut the lock's connection here).
    #[doc(hidden)]
    pub before_commit: Option<BeforeCommit>,
    spec: Arc<Spec>,
    settings: RelaySettings,
    pub stats: Arc<RelayStats>,
    batch_now: usize,
    members_checked: bool,
    retried_at: Option<Instant>,
    /// When a pass last swept unused bodies, and when the relay last vacuumed.
    swept_at: Option<Instant>,
    vacuumed_at: Option<Instant>,
    /// Vacuuming was refused (the relay's role does not own the tables): not tried again.
    vacuum_refused: bool,
    /// Parked items were retried in the last pass: the inbox is filed again after it.
    refile_due: bool,
    /// Replicas whose outbox a committed pass dropped: the next pass catches them up.
    catch_up: Vec<(Uuid, i64)>,
    /// What the pass in progress dropped; becomes `catch_up` only if it commits.
    dropped_now: Vec<(Uuid, i64)>,
    /// The pass in progress checked membership: it counts once the pass commits.
    members_now: bool,
}

impl Relay {
    pub fn new(spec: Arc<Spec>, settings: RelaySettings) -> Relay {
        let batch_now = settings.batch;
        Relay {
            before_commit: None,
            spec,
            settings,
            stats: Arc::default(),
            batch_now,
            members_checked: false,
            retried_at: None,
            swept_at: None,
            vacuumed_at: None,
            vacuum_refused: false,
            refile_due: false,
            catch_up: Vec::new(),
            dropped_now: Vec::new(),
            members_now: false,
        }
    }

    /// This relay's shard and the number of shards.
    fn shards(&self) -> (i32, i32) {
        (self.settings.shard as i32, self.spec.shards as i32)
    }

    /// Steps 1–4 until `stop` turns true.
    pub async fn run(
        &mut self,
        url: &str,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let mut stop = stop;
        self.stats
            .shard
            .store(self.settings.shard, Ordering::Relaxed);
        while !*stop.borrow() {
            let mut conn = match self.acquire(url, &mut stop).await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e, "relay: cannot reach Postgres; retrying");
                    sleep_or_stop(&mut stop, self.settings.standby / 5).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            self.stats.holding.store(true, Ordering::Relaxed);
            self.members_checked = false;
            self.retried_at = None;
            tracing::info!("relay: holding the lock; recording");
            let result = self.hold(&mut conn, url, &mut stop).await;
            self.stats.holding.store(false, Ordering::Relaxed);
            match result {
                Ok(()) => break,
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e, "relay: lost the lock or the connection; standing by");
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    pub async fn acquire(
        &self,
        url: &str,
        stop: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<Option<PgConnection>, RelayError> {
        let mut conn = PgConnection::connect(url).await?;
        loop {
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                .bind(lock_key(self.settings.shard))
                .fetch_one(&mut conn)
                .await?;
            if got {
                return Ok(Some(conn));
            }
            if sleep_or_stop(stop, self.settings.standby / 5).await {
                return Ok(None);
            }
        }
    }

    /// Passes while holding the lock.
    async fn hold(
        &mut self,
        conn: &mut PgConnection,
        url: &str,
        stop: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Result<(), RelayError> {
        let mut listener = sqlx::postgres::PgListener::connect(url).await?;
        listener.listen("ferry_sync").await?;
        let mut failures = 0u32;
        let mut first = true;
        let mut began;
        let mut pace;
        loop {
            if *stop.borrow() {
                return Ok(());
            }
            began = Instant::now();
            let outcome = self.step(conn).await;
            if first && matches!(outcome, Err(RelayError::LockLost)) {
                // The lock was taken a moment ago on this very connection: a transaction
                // that does not see it ran on another backend, which is what a pooler in
                // transaction mode does. Recording there would not be fenced.
                return Err(RelayError::Setup(POOLER.into()));
            }
            first = false;
            match outcome {
                Ok(Step::Passed(report)) => {
                    pace = self.pace(report.messages);
                    self.vacuum(conn).await;
                    self.refile(conn).await;
                    failures = 0;
                    if report.more {
                        continue;
                    }
                }
                Ok(Step::Narrowed { .. } | Step::Parked(Some(_))) => continue,
                Err(RelayError::LockLost) => return Err(RelayError::LockLost),
                // A pass of one note, or of none, failed on data and there was no note to
                // park: the cause is not a note (a row a provisioning reads, say), so it is
                // retried with a backoff like a transient error rather than at once.
                Ok(Step::Parked(None)) => {
                    failures += 1;
                    let wait = Duration::from_millis(100 * 2u64.pow(failures.min(8)));
                    if sleep_or_stop(stop, wait).await {
                        return Ok(());
                    }
                    continue;
                }
                Err(e) if e.is_transient() => {
                    self.stats.errors.fetch_add(1, Ordering::Relaxed);
                    if conn.ping().await.is_err() {
                        return Err(e);
                    }
                    failures += 1;
                    let wait = Duration::from_millis(100 * 2u64.pow(failures.min(8)));
                    tracing::warn!(error = %e, ?wait, "relay: pass failed; retrying");
                    if sleep_or_stop(stop, wait).await {
                        return Ok(());
                    }
                    continue;
                }
                Err(e) => return Err(e),
            }
            tokio::select! {
                n = listener.recv() => {
                    let notes = !is_report(&n) | drain(&mut listener).await;
                    if !notes {
                        gather_reports(&mut listener, stop).await;
                    } else if let Some(rest) = pace.checked_sub(began.elapsed()) {
                        if sleep_or_stop(stop, rest).await {
                            return Ok(());
                        }
                        drain(&mut listener).await;
                    }
                }
                _ = tokio::time::sleep(self.settings.idle) => {}
                _ = stop.changed() => {}
            }
        }
    }

    /// Files the inbox again when the last pass retried what was set aside
    /// (docs/sync-up.md §5.2), outside any pass's transaction. A failure is logged; the
    /// next retry tries again.
    async fn refile(&mut self, conn: &mut PgConnection) {
        // The inbox is everyone's: shard 0 files it again.
        if !std::mem::take(&mut self.refile_due)
            || self.spec.records.is_empty()
            || self.settings.shard != 0
        {
            return;
        }
        match crate::file::refile(conn, &self.spec.records, &self.settings.file_shape).await {
            Ok(done) if done.filed + done.still_refused > 0 => {
                tracing::info!(
                    filed = done.filed,
                    still_refused = done.still_refused,
                    "relay: filed the inbox again"
                );
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "relay: filing the inbox again failed; it is tried again later")
            }
        }
    }

    /// How long after a pass that recorded `messages` the next may begin.
    fn pace(&self, messages: usize) -> Duration {
        let n = u32::try_from(messages).unwrap_or(u32::MAX);
        self.settings
            .pace_per_message
            .saturating_mul(n)
            .min(self.settings.pace_max)
    }

    /// One pass, and what a failure of it on data does next (docs/sync-relay.md §1.4): the
    /// batch is halved until a pass of one note fails, and that note is parked; a pass
    /// that commits grows the batch back. Transient errors are returned for the caller to
    /// back off. `hold` runs the relay on it; tests step it deterministically.
    pub async fn step(&mut self, conn: &mut PgConnection) -> Result<Step, RelayError> {
        match self.pass(conn).await {
            Ok(report) => {
                self.batch_now = (self.batch_now * 2).min(self.settings.batch);
                Ok(Step::Passed(report))
            }
            Err(e) if !e.is_transient() && matches!(e, RelayError::Db(_)) => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                if self.batch_now > 1 {
                    self.batch_now /= 2;
                    tracing::warn!(error = %e, batch = self.batch_now, "relay: a note failed; halving the batch to find it");
                    Ok(Step::Narrowed {
                        batch: self.batch_now,
                    })
                } else {
                    let parked = self.park_first(conn, &e).await?;
                    self.batch_now = self.settings.batch;
                    Ok(Step::Parked(parked))
                }
            }
            Err(e) => Err(e),
        }
    }

    /// One pass (docs/sync-relay.md §1.2). Public for tests and `ferry sync pass`.
    pub async fn pass(&mut self, conn: &mut PgConnection) -> Result<PassReport, RelayError> {
        // The pass's statements look rows up by key lists of every size; a generic plan
        // (chosen after five runs) may scan whole tables for them, which made a pass cost
        // O(rows) and a bulk load quadratic (572 notes/s at 100,000 rows, against 16,500
        // at 5,000). A custom plan per execution costs a few hundred microseconds. JIT
        // never pays for statements this short, and a planner's guess on a table not yet
        // analyzed can price one past `jit_above_cost` (compiling cost 240 ms a time).
        // One round trip, in the pass's own transaction, so any pooler keeps them together.
        sqlx::raw_sql(
            "BEGIN ISOLATION LEVEL REPEATABLE READ; \
             SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL jit = off",
        )
        .execute(&mut *conn)
        .await?;
        let mut result = self.pass_inside(conn).await;
        if result.is_ok()
            && let Some(hook) = &mut self.before_commit
        {
            hook().await;
            // The lock is checked again at the commit's door: a connection cut meanwhile
            // fails here or at the COMMIT, and nothing is recorded.
            if let Err(e) = check_lock(conn, self.settings.shard).await {
                result = Err(e);
            }
        }
        // In the pass's transaction: Postgres delivers it at the commit, with the messages.
        if let Ok(report) = &result
            && report.messages > 0
            && let Err(e) = sqlx::query("SELECT pg_notify('ferry_sync_outbox', $1)")
                .bind(wake_payload(&report.to))
                .execute(&mut *conn)
                .await
        {
            result = Err(e.into());
        }
        match result {
            Ok(report) => {
                sqlx::query("COMMIT").execute(&mut *conn).await?;
                self.catch_up = std::mem::take(&mut self.dropped_now);
                if std::mem::take(&mut self.members_now) {
                    self.members_checked = true;
                }
                self.stats.passes.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .notes
                    .fetch_add(report.notes as u64, Ordering::Relaxed);
                self.stats
                    .messages
                    .fetch_add(report.messages as u64, Ordering::Relaxed);
                self.stats
                    .bytes
                    .fetch_add(report.bytes as u64, Ordering::Relaxed);
                Ok(report)
            }
            Err(e) => {
                let _ = sqlx::query("ROLLBACK").execute(&mut *conn).await;
                self.members_now = false;
                Err(e)
            }
        }
    }

    async fn pass_inside(&mut self, conn: &mut PgConnection) -> Result<PassReport, RelayError> {
        check_lock(conn, self.settings.shard).await?;
        let mut report = PassReport::default();
        if self
            .retried_at
            .is_none_or(|t| t.elapsed() >= self.settings.retry_every)
        {
            retry_set_aside(conn, self.shards()).await?;
            self.retried_at = Some(Instant::now());
            self.refile_due = true;
        }
        let mut epoch = load_epoch(conn, self.spec.shards).await?;
        let pass: i64 = sqlx::query_scalar("SELECT nextval('ferry_sync.passes')")
            .fetch_one(&mut *conn)
            .await?;
        let decisions = reports::handle(
            conn,
            &self.spec,
            &epoch,
            self.settings.digest_every,
            self.shards(),
        )
        .await?;
        report.confirmed = decisions.confirmed;
        if decisions.new_epoch {
            epoch = new_epoch(conn).await?;
            self.catch_up.clear();
            self.stats.new_epochs.fetch_add(1, Ordering::Relaxed);
            self.members_checked = false;
        }
        let notes = sqlx::query("SELECT id, relation, key, kind FROM ferry_sync.notes WHERE parked_at IS NULL AND shard = $2 ORDER BY id LIMIT $1")
            .bind(self.batch_now as i64 + 1)
            .bind(self.shards().0)
            .fetch_all(&mut *conn)
            .await?;
        report.more = notes.len() > self.batch_now;
        let notes = &notes[..notes.len().min(self.batch_now)];
        let mut provision: HashMap<Uuid, Provision> = decisions.provision;
        for (r, since) in &self.catch_up {
            provision
                .entry(*r)
                .or_insert(Provision::CatchUp { since: *since });
        }
        let replica_note = notes.iter().any(|n| n.get::<String, _>(3) == "replica");
        if !self.members_checked || replica_note {
            for r in self.members(conn).await? {
                provision.insert(r, Provision::Full);
            }
            // Checked once this pass commits: a pass that fails must look again.
            self.members_now = true;
        }
        let (following, mut chains) = following(conn, self.shards()).await?;
        let mut planner = Planner::new(&self.spec, pass, &following);
        for (r, how) in &provision {
            if following.partition_of.contains_key(r) {
                // A catch-up from nothing confirmed has no mark to start from.
                let how = match how {
                    Provision::CatchUp { since: 0 } => Provision::Full,
                    how => *how,
                };
                planner.provision(conn, *r, how).await?;
            }
        }
        report.provisioned = provision.len();
        for (r, t) in &decisions.heal {
            if !provision.contains_key(r) && following.partition_of.contains_key(r) {
                planner.heal_table(conn, *r, *t).await?;
                self.stats.heals.fetch_add(1, Ordering::Relaxed);
            }
        }
        let mut ids: Vec<i64> = Vec::with_capacity(notes.len());
        let mut declared: Option<String> = None;
        for n in notes {
            let relation: String = n.get(1);
            let key: String = n.get(2);
            let kind: String = n.get(3);
            if kind == "announce" {
                // Install changed the tables replicas write: every replica with a chain
                // hears of them in its next message (a chain start announces them anyway).
                // A relay still running the rules from before the install leaves the note
                // to the relay that runs the installed ones.
                if declared.is_none() {
                    declared = sqlx::query_scalar("SELECT declared FROM ferry_sync.meta")
                        .fetch_one(&mut *conn)
                        .await?;
                }
                if declared.as_deref() != Some(self.spec.digest.as_str()) {
                    continue;
                }
                for r in following.partition_of.keys() {
                    planner.out.entry(*r).or_default().announce = true;
                }
                ids.push(n.get(0));
                continue;
            }
            ids.push(n.get(0));
            // A note names a Postgres table; each entry of it (one, or one per audience)
            // plans it.
            let entries: Vec<usize> = self.spec.noted(&relation).collect();
            for t in entries {
                match kind.as_str() {
                    "row" => planner.note(t, key.clone()),
                    "table" => {
                        let rows =
                            read::rows(conn, &self.spec, &self.spec.tables[t], read::Filter::All)
                                .await?;
                        for row in rows {
                            planner.note(t, row.key);
                        }
                    }
                    "group"
                        if matches!(self.spec.tables[t].route, spec::RouteSpec::Grouped { .. }) =>
                    {
                        for k in route::keys_in_group(conn, &self.spec, t, &key).await? {
                            planner.note(t, k);
                        }
                    }
                    "routed"
                        if matches!(self.spec.tables[t].route, spec::RouteSpec::Routed { .. }) =>
                    {
                        for k in route::keys_routed(conn, &self.spec, t).await? {
                            planner.note(t, k);
                        }
                    }
                    "group" | "routed" => {}
                    other => tracing::warn!(
                        kind = other,
                        relation,
                        "relay: unknown kind of note; dropped"
                    ),
                }
            }
        }
        report.notes = ids.len();
        planner.run(conn).await?;
        let recorded = record::record(
            conn,
            &self.spec,
            &epoch,
            (self.shards().0, pass),
            planner.out,
            &mut chains,
            self.settings.budget,
        )
        .await?;
        report.messages = recorded.messages;
        report.bytes = recorded.bytes;
        report.to = recorded.to;
        sqlx::query("DELETE FROM ferry_sync.notes WHERE id = ANY($1)")
            .bind(&ids)
            .execute(&mut *conn)
            .await?;
        self.dropped_now = drop_overflowing(
            conn,
            self.settings.outbox_messages_max,
            self.settings.outbox_bytes_max,
            self.shards(),
        )
        .await?;
        prune_tombstones(conn, self.shards()).await?;
        if self
            .swept_at
            .is_none_or(|t| t.elapsed() >= HOUSEKEEPING_EVERY)
        {
            sweep_bodies(conn, self.shards().0).await?;
            self.swept_at = Some(Instant::now());
        }
        Ok(report)
    }

    /// Compares the live replicas with the known ones; returns those to provision.
    async fn members(&self, conn: &mut PgConnection) -> Result<Vec<Uuid>, RelayError> {
        let (shard, shards) = (self.settings.shard, self.spec.shards);
        let mine = |id: &Uuid| shard_of(id, shards) == shard;
        let live = read::live_replicas(conn, &self.spec).await?;
        type Known = (Option<String>, Option<String>, String, bool);
        let known: HashMap<Uuid, Known> = sqlx::query(
            "SELECT id, partition, audience, standing, seal_key IS NOT NULL FROM ferry_sync.replicas",
        )
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4))))
        .filter(|(id, _)| mine(id))
        .collect();
        let mut provision = Vec::new();
        let mut seen = HashSet::new();
        for (id, partition, audience) in live {
            let Ok(id) = Uuid::parse_str(&id) else {
                continue;
            };
            if !mine(&id) {
                continue;
            }
            seen.insert(id);
            match known.get(&id) {
                None => {
                    sqlx::query("INSERT INTO ferry_sync.replicas (id, partition, audience) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
                        .bind(id)
                        .bind(&partition)
                        .bind(&audience)
                        .execute(&mut *conn)
                        .await?;
                }
                Some((old, old_audience, standing, enrolled)) => {
                    // A replica that changes audience holds other tables, or the same
                    // tables in another shape: it starts again, as one that changes
                    // partition does.
                    let moved =
                        old.as_deref() != Some(partition.as_str()) || *old_audience != audience;
                    if moved || standing == "retired" {
                        // The mark counts passes of the partition it held (and a retired
                        // replica's tombstones were not kept for it): it says nothing of
                        // the rows it must now hold. A catch-up before it confirms its new
                        // snapshot (its outbox dropped) would start from it and miss rows;
                        // no mark makes that catch-up a full provisioning.
                        sqlx::query("UPDATE ferry_sync.replicas SET partition = $2, audience = $3, standing = 'new', confirmed_pass = 0 WHERE id = $1")
                            .bind(id)
                            .bind(&partition)
                            .bind(&audience)
                            .execute(&mut *conn)
                            .await?;
                    }
                    if *enrolled && (moved || standing == "retired" || standing == "new") {
                        provision.push(id);
                    }
                }
            }
        }
        for (id, (_, _, standing, _)) in &known {
            if !seen.contains(id) && standing != "retired" {
                for sql in [
                    "UPDATE ferry_sync.replicas SET standing = 'retired' WHERE id = $1",
                    "DELETE FROM ferry_sync.outbox WHERE replica = $1",
                    "DELETE FROM ferry_sync.held WHERE replica = $1",
                    "DELETE FROM ferry_sync.points WHERE replica = $1",
                    "DELETE FROM ferry_sync.quarantine WHERE replica = $1",
                ] {
                    sqlx::query(sql).bind(id).execute(&mut *conn).await?;
                }
            }
        }
        Ok(provision)
    }

    /// Parks the first pending note: a single-note pass failed permanently on it. Returns
    /// its id, or `None` when no note was pending (the failure was not a note's).
    async fn park_first(
        &self,
        conn: &mut PgConnection,
        e: &RelayError,
    ) -> Result<Option<i64>, RelayError> {
        let mut tx = conn.begin().await?;
        check_lock(&mut tx, self.settings.shard).await?;
        let id: Option<i64> = sqlx::query_scalar(
            "UPDATE ferry_sync.notes SET parked_at = now(), attempts = attempts + 1, last_error = $1
             WHERE id = (SELECT id FROM ferry_sync.notes WHERE parked_at IS NULL AND shard = $2 ORDER BY id LIMIT 1) RETURNING id",
        )
        .bind(e.to_string())
        .bind(self.shards().0)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        match id {
            Some(id) => {
                self.stats.parked.fetch_add(1, Ordering::Relaxed);
                tracing::error!(note = id, error = %e, "relay: parked a note the planner fails on; everything else flows");
            }
            None => {
                tracing::error!(error = %e, "relay: a pass without notes failed on data (a row a provisioning or a heal reads?); retrying with a backoff");
            }
        }
        Ok(id)
    }
}

/// Fails with `LockLost` unless this backend holds relay shard `shard`'s lock
/// (docs/sync-relay.md §1.1).
pub async fn check_lock(conn: &mut PgConnection, shard: u32) -> Result<(), RelayError> {
    let key = lock_key(shard);
    let held: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid()
         AND classid = $1::int8::oid AND objid = $2::int8::oid AND objsubid = 1)",
    )
    .bind((key >> 32) & 0xffff_ffff)
    .bind(key & 0xffff_ffff)
    .fetch_one(&mut *conn)
    .await?;
    if held {
        Ok(())
    } else {
        Err(RelayError::LockLost)
    }
}

async fn load_epoch(conn: &mut PgConnection, shards: u32) -> Result<Epoch, RelayError> {
    let row = sqlx::query("SELECT epoch, secret, shards FROM ferry_sync.meta")
        .fetch_optional(&mut *conn)
        .await?;
    let Some(row) = row else {
        return Err(RelayError::Setup(
            "the ferry_sync schema has no meta row: run `ferry sync install`".into(),
        ));
    };
    let secret: Vec<u8> = row.get(1);
    let installed: i32 = row.get(2);
    if installed != shards as i32 {
        // An install changed the number of shards under this relay: its replicas and
        // notes are no longer the ones it would plan for. It must not record.
        return Err(RelayError::Setup(format!(
            "the installed rules spread replicas over {installed} relay shard(s), and this relay runs rules with {shards}: restart it with the installed rules"
        )));
    }
    Ok(Epoch {
        id: row.get(0),
        secret: secret
            .try_into()
            .map_err(|_| RelayError::Setup("ferry_sync.meta.secret is not 32 bytes".into()))?,
    })
}

/// A new epoch: new secret, every chain starts again (docs/sync-protocol.md §1.6 step 2).
async fn new_epoch(conn: &mut PgConnection) -> Result<Epoch, RelayError> {
    let mut secret = [0u8; 32];
    getrandom::getrandom(&mut secret).expect("the operating system's random source is available");
    let id = Uuid::new_v4();
    sqlx::query("UPDATE ferry_sync.meta SET epoch = $1, secret = $2, restores = restores + 1")
        .bind(id)
        .bind(secret.to_vec())
        .execute(&mut *conn)
        .await?;
    for sql in [
        "DELETE FROM ferry_sync.outbox",
        "DELETE FROM ferry_sync.bodies",
        "DELETE FROM ferry_sync.held",
        "DELETE FROM ferry_sync.points",
        "UPDATE ferry_sync.replicas SET last_seq = 0, last_nonce = 0, confirmed_seq = 0, confirmed_nonce = 0,
         confirmed_pass = 0, standing = 'new' WHERE standing <> 'retired'",
        // Every relay shard looks at its replicas again, whatever it remembers.
        "INSERT INTO ferry_sync.notes (relation, key, kind) VALUES ('', '', 'replica')",
    ] {
        sqlx::query(sql).execute(&mut *conn).await?;
    }
    Ok(Epoch { id, secret })
}

/// The replicas this pass sends to (enrolled, not retired), and their chains.
async fn following(
    conn: &mut PgConnection,
    (shard, shards): (i32, i32),
) -> Result<(Following, HashMap<Uuid, Chain>), RelayError> {
    let rows = sqlx::query(
        "SELECT id, coalesce(partition, ''), last_seq, last_nonce, seal_key, audience FROM ferry_sync.replicas
         WHERE standing <> 'retired' AND seal_key IS NOT NULL AND ($2 = 1 OR ferry_sync.shard_of(id, $2) = $1)",
    )
    .bind(shard)
    .bind(shards)
    .fetch_all(&mut *conn)
    .await?;
    let mut following = Following {
        shard,
        ..Following::default()
    };
    let mut chains = HashMap::new();
    for row in rows {
        let id: Uuid = row.get(0);
        let key: Vec<u8> = row.get(4);
        let Ok(seal_key) = <[u8; 32]>::try_from(key) else {
            continue;
        };
        following.insert(id, row.get(1), row.get(5));
        chains.insert(
            id,
            Chain {
                last_seq: row.get(2),
                last_nonce: row.get(3),
                seal_key,
            },
        );
    }
    Ok((following, chains))
}

/// Parked notes go back to pending; quarantined rows are noted again: this shard's
/// (`(shard, shards)`), as its own notes (shard 0's are copied to the others by the
/// fan-out trigger, which costs them a plan of rows they have, nothing more).
async fn retry_set_aside(
    conn: &mut PgConnection,
    (shard, shards): (i32, i32),
) -> Result<(), RelayError> {
    sqlx::query(
        "UPDATE ferry_sync.notes SET parked_at = NULL WHERE parked_at IS NOT NULL AND shard = $1",
    )
    .bind(shard)
    .execute(&mut *conn)
    .await?;
    sqlx::query(
        "WITH mine AS (DELETE FROM ferry_sync.quarantine WHERE ($2 = 1 OR ferry_sync.shard_of(replica, $2) = $1) RETURNING relation, key)
         INSERT INTO ferry_sync.notes (shard, relation, key) SELECT DISTINCT $1, relation, key FROM mine",
    )
    .bind(shard)
    .bind(shards)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Drops the outbox of every replica past a bound (an alarm: `replicas.dropped`) and
/// returns them with their marks, for the next pass to catch up by a new chain.
async fn drop_overflowing(
    conn: &mut PgConnection,
    messages_max: i64,
    bytes_max: i64,
    (shard, shards): (i32, i32),
) -> Result<Vec<(Uuid, i64)>, RelayError> {
    let over: Vec<(Uuid, i64)> = sqlx::query(
        "WITH over AS (SELECT replica FROM ferry_sync.outbox WHERE ($4 = 1 OR ferry_sync.shard_of(replica, $4) = $3)
                       GROUP BY replica HAVING count(*) > $1 OR sum(bytes) > $2),
              gone AS (DELETE FROM ferry_sync.outbox o USING over WHERE o.replica = over.replica RETURNING o.replica)
         UPDATE ferry_sync.replicas c SET dropped = dropped + 1 FROM (SELECT DISTINCT replica FROM gone) g
         WHERE c.id = g.replica RETURNING c.id, c.confirmed_pass",
    )
    .bind(messages_max)
    .bind(bytes_max)
    .bind(shard)
    .bind(shards)
    .fetch_all(&mut *conn)
    .await?
    .iter()
    .map(|row| (row.get(0), row.get(1)))
    .collect();
    for (r, _) in &over {
        tracing::error!(replica = %r, "relay: a replica's outbox passed its bound and was dropped; it will be caught up by a new chain (alarm: replicas.dropped)");
    }
    Ok(over)
}

/// How often a pass sweeps bodies no message names, and the relay vacuums the outbox.
const HOUSEKEEPING_EVERY: Duration = Duration::from_secs(2);

/// Deletes bodies no outbox row names, in the pass (fenced, like every write): one
/// anti-join over two small tables every few seconds, instead of an index on
/// `outbox.body_hash` maintained for every message and a delete per confirmation.
async fn sweep_bodies(conn: &mut PgConnection, shard: i32) -> Result<(), RelayError> {
    sqlx::query(
        "DELETE FROM ferry_sync.bodies b WHERE b.shard = $1
         AND NOT EXISTS (SELECT 1 FROM ferry_sync.outbox o WHERE o.body_hash = b.hash)",
    )
    .bind(shard)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

impl Relay {
    /// Vacuums the outbox and bodies every few seconds, between passes. Both take a row
    /// per message and lose it at the confirmation; autovacuum wakes once a minute
    /// (`autovacuum_naptime`), and meanwhile every insert and scan wades through the dead
    /// rows (a pass's insert of 100 messages cost 2.4 ms of CPU, six times a fresh
    /// table's). A refusal (the relay's role does not own them) is logged once.
    async fn vacuum(&mut self, conn: &mut PgConnection) {
        if self.vacuum_refused
            || self
                .vacuumed_at
                .is_some_and(|t| t.elapsed() < HOUSEKEEPING_EVERY)
        {
            return;
        }
        self.vacuumed_at = Some(Instant::now());
        if let Err(e) = sqlx::raw_sql("VACUUM (SKIP_LOCKED) ferry_sync.outbox, ferry_sync.bodies")
            .execute(&mut *conn)
            .await
        {
            tracing::warn!(error = %e, "relay: cannot vacuum ferry_sync.outbox; autovacuum alone keeps it (run the relay as the schema's owner to let it)");
            self.vacuum_refused = true;
        }
    }
}

/// Tombstones every replica's confirmed mark has passed are no longer needed.
async fn prune_tombstones(
    conn: &mut PgConnection,
    (shard, shards): (i32, i32),
) -> Result<(), RelayError> {
    sqlx::query(
        "DELETE FROM ferry_sync.rows WHERE shard = $1 AND gone AND rv <= (SELECT coalesce(min(confirmed_pass), 0) FROM ferry_sync.replicas
         WHERE standing = 'following' AND ($2 = 1 OR ferry_sync.shard_of(id, $2) = $1))",
    )
    .bind(shard)
    .bind(shards)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Takes every notification already queued, without waiting. Each writer's commit and
/// each report notifies; Postgres folds duplicates only within one transaction, so after
/// a burst the listener holds thousands, and taking one per pass ran thousands of empty
/// passes (2,287 in 6 s after 1,000 changes/s stopped, a core's worth: 2026-12-06). One
/// pass sees everything they announced, so one wake-up is enough.
/// True if one of them was not a report (a note, an enrollment).
async fn drain(listener: &mut sqlx::postgres::PgListener) -> bool {
    let mut notes = false;
    // A zero timeout polls `recv` once: ready while notifications are queued.
    while let Ok(n) = tokio::time::timeout(Duration::ZERO, listener.recv()).await {
        notes |= !is_report(&n);
        if n.is_err() {
            break;
        }
    }
    notes
}

/// How long a wake-up by reports alone waits for more before its pass. A report costs a
/// pass's fixed work, and 100 replicas send 100 a second: alone, each ran a pass. What
/// they carry (confirmations) waits this much; a note does not, nor a report serve
/// marks urgent (`report-now`: nothing applied yet, a gap, rejections).
const REPORTS_GATHER: Duration = Duration::from_millis(100);

fn is_report(n: &Result<sqlx::postgres::PgNotification, sqlx::Error>) -> bool {
    matches!(n, Ok(n) if n.payload() == "report")
}

/// After a wake-up by reports alone: waits [`REPORTS_GATHER`], or until a notification
/// that is not a report, or a stop.
async fn gather_reports(
    listener: &mut sqlx::postgres::PgListener,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) {
    let until = tokio::time::Instant::now() + REPORTS_GATHER;
    loop {
        tokio::select! {
            n = listener.recv() => {
                if !is_report(&n) {
                    drain(listener).await;
                    return;
                }
            }
            _ = tokio::time::sleep_until(until) => return,
            _ = stop.changed() => return,
        }
    }
}

/// Sleeps; true if `stop` turned true meanwhile.
async fn sleep_or_stop(stop: &mut tokio::sync::watch::Receiver<bool>, d: Duration) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = stop.changed() => {}
    }
    *stop.borrow()
}
