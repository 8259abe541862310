//! The relay under faults: two relays racing, a lock connection cut mid-pass, a pooler
//! in transaction mode (docs/sync-relay.md §1.1, guarantees 6 and 7); and its pacing (§6.2).

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::Shop;
use ferry_sync::relay::{Relay, RelayError, RelaySettings};
use sqlx::{Connection, PgConnection};

async fn count(shop: &Shop, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(&shop.db.pool)
        .await
        .unwrap()
}

/// Delivers to every store while a relay runs elsewhere, until nothing is left to do.
async fn settle_running(shop: &mut Shop) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ids: Vec<_> = shop.replicas.keys().copied().collect();
        let mut moved = false;
        for id in ids {
            moved |= shop.deliver(id).await;
        }
        // Each delivery reports, and the relay gathers reports for up to 100 ms before
        // a pass: let it handle them before delivering (and reporting) again.
        let (mut notes, mut reports);
        let handled_by = Instant::now() + Duration::from_secs(2);
        loop {
            notes = count(shop, "SELECT count(*) FROM ferry_sync.notes").await;
            reports = count(
                shop,
                "SELECT count(*) FROM ferry_sync.reports r JOIN ferry_sync.replicas c ON c.id = r.replica WHERE r.n > c.handled_n",
            )
            .await;
            if notes + reports == 0 || Instant::now() > handled_by {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let messages = count(shop, "SELECT count(*) FROM ferry_sync.outbox").await;
        if !moved && notes + messages + reports == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never settled: {notes} notes, {messages} messages, {reports} reports left"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_race_exactly_one_records_and_the_standby_takes_over() {
    let mut shop = Shop::new("race").await;
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(ferry_sync::relay::LOCK_KEY)
        .execute(&mut shop.lock)
        .await
        .unwrap();
    let store = shop.store("north").await;
    let settings = RelaySettings {
        standby: Duration::from_millis(500),
        idle: Duration::from_millis(50),
        ..RelaySettings::default()
    };
    let mut stops = Vec::new();
    let mut stats = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..2 {
        let (tx, rx) = tokio::sync::watch::channel(false);
        let mut relay = Relay::new(shop.spec.clone(), settings.clone());
        stats.push(relay.stats.clone());
        let url = shop.db.url.clone();
        tasks.push(tokio::spawn(async move { relay.run(&url, rx).await }));
        stops.push(tx);
    }
    let holding = |stats: &Vec<Arc<ferry_sync::relay::RelayStats>>| {
        stats
            .iter()
            .map(|s| s.holding.load(Ordering::Relaxed))
            .collect::<Vec<_>>()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !holding(&stats).contains(&true) {
        assert!(Instant::now() < deadline, "no relay took the lock");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    shop.db
        .exec("INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 100) g")
        .await;
    settle_running(&mut shop).await;
    shop.assert_converged().await;
    let who = holding(&stats);
    assert_eq!(
        who.iter().filter(|h| **h).count(),
        1,
        "exactly one relay holds the lock: {who:?}"
    );
    let holder = who.iter().position(|h| *h).unwrap();
    let standby = 1 - holder;
    assert_eq!(
        stats[standby].passes.load(Ordering::Relaxed),
        0,
        "the standby recorded nothing"
    );

    // The holder goes; the standby takes over within the standby bound.
    let gone = Instant::now();
    stops[holder].send(true).unwrap();
    let _ = tasks.remove(holder).await;
    while !stats[standby].holding.load(Ordering::Relaxed) {
        assert!(
            gone.elapsed() < Duration::from_secs(5),
            "the standby did not take over"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let takeover = gone.elapsed();
    eprintln!(
        "takeover after the holder stopped: {} ms (standby 500 ms)",
        takeover.as_millis()
    );
    assert!(
        takeover <= Duration::from_millis(500) * 3,
        "takeover took {takeover:?}"
    );
    shop.db
        .exec("UPDATE products SET price = price + 1 WHERE id <= 10")
        .await;
    settle_running(&mut shop).await;
    shop.assert_converged().await;
    assert!(stats[standby].passes.load(Ordering::Relaxed) > 0);
    for s in &stops {
        let _ = s.send(true);
    }
    for t in tasks {
        let _ = t.await;
    }
    let _ = store;
    shop.finish().await;
}

/// Pacing (docs/sync-relay.md §1.2): a change to an idle relay passes at once; changes that
/// come while the previous pass's fan-out paces the relay share one pass, and each
/// replica gets one message for all of them. Nothing is delivered meanwhile, so no report
/// wakes a pass; the pace is seconds long so a slow machine cannot split the burst.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_during_a_passs_pace_share_the_next_pass_and_one_message_per_replica() {
    let mut shop = Shop::new("pace").await;
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(ferry_sync::relay::LOCK_KEY)
        .execute(&mut shop.lock)
        .await
        .unwrap();
    for _ in 0..3 {
        shop.store("north").await;
    }
    shop.db
        .exec("INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 10) g")
        .await;
    let settings = RelaySettings {
        idle: Duration::from_secs(60),
        pace_per_message: Duration::from_millis(1_000),
        pace_max: Duration::from_millis(3_000),
        ..RelaySettings::default()
    };
    let (stop, rx) = tokio::sync::watch::channel(false);
    let mut relay = Relay::new(shop.spec.clone(), settings);
    let stats = relay.stats.clone();
    let url = shop.db.url.clone();
    let task = tokio::spawn(async move { relay.run(&url, rx).await });
    settle_running(&mut shop).await;
    // Past any pace the provisioning left.
    tokio::time::sleep(Duration::from_millis(3_200)).await;
    let (passes, outbox) = (
        stats.passes.load(Ordering::Relaxed),
        count(&shop, "SELECT count(*) FROM ferry_sync.outbox").await,
    );
    assert_eq!(outbox, 0, "settled");

    shop.db
        .exec("UPDATE products SET price = price + 1 WHERE id = 1")
        .await;
    let first = Instant::now();
    while stats.passes.load(Ordering::Relaxed) == passes {
        // A guard against hanging, not a timing claim: an idle relay passes at once.
        assert!(
            first.elapsed() < Duration::from_secs(30),
            "the first change never passed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!(
        "the first change's pass began within {} ms",
        first.elapsed().as_millis()
    );
    for id in 2..=6 {
        shop.db
            .exec(&format!(
                "UPDATE products SET price = price + 1 WHERE id = {id}"
            ))
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while count(&shop, "SELECT count(*) FROM ferry_sync.notes").await > 0 {
        assert!(Instant::now() < deadline, "the paced pass never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        first.elapsed() >= Duration::from_millis(2_900),
        "the burst waited out the first pass's pace (3 messages × 1 s)"
    );
    assert_eq!(
        stats.passes.load(Ordering::Relaxed),
        passes + 2,
        "two passes: one, then the burst"
    );
    let per_replica: Vec<i64> = sqlx::query_scalar(
        "SELECT count(*) FROM ferry_sync.outbox GROUP BY replica ORDER BY replica",
    )
    .fetch_all(&shop.db.pool)
    .await
    .unwrap();
    assert_eq!(
        per_replica,
        vec![2, 2, 2],
        "one message for the first change, one for the burst"
    );
    settle_running(&mut shop).await;
    shop.assert_converged().await;
    stop.send(true).unwrap();
    let _ = task.await;
    shop.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_lock_connection_is_cut_mid_pass_records_nothing() {
    let mut shop = Shop::new("cut").await;
    shop.store("north").await;
    shop.settle().await;
    shop.db
        .exec("INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 50) g")
        .await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut shop.lock)
        .await
        .unwrap();
    let url = shop.db.url.clone();
    shop.relay.before_commit = Some(Box::new(move || {
        let url = url.clone();
        Box::pin(async move {
            let mut other = PgConnection::connect(&url).await.unwrap();
            sqlx::query("SELECT pg_terminate_backend($1)")
                .bind(pid)
                .execute(&mut other)
                .await
                .unwrap();
        })
    }));
    let notes_before = count(&shop, "SELECT count(*) FROM ferry_sync.notes").await;
    assert!(notes_before >= 50);
    let outcome = shop.relay.pass(&mut shop.lock).await;
    assert!(
        outcome.is_err(),
        "a pass whose lock connection died must fail: {outcome:?}"
    );
    assert_eq!(
        count(&shop, "SELECT count(*) FROM ferry_sync.outbox").await,
        0,
        "nothing recorded"
    );
    assert_eq!(
        count(&shop, "SELECT count(*) FROM ferry_sync.notes").await,
        notes_before,
        "the notes wait for the next relay"
    );

    // The next relay (a new connection, the lock free since the session died) records them.
    shop.relay.before_commit = None;
    shop.lock = PgConnection::connect(&shop.db.url).await.unwrap();
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(ferry_sync::relay::LOCK_KEY)
        .fetch_one(&mut shop.lock)
        .await
        .unwrap();
    assert!(got, "the dead session released the lock");
    shop.settle().await;
    shop.assert_converged().await;
    shop.finish().await;
}

fn as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A pgbouncer in transaction mode in front of the test Postgres, on a free port.
struct Pooler {
    child: std::process::Child,
    dir: std::path::PathBuf,
    port: u16,
}

impl Pooler {
    fn start(db: &str) -> Option<Pooler> {
        let bin = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("ferry-sync-pgbouncer-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").unwrap();
        std::fs::write(
            dir.join("pgbouncer.ini"),
            format!(
                "[databases]\n{db} = host=127.0.0.1 port=5432 dbname={db}\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                 auth_type = trust\nauth_file = {users}\npool_mode = transaction\nunix_socket_dir =\nlogfile = {log}\npidfile = {pid}\n\
                 default_pool_size = 4\nignore_startup_parameters = extra_float_digits\n",
                users = dir.join("users.txt").display(),
                log = dir.join("log").display(),
                pid = dir.join("pid").display(),
            ),
        )
        .unwrap();
        let mut cmd = if as_root() {
            let _ = std::process::Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&dir)
                .status();
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(bin);
            c
        } else {
            std::process::Command::new(bin)
        };
        let child = cmd.arg(dir.join("pgbouncer.ini")).spawn().ok()?;
        for _ in 0..100 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(Pooler { child, dir, port });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Pooler {
    fn drop(&mut self) {
        // Under runuser the child is runuser; pgbouncer itself is named in its pidfile.
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
            let _ = std::process::Command::new("kill").arg(pid.trim()).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooler_in_transaction_mode_is_refused() {
    let mut shop = Shop::new("pooler").await;
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(ferry_sync::relay::LOCK_KEY)
        .execute(&mut shop.lock)
        .await
        .unwrap();
    shop.store("north").await;
    let pooler = Pooler::start(&shop.db.name).expect("pgbouncer runs (scripts/test installs it)");
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/{}?statement-cache-capacity=0",
        pooler.port, shop.db.name
    );
    // The relay takes the lock through the pooler, on the pooler's first backend...
    let mut relay = Relay::new(shop.spec.clone(), RelaySettings::default());
    let (_tx, mut rx) = tokio::sync::watch::channel(false);
    let mut conn = relay
        .acquire(&url, &mut rx)
        .await
        .unwrap()
        .expect("the lock is free");
    // ...another client of the pooler holds that backend in a transaction...
    let mut other = PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("BEGIN; SELECT 1")
        .execute(&mut other)
        .await
        .unwrap();
    // ...so the relay's pass runs on another backend, which does not hold the lock.
    match relay.pass(&mut conn).await {
        Err(RelayError::LockLost) => {}
        other => panic!("a pass behind a transaction pooler must be refused: {other:?}"),
    }
    assert_eq!(
        count(&shop, "SELECT count(*) FROM ferry_sync.outbox").await,
        0
    );
    // And `run` turns that first refusal into the error a person can act on.
    drop(other);
    drop(conn);
    drop(pooler);
    let text = ferry_sync::relay::POOLER;
    assert!(
        text.contains("pooler in transaction mode") && text.contains("session pooling"),
        "{text}"
    );
    shop.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_past_its_bound_is_dropped_and_the_replica_caught_up_with_the_difference() {
    let mut shop = Shop::new("bound").await;
    shop.relay = Relay::new(
        shop.spec.clone(),
        RelaySettings {
            outbox_messages_max: 3,
            ..RelaySettings::default()
        },
    );
    let away = shop.store("north").await;
    let here = shop.store("north").await;
    shop.db
        .exec("INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 20) g")
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    // `away` stops fetching; every change is a pass and a message for it.
    for i in 1..=6 {
        shop.db.exec(&format!("UPDATE products SET price = price + 1 WHERE id = {i}; DELETE FROM products WHERE id = {}", 20 - i)).await;
        shop.passes().await;
        shop.deliver(here).await;
    }
    shop.passes().await;
    let dropped: i32 = sqlx::query_scalar("SELECT dropped FROM ferry_sync.replicas WHERE id = $1")
        .bind(away)
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert!(dropped >= 1, "the outbox past 3 messages was dropped");
    let outbox: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT body_hash FROM ferry_sync.outbox WHERE replica = $1")
            .bind(away)
            .fetch_all(&shop.db.pool)
            .await
            .unwrap();
    assert!(
        outbox.len() <= 3,
        "what is left is the catch-up chain: {} messages",
        outbox.len()
    );
    shop.settle().await;
    shop.assert_converged().await;
    let status = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    assert!(
        status.replicas.iter().all(|r| r.standing == "synced"),
        "{status:?}"
    );
    shop.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_changed_behind_a_replicas_back_are_healed_by_that_tables_digest_alone() {
    let mut shop = Shop::new("digest").await;
    shop.relay = Relay::new(
        shop.spec.clone(),
        RelaySettings {
            digest_every: Duration::ZERO,
            ..RelaySettings::default()
        },
    );
    let store = shop.store("north").await;
    let customer = uuid::Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 30) g;
             INSERT INTO customers VALUES ('{customer}', 'c');
             INSERT INTO orders (id, store_id, customer_id) VALUES (gen_random_uuid(), '{store}', '{customer}');"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    assert_eq!(
        shop.relay.stats.heals.load(Ordering::Relaxed),
        0,
        "a clean run needs no heal"
    );
    // Content changed under the right key, a row lost, a row that should not be there.
    shop.replicas[&store]
        .conn()
        .execute_batch("UPDATE products SET price = '0' WHERE id = 7; DELETE FROM products WHERE id = 8; INSERT INTO products (id, name, price, region) VALUES (999, 'x', '1', 'north');")
        .unwrap();
    let messages_before = shop.relay.stats.bytes.load(Ordering::Relaxed);
    shop.settle().await;
    shop.assert_converged().await;
    assert_eq!(
        shop.relay.stats.heals.load(Ordering::Relaxed),
        1,
        "one table healed"
    );
    let healed = shop.relay.stats.bytes.load(Ordering::Relaxed) - messages_before;
    eprintln!("healing the products table cost {healed} bytes");
    shop.finish().await;
}

// Guards a false heal: a replica reports a digest taken before a write's pass while the
// write's note waits; the server reads current rows, so the digests differ and a table
// was resent that the pass itself was about to send (bytes, never correctness).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_digest_taken_before_a_writes_pass_heals_nothing_and_a_real_difference_still_heals() {
    let mut shop = Shop::new("noheal").await;
    shop.relay = Relay::new(
        shop.spec.clone(),
        RelaySettings {
            digest_every: Duration::ZERO,
            ..RelaySettings::default()
        },
    );
    let store = shop.store("north").await;
    let order = uuid::Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 20) g;
             INSERT INTO orders (id, store_id, note) VALUES ('{order}', '{store}', 'first');"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    let heals = |shop: &Shop| shop.relay.stats.heals.load(Ordering::Relaxed);
    assert_eq!(heals(&shop), 0, "a clean run needs no heal");

    // Writes to a broadcast and a per-replica table; before any pass plans them, the
    // store reports (it is at the end of its chain, so the report carries digests of
    // what it held before the writes).
    shop.db
        .exec(&format!(
            "UPDATE products SET price = 99 WHERE id = 3; DELETE FROM products WHERE id = 4;
             INSERT INTO products VALUES (21, 'new', 1, 'north');
             UPDATE orders SET note = 'changed' WHERE id = '{order}';"
        ))
        .await;
    assert!(!shop.deliver(store).await, "nothing was recorded yet");
    let up = shop.replicas[&store].up().unwrap();
    assert!(!up.digests.is_empty(), "the report carries digests");
    // The pass that handles the report plans the writes too.
    shop.passes().await;
    assert_eq!(
        heals(&shop),
        0,
        "a digest older than pending notes for its table is not compared"
    );
    shop.settle().await;
    shop.assert_converged().await;
    assert_eq!(heals(&shop), 0, "the writes travelled as notes, not heals");

    // A real difference (a row changed behind the relay's back, no note) still heals.
    shop.replicas[&store]
        .conn()
        .execute_batch("UPDATE products SET name = 'tampered' WHERE id = 5")
        .unwrap();
    shop.settle().await;
    shop.assert_converged().await;
    assert_eq!(heals(&shop), 1, "the tampered table was healed");
    shop.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_restored_from_an_older_copy_is_detected_and_provisioned_again() {
    let mut shop = Shop::new("restored").await;
    let store = shop.store("north").await;
    let order = uuid::Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 20) g;
             INSERT INTO orders (id, store_id) VALUES ('{order}', '{store}');"
        ))
        .await;
    shop.settle().await;
    // A backup of the store's file at this point...
    let file = shop.dir.join(format!("{store}.db"));
    let backup = shop.dir.join("backup.db");
    shop.replicas[&store]
        .conn()
        .execute("VACUUM INTO ?1", [backup.to_str().unwrap()])
        .unwrap();
    // ...then more changes it applies and confirms...
    shop.db
        .exec(&format!(
            "UPDATE products SET price = 0 WHERE id <= 5; DELETE FROM orders WHERE id = '{order}'"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    // ...then the file is restored from the backup: it confirms less than before.
    drop(shop.replicas.remove(&store));
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", file.display()));
    }
    std::fs::copy(&backup, &file).unwrap();
    shop.reopen(store);
    assert_eq!(
        shop.held(store)["orders"].len(),
        1,
        "the restored copy holds the old order"
    );
    shop.settle().await;
    shop.assert_converged().await;
    let provisioned: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ferry_sync.replicas WHERE id = $1 AND standing = 'following'",
    )
    .bind(store)
    .fetch_one(&shop.db.pool)
    .await
    .unwrap();
    assert_eq!(provisioned, 1);
    shop.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_a_replica_refuses_is_set_aside_while_the_rest_flows_and_goes_through_after_a_fix() {
    let mut shop = Shop::new("poison").await;
    let store = shop.store("north").await;
    shop.db
        .exec("INSERT INTO products VALUES (1, 'tea', 1, 'north')")
        .await;
    shop.settle().await;
    // The store's own rule: it refuses products named 'bad' (its trigger, not ferry's).
    shop.replicas[&store]
        .conn()
        .execute_batch("CREATE TRIGGER refuse_bad BEFORE INSERT ON products WHEN NEW.name = 'bad' BEGIN SELECT RAISE(ABORT, 'bad names are refused here'); END;")
        .unwrap();
    shop.db
        .exec("INSERT INTO products VALUES (2, 'bad', 2, 'north'), (3, 'coffee', 3, 'north')")
        .await;
    shop.settle().await;
    let held = shop.held(store);
    assert!(
        held["products"].iter().any(|p| p.starts_with("3|")),
        "the rest flows"
    );
    assert!(
        !held["products"].iter().any(|p| p.starts_with("2|")),
        "the refused row is not there"
    );
    let quarantined: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ferry_sync.quarantine WHERE cause = 'replica'")
            .fetch_one(&shop.db.pool)
            .await
            .unwrap();
    assert_eq!(
        quarantined, 1,
        "the server holds it set aside for that store"
    );
    let status = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    assert_eq!(status.replicas[0].quarantined, 1);
    // The store's deploy drops its rule; the relay's retry (at start, and on its timer)
    // sends the row again.
    shop.replicas[&store]
        .conn()
        .execute_batch("DROP TRIGGER refuse_bad")
        .unwrap();
    shop.relay = Relay::new(shop.spec.clone(), RelaySettings::default());
    shop.settle().await;
    shop.assert_converged().await;
    shop.finish().await;
}

/// Products are read through a view whose function cannot show product 13 (a deploy's
/// bug). The function is STABLE, so Postgres runs it only for the rows a read asks for; a
/// VOLATILE one in a view's select list runs for every row the scan passes, and every read
/// of the table would fail, not one note's.
const CHECKED_NAME: &str = "
CREATE FUNCTION checked_name(p int8, n text) RETURNS text LANGUAGE plpgsql STABLE AS $$
BEGIN
  IF p = 13 THEN RAISE EXCEPTION 'product % has a name this view cannot show', p; END IF;
  RETURN n;
END $$;
CREATE VIEW products_named AS SELECT id, checked_name(id, name) AS name, price, region FROM products;
";

// Guards guarantee 9 inside the relay: a note the planner fails on (a `from` view raising
// for one product) must not hold back the notes beside it in its batch. It is found by
// halving and parked, status and metrics count it, a digest of its table waits rather
// than fail on the same row, and after a deploy fixes the view the restarted relay plans
// it and the store ends with exactly what its rules say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_note_the_planner_fails_on_is_parked_while_the_rest_flows_and_goes_through_after_a_fix() {
    let rules = common::SHOP_RULES.replace(
        "[tables.products]\nsync = \"broadcast\"\n",
        "[tables.products]\nsync = \"broadcast\"\nfrom = \"products_named\"\n",
    );
    assert!(rules.contains("products_named"));
    let schema = format!("{}{CHECKED_NAME}", common::SHOP_SCHEMA);
    let mut shop = Shop::new_with("parked", &schema, &rules).await;
    let settings = RelaySettings {
        digest_every: Duration::ZERO,
        ..RelaySettings::default()
    };
    shop.relay = Relay::new(shop.spec.clone(), settings.clone());
    let store = shop.store("north").await;
    shop.db
        .exec("INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 10) g")
        .await;
    assert!(shop.settle_parking().await.is_empty());
    shop.assert_converged().await;

    // One batch: ten products, the one the view cannot show among them, and an order.
    let order = uuid::Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(11, 20) g;
             INSERT INTO orders (id, store_id, note) VALUES ('{order}', '{store}', 'beside it');"
        ))
        .await;
    let parked = shop.settle_parking().await;
    assert_eq!(parked.len(), 1, "one note parked: {parked:?}");
    let (relation, key, error): (String, String, String) = sqlx::query_as(
        "SELECT relation, key, last_error FROM ferry_sync.notes WHERE parked_at IS NOT NULL",
    )
    .fetch_one(&shop.db.pool)
    .await
    .unwrap();
    assert_eq!((relation.as_str(), key.as_str()), ("public.products", "13"));
    assert!(
        error.contains("product 13 has a name this view cannot show"),
        "the parked note keeps its error: {error}"
    );
    let held = shop.held(store);
    let products: Vec<&str> = held["products"]
        .iter()
        .map(|p| p.split('|').next().unwrap())
        .collect();
    assert_eq!(
        products.len(),
        19,
        "the rest of the batch flowed: {products:?}"
    );
    assert!(!products.contains(&"13"));
    assert_eq!(held["orders"].len(), 1, "the order beside it flowed");
    let status = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    assert_eq!((status.notes_parked, status.notes_pending), (1, 0));
    assert_eq!(
        shop.relay.stats.parked.load(Ordering::Relaxed),
        1,
        "ferry_sync_parked_total"
    );

    // Writes keep flowing while it is parked.
    shop.db
        .exec("UPDATE products SET price = 0 WHERE id IN (12, 14)")
        .await;
    assert!(shop.settle_parking().await.is_empty());
    assert!(shop.held(store)["products"].contains("12|p12|0.00|north"));

    // The deploy fixes the view; the relay restarts and retries what it set aside.
    shop.db
        .exec("CREATE OR REPLACE FUNCTION checked_name(p int8, n text) RETURNS text LANGUAGE plpgsql STABLE AS $$ BEGIN RETURN n; END $$")
        .await;
    shop.relay = Relay::new(shop.spec.clone(), settings);
    assert!(shop.settle_parking().await.is_empty());
    shop.assert_converged().await;
    let status = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    assert_eq!((status.notes_parked, status.notes_pending), (0, 0));
    assert_eq!(
        shop.relay.stats.heals.load(Ordering::Relaxed),
        0,
        "the parked row went as a note, not a heal"
    );
    shop.finish().await;
}

// Fault 13, a clock set back: correctness must not rest on wall clocks. Every time either
// side stored is moved a day ahead of both clocks now, as a server or a replica whose
// clock ran a day fast and was then corrected would have left them. Writes must still
// apply and be confirmed, status must still say synced, and a real difference must still
// be healed: the digest's rate limit counted from a stamp in the future suspended
// comparisons for as long as the clock had been wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn times_recorded_ahead_of_the_clocks_change_nothing_applied_confirmed_or_healed() {
    let mut shop = Shop::new("clock").await;
    shop.relay = Relay::new(
        shop.spec.clone(),
        RelaySettings {
            digest_every: Duration::from_secs(3600),
            ..RelaySettings::default()
        },
    );
    let store = shop.store("north").await;
    let order = uuid::Uuid::new_v4();
    shop.db
        .exec(&format!(
            "INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 20) g;
             INSERT INTO orders (id, store_id, note) VALUES ('{order}', '{store}', 'first');"
        ))
        .await;
    shop.settle().await;
    shop.assert_converged().await;
    let digest_at: Option<i64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM digest_at)::int8 FROM ferry_sync.replicas WHERE id = $1",
    )
    .bind(store)
    .fetch_one(&shop.db.pool)
    .await
    .unwrap();
    assert!(
        digest_at.is_some(),
        "the first report's digests were compared"
    );

    // Both sides' stored times a day ahead; writes are noted and recorded meanwhile, so
    // notes and outbox rows carry future times too.
    const DAY_MS: i64 = 86_400_000;
    shop.replicas[&store]
        .conn()
        .execute(
            "UPDATE _ferry_sync_state SET applied_at_ms = applied_at_ms + ?1,
             heard_at_ms = coalesce(heard_at_ms, applied_at_ms) + ?1",
            [DAY_MS],
        )
        .unwrap();
    let ahead = "
        UPDATE ferry_sync.replicas SET digest_at = digest_at + interval '1 day',
          confirmed_at = confirmed_at + interval '1 day';
        UPDATE ferry_sync.reports SET received_at = received_at + interval '1 day';
        UPDATE ferry_sync.notes SET noted_at = noted_at + interval '1 day';
        UPDATE ferry_sync.outbox SET recorded_at = recorded_at + interval '1 day';
        UPDATE ferry_sync.meta SET installed_at = installed_at + interval '1 day';";
    shop.db.exec(ahead).await;
    shop.db
        .exec(&format!(
            "UPDATE products SET price = 0 WHERE id = 3; DELETE FROM products WHERE id = 4;
             UPDATE orders SET note = 'second' WHERE id = '{order}';"
        ))
        .await;
    shop.db.exec(ahead).await;
    shop.passes().await;
    shop.db.exec(ahead).await;
    shop.settle().await;
    shop.assert_converged().await;
    let (last, confirmed): (i64, i64) =
        sqlx::query_as("SELECT last_seq, confirmed_seq FROM ferry_sync.replicas WHERE id = $1")
            .bind(store)
            .fetch_one(&shop.db.pool)
            .await
            .unwrap();
    assert_eq!(confirmed, last, "everything recorded was confirmed");
    assert_eq!(shop.replicas[&store].status().unwrap().seq as i64, last);
    let status = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    assert_eq!(status.replicas[0].standing, "synced", "{status:?}");

    // A real difference is still healed, though the last comparison's stamp is a day
    // ahead of the server's clock and `digest_every` is an hour.
    shop.db.exec(ahead).await;
    shop.replicas[&store]
        .conn()
        .execute_batch("UPDATE products SET name = 'tampered' WHERE id = 5")
        .unwrap();
    shop.settle().await;
    shop.assert_converged().await;
    assert_eq!(
        shop.relay.stats.heals.load(Ordering::Relaxed),
        1,
        "the tampered table was healed"
    );
    shop.finish().await;
}

// Guards guarantee 9 for a row that cannot travel (fault 9's un-encodable server row): a
// product whose float8 is NaN (which never equals itself, so no digest could hold it) is
// quarantined for the stores owed it while the rows beside it flow; status counts it; a
// fix on the server (the value made a number) sends it and clears the quarantine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_cannot_travel_is_quarantined_while_the_rest_flows_and_goes_through_after_a_fix()
{
    let schema = format!(
        "{}ALTER TABLE products ADD COLUMN weight float8;\n",
        common::SHOP_SCHEMA
    );
    let mut shop = Shop::new_with("nan", &schema, common::SHOP_RULES).await;
    let north = shop.store("north").await;
    shop.db
        .exec("INSERT INTO products VALUES (1, 'tea', 1, 'north', 0.5), (2, 'odd', 2, 'north', 'NaN'), (3, 'coffee', 3, 'north', 1.5)")
        .await;
    shop.settle().await;
    let held = shop.held(north);
    assert!(
        held["products"].iter().any(|p| p.starts_with("1|"))
            && held["products"].iter().any(|p| p.starts_with("3|")),
        "the rest flows: {:?}",
        held["products"]
    );
    assert!(
        !held["products"].iter().any(|p| p.starts_with("2|")),
        "the NaN row is not sent"
    );
    let quarantined: Vec<(String, String)> =
        sqlx::query_as("SELECT key, cause FROM ferry_sync.quarantine WHERE replica = $1")
            .bind(north)
            .fetch_all(&shop.db.pool)
            .await
            .unwrap();
    assert_eq!(quarantined, vec![("2".to_string(), "encode".to_string())]);
    let status = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    assert_eq!(status.replicas[0].quarantined, 1);
    // The fix: a number. Its note plans the row again; it travels and leaves quarantine.
    shop.db
        .exec("UPDATE products SET weight = 2.5 WHERE id = 2")
        .await;
    shop.settle().await;
    let held = shop.held(north);
    assert!(
        held["products"].iter().any(|p| p.starts_with("2|")),
        "the fixed row arrives: {:?}",
        held["products"]
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry_sync.quarantine")
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "nothing stays quarantined once the row travelled");
    shop.finish().await;
}
