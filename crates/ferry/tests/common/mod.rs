//! The rig every ferry-ship process test stands on: a primary directory the test writes
//! as the app, a `ferry ship` sidecar process, a `ferry receive` process, and checks that
//! read the replica on connections of their own.
#![allow(dead_code)]

use ferry_ship::proto::Position;
use ferry_ship::shipper::{DbStatus, ShipperStatus};
use ferry_testkit::proc::Proc;
use ferry_testkit::{Scratch, free_port, wait_until, workload};
use rusqlite::{Connection, OpenFlags};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

pub const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

pub fn ferry() -> &'static Path {
    Path::new(FERRY)
}

pub struct Rig {
    pub primary: PathBuf,
    pub standby: PathBuf,
    pub port: u16,
    pub metrics_port: u16,
    /// Where the shipper sends: the receiver, or a proxy in front of it.
    pub peer: String,
    pub token_file: Option<PathBuf>,
    pub ship_args: Vec<String>,
    pub receive_args: Vec<String>,
    receiver: Option<Proc>,
    shipper: Option<Proc>,
    /// Last: fields drop in order, and the processes must be gone before their files.
    pub scratch: Scratch,
}

impl Rig {
    pub fn new(name: &str) -> Rig {
        let scratch = Scratch::new(name);
        let primary = scratch.dir("primary");
        let standby = scratch.dir("standby");
        let port = free_port();
        Rig {
            primary,
            standby,
            port,
            metrics_port: free_port(),
            peer: format!("http://127.0.0.1:{port}"),
            token_file: None,
            ship_args: Vec::new(),
            receive_args: Vec::new(),
            receiver: None,
            shipper: None,
            scratch,
        }
    }

    pub fn receiver_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn start_receiver(&mut self) {
        assert!(self.receiver.is_none(), "receiver already running");
        let mut args = vec![
            "ship".to_string(),
            "receive".into(),
            "--dir".into(),
            self.standby.display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{}", self.port),
        ];
        if let Some(t) = &self.token_file {
            args.extend(["--token-file".into(), t.display().to_string()]);
        }
        args.extend(self.receive_args.clone());
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let log = self.scratch.path().join("receiver.log");
        let p = Proc::spawn("receiver", ferry(), &args, &[("FERRY_LOG", "info")], &log);
        let port = self.port;
        assert!(
            wait_until(Duration::from_secs(20), || std::net::TcpStream::connect((
                "127.0.0.1",
                port
            ))
            .is_ok()),
            "the receiver did not listen; log:\n{}",
            p.log_text()
        );
        self.receiver = Some(p);
    }

    pub fn kill_receiver(&mut self) {
        if let Some(p) = self.receiver.take() {
            p.kill9();
        }
    }

    pub fn receiver(&self) -> &Proc {
        self.receiver.as_ref().expect("receiver running")
    }

    pub fn stop_receiver(&mut self) -> Option<i32> {
        self.receiver
            .take()
            .and_then(|p| p.term(Duration::from_secs(20)))
    }

    pub fn start_shipper(&mut self) {
        assert!(self.shipper.is_none(), "shipper already running");
        let mut args = vec![
            "ship".to_string(),
            "send".into(),
            "--dir".into(),
            self.primary.display().to_string(),
            "--peer".into(),
            self.peer.clone(),
            "--metrics-listen".into(),
            format!("127.0.0.1:{}", self.metrics_port),
        ];
        if let Some(t) = &self.token_file {
            args.extend(["--token-file".into(), t.display().to_string()]);
        }
        // Tests run crashing processes side by side on two cores. A shipper at its default
        // niceness can then be starved for a second while the writer keeps writing, and
        // if that falls right after a fold the writer can overwrite the end of the old
        // cycle before the shipper proves the reset: a base, as docs/ship.md §3.1 says a
        // starved nice shipper may need. That is not what these tests check (a base
        // there would hide the bases they are about), so their shippers run at nice 0
        // unless a test says otherwise.
        if !self.ship_args.iter().any(|a| a == "--nice") {
            args.extend(["--nice".into(), "0".into()]);
        }
        args.extend(self.ship_args.clone());
        let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let log = self.scratch.path().join("shipper.log");
        let level = std::env::var("FERRY_TEST_LOG").unwrap_or_else(|_| "info".into());
        let p = Proc::spawn(
            "shipper",
            ferry(),
            &args,
            &[("FERRY_LOG", level.as_str())],
            &log,
        );
        let port = self.metrics_port;
        assert!(
            wait_until(Duration::from_secs(20), || std::net::TcpStream::connect((
                "127.0.0.1",
                port
            ))
            .is_ok()),
            "the shipper did not serve metrics; log:\n{}",
            p.log_text()
        );
        self.shipper = Some(p);
    }

    pub fn kill_shipper(&mut self) {
        if let Some(p) = self.shipper.take() {
            p.kill9();
        }
    }

    pub fn stop_shipper(&mut self) -> Option<i32> {
        self.shipper
            .take()
            .and_then(|p| p.term(Duration::from_secs(20)))
    }

    pub fn shipper_log(&self) -> String {
        std::fs::read_to_string(self.scratch.path().join("shipper.log")).unwrap_or_default()
    }

    pub fn receiver_log(&self) -> String {
        std::fs::read_to_string(self.scratch.path().join("receiver.log")).unwrap_or_default()
    }

    pub fn shipper_status(&self) -> Option<ShipperStatus> {
        get_json(
            &format!("http://127.0.0.1:{}/status", self.metrics_port),
            None,
        )
    }

    pub fn db_status(&self, name: &str) -> Option<DbStatus> {
        self.shipper_status()?
            .databases
            .into_iter()
            .find(|d| d.name == name)
    }

    pub fn position(&self, name: &str) -> Option<Position> {
        let token = self
            .token_file
            .as_ref()
            .map(|t| std::fs::read_to_string(t).unwrap().trim().to_string());
        get_json(
            &format!("{}/v1/replicas/{name}", self.receiver_url()),
            token,
        )
    }

    pub fn db(&self, name: &str) -> PathBuf {
        self.primary.join(format!("{name}.db"))
    }

    pub fn replica_path(&self, name: &str) -> PathBuf {
        self.standby.join(format!("{name}.db"))
    }

    /// Workload transactions the replica shows (0 if it does not exist yet).
    pub fn replica_txns(&self, name: &str) -> u64 {
        Connection::open_with_flags(self.replica_path(name), OpenFlags::SQLITE_OPEN_READ_ONLY)
            .map(|c| workload::txns(&c))
            .unwrap_or(0)
    }

    /// A read-only connection to the replica.
    pub fn replica(&self, name: &str) -> Connection {
        Connection::open_with_flags(self.replica_path(name), OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("opening the replica")
    }

    /// Wait until the replica shows `txns` workload transactions and the shipper is idle
    /// with nothing outstanding.
    pub fn wait_synced(&self, name: &str, txns: u64, limit: Duration) {
        let ok = wait_until(limit, || {
            let replica_txns = Connection::open_with_flags(
                self.replica_path(name),
                OpenFlags::SQLITE_OPEN_READ_ONLY,
            )
            .map(|c| workload::txns(&c))
            .unwrap_or(0);
            replica_txns == txns
                && self
                    .db_status(name)
                    .is_some_and(|d| d.lag_transactions == 0 && d.state == "idle")
        });
        if !ok {
            let replica_txns = Connection::open_with_flags(
                self.replica_path(name),
                OpenFlags::SQLITE_OPEN_READ_ONLY,
            )
            .map(|c| workload::txns(&c))
            .unwrap_or(0);
            panic!(
                "{name}: the replica did not reach {txns} transactions within {limit:?} (it shows {replica_txns}); status: {:?}\n\
                 shipper log:\n{}\nreceiver log:\n{}",
                self.db_status(name),
                tail(&self.shipper_log()),
                tail(&self.receiver_log())
            );
        }
    }

    /// The replica equals the primary: same logical digest, integrity ok, chain ok.
    pub fn assert_equal(&self, name: &str) {
        let p = Connection::open(self.db(name)).unwrap();
        let r = self.replica(name);
        assert_eq!(workload::integrity(&r), "ok", "{name}: replica integrity");
        let dp = ferry_ship::sqlite::digest(&p).unwrap();
        let dr = ferry_ship::sqlite::digest(&r).unwrap();
        assert_eq!(dp, dr, "{name}: the replica differs from the primary");
        if has_workload(&r) {
            workload::verify(&r)
                .unwrap_or_else(|e| panic!("{name}: the replica fails verification: {e}"));
        }
    }
}

fn has_workload(c: &Connection) -> bool {
    c.query_row(
        "SELECT count(*) FROM sqlite_schema WHERE name = 'meta'",
        [],
        |r| r.get::<_, i64>(0),
    )
    .unwrap_or(0)
        == 1
}

pub fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

pub fn get_json<T: serde::de::DeserializeOwned>(url: &str, token: Option<String>) -> Option<T> {
    let agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(10)))
        .http_status_as_error(false)
        .build()
        .new_agent();
    let mut req = agent.get(url);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let mut resp = req.call().ok()?;
    if resp.status() != 200 {
        return None;
    }
    serde_json::from_str(&resp.body_mut().read_to_string().ok()?).ok()
}

/// POST raw bytes; returns (status, body).
pub fn post(url: &str, body: &[u8], token: Option<&str>) -> (u16, String) {
    let agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(30)))
        .http_status_as_error(false)
        .build()
        .new_agent();
    let mut req = agent.post(url);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let mut resp = req.send(body).expect("the receiver answers");
    (
        resp.status().as_u16(),
        resp.body_mut().read_to_string().unwrap_or_default(),
    )
}

/// Watches a replica from outside, as a reader would: every read is one consistent
/// snapshot that must verify, and the transaction count never goes backwards.
pub struct Watcher {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Result<(u64, u64), String>>>,
}

impl Watcher {
    /// `monotonic`: also require the transaction count never to go backwards.
    pub fn start(replica: PathBuf, monotonic: bool) -> Watcher {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = std::thread::spawn(move || watch(&replica, &s, monotonic));
        Watcher {
            stop,
            handle: Some(handle),
        }
    }

    /// Stop; returns (snapshots verified, highest transaction seen) or the violation.
    pub fn stop(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::SeqCst);
        self.handle
            .take()
            .unwrap()
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("replica watcher: {e}"))
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn watch(replica: &Path, stop: &AtomicBool, monotonic: bool) -> Result<(u64, u64), String> {
    let mut conn: Option<Connection> = None;
    let mut verified = 0u64;
    let mut highest = 0u64;
    let mut i = 0u64;
    while !stop.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(3));
        if conn.is_none() {
            conn = Connection::open_with_flags(replica, OpenFlags::SQLITE_OPEN_READ_ONLY)
                .ok()
                .filter(has_workload);
        }
        let Some(c) = &conn else { continue };
        i += 1;
        let result = if i.is_multiple_of(10) {
            workload::verify(c).map(|v| v.txns)
        } else {
            Ok(workload::txns(c))
        };
        match result {
            Ok(n) => {
                if i.is_multiple_of(10) {
                    verified += 1;
                }
                if monotonic && n < highest {
                    return Err(format!(
                        "the replica went backwards from {highest} to {n} transactions"
                    ));
                }
                highest = highest.max(n);
            }
            Err(e)
                if matches!(&e, workload::VerifyError::Sqlite(_))
                    && ["no such table", "locked", "busy"]
                        .iter()
                        .any(|m| e.to_string().contains(m)) =>
            {
                conn = None;
            }
            Err(e) => return Err(format!("a reader saw an inconsistent replica: {e}")),
        }
        // A replaced replica file (first base) is only seen by a new connection.
        if i.is_multiple_of(50) {
            conn = None;
        }
    }
    Ok((verified, highest))
}
