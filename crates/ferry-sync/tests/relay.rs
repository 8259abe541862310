//! The relay end to end on a real Postgres and real SQLite files: every store holds
//! exactly what the rules say, in content, after writes, moves and deletes
//! (docs/sync.md §1 guarantee 1, docs/sync-relay.md §1.3).

mod common;

use common::Shop;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_store_holds_exactly_what_its_rules_say_through_writes_moves_and_deletes() {
    let mut shop = Shop::new("relay").await;
    let north_a = shop.store("north").await;
    let north_b = shop.store("north").await;
    let south = shop.store("south").await;
    let alice = Uuid::new_v4();
    let bob = Uuid::new_v4();
    let order_1 = Uuid::new_v4();
    let order_2 = Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO products VALUES (1, 'tea', 3.50, 'north'), (2, 'coffee|dark', 4.00, 'north'), (3, 'mate', NULL, 'south');
             INSERT INTO customers VALUES ('{alice}', 'Alice'), ('{bob}', 'Bob');
             INSERT INTO orders (id, store_id, customer_id, note) VALUES ('{order_1}', '{north_a}', '{alice}', 'first'),
               ('{order_2}', '{south}', '{bob}', NULL);
             INSERT INTO order_lines VALUES ('{order_1}', 1, 1, 2), ('{order_1}', 2, 2, 1), ('{order_2}', 1, 3, 5);"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    assert_eq!(
        shop.held(north_b)["orders"].len(),
        0,
        "an order goes only to its store"
    );
    assert_eq!(
        shop.held(north_a)["customers"].len(),
        1,
        "the customer comes with the order (closure)"
    );

    // A price change, a product moving region, an order moving store with its lines.
    shop.db
        .exec(&format!(
            "UPDATE products SET price = 3.75 WHERE id = 1;
             UPDATE products SET region = 'south' WHERE id = 2;
             UPDATE orders SET store_id = '{north_b}' WHERE id = '{order_1}';"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    assert_eq!(
        shop.held(north_a)["customers"].len(),
        0,
        "alice leaves with her only order"
    );
    assert_eq!(
        shop.held(north_b)["order_lines"].len(),
        2,
        "lines follow their order"
    );

    // Deletes: a line, an order (lines cascade), a product.
    shop.db
        .exec(&format!(
            "DELETE FROM order_lines WHERE order_id = '{order_1}' AND line = 2;
             DELETE FROM orders WHERE id = '{order_2}';
             UPDATE order_lines SET product_id = NULL WHERE product_id = 3;
             DELETE FROM products WHERE id = 3;
             UPDATE customers SET name = 'Alice B.' WHERE id = '{alice}';"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;

    // A store closing is retired: it is sent nothing more.
    shop.db
        .exec(&format!(
            "UPDATE stores SET open = false WHERE id = '{south}'"
        ))
        .await;
    shop.settle().await;
    let status = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    let south_status = status
        .replicas
        .iter()
        .find(|r| r.id == south.to_string())
        .unwrap();
    assert_eq!(south_status.standing, "retired");
    shop.replicas.remove(&south);
    shop.assert_converged().await;
    for r in status.replicas.iter().filter(|r| r.standing != "retired") {
        assert_eq!(r.standing, "synced", "{r:?}");
    }
    shop.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_store_is_provisioned_with_what_exists() {
    let mut shop = Shop::new("late").await;
    let first = shop.store("north").await;
    shop.db
        .exec(&format!(
            "INSERT INTO products SELECT g, 'p' || g, g / 10.0, 'north' FROM generate_series(1, 2500) g;
             INSERT INTO customers VALUES ('{first}', 'c');
             INSERT INTO orders (id, store_id, customer_id) SELECT gen_random_uuid(), '{first}', '{first}' FROM generate_series(1, 50);"
        ))
        .await;
    shop.settle().await;
    let late = shop.store("north").await;
    shop.settle().await;
    shop.assert_converged().await;
    assert_eq!(shop.held(late)["products"].len(), 2500);
    shop.finish().await;
}

// Guards a store that moved region and whose outbox was then dropped before it confirmed
// its new partition's snapshot: the catch-up must not start from its mark, which counts
// passes of the old partition (it kept the old region's products and missed the new
// one's). Found by the walk (seed 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_moved_region_and_fell_behind_is_provisioned_not_caught_up() {
    let mut shop = Shop::new("moved").await;
    shop.relay = ferry_sync::relay::Relay::new(
        shop.spec.clone(),
        ferry_sync::relay::RelaySettings {
            outbox_messages_max: 2,
            ..ferry_sync::relay::RelaySettings::default()
        },
    );
    let store = shop.store("north").await;
    shop.db
        .exec("INSERT INTO products SELECT g, 'p' || g, g, CASE WHEN g % 2 = 0 THEN 'north' ELSE 'south' END FROM generate_series(1, 10) g")
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    // It moves south; the snapshot for south and what follows wait until the outbox
    // passes its bound and is dropped.
    shop.db
        .exec(&format!(
            "UPDATE stores SET region = 'south' WHERE id = '{store}'"
        ))
        .await;
    for i in 1..=4 {
        shop.db
            .exec(&format!(
                "UPDATE products SET price = price + 1 WHERE id = {}",
                2 * i - 1
            ))
            .await;
        shop.passes().await;
    }
    shop.settle().await;
    shop.assert_converged().await;
    shop.finish().await;
}

// As above, when the store confirms a message of its old region after the move, before
// the new snapshot: that confirmation must not give it a mark the catch-up starts from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmation_from_before_a_move_gives_no_mark_in_the_new_region() {
    let mut shop = Shop::new("moved2").await;
    shop.relay = ferry_sync::relay::Relay::new(
        shop.spec.clone(),
        ferry_sync::relay::RelaySettings {
            outbox_messages_max: 2,
            ..ferry_sync::relay::RelaySettings::default()
        },
    );
    let store = shop.store("north").await;
    shop.db
        .exec("INSERT INTO products SELECT g, 'p' || g, g, CASE WHEN g % 2 = 0 THEN 'north' ELSE 'south' END FROM generate_series(1, 10) g")
        .await;
    shop.settle().await;
    shop.db
        .exec("UPDATE products SET price = 0 WHERE id = 2")
        .await;
    shop.passes().await;
    shop.db
        .exec(&format!(
            "UPDATE stores SET region = 'south' WHERE id = '{store}'"
        ))
        .await;
    shop.passes().await;
    // The store takes the north message (not the snapshot after it) and confirms it.
    let replica = shop.replicas.get_mut(&store).unwrap();
    let status = replica.status().unwrap();
    let frames = ferry_sync::serve::frames_after(
        &shop.db.pool,
        store,
        status
            .epoch
            .as_deref()
            .and_then(|h| Uuid::parse_str(h).ok()),
        status.seq,
        1,
    )
    .await
    .unwrap();
    replica.receive(&frames[0]).unwrap();
    let up = replica.up_without_digests().unwrap();
    ferry_sync::serve::store_report(&shop.db.pool, store, &ferry_sync::wire::encode_up(&up))
        .await
        .unwrap();
    for i in 1..=4 {
        shop.db
            .exec(&format!(
                "UPDATE products SET price = price + 1 WHERE id = {}",
                2 * i - 1
            ))
            .await;
        shop.passes().await;
    }
    shop.settle().await;
    shop.assert_converged().await;
    shop.finish().await;
}

// Guards a heal planned in the same pass as a move: the old store's copy of the order's
// lines was changed behind the relay's back, so their digest differs and the lines are
// resent to it from the held state at the start of the pass, while the order's move,
// planned in the same pass, takes them (its followers) away there. The replica applies a
// part's deletes before its upserts, so the heal's upserts must not outlive the deletes.
// Found by the walk (seed 24), where a digest compared before a write's pass healed the
// written table; such a digest now waits for the table's notes, so a real difference in
// a follower table stands in for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_order_moved_in_the_pass_that_heals_its_old_store_leaves_it() {
    let mut shop = Shop::new("healmove").await;
    shop.relay = ferry_sync::relay::Relay::new(
        shop.spec.clone(),
        ferry_sync::relay::RelaySettings {
            digest_every: std::time::Duration::ZERO,
            ..ferry_sync::relay::RelaySettings::default()
        },
    );
    let old = shop.store("north").await;
    let new = shop.store("north").await;
    let order = Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO orders (id, store_id, note) VALUES ('{order}', '{old}', 'o');
             INSERT INTO order_lines (order_id, line, qty) VALUES ('{order}', 1, 1), ('{order}', 2, 2);"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    let heals = shop
        .relay
        .stats
        .heals
        .load(std::sync::atomic::Ordering::Relaxed);
    shop.replicas[&old]
        .conn()
        .execute_batch("UPDATE order_lines SET qty = 7")
        .unwrap();
    shop.db
        .exec(&format!(
            "UPDATE orders SET store_id = '{new}' WHERE id = '{order}'"
        ))
        .await;
    // The old store reports its digests before the move is planned.
    shop.deliver(old).await;
    shop.passes().await;
    assert!(
        shop.relay
            .stats
            .heals
            .load(std::sync::atomic::Ordering::Relaxed)
            > heals,
        "the old store's order lines are healed in the pass that plans the move"
    );
    // Checked before any later digest could heal the mistake away.
    shop.deliver(old).await;
    assert_eq!(
        shop.held(old)["orders"].len(),
        0,
        "the order left its old store"
    );
    assert_eq!(
        shop.held(old)["order_lines"].len(),
        0,
        "its lines left with it"
    );
    shop.settle().await;
    shop.assert_converged().await;
    shop.finish().await;
}

/// Replica `id`'s progress on `table` of `kind` in `status`, as (rows, confirmed,
/// pending, covered).
fn progress(
    status: &ferry_sync::status::Status,
    id: Uuid,
    table: &str,
    kind: &str,
) -> Option<(i64, i64, i64, Option<bool>)> {
    let replica = status.replicas.iter().find(|r| r.id == id.to_string())?;
    let t = replica
        .tables
        .iter()
        .find(|t| t.table == table && t.kind == kind)?;
    assert_eq!(t.rows, t.confirmed + t.pending, "{t:?}");
    Some((t.rows, t.confirmed, t.pending, t.covered))
}

// Guards per-table progress in `ferry sync status` (docs/sync.md §12, guarantee 5): it
// counts a row as confirmed only once the store confirmed a message carrying its latest
// version, per store (two stores of one partition at different marks), for broadcast
// tables by their mark (a delete too: the mark must cover the tombstone) and for per-row
// tables by their held rows' messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_counts_each_tables_rows_confirmed_only_once_confirmed() {
    let mut shop = Shop::new("progress").await;
    let a = shop.store("north").await;
    let b = shop.store("north").await;
    let alice = Uuid::new_v4();
    let order_1 = Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO products VALUES (1, 'tea', 1, 'north'), (2, 'coffee', 2, 'north'),
               (3, 'mate', 3, 'north'), (9, 'yerba', 9, 'south');
             INSERT INTO customers VALUES ('{alice}', 'Alice');
             INSERT INTO orders (id, store_id, customer_id) VALUES ('{order_1}', '{a}', '{alice}');
             INSERT INTO order_lines VALUES ('{order_1}', 1, 1, 2), ('{order_1}', 2, 2, 1);"
        ))
        .await;
    shop.settle().await;
    let st = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    for id in [a, b] {
        assert_eq!(
            progress(&st, id, "public.products", "broadcast"),
            Some((3, 3, 0, Some(true))),
            "{st:?}"
        );
    }
    assert_eq!(
        progress(&st, a, "public.orders", "per_row"),
        Some((1, 1, 0, None))
    );
    assert_eq!(
        progress(&st, a, "public.order_lines", "per_row"),
        Some((2, 2, 0, None))
    );
    assert_eq!(
        progress(&st, a, "public.customers", "per_row"),
        Some((1, 1, 0, None))
    );
    assert_eq!(
        progress(&st, b, "public.orders", "per_row"),
        None,
        "b holds no order"
    );
    let json = serde_json::to_value(&st).unwrap();
    // The JSON names each table's kind (tables sorted by name; replicas by id, so which
    // store comes first is chance).
    let products = json["replicas"][0]["tables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["table"] == "public.products")
        .cloned();
    assert_eq!(
        products.map(|t| t["kind"].clone()),
        Some(serde_json::json!("broadcast")),
        "{json}"
    );

    // Recorded, not yet confirmed: a changed product and a new one are pending for both
    // stores, and a's new order is in flight.
    let order_2 = Uuid::new_v4();
    shop.db
        .exec(&format!(
            "UPDATE products SET price = 10 WHERE id = 1;
             INSERT INTO products VALUES (4, 'rooibos', 4, 'north');
             INSERT INTO orders (id, store_id) VALUES ('{order_2}', '{a}');"
        ))
        .await;
    shop.passes().await;
    let st = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    for id in [a, b] {
        assert_eq!(
            progress(&st, id, "public.products", "broadcast"),
            Some((4, 2, 2, Some(false))),
            "{st:?}"
        );
    }
    assert_eq!(
        progress(&st, a, "public.orders", "per_row"),
        Some((2, 1, 1, None))
    );

    // a confirms; b does not: each store's own mark counts.
    shop.deliver(a).await;
    shop.passes().await;
    let st = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    assert_eq!(
        progress(&st, a, "public.products", "broadcast"),
        Some((4, 4, 0, Some(true)))
    );
    assert_eq!(
        progress(&st, a, "public.orders", "per_row"),
        Some((2, 2, 0, None))
    );
    assert_eq!(
        progress(&st, b, "public.products", "broadcast"),
        Some((4, 2, 2, Some(false)))
    );

    // A delete leaves every row it still holds confirmed, but the mark does not cover
    // the table until the delete is confirmed too.
    shop.settle().await;
    shop.db.exec("DELETE FROM products WHERE id = 3").await;
    shop.passes().await;
    let st = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    for id in [a, b] {
        assert_eq!(
            progress(&st, id, "public.products", "broadcast"),
            Some((3, 3, 0, Some(false))),
            "{st:?}"
        );
    }
    shop.settle().await;
    let st = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    for id in [a, b] {
        assert_eq!(
            progress(&st, id, "public.products", "broadcast"),
            Some((3, 3, 0, Some(true)))
        );
    }
    shop.assert_converged().await;
    shop.finish().await;
}
