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

import glob
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench as B  # noqa: E402


def arg(name, default):
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


def tmpfs(d, mode="inprocess", tag="ferry"):
    t = Path("/dev/shm") / f"ferry-tput-{d.name}"
    shutil.rmtree(t, ignore_errors=True)
    t.mkdir(parents=True)
    (d / "standby").rmdir()
    os.symlink(t, d / "standby")
    try:
        return B.ferry_lag_run(d, 0, B.THROUGHPUT_SECONDS, mode, tag)
    finally:
        shutil.rmtree(t, ignore_errors=True)


def own_core(d):
    """inproc, the shipper's threads moved to the replica side's CPU as they appear (they
    all start when the shipper opens, in the writer's first milliseconds)."""
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
        os.sched_setaffinity(0, {int(B.REPLICA_CPU)})
        pid = None
        end = time.time() + 3
        while not stop.is_set() and time.time() < end:
            pid = pid or writer_pid()
            for comm in glob.glob(f"/proc/{pid}/task/[0-9]*/comm") if pid else []:
                tid = int(comm.split("/")[4])
                try:
                    if tid not in moved and Path(comm).read_text().startswith("ferry-ship-"):
                        os.sched_setaffinity(tid, {int(B.REPLICA_CPU)})
                        moved.add(tid)
                except OSError:
                    pass
            time.sleep(0.002)

    t = threading.Thread(target=pin)
    t.start()
    try:
        return B.ferry_lag_run(d, 0, B.THROUGHPUT_SECONDS, "inprocess", "ferry")
    finally:
        stop.set()
        t.join()
        print(f"  (moved {len(moved)} shipper threads to CPU {B.REPLICA_CPU})", flush=True)


CONFIGS = {
    "off": lambda d: B.run_writer([B.HARNESS, "write", "--db", d / "primary" / "bench.db", "--seconds",
                                   B.THROUGHPUT_SECONDS, "--pragmas", "default"]),
    "inproc": lambda d: B.ferry_lag_run(d, 0, B.THROUGHPUT_SECONDS, "inprocess", "ferry"),
    "sidecar": lambda d: B.ferry_lag_run(d, 0, B.THROUGHPUT_SECONDS, "sidecar", "ferry-sidecar"),
    "tmpfs": tmpfs,
    "sidecar-tmpfs": lambda d: tmpfs(d, "sidecar", "ferry-sidecar"),
    "inproc-own-core": own_core,
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
