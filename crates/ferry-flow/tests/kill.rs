//! A process running hundreds of workflows is SIGKILLed again and again; each step
//! appends a line to an external ledger (fsynced) before it returns. After the last
//! restart every run has finished with its result, every step ran, no step whose result
//! the log held after a kill (read back before the restart) ran again, and no step ran
//! again once a later step of its run had started: a later step starts only after the
//! earlier one's result is durable, so either would be an acknowledged step re-executed.

mod common;

use ferry_flow::{Ctx, Engine, Workflow};
use ferry_testkit::Scratch;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

static CHAIN: Workflow<u32, u32> = Workflow::new("chain");
const RUNS: u32 = 200;
const STEPS: u32 = 3;

fn ledger_line(ledger: &Path, line: &str) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(ledger)
        .unwrap();
    f.write_all(line.as_bytes()).unwrap();
    f.sync_data().unwrap();
}

/// The child side (this test binary, run again with FERRY_FLOW_CHILD_DIR set): (re)start
/// every run and wait for all of them.
fn child_runs_workflows(dir: PathBuf) {
    let ledger = dir.join("ledger");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let l = ledger.clone();
        // Small segments, compacted at every few kilobytes: the kills also land in the
        // middle of checkpoints and segment retirements.
        let engine = Engine::builder(dir.join("flow"))
            .log_config(ferry_log::Config {
                segment_bytes: 16 << 10,
                record_bytes_max: 4 << 10,
                ..Default::default()
            })
            .limits(ferry_flow::Limits {
                payload_bytes: 4 << 10,
                ..Default::default()
            })
            .compact_every(4 << 10)
            .compact_interval(Duration::ZERO)
            .register(CHAIN, move |ctx: Ctx, n: u32| {
                let l = l.clone();
                async move {
                    let mut acc = n;
                    for step in 0..STEPS {
                        let l = l.clone();
                        let run = ctx.run_id().to_string();
                        acc = ctx
                            .step(&format!("s{step}"), move |s| {
                                let line = format!("{run} {step} {}\n", s.key());
                                let l = l.clone();
                                async move {
                                    tokio::time::sleep(Duration::from_millis(1)).await;
                                    ledger_line(&l, &line);
                                    Ok(acc * 2 + 1)
                                }
                            })
                            .await?;
                    }
                    Ok(acc)
                }
            })
            .open()
            .unwrap();
        let mut handles = Vec::new();
        for i in 0..RUNS {
            handles.push(engine.start(CHAIN, &format!("r{i}"), &i).await.unwrap());
        }
        for (i, h) in handles.iter().enumerate() {
            let mut want = i as u32;
            for _ in 0..STEPS {
                want = want * 2 + 1;
            }
            assert_eq!(h.result().await.unwrap(), want, "run r{i}");
        }
        println!("all finished");
    });
}

/// The steps whose results the directory holds for runs a restart would replay (its
/// checkpoint's and its log's), read as the next open will find them.
fn durable_steps(dir: &Path) -> BTreeSet<(String, u32)> {
    common::steps_held(&ferry_flow::read_journal(dir).unwrap())
}

#[test]
fn steps_survive_repeated_sigkills() {
    if let Ok(dir) = std::env::var("FERRY_FLOW_CHILD_DIR") {
        return child_runs_workflows(PathBuf::from(dir));
    }
    let scratch = Scratch::new("flow-kill");
    let dir = scratch.dir("work");
    let ledger = dir.join("ledger");
    let exe = std::env::current_exe().unwrap();
    let spawn = || {
        std::process::Command::new(&exe)
            .args(["--exact", "steps_survive_repeated_sigkills", "--nocapture"])
            .env("FERRY_FLOW_CHILD_DIR", &dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    let lines = || {
        std::fs::read_to_string(&ledger)
            .map(|s| s.lines().count())
            .unwrap_or(0)
    };
    // After each kill, how long the ledger was and which step results the log held.
    let mut settled = Vec::new();
    for round in 1..=3 {
        let mut child = spawn();
        let deadline = Instant::now() + Duration::from_secs(60);
        while lines() < round * 120 && Instant::now() < deadline {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        settled.push((lines(), durable_steps(&dir.join("flow"))));
    }
    let child = spawn();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("all finished"),
        "the last run failed: {stdout}"
    );

    let text = std::fs::read_to_string(&ledger).unwrap();
    let all: Vec<&str> = text.lines().collect();
    for (from, held) in &settled {
        for line in &all[*from..] {
            let mut f = line.split(' ');
            let (run, step) = (f.next().unwrap(), f.next().unwrap().parse::<u32>().unwrap());
            assert!(
                !held.contains(&(run.to_string(), step)),
                "{run}: step {step} ran again though the log held its result"
            );
        }
    }
    let mut by_run: BTreeMap<&str, Vec<u32>> = BTreeMap::new();
    for line in text.lines() {
        let mut f = line.split(' ');
        let (run, step, key) = (
            f.next().unwrap(),
            f.next().unwrap().parse::<u32>().unwrap(),
            f.next().unwrap(),
        );
        assert_eq!(
            key,
            format!("{run}/0/{}", step + 1),
            "a step's key is stable"
        );
        by_run.entry(run).or_default().push(step);
    }
    assert_eq!(by_run.len(), RUNS as usize);
    let mut reruns = 0;
    for (run, steps) in &by_run {
        for w in steps.windows(2) {
            assert!(
                w[1] >= w[0],
                "{run}: step {} ran again after step {} had started: {steps:?}",
                w[1],
                w[0]
            );
            reruns += usize::from(w[1] == w[0]);
        }
        for s in 0..STEPS {
            assert!(steps.contains(&s), "{run}: step {s} never ran");
        }
    }
    // Steps cut short by a kill may run again (at most once per kill each); report it.
    let flow = std::fs::read_dir(dir.join("flow"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect::<Vec<_>>();
    let checkpoints = flow.iter().filter(|n| n.starts_with("checkpoint-")).count();
    let segments = flow.iter().filter(|n| n.ends_with(".seg")).count();
    assert_eq!(checkpoints, 1, "compaction ran and cleaned up: {flow:?}");
    let held: Vec<usize> = settled.iter().map(|(_, h)| h.len()).collect();
    eprintln!(
        "{} ledger lines, {reruns} re-executions of steps cut short; {segments} segments \
         left; step results held for the runs each restart replayed: {held:?}",
        text.lines().count()
    );
}
