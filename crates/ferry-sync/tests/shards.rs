//! Relay shards (docs/sync-scale.md §2): the replicas are spread over N relays, each under
//! its own lock, with Postgres as the one shared system. Every shard plans every note for
//! its own replicas and keeps its own broadcast versions.
//!
//! Guards against: a shard recording for (or taking back rows from) another shard's
//! replicas, a note planned by one shard only, two shards' versions of one broadcast row
//! mixed, shards racing on shared bodies, the SQL and Rust ideas of a replica's shard
//! disagreeing, and a change of the number of shards leaving a replica with stale rows.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::{SHOP_RULES, SHOP_SCHEMA, Shop};
use ferry_sync::relay::spec::Spec;
use ferry_sync::relay::{Relay, RelaySettings, lock_key, shard_of};
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

fn sharded(n: u32) -> String {
    format!("{SHOP_RULES}\n[relay]\nshards = {n}\n")
}

/// Relay shard `shard` of `spec`, with a connection holding its lock.
async fn shard(shop: &Shop, spec: &std::sync::Arc<Spec>, shard: u32) -> (Relay, PgConnection) {
    let mut lock = PgConnection::connect(&shop.db.url).await.unwrap();
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(lock_key(shard))
        .fetch_one(&mut lock)
        .await
        .unwrap();
    assert!(got, "shard {shard}'s lock is free");
    let settings = RelaySettings {
        shard,
        ..RelaySettings::default()
    };
    (Relay::new(spec.clone(), settings), lock)
}

/// Stores in `regions`, `per_shard` of them in each of `shards` shards.
async fn stores(shop: &mut Shop, shards: u32, per_shard: usize) -> Vec<Uuid> {
    let mut counts = vec![0; shards as usize];
    let mut out = Vec::new();
    while counts.iter().any(|c| *c < per_shard) {
        let id = Uuid::new_v4();
        let s = shard_of(&id, shards) as usize;
        if counts[s] == per_shard {
            continue;
        }
        counts[s] += 1;
        let region = if out.len() % 2 == 0 { "north" } else { "south" };
        out.push(shop.store_as(id, region).await);
    }
    out
}

async fn write_the_shop(shop: &Shop, stores: &[Uuid]) {
    shop.db
        .exec(
            "INSERT INTO products SELECT g, 'p' || g, g, CASE WHEN g % 2 = 0 THEN 'north' ELSE 'south' END
             FROM generate_series(1, 40) g",
        )
        .await;
    for (i, store) in stores.iter().enumerate() {
        let order = Uuid::new_v4();
        let customer = Uuid::new_v4();
        shop.db
            .exec(&format!(
                "INSERT INTO customers (id, name) VALUES ('{customer}', 'c{i}');
                 INSERT INTO orders (id, store_id, customer_id, note) VALUES ('{order}', '{store}', '{customer}', 'o{i}');
                 INSERT INTO order_lines (order_id, line, product_id, qty) VALUES ('{order}', 1, {}, 2);",
                i % 40 + 1
            ))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_shard_records_for_its_own_replicas_from_every_note_and_all_converge() {
    // The shop runs shard 0's relay and shard 1's, each holding its own lock.
    let mut shop = Shop::new_with("shards", SHOP_SCHEMA, &sharded(2)).await;
    assert_eq!((shop.spec.shards, shop.shards.len()), (2, 1));
    let stores = stores(&mut shop, 2, 3).await;

    // The SQL and the Rust idea of a replica's shard agree.
    for _ in 0..200 {
        let id = Uuid::new_v4();
        for n in [1, 2, 3, 7] {
            let sql: i32 = sqlx::query_scalar("SELECT ferry_sync.shard_of($1, $2)")
                .bind(id)
                .bind(n)
                .fetch_one(&shop.db.pool)
                .await
                .unwrap();
            assert_eq!(sql as u32, shard_of(&id, n as u32), "{id} of {n}");
        }
    }

    write_the_shop(&shop, &stores).await;
    // Every note is there once per shard.
    let per_shard: Vec<(i32, i64)> =
        sqlx::query_as("SELECT shard, count(*) FROM ferry_sync.notes GROUP BY 1 ORDER BY 1")
            .fetch_all(&shop.db.pool)
            .await
            .unwrap();
    assert_eq!(per_shard.len(), 2, "{per_shard:?}");
    assert_eq!(per_shard[0].1, per_shard[1].1, "{per_shard:?}");

    // One shard's pass records for its own replicas only, and leaves the other's notes.
    let (relay, lock) = &mut shop.shards[0];
    while relay.pass(lock).await.unwrap().more {}
    let recorded_for: BTreeSet<u32> =
        sqlx::query_scalar::<_, Uuid>("SELECT DISTINCT replica FROM ferry_sync.outbox")
            .fetch_all(&shop.db.pool)
            .await
            .unwrap()
            .iter()
            .map(|r| shard_of(r, 2))
            .collect();
    assert_eq!(recorded_for, BTreeSet::from([1]));
    let zero_left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ferry_sync.notes WHERE shard = 0")
            .fetch_one(&shop.db.pool)
            .await
            .unwrap();
    assert!(zero_left > 0);

    shop.settle().await;
    shop.assert_converged().await;
    // Each shard keeps its own versions of the broadcast rows.
    let kept: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT shard, count(*) FROM ferry_sync.rows WHERE NOT gone GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&shop.db.pool)
    .await
    .unwrap();
    assert_eq!(kept, [(0, 40), (1, 40)]);

    // Moves, deletes and closure keep working across both: an order moves to a store of
    // the other shard, a product changes region, one is deleted.
    let from = stores[0];
    let to = *stores
        .iter()
        .find(|s| shard_of(s, 2) != shard_of(&from, 2))
        .unwrap();
    shop.db
        .exec(&format!(
            "UPDATE orders SET store_id = '{to}' WHERE store_id = '{from}';
             UPDATE products SET region = 'north' WHERE id = 3;
             DELETE FROM order_lines WHERE product_id = 4; DELETE FROM products WHERE id = 4;"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;

    // Status counts each replica's broadcast rows from its own shard's versions.
    let status = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    for r in &status.replicas {
        let products = r
            .tables
            .iter()
            .find(|t| t.table == "public.products")
            .unwrap_or_else(|| panic!("{}: {:?}", r.id, r.tables));
        let region = r.partition.as_deref().unwrap();
        let expected: i64 = sqlx::query_scalar("SELECT count(*) FROM products WHERE region = $1")
            .bind(region)
            .fetch_one(&shop.db.pool)
            .await
            .unwrap();
        assert_eq!((products.rows, products.confirmed), (expected, expected));
    }
    shop.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_running_side_by_side_converge_and_a_shards_standby_takes_over() {
    let mut shop = Shop::new_with("shards_run", SHOP_SCHEMA, &sharded(2)).await;
    shop.shards.clear();
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(ferry_sync::relay::LOCK_KEY)
        .execute(&mut shop.lock)
        .await
        .unwrap();
    let stores = stores(&mut shop, 2, 3).await;
    let settings = |shard| RelaySettings {
        shard,
        standby: Duration::from_millis(500),
        idle: Duration::from_millis(50),
        ..RelaySettings::default()
    };
    // Two relays per shard: one holds, one stands by.
    let mut running = Vec::new();
    for s in [0, 0, 1, 1] {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let mut relay = Relay::new(shop.spec.clone(), settings(s));
        let stats = relay.stats.clone();
        let url = shop.db.url.clone();
        let task = tokio::spawn(async move { relay.run(&url, rx).await });
        running.push((s, tx, stats, task));
    }
    write_the_shop(&shop, &stores).await;
    // Writes keep coming while the shards record them side by side.
    for i in 0..20 {
        shop.db
            .exec(&format!(
                "UPDATE products SET name = 'renamed {i}' WHERE id = {}",
                i % 40 + 1
            ))
            .await;
        for id in stores.clone() {
            shop.deliver(id).await;
        }
    }
    settle_running(&mut shop).await;
    shop.assert_converged().await;

    // Shard 1's holder stops: its standby takes over, shard 0 never noticed.
    let holder = running
        .iter()
        .position(|(s, _, stats, _)| {
            *s == 1 && stats.holding.load(std::sync::atomic::Ordering::Relaxed)
        })
        .expect("shard 1 has a holder");
    let (_, tx, _, task) = running.remove(holder);
    tx.send(true).unwrap();
    task.await.unwrap().unwrap();
    shop.db.exec("UPDATE products SET price = price + 1").await;
    settle_running(&mut shop).await;
    shop.assert_converged().await;
    for (_, tx, _, task) in running {
        tx.send(true).unwrap();
        task.await.unwrap().unwrap();
    }
    shop.finish().await;
}

/// Delivers to every store while the relays run elsewhere, until nothing is left.
async fn settle_running(shop: &mut Shop) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut moved = false;
        for id in shop.replicas.keys().copied().collect::<Vec<_>>() {
            moved |= shop.deliver(id).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let left: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM ferry_sync.notes) + (SELECT count(*) FROM ferry_sync.outbox)
                  + (SELECT count(*) FROM ferry_sync.reports r JOIN ferry_sync.replicas c ON c.id = r.replica WHERE r.n > c.handled_n)",
        )
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
        if !moved && left == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "never settled: {left} left");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_the_number_of_shards_provisions_every_replica_again_by_its_new_shard() {
    let mut shop = Shop::new_with("reshard", SHOP_SCHEMA, &sharded(2)).await;
    let stores = stores(&mut shop, 3, 2).await;
    write_the_shop(&shop, &stores).await;
    shop.settle().await;
    shop.assert_converged().await;
    shop.shards.clear();

    // Three shards now: installed while nothing runs, then a write nobody has seen.
    let spec = shop.install(&sharded(3)).await;
    shop.db
        .exec("UPDATE products SET region = 'north' WHERE id < 10; DELETE FROM order_lines WHERE product_id = 20")
        .await;
    shop.relay = Relay::new(spec.clone(), RelaySettings::default());
    shop.spec = spec.clone();
    shop.shards = vec![shard(&shop, &spec, 1).await, shard(&shop, &spec, 2).await];
    shop.settle().await;
    shop.assert_converged().await;
    let shards: Vec<i32> =
        sqlx::query_scalar("SELECT DISTINCT shard FROM ferry_sync.rows ORDER BY 1")
            .fetch_all(&shop.db.pool)
            .await
            .unwrap();
    assert_eq!(shards, [0, 1, 2]);
    shop.finish().await;
}

/// A restore one shard detects is every shard's: the other shard's replicas are
/// provisioned again even by a relay that just started (no memory of the old epoch) and
/// whose first passes fail on a bad note.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_epoch_taken_by_one_shard_provisions_the_other_shards_replicas() {
    let mut shop = Shop::new_with("shards_epoch", SHOP_SCHEMA, &sharded(2)).await;
    let stores = stores(&mut shop, 2, 1).await;
    let (a, b) = if shard_of(&stores[0], 2) == 0 {
        (stores[0], stores[1])
    } else {
        (stores[1], stores[0])
    };
    let order = Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO orders (id, store_id, note) VALUES ('{order}', '{b}', 'b''s')"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;

    // Shard 0 hears store a confirm a message the server has no record of: a restore.
    shop.db
        .exec(&format!(
            "UPDATE ferry_sync.replicas SET last_seq = 0 WHERE id = '{a}'"
        ))
        .await;
    shop.deliver(a).await;
    shop.relay.pass(&mut shop.lock).await.unwrap();
    let restores: i32 = sqlx::query_scalar("SELECT restores FROM ferry_sync.meta")
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert_eq!(restores, 1);

    // Shard 1's relay is new, and its first passes fail on a note it cannot plan.
    let spec = shop.spec.clone();
    shop.shards[0].0 = Relay::new(
        spec,
        RelaySettings {
            shard: 1,
            ..RelaySettings::default()
        },
    );
    shop.db
        .exec("INSERT INTO ferry_sync.notes (shard, relation, key) VALUES (1, 'public.products', 'not a number')")
        .await;
    let (relay, lock) = &mut shop.shards[0];
    for _ in 0..20 {
        relay.step(lock).await.unwrap();
    }
    shop.db
        .exec(&format!("DELETE FROM orders WHERE id = '{order}'"))
        .await;
    shop.settle_parking().await;
    shop.assert_converged().await;
    shop.finish().await;
}

/// Two shards record the same broadcast change at the same moment: each writes its own
/// copy of the shared body, so neither pass fails on the other's (docs/sync-scale.md §2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_shards_recording_one_broadcast_change_at_once_both_commit() {
    let mut shop = Shop::new_with("shards_bodies", SHOP_SCHEMA, &sharded(2)).await;
    stores(&mut shop, 2, 2).await;
    shop.db
        .exec("INSERT INTO products VALUES (1, 'tea', 1, 'north'), (2, 'rice', 1, 'south')")
        .await;
    shop.settle().await;
    shop.db.exec("UPDATE products SET price = 99").await;
    let spec = shop.spec.clone();
    let mut zero = std::mem::replace(
        &mut shop.relay,
        Relay::new(spec.clone(), RelaySettings::default()),
    );
    let mut zero_lock = std::mem::replace(
        &mut shop.lock,
        PgConnection::connect(&shop.db.url).await.unwrap(),
    );
    zero.before_commit = Some(Box::new(|| {
        Box::pin(tokio::time::sleep(Duration::from_millis(1500)))
    }));
    let first = tokio::spawn(async move {
        let report = zero.pass(&mut zero_lock).await;
        (report.map(|r| r.messages), zero, zero_lock)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (one, one_lock) = &mut shop.shards[0];
    let second = one.pass(one_lock).await.map(|r| r.messages);
    let (first, mut zero, zero_lock) = first.await.unwrap();
    assert!(matches!(first, Ok(2)), "{first:?}");
    assert!(matches!(second, Ok(2)), "{second:?}");
    zero.before_commit = None;
    shop.relay = zero;
    shop.lock = zero_lock;
    shop.settle().await;
    shop.assert_converged().await;
    let copies: Vec<i32> =
        sqlx::query_scalar("SELECT DISTINCT shard FROM ferry_sync.bodies ORDER BY 1")
            .fetch_all(&shop.db.pool)
            .await
            .unwrap();
    assert!(copies.len() <= 2, "{copies:?}");
    shop.finish().await;
}
