//! A run's life on its shard: take a place, run the workflow's code generation after
//! generation, journal how each generation ended (finished, failed, cancelled,
//! continued as new) or park the run, and settle its status once that is durable.

use crate::api::{FlowError, RunStatus};
use crate::ctx::Ctx;
use crate::job::{Handler, Job, next_start};
use crate::journal::{Entry, Json, Outcome, RECORD_KIND};
use crate::replay::{Replay, Slot};
use crate::run::{Place, RunCtx};
use crate::shared::Shared;
use ferry_core::sync::lock;
use std::rc::Rc;
use std::sync::Arc;

/// Run (or resume) one run to its end on this shard, generation after generation.
///
/// The job comes boxed: an async fn keeps its arguments for its whole life, and a run
/// parked for days should not keep a copy of its start.
pub(crate) async fn run_job(shared: Arc<Shared>, mut job: Box<Job>) {
    let places = shared
        .lane(shared.shard_of(&job.run))
        .starts
        .running
        .clone();
    let place = Rc::new(Box::pin(Place::take(places, &*shared)).await);
    loop {
        // Moved out whole, so the box is freed here (a destructuring pattern would move
        // the fields out and keep the box until the loop comes round).
        let unboxed: Job = {
            let b = job;
            *b
        };
        let Job {
            run,
            generation,
            replay,
            input,
            handler,
            last,
        } = unboxed;
        let ctx = Ctx::new(RunCtx::new(
            shared.clone(),
            place.clone(),
            (run, generation),
            replay,
            last,
        ));
        let result = handler(ctx.clone(), input).await;
        // What follows the code is boxed: while the code waits (a run parked for days),
        // the task holds only the state above.
        match Box::pin(end_generation(&shared, ctx, handler, result)).await {
            Some(next) => job = Box::new(next),
            None => return,
        }
    }
}

/// Journal how a generation ended; the next generation's job if it continued as new.
async fn end_generation(
    shared: &Arc<Shared>,
    ctx: Ctx,
    handler: Handler,
    result: Result<Json, FlowError>,
) -> Option<Job> {
    let run = ctx.run();
    // A run that met its shard's fence ends here, journaling nothing, whatever its code
    // made of the error: it resumes where the shard is held next.
    if run.fenced.get() {
        return None;
    }
    // A mismatch with the journal parks the run whatever the code made of the error
    // (caught it, mapped it, returned something else).
    if let Err(n) = run.replay.borrow().check() {
        shared.park(run, n.to_string());
        return None;
    }
    let mut outcome = match result {
        // Not journaled: after every restart the run replays up to the same call (no
        // step body runs while replaying) and parks again, until a deploy takes the
        // recorded path and it resumes by itself (or it is cancelled).
        Err(FlowError::Nondeterminism(n)) => {
            shared.park(run, n.to_string());
            return None;
        }
        // The log refuses writes: nothing more can be journaled for this run in this
        // process (the journal noted the failure for its callers); it resumes after a
        // restart.
        Err(FlowError::Log(_)) => return None,
        Err(FlowError::Stopped) => return None,
        Err(FlowError::ContinuedAsNew) => match run.next_input.borrow_mut().take() {
            Some(input) => match next_generation(shared, run, handler, input) {
                Ok(job) => {
                    shared.counters.continued();
                    return Some(job);
                }
                Err(FlowError::Log(_)) => return None,
                Err(e) => Outcome::Err(e.to_string()),
            },
            None => Outcome::Err(
                "the workflow returned ContinuedAsNew without calling ctx.continue_as_new".into(),
            ),
        },
        Ok(v) => Outcome::Ok(v),
        Err(FlowError::Cancelled) => Outcome::Cancelled,
        Err(e) => Outcome::Err(e.to_string()),
    };
    // (Bound before matching: `park` borrows the replay again.)
    let finish = run.replay.borrow_mut().finish().map(|slot| match slot {
        Slot::Fresh { pos } => Some(pos),
        Slot::Recorded { .. } => None,
    });
    let pos = match finish {
        Ok(pos) => pos,
        Err(n) => {
            // The code returned while its journal holds more calls: parked, as above.
            shared.park(run, n.to_string());
            return None;
        }
    };
    if let Some(pos) = pos {
        let mut finished = Entry::Finished { outcome };
        match run.append(Some(pos), &finished) {
            Ok(()) => {}
            Err(e @ FlowError::LimitExceeded { .. }) => {
                finished = Entry::Finished {
                    outcome: Outcome::Err(format!("the run's output: {e}")),
                };
                if run.append(Some(pos), &finished).is_err() {
                    return None;
                }
            }
            // The journal failed (and noted it for the run's callers), or the engine
            // is stopping.
            Err(_) => return None,
        }
        let Entry::Finished { outcome: o } = finished else {
            unreachable!("built as Finished above")
        };
        outcome = o;
    }
    // A result leaves the process only once its record is durable, and while its
    // shard is this process's to act for (docs/flow-server.md §5.3).
    if crate::durable::durable(&run.journal, run.last.get())
        .await
        .is_ok()
        && run.journal.may_act()
    {
        shared.settle(&run.run, RunStatus::Finished(outcome));
    }
    None
}

/// End this generation with `ContinuedAsNew` and start the next with `input`.
fn next_generation(
    shared: &Shared,
    run: &RunCtx,
    handler: Handler,
    input: Json,
) -> Result<Job, FlowError> {
    let finish = run.replay.borrow_mut().finish().map(|slot| match slot {
        Slot::Fresh { pos } => Some(pos),
        Slot::Recorded { .. } => None,
    });
    let pos = finish?;
    if let Some(pos) = pos {
        run.append(
            Some(pos),
            &Entry::ContinuedAsNew {
                input: input.clone(),
            },
        )?;
    }
    let (workflow, parent) = {
        let runs = lock(&shared.runs);
        // Gone only on a worker whose shard was just lost (its runs are forgotten while
        // its thread stops): the run goes on wherever the shard is held next.
        let Some(e) = runs.get(&run.run) else {
            run.fenced.set(true);
            return Err(run.fence());
        };
        (e.workflow, e.parent().cloned())
    };
    let next = next_start(
        &run.run,
        run.generation + 1,
        workflow,
        &input,
        parent,
        run.consumed.borrow().clone(),
        run.cancel_seen.get(),
    );
    let bytes = next.encode();
    shared.check_payload(bytes.len())?;
    let last = run.journal.append(RECORD_KIND, &bytes)?;
    if let Some(e) = lock(&shared.runs).get_mut(&run.run) {
        e.generation = run.generation + 1;
    }
    Ok(Job {
        run: run.run.clone(),
        generation: run.generation + 1,
        replay: Replay::new([next]),
        input,
        handler,
        last,
    })
}
