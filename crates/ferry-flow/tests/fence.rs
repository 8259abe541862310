//! The fence that covers side effects (docs/flow-server.md §5.3, guarantee 2), in the
//! engine: over a journal whose `may_act` turns false (a server-mode shard whose lease
//! may have passed to another worker), no step body starts, and the run journals
//! nothing more, whatever its code makes of the error: not even its end.

use ferry_flow::journal::Entry;
use ferry_flow::journal_log::{Durable, OnDurable};
use ferry_flow::{Ctx, Engine, JournalLog, LogConfig, Signal, Workflow};
use ferry_log::{Error, Follower, Log, Lsn, Record, Stats};
use ferry_testkit::{Scratch, eventually};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

/// A local log whose writer may act only while `open`.
struct Gated {
    log: Log,
    open: AtomicBool,
}

impl JournalLog for Gated {
    fn append(&self, kind: u8, payload: &[u8]) -> Result<Lsn, Error> {
        self.log.append(kind, payload)
    }
    fn durable_lsn(&self) -> Lsn {
        self.log.durable_lsn()
    }
    fn start_lsn(&self) -> Lsn {
        self.log.start_lsn()
    }
    fn end_lsn(&self) -> Lsn {
        self.log.end_lsn()
    }
    fn durable(&self, lsn: Lsn, _: Option<&Follower>) -> Durable {
        Box::pin(self.log.durable(lsn))
    }
    fn on_durable(&self, lsn: Lsn, _: Option<&Follower>, f: OnDurable) {
        self.log.on_durable(lsn, None, f)
    }
    fn read(&self, from: Lsn, f: &mut dyn FnMut(Record<'_>)) -> Result<Lsn, Error> {
        self.log.read(from, f)
    }
    fn retire_below(&self, _: Lsn) -> Result<usize, Error> {
        Ok(0)
    }
    fn stats(&self) -> Stats {
        self.log.stats()
    }
    fn may_act(&self) -> bool {
        self.open.load(Ordering::SeqCst)
    }
}

static CHARGE: Workflow<u32, String> = Workflow::new("charge");
static GO: Signal<u32> = Signal::new("go");

/// Guards guarantee 2 in the engine: past the fence a step body does not start, and a
/// run whose code catches the refusal and returns anyway journals no end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_fence_no_step_body_starts_and_the_run_journals_nothing_more() {
    let scratch = Scratch::new("flow-fence");
    let (log, _) = Log::open_dir(&scratch.path().join("log"), LogConfig::default()).unwrap();
    let gated = Arc::new(Gated {
        log,
        open: AtomicBool::new(true),
    });
    let bodies = Arc::new(AtomicU32::new(0));
    let b = bodies.clone();
    let engine = Engine::builder(scratch.path().join("engine"))
        .journal(gated.clone())
        .register(CHARGE, move |ctx: Ctx, n: u32| {
            let b = b.clone();
            async move {
                let b1 = b.clone();
                ctx.step("first", move |_| {
                    let b1 = b1.clone();
                    async move {
                        b1.fetch_add(1, Ordering::SeqCst);
                        Ok(n)
                    }
                })
                .await?;
                let _ = ctx.wait_for(GO, None).await?;
                let b2 = b.clone();
                // The code catches whatever the second step says, and returns anyway.
                let second = ctx
                    .step("second", move |_| {
                        let b2 = b2.clone();
                        async move {
                            b2.fetch_add(1, Ordering::SeqCst);
                            Ok(n)
                        }
                    })
                    .await;
                Ok(format!("returned anyway after {second:?}"))
            }
        })
        .open()
        .unwrap();
    let run = engine.start(CHARGE, "order-1", &7).await.unwrap();
    eventually("the first body", || bodies.load(Ordering::SeqCst) == 1).await;
    // The lease may have passed to another worker from here on.
    gated.open.store(false, Ordering::SeqCst);
    engine.signal("order-1", GO, &1).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        bodies.load(Ordering::SeqCst),
        1,
        "the second body did not start"
    );
    let result = tokio::time::timeout(Duration::from_millis(300), run.result()).await;
    assert!(result.is_err(), "no result left the process: {result:?}");
    // The journal holds no end for the run, nor the second step.
    drop(engine);
    let mut entries = Vec::new();
    gated
        .log
        .read(0, |r| {
            if let Ok(rec) = ferry_flow::journal::Record::decode(r.payload) {
                entries.push(rec.entry);
            }
        })
        .unwrap();
    assert!(
        !entries.iter().any(|e| matches!(e, Entry::Finished { .. })
            || matches!(e, Entry::Step { name, .. } if name == "second")),
        "{entries:?}"
    );
}
