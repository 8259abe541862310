//! `blip`: how long after a short network cut a relay publishes again.
//!
//! Per trial: a fresh stream and a backlog of `--n` messages; one relay (the CLI's
//! defaults: 2 lanes, batch 256, window 64, 10 s publish timeout) publishes them to
//! JetStream through ferry-testkit's TCP fault proxy. Once it is publishing steadily,
//! the proxy cuts the relay's connection at its next bytes and refuses new connections
//! for `--cut-ms` (0: no cut, the control); then it lets them through again (the
//! restore). Measured from the
//! restore: the relay's first confirmed publish (its transport's answer, stamped by a
//! wrapper), and the first message reaching the server (a core subscriber connected to
//! NATS directly, not through the proxy), and the time until the outbox is empty.

use ferry_outbox::Message;
use ferry_outbox::relay::{Relay, RelayConfig};
use ferry_outbox::store::{Db, Leased};
use ferry_outbox::transport::{self, Outcome, PublishFuture, Transport, TransportOptions};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::{create_stream, enqueue_in_chunks, flag, install, num};

/// A transport that stamps every confirmed publish.
struct Stamped {
    inner: Arc<dyn Transport>,
    confirmed: Arc<Mutex<Vec<Instant>>>,
}

impl Transport for Stamped {
    fn publish<'a>(&'a self, msg: &'a Leased) -> PublishFuture<'a> {
        Box::pin(async move {
            let o = self.inner.publish(msg).await;
            if matches!(o, Outcome::Confirmed { .. }) {
                self.confirmed.lock().unwrap().push(Instant::now());
            }
            o
        })
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn dedup_window(&self) -> Option<Duration> {
        self.inner.dedup_window()
    }
    fn connections(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.inner.connections()
    }
}

pub async fn run(args: &[String]) -> Result<serde_json::Value, String> {
    let db = flag(args, "--db").ok_or("--db URL")?;
    let nats = flag(args, "--nats").unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let trials: usize = num(args, "--trials", 3);
    let cut = Duration::from_millis(num(args, "--cut-ms", 2000));
    let mut results = Vec::new();
    for trial in 0..trials {
        let r = one(args, &db, &nats, trial, cut).await?;
        eprintln!("trial {trial}: {r}");
        results.push(r);
    }
    Ok(serde_json::json!({
        "cut_ms": cut.as_millis() as u64,
        "median_resume_ms": median(&results, "resume_ms"),
        "median_first_arrival_ms": median(&results, "first_arrival_ms"),
        "median_drained_ms": median(&results, "drained_ms"),
        "trials": results,
    }))
}

/// The median of `key` over the trials that measured it (the upper middle of an even
/// count); None when none did.
fn median(trials: &[serde_json::Value], key: &str) -> Option<f64> {
    let mut v: Vec<f64> = trials.iter().filter_map(|r| r[key].as_f64()).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

async fn one(
    args: &[String],
    db: &str,
    nats: &str,
    trial: usize,
    cut: Duration,
) -> Result<serde_json::Value, String> {
    let n: u64 = num(args, "--n", 30_000);
    let s = install(db).await?;
    let Db::Pg(pool) = s.db() else {
        return Err("blip runs on Postgres".into());
    };
    sqlx::query("DELETE FROM ferry_outbox.messages")
        .execute(pool)
        .await
        .map_err(|e| e.to_string())?;
    let client = async_nats::connect(nats).await.map_err(|e| e.to_string())?;
    let js = async_nats::jetstream::new(client.clone());
    let name = format!("BENCH_BLIP_{}_{trial}", std::process::id());
    create_stream(&js, &name, format!("{name}.>")).await?;
    let topic = format!("{name}.x");
    enqueue_in_chunks(&s, n, 1000, |j| {
        Message::new(topic.clone(), vec![b'x'; 256]).ordered_by(format!("k{}", j % 1000))
    })
    .await?;
    // Arrivals at the server, seen by a subscriber that is not behind the proxy.
    let arrivals = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let mut sub = client
        .subscribe(topic.clone())
        .await
        .map_err(|e| e.to_string())?;
    let arrivals2 = arrivals.clone();
    let watcher = tokio::spawn(async move {
        use futures_util::StreamExt;
        while sub.next().await.is_some() {
            arrivals2.lock().unwrap().push(Instant::now());
        }
    });
    let target: std::net::SocketAddr = nats
        .trim_start_matches("nats://")
        .parse()
        .map_err(|e| format!("--nats {nats}: {e}"))?;
    let proxy = ferry_testkit::proxy::FaultProxy::start(target);
    let options = TransportOptions {
        nats_stream: Some(name.clone()),
        ..TransportOptions::default()
    };
    let inner = transport::connect(&format!("nats://127.0.0.1:{}", proxy.port()), &options)
        .await
        .map_err(|e| e.to_string())?;
    let confirmed = Arc::new(Mutex::new(Vec::new()));
    let t = Stamped {
        inner: Arc::from(inner),
        confirmed: confirmed.clone(),
    };
    let relay = Relay::new(
        s.clone(),
        Arc::new(t),
        RelayConfig {
            lanes: num(args, "--lanes", 2),
            batch: num(args, "--batch", 256),
            window: num(args, "--window", 64),
            ..RelayConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let running = relay.spawn();
    let steady = Instant::now();
    while confirmed.lock().unwrap().len() < 2000 {
        if steady.elapsed() > Duration::from_secs(60) {
            return Err("the relay did not reach 2000 publishes in 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The cut: the relay's connection breaks at its next bytes; reconnects are refused.
    // `--cut-ms 0` is the control: no cut, the same backlog drained from the same point.
    let cut_at = Instant::now();
    if !cut.is_zero() {
        proxy.faults().refuse.store(true, Ordering::SeqCst);
        proxy.faults().cut_after.store(1, Ordering::SeqCst);
        tokio::time::sleep(cut).await;
        proxy.faults().refuse.store(false, Ordering::SeqCst);
    }
    let restored = Instant::now();
    let before_cut = confirmed.lock().unwrap().len();
    let after = |v: &Mutex<Vec<Instant>>| v.lock().unwrap().iter().copied().find(|t| *t > restored);
    let deadline = restored + Duration::from_secs(90);
    let first = loop {
        if let Some(t) = after(&confirmed) {
            break Some(t);
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    // Then until the outbox is empty: a second stall after the first publish (the old
    // breaker reopening when the acknowledgements lost in the cut time out) shows here.
    let drained = loop {
        let st = s.depth().await.map_err(|e| e.to_string())?;
        if st.pending + st.leased + st.uncertain == 0 {
            break Some(Instant::now());
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let first_arrival = after(&arrivals);
    let during = confirmed
        .lock()
        .unwrap()
        .iter()
        .filter(|t| **t > cut_at && **t <= restored)
        .count();
    // Confirmations per second after the restore: a stall shows as a run of zeros.
    let per_second: Vec<usize> = {
        let c = confirmed.lock().unwrap();
        let end = drained.unwrap_or(deadline);
        let secs = end.saturating_duration_since(restored).as_secs() as usize + 1;
        (0..secs)
            .map(|i| {
                c.iter()
                    .filter(|t| {
                        t.saturating_duration_since(restored).as_secs() as usize == i
                            && **t > restored
                    })
                    .count()
            })
            .collect()
    };
    let st = relay.status();
    running.stop().await.unwrap();
    watcher.abort();
    let _ = js.delete_stream(&name).await;
    s.close().await;
    let ms = |t: Option<Instant>| t.map(|t| t.duration_since(restored).as_secs_f64() * 1000.0);
    Ok(serde_json::json!({
        "trial": trial,
        "resume_ms": ms(first),
        "drained_ms": ms(drained),
        "confirmed_per_second_after_restore": per_second,
        "first_arrival_ms": ms(first_arrival),
        "confirmed_before_restore": before_cut,
        "confirmed_during_cut": during,
        "unavailable": st.unavailable,
        "uncertain": st.uncertain,
        "proxy_connections": proxy.faults().connections.load(Ordering::Relaxed),
    }))
}
