//! A TCP proxy the demo cuts and restores, between the replicas and the serves.

use super::*;

/// The network between the stores and the serves: a TCP proxy that tries its targets in
/// order, and can be cut (every connection dropped, new ones refused) and restored.
pub(super) struct Proxy {
    pub(super) port: u16,
    pub(super) shared: Arc<ProxyShared>,
}

pub(super) struct ProxyShared {
    pub(super) targets: Vec<SocketAddr>,
    pub(super) up: AtomicBool,
    pub(super) stop: AtomicBool,
    /// Both ends of every connection, to cut them.
    pub(super) conns: Mutex<Vec<TcpStream>>,
}

impl Proxy {
    pub(super) fn start(targets: Vec<SocketAddr>) -> anyhow::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(ProxyShared {
            targets,
            up: AtomicBool::new(true),
            stop: AtomicBool::new(false),
            conns: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = conn else { continue };
                if !s.up.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let server = s
                    .targets
                    .iter()
                    .find_map(|t| TcpStream::connect_timeout(t, Duration::from_millis(500)).ok());
                let Some(server) = server else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let ends = (
                    client.try_clone(),
                    server.try_clone(),
                    client.try_clone(),
                    server.try_clone(),
                );
                let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) = ends else {
                    continue;
                };
                {
                    let mut conns = ferry_core::sync::lock(&s.conns);
                    conns.retain(|c| c.peer_addr().is_ok());
                    conns.push(c3);
                    conns.push(s3);
                }
                std::thread::spawn(move || pipe(client, server));
                std::thread::spawn(move || pipe(s2, c2));
            }
        });
        Ok(Proxy { port, shared })
    }

    pub(super) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub(super) fn cut(&self) {
        self.shared.up.store(false, Ordering::SeqCst);
        for c in ferry_core::sync::lock(&self.shared.conns).drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    pub(super) fn restore(&self) {
        self.shared.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.cut();
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

pub(super) fn pipe(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

pub(super) fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
