//! `shards --shards N --replicas R --changes C [--broadcast]`: recording throughput with
//! N relay shards (docs/sync-scale.md §2). R replicas are enrolled and provisioned; then one
//! transaction writes C changes (C orders spread over the replicas, or with
//! `--broadcast` C updates of a table every replica holds) and the N shards, each a relay
//! of its own under its own lock in this process, record them. Measured: from the
//! writer's commit until no note is left, as changes recorded per second; and the
//! writer's own time, which grows with N (every change is noted once per shard).
//!
//! Replicas' confirmations are simulated by emptying the outbox every 50 ms, as prompt
//! replicas would, so outboxes stay small; handling reports is not part of the figure.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ferry_sync::relay::{Relay, RelaySettings};
use sqlx::Row;

use crate::Bench;

const SCHEMA: &str = "
CREATE TABLE stores (id uuid PRIMARY KEY);
CREATE TABLE products (id int8 PRIMARY KEY, name text NOT NULL, price numeric(10,2));
CREATE TABLE orders (id int8 PRIMARY KEY, store_id uuid NOT NULL, note text);
";

pub async fn main(shards: u32, replicas: u64, changes: u64, broadcast: bool) {
    let rules = format!(
        "[replicas]\nrelation = \"stores\"\n[tables.products]\nsync = \"broadcast\"\n\
         [tables.orders]\nsync = {{ assigned = \"store_id\" }}\n[relay]\nshards = {shards}\n"
    );
    let b = Bench::with(SCHEMA, &rules).await;
    if broadcast {
        sqlx::query("INSERT INTO products SELECT g, 'p' || g, g FROM generate_series(1, $1) g")
            .bind(changes as i64)
            .execute(&b.pool)
            .await
            .unwrap();
    }
    let stores = b.stores(replicas).await;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut relays = Vec::new();
    let mut stats = Vec::new();
    for shard in 0..shards {
        let settings = RelaySettings {
            shard,
            idle: Duration::from_millis(20),
            ..RelaySettings::default()
        };
        let mut relay = Relay::new(b.spec.clone(), settings);
        stats.push(relay.stats.clone());
        let url = b.url.clone();
        let stop = stop_rx.clone();
        relays.push(tokio::spawn(async move { relay.run(&url, stop).await }));
    }
    let pool = b.pool.clone();
    let mut stop = stop_rx.clone();
    let confirm = tokio::spawn(async move {
        while !*stop.borrow() {
            let _ = sqlx::query("DELETE FROM ferry_sync.outbox")
                .execute(&pool)
                .await;
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = stop.changed() => {}
            }
        }
    });
    // Provisioned: every replica has its first chain and no note is left.
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let row = sqlx::query(
            "SELECT (SELECT count(*) FROM ferry_sync.notes),
                    (SELECT count(*) FROM ferry_sync.replicas WHERE last_seq = 0)",
        )
        .fetch_one(&b.pool)
        .await
        .unwrap();
        let (notes, bare): (i64, i64) = (row.get(0), row.get(1));
        if notes == 0 && bare == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "provisioning never ended");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let passes_before: u64 = stats.iter().map(|s| s.passes.load(Ordering::Relaxed)).sum();
    let messages_before: u64 = stats
        .iter()
        .map(|s| s.messages.load(Ordering::Relaxed))
        .sum();
    let ids: Vec<uuid::Uuid> = stores.iter().map(|s| s.0).collect();
    let began = Instant::now();
    if broadcast {
        sqlx::query("UPDATE products SET price = price + 1")
            .execute(&b.pool)
            .await
            .unwrap();
    } else {
        sqlx::query(
            "INSERT INTO orders SELECT g, ($2::uuid[])[1 + g % array_length($2::uuid[], 1)], 'o' || g
             FROM generate_series(1, $1) g",
        )
        .bind(changes as i64)
        .bind(&ids)
        .execute(&b.pool)
        .await
        .unwrap();
    }
    let written = began.elapsed();
    loop {
        let notes: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry_sync.notes")
            .fetch_one(&b.pool)
            .await
            .unwrap();
        if notes == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "recording never ended");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let recorded = began.elapsed() - written;
    let passes: u64 = stats
        .iter()
        .map(|s| s.passes.load(Ordering::Relaxed))
        .sum::<u64>()
        - passes_before;
    let messages: u64 = stats
        .iter()
        .map(|s| s.messages.load(Ordering::Relaxed))
        .sum::<u64>()
        - messages_before;
    stop_tx.send(true).unwrap();
    for r in relays {
        r.await.unwrap().unwrap();
    }
    confirm.await.unwrap();
    println!(
        "{}",
        serde_json::json!({
            "bench": "shards", "shards": shards, "replicas": replicas, "changes": changes,
            "kind": if broadcast { "broadcast" } else { "assigned" },
            "write_s": written.as_secs_f64(), "record_s": recorded.as_secs_f64(),
            "changes_per_s": changes as f64 / recorded.as_secs_f64(),
            "passes": passes, "messages": messages,
            "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        })
    );
    b.drop_db().await;
}
