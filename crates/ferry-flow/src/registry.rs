//! The runs map's entries: each run's workflow, status, generation, inbox (signals in
//! journal order, the keys of keyed signals, a cancellation) and what fewer runs need
//! (a parent, waiters for its result, a park position, a published state), boxed.

use crate::api::RunStatus;
use crate::journal::Json;
use crate::run::Wake;
use ferry_log::Lsn;
use std::sync::Arc;
use tokio::sync::oneshot;

/// One run in the runs map. Kept small (what most runs need inline, the rest boxed
/// when first needed): a map of a million parked runs is mostly these.
pub(crate) struct RunEntry {
    pub(crate) workflow: &'static str,
    pub(crate) status: RunStatus,
    pub(crate) generation: u32,
    /// The end of the run's start record: `start` returns once it is durable.
    pub(crate) start_end: Lsn,
    pub(crate) inbox: Inbox,
    extra: Option<Box<Extra>>,
    /// On a server's worker: when the holder's sweep first found the run finished (ms
    /// on the engine's wall clock; 0 not yet), for its retention (holder.rs).
    pub(crate) finished_seen_ms: u64,
}

/// What some runs have: a parent, callers waiting for the result, a park position, a
/// published state.
#[derive(Default)]
struct Extra {
    parent: Option<String>,
    /// Callers of `result()` and parents waiting for this child: told its end.
    waiters: Vec<oneshot::Sender<RunStatus>>,
    /// A parked run's generation and the position after its journal, where a
    /// cancellation journals its end.
    parked_at: Option<(u32, u32)>,
    published: Option<Json>,
}

impl RunEntry {
    pub(crate) fn new(
        workflow: &'static str,
        parent: Option<String>,
        generation: u32,
        status: RunStatus,
    ) -> Self {
        let mut e = RunEntry {
            workflow,
            status,
            generation,
            start_end: 0,
            inbox: Inbox::default(),
            extra: None,
            finished_seen_ms: 0,
        };
        if parent.is_some() {
            e.extra().parent = parent;
        }
        e
    }

    fn extra(&mut self) -> &mut Extra {
        self.extra.get_or_insert_with(Box::default)
    }

    pub(crate) fn parent(&self) -> Option<&String> {
        self.extra.as_ref().and_then(|x| x.parent.as_ref())
    }

    pub(crate) fn add_waiter(&mut self, tx: oneshot::Sender<RunStatus>) {
        self.extra().waiters.push(tx);
    }

    pub(crate) fn parked_at(&self) -> Option<(u32, u32)> {
        self.extra.as_ref().and_then(|x| x.parked_at)
    }

    pub(crate) fn set_parked_at(&mut self, at: Option<(u32, u32)>) {
        if at.is_some() || self.extra.is_some() {
            self.extra().parked_at = at;
        }
    }

    pub(crate) fn published(&self) -> Option<&Json> {
        self.extra.as_ref().and_then(|x| x.published.as_ref())
    }

    pub(crate) fn publish(&mut self, v: Json) {
        self.extra().published = Some(v);
    }

    /// Everyone waiting for this run's end, taken (to be told it).
    pub(crate) fn take_waiters(&mut self) -> Vec<oneshot::Sender<RunStatus>> {
        self.extra
            .as_mut()
            .map(|x| std::mem::take(&mut x.waiters))
            .unwrap_or_default()
    }
}

/// What arrived for a run from outside: signals in journal order, a cancellation.
#[derive(Default)]
pub(crate) struct Inbox {
    /// Shared with the run's context, which checks it without a lock.
    pub(crate) wake: Arc<Wake>,
    /// Boxed when the first signal comes.
    mail: Option<Box<Mail>>,
}

#[derive(Default)]
struct Mail {
    signals: Vec<(String, Json)>,
    /// Signals consumed (all names): `signals.len() - consumed` are pending.
    consumed: usize,
    /// The keys of keyed signals received (never reset: a key is delivered once).
    keys: Vec<String>,
}

impl Inbox {
    fn mail(&mut self) -> &mut Mail {
        self.mail.get_or_insert_with(Box::default)
    }

    pub(crate) fn pending(&self) -> usize {
        self.mail
            .as_ref()
            .map_or(0, |m| m.signals.len().saturating_sub(m.consumed))
    }

    pub(crate) fn consumed_one(&mut self) {
        self.mail().consumed += 1;
    }

    /// Recovery of a finished run from a checkpoint: the keys of the keyed signals it
    /// received, without the signals.
    pub(crate) fn remember_keys(&mut self, keys: &[String]) {
        if !keys.is_empty() {
            self.mail().keys.extend_from_slice(keys);
        }
    }

    /// Recovery: `n` signals were consumed before the journal's end.
    pub(crate) fn set_consumed(&mut self, n: usize) {
        if n > 0 {
            self.mail().consumed = n;
        }
    }

    pub(crate) fn has_key(&self, k: &str) -> bool {
        self.mail
            .as_ref()
            .is_some_and(|m| m.keys.iter().any(|x| x == k))
    }

    pub(crate) fn push(&mut self, name: String, value: Json, key: Option<String>) {
        let m = self.mail();
        m.signals.push((name, value));
        m.keys.extend(key);
    }

    /// The `index`th signal named `name`.
    pub(crate) fn signal_at(&self, name: &str, index: u32) -> Option<Json> {
        self.mail.as_ref().and_then(|m| {
            m.signals
                .iter()
                .filter(|(n, _)| n == name)
                .nth(index as usize)
                .map(|(_, v)| v.clone())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inbox_numbers_signals_by_name_counts_pending_and_keeps_keys() {
        let mut inbox = Inbox::default();
        assert_eq!(inbox.pending(), 0);
        assert!(!inbox.has_key("k1"));
        inbox.push("go".into(), Json::from(1), Some("k1".into()));
        inbox.push("stop".into(), Json::from(2), None);
        inbox.push("go".into(), Json::from(3), None);
        // The n-th of a name, in arrival order, whatever came between.
        assert_eq!(inbox.signal_at("go", 0), Some(Json::from(1)));
        assert_eq!(inbox.signal_at("go", 1), Some(Json::from(3)));
        assert_eq!(inbox.signal_at("go", 2), None);
        assert_eq!(inbox.signal_at("stop", 0), Some(Json::from(2)));
        assert_eq!(inbox.pending(), 3);
        inbox.consumed_one();
        assert_eq!(inbox.pending(), 2);
        // A key is never forgotten, consumed or not.
        assert!(inbox.has_key("k1"));
        assert!(!inbox.has_key("k2"));
    }

    #[test]
    fn a_finished_run_from_a_checkpoint_keeps_its_keys_without_signals() {
        let mut e = RunEntry::new(
            "w",
            None,
            0,
            RunStatus::Finished(crate::journal::Outcome::Ok(Json::Null)),
        );
        e.inbox.remember_keys(&["a".into(), "b".into()]);
        e.inbox.remember_keys(&[]);
        assert!(e.inbox.has_key("a") && e.inbox.has_key("b"));
        assert_eq!(e.inbox.pending(), 0);
        assert_eq!(e.inbox.signal_at("go", 0), None);
        // Recovery of an unfinished run: what was consumed before the journal's end.
        let mut inbox = Inbox::default();
        inbox.push("go".into(), Json::from(1), None);
        inbox.push("go".into(), Json::from(2), None);
        inbox.set_consumed(1);
        assert_eq!(inbox.pending(), 1);
    }

    #[test]
    fn waiters_are_taken_once() {
        let mut e = RunEntry::new("w", Some("parent".into()), 0, RunStatus::Running);
        assert_eq!(e.parent().map(String::as_str), Some("parent"));
        let (tx, mut rx) = oneshot::channel();
        e.add_waiter(tx);
        let taken = e.take_waiters();
        assert_eq!(taken.len(), 1);
        assert!(e.take_waiters().is_empty());
        for w in taken {
            let _ = w.send(RunStatus::Running);
        }
        assert_eq!(rx.try_recv().unwrap(), RunStatus::Running);
    }
}
