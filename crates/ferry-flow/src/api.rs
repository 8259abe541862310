//! The types an application names (docs/flow.md §2): workflows and signals by name and
//! type, the error a call returns, the limits a run lives within, where a run stands and
//! what opening found. No behaviour beyond checking a limit and the JSON codec.

use crate::journal::{Json, Outcome};
use crate::replay::Nondeterminism;
use ferry_core::{Class, Classify, ConfigError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::marker::PhantomData;

/// A signal's name and payload type: `static REVIEW: Signal<Review> = Signal::new("review");`
pub struct Signal<T> {
    pub(crate) name: &'static str,
    _types: PhantomData<fn(T)>,
}

impl<T> Signal<T> {
    pub const fn new(name: &'static str) -> Self {
        Signal {
            name,
            _types: PhantomData,
        }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }
}

impl<T> Clone for Signal<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Signal<T> {}

/// A workflow's name and types: `static CHECKOUT: Workflow<Order, Receipt> = Workflow::new("checkout");`
pub struct Workflow<I, O> {
    name: &'static str,
    _types: PhantomData<fn(I) -> O>,
}

impl<I, O> Workflow<I, O> {
    pub const fn new(name: &'static str) -> Self {
        Workflow {
            name,
            _types: PhantomData,
        }
    }

    pub fn name(&self) -> &'static str {
        self.name
    }
}

impl<I, O> Clone for Workflow<I, O> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<I, O> Copy for Workflow<I, O> {}

/// What a call of the engine or of a run's context can fail with. Classified
/// ([`Classify`]): `Stopped` and most journal failures are transient (reopen the engine
/// and ask again); a damaged journal or checkpoint is corrupted; the rest are permanent
/// (asking again gets the same answer).
#[derive(Clone, Debug, thiserror::Error)]
pub enum FlowError {
    /// A step failed for good: its last attempt's error, once its retries ran out or at
    /// once if the body said the failure was permanent ([`StepError::permanent`]).
    #[error("step {name:?} failed: {error}")]
    Step { name: String, error: String },
    #[error("child run {id:?} failed: {error}")]
    Child { id: String, error: String },
    /// The run's code returned an error: what `result()` of a failed run returns.
    #[error("the run failed: {error}")]
    RunFailed { error: String },
    /// The run was cancelled (`engine.cancel`); returned by the suspension call that
    /// observed it, and by `result()` of a run that ended so.
    #[error("the run was cancelled")]
    Cancelled,
    #[error(transparent)]
    Nondeterminism(#[from] Nondeterminism),
    #[error("the run is parked: {0}")]
    Parked(String),
    #[error("{limit} is {value}, over the limit of {max}: {}", limit.hint())]
    LimitExceeded { limit: Limit, value: u64, max: u64 },
    /// What `ctx.continue_as_new` returns: return it from the workflow.
    #[error("the run continues as new")]
    ContinuedAsNew,
    #[error(transparent)]
    Log(#[from] ferry_log::Error),
    /// A value could not be encoded as JSON or decoded as the type asked for (a type
    /// changed between deploys, or a handle was asked for another workflow's output).
    #[error("cannot encode or decode a value: {0}")]
    Codec(String),
    /// The journal or a checkpoint holds something this build cannot use: damage, or a
    /// newer format. Nothing was changed; `hint` says what to do.
    #[error("{what} is unreadable: {reason}; {hint}")]
    Damaged {
        what: String,
        reason: String,
        hint: String,
    },
    /// The engine knows no run by this id: it was never started here, or it finished
    /// longer ago than the retention.
    #[error(
        "no run {id:?}: it was never started on this engine, or it finished longer ago \
         than the retention"
    )]
    UnknownRun { id: String },
    /// A signal came after its run had finished, and was not delivered. (Sending again
    /// a keyed signal that was delivered before the run finished succeeds instead.)
    #[error("run {id:?} had finished; signal {signal:?} was not delivered")]
    RunFinished { id: String, signal: String },
    /// A setting given to the builder cannot be used; nothing was opened.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A call the engine refuses as given (a malformed run id, a workflow that is not
    /// registered, an id taken by another workflow); the message says which.
    #[error("{0}")]
    Invalid(String),
    /// Reading the engine's directory failed.
    #[error("cannot {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: std::path::PathBuf,
        source: std::sync::Arc<std::io::Error>,
    },
    #[error("the engine stopped")]
    Stopped,
    /// Run `run` lives on shard `shard`, which this worker does not hold now
    /// (docs/flow-server.md §9): another worker does, or nobody yet. Ask again later,
    /// or ask the server.
    #[error(
        "run {run:?} is on shard {shard}, which this worker does not hold now; ask the \
         worker that holds it, through the server, or again later"
    )]
    NotHeld { run: String, shard: u32 },
    /// A call made through the server failed on the worker that holds the run, or on
    /// the server, with an error of kind `kind` that has no variant of its own here
    /// ([`FlowError::from_remote`]); or the server could not be asked (`kind` "server":
    /// transient, ask again).
    #[error("through the flow server: {message} ({kind})")]
    Remote { kind: String, message: String },
}

impl FlowError {
    /// The variant's name in snake case: what a call answered through the server
    /// carries (`remote::proto::Outcome::Err`), and what the HTTP API's refusals say.
    pub fn kind(&self) -> &'static str {
        match self {
            FlowError::Step { .. } => "step",
            FlowError::Child { .. } => "child",
            FlowError::RunFailed { .. } => "run_failed",
            FlowError::Cancelled => "cancelled",
            FlowError::Nondeterminism(_) => "nondeterminism",
            FlowError::Parked(_) => "parked",
            FlowError::LimitExceeded { .. } => "limit_exceeded",
            FlowError::ContinuedAsNew => "continued_as_new",
            FlowError::Log(_) => "log",
            FlowError::Codec(_) => "codec",
            FlowError::Damaged { .. } => "damaged",
            FlowError::UnknownRun { .. } => "unknown_run",
            FlowError::RunFinished { .. } => "run_finished",
            FlowError::Config(_) => "config",
            FlowError::Invalid(_) => "invalid",
            FlowError::Io { .. } => "io",
            FlowError::Stopped => "stopped",
            FlowError::NotHeld { .. } => "not_held",
            FlowError::Remote { .. } => "remote",
        }
    }

    /// The error a call answered through the server stands for, from its `kind` and
    /// `message` and the call's run and signal: the variants a caller acts on come back
    /// as themselves; the rest as `Remote`.
    pub fn from_remote(kind: &str, message: String, run: &str, signal: &str) -> FlowError {
        match kind {
            "unknown_run" => FlowError::UnknownRun { id: run.into() },
            "run_finished" => FlowError::RunFinished {
                id: run.into(),
                signal: signal.into(),
            },
            "cancelled" => FlowError::Cancelled,
            "run_failed" => FlowError::RunFailed { error: message },
            "parked" => FlowError::Parked(message),
            "invalid" => FlowError::Invalid(message),
            "codec" => FlowError::Codec(message),
            "stopped" => FlowError::Stopped,
            _ => FlowError::Remote {
                kind: kind.to_string(),
                message,
            },
        }
    }
}

impl Classify for FlowError {
    fn class(&self) -> Class {
        match self {
            FlowError::Log(e) => e.class(),
            FlowError::Io { source, .. } => source.class(),
            FlowError::Damaged { .. } => Class::Corrupted,
            FlowError::Stopped | FlowError::NotHeld { .. } => Class::Transient,
            FlowError::Remote { kind, .. } => match kind.as_str() {
                "server" | "no_holder" | "log" | "io" | "not_held" => Class::Transient,
                "damaged" => Class::Corrupted,
                _ => Class::Permanent,
            },
            FlowError::Step { .. }
            | FlowError::Child { .. }
            | FlowError::RunFailed { .. }
            | FlowError::Cancelled
            | FlowError::Nondeterminism(_)
            | FlowError::Parked(_)
            | FlowError::LimitExceeded { .. }
            | FlowError::ContinuedAsNew
            | FlowError::Codec(_)
            | FlowError::UnknownRun { .. }
            | FlowError::RunFinished { .. }
            | FlowError::Config(_)
            | FlowError::Invalid(_) => Class::Permanent,
        }
    }
}

/// How one attempt of a step's body failed. Transient by default (any `String` or
/// `&str` converts to one): the step's [`crate::Retry`] policy tries again. Permanent
/// when another attempt cannot succeed (the other side refused the request for good,
/// the input is invalid): the step fails at once with it, whatever attempts remain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepError {
    pub(crate) message: String,
    permanent: bool,
}

impl StepError {
    /// A failure another attempt may cure (a timeout, a peer away, a 503).
    pub fn transient(message: impl Into<String>) -> StepError {
        StepError {
            message: message.into(),
            permanent: false,
        }
    }

    /// A failure no later attempt can cure: the retry policy stops here.
    pub fn permanent(message: impl Into<String>) -> StepError {
        StepError {
            message: message.into(),
            permanent: true,
        }
    }

    /// From any classified error: permanent unless it is transient (a corrupted input
    /// is not retried either).
    pub fn classified<E: Classify + std::fmt::Display>(e: &E) -> StepError {
        if e.is_transient() {
            StepError::transient(e.to_string())
        } else {
            StepError::permanent(e.to_string())
        }
    }

    pub fn is_permanent(&self) -> bool {
        self.permanent
    }

    pub fn message(&self) -> &str {
        &self.message
    }
}

impl std::fmt::Display for StepError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<String> for StepError {
    fn from(message: String) -> StepError {
        StepError::transient(message)
    }
}

impl From<&str> for StepError {
    fn from(message: &str) -> StepError {
        StepError::transient(message)
    }
}

/// Which limit a run exceeded (docs/flow.md §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    Payload,
    History,
    Timers,
    Signals,
}

impl Limit {
    fn hint(&self) -> &'static str {
        match self {
            Limit::Payload => {
                "keep large values outside the journal (a blob store) and journal a \
                 reference, or raise Limits::payload_bytes"
            }
            Limit::History => {
                "long-running workflows should ctx.continue_as_new to start a fresh \
                 history, or raise Limits::history"
            }
            Limit::Timers => "await fewer sleeps at once, or raise Limits::timers",
            Limit::Signals => {
                "the run is not consuming its signals (wait_for); let it catch up, or \
                 raise Limits::signals"
            }
        }
    }
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Limit::Payload => "a journal record's size in bytes",
            Limit::History => "the run's history length (entries this generation)",
            Limit::Timers => "the run's pending timers",
            Limit::Signals => "the run's pending signals",
        })
    }
}

/// Explicit limits per run (docs/flow.md §6). A run that exceeds one fails with
/// [`FlowError::LimitExceeded`]; other runs are unaffected. A caller exceeding one
/// (a start input, a signal) gets the error and nothing is journaled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The largest journal record: a step result, input, output or signal payload with
    /// its few bytes of framing. Default 1 MiB.
    pub payload_bytes: usize,
    /// Entries per generation. Default 10,000.
    pub history: u32,
    /// Sleeps pending at once in one run. Default 1,000.
    pub timers: u32,
    /// Signals received and not yet consumed by one run. Default 1,000.
    pub signals: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            payload_bytes: 1 << 20,
            history: 10_000,
            timers: 1_000,
            signals: 1_000,
        }
    }
}

pub(crate) fn encode<T: Serialize>(v: &T) -> Result<Json, FlowError> {
    serde_json::to_value(v).map_err(|e| FlowError::Codec(e.to_string()))
}

pub(crate) fn decode<T: DeserializeOwned>(v: Json) -> Result<T, FlowError> {
    serde_json::from_value(v).map_err(|e| FlowError::Codec(e.to_string()))
}

/// Where a run stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunStatus {
    Running,
    Finished(Outcome),
    Parked(String),
}

/// One run, as `Engine::runs` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunInfo {
    pub id: String,
    pub workflow: String,
    pub generation: u32,
    pub status: RunStatus,
    pub parent: Option<String>,
}

/// How long opening took, and what it found.
#[derive(Clone, Copy, Debug)]
pub struct Recovery {
    pub elapsed: std::time::Duration,
    pub log_records: u64,
    pub resumed: usize,
    /// Bytes of a torn tail the log cut (a write a crash cut short, never acknowledged).
    pub torn_bytes: u64,
}

/// A record of `bytes` is within `limits`' payload bound, or the error naming it.
pub(crate) fn check_payload(limits: &Limits, bytes: usize) -> Result<(), FlowError> {
    if bytes > limits.payload_bytes {
        return Err(FlowError::LimitExceeded {
            limit: Limit::Payload,
            value: bytes as u64,
            max: limits.payload_bytes as u64,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_classified_by_what_asking_again_does() {
        assert!(FlowError::Stopped.is_transient());
        let damaged = FlowError::Damaged {
            what: "x".into(),
            reason: "y".into(),
            hint: "z".into(),
        };
        assert_eq!(damaged.class(), Class::Corrupted);
        assert_eq!(
            FlowError::UnknownRun { id: "r".into() }.class(),
            Class::Permanent
        );
        assert_eq!(
            FlowError::Config(ConfigError::new("shards", 0, "must be between 1 and 256")).class(),
            Class::Permanent
        );
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(
            StepError::classified(&refused)
                .message()
                .contains("refused")
        );
        assert!(!StepError::classified(&refused).is_permanent());
        let missing = std::io::Error::from(std::io::ErrorKind::NotFound);
        assert!(StepError::classified(&missing).is_permanent());
        assert!(!StepError::from("503").is_permanent());
    }
}
