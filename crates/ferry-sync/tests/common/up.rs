//! What the way-up tests share: record tables for the shop, a transport over the
//! server's own filing that loses and repeats, and reads of what the server filed.

use std::collections::BTreeMap;

use ferry_core::seams::{Rng, SplitMix64};
use ferry_sync::file::{self, Outcome, RecordSpec, Shape};
use ferry_sync::replica::{TransportError, UpSettings, Uplink, Uploader, up_status};
use ferry_sync::wire;
use sqlx::PgPool;
use uuid::Uuid;

pub const RECORDS_SCHEMA: &str = "
CREATE TABLE sales (id uuid PRIMARY KEY, store_id uuid, amount int8 NOT NULL, note text);
CREATE TABLE counters (name text PRIMARY KEY, rev int8 NOT NULL, total numeric(12,2));
";

pub const RECORDS_RULES: &str = r#"
[tables.sales]
mirror = "record"
replica = "store_id"
lane = "sales"

[tables.counters]
mirror = "record"
version = "rev"
"#;

/// A till's settings: a row per store and name that the store owns and the server
/// may wish values for (docs/sync-up.md §7).
pub const SETTINGS_SCHEMA: &str = "
CREATE TABLE till_settings (store_id uuid NOT NULL, name text NOT NULL, price_list text,
  volume int8, rev int8 NOT NULL DEFAULT 0, PRIMARY KEY (store_id, name));
";

pub const SETTINGS_RULES: &str = r#"
[tables.till_settings]
mirror = "setting"
replica = "store_id"
version = "rev"
desired = ["price_list", "volume"]
lane = "settings"
"#;

/// A transport over the server's own filing (no HTTP): it fails before filing, files
/// twice, or files and loses the answer, each with probability `fault` (of 1,000).
pub struct Lossy {
    pub pool: PgPool,
    pub records: Vec<RecordSpec>,
    pub sender: Uuid,
    pub seal_key: [u8; 32],
    pub rng: SplitMix64,
    pub fault: u64,
    pub rt: tokio::runtime::Handle,
    /// Filings that reached the database, answered or not.
    pub filings: u64,
    /// `Some`: uploads given up on (the replica sees a timeout) and kept, to reach the
    /// server later, after newer ones: fault 4's reordering. `None` draws nothing for it.
    pub late: Option<Vec<Vec<u8>>>,
    /// `Some`: an upload's first filing goes through NATS JetStream (a bridge files it
    /// and answers); repeats and late ones are filed directly, as a work queue's
    /// redelivery would.
    pub nats: Option<ferry_sync::nats::link::NatsLink>,
    /// How filing's transaction is shaped (`--file-role`).
    pub shape: Shape,
}

impl Lossy {
    /// Store `store`'s link to the shop's server; `fault` in 1,000 of each kind.
    pub fn new(shop: &super::Shop, store: Uuid, seed: u64, fault: u64) -> Lossy {
        Lossy {
            pool: shop.db.pool.clone(),
            records: shop.spec.records.clone(),
            sender: store,
            seal_key: shop.seal_keys[&store],
            rng: SplitMix64::seeded(seed),
            fault,
            rt: tokio::runtime::Handle::current(),
            filings: 0,
            late: None,
            nats: None,
            shape: Shape::default(),
        }
    }

    /// Files `upload` as the server would, counting the filing.
    fn file(&mut self, upload: &wire::Upload) -> Outcome {
        let outcome = self
            .rt
            .block_on(file::file(
                &self.pool,
                &self.records,
                &self.shape,
                self.sender,
                upload,
            ))
            .expect("filing");
        self.filings += 1;
        outcome
    }

    /// Files `bytes`, the answer thrown away (its replica gave up on it).
    fn file_unanswered(&mut self, bytes: &[u8]) {
        self.file(&wire::decode_upload(bytes).expect("the replica's upload decodes"));
    }

    /// Every upload kept back reaches the server now, oldest first.
    pub fn deliver_late(&mut self) {
        for bytes in self.late.take().unwrap_or_default() {
            self.file_unanswered(&bytes);
        }
        self.late = Some(Vec::new());
    }
}

impl Uplink for Lossy {
    fn upload(&mut self, bytes: &[u8]) -> Result<Vec<u8>, TransportError> {
        if self.late.is_some() && self.fault > 0 {
            let roll = self.rng.next_u64() % 1_000;
            let kept = self.late.as_mut().expect("checked");
            if roll < 100 {
                kept.push(bytes.to_vec());
                return Err(TransportError::Unavailable(
                    "timed out; it may still arrive".into(),
                ));
            }
            if roll < 400 && !kept.is_empty() {
                let first = kept.remove(0);
                self.file_unanswered(&first);
            }
        }
        let roll = self.rng.next_u64() % 1_000;
        let odds = self.fault;
        let fault = |n: u64| roll < odds * n / 3;
        if fault(1) {
            return Err(TransportError::Unavailable("lost on the way there".into()));
        }
        let upload = wire::decode_upload(bytes).expect("the replica's upload decodes");
        let times = if fault(2) { 2 } else { 1 };
        let mut answer = None;
        for time in 0..times {
            answer = Some(match self.nats.as_mut() {
                Some(link) if time == 0 => {
                    self.filings += 1;
                    link.upload(bytes)?
                }
                _ => match self.file(&upload) {
                    Outcome::Filed(filed) => {
                        wire::encode_filed(&filed, &self.seal_key, self.sender.as_bytes())
                    }
                    Outcome::Malformed(m) => panic!("malformed: {m}"),
                },
            });
        }
        if fault(3) {
            return Err(TransportError::Unavailable("the answer was lost".into()));
        }
        Ok(answer.expect("filed at least once"))
    }
}

/// The shop with the record tables and one store in `north`, provisioned: the store, its
/// file, and an app's connection to the file.
pub async fn records_shop(
    prefix: &str,
) -> (super::Shop, Uuid, std::path::PathBuf, rusqlite::Connection) {
    one_store_shop(prefix, RECORDS_SCHEMA, RECORDS_RULES).await
}

/// The shop with `schema` and `rules` added to its own and one store in `north`,
/// provisioned: the store, its file, and an app's connection to the file.
pub async fn one_store_shop(
    prefix: &str,
    schema: &str,
    rules: &str,
) -> (super::Shop, Uuid, std::path::PathBuf, rusqlite::Connection) {
    let mut shop = super::Shop::new_with(
        prefix,
        &format!("{}{schema}", super::SHOP_SCHEMA),
        &format!("{}{rules}", super::SHOP_RULES),
    )
    .await;
    let store = shop.store("north").await;
    shop.settle().await;
    let db = shop.dir.join(format!("{store}.db"));
    let app = rusqlite::Connection::open(&db).unwrap();
    app.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
    (shop, store, db, app)
}

/// Turns until nothing is left unfiled (failures are the transport's: turn again).
pub fn upload_all(uploader: &mut Uploader, link: &mut Lossy, db: &std::path::Path) {
    let conn = rusqlite::Connection::open(db).unwrap();
    for _ in 0..2_000 {
        let _ = uploader.turn(link, &UpSettings::default());
        if up_status(&conn).unwrap().unfiled == 0 {
            return;
        }
    }
    panic!("notes never ran out: {:?}", up_status(&conn).unwrap());
}

pub async fn server_sales(pool: &PgPool) -> BTreeMap<String, (String, i64, Option<String>)> {
    sqlx::query_as::<_, (String, String, i64, Option<String>)>(
        "SELECT id::text, coalesce(store_id::text, 'NULL'), amount, note FROM sales",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, store, amount, note)| (id, (store, amount, note)))
    .collect()
}
