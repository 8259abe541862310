#!/usr/bin/env python3
"""Shipper CPU per MiB of rows only, side by side with Litestream, interleaved: a quick look
at the CPU column of bench/results/ship.md without the full benchmark (bench/ship/run builds
and installs what this needs first). Uses bench.py's own runs (the same proxy, pinning and
workload) at 5,000 tx/s asked, and prints each system's median over --runs runs.

  python3 bench/ship/cpu.py [--runs 3] [--seconds 15]
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench as B  # noqa: E402


def arg(name, default):
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


runs = arg("--runs", 3)
secs = arg("--seconds", 15)
B.WORK.mkdir(parents=True, exist_ok=True)
systems = ["ferry", "ferry sidecar", "litestream 0.5.17 (defaults)", "litestream 0.5.17 (100 ms)"]
out = {s: [] for s in systems}
try:
    for i in range(runs):
        for s in systems:
            d = B.fresh(f"cpu3-{s.split()[0]}-{s.split()[-1].strip('()')}-{i}")
            summary = B.SYSTEMS[s](d, 5000, secs)
            st = B.lag_stats(d, summary)
            out[s].append(st)
            print(f"run {i + 1} {s}: {st['shipper_cpu_per_mb_ms']:.1f} ms/MiB shipper, tps {st['tps']:.0f}, lag p50 {st['lag_p50_ms']:.2f} p99 {st['lag_p99_ms']:.2f}", flush=True)
finally:
    for p in B.procs:
        if p.poll() is None: p.kill()
print()
for s in systems:
    cpu = [r['shipper_cpu_per_mb_ms'] for r in out[s]]
    print(f"{s}: shipper CPU median {statistics.median(cpu):.1f} ms/MiB ({', '.join(f'{c:.1f}' for c in cpu)}); tps median {statistics.median(r['tps'] for r in out[s]):.0f}; lag p99 median {statistics.median(r['lag_p99_ms'] for r in out[s]):.2f} ms")
