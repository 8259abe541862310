//! A flow server in the test's process, on a Unix socket and on TCP (for the fault
//! proxy).

#![allow(dead_code)]

use ferry_flow::log::Config as LogConfig;
use ferry_flow_server::server::{Server, Settings};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UnixListener;

pub const LEASE: Duration = Duration::from_millis(900);

pub fn settings(shards: u32) -> Settings {
    Settings {
        shards,
        lease: LEASE,
        ping_every: Duration::from_millis(100),
        stuck_after: Duration::from_secs(30),
        ..Settings::default()
    }
}

/// [`settings`] with a lease long enough for a busy machine to stop and start the
/// server, or reconnect, within it (tests of a resume).
pub fn long_lease(shards: u32) -> Settings {
    Settings {
        lease: Duration::from_secs(4),
        ..settings(shards)
    }
}

pub struct Running {
    pub server: Arc<Server>,
    accept: Vec<tokio::task::JoinHandle<()>>,
    /// The same server on TCP, for the fault proxy.
    pub tcp: std::net::SocketAddr,
}

impl Running {
    pub async fn stop(self) {
        for a in self.accept {
            a.abort();
            let _ = a.await;
        }
        Arc::into_inner(self.server).unwrap().shutdown().await;
    }
}

/// A server on `dir/server` with `shards` shards and the lease above.
pub fn start(dir: &Path, socket: &Path, shards: u32) -> Running {
    start_with(dir, socket, settings(shards))
}

pub fn start_with(dir: &Path, socket: &Path, settings: Settings) -> Running {
    start_with_log(dir, socket, settings, LogConfig::default())
}

/// [`start_with`] and the log's configuration.
pub fn start_with_log(dir: &Path, socket: &Path, settings: Settings, log: LogConfig) -> Running {
    serve(
        Server::open(&dir.join("server"), settings, log).unwrap(),
        socket,
    )
}

/// Serve `server` on `socket` and on TCP.
pub fn serve(server: Server, socket: &Path) -> Running {
    let _ = std::fs::remove_file(socket);
    let server = Arc::new(server);
    let listener = UnixListener::bind(socket).unwrap();
    server.start();
    let c = server.connector();
    let unix = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(c.connection(stream));
        }
    });
    let tcp_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    tcp_listener.set_nonblocking(true).unwrap();
    let tcp = tcp_listener.local_addr().unwrap();
    let tcp_listener = tokio::net::TcpListener::from_std(tcp_listener).unwrap();
    let c = server.connector();
    let tcp_accept = tokio::spawn(async move {
        while let Ok((stream, _)) = tcp_listener.accept().await {
            tokio::spawn(c.connection(stream));
        }
    });
    Running {
        server,
        accept: vec![unix, tcp_accept],
        tcp,
    }
}

/// A worker engine of the server at `socket`, its builder finished by `build` (its
/// workflows, `max_shards`), opened off the test's runtime (it waits for the server's
/// welcome).
pub async fn open_worker(
    dir: &Path,
    socket: &Path,
    build: impl FnOnce(ferry_flow::EngineBuilder) -> ferry_flow::EngineBuilder + Send + 'static,
) -> ferry_flow::Engine {
    let dir = dir.to_path_buf();
    let addr = format!("unix:{}", socket.display());
    tokio::task::spawn_blocking(move || {
        build(ferry_flow::Engine::builder(dir).server(addr))
            .open()
            .unwrap()
    })
    .await
    .unwrap()
}

/// Drop an engine off the test's runtime (closing hands its shards back and waits).
pub async fn close(e: ferry_flow::Engine) {
    tokio::task::spawn_blocking(move || drop(e)).await.unwrap();
}

/// The keys counted more than once in `ran` (each step body's runs, by key).
pub fn more_than_once(
    ran: &std::sync::Mutex<std::collections::BTreeMap<String, u32>>,
) -> Vec<(String, u32)> {
    ran.lock()
        .unwrap()
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, n)| (k.clone(), *n))
        .collect()
}
