//! The outbox relay as a real process, killed, stopped and starved: SIGKILL mid-batch,
//! SIGSTOP past its lease, Postgres crashing under it, NATS away longer than any retry
//! budget. Every scenario ends with the ledger check (each committed message arrived
//! once, nothing rolled back arrived, keys in commit order) and no message parked.

#[path = "../../ferry-outbox/tests/common/mod.rs"]
mod common;

use common::*;
use ferry_outbox::sink::Faults;
use ferry_testkit::proc::Proc;
use ferry_testkit::servers::{PrivateNats, PrivatePg};
use ferry_testkit::{Scratch, free_port};
use std::path::PathBuf;
use std::time::Duration;

fn ferry() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ferry"))
}

/// A `ferry outbox relay` process with a metrics port.
struct RelayProc {
    proc: Option<Proc>,
    metrics: u16,
}

impl RelayProc {
    fn start(scratch: &Scratch, name: &str, db: &str, to: &str, extra: &[&str]) -> RelayProc {
        Self::start_with(scratch, name, db, to, extra, &[])
    }

    fn start_with(
        scratch: &Scratch,
        name: &str,
        db: &str,
        to: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> RelayProc {
        let metrics = free_port();
        let listen = format!("127.0.0.1:{metrics}");
        let mut args = vec![
            "outbox",
            "relay",
            "--db",
            db,
            "--to",
            to,
            "--metrics-listen",
            &listen,
            "--lease-ms",
            "2000",
            "--publish-timeout-ms",
            "900",
            "--poll-ms",
            "200",
            "--batch",
            "32",
            "--window",
            "8",
        ];
        args.extend_from_slice(extra);
        let log = scratch.path().join(format!("{name}.log"));
        let mut envs = vec![("FERRY_LOG", "info")];
        envs.extend_from_slice(env);
        let proc = Proc::spawn(name, &ferry(), &args, &envs, &log);
        if env
            .iter()
            .any(|(k, _)| *k == "FERRY_OUTBOX_CRASH_BEFORE_SETTLE")
        {
            return RelayProc {
                proc: Some(proc),
                metrics,
            };
        }
        assert!(
            ferry_testkit::wait_until(Duration::from_secs(20), || std::net::TcpStream::connect((
                "127.0.0.1",
                metrics
            ))
            .is_ok()),
            "{name} did not start; see {}",
            log.display()
        );
        RelayProc {
            proc: Some(proc),
            metrics,
        }
    }

    /// A counter from its /metrics.
    fn counter(&self, name: &str) -> u64 {
        let body = ureq::get(&format!("http://127.0.0.1:{}/metrics", self.metrics))
            .call()
            .ok()
            .and_then(|mut r| r.body_mut().read_to_string().ok())
            .unwrap_or_default();
        body.lines()
            .find_map(|l| {
                l.strip_prefix(&format!("{name} "))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            })
            .unwrap_or(0.0) as u64
    }

    fn kill9(&mut self) {
        if let Some(p) = self.proc.take() {
            p.kill9();
        }
    }

    fn signal(&self, sig: &str) {
        let pid = self.proc.as_ref().expect("running").pid();
        let _ = std::process::Command::new("kill")
            .args([&format!("-{sig}"), &pid.to_string()])
            .status();
    }

    fn stop(mut self) {
        if let Some(p) = self.proc.take() {
            assert_eq!(
                p.term(Duration::from_secs(30)),
                Some(0),
                "the relay did not stop cleanly on SIGTERM"
            );
        }
    }
}

impl Drop for RelayProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

// Guards against loss and visible duplicates when a relay dies between publishing and
// settling: the relay is SIGKILLed three times while the app writes; each time the
// messages it held come back after their lease and are presented again under the same
// id, which the endpoint recognises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_batch_loses_nothing_and_its_resends_are_recognised() {
    let scratch = Scratch::new("outbox-kill");
    let db = TestDb::create().await;
    let store = install(&db.url).await;
    let app = App::open(&store).await;
    let sink = RunningSink::start(None).await;
    sink.sink.set_faults(Faults {
        delay: Some(Duration::from_millis(5)),
        ..Faults::default()
    });
    let mut relay = RelayProc::start(&scratch, "relay", &db.url, &sink.url, &[]);
    let mut ledger = Ledger::default();
    for round in 0..3u64 {
        let l = write_workload(&app, 80, 6, 10 + round).await;
        ledger.committed.extend(l.committed);
        ledger.rolled_back.extend(l.rolled_back);
        assert!(
            eventually(Duration::from_secs(20), || relay
                .counter("ferry_outbox_published_total")
                > 5)
            .await
        );
        relay.kill9();
        relay = RelayProc::start(&scratch, "relay", &db.url, &sink.url, &[]);
    }
    assert!(drained(&store, Duration::from_secs(60)).await);
    relay.stop();
    ledger.check(&sink.sink.received());
    assert_eq!(store.status().await.unwrap().parked, 0);
}

// Guards against a stale relay writing after its lease ran out: relay A is SIGSTOPped
// in the middle of a slow batch for longer than its lease; relay B takes the batch over;
// A resumes, finishes publishing (the endpoint recognises the repeats) and its settle is
// refused: A counts fenced rows and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_paused_past_its_lease_is_fenced_and_writes_nothing() {
    let scratch = Scratch::new("outbox-fence");
    let db = TestDb::create().await;
    let store = install(&db.url).await;
    let app = App::open(&store).await;
    let sink = RunningSink::start(None).await;
    sink.sink.set_faults(Faults {
        delay: Some(Duration::from_millis(150)),
        ..Faults::default()
    });
    let ledger = write_workload(&app, 60, 20, 20).await;
    let a = RelayProc::start(&scratch, "relay-a", &db.url, &sink.url, &["--lanes", "1"]);
    assert!(
        eventually(Duration::from_secs(20), || a
            .counter("ferry_outbox_leased_total")
            > 0)
        .await
    );
    a.signal("STOP");
    let b = RelayProc::start(&scratch, "relay-b", &db.url, &sink.url, &["--lanes", "1"]);
    tokio::time::sleep(Duration::from_secs(4)).await;
    a.signal("CONT");
    assert!(drained(&store, Duration::from_secs(60)).await);
    assert!(
        eventually(Duration::from_secs(20), || a
            .counter("ferry_outbox_fenced_total")
            > 0)
        .await,
        "relay A was never fenced"
    );
    a.stop();
    b.stop();
    ledger.check(&sink.sink.received());
}

// Guards against a database crash under a relay losing or duplicating messages: the
// relay's private Postgres is crashed (immediate stop) and restarted while the app and
// the relay run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crashing_under_a_relay_loses_nothing() {
    let scratch = Scratch::new("outbox-pg-crash");
    let pg = PrivatePg::start(scratch.path());
    let url = pg.url("postgres");
    let store = install(&url).await;
    let app = App::open(&store).await;
    let sink = RunningSink::start(None).await;
    let relay = RelayProc::start(&scratch, "relay", &url, &sink.url, &[]);
    let mut ledger = write_workload(&app, 100, 5, 30).await;
    pg.down("immediate");
    tokio::time::sleep(Duration::from_secs(2)).await;
    pg.up();
    // The app's pool reconnects; write on.
    let mut more = None;
    for _ in 0..50 {
        match tokio::time::timeout(Duration::from_secs(5), async {
            write_workload(&app, 100, 5, 31).await
        })
        .await
        {
            Ok(l) => {
                more = Some(l);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    let more = more.expect("the app could not write after the restart");
    ledger.committed.extend(more.committed);
    ledger.rolled_back.extend(more.rolled_back);
    assert!(drained(&store, Duration::from_secs(60)).await);
    relay.stop();
    ledger.check(&sink.sink.received());
}

// Guards against an outage turning into parked messages (ai-crew-sync parks after a few
// minutes of broker outage): NATS is killed for longer than a message's whole retry
// budget at --max-attempts 2; nothing is parked, no attempt is spent, and the relay
// resumes by itself when NATS is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_away_longer_than_the_retry_budget_parks_nothing_and_resumes_by_itself() {
    let scratch = Scratch::new("outbox-nats-down");
    let mut nats = PrivateNats::start(scratch.path());
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "ORDERS".into(),
        subjects: vec!["orders.>".into()],
        storage: async_nats::jetstream::stream::StorageType::File,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .unwrap();
    let db = TestDb::create().await;
    let store = install(&db.url).await;
    let app = App::open(&store).await;
    let relay = RelayProc::start(
        &scratch,
        "relay",
        &db.url,
        &nats.url(),
        &["--stream", "ORDERS", "--max-attempts", "2"],
    );
    let mut ledger = write_workload(&app, 50, 5, 40).await;
    assert!(drained(&store, Duration::from_secs(30)).await);
    nats.kill();
    let l = write_workload(&app, 50, 5, 41).await;
    ledger.committed.extend(l.committed);
    ledger.rolled_back.extend(l.rolled_back);
    // NATS stays away for 8 s, far longer than two attempts' retries would take; the
    // relay goes on trying it meanwhile (its probes fail: the path under test ran) and
    // parks nothing.
    let probes = relay.counter("ferry_outbox_breaker_probes_failed_total");
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        relay.counter("ferry_outbox_breaker_probes_failed_total") >= probes + 3,
        "the relay stopped trying NATS"
    );
    let st = store.status().await.unwrap();
    assert_eq!(st.parked, 0, "{st:?}");
    assert!(st.pending + st.uncertain > 0, "{st:?}");
    nats.up();
    assert!(drained(&store, Duration::from_secs(60)).await);
    assert_eq!(
        relay.counter("ferry_outbox_retried_total"),
        0,
        "the outage spent attempts"
    );
    let openings = relay.counter("ferry_outbox_breaker_openings_total");
    relay.stop();
    // The log says what happened, with the server, once per event: one pause line per
    // opening of the breaker (each stating the pause in force), the lost connection and
    // the reconnection.
    let log = std::fs::read_to_string(scratch.path().join("relay.log")).unwrap();
    let pauses = log
        .lines()
        .filter(|l| l.contains("pausing publishing for"))
        .count() as u64;
    assert!(openings >= 1, "the breaker never opened");
    assert_eq!(pauses, openings, "one pause line per opening:\n{log}");
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("lost the connection to NATS")
            && l.contains(&nats.url())),
        "{log}"
    );
    assert!(log.contains("reconnected to NATS"), "{log}");
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let got = stream_contents(&js, "ORDERS").await;
    ledger.check(&got);
}

// Bad input at start-up is told apart and changes nothing: each command fails with a
// message naming what and where, and the outbox it pointed at is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_is_refused_at_start_up_with_what_and_where() {
    let scratch = Scratch::new("outbox-bad");
    let db = format!("sqlite:{}", scratch.path().join("app.db").display());
    let run = |args: &[&str]| {
        let (code, _, stderr) = ferry_testkit::proc::run(&ferry(), args, &[]);
        assert!(code != 0, "{args:?} succeeded");
        stderr
    };
    let e = run(&["outbox", "status", "--db", &db]);
    assert!(
        e.contains("has no outbox schema") && e.contains("ferry outbox install"),
        "{e}"
    );
    let store = install(&db).await;
    let app = App::open(&store).await;
    let ledger = write_workload(&app, 10, 2, 70).await;
    let before = store.status().await.unwrap();
    let nats = nats_url();
    // `ferry outbox relay` on this outbox, to `to`, with `extra` flags.
    let relay = |to, extra: &[_]| {
        let mut args = vec!["outbox", "relay", "--db", db.as_str(), "--to", to];
        args.extend_from_slice(extra);
        args
    };
    let nowhere = "http://127.0.0.1:9/";
    for (args, want) in [
        (
            vec!["outbox", "status", "--db", "mysql://x/y"],
            "use postgres://",
        ),
        (relay("ftp://x", &[]), "use nats://HOST:PORT"),
        (
            relay("nats://127.0.0.1:1", &[]),
            "cannot connect to NATS at nats://127.0.0.1:1",
        ),
        (
            relay(&nats, &["--stream", "NO_SUCH_STREAM"]),
            "--stream NO_SUCH_STREAM: NATS at",
        ),
        (
            vec![
                "outbox",
                "relay",
                "--db",
                "postgres://postgres@127.0.0.1:1/x",
                "--to",
                nowhere,
            ],
            "cannot connect to Postgres at postgres://postgres@127.0.0.1:1/x as postgres",
        ),
        (
            relay(nowhere, &["--batch", "0"]),
            "--batch 0: must be between",
        ),
        (
            relay(nowhere, &["--lease-ms", "500"]),
            "--lease-ms 500: must be at least 1000 ms",
        ),
        // The settings are checked before anything is connected: a wrong one is
        // reported even when the database is away.
        (
            vec![
                "outbox",
                "relay",
                "--db",
                "postgres://postgres@127.0.0.1:1/x",
                "--to",
                "nats://127.0.0.1:1",
                "--window",
                "0",
            ],
            "--window 0: must be between",
        ),
        (
            relay(nowhere, &["--publish-timeout-ms", "20000"]),
            "must be under half of --lease-ms",
        ),
        (
            vec!["outbox", "requeue", "--db", &db],
            "say which parked messages",
        ),
        (
            vec![
                "outbox",
                "status",
                "--db",
                "postgres://nobody@127.0.0.1:5432/postgres",
            ],
            "cannot connect to Postgres at postgres://nobody@127.0.0.1:5432/postgres as nobody: role \"nobody\" does not exist (SQLSTATE 28000) — check the user and password in the database URL",
        ),
    ] {
        let e = run(&args);
        assert!(e.contains(want), "{args:?}: {e:?} should say {want:?}");
        // Once, in the words a person needs: not Postgres's source line, not the same
        // error again as its own cause.
        assert!(!e.contains(" at line "), "{args:?}: {e:?}");
        assert_eq!(
            e.lines().filter(|l| l.contains("error")).count(),
            1,
            "{args:?}: {e:?}"
        );
    }
    let after = store.status().await.unwrap();
    assert_eq!(
        (after.pending, after.uncertain, after.leased, after.parked),
        (
            before.pending,
            before.uncertain,
            before.leased,
            before.parked
        ),
        "a refused command changed the outbox"
    );
    assert_eq!(before.pending as usize, ledger.committed.len());
}

// Guards the exact case transports deduplicate for, on the embedded store: a relay on
// SQLite publishes a whole batch and dies before settling it (a failpoint aborts the
// process there). The next relay finds the batch's lease run out, presents every
// message again under the same id, and the endpoint recognises each one: nothing lost,
// nothing stored twice, order per key kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlite_relay_dying_between_publish_and_settle_loses_nothing_and_stores_nothing_twice() {
    let scratch = Scratch::new("outbox-settle-crash");
    let db = format!("sqlite:{}", scratch.path().join("app.db").display());
    let store = install(&db).await;
    let app = App::open(&store).await;
    let sink = RunningSink::start(None).await;
    let ledger = write_workload(&app, 120, 6, 80).await;
    let mut doomed = RelayProc::start_with(
        &scratch,
        "doomed",
        &db,
        &sink.url,
        &["--lanes", "1"],
        &[("FERRY_OUTBOX_CRASH_BEFORE_SETTLE", "1")],
    );
    assert!(
        eventually(Duration::from_secs(20), || sink.sink.received_count() > 0).await,
        "the doomed relay published nothing"
    );
    // It aborts right after its first batch.
    assert!(
        eventually(Duration::from_secs(10), || doomed
            .proc
            .as_mut()
            .is_some_and(|p| p.exited().is_some()))
        .await
    );
    let published_by_doomed = sink.sink.received_count();
    doomed.kill9();
    let relay = RelayProc::start(&scratch, "relay", &db, &sink.url, &[]);
    assert!(drained(&store, Duration::from_secs(60)).await);
    relay.stop();
    ledger.check(&sink.sink.received());
    assert_eq!(
        sink.sink.duplicates() as usize,
        published_by_doomed,
        "every message of the unsettled batch was presented again and recognised"
    );
}
