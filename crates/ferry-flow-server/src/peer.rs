//! A worker's end of a connection, frame by frame, with no engine behind it: what the
//! tests speak to a server with (in-process or a `ferry flow serve` process), and a
//! probe for people checking a server by hand. The worker proper is the engine's
//! (docs/flow-server.md §15).

use ferry_flow::remote::io::{FrameReader, write_frame};
use ferry_flow::remote::proto::{
    Append, Body, Frame, Granted, Hello, PROTOCOL, Rec, Refused, Resume, Role, Welcome,
};
use std::path::Path;
use std::time::Duration;
use tokio::net::UnixStream;

pub struct Peer {
    pub stream: UnixStream,
    next: u64,
    frames: FrameReader,
    /// How long [`Peer::recv`] waits before it panics: a test's bound.
    pub patience: Duration,
    /// Each shard's durable position, from every `Durable` received.
    pub durable: std::collections::BTreeMap<u32, u64>,
}

/// A worker's hello.
pub fn hello(session: u128, token: &str, resume: Vec<Resume>) -> Hello {
    Hello {
        version: PROTOCOL,
        role: Role::Worker,
        session,
        max_shards: 0,
        token: token.into(),
        resume,
        name: "peer".into(),
    }
}

/// An append body.
pub fn append(shard: u32, epoch: u64, first: u64, records: Vec<Rec>) -> Body {
    Body::Append(Append {
        shard,
        epoch,
        first,
        records,
    })
}

impl Peer {
    pub async fn connect(socket: &Path) -> std::io::Result<Peer> {
        Ok(Peer {
            stream: UnixStream::connect(socket).await?,
            next: 1,
            frames: FrameReader::default(),
            patience: Duration::from_secs(10),
            durable: Default::default(),
        })
    }

    /// Connect and say hello; the Welcome.
    pub async fn hello(socket: &Path, hello: Hello) -> std::io::Result<(Peer, Welcome)> {
        let mut p = Peer::connect(socket).await?;
        p.send(Body::Hello(hello)).await?;
        match p
            .until(|b| matches!(b, Body::Welcome(_) | Body::Refused { .. }))
            .await
        {
            Body::Welcome(w) => Ok((p, w)),
            other => Err(std::io::Error::other(format!("no welcome: {other:?}"))),
        }
    }

    /// Send a frame under the next request id; the id.
    pub async fn send(&mut self, body: Body) -> std::io::Result<u64> {
        self.next += 1;
        write_frame(
            &mut self.stream,
            &Frame {
                id: self.next,
                body,
            },
        )
        .await?;
        Ok(self.next)
    }

    /// The next frame; None once the server closed the connection (or it broke).
    pub async fn recv(&mut self) -> Option<Frame> {
        let read = self.frames.next(&mut self.stream);
        let frame = tokio::time::timeout(self.patience, read)
            .await
            .expect("the server answers in time")
            .ok()
            .flatten()?;
        if let Body::Durable(ps) = &frame.body {
            for p in ps {
                let d = self.durable.entry(p.shard).or_default();
                *d = (*d).max(p.position);
            }
        }
        Some(frame)
    }

    /// Frames until one matches, skipping the others.
    pub async fn until(&mut self, mut want: impl FnMut(&Body) -> bool) -> Body {
        loop {
            let f = self.recv().await.expect("the connection stays open");
            if want(&f.body) {
                return f.body;
            }
        }
    }

    /// Grants until `n` shards were granted.
    pub async fn grants(&mut self, n: usize) -> Vec<Granted> {
        let mut got = Vec::new();
        while got.len() < n {
            if let Body::Grant(g) = self.until(|b| matches!(b, Body::Grant(_))).await {
                got.extend(g);
            }
        }
        got
    }

    /// Ping every `every` (confirming nothing: a standby's pings) until `n` shards were
    /// granted.
    pub async fn ping_until_grants(&mut self, n: usize, every: Duration) -> Vec<Granted> {
        let mut got = Vec::new();
        let give_up = tokio::time::Instant::now() + self.patience;
        while got.len() < n {
            assert!(
                tokio::time::Instant::now() < give_up,
                "no grant in time (got {got:?})"
            );
            self.send(Body::Ping(Vec::new()))
                .await
                .expect("the connection stays open");
            let wait = tokio::time::Instant::now() + every;
            while let Ok(Some(f)) = tokio::time::timeout_at(wait, self.recv()).await {
                if let Body::Grant(g) = f.body {
                    got.extend(g);
                }
            }
        }
        got
    }

    /// Ping for `shard` at `epoch` and wait for the `Pong`: the grant is confirmed, as
    /// a real worker's is before it acts (a grant never confirmed does not outlive its
    /// connection, docs/flow-server.md §5.1).
    pub async fn confirm(&mut self, shard: u32, epoch: u64) {
        let turns = vec![ferry_flow::remote::proto::Turns {
            shard,
            epoch,
            turns: 0,
        }];
        self.send(Body::Ping(turns))
            .await
            .expect("the connection stays open");
        self.until(|b| matches!(b, Body::Pong(_))).await;
    }

    /// Frames until `shard` is durable up to `position` (at once if it already is).
    pub async fn durable_to(&mut self, shard: u32, position: u64) {
        while self.durable.get(&shard).copied().unwrap_or(0) < position {
            self.recv().await.expect("the connection stays open");
        }
    }

    pub async fn refusal(&mut self) -> Refused {
        match self.until(|b| matches!(b, Body::Refused { .. })).await {
            Body::Refused { refused, .. } => refused,
            _ => unreachable!(),
        }
    }

    /// Every durable record of `shard` from the start, in pages of `page` bytes.
    pub async fn read_all(&mut self, shard: u32, epoch: u64, page: u32) -> Vec<Rec> {
        let mut out = Vec::new();
        loop {
            self.send(Body::Recover {
                shard,
                epoch,
                from: out.len() as u64,
                max_bytes: page,
            })
            .await
            .expect("the connection stays open");
            let Body::Records(r) = self
                .until(|b| matches!(b, Body::Records(_) | Body::Refused { .. }))
                .await
            else {
                panic!("recovering shard {shard} at epoch {epoch} was refused");
            };
            assert_eq!(r.first, out.len() as u64);
            out.extend(r.records);
            if r.last {
                return out;
            }
        }
    }
}
