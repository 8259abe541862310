//! `ferry flow serve` as a real process (docs/flow-server.md): SIGKILLed three times under
//! pipelined appends, it loses nothing it acknowledged and its last holder resumes at the
//! same epochs (T3, at the protocol level: the worker here is a raw peer); SIGTERM closes
//! it cleanly; /metrics and /status answer; a setting that breaks the arithmetic of §3 is
//! refused by name. With `--replicate` (docs/flow-server-replica.md), on three clustered
//! `nats-server` processes, a standby takes over from the stream when the server's
//! machine is lost or the server is paused past its lock, with nothing acknowledged
//! lost, a raw worker and real worker processes alike.

use ferry_core::seams::{Rng, SplitMix64};
use ferry_flow::remote::proto::{Body, Rec, Resume};
use ferry_flow_server::peer::{Peer, append, hello};
use ferry_testkit::proc::Proc;
use ferry_testkit::servers::NatsCluster;
use ferry_testkit::{Scratch, free_port, wait_until};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");
const SHARDS: u32 = 4;

fn serve(dir: &Path, socket: &Path, metrics: Option<u16>, log: &Path) -> Proc {
    serve_with(dir, socket, metrics, log, "3000")
}

/// A server with its directory, socket and log in `scratch`, a lease of `lease_ms` and
/// /metrics on a free port: the server, its socket, the port.
fn serve_in(scratch: &Scratch, lease_ms: &str) -> (Proc, std::path::PathBuf, u16) {
    let socket = scratch.path().join("flow.sock");
    let port = free_port();
    let server = serve_with(
        &scratch.path().join("server"),
        &socket,
        Some(port),
        &scratch.path().join("server.log"),
        lease_ms,
    );
    (server, socket, port)
}

/// [`serve`] with a lease of `lease_ms`.
fn serve_with(dir: &Path, socket: &Path, metrics: Option<u16>, log: &Path, lease_ms: &str) -> Proc {
    serve_more(dir, socket, metrics, log, lease_ms, &[])
}

/// [`serve_with`] and `more` flags.
fn serve_more(
    dir: &Path,
    socket: &Path,
    metrics: Option<u16>,
    log: &Path,
    lease_ms: &str,
    more: &[&str],
) -> Proc {
    let listen = format!("unix:{}", socket.display());
    let dir = dir.display().to_string();
    let metrics = metrics.map(|p| format!("127.0.0.1:{p}"));
    let mut args = vec![
        "flow",
        "serve",
        "--dir",
        &dir,
        "--listen",
        &listen,
        "--shards",
        "4",
        "--lease-ms",
        lease_ms,
        "--ping-ms",
        "500",
    ];
    if let Some(m) = &metrics {
        args.extend(["--metrics-listen", m.as_str()]);
    }
    args.extend(more);
    let p = Proc::spawn("ferry flow serve", Path::new(FERRY), &args, &[], log);
    assert!(
        wait_until(Duration::from_secs(20), || {
            std::os::unix::net::UnixStream::connect(socket).is_ok()
        }),
        "the server listens: {}",
        p.log_text()
    );
    p
}

fn rec(shard: u32, position: u64) -> Rec {
    Rec {
        kind: 1,
        bytes: format!(
            "shard {shard} record {position} {}",
            "x".repeat(position as usize % 50)
        )
        .into_bytes(),
    }
}

/// A raw worker's shards across server restarts and takeovers: per shard the epoch,
/// what was sent, and how much of it was acknowledged.
#[derive(Default)]
struct Sent {
    epochs: BTreeMap<u32, u64>,
    sent: BTreeMap<u32, Vec<Rec>>,
    acked: BTreeMap<u32, u64>,
}

impl Sent {
    /// Say hello to the server at `socket`, resuming what is held; the first time, take
    /// every shard's grant; after that, check every shard resumed at its epoch with at
    /// least what was acknowledged, byte for byte (what was sent and not acknowledged
    /// may or may not have survived: the server's end says which, and the rest is sent
    /// again).
    async fn hello(&mut self, socket: &Path, round: usize) -> Peer {
        let resume: Vec<Resume> = self
            .epochs
            .iter()
            .map(|(&shard, &epoch)| Resume {
                shard,
                epoch,
                acked: self.acked[&shard],
            })
            .collect();
        let (mut peer, welcome) = Peer::hello(socket, hello(0x5eed, "", resume))
            .await
            .unwrap();
        if self.epochs.is_empty() {
            for g in peer.grants(SHARDS as usize).await {
                self.epochs.insert(g.shard, g.epoch);
                self.sent.insert(g.shard, Vec::new());
                self.acked.insert(g.shard, 0);
            }
            return peer;
        }
        assert_eq!(welcome.grants.len(), SHARDS as usize, "round {round}");
        for g in &welcome.grants {
            assert_eq!(g.epoch, self.epochs[&g.shard], "round {round}: same epoch");
            assert!(
                g.end >= self.acked[&g.shard],
                "round {round}: shard {} lost acknowledged records ({} of {})",
                g.shard,
                g.end,
                self.acked[&g.shard]
            );
            let s = self.sent.get_mut(&g.shard).unwrap();
            assert!(g.end as usize <= s.len());
            let back = peer.read_all(g.shard, g.epoch, 4096).await;
            assert_eq!(
                back,
                s[..g.end as usize],
                "round {round}: shard {} byte for byte",
                g.shard
            );
            s.truncate(g.end as usize);
            self.acked.insert(g.shard, g.end);
        }
        peer
    }

    /// Pipelined appends to random shards, in two waves: the first is waited for
    /// (acknowledged), the second is in flight when the caller takes the server away.
    async fn waves(&mut self, peer: &mut Peer, rng: &mut SplitMix64) {
        for wave in 0..2 {
            for _ in 0..50 + rng.below(100) {
                let shard = rng.below(u64::from(SHARDS)) as u32;
                let s = self.sent.get_mut(&shard).unwrap();
                let first = s.len() as u64;
                let n = 1 + rng.below(4);
                let records: Vec<Rec> = (first..first + n).map(|p| rec(shard, p)).collect();
                s.extend(records.iter().cloned());
                peer.send(append(shard, self.epochs[&shard], first, records))
                    .await
                    .unwrap();
            }
            if wave == 0 {
                for (&shard, s) in &self.sent {
                    // A shard this wave did not write to has nothing new to acknowledge.
                    if s.len() as u64 > self.acked[&shard] {
                        peer.durable_to(shard, s.len() as u64).await;
                        self.acked.insert(shard, s.len() as u64);
                    }
                }
            }
        }
    }

    /// Frames until the connection closes (or is quiet for 10 s): acknowledgements that
    /// arrived count, the server said durable. A refusal fails the test unless
    /// `refusals` (a server that heard no ping for a while may revoke and refuse).
    async fn drain(&mut self, mut peer: Peer, round: usize, refusals: bool) {
        while let Ok(Some(f)) = tokio::time::timeout(Duration::from_secs(10), peer.recv()).await {
            match f.body {
                Body::Durable(ps) => {
                    for p in ps {
                        let a = self.acked.get_mut(&p.shard).unwrap();
                        *a = (*a).max(p.position);
                    }
                }
                Body::Refused { .. } | Body::Revoke { .. } if refusals => {}
                Body::Refused { refused, .. } => panic!("round {round}: refused {refused:?}"),
                _ => {}
            }
        }
    }

    fn total(&self) -> u64 {
        self.acked.values().sum()
    }
}

/// Guards T3 and docs/flow-server.md §7: SIGKILL the server three times while a worker
/// pipelines appends to every shard; after each restart every record it acknowledged is
/// there, byte for byte and in order, and the worker resumes at the same epochs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_kills_lose_nothing_acknowledged_and_the_holder_resumes() {
    let scratch = Scratch::new("flow-serve-kill");
    let dir = scratch.path().join("server");
    let socket = scratch.path().join("flow.sock");
    let log = scratch.path().join("server.log");
    let mut rng = SplitMix64::seeded(11);
    let mut shards = Sent::default();
    for round in 0..4 {
        let server = serve(&dir, &socket, None, &log);
        let mut peer = shards.hello(&socket, round).await;
        if round == 0 {
            assert!(shards.epochs.values().all(|&e| e == 1));
        }
        if round == 3 {
            server.term(Duration::from_secs(10));
            break;
        }
        shards.waves(&mut peer, &mut rng).await;
        server.kill9();
        shards.drain(peer, round, false).await;
    }
    let total = shards.total();
    eprintln!(
        "acknowledged {total} records over the kills: {:?}",
        shards.acked
    );
    assert!(total > 300, "the rounds acknowledged only {total} records");
}

/// Guards "operable": /metrics and /status answer, and SIGTERM closes the server
/// cleanly (exit 0, its socket removed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_the_server_and_metrics_and_status_answer() {
    let scratch = Scratch::new("flow-serve-term");
    let (server, socket, port) = serve_in(&scratch, "3000");
    let (mut peer, _) = Peer::hello(&socket, hello(9, "", vec![])).await.unwrap();
    peer.grants(SHARDS as usize).await;
    peer.send(append(2, 1, 0, vec![rec(2, 0)])).await.unwrap();
    peer.durable_to(2, 1).await;
    let get = |path: &str| {
        ureq::get(format!("http://127.0.0.1:{port}{path}"))
            .call()
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap()
    };
    let metrics = get("/metrics");
    assert!(
        metrics.contains("ferry_flow_server_shards{state=\"held\"} 4"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ferry_flow_server_records_total{kind=\"new\"} 1"),
        "{metrics}"
    );
    let status: serde_json::Value = serde_json::from_str(&get("/status")).unwrap();
    assert_eq!(status["version"], 1);
    assert_eq!(status["shards"][2]["records"], 1);
    assert_eq!(status["workers"][0]["connected"], true);
    assert_eq!(server.term(Duration::from_secs(10)), Some(0));
    assert!(!socket.exists(), "the socket is removed");
    assert!(peer.recv().await.is_none(), "the connection was closed");
}

/// Guards "bad input gets a clear error": settings that break docs/flow-server.md §3's
/// arithmetic are refused by flag, before anything is created.
#[test]
fn settings_that_break_the_arithmetic_are_refused_by_flag() {
    let scratch = Scratch::new("flow-serve-bad");
    let dir = scratch.path().join("server");
    // `ferry flow serve --dir DIR` with `extra`: it fails, and says what on stderr.
    let refused = |extra: &[&str]| {
        let mut args = vec!["flow", "serve", "--dir", dir.to_str().unwrap()];
        args.extend(extra);
        let (code, _, err) = ferry_testkit::proc::run(Path::new(FERRY), &args, &[]);
        assert_ne!(code, 0);
        err
    };
    let err = refused(&[
        "--listen",
        "unix:/nonexistent/x.sock",
        "--lease-ms",
        "2000",
        "--ping-ms",
        "1000",
    ]);
    assert!(
        err.contains("--ping-ms: must be above zero and at most a third of lease"),
        "{err}"
    );
    assert!(!dir.exists(), "nothing was created");
    let err = refused(&["--listen", "x", "--shards", "0"]);
    assert!(err.contains("--shards: must be 1 to 1024"), "{err}");
    let err = refused(&[
        "--listen",
        "x",
        "--lease-ms",
        "600",
        "--ping-ms",
        "200",
        "--replicate",
        "nats://127.0.0.1:1",
    ]);
    assert!(
        err.contains("--lease-ms 600: with --replicate it must be at least 1000"),
        "{err}"
    );
    assert!(!dir.exists(), "nothing was created");
}

/// Guards guarantees 4 and 5 with real processes (T2, and T3 with real workers): `ferry
/// demo-flow-server` runs orders on a server and two worker processes, SIGKILLs the
/// worker holding the most shards and then the server; every order is charged and
/// notified once, the takeover comes within the lease plus 1 s, and nothing the
/// surviving worker ran before the server's kill runs again after it.
#[test]
fn worker_kills_lose_nothing_and_take_over_within_the_bound() {
    let scratch = Scratch::new("flow-serve-demo");
    let dir = scratch.path().join("demo");
    let dir_s = dir.display().to_string();
    let (code, out, err) = ferry_testkit::proc::run(
        Path::new(FERRY),
        &[
            "demo-flow-server",
            "--dir",
            &dir_s,
            "--orders",
            "60",
            "--json",
        ],
        &[],
    );
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| {
        panic!("the demo prints JSON ({e}): {out}\n{err}");
    });
    assert_eq!(code, 0, "{doc}\n{err}");
    assert_eq!(doc["ok"], true, "{doc}\n{err}");
    let part = &doc["flow_server"];
    assert_eq!(part["orders_wrong"], 0, "{doc}");
    assert_eq!(part["calls_again_after_server_kill"], 0, "{doc}");
    assert_eq!(part["finished_in_index"], 60, "{doc}");
    let takeover = part["takeover_ms"].as_f64().unwrap();
    assert!(takeover <= 3_000.0, "takeover {takeover} ms: {doc}");
}

/// The server's /status on `port`, once it answers.
fn status(port: u16) -> Option<serde_json::Value> {
    let mut r = ureq::get(format!("http://127.0.0.1:{port}/status"))
        .call()
        .ok()?;
    serde_json::from_str(&r.body_mut().read_to_string().ok()?).ok()
}

/// How many shards worker `pid` holds by the server's status, granted.
fn held_by(port: u16, pid: u32) -> usize {
    let Some(st) = status(port) else { return 0 };
    let name = format!("pid {pid}");
    let Some(session) = st["workers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|w| w["name"] == name.as_str() && w["connected"] == true)
        .and_then(|w| w["session"].as_str().map(str::to_string))
    else {
        return 0;
    };
    st["shards"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["holder"] == session.as_str() && s["granted"] == true)
        .count()
}

/// A worker process of the demo's (`ferry demo-flow-worker`) that starts no orders.
fn idle_worker(scratch: &Scratch, name: &str, socket: &Path) -> Proc {
    order_worker(
        scratch,
        name,
        &unix(socket),
        "http://127.0.0.1:9",
        1,
        "never",
    )
}

fn unix(socket: &Path) -> String {
    format!("unix:{}", socket.display())
}

/// A worker process of the demo's running `orders` orders against the payments
/// service at `service`, once the file `go` in the scratch directory exists; its token
/// is "sesame".
fn order_worker(
    scratch: &Scratch,
    name: &str,
    server: &str,
    service: &str,
    orders: u32,
    go: &str,
) -> Proc {
    let dir = scratch.path().join(name).display().to_string();
    let go = scratch.path().join(go).display().to_string();
    let orders = orders.to_string();
    Proc::spawn(
        name,
        Path::new(FERRY),
        &[
            "demo-flow-worker",
            "--server",
            server,
            "--service",
            service,
            "--orders",
            &orders,
            "--dir",
            &dir,
            "--go",
            &go,
        ],
        // The token of the servers that ask for one (the rest ask for none).
        &[("FERRY_FLOW_TOKEN", "sesame")],
        &scratch.path().join(format!("{name}.log")),
    )
}

/// Guards T11 (§8.2): a worker process told to stop (SIGTERM) hands its shards back at
/// once, so the standby holds them well within the lease (6 s here: an expiry would
/// take longer than that after the last ping), and the worker exits cleanly.
#[test]
fn sigterm_hands_back_at_once() {
    let scratch = Scratch::new("flow-serve-handback");
    let (server, socket, port) = serve_in(&scratch, "6000");
    let a = idle_worker(&scratch, "a", &socket);
    assert!(
        wait_until(Duration::from_secs(20), || held_by(port, a.pid())
            == SHARDS as usize),
        "a holds every shard: {}",
        a.log_text()
    );
    let b = idle_worker(&scratch, "b", &socket);
    assert!(
        wait_until(Duration::from_secs(20), || held_by(port, b.pid()) > 0),
        "b is given some shards: {}",
        b.log_text()
    );
    let start = std::time::Instant::now();
    assert_eq!(a.term(Duration::from_secs(10)), Some(0), "a exits cleanly");
    assert!(
        wait_until(Duration::from_secs(10), || held_by(port, b.pid())
            == SHARDS as usize),
        "b takes every shard: {}",
        b.log_text()
    );
    let took = start.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "the hand-back took {took:?}, not well within the 6 s lease"
    );
    eprintln!("handed back in {took:?}");
    drop(b);
    drop(server);
}

/// One call the payments service took: what, the key, the calling process, when.
#[derive(Clone, Debug)]
struct Call {
    what: String,
    key: String,
    by: u32,
    at: std::time::Instant,
}

/// A payments service for the demo's worker processes (plain HTTP/1.1, one thread per
/// call): it records every call and answers a charge after 200 ms with its key's
/// effect.
fn payments() -> (String, std::sync::Arc<std::sync::Mutex<Vec<Call>>>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let recorded = calls.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let recorded = recorded.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(&stream);
                let mut line = String::new();
                let _ = reader.read_line(&mut line);
                // Drain the headers.
                loop {
                    let mut h = String::new();
                    if reader.read_line(&mut h).unwrap_or(0) <= 2 {
                        break;
                    }
                }
                let target = line.split(' ').nth(1).unwrap_or("").to_string();
                let (path, query) = target.split_once('?').unwrap_or((&target, ""));
                let field = |name: &str| {
                    query
                        .split('&')
                        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                        .unwrap_or("")
                        .to_string()
                };
                let call = Call {
                    what: path.trim_start_matches('/').to_string(),
                    key: field("key"),
                    by: field("by").parse().unwrap_or(0),
                    at: std::time::Instant::now(),
                };
                recorded.lock().unwrap().push(call.clone());
                if call.what == "charge" {
                    std::thread::sleep(Duration::from_millis(200));
                }
                let body = format!("{}-{}", call.what, call.key);
                let _ = write!(
                    &stream,
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    (url, calls)
}

/// Guards guarantees 1 and 2 with a real pause (T4): a worker SIGSTOPped with charges
/// under way loses its shards to a standby after the lease; woken (SIGCONT) past its
/// deadline, it starts no step body (no call of its reaches the service after it
/// wakes, but what was already on the wire), and every order is charged and notified
/// once, by key. (Here what stops the woken worker first is that its stream is lost,
/// so a run's next append or wait fails; `crates/ferry-flow/tests/fence.rs` covers the
/// deadline check before a body starts.)
#[test]
fn a_paused_worker_is_refused_and_starts_nothing() {
    const ORDERS: u32 = 40;
    let scratch = Scratch::new("flow-serve-pause");
    let (server, socket, port) = serve_in(&scratch, "3000");
    let (service, calls) = payments();
    std::fs::write(scratch.path().join("go"), b"").unwrap();
    let a = order_worker(&scratch, "a", &unix(&socket), &service, ORDERS, "go");
    // Stopped as its first notification arrives: most of its orders are charged and
    // in their packing timer, which runs out while it is stopped.
    let notified_by = |pid: u32| {
        let calls = calls.lock().unwrap();
        calls.iter().any(|c| c.by == pid && c.what == "notify")
    };
    assert!(
        wait_until(Duration::from_secs(20), || notified_by(a.pid())),
        "a calls the service: {}",
        a.log_text()
    );
    a.stop();
    let b = order_worker(&scratch, "b", &unix(&socket), &service, ORDERS, "go");
    assert!(
        wait_until(Duration::from_secs(20), || held_by(port, b.pid())
            == SHARDS as usize),
        "b takes every shard after a's lease: {}",
        b.log_text()
    );
    std::thread::sleep(Duration::from_millis(500));
    a.cont();
    let woke = std::time::Instant::now();
    let notified = |calls: &[Call]| {
        calls
            .iter()
            .filter(|c| c.what == "notify")
            .map(|c| c.key.split('/').next().unwrap().to_string())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    };
    assert!(
        wait_until(Duration::from_secs(30), || notified(&calls.lock().unwrap())
            == ORDERS as usize),
        "every order is notified: {}",
        b.log_text()
    );
    std::thread::sleep(Duration::from_millis(500));
    let calls = calls.lock().unwrap().clone();
    // What a had on the wire when it stopped may arrive as it wakes; nothing later.
    let late: Vec<&Call> = calls
        .iter()
        .filter(|c| c.by == a.pid() && c.at > woke + Duration::from_millis(300))
        .collect();
    eprintln!(
        "calls: {} by a, {} by b, {} in all for {ORDERS} orders",
        calls.iter().filter(|c| c.by == a.pid()).count(),
        calls.iter().filter(|c| c.by == b.pid()).count(),
        calls.len()
    );
    assert!(
        late.is_empty(),
        "a called after waking: {late:?}\n{}",
        a.log_text()
    );
    charged_under_one_key(&calls, ORDERS);
    assert_eq!(b.term(Duration::from_secs(10)), Some(0));
    assert_eq!(a.term(Duration::from_secs(10)), Some(0));
    drop(server);
}

/// Each of the demo's `orders` orders was charged under one key, however many times.
fn charged_under_one_key(calls: &[Call], orders: u32) {
    for n in 0..orders {
        let id = format!("order-{n:03}");
        let keys: std::collections::BTreeSet<&str> = calls
            .iter()
            .filter(|c| c.what == "charge" && c.key.starts_with(&format!("{id}/")))
            .map(|c| c.key.as_str())
            .collect();
        assert_eq!(keys.len(), 1, "{id} is charged under one key: {keys:?}");
    }
}

/// `ferry flow ...` with `args`; its exit code, stdout and stderr.
fn ferry_flow(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut all = vec!["flow"];
    all.extend(args);
    ferry_testkit::proc::run(Path::new(FERRY), &all, env)
}

/// Guards guarantee 7 through the CLI (T1's list and show half, §10): `ferry flow
/// list|show|start|result|signal|cancel --server` against a real `ferry flow serve
/// --http` with a worker process; list and show still answer once the worker is
/// SIGKILLed; a missing token is refused by name and changes nothing.
#[test]
fn the_cli_reaches_runs_through_the_servers_http_api() {
    const ORDERS: u32 = 6;
    let scratch = Scratch::new("flow-serve-cli");
    let socket = scratch.path().join("flow.sock");
    let http = free_port();
    let api = format!("http://127.0.0.1:{http}");
    let tokens = scratch.path().join("tokens");
    std::fs::write(&tokens, "sesame\n").unwrap();
    let http_flag = format!("127.0.0.1:{http}");
    let tokens_flag = tokens.display().to_string();
    let server = serve_more(
        &scratch.path().join("server"),
        &socket,
        None,
        &scratch.path().join("server.log"),
        "3000",
        &[
            "--http",
            &http_flag,
            "--token-file",
            &tokens_flag,
            "--call-wait-ms",
            "500",
        ],
    );
    let (service, _calls) = payments();
    std::fs::write(scratch.path().join("go"), b"").unwrap();
    let worker = order_worker(&scratch, "w", &unix(&socket), &service, ORDERS, "go");
    let token = [("FERRY_FLOW_TOKEN", "sesame")];
    let list = || {
        let (code, out, err) = ferry_flow(&["list", "--server", &api, "--json"], &token);
        (code == 0)
            .then(|| serde_json::from_str::<serde_json::Value>(&out).unwrap())
            .ok_or(err)
    };
    let finished = |v: &serde_json::Value| {
        v["runs"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["state"] == "finished")
            .count()
    };
    assert!(
        wait_until(Duration::from_secs(60), || list()
            .is_ok_and(|v| finished(&v) == ORDERS as usize)),
        "every order finishes: {:?}\n{}",
        list(),
        worker.log_text()
    );
    // Start and wait for one more from the CLI; it runs on the worker.
    let (code, out, err) = ferry_flow(&["start", "--server", &api, "order", "cli-1", "7"], &token);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = ferry_flow(
        &[
            "result",
            "--server",
            &api,
            "cli-1",
            "--wait-ms",
            "30000",
            "--json",
        ],
        &token,
    );
    assert_eq!(code, 0, "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["state"], "finished", "{r}");
    // A finished run takes no signal, and has nothing to cancel.
    let (code, _, err) = ferry_flow(&["signal", "--server", &api, "cli-1", "x"], &token);
    assert_ne!(code, 0);
    assert!(err.contains("had finished"), "{err}");
    let (code, out, err) = ferry_flow(&["cancel", "--server", &api, "cli-1"], &token);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("already finished"), "{out}");
    // No token: refused by name, nothing started.
    let (code, _, err) = ferry_flow(&["start", "--server", &api, "order", "cli-2", "1"], &[]);
    assert_ne!(code, 0);
    assert!(
        err.contains("401") && err.contains("FERRY_FLOW_TOKEN"),
        "{err}"
    );
    // With the worker gone, list and show still answer from the server.
    worker.kill9();
    let v = list().unwrap();
    assert_eq!(finished(&v), ORDERS as usize + 1, "{v}");
    assert!(
        v["runs"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["id"] != "cli-2")
    );
    let (code, out, err) = ferry_flow(&["show", "--server", &api, "cli-1"], &token);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("state      finished"), "{out}");
    // A call needs a worker: refused as transient.
    let (code, _, err) = ferry_flow(&["cancel", "--server", &api, "cli-1"], &token);
    assert_ne!(code, 0);
    assert!(err.contains("503") && err.contains("try again"), "{err}");
    server.term(Duration::from_secs(10));
}

/// One `ferry flow serve --replicate`: its process, directory and socket.
struct Node {
    proc: Proc,
    dir: PathBuf,
    socket: PathBuf,
}

fn start(scratch: &Scratch, name: &str, nats: &str) -> Node {
    let dir = scratch.path().join(name);
    let socket = scratch.path().join(format!("{name}.sock"));
    let listen = format!("unix:{}", socket.display());
    let d = dir.display().to_string();
    let proc = Proc::spawn(
        &format!("ferry flow serve ({name})"),
        Path::new(FERRY),
        &[
            "flow",
            "serve",
            "--dir",
            &d,
            "--listen",
            &listen,
            "--shards",
            "4",
            "--lease-ms",
            "3000",
            "--ping-ms",
            "500",
            "--replicate",
            nats,
            "--stream",
            "FLOW_TEST",
        ],
        &[],
        &scratch.path().join(format!("{name}.log")),
    );
    Node { proc, dir, socket }
}

fn serving(node: &Node, within: Duration) -> bool {
    wait_until(within, || {
        std::os::unix::net::UnixStream::connect(&node.socket).is_ok()
    })
}

/// Guards docs/flow-server-replica.md guarantees 1 and 2 (item 8 of the server-mode
/// issue): nothing acknowledged is lost when the server's machine is, and a deposed
/// server acknowledges nothing after the takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_takes_over_from_the_stream_and_nothing_acknowledged_is_lost() {
    let scratch = Scratch::new("flow-replica");
    let mut nats = NatsCluster::start(scratch.path());
    let url = nats.url();
    let mut rng = SplitMix64::seeded(29);
    let mut shards = Sent::default();
    let mut primary = start(&scratch, "a", &url);
    assert!(
        serving(&primary, Duration::from_secs(60)),
        "the first server serves: {}",
        primary.proc.log_text()
    );
    let mut standby = start(&scratch, "b", &url);
    let mut names = ["c", "d", "e"].into_iter();
    for round in 0..4 {
        // The standby waits for the lock: it does not listen.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !serving(&standby, Duration::from_millis(100)),
            "round {round}: a standby serves while the server holds the lock"
        );
        let mut peer = shards.hello(&primary.socket, round).await;
        if round == 3 {
            break;
        }
        shards.waves(&mut peer, &mut rng).await;
        let gone = Instant::now();
        let old = if round < 2 {
            // The machine is lost: the process and its directory.
            primary.proc.kill9();
            std::fs::remove_dir_all(&primary.dir).unwrap();
            if round == 1 {
                // And a NATS node with it: a stream of three replicas goes on with two.
                nats.kill(0);
            }
            None
        } else {
            // Paused past its lock: the standby takes over while it sleeps.
            primary.proc.stop();
            Some(primary.proc)
        };
        // A NATS node lost too: its streams elect new leaders first (15 s was seen on a
        // loaded two-core machine).
        assert!(
            serving(&standby, Duration::from_secs(60)),
            "round {round}: the standby serves: {}",
            standby.proc.log_text()
        );
        eprintln!(
            "round {round}: the standby serves {:?} after the server went",
            gone.elapsed()
        );
        if let Some(mut paused) = old {
            // Woken, the deposed server stops: its lock and its next publish fail.
            paused.cont();
            assert!(
                wait_until(Duration::from_secs(20), || paused.exited().is_some()),
                "round {round}: the deposed server stops: {}",
                paused.log_text()
            );
            assert_ne!(paused.exited(), Some(Some(0)), "round {round}");
        }
        // Woken, the paused server heard no ping for longer than a lease: it may revoke
        // and refuse before it finds itself deposed.
        shards.drain(peer, round, round == 2).await;
        if round == 2 {
            nats.up(0);
        }
        primary = standby;
        standby = start(&scratch, names.next().unwrap(), &url);
    }
    let total = shards.total();
    eprintln!(
        "acknowledged {total} records over the takeovers: {:?}",
        shards.acked
    );
    assert!(total > 300, "the rounds acknowledged only {total} records");
    primary.proc.term(Duration::from_secs(10));
    standby.proc.term(Duration::from_secs(10));
}

/// Guards docs/flow-server-replica.md guarantee 1 with real workers: two worker
/// processes of the demo's name the server and its standby; the server's machine is
/// lost while orders run (SIGKILL, its directory removed); the standby takes over from
/// the stream, the workers dial it, and every order is charged under one key and
/// notified.
#[test]
fn workers_follow_a_replicated_server_to_its_standby() {
    const ORDERS: u32 = 30;
    let scratch = Scratch::new("flow-replica-workers");
    let nats = NatsCluster::start(scratch.path());
    let url = nats.url();
    let a = start(&scratch, "a", &url);
    assert!(
        serving(&a, Duration::from_secs(60)),
        "the server serves: {}",
        a.proc.log_text()
    );
    let b = start(&scratch, "b", &url);
    let servers = format!("{},{}", unix(&a.socket), unix(&b.socket));
    let (service, calls) = payments();
    std::fs::write(scratch.path().join("go"), b"").unwrap();
    let w1 = order_worker(&scratch, "w1", &servers, &service, ORDERS, "go");
    let w2 = order_worker(&scratch, "w2", &servers, &service, ORDERS, "go");
    let charged = || {
        let calls = calls.lock().unwrap();
        calls.iter().filter(|c| c.what == "charge").count()
    };
    assert!(
        wait_until(Duration::from_secs(30), || charged() >= ORDERS as usize / 3),
        "the workers charge: {}",
        w1.log_text()
    );
    a.proc.kill9();
    std::fs::remove_dir_all(&a.dir).unwrap();
    let notified = || {
        let calls = calls.lock().unwrap();
        calls
            .iter()
            .filter(|c| c.what == "notify")
            .map(|c| c.key.split('/').next().unwrap().to_string())
            .collect::<std::collections::BTreeSet<_>>()
            .len()
    };
    assert!(
        wait_until(Duration::from_secs(60), || notified() == ORDERS as usize),
        "every order is notified ({} of {ORDERS}): {}\n{}",
        notified(),
        b.proc.log_text(),
        w1.log_text()
    );
    let calls = calls.lock().unwrap().clone();
    charged_under_one_key(&calls, ORDERS);
    assert_eq!(w1.term(Duration::from_secs(10)), Some(0));
    assert_eq!(w2.term(Duration::from_secs(10)), Some(0));
    b.proc.term(Duration::from_secs(10));
}
