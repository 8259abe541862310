//! Calls across shards on a server's worker (docs/flow-server.md §9).
//!
//! - **Served here**: the server forwards a start, signal, cancel or query for a run on
//!   a shard this worker holds; one thread with its own runtime carries each out on the
//!   engine as the application's own call would be, and answers. A shard not held (yet:
//!   still recovering) answers `not_held`, and the server sends the call again.
//! - **Made from here**: the engine's calls about a run on a shard this worker does not
//!   hold go to the server, which forwards them to the holder ([`remote`]), and a run
//!   handle's result is long-polled from the server's index ([`remote_result`]).

use crate::api::{FlowError, decode};
use crate::journal::Json;
use crate::remote::proto::{self, Call, CallKind, Refused};
use crate::remote::worker::Caller;
use crate::shared::Shared;
use ferry_core::sync::lock;
use serde::de::DeserializeOwned;
use std::sync::Weak;
use tokio::sync::mpsc;

/// Serve the calls the server forwards, until the connection closes, on a thread of
/// their own ([`answer_calls`] on the caller's thread).
pub(crate) fn serve(
    shared: Weak<Shared>,
    calls: mpsc::UnboundedReceiver<(u64, Call)>,
    caller: Caller,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("ferry-flow-calls".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime builds");
            // The engine's futures are not Send: each call is a task of this thread's.
            let tasks = tokio::task::LocalSet::new();
            tasks.block_on(&rt, answer_calls(shared, calls, caller));
        })
        .map(drop)
}

/// Carry out each forwarded call as a task of the current `LocalSet`, and answer it.
pub(crate) async fn answer_calls(
    shared: Weak<Shared>,
    mut calls: mpsc::UnboundedReceiver<(u64, Call)>,
    caller: Caller,
) {
    while let Some((id, call)) = calls.recv().await {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let caller = caller.clone();
        tokio::task::spawn_local(async move {
            let outcome = match carry_out(&shared, call).await {
                Ok(json) => proto::Outcome::Ok(serde_json::to_vec(&json).expect("JSON serializes")),
                // The shard moved while the call was carried out: whether its record is
                // durable, the next holder finds out (the call's key makes a second
                // delivery a no-op) ... or it is closing: the next holder answers.
                Err(FlowError::Log(ferry_log::Error::Fenced(why))) => proto::Outcome::Err {
                    kind: "not_held".into(),
                    message: why,
                },
                Err(e @ FlowError::Stopped) => proto::Outcome::Err {
                    kind: "not_held".into(),
                    message: e.to_string(),
                },
                Err(e) => proto::Outcome::Err {
                    kind: e.kind().into(),
                    message: e.to_string(),
                },
            };
            caller.answer(id, outcome);
        });
    }
}

fn json_of(bytes: &[u8], what: &str) -> Result<Json, FlowError> {
    serde_json::from_slice(bytes).map_err(|e| FlowError::Codec(format!("{what} is not JSON: {e}")))
}

/// A forwarded call, carried out here.
async fn carry_out(shared: &Shared, call: Call) -> Result<Json, FlowError> {
    match call.kind {
        CallKind::Start {
            workflow,
            id,
            input,
        } => {
            let input = json_of(&input, "the input")?;
            shared
                .start_run(&workflow, &id, input, None)?
                .durable()
                .await?;
            Ok(serde_json::json!({ "id": id }))
        }
        CallKind::Signal { id, name, value } => {
            let value = json_of(&value, "the signal's value")?;
            shared.deliver(&id, &name, value, Some(&call.key)).await?;
            Ok(Json::Null)
        }
        CallKind::Cancel { id } => Ok(Json::Bool(shared.cancel(&id).await?)),
        CallKind::Query { id } => Ok(shared.published(&id)?.unwrap_or(Json::Null)),
        CallKind::Result { .. } => Err(FlowError::Invalid(
            "a result is answered by the server, not forwarded".into(),
        )),
    }
}

/// Make `kind` through the server; its JSON answer, or the error it came back with.
pub(crate) async fn remote(
    caller: &Caller,
    kind: CallKind,
    key: String,
) -> Result<Json, FlowError> {
    let run = kind.run().to_string();
    let signal = match &kind {
        CallKind::Signal { name, .. } => name.clone(),
        _ => String::new(),
    };
    match caller.call(Call { kind, key }).await {
        Ok(proto::Outcome::Ok(bytes)) => json_of(&bytes, "the server's answer"),
        Ok(proto::Outcome::Err { kind, message }) => {
            Err(FlowError::from_remote(&kind, message, &run, &signal))
        }
        Err(r) => Err(refused(r)),
    }
}

/// A refusal of a call by the server, as the engine's error.
fn refused(r: Refused) -> FlowError {
    let kind = match r {
        Refused::NoHolder { .. } => "no_holder",
        Refused::Unavailable { .. } => "server",
        _ => "refused",
    };
    FlowError::Remote {
        kind: kind.into(),
        message: r.to_string(),
    }
}

/// How long one long-poll for a result waits on the server.
const RESULT_POLL_MS: u32 = 30_000;

/// Run `id`'s result from the server's index, once it ended.
pub(crate) async fn remote_result<O: DeserializeOwned>(
    caller: &Caller,
    id: &str,
) -> Result<O, FlowError> {
    loop {
        let kind = CallKind::Result {
            id: id.to_string(),
            wait_ms: RESULT_POLL_MS,
        };
        let summary = remote(caller, kind, String::new()).await?;
        let detail = summary.get("detail").cloned().unwrap_or(Json::Null);
        let text = || match &detail {
            Json::String(s) => s.clone(),
            other => other.to_string(),
        };
        return match summary.get("state").and_then(Json::as_str) {
            Some("running") => continue,
            Some("finished") => decode(detail),
            Some("failed") => Err(FlowError::RunFailed { error: text() }),
            Some("cancelled") => Err(FlowError::Cancelled),
            Some("parked") => Err(FlowError::Parked(text())),
            other => Err(FlowError::Codec(format!(
                "the server's answer for run {id:?} has state {other:?}"
            ))),
        };
    }
}

impl Shared {
    /// [`Shared::deliver`] here, or on a server's worker through the server when another
    /// worker holds the run's shard (with a fresh key if the caller gave none, so that a
    /// call sent again is delivered once).
    pub(crate) async fn deliver_anywhere(
        &self,
        id: &str,
        name: &str,
        value: Json,
        key: Option<&str>,
    ) -> Result<(), FlowError> {
        let Some(c) = self.caller.get().filter(|_| elsewhere(&self.held(id))) else {
            return self.deliver(id, name, value, key).await;
        };
        let kind = CallKind::Signal {
            id: id.to_string(),
            name: name.to_string(),
            value: serde_json::to_vec(&value).expect("JSON serializes"),
        };
        let key = key.map_or_else(|| crate::remote::fresh_key("call"), str::to_string);
        remote(c, kind, key).await.map(drop)
    }

    /// What run `id` last published (`ctx.publish`), if anything. On a worker, an
    /// answer leaves only while the shard's lease deadline is ahead
    /// (docs/flow-server.md §5.3).
    pub(crate) fn published(&self, id: &str) -> Result<Option<Json>, FlowError> {
        let lane = self.held(id)?;
        if self.on_server && !lane.journal.may_act() {
            return Err(FlowError::NotHeld {
                run: id.to_string(),
                shard: self.shard_of(id) as u32,
            });
        }
        let runs = lock(&self.runs);
        let e = runs
            .get(id)
            .ok_or_else(|| FlowError::UnknownRun { id: id.into() })?;
        Ok(e.published().cloned())
    }
}

/// Whether a local call's error says the run is not here (its shard is another
/// worker's, or nobody's yet): on a worker, the server is asked instead.
pub(crate) fn elsewhere<T>(r: &Result<T, FlowError>) -> bool {
    matches!(
        r,
        Err(FlowError::NotHeld { .. } | FlowError::UnknownRun { .. })
    )
}
