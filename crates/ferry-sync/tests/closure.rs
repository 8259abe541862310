//! Referential closure across partitions (docs/sync.md §3): a row travels with the
//! parents the replica lacks, broadcast parents of another partition included, and a
//! parent stays while anything the replica holds points at it.

mod common;

use common::Shop;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_naming_another_regions_product_brings_it_and_keeps_it_while_pointed_at() {
    let mut shop = Shop::new("closure").await;
    let north = shop.store("north").await;
    let south = shop.store("south").await;
    let order = Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO products VALUES (1, 'tea', 1, 'north'), (2, 'mate', 2, 'south'), (3, 'yerba', 3, 'south');
             INSERT INTO orders (id, store_id) VALUES ('{order}', '{north}');
             INSERT INTO order_lines VALUES ('{order}', 1, 2, 1);"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    assert!(
        shop.held(north)["products"]
            .iter()
            .any(|p| p.starts_with("2|")),
        "the south product came with the line"
    );

    // The parent changes: the copy held per row follows.
    shop.db
        .exec("UPDATE products SET price = 2.5 WHERE id = 2")
        .await;
    shop.settle().await;
    shop.assert_converged().await;

    // A north product moves south while a line of the north store points at it: it stays.
    shop.db.exec(&format!("INSERT INTO order_lines VALUES ('{order}', 2, 1, 1); UPDATE products SET region = 'south' WHERE id = 1;")).await;
    shop.settle().await;
    shop.assert_converged().await;
    assert!(
        shop.held(north)["products"]
            .iter()
            .any(|p| p.starts_with("1|")),
        "kept while pointed at"
    );

    // The line goes: the product is no longer owed to the north store.
    shop.db
        .exec(&format!(
            "DELETE FROM order_lines WHERE order_id = '{order}' AND line = 2"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    assert!(
        !shop.held(north)["products"]
            .iter()
            .any(|p| p.starts_with("1|")),
        "released"
    );

    // The order moves to the south store: the north store keeps none of it.
    shop.db
        .exec(&format!(
            "UPDATE orders SET store_id = '{south}' WHERE id = '{order}'"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    assert!(
        !shop.held(north)["products"]
            .iter()
            .any(|p| p.starts_with("2|"))
    );
    shop.finish().await;
}

// Guards a product another region's store held per row, taken back in a message its
// outbox then dropped: the catch-up sends only its own region's changes, so the take-back
// must leave a tombstone there. Found by the walk (seed 29).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_product_taken_back_in_a_dropped_outbox_is_taken_back_by_the_catch_up() {
    let mut shop = Shop::new("closure_dropped").await;
    shop.relay = ferry_sync::relay::Relay::new(
        shop.spec.clone(),
        ferry_sync::relay::RelaySettings {
            outbox_messages_max: 2,
            ..ferry_sync::relay::RelaySettings::default()
        },
    );
    let south = shop.store("south").await;
    let order = Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO products VALUES (1, 'tea', 1, 'north'), (2, 'mate', 2, 'south');
             INSERT INTO orders (id, store_id) VALUES ('{order}', '{south}');
             INSERT INTO order_lines VALUES ('{order}', 1, 1, 1);"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    // The line stops naming the north product; that take-back and what follows wait
    // until the outbox passes its bound and is dropped.
    shop.db
        .exec(&format!(
            "UPDATE order_lines SET product_id = NULL WHERE order_id = '{order}'"
        ))
        .await;
    shop.passes().await;
    for i in 1..=3 {
        shop.db
            .exec(&format!(
                "UPDATE orders SET note = 'n{i}' WHERE id = '{order}'"
            ))
            .await;
        shop.passes().await;
    }
    shop.settle().await;
    shop.assert_converged().await;
    assert!(
        !shop.held(south)["products"]
            .iter()
            .any(|p| p.starts_with("1|")),
        "taken back"
    );
    shop.finish().await;
}
