//! The outbox part of `ferry demo`, on embedded defaults:
//!
//! 1. An app writes orders to `outbox/shop.db` (SQLite); each order's event is enqueued
//!    in the same transaction, ordered by customer. One checkout in ten fails and rolls
//!    back, event included.
//! 2. A relay in this process publishes the events to a webhook endpoint the demo
//!    starts (the reference sink, which checks signatures and recognises repeated
//!    idempotency keys).
//! 3. A third of the way in, the endpoint goes down; two thirds in, it comes back.
//! 4. When the outbox is empty, the demo checks every committed event arrived exactly
//!    once, no rolled-back one arrived, and each customer's events arrived in commit
//!    order.

use crate::report::{fact, say};
use anyhow::{anyhow, ensure};
use ferry_outbox::relay::{Relay, RelayConfig};
use ferry_outbox::sink::Sink;
use ferry_outbox::transport::{TransportOptions, webhook::Webhook};
use ferry_outbox::{Db, Message, Store};
use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

const CUSTOMERS: u64 = 50;
const SECRET: &[u8] = b"ferry-demo-secret";

pub fn run(root: &Path, orders: u64) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(demo(root, orders))
}

async fn demo(root: &Path, orders: u64) -> anyhow::Result<()> {
    say!();
    say!("ferry demo: ferry-outbox delivers every committed event once, in order per customer");
    let dir = root.join("outbox");
    std::fs::create_dir_all(&dir)?;
    let url = format!("sqlite:{}", dir.join("shop.db").display());
    let store = Store::connect(&url).await.map_err(|e| anyhow!(e))?;
    store.install().await?;
    let Db::Sqlite(pool) = store.db() else {
        unreachable!("a sqlite: URL opens SQLite")
    };
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, total INTEGER NOT NULL)")
        .execute(pool)
        .await?;

    let sink = Sink::new(Some(SECRET.to_vec()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let mut server = Some(tokio::spawn(sink.clone().serve(listener)));
    let options = TransportOptions {
        webhook_secret: Some(SECRET.to_vec()),
        publish_timeout: Duration::from_secs(2),
        ..TransportOptions::default()
    };
    let transport =
        Webhook::new(&format!("http://127.0.0.1:{port}/hook"), &options).map_err(|e| anyhow!(e))?;
    let relay = Relay::new(
        store.clone(),
        Arc::new(transport),
        RelayConfig {
            lanes: 2,
            poll: Duration::from_millis(100),
            lease: Duration::from_secs(10),
            ..RelayConfig::default()
        },
    )
    .map_err(|e| anyhow!(e))?;
    let running = relay.spawn();

    let mut rng = ferry_core::seams::SplitMix64::from_entropy();
    use ferry_core::seams::Rng;
    let mut committed: Vec<Message> = Vec::new();
    let mut rolled_back: HashSet<String> = HashSet::new();
    let started = Instant::now();
    let (mut down_at, mut up_at) = (None, None);
    for i in 0..orders {
        if i == orders / 3 {
            if let Some(s) = server.take() {
                s.abort();
                let _ = s.await;
            }
            down_at = Some(Instant::now());
        }
        if i == 2 * orders / 3 {
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
            server = Some(tokio::spawn(sink.clone().serve(listener)));
            up_at = Some(Instant::now());
        }
        let customer = format!("customer-{}", rng.below(CUSTOMERS));
        let total = 100 + rng.below(10_000) as i64;
        let event = Message::new(
            "orders.created",
            format!(r#"{{"order":{i},"customer":"{customer}","total":{total}}}"#).into_bytes(),
        )
        .ordered_by(customer.clone());
        let mut tx = pool.begin().await?;
        sqlx::query("INSERT INTO orders (id, customer, total) VALUES (?, ?, ?)")
            .bind(i as i64)
            .bind(&customer)
            .bind(total)
            .execute(&mut *tx)
            .await?;
        ferry_outbox::enqueue(&mut *tx, &event).await?;
        if rng.below(10) == 0 {
            tx.rollback().await?;
            rolled_back.insert(event.message_id.clone());
        } else {
            tx.commit().await?;
            committed.push(event);
        }
        // A steady shop, not a bulk load: the outage must fall mid-stream.
        if i % 50 == 49 {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    let wrote = started.elapsed();
    let drain_started = Instant::now();
    let drained = loop {
        let st = store.depth().await?;
        if st.pending + st.uncertain + st.leased == 0 {
            break true;
        }
        if drain_started.elapsed() > Duration::from_secs(120) {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let drain = drain_started.elapsed();
    running.stop().await?;
    if let Some(s) = server.take() {
        s.abort();
    }

    // The check.
    let got = sink.received();
    let ids: Vec<&str> = got.iter().map(|r| r.message_id.as_str()).collect();
    let unique: HashSet<&str> = ids.iter().copied().collect();
    let want: HashSet<&str> = committed.iter().map(|m| m.message_id.as_str()).collect();
    let missing = want.difference(&unique).count();
    let extra = unique.difference(&want).count();
    let leaked = rolled_back
        .iter()
        .filter(|id| unique.contains(id.as_str()))
        .count();
    let mut arrived: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for r in &got {
        if let Some(k) = &r.key {
            arrived.entry(k).or_default().push(&r.message_id);
        }
    }
    let mut expected: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for m in &committed {
        expected
            .entry(m.key.as_deref().unwrap_or(""))
            .or_default()
            .push(&m.message_id);
    }
    let out_of_order = expected
        .iter()
        .filter(|(k, v)| arrived.get(*k) != Some(*v))
        .count();
    let st = relay.status();
    fact("outbox", "orders", orders);
    fact("outbox", "committed", committed.len());
    fact("outbox", "rolled_back", rolled_back.len());
    fact("outbox", "drained_secs", drain.as_secs_f64());
    fact("outbox", "events_stored", unique.len());
    fact("outbox", "duplicates_recognised", sink.duplicates());
    fact("outbox", "unavailable", st.unavailable);
    fact("outbox", "missing", missing);
    fact("outbox", "unexpected", extra);
    fact("outbox", "rolled_back_delivered", leaked);
    fact("outbox", "customers_out_of_order", out_of_order);

    say!(
        "  wrote {orders} orders in {:.1} s: {} committed with their event in the same transaction, {} rolled back (event included)",
        wrote.as_secs_f64(),
        committed.len(),
        rolled_back.len()
    );
    if let (Some(d), Some(u)) = (down_at, up_at) {
        say!(
            "  took the webhook endpoint down after order {}, brought it back {:.1} s later; the relay paused (breaker) instead of spending attempts: {} publishes found it away, 0 parked",
            orders / 3,
            u.duration_since(d).as_secs_f64(),
            st.unavailable
        );
    }
    say!(
        "  the outbox was empty {:.2} s after the last commit; the endpoint stored {} events ({} signatures checked), recognised {} repeated deliveries",
        drain.as_secs_f64(),
        unique.len(),
        sink.requests(),
        sink.duplicates()
    );
    say!(
        "  every committed event arrived once: {}; rolled-back events delivered: {leaked}; customers whose events arrived out of order: {out_of_order} of {}",
        if missing == 0 && extra == 0 && ids.len() == unique.len() {
            "yes".to_string()
        } else {
            format!("NO ({missing} missing, {extra} unexpected)")
        },
        expected.len()
    );
    ensure!(drained, "the outbox did not drain within 120 s");
    ensure!(
        missing == 0 && extra == 0,
        "{missing} events missing, {extra} unexpected"
    );
    ensure!(
        ids.len() == unique.len(),
        "the endpoint stored an event twice"
    );
    ensure!(leaked == 0, "{leaked} rolled-back events were delivered");
    ensure!(
        out_of_order == 0,
        "{out_of_order} customers' events arrived out of order"
    );
    ensure!(st.parked == 0, "{} events were parked", st.parked);
    ensure!(sink.bad_signatures() == 0, "signatures did not verify");
    store.close().await;
    Ok(())
}
