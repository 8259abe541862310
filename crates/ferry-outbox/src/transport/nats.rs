//! The NATS JetStream transport: the topic is the subject, the message id goes in
//! `Nats-Msg-Id`, and a publish counts only once its acknowledgement arrives.
//!
//! Start-up checks, so that a misconfiguration fails before anything is leased: the
//! server answers; JetStream is enabled; a stream covers the subjects (the named one, or
//! later per subject: a missing stream is reported as unavailable, never as the message's
//! fault); the stream's `duplicate_window` (the dedup window) and the server's
//! `max_payload` against the outbox's payload limit.

use super::{Outcome, PublishFuture, Transport, TransportOptions};
use crate::store::Leased;
use async_nats::jetstream::{self, ErrorCode, context::PublishErrorKind};
use std::time::Duration;

pub struct JetStream {
    url: String,
    client: async_nats::Client,
    js: jetstream::Context,
    dedup_window: Option<Duration>,
}

impl JetStream {
    pub async fn connect(url: &str, options: &TransportOptions) -> Result<JetStream, String> {
        // No retry on the first connection: a wrong address is reported at start-up.
        // Later the client reconnects forever, and the breaker pauses publishing meanwhile.
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .max_reconnects(None)
            .connect(url)
            .await
            .map_err(|e| {
                format!("cannot connect to NATS at {url}: {e}; is nats-server running there?")
            })?;
        let max_payload = client.server_info().max_payload;
        if max_payload < options.payload_bytes_max + crate::message::ENVELOPE_BYTES_MAX {
            return Err(format!(
                "NATS at {url} accepts messages up to {max_payload} bytes (max_payload), less than the outbox's payload limit of {} bytes plus room for headers; raise max_payload on the server or lower the outbox limit",
                options.payload_bytes_max
            ));
        }
        let mut js = jetstream::new(client.clone());
        js.set_timeout(options.publish_timeout);
        let mut dedup_window = None;
        if let Some(name) = &options.nats_stream {
            let mut stream = js.get_stream(name).await.map_err(|e| {
                format!("NATS at {url}: stream {name:?} is not there ({e}); create it (with the topics as its subjects) first")
            })?;
            let info = stream
                .info()
                .await
                .map_err(|e| format!("NATS at {url}: cannot read stream {name:?}: {e}"))?;
            dedup_window = Some(info.config.duplicate_window);
            if info.config.max_message_size > 0
                && (info.config.max_message_size as usize) < options.payload_bytes_max
            {
                return Err(format!(
                    "stream {name:?} takes messages up to {} bytes (max_msg_size), less than the outbox's payload limit of {} bytes",
                    info.config.max_message_size, options.payload_bytes_max
                ));
            }
        } else {
            // Prove JetStream answers at all.
            js.query_account()
                .await
                .map_err(|e| format!("NATS at {url} does not answer JetStream requests ({e}); is it started with -js?"))?;
        }
        Ok(JetStream {
            url: url.to_string(),
            client,
            js,
            dedup_window,
        })
    }

    async fn send(&self, msg: &Leased) -> Outcome {
        if self.client.connection_state() != async_nats::connection::State::Connected {
            return Outcome::Unavailable {
                reason: format!("not connected to NATS at {}", self.url),
                retry_after: None,
                server_error: false,
            };
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", msg.message_id.as_str());
        if let Some(k) = &msg.key {
            headers.insert("Ferry-Key", k.as_str());
        }
        if let Some(s) = msg.seq {
            headers.insert("Ferry-Seq", s.to_string().as_str());
        }
        for (k, v) in &msg.headers {
            headers.insert(k.as_str(), v.as_str());
        }
        let ack = match self
            .js
            .publish_with_headers(msg.topic.clone(), headers, msg.payload.clone().into())
            .await
        {
            Ok(ack) => ack,
            // Not handed to the connection: nothing went out.
            Err(e) => return classify(&self.url, e, false),
        };
        match ack.await {
            Ok(a) => Outcome::Confirmed {
                duplicate: a.duplicate,
            },
            Err(e) => classify(&self.url, e, true),
        }
    }
}

fn classify(url: &str, e: async_nats::jetstream::context::PublishError, sent: bool) -> Outcome {
    let unavailable = |reason: String| Outcome::Unavailable {
        reason,
        retry_after: None,
        server_error: false,
    };
    match e.kind() {
        PublishErrorKind::StreamNotFound => unavailable(format!(
            "NATS at {url}: no stream takes this subject (or no JetStream responder): {e}"
        )),
        PublishErrorKind::MaxPayloadExceeded => Outcome::Refused(format!("{e}")),
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe if sent => {
            Outcome::Unknown(format!("NATS at {url}: {e}"))
        }
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
            unavailable(format!("NATS at {url}: {e}"))
        }
        PublishErrorKind::MaxAckPending => unavailable(format!("NATS at {url}: {e}")),
        _ => {
            let api = std::error::Error::source(&e)
                .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
                .map(|j| j.error_code());
            match api {
                Some(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => {
                    Outcome::Refused(format!("NATS at {url}: {e}"))
                }
                // A full stream (DiscardNew), exhausted account resources, a cluster
                // without a leader: an operator fixes those; the message is fine.
                Some(ErrorCode::STREAM_STORE_FAILED)
                | Some(ErrorCode::ACCOUNT_RESOURCES_EXCEEDED)
                | Some(ErrorCode::CLUSTER_NOT_AVAILABLE)
                // Other resource and availability errors of the server.
                | Some(ErrorCode(10023 | 10028 | 10039 | 10047)) => {
                    unavailable(format!("NATS at {url}: {e}"))
                }
                Some(_) => Outcome::Refused(format!("NATS at {url} refused it: {e}")),
                None if sent => Outcome::Unknown(format!("NATS at {url}: {e}")),
                None => unavailable(format!("NATS at {url}: {e}")),
            }
        }
    }
}

impl Transport for JetStream {
    fn publish<'a>(&'a self, msg: &'a Leased) -> PublishFuture<'a> {
        Box::pin(self.send(msg))
    }

    fn describe(&self) -> String {
        self.url.clone()
    }

    fn dedup_window(&self) -> Option<Duration> {
        self.dedup_window
    }
}
