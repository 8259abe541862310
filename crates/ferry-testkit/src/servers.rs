//! Private Postgres and NATS servers for tests that stop, restart or starve them: each on
//! a free port in a scratch directory, stopped when dropped. Tests that only need a
//! database or a stream use the machine's shared servers instead (`scripts/test` makes
//! sure they run).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Where the Postgres server binaries are: `FERRY_PG_BIN`, else the newest
/// `/usr/lib/postgresql/*/bin`, else `PATH`.
pub fn pg_bin(name: &str) -> PathBuf {
    if let Ok(dir) = std::env::var("FERRY_PG_BIN") {
        return Path::new(&dir).join(name);
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join(name).exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .map_or_else(|| PathBuf::from(name), |d| d.join(name))
}

fn as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A Postgres server command, run as `postgres` when the test runs as root.
fn pg_command(name: &str) -> Command {
    let bin = pg_bin(name);
    if as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

/// A Postgres cluster of the test's own.
pub struct PrivatePg {
    pub data: PathBuf,
    pub port: u16,
    log: PathBuf,
}

impl PrivatePg {
    /// initdb (trust, user `postgres`) and start on a free port.
    pub fn start(dir: &Path) -> PrivatePg {
        let home = dir.join("pg");
        std::fs::create_dir_all(&home).expect("creating the Postgres directory");
        // Postgres refuses to run as root; a root test hands the directory to `postgres`.
        if as_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres", home.to_str().unwrap()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "chown of {} to postgres failed", home.display());
        }
        let data = home.join("data");
        let log = home.join("postgres.log");
        let out = pg_command("initdb")
            .args([
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
            ])
            .stdout(Stdio::null())
            .output()
            .expect("running initdb (Postgres server binaries: apt install postgresql)");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let pg = PrivatePg {
            data,
            port: crate::free_port(),
            log,
        };
        pg.up();
        pg
    }

    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Start (again) on the same port and data.
    pub fn up(&self) {
        let opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories='{}' -c fsync=off -c max_connections=100",
            self.port,
            self.data.display()
        );
        let out = pg_command("pg_ctl")
            .args([
                "-D",
                self.data.to_str().unwrap(),
                "-l",
                self.log.to_str().unwrap(),
                "-o",
                &opts,
                "-w",
                "-t",
                "60",
                "start",
            ])
            .stdout(Stdio::null())
            .output()
            .expect("running pg_ctl");
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Stop: `fast` disconnects clients and shuts down cleanly; `immediate` is a crash.
    pub fn down(&self, mode: &str) {
        let _ = pg_command("pg_ctl")
            .args([
                "-D",
                self.data.to_str().unwrap(),
                "-m",
                mode,
                "-w",
                "-t",
                "60",
                "stop",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        self.down("immediate");
    }
}

/// `nats-server` (or `FERRY_NATS_SERVER`) with `args`, once it listens on `port`.
fn spawn_nats(args: &[&str], port: u16, log: &Path) -> crate::proc::Proc {
    let bin = std::env::var("FERRY_NATS_SERVER").unwrap_or_else(|_| "nats-server".into());
    let p = crate::proc::Proc::spawn("nats-server", Path::new(&bin), args, &[], log);
    assert!(
        crate::wait_until(Duration::from_secs(20), || std::net::TcpStream::connect((
            "127.0.0.1",
            port
        ))
        .is_ok()),
        "nats-server did not start; see {}",
        log.display()
    );
    p
}

/// A NATS server with JetStream of the test's own.
pub struct PrivateNats {
    pub port: u16,
    store: PathBuf,
    log: PathBuf,
    proc: Option<crate::proc::Proc>,
}

impl PrivateNats {
    pub fn start(dir: &Path) -> PrivateNats {
        let mut n = PrivateNats {
            port: crate::free_port(),
            store: dir.join("nats-store"),
            log: dir.join("nats.log"),
            proc: None,
        };
        n.up();
        n
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Start (again) on the same port and store.
    pub fn up(&mut self) {
        assert!(self.proc.is_none(), "nats-server already running");
        let port = self.port.to_string();
        let store = self.store.to_str().unwrap();
        self.proc = Some(spawn_nats(
            &["-js", "-a", "127.0.0.1", "-p", &port, "-sd", store],
            self.port,
            &self.log,
        ));
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        if let Some(p) = self.proc.take() {
            p.kill9();
        }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Three NATS servers with JetStream in one cluster, of the test's own: a stream with
/// three replicas keeps working with any one of them down.
pub struct NatsCluster {
    pub ports: Vec<u16>,
    routes: Vec<u16>,
    dir: PathBuf,
    procs: Vec<Option<crate::proc::Proc>>,
}

impl NatsCluster {
    pub fn start(dir: &Path) -> NatsCluster {
        let n = 3;
        let mut c = NatsCluster {
            ports: (0..n).map(|_| crate::free_port()).collect(),
            routes: (0..n).map(|_| crate::free_port()).collect(),
            dir: dir.to_path_buf(),
            procs: (0..n).map(|_| None).collect(),
        };
        for i in 0..n {
            c.up(i);
        }
        c
    }

    /// Every server's address, comma-separated, as clients take them.
    pub fn url(&self) -> String {
        self.ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Start server `i` (again) on its ports and store.
    pub fn up(&mut self, i: usize) {
        assert!(self.procs[i].is_none(), "nats-server {i} already running");
        let port = self.ports[i].to_string();
        let cluster = format!("nats://127.0.0.1:{}", self.routes[i]);
        let routes = self
            .routes
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, p)| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let store = self.dir.join(format!("nats-{i}"));
        let name = format!("n{i}");
        self.procs[i] = Some(spawn_nats(
            &[
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &port,
                "-sd",
                store.to_str().unwrap(),
                "-n",
                &name,
                "--cluster_name",
                "ferry",
                "--cluster",
                &cluster,
                "--routes",
                &routes,
            ],
            self.ports[i],
            &self.dir.join(format!("nats-{i}.log")),
        ));
    }

    /// SIGKILL server `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(p) = self.procs[i].take() {
            p.kill9();
        }
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.procs.len() {
            self.kill(i);
        }
    }
}
