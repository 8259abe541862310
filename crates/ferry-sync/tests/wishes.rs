//! Settings and wishes (docs/sync-up.md §7): a store owns its setting rows and files them
//! like records (the newer version wins); the server wishes values for their desired
//! columns inside its own transaction; the store carries each wish out after the message
//! commits and answers applied, refused, superseded or waiting, and the answer is filed.
//!
//! Guards against: a wish applied twice or under a stale version, a wish lost when a newer
//! one replaces it, a refused or waiting answer mistaken for applied, and a wish the
//! server cannot check (unknown table or column) written at all.

mod common;

use common::up::{Lossy, SETTINGS_RULES, SETTINGS_SCHEMA, one_store_shop, upload_all};
use common::{SHOP_RULES, SHOP_SCHEMA, Shop};
use ferry_sync::replica::{CarryOut, Outcome, Round, Uploader, Wish};
use ferry_sync::wish;
use serde_json::json;
use uuid::Uuid;

/// Refuses a volume over 10; applies the rest.
struct Careful;

impl CarryOut for Careful {
    fn carry_out(&mut self, wish: &Wish) -> Outcome {
        match wish.values.get("volume") {
            Some(ferry_sync::value::Value::Int(v)) if *v > 10 => {
                Outcome::Refused(format!("volume {v} is too loud for a shop"))
            }
            _ => Outcome::Applied,
        }
    }
}

async fn states(shop: &Shop, store: Uuid) -> Vec<(String, String, Option<String>)> {
    let mut conn = shop.db.pool.acquire().await.unwrap();
    wish::wishes(&mut conn, Some(store))
        .await
        .unwrap()
        .into_iter()
        .map(|w| (w.key, w.state, w.reason))
        .collect()
}

async fn server_setting(shop: &Shop, name: &str) -> Option<(Option<String>, Option<i64>, i64)> {
    sqlx::query_as("SELECT price_list, volume, rev FROM till_settings WHERE name = $1")
        .bind(name)
        .fetch_optional(&shop.db.pool)
        .await
        .unwrap()
}

/// The server wishes `values` onto the store's till setting row `key`, on a connection
/// of its own.
async fn wish_till(
    shop: &Shop,
    store: Uuid,
    key: &serde_json::Value,
    values: serde_json::Value,
    if_version: Option<i64>,
) -> i64 {
    let mut conn = shop.db.pool.acquire().await.unwrap();
    wish::wish(
        &mut conn,
        store,
        "till_settings",
        key,
        &values,
        if_version,
        None,
    )
    .await
    .unwrap()
}

/// The store offers its wishes to its handler once (no delivery, no upload).
fn carry_out(shop: &mut Shop, store: Uuid) -> Round {
    shop.replicas
        .get_mut(&store)
        .unwrap()
        .carry_out_wishes()
        .unwrap()
}

/// Delivers, carries wishes out on the store, and uploads until nothing is unfiled.
async fn round_trip(
    shop: &mut Shop,
    store: Uuid,
    link: Lossy,
    uploader: Uploader,
) -> (Round, Lossy, Uploader) {
    shop.settle().await;
    let round = carry_out(shop, store);
    let db = shop.dir.join(format!("{store}.db"));
    let (mut link, mut uploader) = (link, uploader);
    let (link, uploader) = tokio::task::spawn_blocking(move || {
        upload_all(&mut uploader, &mut link, &db);
        (link, uploader)
    })
    .await
    .unwrap();
    shop.settle().await;
    (round, link, uploader)
}

/// The shop with the till settings and one store in `north`, provisioned, whose till
/// opened at price list `spring` and volume 5, version 1: the store, its file, and the
/// app's connection to it.
async fn till_shop(prefix: &str) -> (Shop, Uuid, std::path::PathBuf, rusqlite::Connection) {
    let (shop, store, db, app) = one_store_shop(prefix, SETTINGS_SCHEMA, SETTINGS_RULES).await;
    app.execute(
        "INSERT INTO till_settings (store_id, name, price_list, volume, rev) VALUES (?1, 'till', 'spring', 5, 1)",
        [store.to_string()],
    )
    .unwrap();
    (shop, store, db, app)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wish_is_carried_out_once_and_its_answer_filed_applied_refused_superseded_or_waiting() {
    let (mut shop, store, db, app) = till_shop("wishes").await;
    let link = Lossy::new(&shop, store, 28, 300);
    let uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    let (_, link, uploader) = round_trip(&mut shop, store, link, uploader).await;
    assert_eq!(
        server_setting(&shop, "till").await,
        Some((Some("spring".into()), Some(5), 1))
    );

    // The server wishes summer prices, in a transaction of its own that writes
    // something else too: both commit together.
    let till = json!([store, "till"]);
    let mut tx = shop.db.pool.begin().await.unwrap();
    sqlx::query("UPDATE products SET price = 3 WHERE false")
        .execute(&mut *tx)
        .await
        .unwrap();
    wish::wish(
        &mut tx,
        store,
        "till_settings",
        &till,
        &json!({"price_list": "summer"}),
        None,
        Some("summer prices"),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(states(&shop, store).await[0].1, "pending");
    let (round, link, uploader) = round_trip(&mut shop, store, link, uploader).await;
    assert_eq!(round.applied, 1);
    assert_eq!(
        server_setting(&shop, "till").await,
        Some((Some("summer".into()), Some(5), 2)),
        "the store wrote the wished column, raised the version, and filed the row"
    );
    assert_eq!(states(&shop, store).await[0].1, "applied");
    // Offered again, an applied wish is left alone.
    assert_eq!(carry_out(&mut shop, store), Round::default());

    // A newer wish after an applied one is answered for its own number and applied once:
    // the answer recorded for the older one is no answer to it (the walk found a newer
    // wish applied again every round, raising the version each time).
    wish_till(&shop, store, &till, json!({"price_list": "autumn"}), None).await;
    let (round, link, uploader) = round_trip(&mut shop, store, link, uploader).await;
    assert_eq!(round.applied, 1);
    assert_eq!(
        server_setting(&shop, "till").await,
        Some((Some("autumn".into()), Some(5), 3))
    );
    assert_eq!(states(&shop, store).await[0].1, "applied");
    assert_eq!(carry_out(&mut shop, store), Round::default());

    // A wish for version 1, which the row has left: superseded, nothing written.
    wish_till(&shop, store, &till, json!({"volume": 7}), Some(1)).await;
    let (round, link, uploader) = round_trip(&mut shop, store, link, uploader).await;
    assert_eq!(round.superseded, 1);
    assert_eq!(server_setting(&shop, "till").await.unwrap().1, Some(5));
    let s = states(&shop, store).await;
    assert_eq!(s[0].1, "superseded");
    assert!(s[0].2.as_deref().unwrap().contains("version is 3"), "{s:?}");

    // The host's handler refuses a loud volume; a newer wish replaces one not yet carried
    // out, and only the newer is carried out.
    shop.replicas
        .get_mut(&store)
        .unwrap()
        .set_wish_handler(Box::new(Careful));
    wish_till(&shop, store, &till, json!({"volume": 8}), None).await;
    wish_till(&shop, store, &till, json!({"volume": 50}), None).await;
    // A wish for a row the store has not made yet waits until it does.
    let kiosk = json!([store, "kiosk"]);
    wish_till(&shop, store, &kiosk, json!({"price_list": "kiosk"}), None).await;
    let (round, link, uploader) = round_trip(&mut shop, store, link, uploader).await;
    assert_eq!((round.refused, round.waiting, round.applied), (1, 1, 0));
    assert_eq!(server_setting(&shop, "till").await.unwrap().1, Some(5));
    let s = states(&shop, store).await;
    assert_eq!(s.len(), 2);
    let (kiosk_state, till_state) = if s[0].0.contains("kiosk") {
        (&s[0], &s[1])
    } else {
        (&s[1], &s[0])
    };
    assert_eq!(till_state.1, "refused");
    assert!(till_state.2.as_deref().unwrap().contains("too loud"));
    assert_eq!(kiosk_state.1, "waiting");
    assert_eq!(kiosk_state.2.as_deref(), Some("the row does not exist yet"));

    app.execute(
        "INSERT INTO till_settings (store_id, name, rev) VALUES (?1, 'kiosk', 1)",
        [store.to_string()],
    )
    .unwrap();
    let (round, _link, _uploader) = round_trip(&mut shop, store, link, uploader).await;
    assert_eq!(round.applied, 1);
    assert_eq!(
        server_setting(&shop, "kiosk").await,
        Some((Some("kiosk".into()), None, 2))
    );
    let s = states(&shop, store).await;
    assert!(
        s.iter()
            .all(|(k, state, _)| !k.contains("kiosk") || state == "applied"),
        "{s:?}"
    );

    // Withdrawn: the store's copy goes, and nothing stands.
    let mut conn = shop.db.pool.acquire().await.unwrap();
    assert!(
        wish::withdraw(&mut conn, store, "till_settings", &kiosk)
            .await
            .unwrap()
    );
    assert!(
        !wish::withdraw(&mut conn, store, "till_settings", &kiosk)
            .await
            .unwrap()
    );
    drop(conn);
    shop.settle().await;
    let left: i64 = app
        .query_row("SELECT count(*) FROM ferry_wishes", [], |r| r.get(0))
        .unwrap();
    assert_eq!(left, 1);
    shop.assert_converged().await;
    shop.finish().await;
}

/// docs/sync-up.md §7: a new chain (here a store restored from an older copy, as after a
/// server restore every store gets) states the store's settings and answers again, and
/// they win whatever their version: the server's copy is the store's again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_and_answers_are_stated_again_on_a_new_chain_and_win_whatever_their_version() {
    let (mut shop, store, db, app) = till_shop("wishes_restate").await;
    let till = json!([store, "till"]);
    wish_till(&shop, store, &till, json!({"volume": 6}), None).await;
    let link = Lossy::new(&shop, store, 7, 0);
    let uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    let (round, link, uploader) = round_trip(&mut shop, store, link, uploader).await;
    assert_eq!(round.applied, 1);
    assert_eq!(
        server_setting(&shop, "till").await,
        Some((Some("spring".into()), Some(6), 2))
    );
    assert_eq!(states(&shop, store).await[0].1, "applied");

    // A backup of the store's file; then the server loses the answer (as a restore of
    // the server would), the store writes on, which is filed, and applies a message.
    let backup = shop.dir.join("backup.db");
    app.execute("VACUUM INTO ?1", [backup.to_str().unwrap()])
        .unwrap();
    shop.db
        .exec("UPDATE ferry_sync.wishes SET answered = NULL, outcome = NULL")
        .await;
    assert_eq!(states(&shop, store).await[0].1, "pending");
    app.execute(
        "UPDATE till_settings SET price_list = 'autumn', rev = 3 WHERE name = 'till'",
        [],
    )
    .unwrap();
    shop.db
        .exec("INSERT INTO products (id, name, price, region) VALUES (1, 'tea', 2.50, 'north')")
        .await;
    let (_, link, uploader) = round_trip(&mut shop, store, link, uploader).await;
    assert_eq!(
        server_setting(&shop, "till").await,
        Some((Some("autumn".into()), Some(6), 3))
    );

    // The store's file is restored from the backup: it is provisioned again, states its
    // setting (version 2, below the server's 3) and its answer, and both win.
    drop((app, uploader, link));
    drop(shop.replicas.remove(&store));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", db.display()));
    }
    std::fs::copy(&backup, &db).unwrap();
    shop.reopen(store);
    let link = Lossy::new(&shop, store, 8, 300);
    let uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    let (round, _link, _uploader) = round_trip(&mut shop, store, link, uploader).await;
    assert_eq!(
        round,
        Round::default(),
        "the restored copy had answered the wish"
    );
    assert_eq!(
        server_setting(&shop, "till").await,
        Some((Some("spring".into()), Some(6), 2)),
        "the store's setting as it stands, whatever its version"
    );
    assert_eq!(states(&shop, store).await[0].1, "applied");
    shop.assert_converged().await;
    shop.finish().await;
}

/// A wish the server cannot check is refused where it is made, and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wish_for_an_unknown_table_key_or_column_is_refused_and_writes_nothing() {
    let shop = Shop::new_with(
        "wishes_refused",
        &format!("{SHOP_SCHEMA}{SETTINGS_SCHEMA}"),
        &format!("{SHOP_RULES}{SETTINGS_RULES}"),
    )
    .await;
    let store = Uuid::new_v4();
    let mut conn = shop.db.pool.acquire().await.unwrap();
    for (setting, key, values, needle) in [
        (
            "orders",
            json!([1]),
            json!({"note": "x"}),
            "is not a setting table (the rules name: till_settings)",
        ),
        (
            "till_settings",
            json!(["only-one"]),
            json!({"volume": 1}),
            "JSON array of 2 values",
        ),
        (
            "till_settings",
            json!([store, "till"]),
            json!({"rev": 9}),
            "rev is not a desired column",
        ),
        (
            "till_settings",
            json!([store, "till"]),
            json!({}),
            "a JSON object of desired columns",
        ),
    ] {
        let e = wish::wish(&mut conn, store, setting, &key, &values, None, None)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains(needle),
            "{setting} {key} {values}: {e}"
        );
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry_sync.wishes")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(n, 0);
    drop(conn);
    shop.finish().await;
}

/// `check` on a database without the schema reads the wishes table the rules mirror from
/// a schema it creates and rolls back: it reports, and leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_before_install_reports_the_wishes_table_and_leaves_nothing() {
    let db = common::TestDb::new("wishes_check").await;
    db.exec(&format!("{SHOP_SCHEMA}{SETTINGS_SCHEMA}")).await;
    let rules =
        ferry_sync::rules::Rules::parse(&format!("{SHOP_RULES}{SETTINGS_RULES}"), "rules.toml")
            .unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    let report = ferry_sync::schema::check(&mut conn, &rules).await.unwrap();
    assert!(!report.is_installed());
    assert!(
        report.to_string().contains("ferry_sync.wishes"),
        "the wishes table's capture trigger is among what install would run"
    );
    let schema: Option<String> = sqlx::query_scalar("SELECT to_regnamespace('ferry_sync')::text")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    assert_eq!(schema, None);
    drop(conn);
    db.drop_db().await;
}
