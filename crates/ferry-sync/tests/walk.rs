//! A seeded random walk over the shop (docs/sync.md §1 guarantee 1): whatever the writes,
//! and whatever a lossy, repeating, reordering transport, killed replicas and relays
//! killed mid-pass do meanwhile, once writes stop and the transport delivers every store
//! holds exactly the rows its rules route to it, in content, and status calls it synced.
//! Both ways: the stores' apps write sales and counters (docs/sync-up.md) that go up
//! through a transport that fails, files twice and loses answers, with uploaders killed
//! at random; at the end the server holds every store's sales exactly once, under the
//! store that wrote them, and each counter at its newest version. Orders are two-way: the
//! stores' apps set their `status` while the server edits, moves and deletes them. Wishes
//! come from three angles at once: the server wishes and withdraws (some transactions
//! roll back), the store's app writes the same setting rows, and the store's till refuses
//! or puts off some wishes; region moves start new chains, which state the settings
//! again. At the end every wish the server holds is answered for its own number, the
//! answer is what the till and the row's history allow, the server's settings are the
//! stores', and a store's `status` on an order it holds is the server's.
//!
//! The oracle is `Shop::expected` (the rules written as plain SQL from the doc) against
//! what each SQLite file holds. In half the seeds the replicas never send digests, so the
//! relay's safety net (a table heal on a digest mismatch) cannot cover a planner bug; in
//! the other half they send them on every report and the relay compares them at once, so
//! heals run in the middle of everything else.
//!
//! `FERRY_SYNC_WALK_SEEDS=N` runs seeds 0..N (default 6), `FERRY_SYNC_WALK_SEED=K` runs
//! seed K alone (a failure names its seed), `FERRY_SYNC_WALK_STEPS` sets the steps per
//! seed (default 400). `scripts/soak-sync` runs many seeds in release mode. To tell a
//! failure of the way down from one of the way up: `FERRY_SYNC_WALK_NO_UP=1` takes the
//! way-up steps' random draws but does nothing with them (the rest of the walk is the
//! same), and `FERRY_SYNC_WALK_NO_RECORDS=1` runs on the shop without record tables.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use common::up::{
    Lossy, RECORDS_RULES, RECORDS_SCHEMA, SETTINGS_RULES, SETTINGS_SCHEMA, upload_all,
};
use common::{SHOP_RULES, SHOP_SCHEMA, Shop};
use ferry_sync::nats::Names;
use ferry_sync::nats::bridge::Bridge;
use ferry_sync::nats::link::NatsLink;
use ferry_sync::relay::{Relay, RelaySettings};
use ferry_sync::replica::{CarryOut, Downlink, Outcome, Position, Received, Uploader, Wish};
use ferry_sync::value::Value;
use ferry_sync::{wire, wish};
use ferry_testkit::servers::PrivateNats;
use serde_json::json;
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_converges_on_its_rules_through_a_seeded_random_walk() {
    walks(Mode::default(), 6, 400).await;
}

/// How a walk runs besides its seed: over NATS, over relay shards, with audiences.
#[derive(Clone, Copy, Debug)]
struct Mode {
    nats: bool,
    shards: u32,
    audiences: bool,
}

impl Default for Mode {
    fn default() -> Mode {
        Mode {
            nats: false,
            shards: 1,
            audiences: false,
        }
    }
}

impl Mode {
    /// The walk's test, and its environment variables' infix.
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Mode { nats: true, .. } => ("over_nats", "NATS_"),
            Mode {
                audiences: true, ..
            } => ("with_audiences", "AUDIENCES_"),
            Mode { shards: 2.., .. } => ("with_relay_shards", "SHARDS_"),
            _ => ("seeded_random_walk", ""),
        }
    }
}

/// The same walk with two audiences (docs/sync-scale.md §1): tills hold products without
/// their cost, back offices with it (a column Postgres computes from the price), and a
/// step now and then turns a store from one into the other, which must leave it the
/// other's shape (no cost on a till) with nothing stale.
/// `FERRY_SYNC_WALK_AUDIENCES_SEEDS`, `FERRY_SYNC_WALK_AUDIENCES_STEPS`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_converges_with_audiences_through_the_same_walk() {
    let mode = Mode {
        audiences: true,
        ..Mode::default()
    };
    walks(mode, 2, 300).await;
}

/// The same walk with the replicas spread over three relay shards (docs/sync-scale.md §2):
/// every pass step runs one shard's pass, picked at random, so the shards fall behind
/// and catch up on each other's notes; shard 0's relay is the one killed mid-pass.
/// `FERRY_SYNC_WALK_SHARDS_SEEDS`, `FERRY_SYNC_WALK_SHARDS_STEPS`; `FERRY_SYNC_WALK_SEED`
/// picks one here too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_converges_with_relay_shards_through_the_same_walk() {
    let seeds = env_u64("FERRY_SYNC_WALK_SHARDS_SEEDS").unwrap_or(2);
    let steps = env_u64("FERRY_SYNC_WALK_SHARDS_STEPS").unwrap_or(300);
    let mode = Mode {
        shards: 3,
        ..Mode::default()
    };
    walks(mode, seeds, steps).await;
}

/// The same walk with NATS JetStream carrying frames, reports and uploads (docs/sync-nats.md): a bridge publishes the outbox and files what comes up; each store fetches
/// through its durable consumer, and a store killed comes back on a new link. The
/// walk's faults act on top: frames the consumer delivered are dropped, repeated and
/// reordered, which the link must make good by reading them again from where the
/// replica stands. Fewer seeds and steps by default (`FERRY_SYNC_WALK_NATS_SEEDS`,
/// `FERRY_SYNC_WALK_NATS_STEPS`); `FERRY_SYNC_WALK_SEED` picks one here too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_store_converges_over_nats_jetstream_through_the_same_walk() {
    let seeds = env_u64("FERRY_SYNC_WALK_NATS_SEEDS").unwrap_or(2);
    let steps = env_u64("FERRY_SYNC_WALK_NATS_STEPS").unwrap_or(300);
    let mode = Mode {
        nats: true,
        ..Mode::default()
    };
    walks(mode, seeds, steps).await;
}

async fn walks(mode: Mode, default_seeds: u64, default_steps: u64) {
    let which = mode.names().1;
    let seeds: Vec<u64> = match env_u64("FERRY_SYNC_WALK_SEED") {
        Some(seed) => vec![seed],
        None => (0..env_u64(&format!("FERRY_SYNC_WALK_{which}SEEDS")).unwrap_or(default_seeds))
            .collect(),
    };
    let steps = env_u64(&format!("FERRY_SYNC_WALK_{which}STEPS")).unwrap_or(default_steps) as usize;
    let started = Instant::now();
    for seed in seeds {
        let one = Instant::now();
        let guard = Replay(seed, mode);
        walk(seed, steps, mode).await;
        drop(guard);
        eprintln!(
            "walk seed {seed} ({mode:?}): {steps} steps in {:?}",
            one.elapsed()
        );
    }
    eprintln!("walk: done in {:?}", started.elapsed());
}

/// Names a failing seed and the way to replay it, as the panic unwinds.
struct Replay(u64, Mode);

impl Drop for Replay {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "walk seed {seed} failed; replay it alone with FERRY_SYNC_WALK_SEED={seed} \
                 cargo test -p ferry-sync --test walk {which} -- --nocapture",
                seed = self.0,
                which = self.1.names().0,
            );
        }
    }
}

/// How the walk's frames and reports travel (uploads: `Lossy`, with its own link): the
/// database directly (serve's own reads and writes), or NATS JetStream through a bridge.
struct Carrier {
    nats: Option<NatsCarrier>,
}

struct NatsCarrier {
    url: String,
    names: Names,
    /// Each store's link down (its consumer); a store killed gets a new one.
    links: BTreeMap<Uuid, NatsLink>,
    stop: tokio::sync::watch::Sender<bool>,
    _server: PrivateNats,
    _scratch: ferry_testkit::Scratch,
}

impl Carrier {
    async fn new(shop: &Shop, seed: u64, nats: bool) -> Carrier {
        if !nats {
            return Carrier { nats: None };
        }
        let scratch = ferry_testkit::Scratch::new(&format!("sync-walk-nats-{seed}"));
        let server = PrivateNats::start(scratch.path());
        let names = Names::new(&format!("walk{seed}")).unwrap();
        let pool = sqlx::PgPool::connect(&shop.db.url).await.unwrap();
        let serve = ferry_sync::serve::Serve::new(pool, Default::default())
            .await
            .unwrap()
            .file_into(shop.spec.records.clone(), Default::default());
        let bridge = Bridge::connect(serve, &server.url(), names.clone())
            .await
            .expect("the bridge connects");
        let (stop, stopped) = tokio::sync::watch::channel(false);
        tokio::spawn(async move { bridge.run(stopped).await.expect("the bridge runs") });
        Carrier {
            nats: Some(NatsCarrier {
                url: server.url(),
                names,
                links: BTreeMap::new(),
                stop,
                _server: server,
                _scratch: scratch,
            }),
        }
    }

    /// A link for store `id`'s uploads, when uploads travel over NATS.
    fn uplink(&self, shop: &Shop, id: Uuid) -> Option<NatsLink> {
        let n = self.nats.as_ref()?;
        let token = shop.tokens[&id].clone();
        Some(tokio::task::block_in_place(|| {
            NatsLink::new(&n.url, n.names.clone(), id, &token).unwrap()
        }))
    }

    /// Up to `max` frames for store `id` standing at `status`; over NATS, waiting up to
    /// `wait` for the bridge to publish.
    async fn frames(
        &mut self,
        shop: &Shop,
        id: Uuid,
        status: &ferry_sync::replica::ReplicaStatus,
        max: usize,
        wait: Duration,
    ) -> Vec<Vec<u8>> {
        let epoch = status
            .epoch
            .as_deref()
            .and_then(|h| Uuid::parse_str(h).ok());
        let Some(n) = self.nats.as_mut() else {
            return ferry_sync::serve::frames_after(&shop.db.pool, id, epoch, status.seq, max)
                .await
                .unwrap();
        };
        let token = shop.tokens[&id].clone();
        let (url, names) = (n.url.clone(), n.names.clone());
        let link = n.links.entry(id).or_insert_with(|| {
            tokio::task::block_in_place(|| NatsLink::new(&url, names, id, &token).unwrap())
        });
        let position = Position {
            epoch: epoch.map(|e| *e.as_bytes()),
            seq: status.seq,
            nonce: 0,
        };
        tokio::task::block_in_place(|| link.fetch(position, max, wait))
            .unwrap_or_else(|e| panic!("store {id}: fetching over NATS: {e}"))
    }

    /// Sends store `id`'s report and returns once the server stored it.
    async fn report(&mut self, shop: &Shop, id: Uuid, up: &[u8]) {
        let Some(n) = self.nats.as_mut() else {
            ferry_sync::serve::store_report(&shop.db.pool, id, up)
                .await
                .unwrap();
            return;
        };
        let stored = || async {
            sqlx::query_scalar::<_, i64>("SELECT n FROM ferry_sync.reports WHERE replica = $1")
                .bind(id)
                .fetch_optional(&shop.db.pool)
                .await
                .unwrap()
        };
        let before = stored().await;
        let link = n
            .links
            .get_mut(&id)
            .expect("a store reports after it fetched");
        tokio::task::block_in_place(|| link.report(up))
            .unwrap_or_else(|e| panic!("store {id}: reporting over NATS: {e}"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while stored().await == before {
            assert!(
                Instant::now() < deadline,
                "store {id}: the bridge never stored its report"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Store `id`'s process was killed: its link goes with it.
    fn killed(&mut self, id: Uuid) {
        if let Some(n) = self.nats.as_mut() {
            n.links.remove(&id);
        }
    }

    fn wait(&self) -> Duration {
        if self.nats.is_some() {
            Duration::from_millis(150)
        } else {
            Duration::ZERO
        }
    }
}

impl Drop for Carrier {
    fn drop(&mut self) {
        if let Some(n) = &self.nats {
            let _ = n.stop.send(true);
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let text = std::env::var(name).ok()?;
    Some(
        text.parse()
            .unwrap_or_else(|_| panic!("{name}={text} is not a number")),
    )
}

/// splitmix64: small, deterministic, and good enough to choose steps.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in 0..n (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// True with probability `percent` / 100.
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> Option<&'a T> {
        if items.is_empty() {
            None
        } else {
            Some(&items[self.below(items.len() as u64) as usize])
        }
    }

    fn uuid(&mut self) -> Uuid {
        Uuid::from_u64_pair(self.next(), self.next())
    }
}

const REGIONS: [&str; 2] = ["north", "south"];
/// Product ids come from a small range, so inserts collide with existing rows and
/// deletes hit rows that lines point at.
const PRODUCT_IDS: u64 = 24;
/// Names that exercise key and value escaping (`|`, `\`) and non-ASCII text. No quote:
/// the walk writes its SQL with `format!`.
const NAMES: [&str; 7] = ["tea", "a|b", "back\\slash", "x\\|y|", "", "ünï", "|"];

/// What one seed chose once: its stores and faults.
struct Plan {
    /// The stores open from the start, and a late one that starts at `late_at`.
    stores: Vec<(Uuid, &'static str)>,
    late: Option<(Uuid, &'static str, usize)>,
    /// One store closes at the first step and opens again at the second (if ever).
    close: Option<(Uuid, usize, Option<usize>)>,
    /// Replicas send digests on every report and the relay compares them at once.
    digests: bool,
}

/// The walk's own picture of which ids may exist: only to aim writes at likely rows.
/// Every write is valid SQL whether or not the row is still there.
#[derive(Default)]
struct Ids {
    stores: Vec<Uuid>,
    customers: Vec<Uuid>,
    orders: Vec<Uuid>,
}

async fn walk(seed: u64, steps: usize, mode: Mode) {
    let Mode {
        nats,
        shards,
        audiences,
    } = mode;
    let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x5EED);
    let relay = if shards > 1 {
        format!("\n[relay]\nshards = {shards}\n")
    } else {
        String::new()
    };
    let (shop_schema, shop_rules) = if audiences {
        (
            format!("{SHOP_SCHEMA}{AUDIENCES_SCHEMA}"),
            SHOP_RULES
                .replace(
                    "relation = \"stores\"\n",
                    "relation = \"stores\"\naudience = \"kind\"\n",
                )
                .replace(
                    "[tables.products]\nsync = \"broadcast\"\npartition = \"region\"\n",
                    AUDIENCES_PRODUCTS,
                )
                .replace(
                    "[tables.order_lines]\nsync = { follows = \"order_id\" }\n",
                    AUDIENCES_LINES,
                ),
        )
    } else {
        (SHOP_SCHEMA.to_string(), SHOP_RULES.to_string())
    };
    let mut shop = if std::env::var_os("FERRY_SYNC_WALK_NO_RECORDS").is_some() {
        Shop::new_with(
            &format!("walk{seed}"),
            &shop_schema,
            &format!("{shop_rules}{relay}"),
        )
        .await
    } else {
        // Orders become two-way: the stores write their `status`.
        let rules = shop_rules.replace(
            "[tables.orders]\n",
            "[tables.orders]\nmirror = \"both\"\nreplica_writes = [\"status\"]\nlane = \"orders\"\n",
        );
        Shop::new_with(
            &format!("walk{seed}"),
            &format!(
                "{shop_schema}{RECORDS_SCHEMA}{SETTINGS_SCHEMA}ALTER TABLE orders ADD COLUMN status text;"
            ),
            &format!("{rules}{RECORDS_RULES}{SETTINGS_RULES}{relay}"),
        )
        .await
    };
    let plan = plan(&mut rng, steps);
    shop.relay = new_relay(&shop, &mut rng, plan.digests);
    let mut carrier = Carrier::new(&shop, seed, nats).await;
    let mut ids = Ids::default();
    let mut book = Book::default();
    let mut ups: BTreeMap<Uuid, Up> = BTreeMap::new();
    for (id, region) in &plan.stores {
        shop.store_as(*id, region).await;
        ids.stores.push(*id);
        ups.insert(*id, Up::new(&shop, *id, rng.next(), &carrier));
    }
    // Frames a delivery held back, delivered (late, repeated) by a later one.
    let mut late_frames: BTreeMap<Uuid, Vec<Vec<u8>>> = BTreeMap::new();
    let mut heals = 0;
    for step in 0..steps {
        if let Some((id, region, at)) = plan.late
            && at == step
        {
            shop.store_as(id, region).await;
            ids.stores.push(id);
            ups.insert(id, Up::new(&shop, id, rng.next(), &carrier));
        }
        if let Some((id, close_at, reopen_at)) = plan.close {
            if close_at == step {
                set_open(&shop, id, false).await;
            }
            if reopen_at == Some(step) {
                set_open(&shop, id, true).await;
            }
        }
        let choice = rng.below(100);
        if trace() {
            eprintln!("step {step}: {choice}");
        }
        match choice {
            0..=31 => write(&shop, &mut rng, &mut ids).await,
            32..=34 => server_wish(&shop, &mut rng, &ids.stores, &mut book, step).await,
            35..=39 => {
                let id = *rng.pick(&ids.stores).expect("a store exists");
                app_write(&shop, &mut rng, id, &mut book, step);
            }
            40..=44 => {
                let id = *rng.pick(&ids.stores).expect("a store exists");
                let up = ups.remove(&id).expect("every store has its uploader");
                let (restart, turns) = (rng.chance(15), 1 + rng.below(3) as usize);
                if rng.chance(70) && ways_up() {
                    // The replica's loop carries wishes out after its messages commit.
                    carry_out(&mut shop, id);
                }
                let up = if std::env::var_os("FERRY_SYNC_WALK_NO_UP").is_some() {
                    up
                } else if restart {
                    // The uploader's process killed and started again: what it held in
                    // memory (a batch sent, its Filed lost) is gone; its file stays.
                    up.restarted(&shop, id, &carrier)
                } else {
                    up.turns(turns).await
                };
                ups.insert(id, up);
            }
            45..=59 => {
                // One shard's pass (with shards, a random one: the others fall behind).
                let k = if shop.shards.is_empty() {
                    0
                } else {
                    rng.below(1 + shop.shards.len() as u64) as usize
                };
                let (relay, lock) = match k {
                    0 => (&mut shop.relay, &mut shop.lock),
                    _ => {
                        let (r, l) = &mut shop.shards[k - 1];
                        (r, l)
                    }
                };
                let report = relay
                    .pass(lock)
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed} step {step}: pass: {e}"));
                if trace() {
                    eprintln!("  pass: {report:?}");
                }
            }
            60..=89 => {
                let id = *rng.pick(&ids.stores).expect("a store exists");
                deliver_faulty(
                    &mut shop,
                    &mut carrier,
                    &mut rng,
                    id,
                    &mut late_frames,
                    plan.digests,
                )
                .await;
            }
            90..=93 => {
                let id = *rng.pick(&ids.stores).expect("a store exists");
                shop.reopen(id);
                carrier.killed(id);
            }
            94..=96 => {
                heals += shop
                    .relay
                    .stats
                    .heals
                    .load(std::sync::atomic::Ordering::Relaxed);
                kill_relay_mid_pass(&mut shop, &mut rng, plan.digests).await;
            }
            _ if audiences && rng.chance(50) => {
                // A store turns from a till into a back office or back: it is
                // provisioned in the other audience's shape.
                let id = *rng.pick(&ids.stores).expect("a store exists");
                if trace() {
                    eprintln!("  store {id} changes audience");
                }
                shop.db
                    .exec(&format!(
                        "UPDATE stores SET kind = CASE kind WHEN 'till' THEN 'office' ELSE 'till' END WHERE id = '{id}'"
                    ))
                    .await;
            }
            _ => {
                // A store moves region: it is provisioned for its new partition.
                let id = *rng.pick(&ids.stores).expect("a store exists");
                let region = REGIONS[rng.below(2) as usize];
                if trace() {
                    eprintln!("  store {id} moves to {region}");
                }
                shop.db
                    .exec(&format!(
                        "UPDATE stores SET region = '{region}' WHERE id = '{id}'"
                    ))
                    .await;
            }
        }
    }

    // Writes stop; the transport delivers faithfully until nothing moves.
    quiesce(&mut shop, &mut carrier, seed).await;
    let closed = plan
        .close
        .filter(|(_, _, reopen)| reopen.is_none_or(|at| at >= steps))
        .map(|(id, _, _)| id);
    if let Some(id) = closed {
        // A closed store is sent nothing more; what its file still holds is its own.
        shop.replicas.remove(&id);
    }
    shop.assert_converged().await;
    if audiences {
        each_audience_has_its_shape(&shop, seed).await;
    }
    the_way_up_is_exactly_once(&shop, seed, &mut ups).await;
    wishes_are_answered_and_two_way_rows_agree(&mut shop, seed, &mut ups, &book).await;
    let status = ferry_sync::status::read(&shop.db.pool, None).await.unwrap();
    for r in &status.replicas {
        let expected = if Some(r.id.as_str()) == closed.map(|c| c.to_string()).as_deref() {
            "retired"
        } else {
            "synced"
        };
        assert_eq!(r.standing, expected, "seed {seed}: {r:?}");
    }
    assert_eq!(status.notes_parked, 0, "seed {seed}: no note was parked");
    // The converged replicas' digests agree with what the server says they hold: with
    // everything delivered, a digest now that asks for a heal is a fingerprint bug.
    let before = shop.heals();
    shop.settle().await;
    let after = shop.heals();
    assert_eq!(
        after, before,
        "seed {seed}: converged replicas' digests differ"
    );
    shop.assert_converged().await;
    heals += after;
    eprintln!(
        "walk seed {seed}: digests {}, heals during the walk {heals}",
        plan.digests
    );
    shop.finish().await;
}

/// Stores are tills or back offices; a product's cost (half its price, computed by
/// Postgres) is the back offices' alone.
const AUDIENCES_SCHEMA: &str = "
ALTER TABLE stores ADD COLUMN kind text NOT NULL DEFAULT 'till';
ALTER TABLE products ADD COLUMN cost numeric GENERATED ALWAYS AS (price / 2) STORED;
";

const AUDIENCES_PRODUCTS: &str = r#"[tables.till_products]
table = "products"
audience = "till"
sync = "broadcast"
partition = "region"
columns = ["id", "name", "price", "region"]

[tables.office_products]
table = "products"
audience = "office"
sync = "broadcast"
partition = "region"
"#;

/// Order lines point at products, which each audience has in its own shape: so they
/// have an entry per audience too (docs/sync-scale.md §1, foreign keys stay inside one).
const AUDIENCES_LINES: &str = r#"[tables.till_lines]
table = "order_lines"
audience = "till"
sync = { follows = "order_id" }

[tables.office_lines]
table = "order_lines"
audience = "office"
sync = { follows = "order_id" }
"#;

/// A till's products have no cost column; a back office's have each product's cost.
/// (Which rows each holds, the walk's shared check has compared already.)
async fn each_audience_has_its_shape(shop: &Shop, seed: u64) {
    for (id, replica) in &shop.replicas {
        let kind: String = sqlx::query_scalar("SELECT kind FROM stores WHERE id = $1")
            .bind(id)
            .fetch_one(&shop.db.pool)
            .await
            .unwrap();
        let conn = replica.conn();
        let has_cost: bool = conn
            .query_row(
                "SELECT count(*) > 0 FROM pragma_table_info('products') WHERE name = 'cost'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        if kind == "till" {
            assert!(!has_cost, "seed {seed}: till {id} holds the cost column");
            continue;
        }
        assert!(
            has_cost,
            "seed {seed}: back office {id} lacks the cost column"
        );
        let held: BTreeSet<String> = conn
            .prepare("SELECT id || '|' || coalesce(cost, 'NULL') FROM products")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let keys: Vec<i64> = conn
            .prepare("SELECT id FROM products")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let expected: BTreeSet<String> = sqlx::query_scalar(
            "SELECT id::text || '|' || coalesce(cost::text, 'NULL') FROM products WHERE id = ANY($1)",
        )
        .bind(&keys)
        .fetch_all(&shop.db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
        assert_eq!(held, expected, "seed {seed}: back office {id}'s costs");
    }
}

/// One store's way up: its uploader (a process of its own) and the lossy transport.
struct Up {
    uploader: Uploader,
    link: Lossy,
}

impl Up {
    fn new(shop: &Shop, id: Uuid, seed: u64, carrier: &Carrier) -> Up {
        let mut link = Lossy::new(shop, id, seed, 300);
        link.late = Some(Vec::new());
        link.nats = carrier.uplink(shop, id);
        Up {
            uploader: Uploader::open(&shop.dir.join(format!("{id}.db")), shop.seal_keys[&id], id)
                .unwrap(),
            link,
        }
    }

    fn restarted(self, shop: &Shop, id: Uuid, carrier: &Carrier) -> Up {
        drop(self.uploader);
        let mut link = self.link;
        // A new process, a new link: answers on their way to the old one are lost.
        link.nats = carrier.uplink(shop, id);
        Up {
            uploader: Uploader::open(&shop.dir.join(format!("{id}.db")), shop.seal_keys[&id], id)
                .unwrap(),
            link,
        }
    }

    /// `n` turns; a failed one (the transport's fault) is what the walk wants to see.
    async fn turns(mut self, n: usize) -> Up {
        tokio::task::spawn_blocking(move || {
            for _ in 0..n {
                let _ = self
                    .uploader
                    .turn(&mut self.link, &ferry_sync::replica::UpSettings::default());
            }
            self
        })
        .await
        .unwrap()
    }
}

/// The store's app writes to the tables it writes (once a snapshot created them): a new
/// sale, an edit or a delete of one, a counter's newer version, an order's status, or
/// one of its settings (raising the version, as the rules ask).
fn app_write(shop: &Shop, rng: &mut Rng, id: Uuid, book: &mut Book, step: usize) {
    // Every draw is taken whatever the file holds, so the rest of the walk does not
    // depend on what the store's app found.
    let (kind, sale, amount) = (rng.below(17), rng.uuid(), rng.below(1_000));
    let (counter, units, cents) = (rng.below(3), rng.below(100), rng.below(100));
    let setting = SETTINGS[rng.below(2) as usize];
    if std::env::var_os("FERRY_SYNC_WALK_NO_UP").is_some() {
        return;
    }
    let app = rusqlite::Connection::open(shop.dir.join(format!("{id}.db"))).unwrap();
    app.busy_timeout(Duration::from_secs(5)).unwrap();
    let ready = writes_ready(&app);
    if !ready {
        return;
    }
    let some_sale = || -> Option<String> {
        app.query_row(
            "SELECT id FROM sales ORDER BY id LIMIT 1 OFFSET ?1 % max(1, (SELECT count(*) FROM sales))",
            [amount as i64],
            |r| r.get(0),
        )
        .ok()
    };
    let sql = match kind {
        0..=4 => format!(
            "INSERT INTO sales (id, store_id, amount, note) VALUES ('{sale}', '{id}', {amount}, 'new')"
        ),
        5 | 6 => match some_sale() {
            Some(sale) => {
                format!("UPDATE sales SET amount = amount + 1, note = 'edited' WHERE id = '{sale}'")
            }
            None => return,
        },
        7 => match some_sale() {
            Some(sale) => format!("DELETE FROM sales WHERE id = '{sale}'"),
            None => return,
        },
        8 | 9 => format!(
            "INSERT INTO counters (name, rev, total) VALUES ('c{counter}', 1, '0.00')
             ON CONFLICT (name) DO UPDATE SET rev = rev + 1, total = '{units}.{cents:02}'"
        ),
        10 | 11 => format!(
            "UPDATE orders SET status = 's{amount}' WHERE id = (SELECT id FROM orders ORDER BY id
             LIMIT 1 OFFSET {amount} % max(1, (SELECT count(*) FROM orders)))"
        ),
        _ => {
            book.app_wrote.insert((id, setting), step);
            format!(
                "INSERT INTO till_settings (store_id, name, price_list, volume, rev)
                 VALUES ('{id}', '{setting}', 'a{units}', {cents}, 1)
                 ON CONFLICT (store_id, name) DO UPDATE SET price_list = excluded.price_list,
                   volume = excluded.volume, rev = rev + 1"
            )
        }
    };
    if trace() {
        eprintln!("  store {id} app: {sql}");
    }
    app.execute_batch(&sql).unwrap();
}

/// Whether a snapshot has created the tables the store's app writes.
fn writes_ready(app: &rusqlite::Connection) -> bool {
    app.query_row(
        "SELECT count(*) = 4 FROM sqlite_schema WHERE name IN ('sales', 'counters', 'orders', 'till_settings')",
        [],
        |r| r.get(0),
    )
    .unwrap()
}

/// After the walk: every uploader, on a faithful transport, first checks the server's
/// filing count (a restore would show there) and sends what is left; then the server's
/// sales are exactly the union of the stores' (each once, under its store), and each
/// counter is at the newest version any store wrote.
async fn the_way_up_is_exactly_once(shop: &Shop, seed: u64, ups: &mut BTreeMap<Uuid, Up>) {
    if std::env::var_os("FERRY_SYNC_WALK_NO_RECORDS").is_some() {
        return;
    }
    let mut want_sales = BTreeMap::new();
    let mut want_revs: BTreeMap<String, i64> = BTreeMap::new();
    let ids: Vec<Uuid> = ups.keys().copied().collect();
    for id in ids {
        let mut up = ups.remove(&id).expect("listed");
        up.link.fault = 0;
        let db = shop.dir.join(format!("{id}.db"));
        let db2 = db.clone();
        let up = tokio::task::spawn_blocking(move || {
            up.uploader.check_server(&mut up.link).unwrap();
            upload_all(&mut up.uploader, &mut up.link, &db2);
            // What the transport kept back arrives last, after everything newer: it must
            // change nothing (fault 4, reordered).
            up.link.deliver_late();
            up
        })
        .await
        .unwrap();
        ups.insert(id, up);
        let app = rusqlite::Connection::open(&db).unwrap();
        if !writes_ready(&app) {
            continue;
        }
        let mut stmt = app.prepare("SELECT id FROM sales").unwrap();
        for sale in stmt.query_map([], |r| r.get::<_, String>(0)).unwrap() {
            want_sales.insert(sale.unwrap(), id.to_string());
        }
        let mut stmt = app.prepare("SELECT name, rev FROM counters").unwrap();
        for row in stmt
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))
            .unwrap()
        {
            let (name, rev) = row.unwrap();
            let best = want_revs.entry(name).or_insert(rev);
            *best = (*best).max(rev);
        }
    }
    let have_sales: BTreeMap<String, String> =
        sqlx::query_as("SELECT id::text, store_id::text FROM sales")
            .fetch_all(&shop.db.pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(
        have_sales, want_sales,
        "seed {seed}: the server's sales are not the stores' sales, once each"
    );
    let have_revs: BTreeMap<String, i64> = sqlx::query_as("SELECT name, rev FROM counters")
        .fetch_all(&shop.db.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(
        have_revs, want_revs,
        "seed {seed}: a counter is not at its newest version"
    );
    eprintln!(
        "walk seed {seed}: {} sales and {} counters filed",
        have_sales.len(),
        have_revs.len()
    );
}

/// A setting row's price list, volume and version.
type Setting = (Option<String>, Option<i64>, i64);

/// The setting rows each store has: `till_settings` keyed by (store, name).
const SETTINGS: [&str; 2] = ["till", "drawer"];

/// The walk's account of wishes: the server's current wish per setting row, and when the
/// store's app last wrote the row itself.
#[derive(Default)]
struct Book {
    wishes: BTreeMap<(Uuid, &'static str), Made>,
    app_wrote: BTreeMap<(Uuid, &'static str), usize>,
}

/// A wish as the server made it, at a step.
#[derive(Debug)]
struct Made {
    number: i64,
    values: serde_json::Value,
    if_version: Option<i64>,
    at: usize,
}

/// Whether the way up runs in this walk (the tables exist and the steps act).
fn ways_up() -> bool {
    std::env::var_os("FERRY_SYNC_WALK_NO_RECORDS").is_none()
        && std::env::var_os("FERRY_SYNC_WALK_NO_UP").is_none()
}

/// The stores' till: refuses a volume over 90 for good and puts a volume of 13 off.
struct Till;

impl CarryOut for Till {
    fn carry_out(&mut self, wish: &Wish) -> Outcome {
        match wish.values.get("volume") {
            Some(Value::Int(v)) if *v > 90 => Outcome::Refused(format!("volume {v} is too loud")),
            Some(Value::Int(13)) => Outcome::Waiting("not at volume 13 today".into()),
            _ => Outcome::Applied,
        }
    }
}

/// Store `id`'s replica offers its wishes to the till.
fn carry_out(shop: &mut Shop, id: Uuid) -> ferry_sync::replica::Round {
    let replica = shop.replicas.get_mut(&id).expect("a replica");
    replica.set_wish_handler(Box::new(Till));
    let round = replica.carry_out_wishes().expect("carrying wishes out");
    if trace() {
        eprintln!("  store {id} carries wishes out: {round:?}");
    }
    round
}

/// The server wishes values onto a store's setting row, or withdraws its wish, in a
/// transaction that sometimes rolls back.
async fn server_wish(shop: &Shop, rng: &mut Rng, stores: &[Uuid], book: &mut Book, step: usize) {
    let store = *rng.pick(stores).expect("a store exists");
    let setting = SETTINGS[rng.below(2) as usize];
    let (kind, price, volume, stale, commit) = (
        rng.below(10),
        rng.below(50),
        rng.below(100),
        rng.chance(30),
        rng.chance(85),
    );
    if !ways_up() {
        return;
    }
    let key = json!([store, setting]);
    let mut tx = shop.db.pool.begin().await.unwrap();
    if kind < 2 {
        let had = wish::withdraw(&mut tx, store, "till_settings", &key)
            .await
            .unwrap();
        if trace() {
            eprintln!("  withdraw {store} {setting}: {had}, commit {commit}");
        }
        if commit {
            book.wishes.remove(&(store, setting));
        }
    } else {
        let values = match kind {
            2..=4 => json!({"price_list": format!("w{price}")}),
            5..=7 => json!({"volume": volume}),
            _ => json!({"price_list": format!("w{price}"), "volume": volume}),
        };
        // Every third wish names the version the server has (or one it never had).
        let if_version = if kind % 3 == 0 {
            let rev: Option<i64> = sqlx::query_scalar(
                "SELECT rev FROM till_settings WHERE store_id = $1 AND name = $2",
            )
            .bind(store)
            .bind(setting)
            .fetch_optional(&mut *tx)
            .await
            .unwrap();
            Some(rev.unwrap_or(1) + i64::from(stale))
        } else {
            None
        };
        let number = wish::wish(
            &mut tx,
            store,
            "till_settings",
            &key,
            &values,
            if_version,
            None,
        )
        .await
        .unwrap();
        if trace() {
            eprintln!(
                "  wish {number} {store} {setting} {values} if {if_version:?}, commit {commit}"
            );
        }
        if commit {
            let made = Made {
                number,
                values,
                if_version,
                at: step,
            };
            book.wishes.insert((store, setting), made);
        }
    }
    if commit {
        tx.commit().await.unwrap();
    } else {
        tx.rollback().await.unwrap();
    }
}

/// After the way up: each open store carries its wishes out and uploads the answers
/// until a round answers nothing new. Then the server holds exactly the wishes the walk
/// made, each open store's answered for its own number and as the till and the row's
/// history allow; the server's settings are the stores'; and a status a store set on an
/// order it holds is the server's.
async fn wishes_are_answered_and_two_way_rows_agree(
    shop: &mut Shop,
    seed: u64,
    ups: &mut BTreeMap<Uuid, Up>,
    book: &Book,
) {
    if !ways_up() {
        return;
    }
    let open: Vec<Uuid> = shop.replicas.keys().copied().collect();
    for round in 0.. {
        assert!(round < 5, "seed {seed}: wishes were still being answered");
        let mut answered = 0;
        for &id in &open {
            let r = carry_out(shop, id);
            answered += r.applied + r.refused + r.superseded;
            let mut up = ups.remove(&id).expect("every store has its uploader");
            let db = shop.dir.join(format!("{id}.db"));
            let up = tokio::task::spawn_blocking(move || {
                upload_all(&mut up.uploader, &mut up.link, &db);
                up
            })
            .await
            .unwrap();
            ups.insert(id, up);
        }
        if answered == 0 {
            break;
        }
    }

    // The server's wishes are the walk's, and an open store's are answered.
    let mut conn = shop.db.pool.acquire().await.unwrap();
    let states = wish::wishes(&mut conn, None).await.unwrap();
    drop(conn);
    let mut have = BTreeMap::new();
    for w in &states {
        let key: (Uuid, String) = serde_json::from_str(&w.key).unwrap();
        assert_eq!(key.0, w.replica, "seed {seed}: {w:?}");
        have.insert((w.replica, key.1), w);
    }
    let want: BTreeMap<(Uuid, String), i64> = book
        .wishes
        .iter()
        .map(|((r, s), m)| ((*r, s.to_string()), m.number))
        .collect();
    let have_numbers: BTreeMap<(Uuid, String), i64> =
        have.iter().map(|(k, w)| (k.clone(), w.wish)).collect();
    assert_eq!(
        have_numbers, want,
        "seed {seed}: the server's wishes are not the walk's"
    );
    let mut told = BTreeMap::<&str, usize>::new();
    for ((store, setting), made) in &book.wishes {
        if !open.contains(store) {
            continue;
        }
        let w = have[&(*store, setting.to_string())];
        let row: Option<(String, i64, i64)> = shop.replicas[store]
            .conn()
            .query_row(
                "SELECT price_list, volume, rev FROM till_settings WHERE store_id = ?1 AND name = ?2",
                [store.to_string(), setting.to_string()],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .ok();
        let volume = made.values.get("volume").and_then(|v| v.as_i64());
        let quiet = book
            .app_wrote
            .get(&(*store, *setting))
            .is_none_or(|at| *at < made.at);
        *told.entry(w.state.as_str()).or_default() += 1;
        match w.state.as_str() {
            "applied" => {
                let (price_list, vol, _) = row.clone().unwrap_or_else(|| {
                    panic!("seed {seed}: {w:?} applied to a row the store lacks")
                });
                assert!(
                    volume.is_none_or(|v| v <= 90 && v != 13),
                    "seed {seed}: {w:?}"
                );
                if quiet {
                    if let Some(p) = made.values.get("price_list") {
                        assert_eq!(Some(price_list.as_str()), p.as_str(), "seed {seed}: {w:?}");
                    }
                    if let Some(v) = volume {
                        assert_eq!(vol, v, "seed {seed}: {w:?}");
                    }
                }
            }
            "refused" => assert!(volume.is_some_and(|v| v > 90), "seed {seed}: {w:?}"),
            "superseded" => assert!(made.if_version.is_some(), "seed {seed}: {w:?}"),
            "waiting" => assert!(
                row.is_none() || volume == Some(13),
                "seed {seed}: {w:?} waits on {row:?}"
            ),
            _ => panic!("seed {seed}: {w:?} is not answered"),
        }
    }

    // The server's settings are the stores' own.
    let mut want_settings: BTreeMap<(String, String), Setting> = BTreeMap::new();
    for id in ups.keys() {
        let app = rusqlite::Connection::open(shop.dir.join(format!("{id}.db"))).unwrap();
        if !writes_ready(&app) {
            continue;
        }
        let mut stmt = app
            .prepare("SELECT store_id, name, price_list, volume, rev FROM till_settings")
            .unwrap();
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    (r.get::<_, String>(0)?, r.get::<_, String>(1)?),
                    (
                        r.get::<_, Option<String>>(2)?,
                        r.get::<_, Option<i64>>(3)?,
                        r.get::<_, i64>(4)?,
                    ),
                ))
            })
            .unwrap();
        for row in rows {
            let (k, v) = row.unwrap();
            want_settings.insert(k, v);
        }
    }
    let have_settings: BTreeMap<(String, String), Setting> =
        sqlx::query_as::<_, (String, String, Option<String>, Option<i64>, i64)>(
            "SELECT store_id::text, name, price_list, volume, rev FROM till_settings",
        )
        .fetch_all(&shop.db.pool)
        .await
        .unwrap()
        .into_iter()
        .map(|(s, n, p, v, r)| ((s, n), (p, v, r)))
        .collect();
    assert_eq!(
        have_settings, want_settings,
        "seed {seed}: the server's settings are not the stores'"
    );

    // A status an open store set on an order it holds is the server's.
    let mut statuses = 0;
    for id in &open {
        let mut stmt = shop.replicas[id]
            .conn()
            .prepare("SELECT id, status FROM orders WHERE status IS NOT NULL")
            .unwrap();
        let rows: Vec<(String, String)> = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        for (order, status) in rows {
            let server: Option<String> =
                sqlx::query_scalar("SELECT status FROM orders WHERE id = $1::uuid")
                    .bind(&order)
                    .fetch_one(&shop.db.pool)
                    .await
                    .unwrap();
            assert_eq!(
                server.as_deref(),
                Some(status.as_str()),
                "seed {seed}: store {id}'s status of order {order} is not the server's"
            );
            statuses += 1;
        }
    }
    eprintln!("walk seed {seed}: wishes {told:?}, {statuses} order statuses agree");
}

fn plan(rng: &mut Rng, steps: usize) -> Plan {
    let mut stores = vec![(rng.uuid(), REGIONS[0]), (rng.uuid(), REGIONS[1])];
    if rng.chance(50) {
        stores.push((rng.uuid(), REGIONS[rng.below(2) as usize]));
    }
    let late = (stores.len() < 4 && rng.chance(70)).then(|| {
        let at = steps / 4 + rng.below((steps / 2).max(1) as u64) as usize;
        (rng.uuid(), REGIONS[rng.below(2) as usize], at)
    });
    let close = rng.chance(60).then(|| {
        let id = stores[rng.below(stores.len() as u64) as usize].0;
        let at = rng.below((steps / 2).max(1) as u64) as usize;
        let reopen = rng
            .chance(70)
            .then(|| at + 1 + rng.below((steps - at).max(1) as u64) as usize);
        (id, at, reopen)
    });
    Plan {
        stores,
        late,
        close,
        digests: rng.chance(50),
    }
}

/// A relay process as a seed runs it: sometimes with small batches (a pass leaves notes
/// for the next), sometimes with a small outbox bound (a replica that falls behind is
/// dropped and caught up by a new chain).
fn new_relay(shop: &Shop, rng: &mut Rng, digests: bool) -> Relay {
    let batch = *rng.pick(&[500, 500, 7, 2]).unwrap();
    let outbox_messages_max = *rng.pick(&[10_000, 10_000, 5, 2]).unwrap();
    Relay::new(
        shop.spec.clone(),
        RelaySettings {
            batch,
            outbox_messages_max,
            digest_every: if digests {
                Duration::ZERO
            } else {
                RelaySettings::default().digest_every
            },
            ..RelaySettings::default()
        },
    )
}

async fn set_open(shop: &Shop, id: Uuid, open: bool) {
    if trace() {
        eprintln!("  store {id} open = {open}");
    }
    shop.db
        .exec(&format!(
            "UPDATE stores SET open = {open} WHERE id = '{id}'"
        ))
        .await;
}

/// One random write, in one transaction.
async fn write(shop: &Shop, rng: &mut Rng, ids: &mut Ids) {
    let product = 1 + rng.below(PRODUCT_IDS);
    let name = NAMES[rng.below(NAMES.len() as u64) as usize];
    let region = REGIONS[rng.below(2) as usize];
    let price = if rng.chance(15) {
        "NULL".to_string()
    } else {
        format!("{}.{:02}", rng.below(100), rng.below(100))
    };
    let sql = match rng.below(16) {
        0 | 1 => format!(
            "INSERT INTO products VALUES ({product}, '{name}', {price}, '{region}')
             ON CONFLICT (id) DO UPDATE SET name = excluded.name, price = excluded.price, region = excluded.region"
        ),
        2 => format!("UPDATE products SET price = {price} WHERE id = {product}"),
        3 => format!("UPDATE products SET name = '{name}' WHERE id = {product}"),
        4 => format!("UPDATE products SET region = '{region}' WHERE id = {product}"),
        5 => format!(
            "UPDATE order_lines SET product_id = NULL WHERE product_id = {product};
             DELETE FROM products WHERE id = {product}"
        ),
        6 => {
            let id = rng.uuid();
            ids.customers.push(id);
            format!("INSERT INTO customers VALUES ('{id}', '{name}')")
        }
        7 => match rng.pick(&ids.customers) {
            Some(c) => format!("UPDATE customers SET name = '{name}' WHERE id = '{c}'"),
            None => return,
        },
        8 => {
            let Some(c) = rng.pick(&ids.customers).copied() else {
                return;
            };
            ids.customers.retain(|x| *x != c);
            format!(
                "UPDATE orders SET customer_id = NULL WHERE customer_id = '{c}';
                 DELETE FROM customers WHERE id = '{c}'"
            )
        }
        9 | 10 => {
            let id = rng.uuid();
            let store = *rng.pick(&ids.stores).expect("a store exists");
            let customer = customer_or_null(rng, ids);
            let note = if rng.chance(30) {
                "NULL".to_string()
            } else {
                format!("'{name}'")
            };
            ids.orders.push(id);
            format!(
                "INSERT INTO orders (id, store_id, customer_id, note)
                 SELECT '{id}', '{store}', id, {note} FROM (SELECT {customer}::uuid AS id) c
                 WHERE c.id IS NULL OR EXISTS (SELECT 1 FROM customers WHERE id = c.id)"
            )
        }
        11 => {
            let (Some(order), Some(store)) =
                (rng.pick(&ids.orders).copied(), rng.pick(&ids.stores).copied())
            else {
                return;
            };
            format!("UPDATE orders SET store_id = '{store}' WHERE id = '{order}'")
        }
        12 => {
            let Some(order) = rng.pick(&ids.orders).copied() else {
                return;
            };
            let customer = customer_or_null(rng, ids);
            format!(
                "UPDATE orders SET customer_id = (SELECT id FROM customers WHERE id = {customer}::uuid),
                 note = '{name}' WHERE id = '{order}'"
            )
        }
        13 => {
            let Some(order) = rng.pick(&ids.orders).copied() else {
                return;
            };
            if rng.chance(50) {
                ids.orders.retain(|x| *x != order);
            }
            format!("DELETE FROM orders WHERE id = '{order}'")
        }
        14 => {
            let Some(order) = rng.pick(&ids.orders).copied() else {
                return;
            };
            let line = 1 + rng.below(4);
            let qty = rng.below(10);
            format!(
                "INSERT INTO order_lines SELECT id, {line}, (SELECT id FROM products WHERE id = {product}), {qty}
                 FROM orders WHERE id = '{order}'
                 ON CONFLICT (order_id, line) DO UPDATE SET product_id = excluded.product_id, qty = excluded.qty"
            )
        }
        _ => {
            let Some(order) = rng.pick(&ids.orders).copied() else {
                return;
            };
            let line = 1 + rng.below(4);
            if rng.chance(50) {
                format!("DELETE FROM order_lines WHERE order_id = '{order}' AND line = {line}")
            } else {
                format!(
                    "UPDATE order_lines SET qty = qty + 1, product_id = (SELECT id FROM products WHERE id = {product})
                     WHERE order_id = '{order}' AND line = {line}"
                )
            }
        }
    };
    if trace() {
        eprintln!("  {sql}");
    }
    shop.db.exec(&sql).await;
}

/// `FERRY_SYNC_WALK_TRACE=1` prints every step, to read a failing seed.
fn trace() -> bool {
    std::env::var_os("FERRY_SYNC_WALK_TRACE").is_some()
}

fn customer_or_null(rng: &mut Rng, ids: &Ids) -> String {
    match rng.pick(&ids.customers) {
        Some(c) if rng.chance(80) => format!("'{c}'"),
        _ => "NULL".to_string(),
    }
}

/// A transport that loses, repeats, reorders, delays and cuts short: it fetches the
/// frames after the replica's position, mangles the list, applies what is left, and
/// then sends the report or loses it. Frames are never altered, so no outcome but an
/// error or a refusal is wrong.
async fn deliver_faulty(
    shop: &mut Shop,
    carrier: &mut Carrier,
    rng: &mut Rng,
    id: Uuid,
    late_frames: &mut BTreeMap<Uuid, Vec<Vec<u8>>>,
    digests: bool,
) {
    let status = shop.replicas[&id].status().unwrap();
    let max = 1 + rng.below(64) as usize;
    // Over NATS, a moment for the bridge to publish what the last pass recorded.
    let wait = carrier.wait() / 8;
    let mut frames = carrier.frames(shop, id, &status, max, wait).await;
    if rng.chance(25) {
        frames.retain(|_| !rng.chance(30));
    }
    if rng.chance(20) {
        let mut repeated = Vec::new();
        for f in frames {
            if rng.chance(30) {
                repeated.push(f.clone());
            }
            repeated.push(f);
        }
        frames = repeated;
    }
    if rng.chance(20) {
        for i in (1..frames.len()).step_by(2) {
            if rng.chance(50) {
                frames.swap(i - 1, i);
            }
        }
    }
    if rng.chance(20) && !frames.is_empty() {
        let keep = rng.below(frames.len() as u64) as usize;
        let cut = frames.split_off(keep);
        if rng.chance(50) {
            late_frames.entry(id).or_default().extend(cut);
        }
    }
    // Frames held back from an earlier delivery arrive now, before or after.
    if rng.chance(30)
        && let Some(late) = late_frames.remove(&id)
    {
        if rng.chance(50) {
            frames.extend(late);
        } else {
            frames.splice(0..0, late);
        }
    }
    let replica = shop.replicas.get_mut(&id).unwrap();
    for frame in &frames {
        let received = replica.receive(frame);
        if trace() {
            eprintln!("  store {id} at {}: {received:?}", status.seq);
        }
        match received {
            Ok(
                Received::Applied { .. } | Received::AlreadyApplied { .. } | Received::Gap { .. },
            ) => {}
            Ok(other) => panic!("store {id}: an unaltered frame was not taken: {other:?}"),
            Err(e) => panic!("store {id}: receiving a frame failed: {e}"),
        }
    }
    if rng.chance(75) {
        let up = if digests {
            replica.up()
        } else {
            replica.up_without_digests()
        }
        .unwrap();
        if trace() {
            eprintln!(
                "  store {id} reports {:?}",
                up.applied.as_ref().map(|a| a.seq)
            );
        }
        carrier.report(shop, id, &wire::encode_up(&up)).await;
        let replica = shop.replicas.get_mut(&id).unwrap();
        replica.reported(&up).unwrap();
    }
}

/// The relay process dies mid-pass: its lock connection's backend is terminated just
/// before the commit, the pass fails and records nothing, and a new relay process (no
/// memory of the old one) takes the lock on a new connection.
async fn kill_relay_mid_pass(shop: &mut Shop, rng: &mut Rng, digests: bool) {
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
    let outcome = shop.relay.pass(&mut shop.lock).await;
    assert!(
        outcome.is_err(),
        "a pass whose lock connection died must fail: {outcome:?}"
    );
    shop.lock = PgConnection::connect(&shop.db.url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(ferry_sync::relay::LOCK_KEY)
            .fetch_one(&mut shop.lock)
            .await
            .unwrap();
        if got {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the dead session never released the lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    shop.relay = new_relay(shop, rng, digests);
}

/// Passes and faithful deliveries (reports without digests, so only the planner can
/// bring a replica to its rules) until nothing moves and nothing waits.
async fn quiesce(shop: &mut Shop, carrier: &mut Carrier, seed: u64) {
    for _ in 0..60 {
        shop.passes().await;
        let mut moved = false;
        let ids: Vec<Uuid> = shop.replicas.keys().copied().collect();
        for id in ids {
            moved |= deliver_faithful(shop, carrier, id).await;
        }
        shop.passes().await;
        let waiting: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM ferry_sync.outbox) + (SELECT count(*) FROM ferry_sync.reports r JOIN ferry_sync.replicas c ON c.id = r.replica WHERE r.n > c.handled_n)",
        )
        .fetch_one(&shop.db.pool)
        .await
        .unwrap();
        if !moved && waiting == 0 {
            return;
        }
        if trace() {
            eprintln!("quiesce: moved {moved}, waiting {waiting}");
        }
    }
    let outbox: Vec<(Uuid, i64, i64)> = sqlx::query_as(
        "SELECT replica, min(seq), max(seq) FROM ferry_sync.outbox GROUP BY replica",
    )
    .fetch_all(&shop.db.pool)
    .await
    .unwrap();
    let chains: Vec<(Uuid, i64, i64)> =
        sqlx::query_as("SELECT id, confirmed_seq, last_seq FROM ferry_sync.replicas")
            .fetch_all(&shop.db.pool)
            .await
            .unwrap();
    let at: Vec<(Uuid, u64)> = shop
        .replicas
        .iter()
        .map(|(id, r)| (*id, r.status().unwrap().seq))
        .collect();
    panic!(
        "seed {seed}: delivery never settled: outbox (replica, first, last) {outbox:?}, \
         chains (replica, confirmed, last) {chains:?}, stores at {at:?}"
    );
}

async fn deliver_faithful(shop: &mut Shop, carrier: &mut Carrier, id: Uuid) -> bool {
    let mut applied = false;
    loop {
        let status = shop.replicas[&id].status().unwrap();
        let wait = carrier.wait();
        let frames = carrier.frames(shop, id, &status, 64, wait).await;
        let replica = shop.replicas.get_mut(&id).unwrap();
        let mut progressed = false;
        for frame in &frames {
            let received = replica.receive(frame).unwrap();
            if trace() {
                eprintln!("  quiesce: store {id} at {}: {received:?}", status.seq);
            }
            match received {
                Received::Applied { .. } => {
                    applied = true;
                    progressed = true;
                }
                Received::AlreadyApplied { .. } | Received::Gap { .. } => {}
                other => panic!("store {id}: {other:?}"),
            }
        }
        let up = replica.up_without_digests().unwrap();
        carrier.report(shop, id, &wire::encode_up(&up)).await;
        shop.replicas.get_mut(&id).unwrap().reported(&up).unwrap();
        if !progressed {
            return applied;
        }
    }
}
