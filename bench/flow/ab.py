#!/usr/bin/env python3
"""A/B of ferry-flow's W1 and W2 between two builds of the bench harness, interleaved on
one machine, for a change that must not move them (a refactor, say).

    cargo build --release -p ferry-bench-flow            # in each checkout
    python3 bench/flow/ab.py BASE_BINARY HEAD_BINARY [ROUNDS]

Each round runs W1 (1,000 steps) then W2 (N=10,000, the median of 3 bursts) on both
builds, in alternating order. Printed: per-round head/base ratios of W2's workflows/s and
W1's step gap p50, and their medians (paired, so that a slow round slows both)."""
import json, os, shutil, statistics, subprocess, sys, tempfile

base, head = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 12
work = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".work", "ab-flow")


def run(binary, *args):
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    out = subprocess.run([binary, *args, "--dir", work], capture_output=True, text=True,
                         check=True).stdout
    return json.loads([l for l in out.splitlines() if l.startswith("{")][-1])


got = {"base": [], "head": []}
for r in range(rounds):
    for name in (["base", "head"] if r % 2 == 0 else ["head", "base"]):
        binary = base if name == "base" else head
        w1 = run(binary, "w1", "--steps", "1000")
        w2 = sorted((run(binary, "w2", "--n", "10000") for _ in range(3)),
                    key=lambda x: x["workflows_per_sec"])[1]
        got[name].append((w1["gap"]["p50_us"], w2["workflows_per_sec"], w2["cpu_secs_per_1k_steps"]))
        print(r, name, got[name][-1], flush=True)
for i, what in enumerate(["W1 step gap p50", "W2 workflows/s", "W2 CPU-s per 1k steps"]):
    pairs = [h[i] / b[i] for h, b in zip(got["head"], got["base"])]
    print(f"{what}: head/base per round {[round(p, 3) for p in pairs]}, "
          f"median {statistics.median(pairs):.3f}")
