//! W3's trace: where a sampled workflow's latency goes, stage by stage, from its own
//! timestamps (arrival, start, each step body) and the log writer's cycles
//! (`Engine::trace_log_cycles`). One arrival in `--trace-every` runs this workflow in
//! place of the plain chain; everything else about the point is the same.

use ferry_flow::{Ctx, FlowError, Workflow};
use ferry_log::Cycle;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub static TRACED: Workflow<(u32, u64), u32> = Workflow::new("traced-chain");

/// Every traced body: (arrival, when it began, when it ended). Its result record is
/// appended just after it ends.
static BODIES: Mutex<Vec<(u64, Instant, Instant)>> = Mutex::new(Vec::new());

/// The writer's cycles each point traced (megabytes), kept until the process ends, as
/// W3 keeps its other large buffers (see `w3`).
static KEPT: Mutex<Vec<Vec<Cycle>>> = Mutex::new(Vec::new());

/// Keep `cycles` until the process ends.
pub fn keep(cycles: Vec<Cycle>) {
    KEPT.lock().expect("kept").push(cycles);
}

/// Room for `bodies` marks, made and touched before the point: growing the vector, or
/// faulting in its pages, during it would stall a shard's thread.
pub fn prepare(bodies: usize) {
    let mut b = BODIES.lock().expect("bodies");
    let t = Instant::now();
    b.clear();
    b.resize(bodies, (0, t, t));
    b.clear();
}

/// W3's chain, each step body marked.
pub async fn traced_chain(ctx: Ctx, (steps, id): (u32, u64)) -> Result<u32, FlowError> {
    for _ in 0..steps {
        let out: String = ctx
            .step("noop", move |_| async move {
                let begun = Instant::now();
                let out = super::PAYLOAD.to_string();
                BODIES
                    .lock()
                    .expect("bodies")
                    .push((id, begun, Instant::now()));
                Ok(out)
            })
            .await?;
        assert_eq!(out.len(), 64, "a step returns its payload");
    }
    Ok(steps)
}

/// A traced arrival as its client saw it.
#[derive(Clone, Copy)]
pub struct Run {
    pub id: u64,
    /// When it was due (its latency counts from here).
    pub due: Instant,
    /// `engine.start` called, returned (its start record durable), `result` returned.
    pub called: Instant,
    pub started: Instant,
    pub done: Instant,
}

/// Stage durations, gathered.
#[derive(Default)]
struct Stages(BTreeMap<&'static str, Vec<Duration>>);

impl Stages {
    fn add(&mut self, stage: &'static str, d: Duration) {
        self.0.entry(stage).or_default().push(d);
    }

    fn report(self) -> Value {
        let mut out = serde_json::Map::new();
        for (stage, v) in self.0 {
            let mean = v.iter().sum::<Duration>().as_secs_f64() * 1e6 / v.len().max(1) as f64;
            let mut s = super::spread(v);
            s["mean_us"] = json!(mean);
            out.insert(stage.into(), s);
        }
        Value::Object(out)
    }
}

/// Where the traced runs due at or after `from` spent their time. For each step, the
/// gap from its body's end to the next body's start is cut at the moments of the cycle
/// that took its record (the first whose `taken` is after the body ended):
///
/// - `behind`: a cycle was under way when the record came; it waited for it to end;
/// - `follow`: the writer's wait for the shards the last sync woke;
/// - `take`: from there to the batches taken (the writer asleep, woken by the append);
/// - `sync`: the write and fdatasync;
/// - `wake`: from the sync's end to the next body running (publishing, waking the
///   shard, the shard's poll of every run that sync made durable).
///
/// `cycles_skipped`: how many cycles ran between the one that took a step's record and
/// the one that took the next step's (0: each record rode the sync right after the one
/// that woke its run, as an ideal group-commit engine's does). `unmatched`: runs that
/// began before the oldest cycle kept, and steps matched to a cycle no later than their
/// predecessor's; left out.
pub fn stages(runs: &[Run], cycles: &[Cycle], from: Instant, steps: u32) -> Value {
    let mut bodies: BTreeMap<u64, Vec<(Instant, Instant)>> = BTreeMap::new();
    for &(id, begun, ended) in BODIES.lock().expect("bodies").iter() {
        bodies.entry(id).or_default().push((begun, ended));
    }
    let cover = |t: Instant| {
        let i = cycles.partition_point(|c| c.taken < t);
        (i < cycles.len()).then_some(i)
    };
    let mut st = Stages::default();
    let mut skipped = BTreeMap::<usize, u64>::new();
    let (mut traced, mut unmatched) = (0, 0);
    // A run that began before the oldest cycle kept (the trace let go of older ones)
    // cannot be matched: every record of it would seem taken by that cycle.
    let kept_from = cycles.first().map(|c| c.began);
    for r in runs.iter().filter(|r| r.due >= from) {
        let Some(b) = bodies.get(&r.id).filter(|b| b.len() == steps as usize) else {
            continue;
        };
        if kept_from.is_none_or(|k| r.called < k) {
            unmatched += 1;
            continue;
        }
        traced += 1;
        st.add(
            "run: due to start called",
            r.called.saturating_duration_since(r.due),
        );
        st.add("run: start called to returned", r.started - r.called);
        st.add(
            "run: last body to result",
            r.done.saturating_duration_since(b[b.len() - 1].1),
        );
        st.add("run: total", r.done - r.due);
        let mut prev = cover(r.called);
        if let Some(c) = prev {
            st.add(
                "run: start synced to first body",
                b[0].0.saturating_duration_since(cycles[c].synced),
            );
        }
        for k in 0..b.len() - 1 {
            let (end, next) = (b[k].1, b[k + 1].0);
            let Some(ci) = cover(end) else { break };
            let c = &cycles[ci];
            st.add("step: total (body to next body)", next - b[k].0);
            st.add("step: behind", c.began.saturating_duration_since(end));
            let at = end.max(c.began);
            st.add("step: follow", c.followed.saturating_duration_since(at));
            st.add(
                "step: take",
                c.taken.saturating_duration_since(at.max(c.followed)),
            );
            st.add("step: sync", c.synced - c.taken);
            st.add("step: wake", next.saturating_duration_since(c.synced));
            // A step's body runs after the cycle that took the step before it: a later
            // cycle takes its record, unless it was stamped in the microseconds before
            // its append and a take fell between (counted apart).
            match prev.and_then(|p| ci.checked_sub(p + 1)) {
                Some(n) => *skipped.entry(n.min(3)).or_default() += 1,
                None if prev.is_some() => unmatched += 1,
                None => {}
            }
            prev = Some(ci);
        }
    }
    let mut writer = Stages::default();
    let window: Vec<&Cycle> = cycles.iter().filter(|c| c.began >= from).collect();
    for c in &window {
        writer.add("follow", c.followed - c.began);
        writer.add("idle", c.taken - c.followed);
        writer.add("sync", c.synced - c.taken);
        writer.add("wake", c.woke - c.synced);
    }
    let secs = window
        .first()
        .zip(window.last())
        .map_or(0.0, |(a, b)| (b.woke - a.began).as_secs_f64());
    let n: u64 = skipped.values().sum();
    json!({
        "traced_runs": traced,
        "unmatched": unmatched,
        "stages": st.report(),
        "cycles_skipped": skipped.iter().map(|(k, v)| (if *k == 3 { "3+".to_string() } else { k.to_string() }, json!(*v as f64 / n.max(1) as f64))).collect::<serde_json::Map<_, _>>(),
        "writer": {"cycles": window.len(), "cycles_per_sec": window.len() as f64 / secs.max(1e-9), "stages": writer.report()},
    })
}
