//! What a user sees when the journal on disk is damaged. A record damaged before records
//! that were durable is not a torn write: the engine refuses to open, names the segment
//! and byte and what to do, and changes nothing on disk. A torn tail (the last write cut
//! short by a crash) is cut, and the runs it held resume from what was durable.

use ferry_core::error::{Class, Classify};
use ferry_flow::{Ctx, Engine, FlowError, RunStatus, Signal, Workflow};
use ferry_testkit::Scratch;
use std::path::{Path, PathBuf};

static CHAIN: Workflow<u32, u32> = Workflow::new("chain");
static GO: Signal<u32> = Signal::new("go");

fn open(dir: &Path) -> Result<Engine, FlowError> {
    Engine::builder(dir)
        .register(CHAIN, |ctx: Ctx, n: u32| async move {
            let a: u32 = ctx.step("a", |_| async move { Ok(n + 1) }).await?;
            let b = ctx.wait_for(GO, None).await?.unwrap_or(0);
            Ok(a + b)
        })
        .open()
}

fn segment(dir: &Path) -> PathBuf {
    let mut segs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    segs.sort();
    assert_eq!(segs.len(), 1, "one segment at this size");
    segs.remove(0)
}

/// Runs 0..n started and waiting for their signal, and the log's end when it closed.
async fn journal_of_waiting_runs(dir: &Path, n: u32) -> u64 {
    let engine = open(dir).unwrap();
    for i in 0..n {
        engine.start(CHAIN, &format!("r{i}"), &i).await.unwrap();
    }
    // Every run journaled its step and its wait (3 records each) and they are durable.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while engine.log_stats().records < 3 * u64::from(n) || {
        let s = engine.log_stats();
        s.durable < s.end
    } {
        assert!(std::time::Instant::now() < deadline, "runs did not settle");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    engine.log_stats().end
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_before_durable_records_refuses_to_open_and_changes_nothing() {
    let scratch = Scratch::new("flow-damage");
    let dir = scratch.dir("flow");
    let end = journal_of_waiting_runs(&dir, 20).await;
    // A durable batch after them, whatever size the group commit made theirs: the damage
    // below is then before durable records, never in the last batch (a torn tail).
    {
        let engine = open(&dir).unwrap();
        engine.start(CHAIN, "after", &0).await.unwrap();
    }
    let seg = segment(&dir);
    let mut bytes = std::fs::read(&seg).unwrap();
    let at = (end / 3) as usize;
    bytes[at] ^= 0x10;
    std::fs::write(&seg, &bytes).unwrap();

    let err = match open(&dir) {
        Err(e) => e,
        Ok(_) => panic!("a damaged journal opened"),
    };
    let msg = err.to_string();
    let name = seg.file_name().unwrap().to_str().unwrap();
    assert!(msg.contains("the log is damaged"), "{msg}");
    assert!(msg.contains(&format!("{name} at byte")), "{msg}");
    assert!(msg.contains("restore the log from a copy"), "{msg}");
    match &err {
        FlowError::Log(e) => assert_eq!(e.class(), Class::Corrupted),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        std::fs::read(&seg).unwrap(),
        bytes,
        "a refused open changes nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_tail_is_cut_and_the_runs_resume() {
    let scratch = Scratch::new("flow-torn");
    let dir = scratch.dir("flow");
    let end = journal_of_waiting_runs(&dir, 5).await;
    // A batch cut short by the crash: bytes after the durable end that are not zeroes
    // and do not make a valid batch.
    let seg = segment(&dir);
    let mut bytes = std::fs::read(&seg).unwrap();
    for b in &mut bytes[end as usize..end as usize + 100] {
        *b = 0xab;
    }
    std::fs::write(&seg, &bytes).unwrap();

    let engine = open(&dir).unwrap();
    assert_eq!(engine.recovery().resumed, 5);
    for i in 0..5 {
        assert_eq!(engine.status(&format!("r{i}")), Some(RunStatus::Running));
        engine.signal(&format!("r{i}"), GO, &100).await.unwrap();
    }
    for i in 0..5u32 {
        let out = engine
            .run::<u32>(&format!("r{i}"))
            .unwrap()
            .result()
            .await
            .unwrap();
        assert_eq!(out, i + 1 + 100);
    }
}

/// A run whose journal lacks its start record (only damage or a bug leaves that) parks
/// with that reason; a cancel ends it, and it stays ended after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_without_its_start_record_parks_and_a_cancel_ends_it() {
    use ferry_flow::journal::{Entry, RECORD_KIND, Record};
    let scratch = Scratch::new("flow-no-start");
    let dir = scratch.dir("flow");
    {
        let (log, _) = ferry_log::Log::open_dir(&dir, ferry_log::Config::default()).unwrap();
        let orphan = Record {
            run: "orphan".into(),
            generation: 0,
            pos: Some(1),
            entry: Entry::TimerFired,
        };
        log.append(RECORD_KIND, &orphan.encode()).unwrap();
        log.close().unwrap();
    }
    let engine = open(&dir).unwrap();
    assert!(
        matches!(engine.status("orphan"), Some(RunStatus::Parked(r)) if r.contains("no start record")),
        "{:?}",
        engine.status("orphan")
    );
    assert!(engine.cancel("orphan").await.unwrap());
    assert!(matches!(
        engine.status("orphan"),
        Some(RunStatus::Finished(ferry_flow::Outcome::Cancelled))
    ));
    drop(engine);
    let engine = open(&dir).unwrap();
    assert!(matches!(
        engine.status("orphan"),
        Some(RunStatus::Finished(ferry_flow::Outcome::Cancelled))
    ));
}
