//! ferry-flow's benchmark harness (bench/flow/run drives it; workloads from §5.3 of
//! shared/research/flow.md). Every subcommand prints one JSON line on stdout. Every step
//! is a no-op returning the same 64-byte string; every engine lives in a fresh directory
//! under `--dir`, which must be on the disk being measured.
//!
//!   server --dir D [--n 2000] [--pipelined 100000] [--bytes 100]
//!       Server mode's journal path without an engine (docs/flow-server.md §6): a
//!       `ferry flow serve` server in this process on a Unix socket, and the worker's
//!       shard stream (`ferry_flow::remote::worker`) appending records of B bytes.
//!       Serial: n times, append one record and wait for the server's acknowledgement;
//!       beside it, the same on a ferry-log in the same directory (append, durable):
//!       p50/p99 of each and the difference. Pipelined: that many records appended
//!       at once, records/s until the last is acknowledged, and the server log's
//!       records per sync.
//!   remote --dir D [--transport unix|tcp] [--workers 1] [--shards 4] [--steps 1000]
//!          [--n 10000] [--wsteps 10] [--follow-us N] [--replicate NATS_URLS]
//!       W1 and W2 through a server (docs/flow-server.md; with --replicate, its log kept
//!       in a fresh JetStream stream of three replicas too): a `ferry flow serve` server
//!       in this process (its own runtime) on a Unix socket or TCP on 127.0.0.1, and
//!       K engines in this process opened as its workers, each run started on the worker
//!       holding its shard; beside it, the same on an embedded engine with as many
//!       shards in the same directory. W1: one workflow of `steps` sequential steps, the
//!       gap between step completions (p50/p99); W2: n workflows of `wsteps` steps
//!       started at once, steps/s and syncs per 1,000 steps (the server's log's syncs
//!       over a worker, the engine's own log's embedded). `--follow-us`: the server
//!       log's `Config::follow` (how long its writer waits, after a sync, for the
//!       workers it acknowledged to send their next appends), 0 as `ferry flow serve`
//!       if absent.
//!   takeover --dir D [--shards 4] [--runs 1000] [--trials 20] [--lease-ms 1000]
//!            [--ping-ms 200]
//!       Takeover after a worker's SIGKILL (docs/flow-server.md §2.4): a server in this
//!       process, a worker engine in this process and a worker child process
//!       (`takeover-child`) that starts `runs` unfinished runs (parked in `wait_for`) on
//!       each shard it holds. Per trial: SIGKILL the child, and time until this
//!       process's worker holds every shard and has recovered every run; p50/p99 over
//!       the trials, against the bound lease + 1 s.
//!   floor --dir D [--n 2000]
//!       Overwrite 4 KiB of a zero-filled file and fdatasync it, n times at consecutive
//!       offsets: the pattern of ferry-log's writer (it writes over zeroes laid ahead, so
//!       a sync carries the data alone). p50/p99/p999 in µs.
//!   w1 --dir D [--steps 1000] [--shards S]
//!       The floor, then one workflow of K sequential steps: the gap between consecutive
//!       step completions as the workflow sees them, and its ratio to the floor's p50.
//!   w2 --dir D [--n 10000] [--steps 10] [--shards S] [--rounds 1] [--follow-us N]
//!       N workflows started at once: steps/s, workflows/s, the log's records per sync and
//!       syncs per 1,000 steps, CPU-seconds per 1,000 steps (getrusage, whole process).
//!       With rounds > 1, the same engine runs the load that many times and the last is
//!       measured; the earlier rounds' steps/s and CPU are listed too. `--follow-us`
//!       sets the log's `Config::follow` (how long its writer waits after a sync for
//!       the shards it woke), its default if absent.
//!   w3 --dir D --max-rate R [--fractions 0.25,0.5,0.8,0.95] [--seconds 5] [--steps 10]
//!      [--warmup 1] [--tick-us T] [--dump PREFIX] [--shards S] [--follow-us N] [--fresh 1]
//!      [--trace-every 20]
//!      [--steady-disk-us B [--steady-disk-ns-per-kib 350]]
//!       Open-loop arrivals at each fraction of R workflows/s (an engine each), kept
//!       by a clock thread that wakes at most every tick, for warmup + seconds: latency
//!       from the scheduled arrival to the result, p50/p99, of the arrivals after the
//!       warm-up (those during it reported apart), CPU per 1,000 steps and each thread's
//!       share of a core (the clock's own as `w3-clock`). First, the disk alone:
//!       sums of steps+1 consecutive 4 KiB fdatasyncs (the floor's pattern, for as long as
//!       a point is measured and at least --chain-n syncs, 16,000 by default), p50/p99:
//!       the spread of a workflow's chain of syncs with no engine; and, on the same
//!       syncs, the open-loop latency of an ideal group-commit engine (see
//!       `ideal_engine`). As long as a point, so that it meets what a point meets.
//!       Before that, each point's engine directory is aged (`age`: bursts, then one
//!       compaction, so the point's segments are made from retired ones, as in a
//!       long-running engine), unless `--fresh 1` (a new engine's log, every segment
//!       created as it fills); each point reports what aging did as `aged`.
//!       `--steady-disk-us B`: the engine's files reached through `SteadyDisk`, each
//!       sync taking B µs plus its size's share (for a --dir on tmpfs: a disk that
//!       never stalls).
//!       Its heap (mimalloc) keeps the pages it frees (`keep_freed_pages`) unless
//!       `FERRY_BENCH_PURGE=1`.
//!       One arrival in `--trace-every` (20; 0: none) runs the chain with each step
//!       body timestamped, and the log's writer records its cycles: each point's
//!       `trace` says where those runs' time went, stage by stage (`trace.rs`).
//!       `--tick-us`: 250 on up to 4 CPUs, 50 on more. `--shards` (w1, w2, w3): the
//!       engine's default (`ferry_flow::default_shards`, half the CPUs) if absent.
//!       `--max-running N|none` (w2, w3 and what opens their engine): the engine's
//!       `max_running` per shard, its default if absent.
//!       Before the first point it waits for the host to take back the memory freed so
//!       far (`settle_host`), and reports each point's `host_steal_ms`: time the host
//!       did not run this VM while it wanted to run; `machine_busy_cores`, the CPU
//!       time the whole machine spent running anything over the point's length; and
//!       per thread, how long it waited runnable for a CPU (`run_queue`); and
//!       `disk_stalls`, the stretches of 2 ms or more in which the disk under --dir
//!       completed nothing while requests were in flight (`DiskWatch`). `--dump
//!       PREFIX` writes every arrival's time, latency and start latency to PREFIX.<percent>
//!       (`dump_arrivals`).
//!   w4 --dir D [--n 1000] [--sleep-ms 1000]
//!       N workflows each sleep, then run one step: how late the sleep returned, and how
//!       late the step after it finished, p50/p99.
//!   w5 --dir D [--n 1000] [--timeout-ms 60000]
//!       N runs parked in `wait_for`; one at a time: signal, then await the run's result
//!       (a step echoing the signal, durable): round trip p50/p99.
//!   w6 --dir D [--n 1000] [--steps 10] [--kill-at 0.4]
//!       A child process (`w6-child`) runs the load, each step appending its key to an
//!       fsynced ledger; SIGKILL once kill-at of the steps ran. Then this process reads
//!       which step results the log holds durably, opens the engine (recovery), restarts
//!       every run and reports open-to-first-step and open-to-all-finished, the steps run
//!       again (allowed: cut short) and the acknowledged steps run again (must be 0).
//!   idle --dir D [--n 10000]
//!       N runs parked in `wait_for` with no timeout: RSS growth per run.

use ferry_flow::journal::{Entry, RECORD_KIND, Record};
use ferry_flow::{Ctx, Engine, EngineBuilder, FlowError, Signal, Workflow};
use serde_json::{Value, json};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

mod trace;

/// Every step's result: 64 bytes, the size §5.3 fixes for every system.
const PAYLOAD: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
const _: () = assert!(PAYLOAD.len() == 64);

static CHAIN: Workflow<u32, u32> = Workflow::new("chain");
static NAP: Workflow<u64, u32> = Workflow::new("nap");
static ECHO: Workflow<u32, String> = Workflow::new("echo");
static PARK: Workflow<u32, u32> = Workflow::new("park");
static PING: Signal<String> = Signal::new("ping");

/// Counts live heap bytes while `idle` measures (off otherwise: one relaxed load per
/// allocation), so idle memory is reported both as RSS growth, which depends on the
/// allocator's fragmentation, and as what the engine holds.
struct Counting;
static COUNTING: AtomicBool = AtomicBool::new(false);
static LIVE: AtomicI64 = AtomicI64::new(0);

/// The heap is mimalloc's, as a Rust service tuned for throughput would link it; with
/// `FERRY_BENCH_MALLOC=system` it is the C library's malloc. Under glibc's malloc the
/// engine needs about a third more CPU per step once the heap holds finished runs
/// (`w2 --rounds`). Decided at the first allocation, reading the environment without
/// allocating.
fn system_malloc() -> bool {
    static CHOICE: AtomicU8 = AtomicU8::new(0);
    match CHOICE.load(Relaxed) {
        1 => true,
        2 => false,
        _ => {
            // SAFETY: getenv returns null or a NUL-terminated string that lives as long
            // as the environment, which nothing here changes; it does not allocate.
            let system = unsafe {
                let v = libc::getenv(c"FERRY_BENCH_MALLOC".as_ptr());
                !v.is_null() && std::ffi::CStr::from_ptr(v) == c"system"
            };
            CHOICE.store(if system { 1 } else { 2 }, Relaxed);
            system
        }
    }
}

unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        if COUNTING.load(Relaxed) {
            LIVE.fetch_add(l.size() as i64, Relaxed);
        }
        // SAFETY: the caller's layout goes to the allocator unchanged.
        unsafe {
            if system_malloc() {
                std::alloc::System.alloc(l)
            } else {
                mimalloc::MiMalloc.alloc(l)
            }
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        if COUNTING.load(Relaxed) {
            LIVE.fetch_sub(l.size() as i64, Relaxed);
        }
        // SAFETY: `p` came from `alloc` above with this layout, and so from the same
        // allocator (the choice never changes).
        unsafe {
            if system_malloc() {
                std::alloc::System.dealloc(p, l)
            } else {
                mimalloc::MiMalloc.dealloc(p, l)
            }
        }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn main() {
    // No transparent huge pages, the setting Redis and MongoDB ask for: mimalloc asks
    // for them on its arenas, and the first touch of each fresh 2 MiB region then
    // zeroes it whole in one page fault, 1 to 5 ms on whichever thread allocates,
    // which showed in W3 as a stall every 100 to 300 ms. `FERRY_BENCH_THP=1` keeps
    // them.
    if std::env::var_os("FERRY_BENCH_THP").is_none_or(|v| v != "1") {
        // SAFETY: PR_SET_THP_DISABLE sets a flag of this process; no memory is passed.
        unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1 as libc::c_ulong, 0, 0, 0) };
    }
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).is_some_and(|a| a == "w3") && !system_malloc() {
        keep_freed_pages();
    }
    // Runtimes of its own (a server's, and one to wait on the worker's stream), so not
    // inside the client's.
    if args.get(1).is_some_and(|a| {
        matches!(
            a.as_str(),
            "server" | "remote" | "takeover" | "takeover-child"
        )
    }) {
        let out = match args[1].as_str() {
            "server" => server(&args),
            "remote" => remote(&args),
            "takeover" => takeover(&args),
            _ => takeover_child(&args),
        };
        match out {
            Ok(v) => println!("{v}"),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    // Timers only: without an I/O driver, a wake from the engine's threads finds this
    // thread through an atomic and costs a syscall only when it sleeps (with one, every
    // wake writes an eventfd), so the client costs the engine's two cores less.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a current-thread runtime builds");
    let local = tokio::task::LocalSet::new();
    let out = local.block_on(&rt, async {
        match args.get(1).map(String::as_str) {
            Some("floor") => floor(&args),
            Some("w1") => w1(&args).await,
            Some("w2") => w2(&args).await,
            Some("w3") => w3(&args).await,
            Some("w4") => w4(&args).await,
            Some("w5") => w5(&args).await,
            Some("w6") => w6(&args).await,
            Some("w6-child") => w6_child(&args).await,
            Some("idle") => idle(&args).await,
            _ => Err("usage: see the module doc of bench/flow/harness/src/main.rs".to_string()),
        }
    });
    match out {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn num<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    flag(args, name)
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `--dir`, created, with `sub` under it, which must not exist yet (a fresh engine).
fn fresh_dir(args: &[String], sub: &str) -> Result<PathBuf, String> {
    let base = PathBuf::from(flag(args, "--dir").ok_or("--dir DIR is required")?);
    let dir = base.join(sub);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| format!("clearing {}: {e}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    Ok(dir)
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The `p`th percentile of `sorted` (nearest rank), in µs.
fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn spread(mut v: Vec<Duration>) -> Value {
    v.sort();
    json!({"n": v.len(), "p50_us": pct(&v, 50.0), "p99_us": pct(&v, 99.0),
           "p999_us": pct(&v, 99.9), "max_us": pct(&v, 100.0)})
}

/// The no-op step every workload runs.
async fn noop(ctx: &Ctx) -> Result<String, FlowError> {
    ctx.step("noop", |_| async { Ok(PAYLOAD.to_string()) })
        .await
}

/// `steps` no-op steps; the output is how many ran.
async fn chain(ctx: Ctx, steps: u32) -> Result<u32, FlowError> {
    for _ in 0..steps {
        let out = noop(&ctx).await?;
        assert_eq!(out.len(), 64, "a step returns its payload");
    }
    Ok(steps)
}

/// The log's counters between two moments: what the workload cost the disk.
fn log_delta(before: ferry_log::Stats, after: ferry_log::Stats, steps: u64) -> Value {
    let records = after.records - before.records;
    let syncs = after.syncs - before.syncs;
    json!({
        "records": records,
        "batches": after.batches - before.batches,
        "syncs": syncs,
        "bytes_written": after.bytes_written - before.bytes_written,
        "segments": after.segments,
        "segments_reused": after.segments_reused - before.segments_reused,
        "records_per_sync": records as f64 / syncs.max(1) as f64,
        "steps_per_sync": steps as f64 / syncs.max(1) as f64,
        "syncs_per_1k_steps": syncs as f64 * 1000.0 / steps.max(1) as f64,
        "writer": writer_delta(&before, &after),
    })
}

/// The writer's cycles (write and sync) between two readings: how many, their p50 and
/// p99 (upper bounds of power-of-two buckets), how many took 1 ms or more, its busy
/// time, and the buckets themselves. What the disk gave the engine while it ran.
fn writer_delta(before: &ferry_log::Stats, after: &ferry_log::Stats) -> Value {
    let d = after.write_us.since(&before.write_us);
    let from_1ms = ferry_log::WriteHistogram::bucket(1024);
    json!({
        "cycles": d.count(),
        "p50_us_below": d.quantile_us(0.5),
        "p99_us_below": d.quantile_us(0.99),
        "cycles_1ms_or_more": d.counts[from_1ms..].iter().sum::<u64>(),
        "busy_secs": d.sum_us as f64 / 1e6,
        "cycles_by_log2_us": d.counts,
    })
}

/// User plus system CPU time of the whole process (every thread), in seconds.
fn cpu_seconds() -> f64 {
    rusage_seconds(libc::RUSAGE_SELF)
}

/// Page faults this process took so far: (minor, major).
fn page_faults() -> (i64, i64) {
    let ru = rusage(libc::RUSAGE_SELF);
    (ru.ru_minflt, ru.ru_majflt)
}

/// User plus system CPU time of `who` (RUSAGE_SELF or RUSAGE_THREAD), in seconds.
fn rusage_seconds(who: libc::c_int) -> f64 {
    let ru = rusage(who);
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// getrusage of `who`, RUSAGE_SELF or RUSAGE_THREAD.
fn rusage(who: libc::c_int) -> libc::rusage {
    // SAFETY: rusage is plain integers, for which all zeroes is a valid value.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage into the struct we own; `who` is one of the two
    // valid values above.
    let rc = unsafe { libc::getrusage(who, &mut ru) };
    assert_eq!(
        rc, 0,
        "getrusage cannot fail for RUSAGE_SELF or RUSAGE_THREAD"
    );
    ru
}

/// CPU-seconds so far of each live thread of this process, summed by thread name.
fn thread_cpu() -> BTreeMap<String, f64> {
    let mut by_name = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return by_name;
    };
    // SAFETY: sysconf only reads a constant of the system.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    for t in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        // "tid (name) state ..." where the name may hold spaces: split after the last ')'.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        let fields: Vec<&str> = stat[close + 2..].split(' ').collect();
        // Fields 14 and 15 of stat (utime, stime) are 11 and 12 after the name.
        let ticks = |i: usize| {
            fields
                .get(i)
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        *by_name.entry(name).or_insert(0.0) += (ticks(11) + ticks(12)) / tick;
    }
    by_name
}

/// What each thread spent between two [`thread_cpu`] readings, as a share of `secs`.
/// `gone`: a thread already joined, and its CPU-seconds.
fn thread_share(before: &BTreeMap<String, f64>, secs: f64, gone: (&str, f64)) -> Value {
    let mut after = thread_cpu();
    after.insert(gone.0.to_string(), gone.1);
    let share: BTreeMap<&String, f64> = after
        .iter()
        .map(|(k, v)| (k, (v - before.get(k).copied().unwrap_or(0.0)) / secs))
        .filter(|(_, v)| *v > 0.005)
        .collect();
    json!(share)
}

/// W3 only: mimalloc keeps the pages its heaps free rather than handing them back to
/// the kernel (`madvise`) a second after they empty, its default (`purge_delay`), unless
/// `FERRY_BENCH_PURGE=1`. With the default, a W3 point at 80% took about 63,000 page
/// faults (a page freed, handed back, touched again), 93% of them on the client
/// thread; kept, about 4,000. A guest that hands pages back also hands them to the
/// host (free page reporting; see `settle_host`), which on the VMs this bench was
/// built on stopped the VM for 10-30 ms at a time: in the middle of a point, as the
/// freeing in bulk between points did before W3 kept it until its end.
fn keep_freed_pages() {
    if std::env::var_os("FERRY_BENCH_PURGE").is_some_and(|v| v == "1") {
        return;
    }
    unsafe extern "C" {
        fn mi_option_get(option: libc::c_int) -> libc::c_long;
        fn mi_option_set(option: libc::c_int, value: libc::c_long);
    }
    // `mi_option_purge_delay` in mimalloc.h's `mi_option_e` (v2 and v3 alike); checked
    // against v3's default (its `options.c`: 1,000 ms; libmimalloc-sys builds v3).
    const PURGE_DELAY: libc::c_int = 15;
    // SAFETY: both read or write one of mimalloc's option values; no memory is passed.
    unsafe {
        assert_eq!(
            mi_option_get(PURGE_DELAY),
            1000,
            "mimalloc's purge_delay is not option 15 with its default of 1,000 ms: \
             update keep_freed_pages for this mimalloc"
        );
        mi_option_set(PURGE_DELAY, -1);
    }
}

/// Resident memory in bytes, after giving freed heap back to the kernel: what the live
/// objects hold, not what earlier temporaries left in malloc's free lists.
fn rss_bytes() -> Result<u64, String> {
    unsafe extern "C" {
        /// mimalloc's own: return this thread's free pages (and abandoned ones) to the OS.
        fn mi_collect(force: bool);
    }
    // SAFETY: both only release free heap pages; neither touches a live allocation.
    unsafe {
        if system_malloc() {
            libc::malloc_trim(0);
        } else {
            mi_collect(true);
        }
    }
    let statm = std::fs::read_to_string("/proc/self/statm").map_err(err)?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .ok_or("cannot read /proc/self/statm")?;
    Ok(pages * 4096)
}

/// The machine's CPU time so far, from /proc/stat summed over CPUs, in ms: what its
/// CPUs spent running anything (user, nice, system, irq and softirq: every process and
/// kernel thread, this one's too), and the host's take (`steal`: time the hypervisor
/// ran something else while this VM's vCPUs wanted to run). None off Linux.
fn machine_cpu_ms() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let f: Vec<f64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0.0))
        .collect();
    let [user, nice, system, _idle, _iowait, irq, softirq, steal, ..] = f[..] else {
        return None;
    };
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let ms = |ticks: f64| ticks * 1000.0 / hz;
    Some((ms(user + nice + system + irq + softirq), ms(steal)))
}

/// Per thread name (summed over threads of that name): nanoseconds on a CPU, nanoseconds
/// runnable but waiting for one, and times run, from /proc/self/task/*/schedstat.
fn schedstat() -> BTreeMap<String, [f64; 3]> {
    let mut by_name = BTreeMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return by_name;
    };
    for task in tasks.filter_map(Result::ok) {
        let read = |f: &str| std::fs::read_to_string(task.path().join(f)).unwrap_or_default();
        let v: Vec<f64> = read("schedstat")
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        if let [run, wait, slices] = v[..] {
            let e = by_name
                .entry(read("comm").trim().to_string())
                .or_insert([0.0; 3]);
            for (a, b) in e.iter_mut().zip([run, wait, slices]) {
                *a += b;
            }
        }
    }
    by_name
}

/// How long each thread waited runnable for a CPU over `secs`: seconds per second, and
/// µs per time it ran (a wake-up's wait, mostly). Its CPU time is `thread_share`'s.
fn run_queue(before: &BTreeMap<String, [f64; 3]>, secs: f64) -> Value {
    let now = schedstat();
    let mut out = serde_json::Map::new();
    for (name, v) in &now {
        let a = before.get(name).copied().unwrap_or([0.0; 3]);
        let (wait, slices) = (v[1] - a[1], v[2] - a[2]);
        out.insert(
            name.clone(),
            json!({"waiting": wait / 1e9 / secs, "wait_per_run_us": wait / 1e3 / slices.max(1.0)}),
        );
    }
    Value::Object(out)
}

/// Free page reporting: a guest hands memory it freed back to the host, in passes some
/// seconds later. On the machines this bench was built on, the whole VM was seen to
/// stop for 10-30 ms (no thread of any process running, the gap counted as `steal` in
/// /proc/stat) within tens of ms of a pass that handed back 100 MB or more. Their
/// kernels count the passes here.
const PAGE_REPORTING: &str = "/sys/module/page_reporting/parameters";

/// Wait, at most `max`, until the guest has made no reporting pass for `quiet`: memory
/// freed before a measurement (by an earlier process, or this one's own preparation)
/// goes back to the host before its clock starts rather than during it. Returns how
/// long it waited; zero where the kernel does not count its passes.
fn settle_host(quiet: Duration, max: Duration) -> Duration {
    let began = Instant::now();
    let read = || {
        std::fs::read_to_string(format!("{PAGE_REPORTING}/passes"))
            .ok()
            .zip(std::fs::read_to_string(format!("{PAGE_REPORTING}/reported_kib")).ok())
    };
    let Some(mut last) = read() else {
        return Duration::ZERO;
    };
    let mut since = Instant::now();
    while since.elapsed() < quiet && began.elapsed() < max {
        std::thread::sleep(Duration::from_millis(100));
        let now = read();
        if now.as_ref() != Some(&last) {
            last = now.unwrap_or_default();
            since = Instant::now();
        }
    }
    began.elapsed()
}

/// The disk's own stalls while a point runs, seen from the kernel's counters of the
/// block device under `dir` (/sys/dev/block/MAJ:MIN/stat), read every `DISK_WATCH_EVERY`
/// by a thread of its own: a stall is a stretch during which requests were in flight and
/// none completed (no read, write or flush). It adds no I/O of its own, so it does not
/// change what it watches. On one host this bench ran on (2026-12-02), the device stopped
/// for 5 ms to 1 s about once a second, at the same moments for every file (two threads
/// syncing a file each saw the same stalls): an engine's whole backlog waits them out,
/// and no engine that syncs can hide them.
struct DiskWatch {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(Vec<(Duration, Duration)>, f64)>,
    began: Instant,
}

const DISK_WATCH_EVERY: Duration = Duration::from_millis(1);
/// Shorter stretches are a request under way, not a stall: a W3 batch of tens of KB
/// writes and syncs in well under a millisecond here.
const DISK_STALL_MIN: Duration = Duration::from_millis(2);

impl DiskWatch {
    /// None where `dir`'s device has no counters (tmpfs, or not Linux).
    fn start(dir: &Path) -> Option<DiskWatch> {
        use std::os::unix::fs::MetadataExt;
        let dev = std::fs::metadata(dir).ok()?.dev();
        let path = format!(
            "/sys/dev/block/{}:{}/stat",
            libc::major(dev),
            libc::minor(dev)
        );
        let file = std::fs::File::open(&path).ok()?;
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let began = Instant::now();
        let thread = std::thread::Builder::new()
            .name("w3-disk-watch".into())
            .spawn(move || {
                // One pread per reading: the counters fit in far less than the buffer.
                let mut buf = [0u8; 512];
                // (completed requests, in flight), from the file's fields 1, 5, 16 and 9.
                let mut read = || -> Option<(u64, u64)> {
                    let n = file.read_at(&mut buf, 0).ok()?;
                    let f: Vec<u64> = std::str::from_utf8(&buf[..n])
                        .ok()?
                        .split_whitespace()
                        .map(|v| v.parse().unwrap_or(0))
                        .collect();
                    let at = |i: usize| f.get(i).copied().unwrap_or(0);
                    Some((at(0) + at(4) + at(15), *f.get(8)?))
                };
                let mut stalls = Vec::new();
                let (mut done, mut since) = (None, None::<Instant>);
                while !halt.load(Relaxed) {
                    let Some((completed, in_flight)) = read() else {
                        break;
                    };
                    let now = Instant::now();
                    if Some(completed) != done || in_flight == 0 {
                        if let Some(t) = since.filter(|t| now - *t >= DISK_STALL_MIN) {
                            stalls.push((t - began, now - t));
                        }
                        since = (in_flight > 0).then_some(now);
                        done = Some(completed);
                    } else if since.is_none() {
                        since = Some(now);
                    }
                    std::thread::sleep(DISK_WATCH_EVERY);
                }
                (stalls, rusage_seconds(libc::RUSAGE_THREAD))
            })
            .ok()?;
        Some(DiskWatch {
            stop,
            thread,
            began,
        })
    }

    /// The stalls seen, from the watch's start: how many, their sum and the longest in
    /// ms, and each (start, length) in ms; and the watch's own CPU in cores.
    fn stop(self) -> Value {
        self.stop.store(true, Relaxed);
        let secs = self.began.elapsed().as_secs_f64();
        let Ok((stalls, cpu)) = self.thread.join() else {
            return Value::Null;
        };
        let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
        json!({
            "watched_secs": secs,
            "stalls": stalls.len(),
            "stalled_ms": ms(stalls.iter().map(|s| s.1).sum()),
            "longest_ms": ms(stalls.iter().map(|s| s.1).max().unwrap_or_default()),
            "at_and_ms": stalls.iter().map(|&(at, d)| [ms(at), ms(d)]).collect::<Vec<_>>(),
            "watch_cores": cpu / secs,
        })
    }
}

fn measure_floor(dir: &Path, n: usize, at_least: Duration) -> Result<Vec<Duration>, String> {
    let path = dir.join("floor.dat");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(err)?;
    // Zeroes laid ahead and synced first, as ferry-log's writer does: the timed syncs
    // then change no file size or extent. Past n, the syncs go round the same blocks
    // again (allocated, so still no size or extent changes).
    (&f).write_all(&vec![0u8; n * 4096]).map_err(err)?;
    f.sync_all().map_err(err)?;
    let block = vec![0xa5u8; 4096];
    let mut lat = Vec::with_capacity(n);
    let began = Instant::now();
    while lat.len() < n || began.elapsed() < at_least {
        let t = Instant::now();
        f.write_all_at(&block, ((lat.len() % n) * 4096) as u64)
            .map_err(err)?;
        f.sync_data().map_err(err)?;
        lat.push(t.elapsed());
    }
    drop(f);
    std::fs::remove_file(&path).map_err(err)?;
    Ok(lat)
}

/// Open-loop latency of an ideal group-commit engine on this disk: one writer syncing
/// back to back (the syncs measured), no CPU time at all, each workflow's `k` records
/// each made durable by the first sync that starts after the one before it was durable.
/// Arrivals are spread evenly over the time the syncs took, so a sync that stalls for
/// 5 ms delays every arrival during it: what one stall does to an engine that shares
/// each sync among every workflow in flight, which the chain's sums (one sample per
/// sync, whatever its length) do not show.
fn ideal_engine(syncs: &[Duration], k: usize) -> Value {
    // ends[i]: when sync i completed, from the start of the first.
    let ends: Vec<Duration> = syncs
        .iter()
        .scan(Duration::ZERO, |t, d| {
            *t += *d;
            Some(*t)
        })
        .collect();
    if ends.len() <= k {
        return Value::Null;
    }
    // Arrivals up to the start of the sync that leaves room for k more.
    let span = ends[ends.len() - k - 1];
    let n = 20_000u32;
    let mut lat = Vec::with_capacity(n as usize);
    let mut j = 0; // the first sync starting at or after the arrival
    for i in 0..n {
        let t = span * i / n;
        // Sync j starts when sync j-1 ends (sync 0 at zero).
        while j < ends.len() && (if j == 0 { Duration::ZERO } else { ends[j - 1] }) < t {
            j += 1;
        }
        if j + k > ends.len() {
            break;
        }
        lat.push(ends[j + k - 1] - t);
    }
    spread(lat)
}

/// `server`: see the module doc.
fn server(args: &[String]) -> Result<Value, String> {
    use ferry_flow::remote::worker::{Event, Worker, WorkerSettings};
    let dir = fresh_dir(args, "server")?;
    let n: usize = num(args, "--n", 2000);
    let pipelined: u64 = num(args, "--pipelined", 100_000);
    let payload = vec![7u8; num(args, "--bytes", 100)];
    // ferry-log alone, in the same directory: the floor the server's path is compared with.
    let local = {
        let (log, _) = ferry_log::Log::open_dir(&dir.join("local"), ferry_log::Config::default())
            .map_err(err)?;
        let mut lat = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            let end = log.append(1, &payload).map_err(err)?;
            log.wait_durable(end).map_err(err)?;
            lat.push(t.elapsed());
        }
        lat
    };
    let serving = Serving::start(
        &dir,
        ferry_flow_server::server::Settings {
            shards: 1,
            ..Default::default()
        },
        ferry_log::Config::default(),
        false,
    )?;
    let server = &serving.server;
    let worker = Worker::connect(WorkerSettings::new(serving.addr.clone())).map_err(err)?;
    match worker.next_event(Duration::from_secs(10)) {
        Some(Event::Granted { shard: 0, .. }) => {}
        other => return Err(format!("no grant: {other:?}")),
    }
    let stream = worker.stream(0).ok_or("no stream")?;
    let waiter = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(err)?;
    let mut remote = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let end = ferry_flow::JournalLog::append(&*stream, 1, &payload).map_err(err)?;
        waiter
            .block_on(ferry_flow::JournalLog::durable(&*stream, end, None))
            .map_err(err)?;
        remote.push(t.elapsed());
    }
    let syncs0 = server.status().log.syncs;
    let t = Instant::now();
    let mut end = 0;
    for _ in 0..pipelined {
        end = ferry_flow::JournalLog::append(&*stream, 1, &payload).map_err(err)?;
    }
    waiter
        .block_on(ferry_flow::JournalLog::durable(&*stream, end, None))
        .map_err(err)?;
    let took = t.elapsed();
    let syncs = server.status().log.syncs - syncs0;
    drop(worker);
    let (mut l, mut r) = (local, remote);
    l.sort();
    r.sort();
    let out = json!({
        "workload": "server",
        "bytes": payload.len(),
        "serial": {
            "n": n,
            "local_p50_us": pct(&l, 50.0), "local_p99_us": pct(&l, 99.0),
            "server_p50_us": pct(&r, 50.0), "server_p99_us": pct(&r, 99.0),
            "added_p50_us": pct(&r, 50.0) - pct(&l, 50.0),
        },
        "pipelined": {
            "records": pipelined,
            "records_per_s": pipelined as f64 / took.as_secs_f64(),
            "records_per_sync": pipelined as f64 / syncs.max(1) as f64,
        },
    });
    serving.stop();
    Ok(out)
}

static W1CHAIN: Workflow<u32, u32> = Workflow::new("w1-chain");

/// Step completion marks of the W1 workflow.
static MARKS: Mutex<Vec<Instant>> = Mutex::new(Vec::new());

/// W1's workflow: `steps` no-op steps, each completion marked.
async fn marked_chain(ctx: Ctx, steps: u32) -> Result<u32, FlowError> {
    MARKS.lock().expect("marks").push(Instant::now());
    for _ in 0..steps {
        noop(&ctx).await?;
        MARKS.lock().expect("marks").push(Instant::now());
    }
    Ok(steps)
}

/// W1 then W2 on `engines` (runs started on the one holding their shard, when there
/// are several): the gaps of W1, and W2's steps/s with every workflow started at once,
/// as the embedded W2's bursts and the peers' W2 start them; `syncs` reads the log's
/// syncs.
fn w1_w2(
    engines: &[Rc<Engine>],
    shards: u32,
    args: &[String],
    syncs: &dyn Fn() -> u64,
) -> Result<Value, String> {
    let steps: u32 = num(args, "--steps", 1000);
    let (n, wsteps): (u32, u32) = (num(args, "--n", 10_000), num(args, "--wsteps", 10));
    let holder = |id: &str| -> &Rc<Engine> {
        let shard = ferry_flow::shard_of(id, shards);
        engines
            .iter()
            .find(|e| e.held_shards().iter().any(|(s, _)| *s == shard))
            .unwrap_or(&engines[0])
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(err)?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async {
        MARKS.lock().expect("marks").clear();
        holder("w1")
            .start(W1CHAIN, "w1", &steps)
            .await
            .map_err(err)?
            .result()
            .await
            .map_err(err)?;
        let marks = MARKS.lock().expect("marks").clone();
        let gaps: Vec<Duration> = marks[1..].windows(2).map(|w| w[1] - w[0]).collect();
        let syncs0 = syncs();
        let t = Instant::now();
        let mut tasks = Vec::with_capacity(n as usize);
        for i in 0..n {
            let id = format!("w2-{i}");
            let e = holder(&id).clone();
            tasks.push(tokio::task::spawn_local(async move {
                e.start(CHAIN, &id, &wsteps).await?.result().await
            }));
        }
        for t in tasks {
            t.await.map_err(err)?.map_err(err)?;
        }
        let secs = t.elapsed().as_secs_f64();
        let total = f64::from(n) * f64::from(wsteps);
        Ok(json!({
            "w1_gap": spread(gaps),
            "w2_steps_per_sec": total / secs,
            "w2_syncs_per_1k_steps": (syncs() - syncs0) as f64 * 1000.0 / total,
        }))
    })
}

/// A flow server in this process, on a runtime of its own.
struct Serving {
    rt: tokio::runtime::Runtime,
    server: Arc<ferry_flow_server::server::Server>,
    accept: tokio::task::JoinHandle<()>,
    /// What a worker dials.
    addr: String,
}

impl Serving {
    /// A server on `dir/server` with `settings` and `log`, listening on a Unix socket
    /// in `dir` or (`tcp`) on 127.0.0.1.
    fn start(
        dir: &Path,
        settings: ferry_flow_server::server::Settings,
        log: ferry_log::Config,
        tcp: bool,
    ) -> Result<Serving, String> {
        Serving::start_replicated(dir, settings, log, tcp, None)
    }

    /// [`Serving::start`], its log kept in the JetStream stream `replicate` names too
    /// (`URL` and stream name; docs/flow-server-replica.md).
    fn start_replicated(
        dir: &Path,
        settings: ferry_flow_server::server::Settings,
        log: ferry_log::Config,
        tcp: bool,
        replicate: Option<(String, String)>,
    ) -> Result<Serving, String> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(err)?;
        let socket = dir.join("flow.sock");
        let (server, accept, addr) = rt.block_on(async {
            let server = match replicate {
                None => ferry_flow_server::server::Server::open(&dir.join("server"), settings, log)
                    .map_err(err)?,
                Some((url, stream)) => {
                    use ferry_flow_server::replica::{Replica, ReplicaSettings};
                    let mut replica = Replica::connect(&ReplicaSettings {
                        url,
                        stream,
                        replicas: 3,
                        lease: settings.lease,
                    })
                    .await
                    .map_err(err)?;
                    replica.acquire().await.map_err(err)?;
                    replica
                        .restore(&dir.join("server"), log.clone())
                        .await
                        .map_err(err)?;
                    ferry_flow_server::server::Server::open_replicated(
                        &dir.join("server"),
                        settings,
                        log,
                        replica,
                    )
                    .map_err(err)?
                }
            };
            let server = Arc::new(server);
            server.start();
            let c = server.connector();
            let (accept, addr) = if tcp {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .map_err(err)?;
                let addr = listener.local_addr().map_err(err)?.to_string();
                let accept = tokio::spawn(async move {
                    while let Ok((stream, _)) = listener.accept().await {
                        let _ = stream.set_nodelay(true);
                        tokio::spawn(c.connection(stream));
                    }
                });
                (accept, addr)
            } else {
                let listener = tokio::net::UnixListener::bind(&socket).map_err(err)?;
                let accept = tokio::spawn(async move {
                    while let Ok((stream, _)) = listener.accept().await {
                        tokio::spawn(c.connection(stream));
                    }
                });
                (accept, format!("unix:{}", socket.display()))
            };
            Ok::<_, String>((server, accept, addr))
        })?;
        Ok(Serving {
            rt,
            server,
            accept,
            addr,
        })
    }

    /// Stop accepting, and shut the server down once its connections have let go.
    fn stop(self) {
        let Serving {
            rt, server, accept, ..
        } = self;
        rt.block_on(async {
            accept.abort();
            let _ = accept.await;
            if let Some(s) = Arc::into_inner(server) {
                s.shutdown().await;
            }
        });
    }
}

/// The parked workflow of `takeover` (and `idle`): waits for a signal that never comes.
async fn parked(ctx: Ctx, _: u32) -> Result<u32, FlowError> {
    let got = ctx.wait_for(PING, None).await?;
    Ok(got.map_or(0, |v| v.len() as u32))
}

/// `takeover-child --server ADDR --runs N --prefix P`: a worker that starts N parked
/// runs on each shard it holds once the shards settle, says `ready`, and waits to be
/// killed.
fn takeover_child(args: &[String]) -> Result<Value, String> {
    let addr = flag(args, "--server").ok_or("--server")?;
    let runs: usize = num(args, "--runs", 1000);
    let prefix = flag(args, "--prefix").ok_or("--prefix")?;
    let dir = PathBuf::from(flag(args, "--dir").ok_or("--dir")?);
    let engine = Engine::builder(dir)
        .server(addr)
        .register(PARK, parked)
        .open()
        .map_err(err)?;
    let shards: u32 = num(args, "--shards", 4);
    // Settled: half of the shards (the other worker holds the rest).
    let until = Instant::now() + Duration::from_secs(30);
    while engine.held_shards().len() != (shards as usize).div_ceil(2) {
        if Instant::now() > until {
            return Err(format!("held {:?}", engine.held_shards()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let held: Vec<u32> = engine.held_shards().iter().map(|(s, _)| *s).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(err)?;
    let started = rt.block_on(async {
        let mut count: BTreeMap<u32, usize> = BTreeMap::new();
        let mut started = 0;
        let mut i = 0u32;
        while held
            .iter()
            .any(|s| count.get(s).copied().unwrap_or(0) < runs)
        {
            let id = format!("{prefix}-{i}");
            i += 1;
            let shard = ferry_flow::shard_of(&id, shards);
            let c = count.entry(shard).or_default();
            if held.contains(&shard) && *c < runs {
                engine.start(PARK, &id, &i).await.map_err(err)?;
                *c += 1;
                started += 1;
            }
        }
        Ok::<_, String>(started)
    })?;
    println!("ready {started}");
    let _ = std::io::stdout().flush();
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn takeover(args: &[String]) -> Result<Value, String> {
    use std::io::BufRead;
    let dir = fresh_dir(args, "takeover")?;
    let shards: u32 = num(args, "--shards", 4);
    let runs: usize = num(args, "--runs", 1000);
    let trials: usize = num(args, "--trials", 20);
    let lease = Duration::from_millis(num(args, "--lease-ms", 1000));
    let exe = std::env::current_exe().map_err(err)?;
    let mut times = Vec::new();
    let mut recovered_runs = Vec::new();
    for trial in 0..trials {
        // A server of its own per trial: only this trial's runs to take over.
        let serving = Serving::start(
            &dir.join(format!("trial-{trial}")),
            ferry_flow_server::server::Settings {
                shards,
                lease,
                ping_every: Duration::from_millis(num(args, "--ping-ms", 200)),
                ..Default::default()
            },
            ferry_log::Config::default(),
            false,
        )?;
        let (server, addr) = (&serving.server, &serving.addr);
        // The child first, so that it holds every shard, then this process's worker,
        // which the server gives half of them.
        let mut child = std::process::Command::new(&exe)
            .args(["takeover-child", "--server", addr, "--prefix"])
            .arg(format!("t{trial}"))
            .args(["--runs", &runs.to_string(), "--shards", &shards.to_string()])
            .arg("--dir")
            .arg(dir.join(format!("child-{trial}")))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .map_err(err)?;
        let until = Instant::now() + Duration::from_secs(30);
        while server
            .status()
            .workers
            .iter()
            .filter(|w| w.connected)
            .count()
            < 1
        {
            if Instant::now() > until {
                return Err("the child did not connect".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let survivor = Engine::builder(dir.join(format!("survivor-{trial}")))
            .server(addr.clone())
            .register(PARK, parked)
            .open()
            .map_err(err)?;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().ok_or("no stdout")?)
            .read_line(&mut line)
            .map_err(err)?;
        let started: usize = line
            .trim()
            .strip_prefix("ready ")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("the child said {line:?}"))?;
        let before = survivor.runs().len();
        let t = Instant::now();
        child.kill().map_err(err)?;
        child.wait().map_err(err)?;
        let until = t + Duration::from_secs(60);
        while survivor.held_shards().len() != shards as usize
            || survivor.runs().len() < before + started
        {
            if Instant::now() > until {
                return Err(format!(
                    "trial {trial}: the survivor holds {:?} and {} runs after 60 s",
                    survivor.held_shards(),
                    survivor.runs().len()
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        times.push(t.elapsed());
        recovered_runs.push(started);
        drop(survivor);
        serving.stop();
    }
    let bound = lease + Duration::from_secs(1);
    let mut sorted = times.clone();
    sorted.sort();
    Ok(json!({
        "workload": "takeover",
        "shards": shards,
        "runs_per_shard": runs,
        "runs_taken_over": recovered_runs,
        "lease_ms": lease.as_millis() as u64,
        "takeover": spread(times),
        "bound_ms": bound.as_millis() as u64,
        "within_bound": sorted.last().is_some_and(|w| *w <= bound),
    }))
}

fn remote(args: &[String]) -> Result<Value, String> {
    let dir = fresh_dir(args, "remote")?;
    let workers: usize = num(args, "--workers", 1);
    let shards: u32 = num(args, "--shards", 4);
    let tcp = flag(args, "--transport").is_some_and(|t| t == "tcp");
    let embedded = {
        let engine = Rc::new(
            Engine::builder(dir.join("embedded"))
                .shards(shards as usize)
                .register(CHAIN, chain)
                .register(W1CHAIN, marked_chain)
                .open()
                .map_err(err)?,
        );
        w1_w2(std::slice::from_ref(&engine), shards, args, &|| {
            engine.log_stats().syncs
        })?
    };
    // A fresh stream per run: `--replicate URL` names the NATS cluster.
    let replicate = flag(args, "--replicate").map(|url| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        (url.to_string(), format!("BENCH_{nanos}"))
    });
    let serving = Serving::start_replicated(
        &dir,
        ferry_flow_server::server::Settings {
            shards,
            ..Default::default()
        },
        ferry_log::Config {
            follow: Duration::from_micros(num(args, "--follow-us", 0)),
            ..Default::default()
        },
        tcp,
        replicate.clone(),
    )?;
    let (server, addr) = (&serving.server, &serving.addr);
    let mut engines = Vec::new();
    for k in 0..workers {
        engines.push(Rc::new(
            Engine::builder(dir.join(format!("worker-{k}")))
                .server(addr.clone())
                .register(CHAIN, chain)
                .register(W1CHAIN, marked_chain)
                .open()
                .map_err(err)?,
        ));
    }
    // Every shard held, spread over the workers.
    let spread_out = Instant::now() + Duration::from_secs(30);
    loop {
        let held: Vec<usize> = engines.iter().map(|e| e.held_shards().len()).collect();
        let all = held.iter().sum::<usize>() == shards as usize;
        if all
            && held
                .iter()
                .all(|h| *h >= (shards as usize / workers).max(1))
        {
            break;
        }
        if Instant::now() > spread_out {
            return Err(format!(
                "the shards did not spread over the workers: {held:?}"
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let through = w1_w2(&engines, shards, args, &|| server.status().log.syncs)?;
    drop(engines);
    serving.stop();
    let p50 = |v: &Value| v["w1_gap"]["p50_us"].as_f64().unwrap_or(f64::NAN);
    let sps = |v: &Value| v["w2_steps_per_sec"].as_f64().unwrap_or(f64::NAN);
    let spk = |v: &Value| v["w2_syncs_per_1k_steps"].as_f64().unwrap_or(f64::NAN);
    Ok(json!({
        "workload": "remote",
        "transport": if tcp { "tcp" } else { "unix" },
        "workers": workers,
        "replicated": replicate.is_some(),
        "shards": shards,
        "embedded": embedded,
        "server": through,
        "w1_added_p50_us": p50(&through) - p50(&embedded),
        "w2_ratio_to_embedded": sps(&through) / sps(&embedded),
        "syncs_ratio_to_embedded": spk(&through) / spk(&embedded),
    }))
}

fn floor(args: &[String]) -> Result<Value, String> {
    let dir = fresh_dir(args, "floor")?;
    let lat = measure_floor(&dir, num(args, "--n", 2000), Duration::ZERO)?;
    Ok(json!({"workload": "floor", "fdatasync_4k": spread(lat)}))
}

async fn w1(args: &[String]) -> Result<Value, String> {
    let steps: u32 = num(args, "--steps", 1000);
    let dir = fresh_dir(args, "w1")?;
    let mut floor = measure_floor(&dir, num(args, "--floor-n", 2000), Duration::ZERO)?;
    floor.sort();
    let floor_p50 = pct(&floor, 50.0);
    let marks: Arc<Mutex<Vec<Instant>>> = Arc::new(Mutex::new(Vec::new()));
    let m = marks.clone();
    let engine = Engine::builder(dir.join("flow"))
        .shards(num(args, "--shards", ferry_flow::default_shards()))
        .register(CHAIN, move |ctx: Ctx, steps: u32| {
            let m = m.clone();
            async move {
                m.lock().expect("marks").push(Instant::now());
                for _ in 0..steps {
                    noop(&ctx).await?;
                    m.lock().expect("marks").push(Instant::now());
                }
                Ok(steps)
            }
        })
        .open()
        .map_err(err)?;
    let before = engine.log_stats();
    let t = Instant::now();
    let h = engine.start(CHAIN, "w1", &steps).await.map_err(err)?;
    h.result().await.map_err(err)?;
    let total = t.elapsed();
    let log = log_delta(before, engine.log_stats(), u64::from(steps));
    let marks = marks.lock().expect("marks").clone();
    // Between consecutive step completions: K-1 gaps (the first step also pays the start).
    let gaps: Vec<Duration> = marks[1..].windows(2).map(|w| w[1] - w[0]).collect();
    let g = spread(gaps);
    Ok(json!({
        "workload": "w1", "steps": steps, "total_ms": total.as_secs_f64() * 1e3,
        "gap": g, "floor": spread(floor),
        "ratio_p50_to_floor_p50": g["p50_us"].as_f64().unwrap_or(f64::NAN) / floor_p50,
        "log": log,
    }))
}

/// The engine W2 and W3 measure: `--shards` (2), and `--follow-us` for the log's
/// `Config::follow` (its default if absent).
fn chain_engine(dir: &Path, args: &[String]) -> Result<Engine, String> {
    chain_builder(dir, args).open().map_err(err)
}

/// [`chain_engine`]'s builder, for what opens the same engine with more settings.
fn chain_builder(dir: &Path, args: &[String]) -> EngineBuilder {
    let mut log = ferry_log::Config::default();
    if flag(args, "--follow-us").is_some() {
        log.follow = Duration::from_micros(num(args, "--follow-us", 0));
    }
    let mut builder = Engine::builder(dir)
        .log_config(log)
        .shards(num(args, "--shards", ferry_flow::default_shards()))
        .register(CHAIN, chain)
        .register(trace::TRACED, trace::traced_chain);
    match flag(args, "--max-running").as_deref() {
        None => {}
        Some("none") => builder = builder.max_running(None),
        // What does not parse is 0, which the engine refuses with its own error.
        Some(_) => builder = builder.max_running(Some(num(args, "--max-running", 0))),
    }
    match flag(args, "--steady-disk-us") {
        Some(_) => {
            let base = Duration::from_micros(num(args, "--steady-disk-us", 150));
            let ns_per_kib = num(args, "--steady-disk-ns-per-kib", 350);
            builder.wrap_files(move |files| {
                Arc::new(SteadyDisk {
                    files,
                    base,
                    ns_per_kib,
                    unsynced: Mutex::new(BTreeMap::new()),
                })
            })
        }
        None => builder,
    }
}

/// A disk that never stalls, for a control: files on the directory's own file system
/// (tmpfs, where a sync costs nothing), each sync then made to take `base` plus
/// `ns_per_kib` for every KiB written to the file since its last sync, as long as a real
/// disk's fdatasync of that much. The default per KiB is from a host this bench ran on
/// (2026-12-02): 4 KiB synced in 173 µs, 256 KiB in 299 µs, 1 MiB in 514 µs. What an engine's W3 tail is on it is the
/// engine's own: no device stall, no sync slower than its size makes it.
struct SteadyDisk {
    files: ferry_log::FileStorage,
    base: Duration,
    ns_per_kib: u64,
    /// Bytes written to each file since its last sync.
    unsynced: Mutex<BTreeMap<String, u64>>,
}

impl ferry_log::Storage for SteadyDisk {
    fn list(&self) -> std::io::Result<Vec<String>> {
        self.files.list()
    }
    fn create(&self, name: &str) -> std::io::Result<()> {
        self.files.create(name)
    }
    fn len(&self, name: &str) -> std::io::Result<u64> {
        self.files.len(name)
    }
    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
        self.files.read_at(name, offset, buf)
    }
    fn write_at(&self, name: &str, offset: u64, data: &[u8]) -> std::io::Result<()> {
        *self
            .unsynced
            .lock()
            .expect("unsynced")
            .entry(name.to_string())
            .or_default() += data.len() as u64;
        self.files.write_at(name, offset, data)
    }
    fn sync(&self, name: &str) -> std::io::Result<()> {
        let began = Instant::now();
        let bytes = self
            .unsynced
            .lock()
            .expect("unsynced")
            .remove(name)
            .unwrap_or(0);
        self.files.sync(name)?;
        let took = self.base + Duration::from_nanos(bytes / 1024 * self.ns_per_kib);
        // The syncing thread's timer slack cut to 1 µs (from 50), so the sleep ends on
        // time: once per thread, not a system call per sync.
        thread_local! {
            static SLACK_CUT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
        }
        if !SLACK_CUT.replace(true) {
            // SAFETY: PR_SET_TIMERSLACK sets a value of this thread only; no memory is passed.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
        }
        if let Some(left) = took.checked_sub(began.elapsed()) {
            std::thread::sleep(left);
        }
        Ok(())
    }
    fn truncate(&self, name: &str, len: u64) -> std::io::Result<()> {
        self.files.truncate(name, len)
    }
    fn remove(&self, name: &str) -> std::io::Result<()> {
        self.files.remove(name)
    }
    fn sync_dir(&self) -> std::io::Result<()> {
        self.files.sync_dir()
    }
    fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        self.files.rename(from, to)
    }
}

async fn w2(args: &[String]) -> Result<Value, String> {
    let n: u32 = num(args, "--n", 10_000);
    let steps: u32 = num(args, "--steps", 10);
    let shards: usize = num(args, "--shards", ferry_flow::default_shards());
    let dir = fresh_dir(args, "w2")?;
    let engine = Rc::new(chain_engine(&dir.join("flow"), args)?);
    // Rounds before the measured one, on the same engine: how the pace holds once the
    // heap and the runs map hold finished runs.
    let mut earlier = Vec::new();
    for r in 1..num(args, "--rounds", 1u32) {
        let cpu = cpu_seconds();
        let t = Instant::now();
        burst(&engine, &format!("w2-{r}"), n, steps).await?;
        let total = f64::from(n * steps);
        earlier.push(json!({
            "steps_per_sec": total / t.elapsed().as_secs_f64(),
            "cpu_secs_per_1k_steps": (cpu_seconds() - cpu) * 1000.0 / total,
        }));
    }
    let before = engine.log_stats();
    let cpu = cpu_seconds();
    let t = Instant::now();
    let lat = burst(&engine, "w2", n, steps).await?;
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu;
    let total_steps = u64::from(n) * u64::from(steps);
    Ok(json!({
        "workload": "w2", "workflows": n, "steps_per_workflow": steps, "shards": shards,
        "secs": secs,
        "steps_per_sec": total_steps as f64 / secs,
        "workflows_per_sec": f64::from(n) / secs,
        "cpu_secs": cpu,
        "cpu_secs_per_1k_steps": cpu * 1000.0 / total_steps as f64,
        "workflow_latency": spread(lat),
        "earlier_rounds": earlier,
        "log": log_delta(before, engine.log_stats(), total_steps),
    }))
}

async fn w3(args: &[String]) -> Result<Value, String> {
    let max_rate: f64 = num(args, "--max-rate", 0.0);
    if max_rate <= 0.0 {
        return Err("--max-rate R (workflows/s, W2's measured maximum) is required".into());
    }
    let fractions: Vec<f64> = flag(args, "--fractions")
        .unwrap_or_else(|| "0.25,0.5,0.8,0.95".into())
        .split(',')
        .map(|f| f.parse().map_err(err))
        .collect::<Result<_, _>>()?;
    let seconds: f64 = num(args, "--seconds", 5.0);
    let warmup: f64 = num(args, "--warmup", 1.0);
    let steps: u32 = num(args, "--steps", 10);
    // The clock's tick: each arrival is released up to a tick late (counted in its
    // latency). 250 µs where the clock's wake-ups take CPU the engine needs (0.06 of a
    // core; 100 µs took 0.13), 50 µs where cores are to spare.
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let tick = Duration::from_micros(num(args, "--tick-us", if cpus <= 4 { 250 } else { 50 }));
    // One arrival in this many is traced (`trace.rs`); 0: none.
    let trace_every: u64 = num(args, "--trace-every", 20);
    // What W3 frees in bulk (the disk's samples, each point's log) stays allocated until
    // its last point: memory a guest frees is handed back to the host some seconds
    // later, and on the VMs this bench was built on the VM stopped for 10-30 ms around
    // such passes (`settle_host`). Freed between points, it would stall the next point
    // for reasons that are not the engine's.
    let mut dirs = Vec::new();
    // Each point's engine directory, aged first (see `age`) unless `--fresh`: all of
    // them before the disk's samples and `settle_host`, since aging frees memory.
    let mut point_dirs = Vec::new();
    for &f in &fractions {
        let dir = fresh_dir(args, &format!("w3-{}", (f * 100.0).round()))?;
        let aged = if flag(args, "--fresh").is_some() {
            Value::Null
        } else {
            let bytes = f * max_rate * (warmup + seconds) * BYTES_PER_WORKFLOW;
            age(&dir.join("flow"), bytes as u64, steps, args).await?
        };
        point_dirs.push((dir, aged));
    }
    // The disk alone: a workflow's start and steps each wait for a sync of their own
    // (at the least), one after another. How those chains of syncs spread on this disk
    // bounds the spread any engine that syncs per step can show here.
    let (chain, samples) = {
        let dir = fresh_dir(args, "w3-disk")?;
        let syncs = measure_floor(
            &dir,
            num(args, "--chain-n", 16000),
            Duration::from_secs_f64(seconds),
        )?;
        let k = steps as usize + 1;
        let sums: Vec<Duration> = syncs.windows(k).map(|w| w.iter().sum()).collect();
        let chain = json!({"syncs": k, "latency": spread(sums.clone()), "ideal_engine": ideal_engine(&syncs, k)});
        dirs.push(dir);
        (chain, (syncs, sums))
    };
    // What this process's start, or the process run before it, freed: handed back now.
    let settled = settle_host(Duration::from_secs(5), Duration::from_secs(30));
    let mut points = Vec::new();
    for (f, (dir, aged)) in fractions.into_iter().zip(point_dirs) {
        let engine = Rc::new(chain_engine(&dir.join("flow"), args)?);
        let watch = DiskWatch::start(&dir);
        let (cpu0, t) = (machine_cpu_ms(), Instant::now());
        let dump =
            flag(args, "--dump").map(|d| PathBuf::from(format!("{d}.{}", (f * 100.0).round())));
        let p = open_loop(
            &engine,
            f * max_rate,
            (warmup, seconds),
            (steps, trace_every),
            tick,
            dump.as_deref(),
        )
        .await?;
        let cpu = cpu0
            .zip(machine_cpu_ms())
            .map(|(a, b)| (b.0 - a.0, b.1 - a.1));
        let busy = cpu.map(|(busy, _)| busy / (t.elapsed().as_secs_f64() * 1e3));
        let disk_stalls = watch.map_or(Value::Null, DiskWatch::stop);
        points.push(
            json!({"fraction": f, "point": p, "aged": aged, "host_steal_ms": cpu.map(|c| c.1),
            "machine_busy_cores": busy, "disk_stalls": disk_stalls}),
        );
        // Closed, not kept: a live engine compacts its log in the background, which
        // would take CPU from the next point.
        drop(engine);
        dirs.push(dir);
    }
    drop(samples);
    for dir in dirs {
        std::fs::remove_dir_all(&dir).map_err(err)?;
    }
    Ok(
        json!({"workload": "w3", "max_rate": max_rate, "settled_secs": settled.as_secs_f64(), "steps_per_workflow": steps, "seconds": seconds, "warmup": warmup, "points": points, "disk_chain": chain}),
    )
}

/// What a workflow of W3's chain journals, about (its start, ten 64-byte step results
/// and its end, with their frames): to size how much log a point writes.
const BYTES_PER_WORKFLOW: f64 = 1_700.0;

/// Bring the engine directory `dir` to the state a long-running engine's log is in:
/// its segments are made from retired ones (ferry-log's spares, docs/log.md §3), so a
/// sync writes over blocks the file already has. A fresh engine creates every segment
/// and extends it as it fills; a long-running one compacts, retires and reuses them.
/// Bursts of W3's chain journal at least `bytes` (up to the spares a log keeps), then
/// one compaction (retention zero: the finished runs leave with it) retires them;
/// the engine is closed, and the point opens it anew.
async fn age(dir: &Path, bytes: u64, steps: u32, args: &[String]) -> Result<Value, String> {
    // `chain_builder`'s log keeps the default sizes.
    let log = ferry_log::Config::default();
    let bytes = bytes.min(log.spare_segments as u64 * log.segment_bytes);
    let engine = Rc::new(
        chain_builder(dir, args)
            .compact_every(bytes + log.segment_bytes)
            .compact_interval(Duration::ZERO)
            .retention(Duration::ZERO)
            .open()
            .map_err(err)?,
    );
    let t = Instant::now();
    let mut i = 0;
    while engine.log_stats().end < bytes + log.segment_bytes {
        burst(&engine, &format!("age-{i}"), 10_000, steps).await?;
        i += 1;
    }
    // A compaction is due once the bursts end; one that has not retired them within
    // two minutes is reported (`stuck`: what the log held), and the point runs on what
    // aging left rather than the whole benchmark stopping.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut stuck = None;
    while engine.log_stats().segments > 1 {
        if Instant::now() > deadline {
            let st = engine.log_stats();
            let metrics = engine.metrics();
            let compactions: Vec<&str> = metrics
                .lines()
                .filter(|l| {
                    l.starts_with("ferry_flow_compaction")
                        || l.starts_with("ferry_flow_log_segments_retired")
                })
                .collect();
            stuck = Some(format!(
                "no compaction retired the segments within 120 s: log end {}, durable {}, {} \
                 segments, {bytes} bytes asked; {compactions:?}",
                st.end, st.durable, st.segments,
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let written = engine.log_stats().end;
    drop(engine);
    let spares = std::fs::read_dir(dir)
        .map_err(err)?
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "spare"))
        })
        .count();
    Ok(
        json!({"bytes": written, "spares": spares, "compacted": stuck.is_none(), "stuck": stuck, "secs": t.elapsed().as_secs_f64()}),
    )
}

/// Arrivals at `rate`/s on a fixed schedule for `warmup` + `seconds`, whatever the engine
/// does (open loop): a slow engine shows up as latency, measured from each arrival's
/// scheduled time. Arrivals in the first `warmup` seconds (a fresh engine's first
/// segment, its threads' first wake-ups, the heap growing) are reported apart.
async fn open_loop(
    engine: &Rc<Engine>,
    rate: f64,
    (warmup, seconds): (f64, f64),
    (steps, trace_every): (u32, u64),
    tick: Duration,
    dump: Option<&Path>,
) -> Result<Value, String> {
    let count = (rate * (warmup + seconds)).round().max(1.0) as u64;
    // The traced arrivals' marks, and the writer's cycles (at most one per 50 µs).
    let traced_n = count.checked_div(trace_every).unwrap_or(0) + 1;
    let now = Instant::now();
    let traced_cap = if trace_every > 0 {
        traced_n as usize
    } else {
        0
    };
    let run = trace::Run {
        id: 0,
        due: now,
        called: now,
        started: now,
        done: now,
    };
    let traced = Rc::new(RefCell::new(touched(traced_cap, run)));
    if trace_every > 0 {
        trace::prepare((traced_n * u64::from(steps)) as usize);
        // At most one cycle per 40 µs, through the warm-up, the point and 2 s of drain.
        engine.trace_log_cycles(((warmup + seconds + 2.0) * 25_000.0) as usize);
    }
    let v = touched(count as usize, (now, Duration::ZERO, Duration::ZERO));
    let lat: Rc<RefCell<Vec<(Instant, Duration, Duration)>>> = Rc::new(RefCell::new(v));
    let before = engine.log_stats();
    let cpu = thread_cpu();
    let cpu0 = cpu_seconds();
    let faults0 = page_faults();
    let sched = schedstat();
    let t0 = Instant::now() + Duration::from_millis(20);
    // The schedule is kept by an OS thread: tokio's timers tick in whole milliseconds,
    // which would add up to 1 ms to every arrival and release them in per-millisecond
    // bursts. It wakes at each arrival's time, but no more often than every `tick` (each
    // wake-up costs both threads a context switch), with the kernel's timer slack cut
    // from 50 µs to 1 µs, and hands over every arrival due by then. Latency counts from
    // the arrival's time, so what `tick` delays is in the figures. At 250 µs the clock
    // takes 0.06 of a core from the engine's two; at 100 µs it took 0.13.
    let (tx, mut arrivals) = tokio::sync::mpsc::unbounded_channel::<(u64, Instant)>();
    // It returns its own CPU time: once joined it is gone from /proc, and its share of
    // the two cores is the harness's, not the engine's.
    let clock = std::thread::Builder::new()
        .name("w3-clock".into())
        .spawn(move || {
            // SAFETY: PR_SET_TIMERSLACK sets a value of this thread only; no memory is passed.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000 as libc::c_ulong) };
            let due = |i: u64| t0 + Duration::from_secs_f64(i as f64 / rate);
            let mut i = 0;
            let mut woke = Instant::now();
            'schedule: while i < count {
                let now = Instant::now();
                let wake = due(i).max(woke + tick);
                if wake > now {
                    std::thread::sleep(wake - now);
                    continue;
                }
                woke = now;
                while i < count && due(i) <= now {
                    if tx.send((i, due(i))).is_err() {
                        break 'schedule;
                    }
                    i += 1;
                }
            }
            rusage_seconds(libc::RUSAGE_THREAD)
        })
        .map_err(err)?;
    // Each arrival's task reports its end on `done` and is gone: a JoinHandle kept per
    // arrival would keep every finished task's memory until the end of the point.
    let (done_tx, mut done) = tokio::sync::mpsc::unbounded_channel::<Result<(), FlowError>>();
    let mut started = 0u64;
    while let Some((i, due)) = arrivals.recv().await {
        let (e, l, done_tx) = (engine.clone(), lat.clone(), done_tx.clone());
        let tr = (trace_every > 0 && i % trace_every == 0).then(|| traced.clone());
        started += 1;
        tokio::task::spawn_local(async move {
            let r = async {
                let id = format!("w3-{i}");
                let Some(tr) = tr else {
                    let h = e.start(CHAIN, &id, &steps).await?;
                    let s = due.elapsed();
                    h.result().await?;
                    l.borrow_mut().push((due, due.elapsed(), s));
                    return Ok(());
                };
                let called = Instant::now();
                let h = e.start(trace::TRACED, &id, &(steps, i)).await?;
                let started = Instant::now();
                h.result().await?;
                let done = Instant::now();
                l.borrow_mut().push((due, done - due, started - due));
                tr.borrow_mut().push(trace::Run {
                    id: i,
                    due,
                    called,
                    started,
                    done,
                });
                Ok(())
            };
            let _ = done_tx.send(r.await);
        });
    }
    let clock_cpu = clock
        .join()
        .map_err(|_| "the arrival clock panicked".to_string())?;
    for _ in 0..started {
        done.recv()
            .await
            .ok_or("a workflow's task vanished")?
            .map_err(err)?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let faults = page_faults();
    let measured_from = t0 + Duration::from_secs_f64(warmup);
    let (measured, warm): (Vec<_>, Vec<_>) = lat
        .borrow()
        .iter()
        .partition(|(due, _, _)| *due >= measured_from);
    if let Some(path) = dump {
        dump_arrivals(path, t0, &lat.borrow()).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let only = |v: Vec<(Instant, Duration, Duration)>| v.into_iter().map(|(_, l, _)| l).collect();
    let traced = if trace_every > 0 {
        let cycles = engine.take_log_cycles();
        engine.trace_log_cycles(0);
        let stages = trace::stages(&traced.borrow(), &cycles, measured_from, steps);
        trace::keep(cycles);
        stages
    } else {
        Value::Null
    };
    Ok(json!({
        "trace": traced,
        "rate_asked": rate, "workflows": count, "achieved_per_sec": count as f64 / secs,
        "warmup_secs": warmup, "measured_secs": seconds,
        "latency": spread(only(measured)),
        "warmup_latency": spread(only(warm)),
        "cpu_secs_per_1k_steps": (cpu_seconds() - cpu0) * 1000.0 / (count * u64::from(steps)) as f64,
        "page_faults": {"minor": faults.0 - faults0.0, "major": faults.1 - faults0.1},
        "cpu_share_by_thread": thread_share(&cpu, secs, ("w3-clock", clock_cpu)),
        "run_queue": run_queue(&sched, secs),
        "log": log_delta(before, engine.log_stats(), count * u64::from(steps)),
    }))
}

/// An empty vector with room for `n` values, its pages touched now: one that doubles as
/// it goes copies megabytes and faults in fresh pages on the thread that fills it, in the
/// middle of a measurement.
fn touched<T: Clone>(n: usize, filler: T) -> Vec<T> {
    let mut v = vec![filler; n];
    v.clear();
    v
}

/// One line per arrival, `due_ms latency_ms start_ms` from the point's start (start:
/// until `engine.start` returned, its start record durable); the first line
/// gives that start on CLOCK_MONOTONIC (seconds), to line stalls up with `perf record
/// -k mono` or anything else that stamps its events with that clock.
fn dump_arrivals(
    path: &Path,
    t0: Instant,
    lat: &[(Instant, Duration, Duration)],
) -> std::io::Result<()> {
    // SAFETY: timespec is plain integers; clock_gettime writes one into the struct we own.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: as above; CLOCK_MONOTONIC is valid.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let now = ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(
        f,
        "# start {:.6} CLOCK_MONOTONIC",
        now - t0.elapsed().as_secs_f64()
    )?;
    for (due, l, s) in lat {
        let at = due.saturating_duration_since(t0).as_secs_f64() * 1e3;
        writeln!(
            f,
            "{at:.3} {:.3} {:.3}",
            l.as_secs_f64() * 1e3,
            s.as_secs_f64() * 1e3
        )?;
    }
    f.flush()
}

async fn w4(args: &[String]) -> Result<Value, String> {
    let n: u32 = num(args, "--n", 1000);
    let sleep_ms: u64 = num(args, "--sleep-ms", 1000);
    let dir = fresh_dir(args, "w4")?;
    type Marks = Arc<Mutex<Vec<(Duration, Duration)>>>;
    let marks: Marks = Arc::new(Mutex::new(Vec::new()));
    let m = marks.clone();
    let engine = Rc::new(
        Engine::builder(dir.join("flow"))
            .shards(num(args, "--shards", ferry_flow::default_shards()))
            .register(NAP, move |ctx: Ctx, ms: u64| {
                let m = m.clone();
                async move {
                    let d = Duration::from_millis(ms);
                    let t = Instant::now();
                    ctx.sleep(d).await?;
                    let woke = t.elapsed();
                    noop(&ctx).await?;
                    let done = t.elapsed();
                    m.lock().expect("marks").push((woke, done));
                    Ok(1)
                }
            })
            .open()
            .map_err(err)?,
    );
    let mut tasks = Vec::new();
    for i in 0..n {
        let e = engine.clone();
        tasks.push(tokio::task::spawn_local(async move {
            e.start(NAP, &format!("w4-{i}"), &sleep_ms)
                .await?
                .result()
                .await
        }));
    }
    for task in tasks {
        task.await.map_err(err)?.map_err(err)?;
    }
    let d = Duration::from_millis(sleep_ms);
    let marks = marks.lock().expect("marks").clone();
    // Signed: a timer is journaled in whole wall-clock ms, so by the monotonic clock it
    // may fire up to 1 ms before `sleep_ms` after the call (never before its journaled
    // wall-clock time).
    let late_ms = |x: Duration| (x.as_secs_f64() - d.as_secs_f64()) * 1e3;
    let mut woke: Vec<f64> = marks.iter().map(|(w, _)| late_ms(*w)).collect();
    let mut done: Vec<f64> = marks.iter().map(|(_, s)| late_ms(*s)).collect();
    woke.sort_by(f64::total_cmp);
    done.sort_by(f64::total_cmp);
    let p = |v: &[f64], q: f64| v[((q / 100.0) * (v.len() - 1) as f64).round() as usize];
    Ok(json!({
        "workload": "w4", "workflows": n, "sleep_ms": sleep_ms,
        "woke_late_ms": {"p50": p(&woke, 50.0), "p99": p(&woke, 99.0), "min": woke[0], "max": p(&woke, 100.0)},
        "step_done_late_ms": {"p50": p(&done, 50.0), "p99": p(&done, 99.0), "max": p(&done, 100.0)},
    }))
}

/// Wait until every record appended is durable and the log holds `records` records in all.
async fn settle(engine: &Engine, records: u64) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = engine.log_stats();
        if (s.records >= records && s.durable >= s.end) || Instant::now() > deadline {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn w5(args: &[String]) -> Result<Value, String> {
    let n: u32 = num(args, "--n", 1000);
    let timeout = Duration::from_millis(num(args, "--timeout-ms", 60_000));
    let dir = fresh_dir(args, "w5")?;
    let engine = Engine::builder(dir.join("flow"))
        .shards(num(args, "--shards", ferry_flow::default_shards()))
        .register(ECHO, move |ctx: Ctx, _: u32| async move {
            let got = ctx.wait_for(PING, Some(timeout)).await?;
            let v = got.ok_or_else(|| FlowError::Invalid("no signal before the timeout".into()))?;
            ctx.step("echo", move |_| {
                let v = v.clone();
                async move { Ok(v) }
            })
            .await
        })
        .open()
        .map_err(err)?;
    // Every run parked in wait_for (Started and WaitStarted durable) before timing.
    let base = engine.log_stats().records;
    for i in 0..n {
        engine
            .start(ECHO, &format!("w5-{i}"), &i)
            .await
            .map_err(err)?;
    }
    settle(&engine, base + 2 * u64::from(n)).await;
    let mut signal = Vec::with_capacity(n as usize);
    let mut round = Vec::with_capacity(n as usize);
    for i in 0..n {
        let id = format!("w5-{i}");
        let t = Instant::now();
        engine
            .signal(&id, PING, &PAYLOAD.to_string())
            .await
            .map_err(err)?;
        signal.push(t.elapsed());
        let h = engine.run::<String>(&id).ok_or("the run exists")?;
        let out = h.result().await.map_err(err)?;
        round.push(t.elapsed());
        if out != PAYLOAD {
            return Err(format!("run {id} echoed {out:?}"));
        }
    }
    Ok(
        json!({"workload": "w5", "round_trips": n, "round_trip": spread(round), "signal_durable": spread(signal)}),
    )
}

/// The W6 workflow: `steps` steps, each appending `PHASE KEY` to the ledger and
/// fdatasyncing it before it returns.
fn ledger_engine(
    dir: &Path,
    ledger: &Path,
    phase: &'static str,
    first_step: Arc<OnceLock<Instant>>,
) -> Result<Engine, String> {
    let file = Arc::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(ledger)
            .map_err(err)?,
    );
    Engine::builder(dir)
        .shards(2)
        .register(CHAIN, move |ctx: Ctx, steps: u32| {
            let (file, first_step) = (file.clone(), first_step.clone());
            async move {
                for _ in 0..steps {
                    let (file, first_step) = (file.clone(), first_step.clone());
                    ctx.step("noop", move |s| {
                        let line = format!("{phase} {}\n", s.key());
                        let (file, first_step) = (file.clone(), first_step.clone());
                        async move {
                            // One write(2) per line on an O_APPEND file: lines never interleave.
                            (&*file).write_all(line.as_bytes()).expect("ledger write");
                            file.sync_data().expect("ledger fdatasync");
                            first_step.get_or_init(Instant::now);
                            Ok(PAYLOAD.to_string())
                        }
                    })
                    .await?;
                }
                Ok(steps)
            }
        })
        .open()
        .map_err(err)
}

/// Start runs `{prefix}-0` to `{prefix}-(n-1)` of CHAIN all at once and await every
/// result; each one's time from its start call to its result.
async fn burst(
    engine: &Rc<Engine>,
    prefix: &str,
    n: u32,
    steps: u32,
) -> Result<Vec<Duration>, String> {
    let mut tasks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let (e, id) = (engine.clone(), format!("{prefix}-{i}"));
        tasks.push(tokio::task::spawn_local(async move {
            let started = Instant::now();
            e.start(CHAIN, &id, &steps).await?.result().await?;
            Ok::<_, FlowError>(started.elapsed())
        }));
    }
    let mut lat = Vec::with_capacity(n as usize);
    for task in tasks {
        lat.push(task.await.map_err(err)?.map_err(err)?);
    }
    Ok(lat)
}

async fn w6_child(args: &[String]) -> Result<Value, String> {
    let dir = PathBuf::from(flag(args, "--dir").ok_or("--dir")?);
    let engine = Rc::new(ledger_engine(
        &dir.join("flow"),
        &dir.join("ledger"),
        "A",
        Arc::new(OnceLock::new()),
    )?);
    burst(
        &engine,
        "w6",
        num(args, "--n", 1000),
        num(args, "--steps", 10),
    )
    .await?;
    Ok(json!({"finished": true}))
}

fn ledger_lines(ledger: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(ledger)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(p, k)| (p.to_string(), k.to_string()))
        .collect()
}

/// The keys of every step whose result the log holds durably: after a crash, exactly
/// the steps that must never run again.
fn durable_steps(flow_dir: &Path) -> Result<BTreeSet<String>, String> {
    let (log, _) = ferry_log::Log::open_dir(flow_dir, ferry_log::Config::default()).map_err(err)?;
    let mut keys = BTreeSet::new();
    log.read(log.start_lsn(), |r| {
        if r.kind != RECORD_KIND {
            return;
        }
        if let Ok(rec) = Record::decode(r.payload)
            && let (Entry::Step { .. }, Some(pos)) = (&rec.entry, rec.pos)
        {
            keys.insert(format!("{}/{}/{}", rec.run, rec.generation, pos));
        }
    })
    .map_err(err)?;
    Ok(keys)
}

async fn w6(args: &[String]) -> Result<Value, String> {
    let n: u32 = num(args, "--n", 1000);
    let steps: u32 = num(args, "--steps", 10);
    let kill_at: f64 = num(args, "--kill-at", 0.4);
    let dir = fresh_dir(args, "w6")?;
    let ledger = dir.join("ledger");
    let exe = std::env::current_exe().map_err(err)?;
    let mut child = std::process::Command::new(exe)
        .args([
            "w6-child",
            "--n",
            &n.to_string(),
            "--steps",
            &steps.to_string(),
            "--dir",
        ])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .spawn()
        .map_err(err)?;
    let target = (f64::from(n * steps) * kill_at) as usize;
    let deadline = Instant::now() + Duration::from_secs(120);
    while ledger_lines(&ledger).len() < target {
        if child.try_wait().map_err(err)?.is_some() || Instant::now() > deadline {
            return Err("the W6 child ended or stalled before the kill".into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    child.kill().map_err(err)?; // SIGKILL
    child.wait().map_err(err)?;
    let before_kill = ledger_lines(&ledger).len();
    let durable = durable_steps(&dir.join("flow"))?;

    let first_step = Arc::new(OnceLock::new());
    let t = Instant::now();
    let engine = Rc::new(ledger_engine(
        &dir.join("flow"),
        &ledger,
        "B",
        first_step.clone(),
    )?);
    let open_ms = t.elapsed().as_secs_f64() * 1e3;
    burst(&engine, "w6", n, steps).await?;
    let all_ms = t.elapsed().as_secs_f64() * 1e3;
    let first_ms = first_step.get().map(|f| (*f - t).as_secs_f64() * 1e3);
    drop(engine);
    Ok(json!({
        "workload": "w6", "workflows": n, "steps_per_workflow": steps,
        "ledger_lines_at_kill": before_kill, "durable_step_results_at_kill": durable.len(),
        "open_ms": open_ms, "open_to_first_step_ms": first_ms, "open_to_all_finished_ms": all_ms,
        "check": check_ledger(&ledger_lines(&ledger), &durable, n, steps),
    }))
}

/// Every step ran; none whose result was durable at the kill ran again; steps cut short
/// (ran before the kill, result not durable) may have run again once: counted.
fn check_ledger(
    lines: &[(String, String)],
    durable: &BTreeSet<String>,
    n: u32,
    steps: u32,
) -> Value {
    let mut runs: BTreeMap<&str, (u32, u32)> = BTreeMap::new();
    for (phase, key) in lines {
        let e = runs.entry(key).or_default();
        if phase == "A" { e.0 += 1 } else { e.1 += 1 }
    }
    let acknowledged_rerun: Vec<&str> = runs
        .iter()
        .filter(|(k, (a, b))| *a + *b > 1 && durable.contains(**k))
        .map(|(k, _)| *k)
        .collect();
    let cut_short_rerun = runs
        .iter()
        .filter(|(k, (a, b))| *a + *b > 1 && !durable.contains(**k))
        .count();
    let twice_in_one_process = runs.values().filter(|(a, b)| *a > 1 || *b > 1).count();
    json!({
        "distinct_steps_run": runs.len(), "steps_expected": n * steps,
        "every_step_ran": runs.len() == (n * steps) as usize,
        "acknowledged_steps_rerun": acknowledged_rerun.len(),
        "acknowledged_rerun_examples": acknowledged_rerun.iter().take(5).collect::<Vec<_>>(),
        "cut_short_steps_rerun": cut_short_rerun,
        "steps_run_twice_in_one_process": twice_in_one_process,
    })
}

async fn idle(args: &[String]) -> Result<Value, String> {
    let n: u32 = num(args, "--n", 10_000);
    let warm: u32 = 100;
    let dir = fresh_dir(args, "idle")?;
    let engine = Rc::new(
        Engine::builder(dir.join("flow"))
            .shards(num(args, "--shards", ferry_flow::default_shards()))
            .register(PARK, parked)
            .open()
            .map_err(err)?,
    );
    // A few runs first so that thread stacks, the runtime and the log's buffers exist
    // before the baseline: the delta is what each further parked run holds.
    park_runs(&engine, "warm", warm).await?;
    settle(&engine, 2 * u64::from(warm)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss0 = rss_bytes()?;
    COUNTING.store(true, Relaxed);
    park_runs(&engine, "idle", n).await?;
    settle(&engine, 2 * u64::from(warm + n)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss1 = rss_bytes()?;
    COUNTING.store(false, Relaxed);
    // The net growth of the live heap while the runs were started and parked (frees of
    // older blocks meanwhile subtract).
    let live = LIVE.load(Relaxed);
    Ok(json!({
        "workload": "idle", "runs": n, "rss_before": rss0, "rss_after": rss1,
        "bytes_per_run": (rss1 as f64 - rss0 as f64) / f64::from(n),
        "live_heap_per_run": live as f64 / f64::from(n),
        "records_per_run": engine.log_stats().records as f64 / f64::from(warm + n),
    }))
}

/// Start `n` runs that park, one after another (each start awaited): started all at
/// once, the harness's own 10,000 start tasks are freed afterwards and leave holes
/// between the runs' blocks that RSS counts (2.2-2.5 KiB per run instead of 1.4 KiB
/// here, with the same live heap).
async fn park_runs(engine: &Rc<Engine>, prefix: &str, n: u32) -> Result<(), String> {
    for i in 0..n {
        engine
            .start(PARK, &format!("{prefix}-{i}"), &i)
            .await
            .map_err(err)?;
    }
    Ok(())
}
