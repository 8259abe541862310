//! A server restored from an older copy (docs/sync-protocol.md §1.6 step 2, guarantee 10): a real
//! Postgres of the test's own is stopped, its data directory copied, changes made and
//! confirmed, then the copy put back. A replica's confirmation of a message the restored
//! server stamped but has no record of makes it take a new epoch and provision every
//! replica, which ends holding what the restored server says. Its own binary: the test
//! points FERRY_TEST_PG at its private server.

mod common;

use common::Shop;
use ferry_testkit::servers::PrivatePg;
use sqlx::{Connection, PgConnection};

async fn relock(shop: &mut Shop) {
    for _ in 0..100 {
        if let Ok(mut c) = PgConnection::connect(&shop.db.url).await {
            let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
                .bind(ferry_sync::relay::LOCK_KEY)
                .fetch_one(&mut c)
                .await
                .unwrap();
            if !got {
                let who: Vec<(i32, String)> = sqlx::query_as("SELECT l.pid, coalesce(a.query, '') FROM pg_locks l LEFT JOIN pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory'")
                    .fetch_all(&mut c)
                    .await
                    .unwrap();
                panic!("the relay lock is held after a restart: {who:?}");
            }
            shop.lock = c;
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("the restarted Postgres did not answer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restored_from_an_older_copy_takes_a_new_epoch_and_every_replica_follows_it() {
    let scratch = std::env::temp_dir().join(format!("ferry-sync-restore-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let pg = PrivatePg::start(&scratch);
    // SAFETY of the environment: this binary holds this one test.
    unsafe {
        std::env::set_var(
            "FERRY_TEST_PG",
            format!("postgres://postgres@127.0.0.1:{}", pg.port),
        )
    };
    let mut shop = Shop::new("restore").await;
    let a = shop.store("north").await;
    let b = shop.store("north").await;
    shop.db
        .exec("INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 20) g")
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    let epoch_before: uuid::Uuid = sqlx::query_scalar("SELECT epoch FROM ferry_sync.meta")
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();

    // The backup.
    pg.down("fast");
    assert!(
        PgConnection::connect(&shop.db.url).await.is_err(),
        "Postgres stopped for the backup"
    );
    let backup = scratch.join("backup");
    common::copy_dir(&pg.data, &backup);
    pg.up();
    relock(&mut shop).await;

    // Changes after the backup, applied and confirmed by both stores.
    for i in 0..5 {
        shop.db
            .exec(&format!(
                "UPDATE products SET price = price + 100 WHERE id = {}",
                i + 1
            ))
            .await;
        shop.passes().await;
    }
    shop.db.exec("DELETE FROM products WHERE id > 15").await;
    shop.settle().await;
    shop.assert_converged().await;

    // The restore.
    pg.down("fast");
    common::copy_dir(&backup, &pg.data);
    pg.up();
    relock(&mut shop).await;
    shop.settle().await;
    shop.assert_converged().await;
    let (epoch_after, restores): (uuid::Uuid, i32) =
        sqlx::query_as("SELECT epoch, restores FROM ferry_sync.meta")
            .fetch_one(&shop.db.pool)
            .await
            .unwrap();
    assert_ne!(epoch_after, epoch_before, "a new epoch");
    assert_eq!(restores, 1, "the alarm counts the restore");
    assert_eq!(
        shop.held(a)["products"].len(),
        20,
        "the restored server's rows, back on the store"
    );
    let _ = b;
    shop.finish().await;
    drop(pg);
    let _ = std::fs::remove_dir_all(&scratch);
}
