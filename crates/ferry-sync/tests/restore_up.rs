//! The way up across a real server restore (docs/sync-up.md §6, guarantee 3): a
//! Postgres of the test's own is stopped and its data directory copied; a store files
//! more records; the copy is put back, so the server has lost those filings and its
//! filing count for the store is behind the store's. The store's check finds it, and its
//! journal brings every record back. Its own binary: it points FERRY_TEST_PG at its
//! private server.

mod common;

use common::up::{Lossy, RECORDS_RULES, RECORDS_SCHEMA, server_sales, upload_all};
use common::{SHOP_RULES, SHOP_SCHEMA, Shop};
use ferry_sync::replica::Uploader;
use ferry_testkit::servers::PrivatePg;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

async fn reconnect(url: &str) {
    for _ in 0..100 {
        if PgConnection::connect(url).await.is_ok() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the restarted Postgres did not answer");
}

/// `n` sales written by the store's app, in one transaction; their expected rows.
fn write_sales(
    db: &std::path::Path,
    store: Uuid,
    n: i64,
) -> std::collections::BTreeMap<String, (String, i64, Option<String>)> {
    let app = rusqlite::Connection::open(db).unwrap();
    app.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
    let mut out = std::collections::BTreeMap::new();
    app.execute_batch("BEGIN").unwrap();
    for i in 0..n {
        let id = Uuid::new_v4().to_string();
        app.execute(
            "INSERT INTO sales (id, store_id, amount) VALUES (?1, ?2, ?3)",
            rusqlite::params![id, store.to_string(), i],
        )
        .unwrap();
        out.insert(id, (store.to_string(), i, None));
    }
    app.execute_batch("COMMIT").unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_filed_after_the_backup_come_back_from_the_stores_journal() {
    let scratch =
        std::env::temp_dir().join(format!("ferry-sync-restore-up-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let pg = PrivatePg::start(&scratch);
    // SAFETY of the environment: this binary holds this one test.
    unsafe {
        std::env::set_var(
            "FERRY_TEST_PG",
            format!("postgres://postgres@127.0.0.1:{}", pg.port),
        )
    };
    let mut shop = Shop::new_with(
        "restore_up",
        &format!("{SHOP_SCHEMA}{RECORDS_SCHEMA}"),
        &format!("{SHOP_RULES}{RECORDS_RULES}"),
    )
    .await;
    let store = shop.store("north").await;
    shop.settle().await;
    let db = shop.dir.join(format!("{store}.db"));
    let link = Lossy::new(&shop, store, 3, 0);
    let uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    let mut expected = write_sales(&db, store, 20);
    let file_all = |mut uploader: Uploader, mut link: Lossy, check: bool| {
        let db = db.clone();
        tokio::task::spawn_blocking(move || {
            if check {
                uploader.check_server(&mut link).unwrap();
            }
            upload_all(&mut uploader, &mut link, &db);
            (uploader, link)
        })
    };
    let (uploader, link) = file_all(uploader, link, false).await.unwrap();
    assert_eq!(server_sales(&shop.db.pool).await, expected);

    // The backup.
    pg.down("fast");
    let backup = scratch.join("backup");
    common::copy_dir(&pg.data, &backup);
    pg.up();
    reconnect(&shop.db.url).await;

    // Records filed after the backup.
    expected.extend(write_sales(&db, store, 25));
    let (uploader, link) = file_all(uploader, link, false).await.unwrap();
    assert_eq!(server_sales(&shop.db.pool).await, expected);

    // The restore: the server has lost those 25 filings.
    pg.down("fast");
    common::copy_dir(&backup, &pg.data);
    pg.up();
    reconnect(&shop.db.url).await;
    assert_eq!(
        server_sales(&shop.db.pool).await.len(),
        20,
        "the restored server has only what the backup had"
    );
    let _ = file_all(uploader, link, true).await.unwrap();
    assert_eq!(
        server_sales(&shop.db.pool).await,
        expected,
        "every record is back, once"
    );
    shop.finish().await;
    drop(pg);
    let _ = std::fs::remove_dir_all(&scratch);
}
