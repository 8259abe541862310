#!/usr/bin/env python3
"""Recording throughput of ferry-sync's relay with 1, 2 and 4 relay shards
(docs/sync-scale.md §2): `ferry-bench-sync shards` per point, three runs each, medians as
ratios to one shard, written to bench/results/sync-shards.md and sync-shards.png.

Usage: python3 bench/sync/shards.py [--runs 3] [--replicas 400] [--changes 20000]
       [--shards 1,2,4] [--bin target/release/ferry-bench-sync]

Build first: cargo build --release --locked -p ferry-bench-sync. Needs the machine's
Postgres (FERRY_TEST_PG, default postgres://postgres@127.0.0.1:5432).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(binary, shards, replicas, changes, broadcast):
    cmd = [binary, "shards", "--shards", str(shards), "--replicas", str(replicas),
           "--changes", str(changes)]
    if broadcast:
        cmd.append("--broadcast")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900).stdout
    lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    return lines[-1]


def machine():
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    pg = subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-Atc", "SHOW server_version"],
                        capture_output=True, text=True).stdout.strip()
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cpus": os.cpu_count(), "kernel": platform.release(),
            "postgres": pg, "ferry": rev}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=400)
    ap.add_argument("--changes", type=int, default=20000)
    ap.add_argument("--shards", default="1,2,4")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/ferry-bench-sync"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results"))
    a = ap.parse_args()
    shards = [int(s) for s in a.shards.split(",")]
    results = {}
    for kind in ["assigned", "broadcast"]:
        for n in shards:
            for i in range(a.runs):
                r = run(a.bin, n, a.replicas, a.changes, kind == "broadcast")
                print(json.dumps(r), flush=True)
                results.setdefault((kind, n), []).append(r)
    write(a, shards, results, machine())


def write(a, shards, results, m):
    md = ["# ferry-sync: recording throughput by relay shards", "",
          f"Measured {time.strftime('%Y-%m-%d')} with `python3 bench/sync/shards.py --runs {a.runs} "
          f"--replicas {a.replicas} --changes {a.changes} --shards {a.shards}` at {m['ferry']}.", "",
          f"Machine: {m['cpu']}, {m['cpus']} CPUs, Linux {m['kernel']}; Postgres {m['postgres']} on "
          "the same machine. Each shard is a relay of its own (its own lock and connection) "
          "in one process (`ferry-bench-sync shards`).", "",
          "One transaction writes the changes after every replica is provisioned; the figure "
          "is changes recorded per second from its commit until no note is left. "
          "`assigned`: orders spread over the replicas (each change goes to one replica). "
          "`broadcast`: an update of every row of a table every replica holds (each change "
          "goes to every replica). Replicas' confirmations are simulated by emptying the "
          "outbox every 50 ms. Medians of the runs; ratios to one shard.", "",
          "| kind | shards | changes/s (median) | × one shard | runs | writer's time (s) |",
          "|---|---|---|---|---|---|"]
    for kind in ["assigned", "broadcast"]:
        base = statistics.median(r["changes_per_s"] for r in results[(kind, shards[0])])
        for n in shards:
            rs = results[(kind, n)]
            med = statistics.median(r["changes_per_s"] for r in rs)
            runs = ", ".join(f"{r['changes_per_s']:,.0f}" for r in rs)
            write_s = statistics.median(r["write_s"] for r in rs)
            md.append(f"| {kind} | {n} | {med:,.0f} | {med / base:.2f} | {runs} | {write_s:.2f} |")
    md += ["", "![throughput by shards](sync-shards.png)", ""]
    path = os.path.join(a.out, "sync-shards.md")
    with open(path, "w") as f:
        f.write("\n".join(md))
    print(f"wrote {path}", file=sys.stderr)
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, style in [("assigned", "-o"), ("broadcast", "--s")]:
        ys = [statistics.median(r["changes_per_s"] for r in results[(kind, n)]) for n in shards]
        ax.plot(shards, ys, style, label=kind)
    ax.set_xlabel("relay shards")
    ax.set_ylabel("changes recorded per second (median)")
    ax.set_xticks(shards)
    ax.set_title(f"ferry-sync recording, {m['cpus']} CPUs, {a.replicas} replicas")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "sync-shards.png"), dpi=110)


if __name__ == "__main__":
    main()
