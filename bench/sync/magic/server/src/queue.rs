//! The loopback transport: magic_sync's `Transport`, as a store-and-forward queue per
//! replica in this process, fetched by the replica host over HTTP.
//!
//! 1. `send(audience, replica, bytes, id)` appends `(index, bytes)` to the replica's
//!    queue — index counting from 1 per replica — wakes any fetch waiting on it, and
//!    answers Ok: the transport took the message.
//! 2. A fetch after K drops every message at or below K (the host applied them: K is its
//!    acknowledgement), waits until one past K exists or the wait is over, and answers
//!    up to [`FETCH_MESSAGES_MAX`] of them, in order.
//! 3. A message is answered again by every fetch until one acknowledges it: at least
//!    once, in order, as magic_sync's PROTOCOL.md §2 asks of a transport.
//!
//! Nothing is persisted: a restart of the server process loses what was queued. That
//! breaks §2's "nothing it took is lost" only across a restart, which no benchmark run
//! does; the fault injector [`Queues::arm_loss`] breaks it on purpose, once.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use magic_sync::Error;
use magic_sync::run::server::Transport;
use tokio::sync::watch;
use uuid::Uuid;

/// Messages one fetch answers at most. At magic_sync's default 512 KiB a message, an
/// answer is at most 32 MiB; the host applies them one after another, acknowledging the
/// last it applied with its next fetch.
pub const FETCH_MESSAGES_MAX: usize = 64;

/// Every replica's queue, and what the transport counts.
#[derive(Default)]
pub struct Queues {
    /// Per replica, created on its first message or fetch. A queue is never bounded:
    /// a store-and-forward transport that took a message keeps it until acknowledged,
    /// so a host that stops fetching grows this for as long as the run lasts.
    replicas: Mutex<HashMap<Uuid, Arc<Queue>>>,
    /// Whether the next message `send` takes is to be lost.
    lose_next: AtomicBool,
    lost: AtomicU64,
    lost_bytes: AtomicU64,
    /// Taken by `send`, lost ones included.
    taken: AtomicU64,
    taken_bytes: AtomicU64,
    /// Answered by fetches, each time it is answered.
    served: AtomicU64,
    served_bytes: AtomicU64,
    /// Posted up.
    up: AtomicU64,
    up_bytes: AtomicU64,
}

/// One replica's messages not yet acknowledged, oldest first.
struct Queue {
    pending: Mutex<VecDeque<(u64, Vec<u8>)>>,
    /// The index of the last message appended: what a waiting fetch watches. Written
    /// only under `pending`'s lock, so an index is never handed out twice.
    last: watch::Sender<u64>,
}

impl Queues {
    fn queue(&self, replica: Uuid) -> Arc<Queue> {
        let mut replicas = self
            .replicas
            .lock()
            .expect("no thread panics holding the map");
        replicas
            .entry(replica)
            .or_insert_with(|| {
                Arc::new(Queue {
                    pending: Mutex::new(VecDeque::new()),
                    last: watch::Sender::new(0),
                })
            })
            .clone()
    }

    fn take(&self, replica: Uuid, message: Vec<u8>) {
        let len = message.len() as u64;
        self.taken.fetch_add(1, Ordering::Relaxed);
        self.taken_bytes.fetch_add(len, Ordering::Relaxed);
        if self.lose_next.swap(false, Ordering::SeqCst) {
            self.lost.fetch_add(1, Ordering::SeqCst);
            self.lost_bytes.fetch_add(len, Ordering::SeqCst);
            tracing::warn!(%replica, bytes = len, "loopback: a message taken and lost, as armed");
            return;
        }
        let queue = self.queue(replica);
        let mut pending = queue
            .pending
            .lock()
            .expect("no thread panics holding a queue");
        let index = *queue.last.borrow() + 1;
        pending.push_back((index, message));
        queue.last.send_replace(index);
    }

    /// The answer to a fetch after `after`, waiting up to `wait` for a message past it:
    /// `[u64 BE index][u32 BE length][bytes]` per message, up to [`FETCH_MESSAGES_MAX`].
    pub async fn fetch(&self, replica: Uuid, after: u64, wait: Duration) -> Vec<u8> {
        let queue = self.queue(replica);
        let mut last = queue.last.subscribe();
        {
            let mut pending = queue
                .pending
                .lock()
                .expect("no thread panics holding a queue");
            while pending.front().is_some_and(|(i, _)| *i <= after) {
                pending.pop_front();
            }
        }
        let _ = tokio::time::timeout(wait, last.wait_for(|l| *l > after)).await;
        let mut body = Vec::new();
        let mut served = 0u64;
        {
            let pending = queue
                .pending
                .lock()
                .expect("no thread panics holding a queue");
            for (index, message) in pending
                .iter()
                .filter(|(i, _)| *i > after)
                .take(FETCH_MESSAGES_MAX)
            {
                body.extend_from_slice(&index.to_be_bytes());
                let len = u32::try_from(message.len()).expect("a message is under 4 GiB");
                body.extend_from_slice(&len.to_be_bytes());
                body.extend_from_slice(message);
                served += 1;
            }
        }
        self.served.fetch_add(served, Ordering::Relaxed);
        self.served_bytes
            .fetch_add(body.len() as u64, Ordering::Relaxed);
        body
    }

    pub fn count_up(&self, bytes: usize) {
        self.up.fetch_add(1, Ordering::Relaxed);
        self.up_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn arm_loss(&self) {
        self.lose_next.store(true, Ordering::SeqCst);
    }

    pub fn lost(&self) -> serde_json::Value {
        serde_json::json!({
            "armed": self.lose_next.load(Ordering::SeqCst),
            "lost": self.lost.load(Ordering::SeqCst),
            "lost_bytes": self.lost_bytes.load(Ordering::SeqCst),
        })
    }

    /// `messages` and `bytes` are what `send` took; the rest what was served down (a
    /// message each time it was answered, with its 12-byte frame) and posted up.
    pub fn stats(&self) -> serde_json::Value {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        serde_json::json!({
            "messages": n(&self.taken),
            "bytes": n(&self.taken_bytes),
            "served_messages": n(&self.served),
            "served_bytes": n(&self.served_bytes),
            "up_messages": n(&self.up),
            "up_bytes": n(&self.up_bytes),
        })
    }
}

/// magic_sync's way to the replicas: every message into its replica's queue.
pub struct Loopback(pub Arc<Queues>);

impl Transport for Loopback {
    async fn send(
        &self,
        _audience: &str,
        replica: Uuid,
        message: Vec<u8>,
        _id: &str,
    ) -> Result<(), Error> {
        self.0.take(replica, message);
        Ok(())
    }
}
