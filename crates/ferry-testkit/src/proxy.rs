//! A TCP proxy between a client and a server that counts bytes and injects faults:
//! delay every chunk, refuse connections, cut a connection after N more bytes sent
//! upstream (a body cut mid-way), or hold one direction or both (a network that stops
//! carrying packets while the connections stay open: what was sent arrives once the
//! hold is lifted, as TCP's retransmissions would deliver it).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Faults and counters, changeable while the proxy runs.
#[derive(Default)]
pub struct Faults {
    /// Sleep this long before forwarding each chunk, in both directions.
    pub delay_ms: AtomicU64,
    /// Close new connections at once.
    pub refuse: AtomicBool,
    /// If non-zero: after this many more bytes upstream (on whichever connection carries
    /// them) that connection is cut mid-stream, and this goes back to 0.
    pub cut_after: AtomicU64,
    /// Hold what the client sends (one-way: the server hears nothing).
    pub hold_up: AtomicBool,
    /// Hold what the server sends (one-way: the client hears nothing).
    pub hold_down: AtomicBool,
    pub bytes_up: AtomicU64,
    pub bytes_down: AtomicU64,
    pub connections: AtomicU64,
    pub cuts: AtomicU64,
}

impl Faults {
    /// Hold both directions (`true`) or lift every hold (`false`).
    pub fn blackhole(&self, on: bool) {
        self.hold_up.store(on, Ordering::SeqCst);
        self.hold_down.store(on, Ordering::SeqCst);
    }
}

/// A running proxy on 127.0.0.1.
pub struct FaultProxy {
    port: u16,
    faults: Arc<Faults>,
    stop: Arc<AtomicBool>,
}

impl FaultProxy {
    /// Listen on a free port and forward to `target`.
    pub fn start(target: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("binding the proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let faults = Arc::new(Faults::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (f, s) = (faults.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = conn else { continue };
                f.connections.fetch_add(1, Ordering::Relaxed);
                if f.refuse.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(target) else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (c2, s2) = (
                    client.try_clone().expect("clone"),
                    server.try_clone().expect("clone"),
                );
                let (fu, fd) = (f.clone(), f.clone());
                std::thread::spawn(move || pipe(client, server, &fu, true));
                std::thread::spawn(move || pipe(s2, c2, &fd, false));
            }
        });
        FaultProxy { port, faults, stop }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// The faults, to change from another task or thread.
    pub fn faults_handle(&self) -> Arc<Faults> {
        self.faults.clone()
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, f: &Faults, up: bool) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let delay = f.delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            std::thread::sleep(Duration::from_millis(delay));
        }
        let hold = if up { &f.hold_up } else { &f.hold_down };
        while hold.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut n = n;
        let mut cutting = false;
        if up {
            let budget = f.cut_after.load(Ordering::SeqCst);
            if budget > 0 {
                if n as u64 >= budget {
                    n = budget as usize;
                    cutting = f
                        .cut_after
                        .compare_exchange(budget, 0, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok();
                } else {
                    let _ = f.cut_after.compare_exchange(
                        budget,
                        budget - n as u64,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    );
                }
            }
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
        let counter = if up { &f.bytes_up } else { &f.bytes_down };
        counter.fetch_add(n as u64, Ordering::Relaxed);
        if cutting {
            f.cuts.fetch_add(1, Ordering::Relaxed);
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
