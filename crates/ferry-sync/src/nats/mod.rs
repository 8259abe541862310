//! NATS JetStream as a transport, beside the built-in HTTP (docs/sync-nats.md): the same
//! frames, reports, uploads and `Filed` answers, carried on per-replica subjects.
//!
//! - [`bridge::Bridge`] runs in `ferry sync serve --nats URL`: it publishes each
//!   replica's outbox frames to its down subject, and files what replicas publish up.
//! - [`link::NatsLink`] is the replica's side: a [`Downlink`](crate::replica::Downlink)
//!   over its durable consumer and an [`Uplink`](crate::replica::Uplink) that publishes
//!   uploads (deduplicated by their upload id) and waits for their `Filed`.
//!
//! What travels is exactly what HTTP carries; every check the frames, reports and uploads
//! get (seals, stamps, chains, the stale check, the token) is the same.

pub mod bridge;
pub mod link;

use std::time::Duration;

use uuid::Uuid;

/// The subjects' prefix unless told otherwise.
pub const PREFIX_DEFAULT: &str = "ferry.sync";

/// The replica's token, on everything it publishes: the bridge files and stores only
/// under the replica whose token it is (the subject names the replica; the token proves
/// it), whatever NATS's own permissions allow.
pub const TOKEN_HEADER: &str = "Ferry-Token";
/// On a down message: the frame's epoch (uuid) and seq; on a `Filed`: the upload's id.
pub const EPOCH_HEADER: &str = "Ferry-Epoch";
pub const SEQ_HEADER: &str = "Ferry-Seq";
pub const UPLOAD_HEADER: &str = "Ferry-Upload";
/// `i/n`: the message is part *i* (from 1) of *n* of one frame or `Filed`, when the whole
/// is over what the NATS server takes in one message (its `max_payload`).
pub const CHUNK_HEADER: &str = "Ferry-Chunk";
/// On the filed subject, instead of a `Filed`: why the upload was not filed (a wrong
/// token, a malformed upload), in words.
pub const REFUSED_HEADER: &str = "Ferry-Refused";

/// Room left for headers in a message of `max_payload` bytes.
pub const HEADROOM: usize = 8 * 1024;

/// Down messages kept per replica in the stream, whatever was acknowledged: twice the
/// outbox's bound, so a replica that comes back within the outbox's bound finds every
/// frame it lacks. Beyond it the oldest go; the replica sees a gap and is caught up by a
/// new chain, as over HTTP after its outbox was dropped.
pub const DOWN_KEPT_PER_REPLICA: i64 = 20_000;
/// How long the streams keep a message: a replica away longer is caught up by a new
/// chain; an upload older than this is sent again by its replica anyway.
pub const KEPT_FOR: Duration = Duration::from_secs(14 * 24 * 3600);

/// The subjects, streams and consumers under one prefix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    prefix: String,
}

/// What a message published up is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Up {
    Report,
    Upload,
}

impl Names {
    /// `prefix`: NATS subject tokens (letters, digits, `_`, `-`) joined by dots.
    pub fn new(prefix: &str) -> Result<Names, ferry_core::ConfigError> {
        let ok = !prefix.is_empty()
            && prefix.split('.').all(|t| {
                !t.is_empty()
                    && t.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            });
        if !ok {
            return Err(ferry_core::ConfigError::new(
                "nats-prefix",
                prefix,
                "must be NATS subject tokens (letters, digits, '_', '-') joined by dots, e.g. ferry.sync",
            ));
        }
        Ok(Names {
            prefix: prefix.to_string(),
        })
    }

    /// Frames to replica `id`, in its chain's order.
    pub fn down(&self, id: Uuid) -> String {
        format!("{}.{id}.down", self.prefix)
    }

    /// Replica `id`'s uploads.
    pub fn upload(&self, id: Uuid) -> String {
        format!("{}.{id}.up", self.prefix)
    }

    /// Replica `id`'s reports.
    pub fn report(&self, id: Uuid) -> String {
        format!("{}.{id}.report", self.prefix)
    }

    /// The answers to replica `id`'s uploads (core NATS: a replica not listening sends
    /// its upload again, as over HTTP when an answer is lost).
    pub fn filed(&self, id: Uuid) -> String {
        format!("{}.{id}.filed", self.prefix)
    }

    fn stream_base(&self) -> String {
        self.prefix.replace(['.', '-'], "_").to_ascii_uppercase()
    }

    /// The stream of every replica's frames (`<prefix>.*.down`).
    pub fn down_stream(&self) -> String {
        format!("{}_DOWN", self.stream_base())
    }

    /// The stream of replicas' uploads (`<prefix>.*.up`), a work queue the bridges share.
    pub fn up_stream(&self) -> String {
        format!("{}_UP", self.stream_base())
    }

    /// The stream of replicas' reports (`<prefix>.*.report`), a work queue keeping the
    /// latest per replica only: a report stored late can never replace a newer one.
    pub fn reports_stream(&self) -> String {
        format!("{}_REPORTS", self.stream_base())
    }

    /// Replica `id`'s durable consumer of its frames.
    pub fn consumer(&self, id: Uuid) -> String {
        format!(
            "{}-{id}",
            self.stream_base().to_ascii_lowercase().replace('_', "-")
        )
    }

    /// The bridges' shared durable consumer of the up stream.
    pub fn filer(&self) -> String {
        format!(
            "{}-filer",
            self.stream_base().to_ascii_lowercase().replace('_', "-")
        )
    }

    /// The bridges' shared durable consumer of the reports stream.
    pub fn reporter(&self) -> String {
        format!(
            "{}-reports",
            self.stream_base().to_ascii_lowercase().replace('_', "-")
        )
    }

    /// The replica and kind a subject of the up stream names.
    pub fn parse_up(&self, subject: &str) -> Option<(Uuid, Up)> {
        let rest = subject.strip_prefix(&self.prefix)?.strip_prefix('.')?;
        let (id, kind) = rest.split_once('.')?;
        let kind = match kind {
            "up" => Up::Upload,
            "report" => Up::Report,
            _ => return None,
        };
        Some((id.parse().ok()?, kind))
    }

    fn down_subjects(&self) -> String {
        format!("{}.*.down", self.prefix)
    }

    fn up_subjects(&self) -> String {
        format!("{}.*.up", self.prefix)
    }

    fn report_subjects(&self) -> String {
        format!("{}.*.report", self.prefix)
    }
}

/// `whole` in messages of at most `max` bytes each: (part from 1, parts, bytes).
pub fn chunks(whole: &[u8], max: usize) -> impl Iterator<Item = (usize, usize, &[u8])> {
    let max = max.max(1);
    let n = whole.len().div_ceil(max).max(1);
    (0..n).map(move |i| {
        let end = ((i + 1) * max).min(whole.len());
        (i + 1, n, &whole[i * max..end])
    })
}

/// Reads `i/n` from a chunk header; a message without one is whole (1/1).
pub fn chunk_of(headers: Option<&async_nats::HeaderMap>) -> Option<(usize, usize)> {
    let Some(value) = headers.and_then(|h| h.get(CHUNK_HEADER)) else {
        return Some((1, 1));
    };
    let (i, n) = value.as_str().split_once('/')?;
    let (i, n): (usize, usize) = (i.parse().ok()?, n.parse().ok()?);
    (1..=n).contains(&i).then_some((i, n))
}

/// Puts chunked wholes back together, in order: a part out of turn (the stream dropped an
/// earlier one) drops the whole it belongs to.
#[derive(Default)]
pub struct Assembler {
    buf: Vec<u8>,
    next: usize,
    key: String,
}

/// The most a whole put together from parts may be: a frame's limit (docs/sync.md §11),
/// which is above a `Filed`'s. Parts past it drop the whole.
pub const WHOLE_BYTES_MAX: usize = crate::wire::FRAME_BYTES_MAX;

impl Assembler {
    /// `key` names the whole (its frame or upload); the whole, once its last part came.
    pub fn push(&mut self, key: &str, (i, n): (usize, usize), bytes: &[u8]) -> Option<Vec<u8>> {
        if n == 1 {
            self.next = 0;
            return Some(bytes.to_vec());
        }
        if i == 1 {
            self.buf.clear();
            self.key = key.to_string();
            self.next = 1;
        }
        if self.next != i || self.key != key || self.buf.len() + bytes.len() > WHOLE_BYTES_MAX {
            self.next = 0;
            self.buf = Vec::new();
            return None;
        }
        self.buf.extend_from_slice(bytes);
        if i == n {
            self.next = 0;
            return Some(std::mem::take(&mut self.buf));
        }
        self.next += 1;
        None
    }
}

/// A connection to NATS that keeps reconnecting, and says so in the log.
pub(crate) async fn connect(url: &str, who: &'static str) -> Result<async_nats::Client, String> {
    let server = url.to_string();
    async_nats::ConnectOptions::new()
        .name(who)
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(None)
        .retry_on_initial_connect()
        .reconnect_delay_callback(|attempts| {
            let exp = u32::try_from(attempts.saturating_sub(1))
                .unwrap_or(u32::MAX)
                .min(16);
            Duration::from_millis(2u64.saturating_pow(exp)).min(Duration::from_millis(500))
        })
        .event_callback(move |event| {
            let server = server.clone();
            async move {
                match event {
                    async_nats::Event::Disconnected => {
                        tracing::warn!(%server, who, "lost the connection to NATS; reconnecting")
                    }
                    async_nats::Event::Connected => {
                        tracing::info!(%server, who, "connected to NATS")
                    }
                    other => tracing::debug!(%server, who, event = %other, "NATS"),
                }
            }
        })
        .connect(url)
        .await
        .map_err(|e| format!("cannot connect to NATS at {url}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_per_replica_and_parse_back() {
        let names = Names::new("shop.sync").unwrap();
        let id = Uuid::from_u128(7);
        assert_eq!(names.down_stream(), "SHOP_SYNC_DOWN");
        assert_eq!(names.up_stream(), "SHOP_SYNC_UP");
        assert_eq!(names.reports_stream(), "SHOP_SYNC_REPORTS");
        assert_eq!(
            names.consumer(id),
            "shop-sync-00000000-0000-0000-0000-000000000007"
        );
        assert_eq!(names.parse_up(&names.upload(id)), Some((id, Up::Upload)));
        assert_eq!(names.parse_up(&names.report(id)), Some((id, Up::Report)));
        assert_eq!(names.parse_up(&names.down(id)), None);
        assert_eq!(names.parse_up("shop.sync.not-a-uuid.up"), None);
        assert_eq!(names.parse_up("other.sync.x.up"), None);
        for bad in ["", "a..b", "a.*", "a.>", "a b", ".a"] {
            assert!(Names::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn chunks_come_back_whole_and_a_missing_part_drops_its_whole() {
        let whole: Vec<u8> = (0..2_500u32).map(|i| i as u8).collect();
        let parts: Vec<_> = chunks(&whole, 1_000).collect();
        assert_eq!(parts.len(), 3);
        let mut a = Assembler::default();
        assert_eq!(a.push("f", (1, 3), parts[0].2), None);
        assert_eq!(a.push("f", (2, 3), parts[1].2), None);
        assert_eq!(a.push("f", (3, 3), parts[2].2), Some(whole.clone()));
        // Part 2 lost: the whole is dropped, and the next whole starts clean.
        assert_eq!(a.push("g", (1, 3), parts[0].2), None);
        assert_eq!(a.push("g", (3, 3), parts[2].2), None);
        assert_eq!(a.push("h", (1, 1), b"x"), Some(b"x".to_vec()));
        // Parts of another whole in the middle.
        assert_eq!(a.push("i", (1, 2), b"a"), None);
        assert_eq!(a.push("j", (2, 2), b"b"), None);
        assert_eq!(chunks(b"", 10).count(), 1);
        assert_eq!(chunk_of(None), Some((1, 1)));
    }
}
