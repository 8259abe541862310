//! `grouped` and `routed` tables (docs/sync.md §3): rows follow group membership and
//! assignment, and whatever a routing view says, as they change.

mod common;

use std::collections::BTreeSet;

use common::Shop;
use sqlx::Row;
use uuid::Uuid;

const SCHEMA: &str = "
CREATE TABLE stores (id uuid PRIMARY KEY, region text NOT NULL, open bool NOT NULL DEFAULT true);
CREATE TABLE tags (id int8 PRIMARY KEY, label text NOT NULL);
CREATE TABLE tag_members (tag_id int8 REFERENCES tags ON DELETE CASCADE, group_id int8, PRIMARY KEY (tag_id, group_id));
CREATE TABLE group_stores (group_id int8, store_id uuid, PRIMARY KEY (group_id, store_id));
CREATE TABLE notices (id int8 PRIMARY KEY, body text NOT NULL, audience text NOT NULL);
CREATE TABLE notice_targets (region text NOT NULL, audience text NOT NULL);
CREATE VIEW notice_routes AS
  SELECT n.id AS notice_id, s.id AS store_id FROM notices n
  JOIN notice_targets t ON t.audience = n.audience JOIN stores s ON s.region = t.region;
";

const RULES: &str = r#"
[replicas]
relation = "stores"
live = "open"

[tables.tags]
sync = { grouped = { members = "tag_members", row = "tag_id", group = "group_id", assigned = "group_stores", replica = "store_id" } }

[tables.notices]
sync = { routed = { view = "notice_routes", row = "notice_id", replica = "store_id" } }
"#;

async fn expected(shop: &Shop, store: Uuid) -> (BTreeSet<String>, BTreeSet<String>) {
    let tags = sqlx::query(
        "SELECT t.id::text || '|' || t.label FROM tags t WHERE t.id IN
           (SELECT m.tag_id FROM tag_members m JOIN group_stores g USING (group_id) WHERE g.store_id = $1)",
    )
    .bind(store)
    .fetch_all(&shop.db.pool)
    .await
    .unwrap();
    let notices = sqlx::query(
        "SELECT n.id::text || '|' || n.body FROM notices n WHERE n.id IN (SELECT notice_id FROM notice_routes WHERE store_id = $1)",
    )
    .bind(store)
    .fetch_all(&shop.db.pool)
    .await
    .unwrap();
    (
        tags.iter().map(|r| r.get::<String, _>(0)).collect(),
        notices.iter().map(|r| r.get::<String, _>(0)).collect(),
    )
}

fn held(shop: &Shop, store: Uuid) -> (BTreeSet<String>, BTreeSet<String>) {
    let conn = shop.replicas[&store].conn();
    let read = |sql: &str| -> BTreeSet<String> {
        let exists: bool = conn
            .query_row(
                "SELECT count(*) > 0 FROM sqlite_master WHERE name = ?1",
                [sql.split_whitespace().last().unwrap()],
                |r| r.get(0),
            )
            .unwrap();
        if !exists {
            return BTreeSet::new();
        }
        let mut stmt = conn.prepare(sql).unwrap();
        stmt.query_map([], |r| {
            Ok(format!(
                "{}|{}",
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?
            ))
        })
        .unwrap()
        .map(Result::unwrap)
        .collect()
    };
    (
        read("SELECT id, label FROM tags"),
        read("SELECT id, body FROM notices"),
    )
}

async fn assert_routed(shop: &Shop, stores: &[Uuid]) {
    for s in stores {
        assert_eq!(held(shop, *s), expected(shop, *s).await, "store {s}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_and_routed_rows_follow_membership_assignment_and_the_view() {
    let mut shop = Shop::new_with("routes", SCHEMA, RULES).await;
    let a = shop.store("north").await;
    let b = shop.store("south").await;
    shop.db
        .exec(&format!(
            "INSERT INTO tags VALUES (1, 'red'), (2, 'blue'), (3, 'green');
             INSERT INTO tag_members VALUES (1, 10), (2, 10), (3, 20);
             INSERT INTO group_stores VALUES (10, '{a}'), (20, '{b}');
             INSERT INTO notices VALUES (1, 'to all', 'all'), (2, 'to the north', 'north');
             INSERT INTO notice_targets VALUES ('north', 'all'), ('south', 'all'), ('north', 'north');"
        ))
        .await;
    shop.settle().await;
    assert_routed(&shop, &[a, b]).await;
    assert_eq!(held(&shop, b).0.len(), 1, "b holds group 20's one tag");

    // Membership and assignment change.
    shop.db
        .exec(&format!(
            "INSERT INTO tag_members VALUES (3, 10);
             DELETE FROM group_stores WHERE group_id = 20; INSERT INTO group_stores VALUES (20, '{a}');
             UPDATE tags SET label = 'crimson' WHERE id = 1;"
        ))
        .await;
    shop.settle().await;
    assert_routed(&shop, &[a, b]).await;
    assert!(held(&shop, b).0.is_empty(), "b's only group went to a");

    // What the view reads changes.
    shop.db
        .exec("INSERT INTO notice_targets VALUES ('south', 'north'); DELETE FROM notice_targets WHERE region = 'north' AND audience = 'all';")
        .await;
    shop.settle().await;
    assert_routed(&shop, &[a, b]).await;
    assert_eq!(held(&shop, b).1.len(), 2);
    assert_eq!(held(&shop, a).1.len(), 1);

    // A late store gets what its groups and the view give it.
    let c = shop.store("south").await;
    shop.db
        .exec(&format!("INSERT INTO group_stores VALUES (10, '{c}')"))
        .await;
    shop.settle().await;
    assert_routed(&shop, &[a, b, c]).await;
    shop.finish().await;
}
