//! A relay's background tasks beside its lanes: turning database commits into wake-ups,
//! reclaiming expired leases, recording its totals in the database, and watching the
//! transport's dedup window.

use super::config::TOTALS_EVERY;
use super::handle::Relay;
use crate::error::DbError;
use crate::totals::RelayRecord;
use ferry_core::Classify;
use ferry_core::sync::lock;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// SQLite: how often an idle relay looks at `PRAGMA data_version` for commits by others.
const SQLITE_WATCH: Duration = Duration::from_millis(2);

impl Relay {
    /// Turn database commits into wake-ups: `LISTEN ferry_outbox` on Postgres; on SQLite
    /// a change of `PRAGMA data_version` (any connection's commit, in any process).
    pub(super) async fn watch(self: Arc<Self>) {
        match self.store.db() {
            crate::store::Db::Pg(pool) => loop {
                match sqlx::postgres::PgListener::connect_with(pool).await {
                    Ok(mut l) => {
                        if let Err(e) = l.listen("ferry_outbox").await {
                            tracing::warn!("LISTEN failed: {e}; relying on the poll");
                        } else {
                            // Commits made while the listener was away notified no one.
                            self.wake.notify_waiters();
                            while l.recv().await.is_ok() {
                                self.wake.notify_waiters();
                            }
                        }
                    }
                    Err(e) => tracing::debug!("LISTEN connection failed: {e}"),
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            },
            crate::store::Db::Sqlite(pool) => {
                let mut conn = loop {
                    match pool.acquire().await {
                        Ok(c) => break c,
                        Err(e) => {
                            tracing::debug!("the commit watcher cannot get a connection yet: {e}");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                };
                let mut last: Option<i64> = None;
                loop {
                    let v: Option<i64> = sqlx::query_scalar("PRAGMA data_version")
                        .fetch_one(&mut *conn)
                        .await
                        .ok();
                    if v.is_some() && last.is_some() && v != last {
                        self.wake.notify_waiters();
                    }
                    last = v;
                    tokio::time::sleep(SQLITE_WATCH).await;
                }
            }
        }
    }

    /// Return expired leases to pending, every quarter lease.
    pub(super) async fn reclaim_loop(self: Arc<Self>) {
        loop {
            tokio::time::sleep(self.config.lease / 4).await;
            match self.store.reclaim_expired().await {
                Ok(0) => {}
                Ok(n) => {
                    tracing::info!(
                        messages = n,
                        "leases ran out (a relay died or stalled): those messages are pending again, marked uncertain"
                    );
                    self.wake.notify_waiters();
                }
                Err(e) if e.is_transient() => tracing::debug!("{e}"),
                Err(e) => tracing::warn!("{e}"),
            }
            self.check_dedup_window().await;
        }
    }

    /// Record the counters every [`TOTALS_EVERY`].
    pub(super) async fn totals_loop(self: Arc<Self>) {
        loop {
            tokio::time::sleep(TOTALS_EVERY).await;
            self.record_totals(false).await;
        }
    }

    /// Upsert this relay's row of totals (crate::totals). A failure costs the report,
    /// never the relaying: it is logged, once per kind of error.
    pub(super) async fn record_totals(&self, stopped: bool) {
        if !self.retired.load(Ordering::Relaxed) {
            match self
                .store
                .retire_relays(&self.config.owner, crate::totals::RETIRE_AFTER)
                .await
            {
                Ok(n) => {
                    if n > 0 {
                        tracing::debug!(rows = n, "folded the totals of retired relays");
                    }
                    self.retired.store(true, Ordering::Relaxed);
                }
                Err(e) => {
                    self.totals_failed(e);
                    return;
                }
            }
        }
        let record = {
            let b = lock(&self.breaker);
            RelayRecord {
                owner: self.config.owner.clone(),
                transport: self.transport.describe(),
                stopped,
                breaker_open: b.is_open(),
                last_error: b.last_error().map(str::to_string),
                totals: self.stats.totals(&b),
            }
        };
        if let Err(e) = self.store.record_totals(&record).await {
            self.totals_failed(e);
        }
    }

    /// Recording the totals failed: relaying goes on. A permanent failure is logged once.
    pub(super) fn totals_failed(&self, e: DbError) {
        if e.is_transient() {
            tracing::debug!("{e}");
        } else if !self.totals_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "{e} (relaying goes on; `ferry outbox status` will lack this relay's totals)"
            );
        }
    }

    /// Raise the alarm when an uncertain message has waited so long that the transport
    /// may no longer recognise its id: resolving it then may store it twice.
    pub(super) async fn check_dedup_window(&self) {
        let Some(window) = self.transport.dedup_window() else {
            return;
        };
        let Ok(oldest_uncertain_secs) = self.store.oldest_uncertain_secs().await else {
            return;
        };
        let limit = window.mul_f64(0.9).as_secs_f64();
        let past = oldest_uncertain_secs.is_some_and(|age| age > limit);
        let was = self
            .stats
            .uncertain_past_window
            .swap(past, Ordering::Relaxed);
        if past && !was {
            tracing::error!(
                oldest_uncertain_secs,
                dedup_window_secs = window.as_secs(),
                "an uncertain message has waited longer than the transport's dedup window allows: once the transport answers again it may store that message twice; consumers must deduplicate by message id, or raise the window"
            );
        }
    }
}
