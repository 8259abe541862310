//! Deadlines journaled before a restart are kept after it: a retry's backoff and a
//! `wait_for` timeout are durable timers, measured from when they were set, not from
//! the reopen. Guards against a restart shortening a backoff (hammering a service that
//! asked to be left alone) or stretching a timeout. One thread with tokio's clock
//! paused and the engine's wall clock read from it, so the times are exact and nothing
//! here waits in real time.

use ferry_core::seams::Clock;
use ferry_flow::{Ctx, Engine, Retry, Signal, Workflow};
use ferry_log::sim::SimStorage;
use std::sync::{Arc, Mutex};
use std::time::Duration;

static W: Workflow<u32, String> = Workflow::new("w");
static GO: Signal<u32> = Signal::new("go");

/// The wall clock as tokio's paused clock moves.
struct TokioClock {
    origin: tokio::time::Instant,
}

impl Clock for TokioClock {
    fn now(&self) -> std::time::Instant {
        tokio::time::Instant::now().into_std()
    }
    fn wall_ms(&self) -> u64 {
        1_800_000_000_000 + self.origin.elapsed().as_millis() as u64
    }
}

fn paused(f: impl std::future::Future<Output = ()>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    tokio::task::LocalSet::new().block_on(&rt, f);
}

/// Wall ms at which things happened, as the workflow saw them.
type Marks = Arc<Mutex<Vec<(&'static str, u64)>>>;

fn open(sim: &Arc<SimStorage>, clock: &Arc<TokioClock>, marks: &Marks, round: u64) -> Engine {
    let (c, m) = (clock.clone(), marks.clone());
    Engine::builder("unused")
        .storage(sim.clone())
        .clock(clock.clone())
        .on_this_thread(round)
        .register(W, move |ctx: Ctx, n: u32| {
            let (c, m) = (c.clone(), m.clone());
            async move {
                if n == 0 {
                    let v: u32 = ctx
                        .step("call", |_| {
                            let (c, m) = (c.clone(), m.clone());
                            async move {
                                let mut m = m.lock().unwrap();
                                m.push(("attempt", c.wall_ms()));
                                if m.len() == 1 {
                                    Err("503, retry later".into())
                                } else {
                                    Ok(7)
                                }
                            }
                        })
                        .retry(Retry::exponential(3, Duration::from_secs(20)))
                        .await?;
                    return Ok(format!("got {v}"));
                }
                m.lock().unwrap().push(("waiting", c.wall_ms()));
                let got = ctx.wait_for(GO, Some(Duration::from_secs(30))).await?;
                m.lock().unwrap().push(("waited", c.wall_ms()));
                Ok(format!("{got:?}"))
            }
        })
        .open()
        .unwrap()
}

/// Let the engine run (and its disk sync) for `d` of tokio time.
async fn run_for(d: Duration) {
    tokio::time::sleep(d).await;
}

/// The engine process dies: only what its disk holds is there for the next one.
fn die(engine: Engine, sim: &SimStorage) {
    sim.halt();
    drop(engine);
    sim.kill();
}

#[test]
fn a_backoff_cut_by_a_restart_waits_out_its_journaled_retry_time() {
    paused(async {
        let sim = Arc::new(SimStorage::new(1));
        let clock = Arc::new(TokioClock {
            origin: tokio::time::Instant::now(),
        });
        let marks: Marks = Arc::default();
        let engine = open(&sim, &clock, &marks, 1);
        engine.start(W, "r", &0).await.unwrap();
        // The first attempt fails and its retry time (20 s on) is journaled; the
        // engine dies 2 s into the backoff.
        run_for(Duration::from_secs(2)).await;
        assert_eq!(
            marks.lock().unwrap().len(),
            1,
            "one attempt before the kill"
        );
        die(engine, &sim);
        let engine = open(&sim, &clock, &marks, 2);
        let got = engine.start(W, "r", &0).await.unwrap().result().await;
        assert_eq!(got.unwrap(), "got 7");
        let m = marks.lock().unwrap().clone();
        assert_eq!(m.len(), 2, "{m:?}");
        let waited = m[1].1 - m[0].1;
        assert!(
            waited >= 20_000,
            "the retry came {waited} ms after the failure, before its 20 s backoff"
        );
        assert!(
            waited < 21_000,
            "the backoff restarted at the reopen: {waited} ms"
        );
    });
}

#[test]
fn a_wait_for_timeout_cut_by_a_restart_keeps_its_deadline() {
    paused(async {
        let sim = Arc::new(SimStorage::new(2));
        let clock = Arc::new(TokioClock {
            origin: tokio::time::Instant::now(),
        });
        let marks: Marks = Arc::default();
        let engine = open(&sim, &clock, &marks, 1);
        engine.start(W, "r", &1).await.unwrap();
        // 10 s into its 30 s wait the engine dies; it is down for 5 s.
        run_for(Duration::from_secs(10)).await;
        die(engine, &sim);
        run_for(Duration::from_secs(5)).await;
        let engine = open(&sim, &clock, &marks, 2);
        let got = engine.start(W, "r", &1).await.unwrap().result().await;
        assert_eq!(got.unwrap(), "None", "timed out, no signal");
        let m = marks.lock().unwrap().clone();
        let began = m.iter().find(|(w, _)| *w == "waiting").unwrap().1;
        let ended = m.iter().find(|(w, _)| *w == "waited").unwrap().1;
        let waited = ended - began;
        assert!(waited >= 30_000, "timed out after {waited} ms, before 30 s");
        assert!(
            waited < 31_000,
            "the timeout restarted at the reopen: {waited} ms"
        );
    });
}
