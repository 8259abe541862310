//! A message as the app hands it over, and the limits it is checked against before
//! anything is written (docs/outbox.md §3.1). Pure: no I/O.

use std::collections::BTreeMap;

/// Payload bytes allowed by default: 1 MB (10^6), which with the largest headers allowed
/// still fits NATS's default `max_payload` of 1 MiB. A relay checks the transport's own
/// limit at start-up and refuses to start below it.
pub const PAYLOAD_BYTES_MAX: usize = 1_000_000;
/// Header pairs per message. Each becomes a transport header.
pub const HEADERS_MAX: usize = 32;
/// Bytes of all header names and values together.
pub const HEADER_BYTES_MAX: usize = 4 << 10;
/// Bytes of a topic, a key or a message id.
pub const NAME_BYTES_MAX: usize = 255;
/// Room a relay needs on top of the payload: the message's headers at their limit, the
/// relay's own (`Nats-Msg-Id`, `Ferry-Key`, `Ferry-Seq`: at most three names and
/// 255-byte values) and the protocol's framing.
pub const ENVELOPE_BYTES_MAX: usize = HEADER_BYTES_MAX + 1024 + 2 * NAME_BYTES_MAX;
const _: () = assert!(PAYLOAD_BYTES_MAX + ENVELOPE_BYTES_MAX <= 1 << 20);

/// One message to enqueue in the app's transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// The id every transport sees (`Nats-Msg-Id`, `Idempotency-Key`). Enqueueing an id
    /// already in the outbox does nothing, so an app may retry its transaction.
    pub message_id: String,
    /// A NATS subject or the webhook's topic header: printable ASCII, no spaces.
    pub topic: String,
    /// Messages of one key are published in commit order when `ordered`.
    pub key: Option<String>,
    pub ordered: bool,
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
}

impl Message {
    /// An unordered message with a fresh UUIDv7 id.
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Message {
        Message {
            message_id: uuid::Uuid::now_v7().to_string(),
            topic: topic.into(),
            key: None,
            ordered: false,
            payload: payload.into(),
            headers: BTreeMap::new(),
        }
    }

    /// Publish in commit order with every other ordered message of `key`.
    #[must_use]
    pub fn ordered_by(mut self, key: impl Into<String>) -> Message {
        self.key = Some(key.into());
        self.ordered = true;
        self
    }

    #[must_use]
    pub fn with_id(mut self, message_id: impl Into<String>) -> Message {
        self.message_id = message_id.into();
        self
    }

    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Message {
        self.headers.insert(name.into(), value.into());
        self
    }
}

/// Limits a message is checked against at enqueue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub payload_bytes_max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            payload_bytes_max: PAYLOAD_BYTES_MAX,
        }
    }
}

/// Why a message was not enqueued. Nothing was written; the app's transaction is intact
/// (the app decides whether to roll it back).
#[derive(Debug, thiserror::Error)]
pub enum EnqueueError {
    #[error("message {message_id}: {what}")]
    Invalid { message_id: String, what: String },
    #[error(
        "the outbox schema is not installed in this database (run `ferry outbox install --db URL`): {0}"
    )]
    NotInstalled(String),
    #[error("enqueue failed: {0}")]
    Db(#[from] sqlx::Error),
}

impl ferry_core::Classify for EnqueueError {
    fn class(&self) -> ferry_core::Class {
        match self {
            EnqueueError::Invalid { .. } | EnqueueError::NotInstalled(_) => {
                ferry_core::Class::Permanent
            }
            EnqueueError::Db(e) => crate::error::classify(e),
        }
    }
}

/// Check `m` against `limits` and the format rules; the error names the field, its size
/// and the limit.
pub fn validate(m: &Message, limits: &Limits) -> Result<(), EnqueueError> {
    let invalid = |what: String| EnqueueError::Invalid {
        message_id: truncate(&m.message_id, 64),
        what,
    };
    check_name("message_id", &m.message_id, false).map_err(invalid)?;
    check_name("topic", &m.topic, true).map_err(invalid)?;
    if let Some(k) = &m.key {
        check_name("key", k, false).map_err(invalid)?;
    }
    if m.ordered && m.key.is_none() {
        return Err(invalid(
            "ordered messages need a key: order is kept per key".into(),
        ));
    }
    if m.payload.len() > limits.payload_bytes_max {
        return Err(invalid(format!(
            "payload is {} bytes, over the limit of {} bytes; send a reference to the data instead, or raise payload_bytes_max (and the transport's own limit)",
            m.payload.len(),
            limits.payload_bytes_max
        )));
    }
    if m.headers.len() > HEADERS_MAX {
        return Err(invalid(format!(
            "{} headers, over the limit of {HEADERS_MAX}",
            m.headers.len()
        )));
    }
    let header_bytes: usize = m.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    if header_bytes > HEADER_BYTES_MAX {
        return Err(invalid(format!(
            "headers take {header_bytes} bytes, over the limit of {HEADER_BYTES_MAX}"
        )));
    }
    for (k, v) in &m.headers {
        if k.is_empty()
            || !k
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(invalid(format!(
                "header name {k:?} must be letters, digits, '-' or '_'"
            )));
        }
        if k.to_ascii_lowercase().starts_with("ferry-")
            || k.eq_ignore_ascii_case("nats-msg-id")
            || k.eq_ignore_ascii_case("idempotency-key")
        {
            return Err(invalid(format!(
                "header name {k:?} is reserved for the relay"
            )));
        }
        if v.chars().any(|c| c.is_control() && c != '\t') {
            return Err(invalid(format!(
                "header {k:?} has a control character (a line break, NUL…) in its value"
            )));
        }
    }
    Ok(())
}

/// Non-empty, at most `NAME_BYTES_MAX`, printable ASCII without spaces; a subject (topic)
/// also may not start or end with '.' nor hold NATS wildcards.
fn check_name(field: &str, v: &str, subject: bool) -> Result<(), String> {
    if v.is_empty() {
        return Err(format!("{field} is empty"));
    }
    if v.len() > NAME_BYTES_MAX {
        return Err(format!(
            "{field} is {} bytes, over the limit of {NAME_BYTES_MAX}",
            v.len()
        ));
    }
    if let Some(c) = v.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "{field} {:?} holds {c:?}: only printable ASCII without spaces",
            truncate(v, 64)
        ));
    }
    if subject
        && (v.starts_with('.')
            || v.ends_with('.')
            || v.contains("..")
            || v.contains('*')
            || v.contains('>'))
    {
        return Err(format!(
            "topic {v:?} is not a valid subject (no empty tokens, no '*' or '>')"
        ));
    }
    Ok(())
}

fn truncate(s: &str, n: usize) -> String {
    if s.len() <= n {
        return s.to_string();
    }
    let mut end = n;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_good_message_passes_and_each_bad_field_is_named() {
        let ok = Message::new("orders.created", b"{}".to_vec()).ordered_by("order-1");
        validate(&ok, &Limits::default()).unwrap();
        let cases: Vec<(Message, &str)> = vec![
            (Message::new("", b"x".to_vec()), "topic is empty"),
            (Message::new("a b", b"x".to_vec()), "printable ASCII"),
            (Message::new("a.*", b"x".to_vec()), "not a valid subject"),
            (
                Message::new("t", vec![0u8; PAYLOAD_BYTES_MAX + 1]),
                "over the limit of 1000000 bytes",
            ),
            (
                Message {
                    ordered: true,
                    ..Message::new("t", b"x".to_vec())
                },
                "need a key",
            ),
            (
                Message::new("t", b"x".to_vec()).with_header("Nats-Msg-Id", "x"),
                "reserved",
            ),
            (
                Message::new("t", b"x".to_vec()).with_header("a", "b\r\nc: d"),
                "control character",
            ),
            (
                Message::new("t", b"x".to_vec()).with_id(""),
                "message_id is empty",
            ),
        ];
        for (m, want) in cases {
            let e = validate(&m, &Limits::default()).unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} should say {want:?}");
        }
    }
}
