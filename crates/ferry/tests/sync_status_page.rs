//! The status page `ferry sync serve` serves for people (docs/sync.md §12), rendered by a
//! real headless browser (Chromium's headless shell, which `scripts/test` installs) from
//! the versioned `/status` document: replicas by standing, per-table progress, the inbox
//! and wishes, scoped to a partition by the page's own query as `ferry sync status
//! --partition` is.
//!
//! Guards against a page that renders nothing (a script error, a field renamed in the
//! document), shows another partition's replicas, or inserts what it shows as HTML.

#[path = "../../ferry-sync/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::{SHOP_RULES, SHOP_SCHEMA, TestDb};
use ferry_sync::enroll;
use ferry_sync::rules::Rules;
use ferry_testkit::proc::Proc;
use ferry_testkit::{Scratch, free_port, wait_until};
use uuid::Uuid;

/// The headless browser: `FERRY_TEST_BROWSER`, or Chromium's headless shell or Chromium
/// on the PATH.
fn browser() -> PathBuf {
    if let Ok(b) = std::env::var("FERRY_TEST_BROWSER") {
        return b.into();
    }
    ["chromium-headless-shell", "chromium", "chromium-browser"]
        .iter()
        .flat_map(|name| {
            std::env::var_os("PATH")
                .map(|p| std::env::split_paths(&p).map(|d| d.join(name)).collect::<Vec<_>>())
                .unwrap_or_default()
        })
        .find(|p| p.exists())
        .expect(
            "no headless browser: run scripts/test (it installs chromium-headless-shell), or set FERRY_TEST_BROWSER",
        )
}

/// The page at `url` as the browser rendered it, its scripts run and its fetches
/// answered.
fn rendered(url: &str, profile: &Path) -> String {
    let out = Command::new(browser())
        .args([
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=5000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("--dump-dom")
        .arg(url)
        .output()
        .expect("the headless browser runs");
    assert!(
        out.status.success(),
        "the browser failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_renders_the_status_document_in_a_real_browser_scoped_by_partition() {
    let scratch = Scratch::new("sync-status-page");
    let db = TestDb::new("status_page").await;
    db.exec(SHOP_SCHEMA).await;
    db.exec(
        "CREATE TABLE tills (store_id uuid PRIMARY KEY, price_list text, rev int8 NOT NULL DEFAULT 0);",
    )
    .await;
    let rules_text = format!(
        "{SHOP_RULES}\n[tables.tills]\nmirror = \"setting\"\nreplica = \"store_id\"\nversion = \"rev\"\ndesired = [\"price_list\"]\n"
    );
    let rules_file = scratch.path().join("rules.toml");
    std::fs::write(&rules_file, &rules_text).unwrap();
    let rules = Rules::parse(&rules_text, &rules_file).unwrap();
    ferry_sync::schema::install(&db.pool, &rules).await.unwrap();
    let (north, south) = (Uuid::new_v4(), Uuid::new_v4());
    // A name a page that inserted HTML would turn into markup.
    let evil = "<b id=\"injected\">x</b>";
    db.exec(&format!(
        "INSERT INTO stores (id, region) VALUES ('{north}', 'north'), ('{south}', 'south');
         INSERT INTO products SELECT g, 'p' || g, g, 'north' FROM generate_series(1, 5) g;"
    ))
    .await;
    let mut conn = db.pool.acquire().await.unwrap();
    for store in [north, south] {
        enroll::enroll(&mut conn, store, &enroll::new_token())
            .await
            .unwrap();
    }
    ferry_sync::wish::wish(
        &mut conn,
        north,
        "tills",
        &serde_json::json!([north]),
        &serde_json::json!({ "price_list": "summer" }),
        None,
        None,
    )
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO ferry_sync.inbox (replica, relation, key, row, reason) VALUES ($1, 'public.sales', 'k1', '\\x00', $2)",
    )
    .bind(north)
    .bind(evil)
    .execute(&mut *conn)
    .await
    .unwrap();
    drop(conn);

    let port = free_port();
    let _serve = Proc::spawn(
        "serve",
        Path::new(env!("CARGO_BIN_EXE_ferry")),
        &[
            "sync",
            "serve",
            "--rules",
            rules_file.to_str().unwrap(),
            "--db",
            &db.url,
            "--listen",
            &format!("127.0.0.1:{port}"),
        ],
        &[("FERRY_LOG", "info")],
        &scratch.path().join("serve.log"),
    );
    // The relay has recorded the stores' first messages once the document shows them.
    let doc = || -> Option<serde_json::Value> {
        let body = ureq::get(&format!("http://127.0.0.1:{port}/status"))
            .call()
            .ok()?
            .body_mut()
            .read_to_string()
            .ok()?;
        serde_json::from_str(&body).ok()
    };
    let recorded = wait_until(Duration::from_secs(30), || {
        doc().is_some_and(|d| {
            d["replicas"]
                .as_array()
                .is_some_and(|r| r.len() == 2 && r.iter().all(|r| r["last_seq"].as_i64() > Some(0)))
        })
    });
    assert!(
        recorded,
        "the relay never recorded the stores' messages: {:?}",
        doc()
    );
    let d = doc().unwrap();
    assert_eq!(d["version"], 1, "{d}");

    let profile = scratch.path().join("browser");
    let all = rendered(&format!("http://127.0.0.1:{port}/"), &profile);
    assert!(
        all.contains("data-rendered=\"yes\""),
        "the page never rendered:\n{all}"
    );
    for (what, needle) in [
        ("north's row", format!("data-replica=\"{north}\"")),
        ("south's row", format!("data-replica=\"{south}\"")),
        ("a standing", "class=\"standing silent\"".to_string()),
        (
            "per-table progress",
            "data-table=\"public.products\"".to_string(),
        ),
        ("north's pending wish", "1 / 0 / 0 / 0 / 0".to_string()),
        ("the inbox row's table", "public.sales".to_string()),
        ("all partitions", "all partitions".to_string()),
    ] {
        assert!(all.contains(&needle), "no {what} ({needle:?}) in:\n{all}");
    }
    assert!(
        !all.contains("<b id=\"injected\">")
            && all.contains("&lt;b id=\"injected\"&gt;x&lt;/b&gt;"),
        "text from the database must show as text:\n{all}"
    );

    let scoped = rendered(
        &format!("http://127.0.0.1:{port}/?partition=south"),
        &profile,
    );
    assert!(scoped.contains("data-rendered=\"yes\""), "{scoped}");
    assert!(
        scoped.contains(&format!("data-replica=\"{south}\"")),
        "{scoped}"
    );
    assert!(
        !scoped.contains(&north.to_string()),
        "north is another partition's: it must not show, nor its inbox:\n{scoped}"
    );
    assert!(scoped.contains("partition south"), "{scoped}");
    drop(_serve);
    db.drop_db().await;
}
