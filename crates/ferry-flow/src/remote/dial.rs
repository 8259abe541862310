//! Dialling the flow server (docs/flow-server.md §1): `unix:/path` or `HOST:PORT`, or
//! several of them, comma-separated, for a server and its standbys
//! (docs/flow-server-replica.md).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// A connection to the server, whatever carries it.
pub trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

/// Connect to one of `servers` (comma-separated: a server and its standbys,
/// docs/flow-server-replica.md): the one at `preferred` first (the last to answer),
/// then the others in turn, each given 2 s when there are several (a standby does not
/// listen, and a lost machine should not hold up the next), `alone` when it is one.
pub(super) async fn dial(
    servers: &str,
    preferred: &AtomicUsize,
    alone: Duration,
) -> std::io::Result<Box<dyn Stream>> {
    let all: Vec<&str> = servers
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let within = if all.len() > 1 {
        Duration::from_secs(2)
    } else {
        alone
    };
    if all.len() == 1 {
        return dial_one(all[0], within).await;
    }
    let first = preferred.load(Ordering::Relaxed);
    let mut failed = Vec::new();
    for k in 0..all.len() {
        let i = (first + k) % all.len();
        match dial_one(all[i], within).await {
            Ok(s) => {
                preferred.store(i, Ordering::Relaxed);
                return Ok(s);
            }
            Err(e) => failed.push(format!("{}: {e}", all[i])),
        }
    }
    Err(std::io::Error::other(if failed.is_empty() {
        "no server address".to_string()
    } else {
        failed.join("; ")
    }))
}

async fn dial_one(server: &str, within: Duration) -> std::io::Result<Box<dyn Stream>> {
    let dialed = tokio::time::timeout(within, async {
        Ok::<Box<dyn Stream>, std::io::Error>(match server.strip_prefix("unix:") {
            Some(path) => Box::new(tokio::net::UnixStream::connect(path).await?),
            None => {
                let s = tokio::net::TcpStream::connect(server).await?;
                s.set_nodelay(true)?;
                Box::new(s)
            }
        })
    })
    .await;
    dialed.unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
}
