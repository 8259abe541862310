//! Two-way tables (docs/sync-up.md §2, `mirror = "both"`): the server sends the rows, a
//! store writes back the columns the rules give it, and filing sets those columns only
//! on rows the server records the store holding. The server's columns and the store's
//! never overwrite each other; an edit of a row the server deleted, took back, or never
//! sent is dropped, and the store is told and counts it.
//!
//! Guards against: a message down wiping a store's columns, a filing that notes the row
//! again (a message back for every edit), an edit landing on a row another store now
//! holds, and a dropped edit kept forever or set aside.

mod common;

use common::up::{Lossy, upload_all};
use common::{SHOP_RULES, SHOP_SCHEMA, Shop};
use ferry_sync::replica::{Uploader, up_status};
use uuid::Uuid;

/// The shop with orders and products two-way: a store writes an order's `status` and
/// `picked_at`, and a product's `shelf` (the last store of the region to file wins).
fn two_way_shop() -> (String, String) {
    let schema = format!(
        "{SHOP_SCHEMA}
         ALTER TABLE orders ADD COLUMN status text, ADD COLUMN picked_at int8;
         ALTER TABLE products ADD COLUMN shelf text;"
    );
    let rules = SHOP_RULES
        .replace(
            "[tables.orders]\n",
            "[tables.orders]\nmirror = \"both\"\nreplica_writes = [\"status\", \"picked_at\"]\nlane = \"orders\"\n",
        )
        .replace(
            "[tables.products]\n",
            "[tables.products]\nmirror = \"both\"\nreplica_writes = [\"shelf\"]\n",
        );
    (schema, rules)
}

async fn order(shop: &Shop, store: Uuid, note: &str) -> String {
    let id = Uuid::new_v4();
    sqlx::query("INSERT INTO orders (id, store_id, note) VALUES ($1, $2, $3)")
        .bind(id)
        .bind(store)
        .bind(note)
        .execute(&shop.db.pool)
        .await
        .unwrap();
    id.to_string()
}

async fn server_order(shop: &Shop, id: &str) -> (Option<String>, Option<i64>, Option<String>) {
    sqlx::query_as("SELECT status, picked_at, note FROM orders WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(&shop.db.pool)
        .await
        .unwrap()
}

async fn upload(uploader: Uploader, link: Lossy, db: std::path::PathBuf) -> (Uploader, Lossy) {
    let (mut uploader, mut link) = (uploader, link);
    tokio::task::spawn_blocking(move || {
        upload_all(&mut uploader, &mut link, &db);
        (uploader, link)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stores_columns_are_filed_only_on_rows_it_holds_and_neither_side_overwrites_the_other() {
    let (schema, rules) = two_way_shop();
    let mut shop = Shop::new_with("two_way", &schema, &rules).await;
    let north = shop.store("north").await;
    let south = shop.store("south").await;
    shop.db
        .exec("INSERT INTO products (id, name, price, region) VALUES (1, 'tea', 2.50, 'north'), (2, 'rice', 1.00, 'south')")
        .await;
    let kept = order(&shop, north, "kept").await;
    let deleted = order(&shop, north, "deleted").await;
    let moved = order(&shop, north, "moved").await;
    shop.settle().await;
    shop.assert_converged().await;

    // The store has the columns it writes, empty, and one trigger per two-way table.
    let db = shop.dir.join(format!("{north}.db"));
    let app = rusqlite::Connection::open(&db).unwrap();
    app.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
    let (status, triggers): (Option<String>, i64) = app
        .query_row(
            "SELECT (SELECT status FROM orders WHERE id = ?1),
                    (SELECT count(*) FROM sqlite_schema WHERE type = 'trigger' AND tbl_name IN ('orders', 'products'))",
            [&kept],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((status, triggers), (None, 2));

    // The store picks an order and shelves a product: filed through a transport that
    // loses and repeats, on the server's rows, with the server's columns untouched.
    app.execute(
        "UPDATE orders SET status = 'picked', picked_at = 1700 WHERE id = ?1",
        [&kept],
    )
    .unwrap();
    app.execute("UPDATE products SET shelf = 'A3' WHERE id = 1", [])
        .unwrap();
    let link = Lossy::new(&shop, north, 5, 300);
    let uploader = Uploader::open(&db, shop.seal_keys[&north], north).unwrap();
    let (uploader, mut link) = upload(uploader, link, db.clone()).await;
    assert_eq!(
        server_order(&shop, &kept).await,
        (Some("picked".into()), Some(1700), Some("kept".into()))
    );
    let shelf: Option<String> = sqlx::query_scalar("SELECT shelf FROM products WHERE id = 1")
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert_eq!(shelf.as_deref(), Some("A3"));
    // Filing wrote only the store's columns, which the capture trigger does not watch:
    // nothing to send back down.
    let notes: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry_sync.notes")
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert_eq!(notes, 0, "filing a store's columns notes nothing");

    // The server edits its own column: the message down leaves the store's alone.
    sqlx::query("UPDATE orders SET note = 'rush' WHERE id = $1::uuid")
        .bind(&kept)
        .execute(&shop.db.pool)
        .await
        .unwrap();
    shop.settle().await;
    shop.assert_converged().await;
    let local: (String, Option<String>, Option<i64>) = app
        .query_row(
            "SELECT note, status, picked_at FROM orders WHERE id = ?1",
            [&kept],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(local, ("rush".into(), Some("picked".into()), Some(1700)));
    let standing: String =
        sqlx::query_scalar("SELECT standing FROM ferry_sync.replicas WHERE id = $1")
            .bind(north)
            .fetch_one(&shop.db.pool)
            .await
            .unwrap();
    assert_eq!(
        standing, "following",
        "the digests agree: no provisioning again"
    );

    // Edits the server cannot take: an order it deleted, one it gave another store
    // (recorded by a pass the store has not heard of), and one it never sent.
    app.execute_batch(&format!(
        "UPDATE orders SET status = 'picked' WHERE id IN ('{deleted}', '{moved}');
         INSERT INTO orders (id, store_id, note, placed_at) VALUES ('{}', '{north}', 'local', 'now');
         UPDATE orders SET status = 'picked' WHERE note = 'local';",
        Uuid::new_v4()
    ))
    .unwrap();
    sqlx::query("DELETE FROM orders WHERE id = $1::uuid")
        .bind(&deleted)
        .execute(&shop.db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE orders SET store_id = $2 WHERE id = $1::uuid")
        .bind(&moved)
        .bind(south)
        .execute(&shop.db.pool)
        .await
        .unwrap();
    shop.passes().await;
    link.fault = 0;
    let (uploader, link) = upload(uploader, link, db.clone()).await;
    let status = up_status(&app).unwrap();
    assert_eq!(
        (status.dropped, status.unfiled, status.set_aside),
        (3, 0, 0),
        "three edits dropped and said so; nothing left to send or set aside"
    );
    assert_eq!(
        server_order(&shop, &moved).await,
        (None, None, Some("moved".into())),
        "the order south now holds kept south's columns"
    );
    let local: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE note = 'local'")
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert_eq!(local, 0, "a row the store made up is not the server's");
    let shown: i64 = app
        .query_row(
            "SELECT count(*) FROM orders WHERE status IS NOT NULL AND id <> ?1",
            [&kept],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(
        shown, 0,
        "a dropped edit's columns go back to empty, as on a row held afresh"
    );
    app.execute("DELETE FROM orders WHERE note = 'local'", [])
        .unwrap();
    shop.settle().await;
    shop.assert_converged().await;

    // A store closed (retired: sent nothing more, its file kept) edits an order it still
    // has; the edit is dropped. Opened again, it is sent the order afresh by a snapshot
    // that keeps the row: it must not go on showing the edit the server never took (the
    // walk found a store showing such a status for good).
    shop.db
        .exec(&format!(
            "UPDATE stores SET open = false WHERE id = '{north}'"
        ))
        .await;
    shop.settle().await;
    app.execute("UPDATE orders SET status = 'packed' WHERE id = ?1", [&kept])
        .unwrap();
    let (_uploader, _link) = upload(uploader, link, db.clone()).await;
    assert_eq!(up_status(&app).unwrap().dropped, 4);
    shop.db
        .exec(&format!(
            "UPDATE stores SET open = true WHERE id = '{north}'"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    let local: Option<String> = app
        .query_row("SELECT status FROM orders WHERE id = ?1", [&kept], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(local, None, "the store holds the order afresh");
    assert_eq!(
        server_order(&shop, &kept).await.0.as_deref(),
        Some("picked"),
        "the server keeps what the store last filed"
    );
    shop.finish().await;
}
