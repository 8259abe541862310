//! Enqueue in the app's own transaction (docs/outbox.md §3.1–3.2).
//!
//! ```ignore
//! let mut tx = pool.begin().await?;
//! sqlx::query("INSERT INTO orders …").execute(&mut *tx).await?;
//! ferry_outbox::enqueue(&mut *tx, &Message::new("orders.created", body).ordered_by(order_id)).await?;
//! tx.commit().await?;
//! ```
//!
//! The message exists if and only if the transaction commits. Call it inside a
//! transaction: on a bare connection each statement commits on its own, and an ordered
//! enqueue's key lock would not span the app's own writes.

use crate::error::schema_missing;
use crate::message::{EnqueueError, Limits, Message, validate};
use sqlx::{PgConnection, SqliteConnection};
use std::future::Future;

/// What an enqueue did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enqueued {
    /// A new message, with its row id.
    New { id: i64 },
    /// A message with this id is already in the outbox; nothing was written.
    AlreadyThere,
}

/// A connection (usually `&mut *tx` of an open transaction) the outbox can write to.
pub trait OutboxConnection: Send {
    fn enqueue_with<'a>(
        &'a mut self,
        msg: &'a Message,
        limits: &'a Limits,
    ) -> impl Future<Output = Result<Enqueued, EnqueueError>> + Send + 'a;

    /// Enqueue messages already validated and in key order (see `enqueue_many`). The
    /// default enqueues one by one; a store may do better.
    fn enqueue_sorted<'a>(
        &'a mut self,
        msgs: &'a [&'a Message],
        limits: &'a Limits,
    ) -> impl Future<Output = Result<Vec<Enqueued>, EnqueueError>> + Send + 'a {
        async move {
            let mut out = Vec::with_capacity(msgs.len());
            for m in msgs {
                out.push(self.enqueue_with(m, limits).await?);
            }
            Ok(out)
        }
    }
}

/// Enqueue `msg` with the default limits.
pub async fn enqueue<C: OutboxConnection + ?Sized>(
    conn: &mut C,
    msg: &Message,
) -> Result<Enqueued, EnqueueError> {
    conn.enqueue_with(msg, &Limits::default()).await
}

/// Enqueue several messages; ordered keys are taken in sorted order so that two
/// transactions enqueueing the same keys cannot deadlock on the key locks.
pub async fn enqueue_many<C: OutboxConnection + ?Sized>(
    conn: &mut C,
    msgs: &[Message],
) -> Result<Vec<Enqueued>, EnqueueError> {
    let limits = Limits::default();
    for m in msgs {
        validate(m, &limits)?;
    }
    let mut order: Vec<usize> = (0..msgs.len()).collect();
    // Ordered messages first by key (stable: a key's messages keep their given order),
    // the rest after in the order given.
    order.sort_by(|&a, &b| {
        let ka = msgs[a].ordered.then(|| msgs[a].key.as_deref()).flatten();
        let kb = msgs[b].ordered.then(|| msgs[b].key.as_deref()).flatten();
        match (ka, kb) {
            (Some(x), Some(y)) => x.cmp(y),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => std::cmp::Ordering::Equal,
        }
    });
    let sorted: Vec<&Message> = order.iter().map(|&i| &msgs[i]).collect();
    let done = conn.enqueue_sorted(&sorted, &limits).await?;
    let mut out = vec![Enqueued::AlreadyThere; msgs.len()];
    for (i, e) in order.into_iter().zip(done) {
        out[i] = e;
    }
    Ok(out)
}

fn headers_json(msg: &Message) -> String {
    serde_json::to_string(&msg.headers).expect("a map of strings always serialises")
}

/// SQLSTATE 3F000 (no such schema), 42883 (undefined function) and 42P01 (undefined
/// table), or SQLite's "no such table": the outbox is not installed.
fn not_installed(e: sqlx::Error) -> EnqueueError {
    match &e {
        sqlx::Error::Database(d) if schema_missing(&e, &["3F000", "42883", "42P01"]) => {
            EnqueueError::NotInstalled(d.message().to_string())
        }
        _ => EnqueueError::Db(e),
    }
}

impl OutboxConnection for PgConnection {
    async fn enqueue_with(
        &mut self,
        msg: &Message,
        limits: &Limits,
    ) -> Result<Enqueued, EnqueueError> {
        validate(msg, limits)?;
        let id: Option<i64> =
            sqlx::query_scalar("SELECT ferry_outbox.enqueue($1, $2, $3, $4, $5, $6::jsonb)")
                .bind(&msg.message_id)
                .bind(&msg.topic)
                .bind(&msg.key)
                .bind(msg.ordered)
                .bind(&msg.payload)
                .bind(headers_json(msg))
                .fetch_one(&mut *self)
                .await
                .map_err(not_installed)?;
        Ok(id.map_or(Enqueued::AlreadyThere, |id| Enqueued::New { id }))
    }
}

impl OutboxConnection for SqliteConnection {
    async fn enqueue_with(
        &mut self,
        msg: &Message,
        limits: &Limits,
    ) -> Result<Enqueued, EnqueueError> {
        validate(msg, limits)?;
        let done = self.enqueue_sorted(&[msg], limits).await?;
        Ok(done[0])
    }

    async fn enqueue_sorted(
        &mut self,
        msgs: &[&Message],
        _limits: &Limits,
    ) -> Result<Vec<Enqueued>, EnqueueError> {
        // Two statements for the whole batch instead of two per message: every statement
        // is a round trip to sqlx's SQLite worker thread, which cost more than the SQL.
        // Both are writes, the first one first: a deferred transaction that read first
        // could not upgrade to the write lock while a relay writes ("database is
        // locked" at once instead of waiting). A repeated message id still takes a
        // number on its key; a gap in a key's seqs is harmless (order compares seqs).
        if msgs.is_empty() {
            return Ok(Vec::new());
        }
        // Messages per ordered key (a map, so a caller's order cannot split a key's range).
        let mut counts: std::collections::BTreeMap<&str, i64> = Default::default();
        for m in msgs.iter().filter(|m| m.ordered) {
            let k = m
                .key
                .as_deref()
                .expect("validated: ordered messages have a key");
            *counts.entry(k).or_default() += 1;
        }
        let mut next_seq: std::collections::HashMap<String, i64> = Default::default();
        if !counts.is_empty() {
            let rows: Vec<(String, i64)> = sqlx::query_as(
                "INSERT INTO ferry_outbox_key_seqs (key, last_seq) \
                 SELECT value ->> 0, value ->> 1 FROM json_each(?1) WHERE true \
                 ON CONFLICT (key) DO UPDATE SET last_seq = last_seq + excluded.last_seq \
                 RETURNING key, last_seq",
            )
            .bind(
                serde_json::to_string(&counts.iter().collect::<Vec<_>>())
                    .expect("keys and counts serialise"),
            )
            .fetch_all(&mut *self)
            .await
            .map_err(not_installed)?;
            for (k, last) in rows {
                let n = counts.get(k.as_str()).copied().unwrap_or(0);
                next_seq.insert(k, last - n + 1);
            }
        }
        let rows: Vec<serde_json::Value> = msgs
            .iter()
            .map(|m| {
                let seq = m.ordered.then(|| {
                    let k = m.key.as_deref().expect("validated");
                    let s = next_seq.get_mut(k).expect("every ordered key got a range");
                    *s += 1;
                    *s - 1
                });
                serde_json::json!({
                    "i": m.message_id, "t": m.topic, "k": m.key, "o": m.ordered as i64, "s": seq,
                    "p": hex(&m.payload), "h": headers_json(m),
                })
            })
            .collect();
        let inserted: Vec<(i64, String)> = sqlx::query_as(
            "INSERT INTO ferry_outbox_messages \
             (message_id, topic, key, ordered, seq, payload, headers, next_attempt_at, enqueued_at) \
             SELECT value ->> 'i', value ->> 't', value ->> 'k', value ->> 'o', value ->> 's', \
                    unhex(value ->> 'p'), value ->> 'h', ?2, ?2 \
             FROM json_each(?1) WHERE true ON CONFLICT (message_id) DO NOTHING RETURNING id, message_id",
        )
        .bind(serde_json::Value::Array(rows).to_string())
        .bind(i64::try_from(ferry_core::seams::wall_ms()).expect("wall-clock milliseconds fit an i64"))
        .fetch_all(&mut *self)
        .await
        .map_err(not_installed)?;
        let mut ids: std::collections::HashMap<String, i64> = inserted
            .into_iter()
            .map(|(id, message_id)| (message_id, id))
            .collect();
        Ok(msgs
            .iter()
            .map(|m| {
                ids.remove(&m.message_id)
                    .map_or(Enqueued::AlreadyThere, |id| Enqueued::New { id })
            })
            .collect())
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
    out
}
