#!/usr/bin/env python3
"""The DBOS arm of bench/flow: DBOS Transact for Python (installed from PyPI by
bench/flow/run) on SQLite or on Postgres, running the same no-op workloads as ferry's
harness: every step returns the same 64-byte string. Prints one JSON line.

  dbos_arm.py --db URL w1 [--steps 200]
  dbos_arm.py --db URL w2 [--n 1000] [--steps 10]

URL is sqlite:///FILE or postgresql://USER@HOST:PORT/DB (a database of its own: DBOS
creates its system tables there). Workflows and steps are async and run on one event
loop, the way DBOS runs many concurrent workflows without a thread each. DBOS keeps its
defaults: on SQLite that is a rollback journal with synchronous=FULL (SQLite's default,
DBOS sets no pragma about it); on Postgres whatever the server runs
(synchronous_commit=on here). CPU is this process's only: on Postgres the server's
backends do part of the work and are not counted.
"""

import argparse
import asyncio
import json
import logging
import time

from armlib import parse_args, self_cpu, spread
from dbos import DBOS

PAYLOAD = "0123456789abcdef" * 4
assert len(PAYLOAD) == 64
MARKS = []


@DBOS.step()
async def noop() -> str:
    return PAYLOAD


@DBOS.workflow()
async def chain(steps: int, mark: bool) -> int:
    if mark:
        MARKS.append(time.perf_counter())
    for _ in range(steps):
        out = await noop()
        assert len(out) == 64
        if mark:
            MARKS.append(time.perf_counter())
    return steps


async def w1(a):
    MARKS.clear()
    t = time.perf_counter()
    h = await DBOS.start_workflow_async(chain, a.steps, True)
    await h.get_result()
    total = time.perf_counter() - t
    gaps = [(y - x) * 1e6 for x, y in zip(MARKS[1:], MARKS[2:])]
    return {"workload": "w1", "steps": a.steps, "total_ms": total * 1e3, "gap": spread(gaps)}


async def w2(a):
    c0, t = self_cpu(), time.perf_counter()

    async def one(i):
        s = time.perf_counter()
        h = await DBOS.start_workflow_async(chain, a.steps, False)
        await h.get_result()
        return (time.perf_counter() - s) * 1e6

    lat = await asyncio.gather(*(one(i) for i in range(a.n)))
    secs = time.perf_counter() - t
    c = self_cpu() - c0
    steps = a.n * a.steps
    return {"workload": "w2", "workflows": a.n, "steps_per_workflow": a.steps, "secs": secs,
            "steps_per_sec": steps / secs, "workflows_per_sec": a.n / secs, "cpu_secs": c,
            "cpu_secs_per_1k_steps": c * 1000 / steps, "workflow_latency": spread(lat)}


async def main(a):
    DBOS(config={"name": "ferry_bench_flow", "system_database_url": a.db, "log_level": "WARNING"})
    DBOS.launch()
    logging.getLogger("dbos").setLevel(logging.WARNING)
    try:
        # Warm-up: connections open, tables cached, code paths taken once.
        await w1(argparse.Namespace(steps=5))
        out = await (w1(a) if a.workload == "w1" else w2(a))
    finally:
        DBOS.destroy()
    import dbos as d
    out["system"] = "dbos-" + ("sqlite" if a.db.startswith("sqlite") else "postgres")
    out["version"] = getattr(d, "__version__", None) or __import__("importlib.metadata").metadata.version("dbos")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--db", required=True)
    a = parse_args(p)
    asyncio.run(main(a))
