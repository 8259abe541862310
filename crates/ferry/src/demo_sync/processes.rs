//! The demo's child processes (serves and replicas) and the waits on them.

use super::*;

/// One of the demo's child processes.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(super) enum Kid {
    Serve(usize),
    Replica(usize),
}

/// The demo's child processes, SIGKILLed when dropped: no path leaves one running.
#[derive(Default)]
pub(super) struct Kids {
    pub(super) running: BTreeMap<Kid, Child>,
}

impl Kids {
    pub(super) fn spawn(
        &mut self,
        kid: Kid,
        args: &[&std::ffi::OsStr],
        log: &Path,
    ) -> anyhow::Result<()> {
        let child = crate::demo::spawn_ferry(&format!("{kid:?}"), args, log)?;
        self.running.insert(kid, child);
        Ok(())
    }

    pub(super) fn serve(
        &mut self,
        i: usize,
        dir: &Path,
        rules: &Path,
        url: &str,
        port: u16,
    ) -> anyhow::Result<()> {
        let listen = format!("127.0.0.1:{port}");
        let args: Vec<&std::ffi::OsStr> = vec![
            "sync".as_ref(),
            "serve".as_ref(),
            "--rules".as_ref(),
            rules.as_os_str(),
            "--db".as_ref(),
            url.as_ref(),
            "--listen".as_ref(),
            listen.as_ref(),
            "--standby-ms".as_ref(),
            "1000".as_ref(),
            "--idle-ms".as_ref(),
            "50".as_ref(),
        ];
        self.spawn(
            Kid::Serve(i),
            &args,
            &dir.join(format!("serve-{}.log", i + 1)),
        )
    }

    pub(super) fn replica(
        &mut self,
        i: usize,
        s: &Store,
        server: &str,
        dir: &Path,
    ) -> anyhow::Result<()> {
        let id = s.id.to_string();
        let args: Vec<&std::ffi::OsStr> = vec![
            "sync".as_ref(),
            "replica".as_ref(),
            "--server".as_ref(),
            server.as_ref(),
            "--db".as_ref(),
            s.db.as_os_str(),
            "--id".as_ref(),
            id.as_ref(),
            "--token-file".as_ref(),
            s.token_file.as_os_str(),
        ];
        self.spawn(
            Kid::Replica(i),
            &args,
            &dir.join(format!("replica-{}.log", s.label)),
        )
    }

    /// SIGKILL, and reap.
    pub(super) fn kill(&mut self, kid: Kid) {
        if let Some(mut c) = self.running.remove(&kid) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A child that exited on its own is a failure of the demo.
    pub(super) fn check(&mut self) -> anyhow::Result<()> {
        for (kid, c) in &mut self.running {
            if let Some(st) = c.try_wait()? {
                bail!("{kid:?} exited with {st}; see its log");
            }
        }
        Ok(())
    }
}

impl Drop for Kids {
    fn drop(&mut self) {
        let kids: Vec<Kid> = self.running.keys().copied().collect();
        for k in kids {
            self.kill(k);
        }
    }
}

pub(super) async fn wait_healthy(port: u16, dir: &Path) -> anyhow::Result<()> {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(15) {
        if get(port, "/healthz").await.is_some() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!(
        "a `ferry sync serve` did not answer on port {port} within 15 s; see {}",
        dir.display()
    )
}

pub(super) async fn get(port: u16, path: &'static str) -> Option<String> {
    tokio::task::spawn_blocking(move || {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(2)))
            .http_status_as_error(true)
            .build()
            .new_agent();
        agent
            .get(&format!("http://127.0.0.1:{port}{path}"))
            .call()
            .ok()?
            .body_mut()
            .read_to_string()
            .ok()
    })
    .await
    .ok()
    .flatten()
}

/// Whether the serve on `port` holds the relay lock, from its /metrics.
pub(super) async fn holding(port: u16) -> Option<bool> {
    let text = get(port, "/metrics").await?;
    // `ferry_sync_relay_holding{shard="0"} 1`
    text.lines()
        .find(|l| l.starts_with("ferry_sync_relay_holding"))
        .and_then(|l| l.rsplit(' ').next())
        .map(|v| v.trim() == "1")
}

/// Which serve holds the relay lock, once exactly one does.
pub(super) async fn wait_holder(ports: &[u16; 2], limit: Duration) -> anyhow::Result<usize> {
    let start = Instant::now();
    loop {
        let a = holding(ports[0]).await;
        let b = holding(ports[1]).await;
        match (a, b) {
            (Some(true), Some(false)) => return Ok(0),
            (Some(false), Some(true)) => return Ok(1),
            (Some(true), Some(true)) => bail!("both serves say they hold the relay lock"),
            _ => {}
        }
        ensure!(
            start.elapsed() < limit,
            "no serve took the relay lock within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Until every store stands synced (`ferry_sync::status::read`) and no note waits.
pub(super) async fn wait_synced(
    pool: &PgPool,
    kids: &mut Kids,
    limit: Duration,
) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        kids.check()?;
        let st = ferry_sync::status::read(pool, None).await?;
        ensure!(
            st.notes_parked == 0,
            "{} notes were parked",
            st.notes_parked
        );
        if st.notes_pending == 0 && st.replicas.iter().all(|r| r.standing == "synced") {
            return Ok(());
        }
        if start.elapsed() > limit {
            let standings: Vec<String> = st
                .replicas
                .iter()
                .map(|r| {
                    format!(
                        "{} {} ({}/{})",
                        r.id, r.standing, r.confirmed_seq, r.last_seq
                    )
                })
                .collect();
            bail!(
                "the stores were not all synced within {limit:?}: {} notes pending; {}",
                st.notes_pending,
                standings.join(", ")
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(super) async fn wait_until(
    limit: Duration,
    what: &str,
    mut f: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        if f()? {
            return Ok(());
        }
        ensure!(start.elapsed() < limit, "waited {limit:?} for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
