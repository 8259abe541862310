//! Audiences (docs/sync-scale.md §1): two kinds of replica, a shop's till and its region's
//! back office, hold the same Postgres tables in different shapes from one relay. The
//! till holds the products on sale without their cost, its own orders with their lines
//! and customers; the back office holds every product of its region with its cost, and
//! the orders of its region's tills without the customer.
//!
//! Guards against: a row or a column of one audience reaching the other (the cost on a
//! till), one entry's held state or notes standing in for another's, closure reaching
//! into the other audience's shape, and a replica that changes audience keeping what its
//! old audience held (rows, or the server's columns it no longer sends).

mod common;

use common::{SHOP_SCHEMA, Shop};
use sqlx::Row;
use std::collections::{BTreeMap, BTreeSet};
use uuid::Uuid;

const RULES: &str = r#"
[replicas]
relation = "stores"
live = "open"
partition = "region"
audience = "kind"

[tables.till_products]
table = "products"
audience = "till"
sync = "broadcast"
partition = "region"
columns = ["id", "name", "price", "region"]
active = "products_on_sale"

[tables.office_products]
table = "products"
audience = "office"
sync = "broadcast"
partition = "region"

[tables.customers]

[tables.orders]
audience = "till"
sync = { assigned = "store_id" }

[tables.order_lines]
audience = "till"
sync = { follows = "order_id" }

[tables.office_orders]
table = "orders"
audience = "office"
columns = ["id", "store_id", "note"]
sync = { routed = { view = "office_orders", row = "order_id", replica = "office_id" } }

[tables.office_lines]
table = "order_lines"
audience = "office"
as = "order_lines"
sync = { follows = "order_id" }
"#;

fn schema() -> String {
    format!(
        "{SHOP_SCHEMA}
         ALTER TABLE stores ADD COLUMN kind text NOT NULL DEFAULT 'till';
         ALTER TABLE products ADD COLUMN cost numeric(10,2);
         CREATE VIEW products_on_sale AS SELECT id FROM products WHERE price IS NOT NULL;
         CREATE VIEW office_orders AS
           SELECT o.id AS order_id, b.id AS office_id FROM orders o
           JOIN stores t ON t.id = o.store_id JOIN stores b ON b.region = t.region AND b.kind = 'office';"
    )
}

async fn store(shop: &mut Shop, region: &str, kind: &str) -> Uuid {
    let id = shop.store(region).await;
    sqlx::query("UPDATE stores SET kind = $2 WHERE id = $1")
        .bind(id)
        .bind(kind)
        .execute(&shop.db.pool)
        .await
        .unwrap();
    id
}

/// Every synced table of store `id` as `table(column, ...)` → its rows in text form.
fn held(shop: &Shop, id: Uuid) -> BTreeMap<String, BTreeSet<String>> {
    let conn = shop.replicas[&id].conn();
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM _ferry_sync_tables ORDER BY name")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let mut out = BTreeMap::new();
    for table in tables {
        let columns: Vec<String> = conn
            .prepare(&format!(
                "SELECT name FROM pragma_table_info('{table}') ORDER BY cid"
            ))
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let select: Vec<String> = columns
            .iter()
            .map(|c| format!("coalesce(CAST(\"{c}\" AS TEXT), 'NULL')"))
            .collect();
        let rows: BTreeSet<String> = conn
            .prepare(&format!(
                "SELECT {} FROM \"{table}\"",
                select.join(" || '|' || ")
            ))
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        out.insert(format!("{table}({})", columns.join(",")), rows);
    }
    out
}

fn expect(tables: &[(&str, &[&str])]) -> BTreeMap<String, BTreeSet<String>> {
    tables
        .iter()
        .map(|(t, rows)| (t.to_string(), rows.iter().map(|r| r.to_string()).collect()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_till_and_a_back_office_hold_the_same_tables_in_their_own_shapes_from_one_relay() {
    let mut shop = Shop::new_with("audiences", &schema(), RULES).await;
    let till = store(&mut shop, "north", "till").await;
    let office = store(&mut shop, "north", "office").await;
    let south = store(&mut shop, "south", "till").await;
    let customer = Uuid::new_v4();
    let order = Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO products (id, name, price, region, cost) VALUES
               (1, 'tea', 2.50, 'north', 1.10), (2, 'rice', NULL, 'north', 0.50), (3, 'salt', 1.00, 'south', 0.20);
             INSERT INTO customers (id, name) VALUES ('{customer}', 'ada');
             INSERT INTO orders (id, store_id, customer_id, note) VALUES ('{order}', '{till}', '{customer}', 'first');
             INSERT INTO order_lines (order_id, line, product_id, qty) VALUES ('{order}', 1, 2, 3);"
        ))
        .await;
    shop.settle().await;

    let till_products = "products(id,name,price,region)";
    let till_orders = "orders(id,store_id,customer_id,note,placed_at)";
    let lines = "order_lines(order_id,line,product_id,qty)";
    let placed: String = sqlx::query_scalar(
        "SELECT to_char(placed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') FROM orders",
    )
    .fetch_one(&shop.db.pool)
    .await
    .unwrap();
    let till_order = format!("{order}|{till}|{customer}|first|{placed}");
    let line = format!("{order}|1|2|3");
    // The till: the product on sale, and rice only because its order line names it
    // (closure into the till's own shape: no cost); its order, line and customer.
    assert_eq!(
        held(&shop, till),
        expect(&[
            ("customers(id,name)", &[&format!("{customer}|ada")]),
            (lines, &[&line]),
            (till_orders, &[&till_order]),
            (till_products, &["1|tea|2.50|north", "2|rice|NULL|north"]),
        ])
    );
    // The back office: every product of its region with its cost; the region's orders
    // in its own shape (no customer, so no customer rows), with their lines.
    assert_eq!(
        held(&shop, office),
        expect(&[
            ("customers(id,name)", &[]),
            (lines, &[&line]),
            (
                "orders(id,store_id,note)",
                &[&format!("{order}|{till}|first")]
            ),
            (
                "products(id,name,price,region,cost)",
                &["1|tea|2.50|north|1.10", "2|rice|NULL|north|0.50"]
            ),
        ])
    );
    assert_eq!(
        held(&shop, south),
        expect(&[
            ("customers(id,name)", &[]),
            (lines, &[]),
            (till_orders, &[]),
            (till_products, &["3|salt|1.00|south"])
        ])
    );

    // Each entry keeps its own held state: one Postgres table, two names.
    let kept: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT relation FROM ferry_sync.rows WHERE relation LIKE 'public.products%' ORDER BY 1",
    )
    .fetch_all(&shop.db.pool)
    .await
    .unwrap();
    assert_eq!(kept, ["public.products@office", "public.products@till"]);

    // One write reaches both shapes; a cost change only the office's.
    shop.db
        .exec("UPDATE products SET price = 2.75, cost = 1.20 WHERE id = 1")
        .await;
    shop.settle().await;
    assert!(held(&shop, till)[till_products].contains("1|tea|2.75|north"));
    assert!(
        held(&shop, office)["products(id,name,price,region,cost)"]
            .contains("1|tea|2.75|north|1.20")
    );

    // Status says each replica's audience and counts only its own audience's tables.
    let status = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    for r in &status.replicas {
        let tables: Vec<&str> = r.tables.iter().map(|t| t.table.as_str()).collect();
        let audience = r.audience.as_deref().unwrap();
        assert!(
            tables
                .iter()
                .all(|t| !t.contains('@') || t.ends_with(&format!("@{audience}"))),
            "{audience}: {tables:?}"
        );
    }

    // The back office becomes a till: it starts again in the till's shape, and keeps
    // neither the office's rows nor the cost column the till's shape lacks.
    sqlx::query("UPDATE stores SET kind = 'till' WHERE id = $1")
        .bind(office)
        .execute(&shop.db.pool)
        .await
        .unwrap();
    shop.settle().await;
    assert_eq!(
        held(&shop, office),
        expect(&[
            ("customers(id,name)", &[]),
            (lines, &[]),
            ("orders(id,store_id,note,customer_id,placed_at)", &[]),
            (till_products, &["1|tea|2.75|north"]),
        ])
    );
    let audience: Option<String> =
        sqlx::query("SELECT audience FROM ferry_sync.replicas WHERE id = $1")
            .bind(office)
            .fetch_one(&shop.db.pool)
            .await
            .unwrap()
            .get(0);
    assert_eq!(audience.as_deref(), Some("till"));
    shop.finish().await;
}

/// A table every replica held is split into an entry per audience by a rules change: the
/// old entry's state goes, and every replica starts again in its audience's shape (a till
/// must not keep a row its entry's `active` view hides).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_split_into_audiences_leaves_no_row_or_state_of_the_old_entry() {
    let before = RULES
        .split("[tables.till_products]")
        .next()
        .unwrap()
        .to_string()
        + "[tables.products]\nsync = \"broadcast\"\npartition = \"region\"\n";
    let mut shop = Shop::new_with("audience_split", &schema(), &before).await;
    let till = store(&mut shop, "north", "till").await;
    shop.db
        .exec("INSERT INTO products (id, name, price, region, cost) VALUES (1, 'tea', 2.50, 'north', 1.10), (2, 'rice', NULL, 'north', 0.50)")
        .await;
    shop.settle().await;
    assert_eq!(
        held(&shop, till)["products(id,name,price,region,cost)"].len(),
        2
    );

    shop.spec = shop.install(RULES).await;
    shop.relay = ferry_sync::relay::Relay::new(shop.spec.clone(), Default::default());
    shop.settle().await;
    assert_eq!(
        held(&shop, till)["products(id,name,price,region)"],
        BTreeSet::from(["1|tea|2.50|north".to_string()])
    );
    let status = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    let tables: Vec<&str> = status.replicas[0]
        .tables
        .iter()
        .map(|t| t.table.as_str())
        .collect();
    assert!(!tables.contains(&"public.products"), "{tables:?}");
    let old: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ferry_sync.rows WHERE relation = 'public.products'",
    )
    .fetch_one(&shop.db.pool)
    .await
    .unwrap();
    assert_eq!(old, 0);
    shop.finish().await;
}
