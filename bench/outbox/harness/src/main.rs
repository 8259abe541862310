//! ferry-outbox's benchmark harness. Every subcommand prints one JSON line.
//!
//!   nats-ceiling --url U --window W --seconds S --payload P
//!       JetStream acknowledged publishes/s with W in flight (stream BENCH_CEIL).
//!   fill --db URL --n N --keys K --payload P [--unordered]
//!       Enqueue N messages, 1000 per transaction (the backlog a drain starts from).
//!   drain --db URL --to URL --batch B --window W --relays R [--stream S]
//!       Run R relays until the outbox is empty; messages/s.
//!   onerow --db URL --to URL --seconds S [--stream S]
//!       ai-crew-sync's loop, emulated: lease one row, publish, await the ack, settle in
//!       a four-statement transaction, 500 ms idle poll; messages/s over S seconds.
//!   latency --db URL --to URL --rate R --seconds S [--stream S] [--subject-prefix X]
//!       8 producer connections commit one message each at R/s in total while a relay
//!       runs; a core NATS subscriber stamps arrivals; commit-to-arrival p50/p99.
//!   stream --url U --name S --subjects X
//!       (Re)create the JetStream stream S on subjects X (file storage, 2 min dedup).
//!   sqlite-e2e --dir D --n N --sink-port P
//!       SQLite store, a producer writing N messages (100 per transaction) while a relay
//!       publishes to a local webhook sink; end-to-end messages/s.
//!   blip --db URL --nats URL [--trials T] [--cut-ms C] [--n N] [--lanes L] [--batch B]
//!        [--window W]
//!       A relay publishes a backlog to JetStream through a TCP fault proxy; mid-drain
//!       the proxy cuts the relay's connection and refuses new ones for C ms. Per
//!       trial: from the restore to the relay's first confirmed publish, and to the
//!       first message reaching the server (a core subscriber on it directly).

use ferry_outbox::Message;
use ferry_outbox::relay::{Relay, RelayConfig};
use ferry_outbox::store::{Db, Store};
use ferry_outbox::transport::{self, TransportOptions};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod blip;

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn num<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    flag(args, name)
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    // FERRY_LOG=info (or a filter) shows the relays' logs on stderr.
    if let Ok(filter) = std::env::var("FERRY_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }
    let out = match args.get(1).map(String::as_str) {
        Some("nats-ceiling") => nats_ceiling(&args).await,
        Some("fill") => fill(&args).await,
        Some("drain") => drain(&args).await,
        Some("onerow") => onerow(&args).await,
        Some("latency") => latency(&args).await,
        Some("sqlite-e2e") => sqlite_e2e(&args).await,
        Some("stream") => stream(&args).await,
        Some("blip") => blip::run(&args).await,
        _ => Err("usage: see the module doc".to_string()),
    };
    match out {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

async fn nats_ceiling(args: &[String]) -> Result<serde_json::Value, String> {
    let url = flag(args, "--url").unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let window: usize = num(args, "--window", 64);
    let seconds: f64 = num(args, "--seconds", 5.0);
    let payload: usize = num(args, "--payload", 256);
    let client = async_nats::connect(&url).await.map_err(|e| e.to_string())?;
    let js = async_nats::jetstream::new(client);
    let name = format!("BENCH_CEIL_{}", std::process::id());
    create_stream(&js, &name, format!("{name}.>")).await?;
    let body = vec![7u8; payload];
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let mut inflight = std::collections::VecDeque::new();
    let mut n = 0u64;
    let mut lat = Vec::new();
    while Instant::now() < deadline {
        while inflight.len() < window {
            let mut h = async_nats::HeaderMap::new();
            h.insert("Nats-Msg-Id", format!("{name}-{n}").as_str());
            let f = js
                .publish_with_headers(format!("{name}.x"), h, body.clone().into())
                .await
                .map_err(|e| e.to_string())?;
            inflight.push_back((Instant::now(), f));
            n += 1;
        }
        let (t, f) = inflight.pop_front().expect("filled above");
        f.await.map_err(|e| e.to_string())?;
        lat.push(t.elapsed());
    }
    for (t, f) in inflight {
        f.await.map_err(|e| e.to_string())?;
        lat.push(t.elapsed());
    }
    let secs = start.elapsed().as_secs_f64();
    js.delete_stream(&name).await.map_err(|e| e.to_string())?;
    lat.sort();
    Ok(
        serde_json::json!({"acks_per_sec": lat.len() as f64 / secs, "window": window, "p50_us": pct(&lat, 50.0), "p99_us": pct(&lat, 99.0)}),
    )
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// The store at `--db`, with the outbox schema installed.
async fn store(args: &[String]) -> Result<Store, String> {
    let url = flag(args, "--db").ok_or("--db URL")?;
    install(&url).await
}

async fn install(url: &str) -> Result<Store, String> {
    let s = Store::connect(url).await.map_err(|e| e.to_string())?;
    s.install().await.map_err(|e| e.to_string())?;
    Ok(s)
}

/// Enqueue `n` messages, `per_txn` to a transaction; `message(j)` makes the j-th.
async fn enqueue_in_chunks(
    s: &Store,
    n: u64,
    per_txn: u64,
    message: impl Fn(u64) -> Message,
) -> Result<(), String> {
    let mut i = 0;
    while i < n {
        let chunk: Vec<Message> = (i..(i + per_txn).min(n)).map(&message).collect();
        match s.db() {
            Db::Pg(p) => {
                let mut tx = p.begin().await.map_err(|e| e.to_string())?;
                ferry_outbox::enqueue_many(&mut *tx, &chunk)
                    .await
                    .map_err(|e| e.to_string())?;
                tx.commit().await.map_err(|e| e.to_string())?;
            }
            Db::Sqlite(p) => {
                let mut tx = p.begin().await.map_err(|e| e.to_string())?;
                ferry_outbox::enqueue_many(&mut *tx, &chunk)
                    .await
                    .map_err(|e| e.to_string())?;
                tx.commit().await.map_err(|e| e.to_string())?;
            }
        }
        i += chunk.len() as u64;
    }
    Ok(())
}

/// Create the JetStream stream `name` on `subjects` (file storage, 2 min dedup).
async fn create_stream(
    js: &async_nats::jetstream::Context,
    name: &str,
    subjects: String,
) -> Result<(), String> {
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.to_string(),
        subjects: vec![subjects],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

async fn fill(args: &[String]) -> Result<serde_json::Value, String> {
    let s = store(args).await?;
    let n: u64 = num(args, "--n", 100_000);
    let keys: u64 = num(args, "--keys", 1000);
    let payload: usize = num(args, "--payload", 256);
    let topic = flag(args, "--topic").unwrap_or_else(|| "bench.orders".into());
    let ordered = !args.iter().any(|a| a == "--unordered");
    let start = Instant::now();
    enqueue_in_chunks(&s, n, 1000, |j| {
        let m = Message::new(topic.clone(), vec![b'x'; payload]);
        if ordered {
            m.ordered_by(format!("k{}", j % keys))
        } else {
            m
        }
    })
    .await?;
    Ok(serde_json::json!({"filled": n, "secs": start.elapsed().as_secs_f64()}))
}

async fn connect_transport(args: &[String]) -> Result<Arc<dyn transport::Transport>, String> {
    let to = flag(args, "--to").ok_or("--to URL")?;
    let options = TransportOptions {
        nats_stream: flag(args, "--stream"),
        ..TransportOptions::default()
    };
    Ok(Arc::from(
        transport::connect(&to, &options)
            .await
            .map_err(|e| e.to_string())?,
    ))
}

async fn drain(args: &[String]) -> Result<serde_json::Value, String> {
    let s = store(args).await?;
    let t = if flag(args, "--to").as_deref() == Some("sink") {
        // A reference webhook sink in this process.
        let sink = ferry_outbox::sink::Sink::new(None);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let port = l.local_addr().map_err(|e| e.to_string())?.port();
        tokio::spawn(sink.serve(l));
        Arc::from(
            transport::connect(
                &format!("http://127.0.0.1:{port}/hook"),
                &TransportOptions::default(),
            )
            .await
            .map_err(|e| e.to_string())?,
        )
    } else {
        connect_transport(args).await?
    };
    let relays: usize = num(args, "--relays", 1);
    let config = RelayConfig {
        batch: num(args, "--batch", 256),
        window: num(args, "--window", 64),
        lanes: num(args, "--lanes", 1),
        poll: Duration::from_millis(50),
        ..RelayConfig::default()
    };
    let before = s.depth().await.map_err(|e| e.to_string())?.pending;
    let start = Instant::now();
    let mut running = Vec::new();
    let mut rs = Vec::new();
    for _ in 0..relays {
        let r = Relay::new(s.clone(), t.clone(), config.clone()).map_err(|e| e.to_string())?;
        running.push(r.spawn());
        rs.push(r);
    }
    loop {
        let st = s.depth().await.map_err(|e| e.to_string())?;
        if st.pending + st.leased + st.uncertain == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = start.elapsed().as_secs_f64();
    for r in running {
        r.stop().await.map_err(|e| e.to_string())?;
    }
    let published: u64 = rs.iter().map(|r| r.status().published).sum();
    let fenced: u64 = rs.iter().map(|r| r.status().fenced).sum();
    Ok(
        serde_json::json!({"messages": before, "secs": secs, "per_sec": before as f64 / secs, "published": published, "fenced": fenced}),
    )
}

/// ai-crew-sync's worker loop, emulated on ferry's tables (docs: research/outbox.md §1.5):
/// one row per lease, one publish in flight, then a settle transaction of four
/// statements (delete the slot, mark the message stored, stamp receipts, enqueue an
/// inbox reference), and a 500 ms sleep when nothing is due.
async fn onerow(args: &[String]) -> Result<serde_json::Value, String> {
    let s = store(args).await?;
    let t = connect_transport(args).await?;
    let seconds: f64 = num(args, "--seconds", 10.0);
    let Db::Pg(pool) = s.db() else {
        return Err("onerow runs on Postgres".into());
    };
    for ddl in [
        "CREATE TABLE IF NOT EXISTS bench_messages (message_id text PRIMARY KEY, state text, locator text)",
        "CREATE TABLE IF NOT EXISTS bench_receipts (message_id text, stored_at timestamptz)",
        "CREATE TABLE IF NOT EXISTS bench_inbox (message_id text, created_at timestamptz)",
    ] {
        sqlx::query(ddl)
            .execute(pool)
            .await
            .map_err(|e| e.to_string())?;
    }
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let mut n = 0u64;
    while Instant::now() < deadline {
        let leased = s
            .lease("onerow", 1, Duration::from_secs(60))
            .await
            .map_err(|e| e.to_string())?;
        let Some(m) = leased.into_iter().next() else {
            tokio::time::sleep(Duration::from_millis(500)).await;
            continue;
        };
        match t.publish(&m).await {
            ferry_outbox::transport::Outcome::Confirmed { .. } => {}
            o => return Err(format!("publish failed: {o:?}")),
        }
        let mut tx = pool.begin().await.map_err(|e| e.to_string())?;
        sqlx::query("DELETE FROM ferry_outbox.messages WHERE id = $1 AND generation = $2 AND lease_until > now()")
            .bind(m.id)
            .bind(m.generation.0 as i64)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        sqlx::query("INSERT INTO bench_messages VALUES ($1, 'stored', 'x') ON CONFLICT (message_id) DO UPDATE SET state = 'stored'")
            .bind(&m.message_id)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        sqlx::query("INSERT INTO bench_receipts VALUES ($1, now())")
            .bind(&m.message_id)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        sqlx::query("INSERT INTO bench_inbox VALUES ($1, now())")
            .bind(&m.message_id)
            .execute(&mut *tx)
            .await
            .map_err(|e| e.to_string())?;
        tx.commit().await.map_err(|e| e.to_string())?;
        n += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    Ok(serde_json::json!({"messages": n, "secs": secs, "per_sec": n as f64 / secs}))
}

async fn latency(args: &[String]) -> Result<serde_json::Value, String> {
    let s = store(args).await?;
    let t = connect_transport(args).await?;
    let rate: f64 = num(args, "--rate", 1000.0);
    let seconds: f64 = num(args, "--seconds", 10.0);
    let prefix = flag(args, "--subject-prefix").unwrap_or_else(|| "bench".into());
    let nats_url = flag(args, "--to").ok_or("--to")?;
    let client = async_nats::connect(&nats_url)
        .await
        .map_err(|e| e.to_string())?;
    let mut sub = client
        .subscribe(format!("{prefix}.lat"))
        .await
        .map_err(|e| e.to_string())?;
    let epoch = Instant::now();
    let arrivals = tokio::spawn(async move {
        use futures_util::StreamExt;
        let mut out = Vec::new();
        while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(5), sub.next()).await {
            let at = epoch.elapsed().as_micros() as u64;
            let committed: u64 = std::str::from_utf8(&m.payload)
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            out.push(at.saturating_sub(committed));
        }
        out
    });
    let relay = Relay::new(
        s.clone(),
        t,
        RelayConfig {
            lanes: 2,
            poll: Duration::from_millis(200),
            ..RelayConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let running = relay.spawn();
    let producers = 8;
    let mut tasks = Vec::new();
    let per = rate / producers as f64;
    for p in 0..producers {
        let s = s.clone();
        let prefix = prefix.clone();
        tasks.push(tokio::spawn(async move {
            let Db::Pg(pool) = s.db() else { return 0u64 };
            let start = Instant::now();
            let mut n = 0u64;
            while start.elapsed().as_secs_f64() < seconds {
                let due = start + Duration::from_secs_f64(n as f64 / per);
                tokio::time::sleep_until(due.into()).await;
                let Ok(mut tx) = pool.begin().await else {
                    continue;
                };
                // The commit time goes in the payload after the commit: enqueue a
                // placeholder, then rewrite it in the same transaction just before COMMIT.
                let m = Message::new(format!("{prefix}.lat"), b"0".to_vec())
                    .ordered_by(format!("p{p}-{}", n % 50));
                if ferry_outbox::enqueue(&mut *tx, &m).await.is_err() {
                    continue;
                }
                let stamp = epoch.elapsed().as_micros() as u64;
                let _ = sqlx::query(
                    "UPDATE ferry_outbox.messages SET payload = $1 WHERE message_id = $2",
                )
                .bind(stamp.to_string().into_bytes())
                .bind(&m.message_id)
                .execute(&mut *tx)
                .await;
                if tx.commit().await.is_ok() {
                    n += 1;
                }
            }
            n
        }));
    }
    let mut sent = 0;
    for t in tasks {
        sent += t.await.unwrap_or(0);
    }
    loop {
        let st = s.depth().await.map_err(|e| e.to_string())?;
        if st.pending + st.leased + st.uncertain == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.stop().await.unwrap();
    let mut lat: Vec<Duration> = arrivals
        .await
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(Duration::from_micros)
        .collect();
    lat.sort();
    Ok(
        serde_json::json!({"rate": rate, "sent": sent, "received": lat.len(), "achieved": sent as f64 / seconds, "p50_us": pct(&lat, 50.0), "p99_us": pct(&lat, 99.0), "max_us": lat.last().map(|d| d.as_micros() as f64)}),
    )
}

async fn sqlite_e2e(args: &[String]) -> Result<serde_json::Value, String> {
    let dir = flag(args, "--dir").ok_or("--dir")?;
    let n: u64 = num(args, "--n", 100_000);
    let s = install(&format!("sqlite:{dir}/bench.db")).await?;
    let sink = ferry_outbox::sink::Sink::new(None);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let port = l.local_addr().map_err(|e| e.to_string())?.port();
    let server = tokio::spawn(sink.clone().serve(l));
    let t = transport::connect(
        &format!("http://127.0.0.1:{port}/hook"),
        &TransportOptions::default(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let relay = Relay::new(
        s.clone(),
        Arc::from(t),
        RelayConfig {
            lanes: num(args, "--lanes", 2),
            batch: num(args, "--batch", 512),
            window: num(args, "--window", 128),
            poll: Duration::from_millis(100),
            ..RelayConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let running = relay.spawn();
    let start = Instant::now();
    enqueue_in_chunks(&s, n, 100, |j| {
        Message::new("bench.e2e", vec![b'x'; 256]).ordered_by(format!("k{}", j % 1000))
    })
    .await?;
    let wrote = start.elapsed().as_secs_f64();
    while (sink.received_count() as u64) < n {
        tokio::time::sleep(Duration::from_millis(5)).await;
        if start.elapsed() > Duration::from_secs(600) {
            return Err("not drained in 600 s".into());
        }
    }
    let secs = start.elapsed().as_secs_f64();
    running.stop().await.unwrap();
    server.abort();
    Ok(
        serde_json::json!({"messages": n, "write_secs": wrote, "secs": secs, "per_sec": n as f64 / secs, "duplicates": sink.duplicates()}),
    )
}

async fn stream(args: &[String]) -> Result<serde_json::Value, String> {
    let url = flag(args, "--url").unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let name = flag(args, "--name").ok_or("--name")?;
    let subjects = flag(args, "--subjects").ok_or("--subjects")?;
    let client = async_nats::connect(&url).await.map_err(|e| e.to_string())?;
    let js = async_nats::jetstream::new(client);
    // Streams left by earlier bench runs (BENCH*) may claim the same subjects.
    let mut names = js.stream_names();
    let mut old = Vec::new();
    {
        use futures_util::StreamExt;
        while let Some(Ok(n)) = names.next().await {
            if n.starts_with("BENCH") {
                old.push(n);
            }
        }
    }
    for n in old {
        let _ = js.delete_stream(&n).await;
    }
    create_stream(&js, &name, subjects).await?;
    Ok(serde_json::json!({"stream": name}))
}
