//! HTTP/1.1 over plain TCP, for the shipper's requests to an `http://` receiver: each
//! request goes out in one write (head and body together) on a kept-alive
//! connection, and its reply is read in as few reads as it arrived in.
//!
//! Why not the general client ([`ureq`], still used for `https://`): the shipper sends a
//! request per step, several hundred a second under load, on the app's cores. Profiled,
//! ureq wrote a request's head and body with two writes (two trips through the network
//! stack, two wake-ups of the receiver) and spent as long again on its own bookkeeping
//! around them; the requests were over half of the shipper's CPU
//! (docs/notes/2026-12-07-ship-cpu-per-mb.md).
//!
//! What it speaks: `GET` and `POST` with a `Content-Length` body; replies with a
//! `Content-Length` or chunked body of at most `REPLY_BYTES_MAX`, or one that ends when the
//! peer closes. Anything else from the peer is an [`io::Error`] naming what was wrong.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A reply's head (status line and headers) longer than this is refused.
const HEAD_BYTES_MAX: usize = 64 << 10;
/// A reply's body longer than this is refused (the receiver's replies are a few hundred
/// bytes of JSON).
pub const REPLY_BYTES_MAX: usize = 1 << 20;
/// Kept-alive connections kept for reuse (one per worker is all the shipper needs).
const IDLE_MAX: usize = 4;
/// A kept-alive connection idle longer than this is checked before reuse (the peer may
/// have closed it; a request written to a closed connection fails only at its reply).
const IDLE_CHECK_AFTER: Duration = Duration::from_secs(1);

/// A reply: status and body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// The body of a request.
pub enum Body<'a> {
    None,
    Bytes(&'a [u8]),
    /// `len` bytes read from the reader (streamed, never held whole).
    Reader(u64, &'a mut dyn Read),
}

/// A reply's status line and the headers that matter.
struct Head {
    status: u16,
    length: Option<usize>,
    chunked: bool,
    keep_alive: bool,
}

/// A failed exchange: whether any of a reply came back decides whether it may be sent again.
enum Stale {
    /// The request could not be written, or the connection ended before any byte of a
    /// reply.
    Unanswered(io::Error),
    Failed(io::Error),
}

impl Stale {
    fn into_inner(self) -> io::Error {
        match self {
            Stale::Unanswered(e) | Stale::Failed(e) => e,
        }
    }
}

/// Connections to one `host:port`.
pub struct Http1 {
    authority: String,
    connect_timeout: Duration,
    io_timeout: Duration,
    idle_check_after: Duration,
    idle: Mutex<Vec<(Conn, Instant)>>,
}

struct Conn {
    stream: BufReader<TcpStream>,
}

impl Http1 {
    /// `authority` is `host:port` (resolved at each connect, never per request).
    pub fn new(authority: &str, connect_timeout: Duration, io_timeout: Duration) -> Http1 {
        Http1 {
            authority: authority.to_string(),
            connect_timeout,
            io_timeout,
            idle_check_after: IDLE_CHECK_AFTER,
            idle: Mutex::new(Vec::new()),
        }
    }

    /// Send one request and read its reply. `headers` are extra lines (`Name: value`)
    /// beside `Host` and `Content-Length`. A kept-alive connection the peer closed while
    /// it was idle is replaced before anything is written to it.
    pub fn request(
        &self,
        method: &str,
        path_and_query: &str,
        headers: &[(&str, &str)],
        mut body: Body<'_>,
    ) -> io::Result<Response> {
        let resendable = !matches!(body, Body::Reader(..));
        if let Some(mut conn) = self.take_idle() {
            match conn.exchange(&self.authority, method, path_and_query, headers, &mut body) {
                Ok((reply, reusable)) => {
                    if reusable {
                        self.put_idle(conn);
                    }
                    return Ok(reply);
                }
                // The peer closed the kept-alive connection before reading this request
                // (it restarted, or timed the connection out): once more on a new one.
                // Safe because nothing of a reply came back, and sending a request twice
                // is safe in the protocol (docs/ship-protocol.md §1).
                Err(Stale::Unanswered(_)) if resendable => {}
                Err(Stale::Unanswered(e) | Stale::Failed(e)) => return Err(e),
            }
        }
        let mut conn = self.connect()?;
        let (reply, reusable) = conn
            .exchange(&self.authority, method, path_and_query, headers, &mut body)
            .map_err(Stale::into_inner)?;
        if reusable {
            self.put_idle(conn);
        }
        Ok(reply)
    }

    fn connect(&self) -> io::Result<Conn> {
        let mut last = None;
        for addr in self.authority.to_socket_addrs()? {
            match TcpStream::connect_timeout(&addr, self.connect_timeout) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    s.set_read_timeout(Some(self.io_timeout))?;
                    s.set_write_timeout(Some(self.io_timeout))?;
                    return Ok(Conn {
                        stream: BufReader::with_capacity(16 << 10, s),
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} resolves to no address", self.authority),
            )
        }))
    }

    fn take_idle(&self) -> Option<Conn> {
        let mut idle = ferry_core::sync::lock(&self.idle);
        while let Some((conn, since)) = idle.pop() {
            if since.elapsed() < self.idle_check_after || conn.still_open() {
                return Some(conn);
            }
        }
        None
    }

    fn put_idle(&self, conn: Conn) {
        // Bytes past the reply would be read as the next request's reply: a peer that
        // sent them is not trusted with another request.
        if !conn.stream.buffer().is_empty() {
            return;
        }
        let mut idle = ferry_core::sync::lock(&self.idle);
        if idle.len() < IDLE_MAX {
            idle.push((conn, Instant::now()));
        }
    }
}

impl Conn {
    /// Whether the peer has neither closed the connection nor sent anything unasked.
    fn still_open(&self) -> bool {
        let s = self.stream.get_ref();
        if !self.stream.buffer().is_empty() || s.set_nonblocking(true).is_err() {
            return false;
        }
        let mut byte = [0u8; 1];
        let open = matches!(s.peek(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        open && s.set_nonblocking(false).is_ok()
    }

    /// Write the request, read the reply; true beside it if the connection can carry
    /// another request.
    fn exchange(
        &mut self,
        authority: &str,
        method: &str,
        path_and_query: &str,
        headers: &[(&str, &str)],
        body: &mut Body<'_>,
    ) -> Result<(Response, bool), Stale> {
        let len = match body {
            Body::None => None,
            Body::Bytes(b) => Some(b.len() as u64),
            Body::Reader(n, _) => Some(*n),
        };
        let mut head = format!("{method} {path_and_query} HTTP/1.1\r\nHost: {authority}\r\n");
        for (name, value) in headers {
            head.push_str(name);
            head.push_str(": ");
            head.push_str(value);
            head.push_str("\r\n");
        }
        if let Some(n) = len {
            head.push_str(&format!("Content-Length: {n}\r\n"));
        }
        head.push_str("\r\n");
        let s = self.stream.get_mut();
        // One write for head and body: one trip through the network stack and one wake-up
        // of the peer. (A copy, not `writev`: std's `write` sends with MSG_NOSIGNAL, so a
        // peer gone mid-write is an error here, never a SIGPIPE in an app that did not
        // ignore it; and the copy costs less than the second trip did.)
        let sent = match body {
            Body::None => s.write_all(head.as_bytes()),
            Body::Bytes(b) => {
                let mut whole = Vec::with_capacity(head.len() + b.len());
                whole.extend_from_slice(head.as_bytes());
                whole.extend_from_slice(b);
                s.write_all(&whole)
            }
            Body::Reader(n, r) => {
                let n = *n;
                s.write_all(head.as_bytes()).and_then(|()| {
                    let copied = io::copy(&mut r.take(n), s)?;
                    if copied != n {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!("the request body ended after {copied} of {n} bytes"),
                        ));
                    }
                    Ok(())
                })
            }
        };
        if let Err(e) = sent {
            return Err(match e.kind() {
                io::ErrorKind::UnexpectedEof => Stale::Failed(e),
                _ => Stale::Unanswered(e),
            });
        }
        let mut answered = false;
        self.read_reply(&mut answered).map_err(|e| {
            if answered {
                Stale::Failed(e)
            } else {
                Stale::Unanswered(e)
            }
        })
    }

    /// Read a reply; `answered` is set once any byte of it arrived.
    fn read_reply(&mut self, answered: &mut bool) -> io::Result<(Response, bool)> {
        loop {
            let head = self.read_head(answered)?;
            // 1xx: an interim reply; the real one follows.
            if !(100..200).contains(&head.status) {
                return self.read_body(head);
            }
        }
    }

    /// The status line and the headers that matter.
    fn read_head(&mut self, answered: &mut bool) -> io::Result<Head> {
        let mut line = String::new();
        let mut head_bytes = 0;
        let mut read_line = |r: &mut BufReader<TcpStream>, line: &mut String| -> io::Result<()> {
            line.clear();
            let n = r
                .by_ref()
                .take((HEAD_BYTES_MAX - head_bytes) as u64 + 1)
                .read_line(line)?;
            head_bytes += n;
            *answered |= n > 0;
            if !line.ends_with('\n') && head_bytes <= HEAD_BYTES_MAX {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the connection closed before the reply's head ended",
                ));
            }
            if head_bytes > HEAD_BYTES_MAX {
                return Err(bad(format!(
                    "the reply's head is over {HEAD_BYTES_MAX} bytes"
                )));
            }
            Ok(())
        };
        read_line(&mut self.stream, &mut line)?;
        let status = parse_status(&line)?;
        let mut keep_alive = line.starts_with("HTTP/1.1");
        let mut length: Option<usize> = None;
        let mut chunked = false;
        loop {
            read_line(&mut self.stream, &mut line)?;
            let l = line.trim_end_matches(['\r', '\n']);
            if l.is_empty() {
                break;
            }
            let Some((name, value)) = l.split_once(':') else {
                return Err(bad(format!("a header line without a colon: {l:.80}")));
            };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                let n: usize = value
                    .parse()
                    .map_err(|_| bad(format!("Content-Length is not a number: {value:.40}")))?;
                if length.is_some_and(|m| m != n) {
                    return Err(bad("two different Content-Length headers".into()));
                }
                length = Some(n);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value.eq_ignore_ascii_case("chunked");
                if !chunked {
                    return Err(bad(format!(
                        "Transfer-Encoding {value:.40} is not understood"
                    )));
                }
            } else if name.eq_ignore_ascii_case("connection") {
                if value.eq_ignore_ascii_case("close") {
                    keep_alive = false;
                } else if value.eq_ignore_ascii_case("keep-alive") {
                    keep_alive = true;
                }
            }
        }
        Ok(Head {
            status,
            length,
            chunked,
            keep_alive,
        })
    }

    fn read_body(&mut self, head: Head) -> io::Result<(Response, bool)> {
        let Head {
            status,
            length,
            chunked,
            mut keep_alive,
        } = head;
        let body = if status == 204 || status == 304 {
            Vec::new()
        } else if chunked {
            read_chunked(&mut self.stream)?
        } else if let Some(n) = length {
            if n > REPLY_BYTES_MAX {
                return Err(bad(format!(
                    "a reply body of {n} bytes (at most {REPLY_BYTES_MAX})"
                )));
            }
            let mut body = vec![0u8; n];
            self.stream.read_exact(&mut body)?;
            body
        } else {
            // Ends when the peer closes.
            keep_alive = false;
            read_capped(&mut self.stream)?
        };
        Ok((Response { status, body }, keep_alive))
    }
}

fn bad(msg: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("not an HTTP/1.1 reply: {msg}"),
    )
}

/// `HTTP/1.x NNN reason`.
fn parse_status(line: &str) -> io::Result<u16> {
    let l = line.trim_end_matches(['\r', '\n']);
    let mut parts = l.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    let code = parts.next().unwrap_or("");
    if !(version == "HTTP/1.1" || version == "HTTP/1.0") || code.len() != 3 {
        return Err(bad(format!("the status line is {l:.80}")));
    }
    code.parse()
        .map_err(|_| bad(format!("the status line is {l:.80}")))
}

fn read_capped(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    r.take(REPLY_BYTES_MAX as u64 + 1).read_to_end(&mut body)?;
    if body.len() > REPLY_BYTES_MAX {
        return Err(bad(format!("a reply body over {REPLY_BYTES_MAX} bytes")));
    }
    Ok(body)
}

fn read_chunked(r: &mut BufReader<TcpStream>) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    let mut line = String::new();
    let next_line = |r: &mut BufReader<TcpStream>, line: &mut String| -> io::Result<()> {
        line.clear();
        r.by_ref().take(HEAD_BYTES_MAX as u64).read_line(line)?;
        if !line.ends_with('\n') {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the connection closed inside a chunked reply",
            ));
        }
        Ok(())
    };
    loop {
        next_line(r, &mut line)?;
        let size = line.trim_end_matches(['\r', '\n']);
        let size = size.split(';').next().unwrap_or("").trim();
        let n = usize::from_str_radix(size, 16)
            .map_err(|_| bad(format!("a chunk size of {size:.40}")))?;
        if n == 0 {
            // Trailers, up to a blank line.
            loop {
                next_line(r, &mut line)?;
                if line.trim_end_matches(['\r', '\n']).is_empty() {
                    return Ok(body);
                }
            }
        }
        if n > REPLY_BYTES_MAX - body.len() {
            return Err(bad(format!("a reply body over {REPLY_BYTES_MAX} bytes")));
        }
        let at = body.len();
        body.resize(at + n, 0);
        r.read_exact(&mut body[at..])?;
        next_line(r, &mut line)?;
        if !line.trim_end_matches(['\r', '\n']).is_empty() {
            return Err(bad("a chunk longer than its size".into()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A peer that answers each request on a connection with the next of `replies`
    /// (closing after it when the reply says `Connection: close`, or when it is the last
    /// of its connection's list), and keeps every request it read.
    struct Peer {
        addr: String,
        accepted: Arc<AtomicUsize>,
        requests: Arc<Mutex<Vec<Vec<u8>>>>,
    }

    fn peer(connections: Vec<Vec<&'static str>>) -> Peer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (a, r) = (accepted.clone(), requests.clone());
        std::thread::spawn(move || {
            for replies in connections {
                let (s, _) = listener.accept().unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                let mut reader = BufReader::new(s.try_clone().unwrap());
                let mut s = s;
                for reply in replies {
                    let mut req = Vec::new();
                    let mut len = 0usize;
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap() == 0 {
                            return;
                        }
                        req.extend_from_slice(line.as_bytes());
                        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                            len = v.trim().parse().unwrap();
                        }
                        if line == "\r\n" {
                            break;
                        }
                    }
                    let mut body = vec![0u8; len];
                    reader.read_exact(&mut body).unwrap();
                    req.extend_from_slice(&body);
                    ferry_core::sync::lock(&r).push(req);
                    s.write_all(reply.as_bytes()).unwrap();
                }
            }
        });
        Peer {
            addr,
            accepted,
            requests,
        }
    }

    fn client(p: &Peer) -> Http1 {
        Http1::new(&p.addr, Duration::from_secs(2), Duration::from_secs(2))
    }

    const OK: &str = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello";

    #[test]
    fn a_request_goes_out_whole_and_the_connection_is_kept_for_the_next() {
        let p = peer(vec![vec![OK, OK]]);
        let c = client(&p);
        let r = c
            .request(
                "POST",
                "/v1/x?a=1",
                &[("Content-Type", "t/x")],
                Body::Bytes(b"abc"),
            )
            .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"hello"[..]));
        let r = c.request("GET", "/v1/y", &[], Body::None).unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(
            p.accepted.load(Ordering::SeqCst),
            1,
            "one connection for both"
        );
        let reqs = ferry_core::sync::lock(&p.requests).clone();
        let first = String::from_utf8(reqs[0].clone()).unwrap();
        assert_eq!(
            first,
            format!(
                "POST /v1/x?a=1 HTTP/1.1\r\nHost: {}\r\nContent-Type: t/x\r\nContent-Length: 3\r\n\r\nabc",
                p.addr
            )
        );
        assert!(String::from_utf8_lossy(&reqs[1]).starts_with("GET /v1/y HTTP/1.1\r\n"));
    }

    #[test]
    fn a_streamed_body_is_sent_and_a_short_one_is_refused() {
        let p = peer(vec![vec![OK, OK]]);
        let c = client(&p);
        let mut r: &[u8] = b"0123456789";
        let reply = c
            .request("POST", "/b", &[], Body::Reader(10, &mut r))
            .unwrap();
        assert_eq!(reply.status, 200);
        assert!(ferry_core::sync::lock(&p.requests)[0].ends_with(b"\r\n\r\n0123456789"));
        let mut short: &[u8] = b"0123";
        let e = c
            .request("POST", "/b", &[], Body::Reader(10, &mut short))
            .unwrap_err();
        assert!(e.to_string().contains("ended after 4 of 10 bytes"), "{e}");
    }

    #[test]
    fn a_chunked_reply_is_read_whole() {
        let p = peer(vec![vec![
            "HTTP/1.1 409 Conflict\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: t\r\n\r\n",
            OK,
        ]]);
        let c = client(&p);
        let r = c.request("GET", "/", &[], Body::None).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (409, &b"abcde"[..]));
        // The connection is still in step: the next reply reads right.
        let r = c.request("GET", "/", &[], Body::None).unwrap();
        assert_eq!(r.body, b"hello");
    }

    #[test]
    fn connection_close_and_a_peer_that_closed_while_idle_get_a_new_connection() {
        let close = "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n";
        // The second connection's one reply, then the peer closes it while it is idle.
        let p = peer(vec![vec![close], vec![OK], vec![OK]]);
        let mut c = client(&p);
        c.idle_check_after = Duration::ZERO;
        c.request("GET", "/", &[], Body::None).unwrap();
        c.request("GET", "/", &[], Body::None).unwrap();
        assert_eq!(p.accepted.load(Ordering::SeqCst), 2);
        std::thread::sleep(Duration::from_millis(100));
        let r = c.request("GET", "/", &[], Body::None).unwrap();
        assert_eq!(r.body, b"hello");
        assert_eq!(p.accepted.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn what_is_not_a_reply_is_refused_by_name() {
        let cases = [
            (
                "SSH-2.0-OpenSSH\r\n\r\n",
                "the status line is SSH-2.0-OpenSSH",
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: 2000000\r\n\r\n",
                "a reply body of 2000000 bytes",
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
                "Content-Length is not a number",
            ),
            (
                "HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
                "Transfer-Encoding gzip",
            ),
            (
                "HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
                "a header line without a colon",
            ),
            (
                "HTTP/1.1 200 OK\r\nContent-",
                "closed before the reply's head ended",
            ),
        ];
        for (reply, want) in cases {
            let p = peer(vec![vec![reply]]);
            let e = client(&p).request("GET", "/", &[], Body::None).unwrap_err();
            assert!(e.to_string().contains(want), "{reply:?}: {e}");
        }
    }

    #[test]
    fn an_interim_reply_is_skipped() {
        let p = peer(vec![vec![
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
            OK,
        ]]);
        let c = client(&p);
        let r = c.request("POST", "/", &[], Body::Bytes(b"x")).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"hello"[..]));
        assert_eq!(
            c.request("GET", "/", &[], Body::None).unwrap().body,
            b"hello"
        );
        assert_eq!(p.accepted.load(Ordering::SeqCst), 1);
    }

    // A receiver that restarted leaves the kept-alive connection dead: the request goes
    // again on a new one instead of failing the step.
    #[test]
    fn a_request_on_a_connection_the_peer_closed_is_sent_again_on_a_new_one() {
        let p = peer(vec![vec![OK], vec![OK]]);
        let c = client(&p);
        c.request("POST", "/", &[], Body::Bytes(b"one")).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let r = c.request("POST", "/", &[], Body::Bytes(b"two")).unwrap();
        assert_eq!(r.body, b"hello");
        assert_eq!(p.accepted.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_chunk_size_past_the_limit_is_refused() {
        let p = peer(vec![vec![
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n",
        ]]);
        let e = client(&p).request("GET", "/", &[], Body::None).unwrap_err();
        assert!(e.to_string().contains("over 1048576 bytes"), "{e}");
    }

    // A second reply nobody asked for must never be taken for the next request's.
    #[test]
    fn a_connection_with_bytes_past_its_reply_is_not_reused() {
        let p = peer(vec![
            vec![
                "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nbad",
            ],
            vec![OK],
        ]);
        let c = client(&p);
        assert_eq!(
            c.request("GET", "/", &[], Body::None).unwrap().body,
            b"hello"
        );
        assert_eq!(
            c.request("GET", "/", &[], Body::None).unwrap().body,
            b"hello"
        );
        assert_eq!(p.accepted.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_reply_that_ends_with_the_connection_is_read_to_its_end() {
        let p = peer(vec![vec!["HTTP/1.0 503 Busy\r\n\r\nlater"], vec![OK]]);
        let c = client(&p);
        let r = c.request("GET", "/", &[], Body::None).unwrap();
        assert_eq!((r.status, r.body.as_slice()), (503, &b"later"[..]));
        c.request("GET", "/", &[], Body::None).unwrap();
        assert_eq!(p.accepted.load(Ordering::SeqCst), 2, "not reused");
    }
}
