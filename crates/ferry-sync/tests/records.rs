//! The way up for record tables (docs/sync-up.md): a store's writes to a table it
//! writes reach the server's table once, through a transport that fails before filing,
//! repeats a filing and loses answers; edits follow the table's rule (first wins, or
//! newer version wins); deletes of the store's own rows are filed; a row naming another
//! store is set aside; and a server that lost filings gets them again from the journal.
//!
//! Guards against: a note forgotten without a Filed (a row lost), a row filed twice or
//! under the wrong store, a stale edit overwriting a newer one, and filings lost to a
//! restore.

mod common;

use std::collections::BTreeMap;

use common::up::{Lossy, RECORDS_RULES, RECORDS_SCHEMA, records_shop, server_sales, upload_all};
use common::{SHOP_RULES, SHOP_SCHEMA, Shop};
use ferry_sync::file::{self, Shape};
use ferry_sync::replica::{Uploader, up_status};
use sqlx::Connection;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_write_is_filed_once_through_lost_and_repeated_answers_and_a_lost_filing_comes_back()
{
    let (shop, store, db, app) = records_shop("records").await;
    // The snapshot created the tables the store writes, with their triggers.
    let triggers: i64 = app
        .query_row(
            "SELECT count(*) FROM sqlite_schema WHERE type = 'trigger' AND tbl_name IN ('sales', 'counters')",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(triggers, 6, "three triggers per table the store writes");

    let mut link = Lossy::new(&shop, store, 27, 300);
    let mut uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();

    // 200 sales in 20 transactions, each row written twice before it goes up; an upload
    // after each transaction, so the transport's faults hit many uploads.
    let mut expected = BTreeMap::new();
    for batch in 0..20 {
        app.execute_batch("BEGIN").unwrap();
        for i in 0..10 {
            let id = Uuid::new_v4().to_string();
            let amount = batch * 10 + i;
            app.execute(
                "INSERT INTO sales (id, store_id, amount, note) VALUES (?1, ?2, ?3, 'first')",
                rusqlite::params![id, store.to_string(), amount],
            )
            .unwrap();
            app.execute("UPDATE sales SET note = 'kept' WHERE id = ?1", [&id])
                .unwrap();
            expected.insert(id, (store.to_string(), amount, Some("kept".to_string())));
        }
        app.execute_batch("COMMIT").unwrap();
        let db = db.clone();
        (uploader, link) = tokio::task::spawn_blocking(move || {
            upload_all(&mut uploader, &mut link, &db);
            (uploader, link)
        })
        .await
        .unwrap();
    }
    assert_eq!(
        server_sales(&shop.db.pool).await,
        expected,
        "each sale filed once, as written"
    );
    assert!(
        link.filings > 20,
        "some uploads were filed twice: {}",
        link.filings
    );

    // A sale without a version is history: an edit after filing changes nothing; a
    // delete of the store's own row is filed.
    let (edited, deleted) = {
        let mut keys = expected.keys();
        (keys.next().unwrap().clone(), keys.next().unwrap().clone())
    };
    app.execute("UPDATE sales SET amount = -1 WHERE id = ?1", [&edited])
        .unwrap();
    app.execute("DELETE FROM sales WHERE id = ?1", [&deleted])
        .unwrap();
    expected.remove(&deleted);
    // Counters carry a version: the newer wins, whatever order the uploads file in.
    app.execute_batch(
        "INSERT INTO counters VALUES ('tills', 1, '10.50'); UPDATE counters SET rev = 2, total = '11.00';",
    )
    .unwrap();
    let (mut uploader, mut link) = tokio::task::spawn_blocking(move || {
        upload_all(&mut uploader, &mut link, &db);
        (uploader, link)
    })
    .await
    .unwrap();
    let db = shop.dir.join(format!("{store}.db"));
    assert_eq!(
        server_sales(&shop.db.pool).await,
        expected,
        "the edit ignored, the delete filed"
    );
    let counter: (i64, String) = sqlx::query_as("SELECT rev, total::text FROM counters")
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert_eq!(counter, (2, "11.00".to_string()));

    // The server loses filings (what a restore from an older copy does to these
    // tables): the rows filed after count k, and its count falls back to k.
    let k: i64 = sqlx::query_scalar("SELECT n FROM ferry_sync.filings WHERE replica = $1")
        .bind(store)
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    let mut later = BTreeMap::new();
    app.execute_batch("BEGIN").unwrap();
    for i in 0..30 {
        let id = Uuid::new_v4().to_string();
        app.execute(
            "INSERT INTO sales (id, store_id, amount) VALUES (?1, ?2, ?3)",
            rusqlite::params![id, store.to_string(), 1_000 + i],
        )
        .unwrap();
        later.insert(id.clone(), (store.to_string(), 1_000 + i, None));
    }
    app.execute_batch("COMMIT").unwrap();
    expected.extend(later.clone());
    link.fault = 0;
    let (mut uploader, mut link) = tokio::task::spawn_blocking(move || {
        upload_all(&mut uploader, &mut link, &db);
        (uploader, link)
    })
    .await
    .unwrap();
    assert_eq!(server_sales(&shop.db.pool).await, expected);
    let ids: Vec<Uuid> = later.keys().map(|k| k.parse().unwrap()).collect();
    sqlx::query("DELETE FROM sales WHERE id = ANY($1)")
        .bind(&ids)
        .execute(&shop.db.pool)
        .await
        .unwrap();
    sqlx::query("UPDATE ferry_sync.filings SET n = $2 WHERE replica = $1")
        .bind(store)
        .bind(k)
        .execute(&shop.db.pool)
        .await
        .unwrap();
    let db = shop.dir.join(format!("{store}.db"));
    let (_, _) = tokio::task::spawn_blocking(move || {
        // With nothing to send, the check (an empty upload) finds the server behind, and
        // the journal after its count goes up again.
        uploader.check_server(&mut link).unwrap();
        upload_all(&mut uploader, &mut link, &db);
        (uploader, link)
    })
    .await
    .unwrap();
    assert_eq!(
        server_sales(&shop.db.pool).await,
        expected,
        "the filings the server lost came back from the store's journal"
    );
    shop.finish().await;
}

/// docs/sync-up.md §1, guarantee 2: a row naming another store is refused for good and
/// set aside on the replica, while the rest of its upload is filed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_naming_another_store_is_set_aside_and_the_rest_filed() {
    let (shop, store, db, app) = records_shop("records_aside").await;
    let other = Uuid::new_v4();
    let (mine, theirs) = (Uuid::new_v4(), Uuid::new_v4());
    app.execute(
        "INSERT INTO sales (id, store_id, amount) VALUES (?1, ?2, 1), (?3, ?4, 2)",
        rusqlite::params![
            mine.to_string(),
            store.to_string(),
            theirs.to_string(),
            other.to_string()
        ],
    )
    .unwrap();
    let mut link = Lossy::new(&shop, store, 1, 0);
    let mut uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    let status = tokio::task::spawn_blocking(move || {
        upload_all(&mut uploader, &mut link, &db);
        up_status(&app).unwrap()
    })
    .await
    .unwrap();
    assert_eq!((status.unfiled, status.set_aside), (0, 1), "{status:?}");
    let filed = server_sales(&shop.db.pool).await;
    assert_eq!(
        filed.keys().cloned().collect::<Vec<_>>(),
        vec![mine.to_string()]
    );
    shop.finish().await;
}

/// docs/sync-up.md §5.2: a row the server's database refuses (here a CHECK a deploy will
/// drop) waits in the inbox, answered, while the rest of its upload is filed; after the
/// fix, refiling files it and empties the inbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_database_refuses_waits_in_the_inbox_and_is_filed_after_the_fix() {
    let mut shop = Shop::new_with(
        "records_inbox",
        &format!("{SHOP_SCHEMA}{RECORDS_SCHEMA}"),
        &format!("{SHOP_RULES}{RECORDS_RULES}"),
    )
    .await;
    let store = shop.store("north").await;
    shop.settle().await;
    shop.db
        .exec("ALTER TABLE sales ADD CONSTRAINT no_refunds CHECK (amount >= 0)")
        .await;
    let db = shop.dir.join(format!("{store}.db"));
    let app = rusqlite::Connection::open(&db).unwrap();
    let (good, refund) = (Uuid::new_v4(), Uuid::new_v4());
    app.execute(
        "INSERT INTO sales (id, store_id, amount) VALUES (?1, ?3, 10), (?2, ?3, -5)",
        rusqlite::params![good.to_string(), refund.to_string(), store.to_string()],
    )
    .unwrap();
    let mut link = Lossy::new(&shop, store, 2, 0);
    let mut uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    let status = tokio::task::spawn_blocking(move || {
        upload_all(&mut uploader, &mut link, &db);
        up_status(&app).unwrap()
    })
    .await
    .unwrap();
    assert_eq!(
        (status.unfiled, status.set_aside),
        (0, 0),
        "answered: {status:?}"
    );
    let filed = server_sales(&shop.db.pool).await;
    assert_eq!(
        filed.keys().cloned().collect::<Vec<_>>(),
        vec![good.to_string()]
    );
    let (key, reason): (String, String) =
        sqlx::query_as("SELECT key, reason FROM ferry_sync.inbox WHERE replica = $1")
            .bind(store)
            .fetch_one(&shop.db.pool)
            .await
            .unwrap();
    assert_eq!(key, refund.to_string());
    assert!(reason.contains("no_refunds"), "{reason}");

    // Refiling before the fix keeps it, with a try counted; after it, files it.
    let mut conn = shop.db.pool.acquire().await.unwrap();
    let records = shop.spec.records.clone();
    let before = file::refile(&mut conn, &records, &Shape::default())
        .await
        .unwrap();
    assert_eq!((before.filed, before.still_refused), (0, 1));
    shop.db
        .exec("ALTER TABLE sales DROP CONSTRAINT no_refunds")
        .await;
    let after = file::refile(&mut conn, &records, &Shape::default())
        .await
        .unwrap();
    assert_eq!((after.filed, after.still_refused), (1, 0));
    drop(conn);
    assert_eq!(server_sales(&shop.db.pool).await.len(), 2);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry_sync.inbox")
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
    shop.finish().await;
}

/// Fault 12 of `../shared/research/sync.md` §5.2, the way up: the rules change what the
/// stores write (a column added to a record table, a record table added). Install notes
/// it, the next pass announces the tables to every store in its next message, and the
/// stores write the new column and table at once: nobody is provisioned again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_12_a_column_and_a_table_the_stores_write_reach_them_without_provisioning() {
    let mut shop = Shop::new_with(
        "records_change",
        &format!("{SHOP_SCHEMA}{RECORDS_SCHEMA}"),
        &format!("{SHOP_RULES}{RECORDS_RULES}"),
    )
    .await;
    let store = shop.store("north").await;
    shop.db
        .exec("INSERT INTO products (id, name, price, region) VALUES (1, 'tea', 2.50, 'north')")
        .await;
    shop.settle().await;
    let seq = shop.replicas[&store].status().unwrap().seq;

    shop.db
        .exec(
            "ALTER TABLE sales ADD COLUMN channel text;
             CREATE TABLE returns (id uuid PRIMARY KEY, store_id uuid, sale_id uuid NOT NULL);",
        )
        .await;
    let rules_text = format!(
        "{SHOP_RULES}{RECORDS_RULES}\n[tables.returns]\nmirror = \"record\"\nreplica = \"store_id\"\n"
    );
    let spec = shop.install(&rules_text).await;
    // A relay still running the old rules leaves the announcement to the new one.
    let stale = shop.relay.pass(&mut shop.lock).await.unwrap();
    let waiting: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ferry_sync.notes WHERE kind = 'announce'")
            .fetch_one(&shop.db.pool)
            .await
            .unwrap();
    assert_eq!((stale.messages, waiting), (0, 1));
    // The serve process restarts with the installed rules.
    shop.spec = spec;
    shop.relay = ferry_sync::relay::Relay::new(shop.spec.clone(), Default::default());
    let pass = shop.relay.pass(&mut shop.lock).await.unwrap();
    assert_eq!(
        (pass.provisioned, pass.messages),
        (0, 1),
        "one message, to the one store, and no provisioning"
    );
    shop.settle().await;
    let status = shop.replicas[&store].status().unwrap();
    assert_eq!(status.seq, seq + 1, "the chain went on: {status:?}");

    let db = shop.dir.join(format!("{store}.db"));
    let app = rusqlite::Connection::open(&db).unwrap();
    let (sale, ret) = (Uuid::new_v4(), Uuid::new_v4());
    app.execute_batch(&format!(
        "INSERT INTO sales (id, store_id, amount, channel) VALUES ('{sale}', '{store}', 7, 'web');
         INSERT INTO returns (id, store_id, sale_id) VALUES ('{ret}', '{store}', '{sale}');"
    ))
    .unwrap();
    let mut link = Lossy::new(&shop, store, 12, 300);
    let mut uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    tokio::task::spawn_blocking(move || upload_all(&mut uploader, &mut link, &db))
        .await
        .unwrap();
    let channel: Option<String> = sqlx::query_scalar("SELECT channel FROM sales WHERE id = $1")
        .bind(sale)
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert_eq!(channel.as_deref(), Some("web"));
    let returned: Uuid = sqlx::query_scalar("SELECT sale_id FROM returns WHERE id = $1")
        .bind(ret)
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert_eq!(returned, sale);
    shop.assert_converged().await;
    shop.finish().await;
}

/// docs/sync-up.md §1 (a chatty table does not hold up the others): with thousands of
/// sales waiting in their lane, the one counter written after them goes up in the first
/// turn, beside the first bounded upload of sales.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_with_a_backlog_does_not_hold_up_another_lanes_row() {
    let (shop, store, db, app) = records_shop("records_lanes").await;
    app.execute_batch("BEGIN").unwrap();
    for i in 0..3_000 {
        app.execute(
            "INSERT INTO sales (id, store_id, amount) VALUES (?1, ?2, ?3)",
            rusqlite::params![Uuid::new_v4().to_string(), store.to_string(), i],
        )
        .unwrap();
    }
    app.execute_batch("COMMIT; INSERT INTO counters VALUES ('tills', 1, '1.00');")
        .unwrap();
    let mut link = Lossy::new(&shop, store, 3, 0);
    let mut uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    let turn = tokio::task::spawn_blocking(move || {
        uploader
            .turn(&mut link, &ferry_sync::replica::UpSettings::default())
            .unwrap()
    })
    .await
    .unwrap();
    assert!(turn.more, "sales are left for the next turns");
    let counters: i64 = sqlx::query_scalar("SELECT count(*) FROM counters")
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert_eq!(counters, 1, "the counter went up in the first turn");
    assert_eq!(
        server_sales(&shop.db.pool).await.len(),
        ferry_sync::replica::UPLOAD_ROWS,
        "one bounded upload of the sales lane"
    );
    shop.finish().await;
}

/// docs/sync-up.md §6: a server restored to a filing count older than the store's
/// journal reaches gets back what the journal holds, and the store raises an alarm naming
/// the filings it could not send again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_older_than_the_journal_reaches_is_an_alarm_naming_the_filings_lost() {
    let (shop, store, db, app) = records_shop("records_reach").await;
    let mut link = Lossy::new(&shop, store, 4, 0);
    let mut uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    let settings = ferry_sync::replica::UpSettings {
        journal_rows: 10,
        ..Default::default()
    };
    // Six filings of five sales each; the journal keeps the newest ten rows, with the
    // rest of the filing the tenth came in (filings 4 to 6).
    let (uploader_back, link_back, app) = tokio::task::spawn_blocking(move || {
        for f in 0..6 {
            for i in 0..5 {
                app.execute(
                    "INSERT INTO sales (id, store_id, amount) VALUES (?1, ?2, ?3)",
                    rusqlite::params![Uuid::new_v4().to_string(), store.to_string(), f * 5 + i],
                )
                .unwrap();
            }
            uploader.turn(&mut link, &settings).unwrap();
        }
        (uploader, link, app)
    })
    .await
    .unwrap();
    let (mut uploader, mut link) = (uploader_back, link_back);
    assert_eq!(up_status(&app).unwrap().journal, 15);
    // The server loses every filing after the second (a restore to that point).
    sqlx::query("UPDATE ferry_sync.filings SET n = 2 WHERE replica = $1")
        .bind(store)
        .execute(&shop.db.pool)
        .await
        .unwrap();
    sqlx::query("DELETE FROM sales WHERE amount >= 10")
        .execute(&shop.db.pool)
        .await
        .unwrap();
    let status = tokio::task::spawn_blocking(move || {
        assert!(uploader.check_server(&mut link).unwrap());
        upload_all(&mut uploader, &mut link, &db);
        up_status(&app).unwrap()
    })
    .await
    .unwrap();
    assert_eq!(
        status.beyond_journal,
        Some((3, 3)),
        "filing 3 was pruned from the journal: {status:?}"
    );
    let filed = server_sales(&shop.db.pool).await;
    assert_eq!(
        filed
            .values()
            .filter(|(_, amount, _)| *amount >= 15)
            .count(),
        15,
        "what the journal held came back"
    );
    assert_eq!(filed.len(), 25, "filing 3 (5 sales) is the one lost");
    shop.finish().await;
}

/// An uplink that gives up on its first upload (a timeout: the replica sees a failure)
/// and keeps its bytes, then carries the rest over `Lossy`: the upload it kept reaches
/// the server later, when the test says.
struct Late {
    kept: Option<Vec<u8>>,
    link: Lossy,
}

impl ferry_sync::replica::Uplink for Late {
    fn upload(&mut self, bytes: &[u8]) -> Result<Vec<u8>, ferry_sync::replica::TransportError> {
        if self.kept.is_none() {
            self.kept = Some(bytes.to_vec());
            return Err(ferry_sync::replica::TransportError::Unavailable(
                "timed out waiting for the answer".into(),
            ));
        }
        self.link.upload(bytes)
    }
}

/// Fault 4 of the research's §5.2, reordered: an upload the store gave up on reaches the
/// server after its resend and a newer upload were filed (a stream's redelivery, or an
/// HTTP request still in flight when the replica tried again). Filed as it came, the old
/// upsert would bring back a sale the store then deleted. It is answered stale, files
/// nothing, and moves no count; the same upload again, once filed, is filed again
/// harmlessly; and a store whose ids fell behind the server's (its file restored) is told
/// the newest and goes past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_4_an_upload_filed_after_a_newer_one_is_answered_stale_and_files_nothing() {
    let (shop, store, db, app) = records_shop("records_late").await;
    let sale = sell(&app, store, 1);
    let mut late = Late {
        kept: None,
        link: Lossy::new(&shop, store, 4, 0),
    };
    let uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    let app_db = db.clone();
    let sale2 = sale.clone();
    let (late, _uploader) = tokio::task::spawn_blocking(move || {
        let mut uploader = uploader;
        let settings = ferry_sync::replica::UpSettings::default();
        assert!(uploader.turn(&mut late, &settings).is_err(), "given up on");
        // The store deletes the sale; the next upload files the delete.
        let app = rusqlite::Connection::open(&app_db).unwrap();
        app.execute("DELETE FROM sales WHERE id = ?1", [&sale2])
            .unwrap();
        upload_all(&mut uploader, &mut late.link, &app_db);
        (late, uploader)
    })
    .await
    .unwrap();
    assert!(server_sales(&shop.db.pool).await.is_empty());
    let count = |pool: sqlx::PgPool| async move {
        sqlx::query_scalar::<_, i64>("SELECT n FROM ferry_sync.filings")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = count(shop.db.pool.clone()).await;

    // The upload the store gave up on arrives now.
    let kept = ferry_sync::wire::decode_upload(late.kept.as_ref().unwrap()).unwrap();
    let outcome = file::file(
        &shop.db.pool,
        &shop.spec.records,
        &Shape::default(),
        store,
        &kept,
    )
    .await
    .unwrap();
    let file::Outcome::Filed(filed) = outcome else {
        panic!("{outcome:?}")
    };
    let newest = filed.stale.expect("answered stale");
    assert!(newest > kept.id, "{filed:?}");
    assert!(
        server_sales(&shop.db.pool).await.is_empty(),
        "the deleted sale did not come back"
    );
    assert_eq!(
        count(shop.db.pool.clone()).await,
        before,
        "no filing counted"
    );
    // Through the careful way too (a role to take): the same answer.
    let shaped = Shape {
        role: Some("postgres".into()),
    };
    let again = file::file(&shop.db.pool, &shop.spec.records, &shaped, store, &kept)
        .await
        .unwrap();
    assert!(
        matches!(&again, file::Outcome::Filed(f) if f.stale == Some(newest)),
        "{again:?}"
    );
    assert!(server_sales(&shop.db.pool).await.is_empty());

    // A store whose ids are behind the server's (its file restored from an older copy)
    // gets one stale answer, jumps past, and its row is filed.
    sqlx::query("UPDATE ferry_sync.filings SET last_id = $1")
        .bind(i64::MAX - 1)
        .execute(&shop.db.pool)
        .await
        .unwrap();
    let other = sell(&app, store, 7);
    let mut link = late.link;
    let mut uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    let db2 = db.clone();
    tokio::task::spawn_blocking(move || upload_all(&mut uploader, &mut link, &db2))
        .await
        .unwrap();
    let sales = server_sales(&shop.db.pool).await;
    assert_eq!(sales.keys().collect::<Vec<_>>(), vec![&other]);
    assert_eq!(up_status(&app).unwrap().set_aside, 0);
    shop.finish().await;
}

/// An uplink that is down until told otherwise, counting its tries.
struct Gate {
    down: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tries: std::sync::Arc<std::sync::atomic::AtomicU64>,
    link: Lossy,
}

impl ferry_sync::replica::Uplink for Gate {
    fn upload(&mut self, bytes: &[u8]) -> Result<Vec<u8>, ferry_sync::replica::TransportError> {
        use std::sync::atomic::Ordering::SeqCst;
        self.tries.fetch_add(1, SeqCst);
        if self.down.load(SeqCst) {
            return Err(ferry_sync::replica::TransportError::Unavailable(
                "the network is down".into(),
            ));
        }
        self.link.upload(bytes)
    }
}

/// docs/sync-up.md §3.2: an uploader waiting out its backoff after the network went away
/// tries again as soon as the fetch loop beside it hears the server (`LinkBack`), not at
/// the end of its own wait. The wait here is an hour, so only the signal can end it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploader_waiting_out_a_backoff_goes_when_the_fetch_loop_hears_the_server() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    let (shop, store, db, app) = records_shop("records_back").await;
    sell(&app, store, 5);
    let down = Arc::new(AtomicBool::new(true));
    let tries = Arc::new(AtomicU64::new(0));
    let mut gate = Gate {
        down: down.clone(),
        tries: tries.clone(),
        link: Lossy::new(&shop, store, 9, 0),
    };
    let back = Arc::new(ferry_sync::replica::LinkBack::default());
    let mut uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    uploader.set_link_back(back.clone());
    let hour = std::time::Duration::from_secs(3_600);
    let settings = ferry_sync::replica::UpSettings {
        backoff: ferry_core::backoff::Backoff::new(hour, hour, hour),
        ..Default::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let up_stop = stop.clone();
    let up = std::thread::spawn(move || uploader.run(&mut gate, &up_stop, &settings));
    while tries.load(SeqCst) == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // Failed once: the uploader now waits an hour. The network returns, and the fetch
    // loop hears the server.
    down.store(false, SeqCst);
    back.bump();
    let mut filed = 0;
    for _ in 0..2_000 {
        filed = server_sales(&shop.db.pool).await.len();
        if filed == 1 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(filed, 1, "the sale went up once the server was heard");
    stop.store(true, SeqCst);
    up.join().unwrap().unwrap();
    shop.finish().await;
}

/// An uploader whose keepalive falls due while the network is down (a store idle
/// offline, its journal not empty) waits and tries again; it used to return the error,
/// and `ferry sync replica` stopped the whole replica on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uploader_idle_offline_with_a_journal_keeps_trying_instead_of_stopping() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    let (shop, store, db, app) = records_shop("records_idle").await;
    sell(&app, store, 5);
    let mut uploader = Uploader::open(&db, shop.seal_keys[&store], store).unwrap();
    let mut link = Lossy::new(&shop, store, 10, 0);
    let db2 = db.clone();
    let (uploader, link) = tokio::task::spawn_blocking(move || {
        upload_all(&mut uploader, &mut link, &db2);
        (uploader, link)
    })
    .await
    .unwrap();
    assert_eq!(up_status(&app).unwrap().journal, 1);
    let tries = Arc::new(AtomicU64::new(0));
    let mut gate = Gate {
        down: Arc::new(AtomicBool::new(true)),
        tries: tries.clone(),
        link,
    };
    let settings = ferry_sync::replica::UpSettings {
        keepalive: std::time::Duration::ZERO,
        backoff: ferry_core::backoff::Backoff::new(
            std::time::Duration::from_millis(10),
            std::time::Duration::from_millis(20),
            std::time::Duration::from_millis(5),
        ),
        ..Default::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let up_stop = stop.clone();
    let mut uploader = uploader;
    let up = std::thread::spawn(move || uploader.run(&mut gate, &up_stop, &settings));
    while tries.load(SeqCst) < 3 && !up.is_finished() {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    stop.store(true, SeqCst);
    up.join()
        .unwrap()
        .expect("the uploader waited, and stopped only when told");
    assert!(tries.load(SeqCst) >= 3, "it kept trying");
    shop.finish().await;
}

/// The store's app sells for `amount`: a new sale of its own, its id returned.
fn sell(app: &rusqlite::Connection, store: Uuid, amount: i64) -> String {
    let id = Uuid::new_v4().to_string();
    app.execute(
        "INSERT INTO sales (id, store_id, amount) VALUES (?1, ?2, ?3)",
        rusqlite::params![id, store.to_string(), amount],
    )
    .unwrap();
    id
}

/// Filing under row-level security (docs/sync-up.md §5.1 step 1): a policy on `counters`
/// lets only the north store write, reading `ferry_sync.replica`. Filed by a role the
/// policy applies to, both ways: the one-statement way (the pool's own role, no
/// `--file-role`) and the statement-per-part way (`--file-role`). North's counter is
/// filed; south's is refused by the database and waits in the inbox; nothing else moves.
/// Guards against a filing whose setting the policy does not see yet (set after, or in
/// another statement's snapshot of it), which would refuse north or admit south.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_level_security_reads_the_sender_in_every_way_of_filing() {
    let (mut shop, north, north_db, north_app) = records_shop("records_rls").await;
    let south = shop.store("south").await;
    shop.settle().await;
    let south_db = shop.dir.join(format!("{south}.db"));
    let south_app = rusqlite::Connection::open(&south_db).unwrap();
    south_app
        .busy_timeout(std::time::Duration::from_secs(5))
        .unwrap();
    let role = format!("{}_filer", shop.db.name);
    shop.db
        .exec(&format!(
            "CREATE ROLE {role} LOGIN;
             GRANT USAGE ON SCHEMA public, ferry_sync TO {role};
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public, ferry_sync TO {role};
             GRANT USAGE ON ALL SEQUENCES IN SCHEMA public, ferry_sync TO {role};
             ALTER TABLE counters ENABLE ROW LEVEL SECURITY;
             CREATE POLICY north_only ON counters USING (true)
               WITH CHECK (current_setting('ferry_sync.replica', true) = '{north}');"
        ))
        .await;
    // One connection each, carrying north's id from an earlier filing: the setting must
    // be made before the policy reads it, or south's row would pass as north's.
    let opts: sqlx::postgres::PgConnectOptions = shop.db.url.parse().unwrap();
    let one = sqlx::postgres::PgPoolOptions::new().max_connections(1);
    let as_role = one
        .clone()
        .connect_with(opts.clone().username(&role))
        .await
        .unwrap();
    let as_owner = one.connect_with(opts).await.unwrap();
    let ways = [
        ("at_once", as_role.clone(), Shape::default()),
        (
            "per_part",
            as_owner.clone(),
            Shape {
                role: Some(role.clone()),
            },
        ),
    ];
    for (way, pool, shape) in ways {
        for (store, db, app) in [
            (north, &north_db, &north_app),
            (south, &south_db, &south_app),
        ] {
            sqlx::query("SELECT set_config('ferry_sync.replica', $1, false)")
                .bind(north.to_string())
                .execute(&pool)
                .await
                .unwrap();
            app.execute(
                "INSERT INTO counters (name, rev, total) VALUES (?1, 1, '1.00')",
                [format!("{way}_{store}")],
            )
            .unwrap();
            let mut link = Lossy::new(&shop, store, 5, 0);
            link.pool = pool.clone();
            link.shape = shape.clone();
            let mut uploader = Uploader::open(db, shop.seal_keys[&store], store).unwrap();
            let db = db.clone();
            tokio::task::spawn_blocking(move || upload_all(&mut uploader, &mut link, &db))
                .await
                .unwrap();
        }
        let names: Vec<String> = sqlx::query_scalar("SELECT name FROM counters ORDER BY name")
            .fetch_all(&shop.db.pool)
            .await
            .unwrap();
        assert!(
            names.contains(&format!("{way}_{north}")),
            "{way}: north filed: {names:?}"
        );
        assert!(
            !names.contains(&format!("{way}_{south}")),
            "{way}: south refused: {names:?}"
        );
        let waiting: i64 =
            sqlx::query_scalar("SELECT count(*) FROM ferry_sync.inbox WHERE replica = $1")
                .bind(south)
                .fetch_one(&shop.db.pool)
                .await
                .unwrap();
        assert!(waiting >= 1, "{way}: south's row waits in the inbox");
    }
    as_role.close().await;
    as_owner.close().await;
    drop((north_app, south_app));
    shop.finish().await;
    let mut admin = sqlx::PgConnection::connect(&common::admin_url())
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP ROLE {role}")))
        .execute(&mut admin)
        .await
        .unwrap();
}
