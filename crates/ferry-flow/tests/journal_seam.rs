//! The engine over a log that lives elsewhere (`EngineBuilder::journal`): the seam a
//! server mode plugs into. `Remote` stands in for a server that holds the log: appends
//! travel to its thread, which makes them durable a round trip later, all that arrived
//! meanwhile at once; a worker that dies loses what the server had not made durable,
//! and a new worker's session reads the rest. Guards against the engine depending on
//! ferry-log (or on its own directory) anywhere but in opening its own log, and checks
//! that workflow code runs unchanged over the seam, crash included.

use ferry_flow::journal::{Entry, RECORD_KIND, Record as JournalRecord};
use ferry_flow::journal_log::{Durable, OnDurable};
use ferry_flow::{Ctx, Engine, FlowError, JournalLog, Signal, Workflow};
use ferry_log::{Error, Lsn, Record, Stats};
use ferry_testkit::{Scratch, eventually};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// What the server keeps; one per test.
struct Server {
    state: Mutex<State>,
    work: Condvar,
    durable: AtomicU64,
}

struct Rec {
    lsn: Lsn,
    end: Lsn,
    kind: u8,
    payload: Vec<u8>,
}

enum Wait {
    Channel(oneshot::Sender<Result<(), Error>>),
    Call(OnDurable),
}

impl Wait {
    fn send(self, r: Result<(), Error>) {
        match self {
            Wait::Channel(tx) => {
                let _ = tx.send(r);
            }
            Wait::Call(f) => f(r),
        }
    }
}

#[derive(Default)]
struct State {
    durable: Vec<Rec>,
    /// Sent by the current session, not yet durable.
    pending: Vec<Rec>,
    end: Lsn,
    waits: Vec<(Lsn, Wait)>,
    /// The session whose appends the server takes; older sessions are dead.
    session: u64,
    /// Where each dead session's durable position stopped: it never moves again for
    /// that session (the next session's records are not its own).
    ended: BTreeMap<u64, Lsn>,
}

/// What a dead session's calls get: the journal refuses everything from then on.
fn session_ended() -> Error {
    Error::Io {
        what: "reach the server (this worker's session ended)",
        source: Arc::new(std::io::Error::other("session ended")),
    }
}

/// A worker's session with the server.
struct Remote {
    server: Arc<Server>,
    session: u64,
}

impl Server {
    /// The server's thread holds it weakly: it stops once the test lets go of it.
    fn start() -> Arc<Server> {
        let server = Arc::new(Server {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            durable: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&server);
        std::thread::spawn(move || {
            while let Some(s) = weak.upgrade() {
                s.serve_once();
            }
        });
        server
    }

    /// Make what arrived durable, a round trip after it arrived: everything that
    /// arrived meanwhile in one go. Returns after 10 ms with nothing to do.
    fn serve_once(&self) {
        let (session, n) = {
            let mut st = self.state.lock().unwrap();
            if st.pending.is_empty() {
                st = self
                    .work
                    .wait_timeout(st, Duration::from_millis(10))
                    .unwrap()
                    .0;
            }
            if st.pending.is_empty() {
                return;
            }
            (st.session, st.pending.len())
        };
        std::thread::sleep(Duration::from_micros(300));
        let ready = {
            let mut st = self.state.lock().unwrap();
            if st.session != session {
                return;
            }
            let batch: Vec<Rec> = st.pending.drain(..n).collect();
            let upto = batch.last().expect("n > 0").end;
            st.durable.extend(batch);
            self.durable.store(upto, Ordering::SeqCst);
            let (ready, rest) = std::mem::take(&mut st.waits)
                .into_iter()
                .partition(|(lsn, _)| *lsn <= upto);
            st.waits = rest;
            ready
        };
        for (_, w) in ready {
            w.send(Ok(()));
        }
    }

    fn session(self: &Arc<Self>) -> Arc<Remote> {
        let session = self.state.lock().unwrap().session;
        Arc::new(Remote {
            server: self.clone(),
            session,
        })
    }

    /// The worker died: what it sent and the server had not made durable is gone,
    /// its waits fail, and the next session starts at the durable end.
    fn worker_died(&self) {
        let waits = {
            let mut st = self.state.lock().unwrap();
            let (old, at) = (st.session, self.durable.load(Ordering::SeqCst));
            st.ended.insert(old, at);
            st.session += 1;
            st.pending.clear();
            st.end = self.durable.load(Ordering::SeqCst);
            std::mem::take(&mut st.waits)
        };
        for (_, w) in waits {
            w.send(Err(session_ended()));
        }
    }

    /// The durable records, decoded.
    fn journal(&self) -> Vec<JournalRecord> {
        let st = self.state.lock().unwrap();
        st.durable
            .iter()
            .filter(|r| r.kind == RECORD_KIND)
            .map(|r| JournalRecord::decode(&r.payload).unwrap())
            .collect()
    }
}

impl Remote {
    /// This session's durable position: frozen where it stopped once the session died.
    fn durable_in(&self, st: &State) -> Lsn {
        match st.ended.get(&self.session) {
            Some(&at) => at,
            None => self.server.durable.load(Ordering::SeqCst),
        }
    }

    /// Queue `w` for `lsn`, or answer it now if `lsn` is durable or never will be.
    fn wait(&self, lsn: Lsn, w: Wait) {
        let mut st = self.server.state.lock().unwrap();
        let r = match st.ended.get(&self.session) {
            Some(&at) if at >= lsn => Ok(()),
            Some(_) => Err(session_ended()),
            None if self.server.durable.load(Ordering::SeqCst) >= lsn => Ok(()),
            None => {
                st.waits.push((lsn, w));
                return;
            }
        };
        drop(st);
        w.send(r);
    }
}

impl JournalLog for Remote {
    fn append(&self, kind: u8, payload: &[u8]) -> Result<Lsn, Error> {
        let mut st = self.server.state.lock().unwrap();
        if st.session != self.session {
            return Err(session_ended());
        }
        let lsn = st.end;
        let end = lsn + 16 + payload.len() as u64;
        st.pending.push(Rec {
            lsn,
            end,
            kind,
            payload: payload.to_vec(),
        });
        st.end = end;
        self.server.work.notify_one();
        Ok(end)
    }

    fn durable_lsn(&self) -> Lsn {
        let st = self.server.state.lock().unwrap();
        self.durable_in(&st)
    }

    fn start_lsn(&self) -> Lsn {
        0
    }

    fn end_lsn(&self) -> Lsn {
        self.server.state.lock().unwrap().end
    }

    fn durable(&self, lsn: Lsn, _: Option<&ferry_log::Follower>) -> Durable {
        let (tx, rx) = oneshot::channel();
        self.wait(lsn, Wait::Channel(tx));
        Box::pin(async move { rx.await.unwrap_or_else(|_| Err(session_ended())) })
    }

    fn on_durable(&self, lsn: Lsn, _: Option<&ferry_log::Follower>, f: OnDurable) {
        self.wait(lsn, Wait::Call(f));
    }

    fn read(&self, from: Lsn, f: &mut dyn FnMut(Record<'_>)) -> Result<Lsn, Error> {
        let st = self.server.state.lock().unwrap();
        let durable = self.durable_in(&st);
        for r in st
            .durable
            .iter()
            .filter(|r| r.lsn >= from && r.end <= durable)
        {
            f(Record {
                lsn: r.lsn,
                end: r.end,
                kind: r.kind,
                payload: &r.payload,
            });
        }
        Ok(durable)
    }

    fn retire_below(&self, _: Lsn) -> Result<usize, Error> {
        Ok(0)
    }

    fn stats(&self) -> Stats {
        Stats {
            durable: self.durable_lsn(),
            end: self.end_lsn(),
            ..Stats::default()
        }
    }
}

static ORDER: Workflow<u32, String> = Workflow::new("order");
static DOUBLE: Workflow<u32, u32> = Workflow::new("double");
static SHIPPED: Signal<String> = Signal::new("shipped");

/// Step bodies record their idempotency key here: the outside world.
type Ledger = Arc<Mutex<Vec<String>>>;

fn engine(dir: &std::path::Path, journal: Arc<Remote>, ledger: Ledger) -> Engine {
    Engine::builder(dir)
        .journal(journal)
        .register(DOUBLE, |ctx: Ctx, n: u32| async move {
            ctx.step("double", move |_| async move { Ok(n * 2) }).await
        })
        .register(ORDER, move |ctx: Ctx, n: u32| {
            let ledger = ledger.clone();
            async move {
                let charged: u32 = ctx
                    .step("charge", |s| {
                        let ledger = ledger.clone();
                        async move {
                            ledger.lock().unwrap().push(s.key().to_string());
                            Ok(n * 10)
                        }
                    })
                    .await?;
                ctx.sleep(Duration::from_millis(5)).await?;
                let doubled = ctx.child(DOUBLE, &charged).await?;
                let tracking = ctx
                    .wait_for(SHIPPED, Some(Duration::from_secs(60)))
                    .await?
                    .ok_or_else(|| FlowError::Invalid("no shipment".into()))?;
                Ok(format!("{n}:{doubled}:{tracking}"))
            }
        })
        .open()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workflows_run_unchanged_over_a_journal_that_lives_elsewhere() {
    let scratch = Scratch::new("flow-seam");
    let dir = scratch.dir("flow");
    let server = Server::start();
    let ledger: Ledger = Arc::default();
    let engine = engine(&dir, server.session(), ledger.clone());
    let mut handles = Vec::new();
    for n in 0..20 {
        handles.push(
            engine
                .start(ORDER, &format!("order-{n}"), &n)
                .await
                .unwrap(),
        );
    }
    for n in 0..20 {
        eventually("the order to wait for its shipment", || {
            server.journal().iter().any(|r| {
                r.run == format!("order-{n}") && matches!(&r.entry, Entry::WaitStarted { .. })
            })
        })
        .await;
        engine
            .signal(&format!("order-{n}"), SHIPPED, &format!("T{n}"))
            .await
            .unwrap();
    }
    for (n, h) in handles.into_iter().enumerate() {
        assert_eq!(h.result().await.unwrap(), format!("{n}:{}:T{n}", n * 20));
    }
    assert_eq!(ledger.lock().unwrap().len(), 20, "one charge per order");
    // Everything went to the journal: the engine wrote nothing of its own.
    let made: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(
        made.is_empty(),
        "the engine wrote {made:?} in its directory over a journal of someone else's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_worker_resumes_from_the_journal_and_no_acknowledged_step_runs_again() {
    let scratch = Scratch::new("flow-seam-crash");
    let dir = scratch.dir("flow");
    let server = Server::start();
    let ledger: Ledger = Arc::default();
    let first = engine(&dir, server.session(), ledger.clone());
    for n in 0..40 {
        first.start(ORDER, &format!("order-{n}"), &n).await.unwrap();
    }
    eventually("some charges to be made", || {
        ledger.lock().unwrap().len() >= 10
    })
    .await;
    // The worker dies mid-way: its session ends with whatever the server holds.
    server.worker_died();
    drop(first);
    let charged_durably: BTreeSet<String> = server
        .journal()
        .iter()
        .filter(|r| matches!(&r.entry, Entry::Step { name, .. } if name == "charge"))
        .map(|r| r.run.clone())
        .collect();
    let before: BTreeMap<String, usize> = charges_by_run(&ledger);
    assert!(
        !charged_durably.is_empty(),
        "the worker died before any charge was durable: the test checks nothing"
    );

    let second = engine(&dir, server.session(), ledger.clone());
    assert!(
        second.recovery().log_records > 0,
        "the new worker read the journal"
    );
    for n in 0..40 {
        let id = format!("order-{n}");
        // Started again by the application, as after any restart: the same run.
        let h = second.start(ORDER, &id, &n).await.unwrap();
        eventually("the order to wait for its shipment", || {
            server
                .journal()
                .iter()
                .any(|r| r.run == id && matches!(&r.entry, Entry::WaitStarted { .. }))
        })
        .await;
        second.signal(&id, SHIPPED, &format!("T{n}")).await.unwrap();
        assert_eq!(h.result().await.unwrap(), format!("{n}:{}:T{n}", n * 20));
    }
    let after = charges_by_run(&ledger);
    for n in 0..40 {
        let id = format!("order-{n}");
        let (was, now) = (
            before.get(&id).copied().unwrap_or(0),
            after.get(&id).copied().unwrap_or(0),
        );
        assert!(now >= 1, "{id} was never charged");
        if charged_durably.contains(&id) {
            assert_eq!(now, was, "{id}'s charge was durable, yet it ran again");
        }
    }
}

/// How many times each run's charge ran (keys are `run/generation/position`).
fn charges_by_run(ledger: &Ledger) -> BTreeMap<String, usize> {
    let mut by = BTreeMap::new();
    for key in ledger.lock().unwrap().iter() {
        let run = key.split('/').next().unwrap().to_string();
        *by.entry(run).or_default() += 1;
    }
    by
}
