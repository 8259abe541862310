//! The NATS JetStream transport: the topic is the subject, the message id goes in
//! `Nats-Msg-Id`, and a publish counts only once its acknowledgement arrives.
//!
//! Start-up checks, so that a misconfiguration fails before anything is leased: the
//! server answers; JetStream answers (`$JS.API.INFO`, read with a reply type of our own
//! that takes any server version's fields: async-nats's own requires fields nats-server
//! 2.9 does not send); the named stream, when there is one, exists, and its
//! `duplicate_window` (the dedup window) and `max_msg_size`, and the server's
//! `max_payload`, suit the outbox's payload limit.
//!
//! A publish that no one answers ("no responders") is told apart by asking JetStream:
//! when JetStream itself does not answer, the transport is away (unavailable); when it
//! answers but no stream takes the subject, the message is refused (it spends an
//! attempt and is parked at the bound, its error naming the subject), because no retry
//! can deliver it until someone creates a stream for it.
//!
//! Connection events are logged with the server and what happened, and counted: a
//! disconnect ends the wait for acknowledgements sent before it (they would never come:
//! the outcome is unknown and the message is presented again under the same id), and a
//! reconnection lets a paused relay probe at once ([`Transport::connections`]).

use super::{Outcome, PublishFuture, Transport, TransportError, TransportOptions};
use crate::store::Leased;
use async_nats::jetstream::{self, ErrorCode, context::PublishErrorKind};
use ferry_core::ConfigError;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

pub struct JetStream {
    url: String,
    client: async_nats::Client,
    js: jetstream::Context,
    dedup_window: Option<Duration>,
    events: Arc<Events>,
}

/// Counts of connection events, rising: each a watch so waiters wake on a change.
struct Events {
    connects: watch::Sender<u64>,
    disconnects: watch::Sender<u64>,
}

/// How long a start-up request to JetStream may take.
const START_UP_REQUEST: Duration = Duration::from_secs(5);
/// Longest wait between two reconnection attempts. async-nats doubles from 2 ms to 4 s;
/// a relay waiting up to 4 s after the server came back is an outage of our own making,
/// and one TCP connect per half second to one server costs it nothing.
const RECONNECT_DELAY_MAX: Duration = Duration::from_millis(500);

impl JetStream {
    pub async fn connect(
        url: &str,
        options: &TransportOptions,
    ) -> Result<JetStream, TransportError> {
        let events = Arc::new(Events {
            connects: watch::channel(0).0,
            disconnects: watch::channel(0).0,
        });
        let (e, u) = (events.clone(), url.to_string());
        // No retry on the first connection: a wrong address is reported at start-up.
        // Later the client reconnects forever, and the breaker pauses publishing meanwhile.
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .max_reconnects(None)
            .reconnect_delay_callback(|attempts| {
                let exp = u32::try_from(attempts.saturating_sub(1))
                    .unwrap_or(u32::MAX)
                    .min(16);
                Duration::from_millis(2u64.saturating_pow(exp)).min(RECONNECT_DELAY_MAX)
            })
            .event_callback(move |event| {
                let (e, u) = (e.clone(), u.clone());
                async move { log_event(&u, &e, event) }
            })
            .connect(url)
            .await
            .map_err(|err| TransportError::Unreachable {
                what: format!("NATS at {url}"),
                detail: err.to_string(),
            })?;
        let max_payload = client.server_info().max_payload;
        if max_payload < options.payload_bytes_max + crate::message::ENVELOPE_BYTES_MAX {
            return Err(TransportError::Unsuitable {
                what: format!("NATS at {url}"),
                detail: format!(
                    "it accepts messages up to {max_payload} bytes (max_payload), less than the outbox's payload limit of {} bytes plus room for headers; raise max_payload on the server or lower the outbox limit",
                    options.payload_bytes_max
                ),
            });
        }
        let mut js = jetstream::new(client.clone());
        js.set_timeout(options.publish_timeout);
        let mut dedup_window = None;
        jetstream_answers(&client, url).await?;
        if let Some(name) = &options.nats_stream {
            // get_stream reads the stream's info: its cached copy is current.
            let stream = js.get_stream(name).await.map_err(|e| {
                ConfigError::new(
                    "stream",
                    name,
                    format!("NATS at {url} has no such stream ({e}); create it (with the topics as its subjects) first"),
                )
            })?;
            let info = stream.cached_info();
            dedup_window = Some(info.config.duplicate_window);
            if info.config.max_message_size > 0
                && (info.config.max_message_size as usize) < options.payload_bytes_max
            {
                return Err(TransportError::Unsuitable {
                    what: format!("NATS at {url}"),
                    detail: format!(
                        "stream {name:?} takes messages up to {} bytes (max_msg_size), less than the outbox's payload limit of {} bytes",
                        info.config.max_message_size, options.payload_bytes_max
                    ),
                });
            }
        }
        Ok(JetStream {
            url: url.to_string(),
            client,
            js,
            dedup_window,
            events,
        })
    }

    async fn send(&self, msg: &Leased) -> Outcome {
        if self.client.connection_state() != async_nats::connection::State::Connected {
            return unavailable(format!("not connected to NATS at {}", self.url));
        }
        // A disconnect from here on ends the wait for this publish's acknowledgement.
        let mut disconnects = self.events.disconnects.subscribe();
        disconnects.mark_unchanged();
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
            Err(e) => return self.classify(msg, e, false).await,
        };
        tokio::select! {
            r = std::future::IntoFuture::into_future(ack) => match r {
                Ok(a) => Outcome::Confirmed { duplicate: a.duplicate },
                Err(e) => self.classify(msg, e, true).await,
            },
            _ = disconnects.changed() => Outcome::Unknown(format!(
                "the connection to NATS at {} dropped before the acknowledgement came: the stream may hold it",
                self.url
            )),
        }
    }

    async fn classify(
        &self,
        msg: &Leased,
        e: async_nats::jetstream::context::PublishError,
        sent: bool,
    ) -> Outcome {
        let url = &self.url;
        match e.kind() {
            PublishErrorKind::StreamNotFound => self.no_responders(&msg.topic).await,
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

    /// No one answered a publish to `subject`: JetStream is away, or no stream takes the
    /// subject. Ask JetStream which.
    async fn no_responders(&self, subject: &str) -> Outcome {
        let url = &self.url;
        if let Err(e) = jetstream_answers(&self.client, url).await {
            return unavailable(format!(
                "NATS at {url}: no JetStream responder for subject {subject}, and JetStream does not answer ({e})"
            ));
        }
        match self.js.stream_by_subject(subject).await {
            Err(e) if e.kind() == jetstream::context::GetStreamByNameErrorKind::NotFound => {
                Outcome::Refused(format!(
                    "no JetStream stream on NATS at {url} takes subject {subject}: create a stream whose subjects cover it (or add it to a stream's subjects), then requeue the message"
                ))
            }
            Ok(stream) => unavailable(format!(
                "NATS at {url}: stream {stream} takes subject {subject} but did not answer the publish"
            )),
            Err(e) => unavailable(format!(
                "NATS at {url}: no JetStream responder for subject {subject}, and looking up its stream failed ({e})"
            )),
        }
    }
}

fn unavailable(reason: String) -> Outcome {
    Outcome::Unavailable {
        reason,
        retry_after: None,
        server_error: false,
    }
}

/// The part of JetStream's `$JS.API.INFO` reply the outbox reads: only whether it is an
/// error. Every other field is ignored, so any server version's reply parses.
#[derive(serde::Deserialize)]
struct InfoReply {
    #[serde(default)]
    error: Option<ApiError>,
}

#[derive(serde::Deserialize)]
struct ApiError {
    #[serde(default)]
    code: u16,
    #[serde(default)]
    description: String,
}

/// Does JetStream answer on this connection?
async fn jetstream_answers(client: &async_nats::Client, url: &str) -> Result<(), TransportError> {
    let unsuitable = |detail: String| TransportError::Unsuitable {
        what: format!("NATS at {url}"),
        detail,
    };
    let reply = tokio::time::timeout(
        START_UP_REQUEST,
        client.request("$JS.API.INFO", Vec::new().into()),
    )
    .await
    .map_err(|_| TransportError::Unreachable {
        what: format!("JetStream at {url}"),
        detail: format!("no answer to $JS.API.INFO within {START_UP_REQUEST:?}"),
    })?;
    let reply = match reply {
        Ok(m) => m,
        Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
            return Err(unsuitable(
                "JetStream does not answer (no responders for $JS.API.INFO): start nats-server with -js (or enable JetStream for this account)".into(),
            ));
        }
        Err(e) => {
            return Err(TransportError::Unreachable {
                what: format!("JetStream at {url}"),
                detail: e.to_string(),
            });
        }
    };
    let info: InfoReply = serde_json::from_slice(&reply.payload).map_err(|e| {
        unsuitable(format!(
            "its answer to $JS.API.INFO is not JSON ({e}): {}",
            String::from_utf8_lossy(&reply.payload[..reply.payload.len().min(200)])
        ))
    })?;
    match info.error {
        Some(err) => Err(unsuitable(format!(
            "JetStream refuses this account ({} {}): enable JetStream for it",
            err.code, err.description
        ))),
        None => Ok(()),
    }
}

/// Log a connection event with the server and what it means for publishing, and count
/// (re)connections and disconnects.
fn log_event(url: &str, events: &Events, event: async_nats::Event) {
    use async_nats::Event as E;
    match event {
        E::Connected => {
            let mut first = false;
            events.connects.send_modify(|n| {
                first = *n == 0;
                *n += 1;
            });
            if !first {
                tracing::info!(server = %url, "reconnected to NATS: publishing resumes");
            }
        }
        E::Disconnected => {
            events.disconnects.send_modify(|n| *n += 1);
            tracing::warn!(
                server = %url,
                "lost the connection to NATS; reconnecting (publishes in flight are presented again under the same id)"
            );
        }
        E::ClientError(e) => {
            tracing::debug!(server = %url, "connecting to NATS failed: {e}; retrying");
        }
        E::ServerError(e) => tracing::warn!(server = %url, "NATS reported an error: {e}"),
        E::LameDuckMode => tracing::warn!(
            server = %url,
            "NATS is shutting down (lame duck mode): the client will reconnect"
        ),
        E::SlowConsumer(sid) => {
            tracing::warn!(server = %url, sid, "NATS: a subscription cannot keep up")
        }
        E::Draining => tracing::info!(server = %url, "draining the NATS connection"),
        // The client was dropped (the relay stopping, or failing at start-up).
        E::Closed => tracing::debug!(server = %url, "the NATS connection is closed"),
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

    fn connections(&self) -> Option<watch::Receiver<u64>> {
        Some(self.events.connects.subscribe())
    }
}
