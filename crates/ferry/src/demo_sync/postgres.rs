//! The demo's Postgres: the one scripts/test uses, or a private one it starts.

use super::*;

pub(super) struct Postgres {
    /// postgres://USER@HOST:PORT, without a database.
    pub(super) base: String,
    pub(super) origin: &'static str,
    pub(super) private: Option<PrivatePg>,
}

impl Postgres {
    pub(super) fn find_or_start(dir: &Path) -> anyhow::Result<Postgres> {
        let configured = std::env::var("FERRY_TEST_PG")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".into());
        let base = base_of(&configured);
        let answers = host_port(&base)
            .and_then(|hp| {
                use std::net::ToSocketAddrs;
                hp.to_socket_addrs().ok()?.next()
            })
            .is_some_and(|a| TcpStream::connect_timeout(&a, Duration::from_secs(1)).is_ok());
        if answers {
            return Ok(Postgres {
                base,
                origin: "the one scripts/test uses",
                private: None,
            });
        }
        let pg = PrivatePg::start(&dir.join("pg"))
            .with_context(|| format!("no Postgres answers at {base} and starting one failed"))?;
        Ok(Postgres {
            base: format!("postgres://postgres@127.0.0.1:{}", pg.port),
            origin: "none answered at FERRY_TEST_PG, so the demo started one",
            private: Some(pg),
        })
    }

    pub(super) fn url(&self, db: &str) -> String {
        format!("{}/{db}", self.base)
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if let Some(pg) = self.private.take() {
            pg.stop();
        }
    }
}

/// `postgres://u@h:p/db?x` → `postgres://u@h:p`.
pub(super) fn base_of(url: &str) -> String {
    let url = url.split('?').next().unwrap_or(url);
    match url.find("://") {
        Some(s) => match url[s + 3..].find('/') {
            Some(slash) => url[..s + 3 + slash].to_string(),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

pub(super) fn host_port(base: &str) -> Option<String> {
    let rest = base.split("://").nth(1)?;
    let hp = rest.rsplit('@').next()?;
    Some(if hp.contains(':') {
        hp.to_string()
    } else {
        format!("{hp}:5432")
    })
}

/// A Postgres cluster of the demo's own: initdb (trust) and start on a free port.
pub(super) struct PrivatePg {
    pub(super) data: PathBuf,
    pub(super) port: u16,
}

pub(super) fn as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

pub(super) fn pg_bin(name: &str) -> PathBuf {
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

/// A Postgres server command, run as `postgres` when the demo runs as root.
pub(super) fn pg_command(name: &str) -> Command {
    let bin = pg_bin(name);
    let mut c = if as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    };
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

impl PrivatePg {
    pub(super) fn start(home: &Path) -> anyhow::Result<PrivatePg> {
        std::fs::create_dir_all(home)?;
        if as_root() {
            let ok = Command::new("chown")
                .arg("-R")
                .arg("postgres:postgres")
                .arg(home)
                .status()
                .is_ok_and(|s| s.success());
            ensure!(ok, "chown of {} to postgres failed", home.display());
        }
        let data = home.join("data");
        let out = pg_command("initdb")
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "--no-sync"])
            .output()
            .context("running initdb (Postgres server binaries: apt install postgresql)")?;
        ensure!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = free_port()?;
        let opts = format!(
            "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='{}' -c fsync=off",
            data.display()
        );
        let out = pg_command("pg_ctl")
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(home.join("postgres.log"))
            .args(["-o", &opts, "-w", "-t", "60", "start"])
            .output()
            .context("running pg_ctl")?;
        ensure!(
            out.status.success(),
            "pg_ctl start failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(PrivatePg { data, port })
    }

    pub(super) fn stop(self) {
        let _ = pg_command("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "-w", "-t", "60", "stop"])
            .output();
    }
}
