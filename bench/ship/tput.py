#!/usr/bin/env python3
"""Primary write throughput only, interleaved and paired: a quick look at what shipping
costs the primary without the full benchmark (bench/ship/run builds what this needs first,
or: cargo build --release -p ferry -p ferry-bench-ship).

Configurations, each run in turn within every round (medians of paired ratios against
"off", SQLite's defaults with no shipper):
  off       the writer alone, SQLite's defaults (autocheckpoint on)
  inproc    ferry-ship in the writer's process, the receiver's directory on the same disk
  sidecar   `ferry ship` as its own process, same disk
  tmpfs     inproc with the receiver's directory on /dev/shm: the replica's syncs no
            longer share the primary's disk, as on a real second machine
  sidecar-tmpfs  sidecar, the receiver's directory on /dev/shm
  inproc-own-core   inproc with the shipper's threads (`ferry-ship-*`) moved to the
            replica side's CPU once they start: writer and shipper on separate cores
            (a fold's locked half, run in the app's commit hook, stays on the writer's)
  sidecar-own-core  sidecar on the replica side's CPU

  python3 bench/ship/tput.py [--runs 3] [--seconds 10] [CONFIG ...]
"""

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench as B  # noqa: E402


def arg(name, default):
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


CONFIGS = {
    "off": lambda d: B.run_writer([B.HARNESS, "write", "--db", d / "primary" / "bench.db", "--seconds",
                                   B.THROUGHPUT_SECONDS, "--pragmas", "default"]),
    "inproc": lambda d: B.ferry_lag_run(d, 0, B.THROUGHPUT_SECONDS, "inprocess", "ferry"),
    "sidecar": lambda d: B.ferry_lag_run(d, 0, B.THROUGHPUT_SECONDS, "sidecar", "ferry-sidecar"),
    "tmpfs": lambda d: B.apart_disk_run(d, B.THROUGHPUT_SECONDS),
    "sidecar-tmpfs": lambda d: B.apart_disk_run(d, B.THROUGHPUT_SECONDS, "sidecar", "ferry-sidecar"),
    "inproc-own-core": lambda d: B.own_core_run(d, B.THROUGHPUT_SECONDS),
    "sidecar-own-core": lambda d: B.ferry_lag_run(d, 0, B.THROUGHPUT_SECONDS, "sidecar", "ferry-sidecar",
                                                  sidecar_cpu=B.REPLICA_CPU),
}


def main():
    runs = arg("--runs", 3)
    B.THROUGHPUT_SECONDS = arg("--seconds", 10)
    names = [a for a in sys.argv[1:] if a in CONFIGS] or list(CONFIGS)
    if "off" not in names:
        names.insert(0, "off")
    B.WORK.mkdir(parents=True, exist_ok=True)
    tps = {n: [] for n in names}
    try:
        for i in range(runs):
            for n in names:
                s = CONFIGS[n](B.fresh(f"tput-{n}-{i}"))
                tps[n].append(s["tps"])
                print(f"round {i + 1}/{runs}: {n} {s['tps']:,.0f} tx/s", flush=True)
    finally:
        for p in B.procs:
            if p.poll() is None:
                p.kill()
    print(f"\noff: median {statistics.median(tps['off']):,.0f} tx/s")
    for n in names[1:]:
        ratios = [a / b for a, b in zip(tps[n], tps["off"])]
        print(f"{n}: median {statistics.median(tps[n]):,.0f} tx/s; paired ratios "
              + ", ".join(f"{r:.1%}" for r in ratios) + f"; median {statistics.median(ratios):.1%}")


if __name__ == "__main__":
    main()
