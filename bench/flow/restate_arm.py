#!/usr/bin/env python3
"""The Restate arm of bench/flow: a real Restate server (npm `@restatedev/restate-server`,
installed by bench/flow/run into bench/.work/flow-npm; single node, its data in a fresh
directory, on free loopback ports) and a service on Restate's Python SDK (PyPI
`restate-sdk`) served by hypercorn over cleartext HTTP/2 in a child process, running the
same no-op workloads as ferry's harness: a Restate workflow whose every step is a
`ctx.run_typed` returning the same 64-byte string. The deployment is registered through
the admin API, workflows are invoked through the HTTP ingress. Prints one JSON line.

  restate_arm.py --server BIN --dir DIR w1 [--steps 200]
  restate_arm.py --server BIN --dir DIR w2 [--n 1000] [--steps 10]
  ... [--wrap "strace -f -c -e trace=fsync,fdatasync -o OUT"]   (the server under strace)
  restate_arm.py serve --port P                                  (the service endpoint)

`ctx.run` journals each step: the SDK proposes the result to the server, which appends it
to its log (Bifrost, on the node's log-server: RocksDB with its WAL synced) and only then
sends the completion back, so the workflow goes on after the step is durable. The server
keeps its defaults apart from ports, data directory, `listen-mode=tcp` and
`disable-telemetry=true` (its daily usage ping); its start-up check for a newer release on
the GitHub API has no switch and fails once, harmlessly, on this loopback-only machine.

W1's gaps are taken inside the workflow, between consecutive `ctx.run` completions, and
returned as its output. W2 starts all N workflows through the ingress's `/send` (each call
returns once the invocation is accepted) over 64 keep-alive HTTP/1.1 connections, then
attaches to each for its result. `cpu_secs` counts the server process (all its threads) and
the service process; this client process is reported apart (`cpu_secs_client`).
"""

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from armlib import free_port, parse_args, proc_cpu, self_cpu, spread, wait_port

PAYLOAD = "0123456789abcdef" * 4
assert len(PAYLOAD) == 64
SERVICE = "FerryBenchChain"


T0 = time.perf_counter()


def note(m):
    print(f"[restate_arm {time.perf_counter() - T0:7.2f}s] {m}", file=sys.stderr, flush=True)


# ---- the service (runs in the child process under hypercorn) ----

def serve(port):
    import restate
    from hypercorn.asyncio import serve as hyper_serve
    from hypercorn.config import Config

    chain = restate.Workflow(SERVICE)

    async def noop() -> str:
        return PAYLOAD

    @chain.main()
    async def run(ctx: restate.WorkflowContext, req: dict) -> dict:
        mark = req.get("mark", False)
        marks = [time.perf_counter()] if mark else None
        for _ in range(req["steps"]):
            out = await ctx.run_typed("noop", noop)
            assert len(out) == 64
            if mark:
                marks.append(time.perf_counter())
        gaps = [(y - x) * 1e6 for x, y in zip(marks[1:], marks[2:])] if mark else []
        return {"steps": req["steps"], "gaps_us": gaps}

    cfg = Config()
    cfg.bind = [f"127.0.0.1:{port}"]
    cfg.accesslog = None
    cfg.errorlog = "-"
    cfg.loglevel = "WARNING"
    cfg.h2_max_concurrent_streams = 1000
    asyncio.run(hyper_serve(restate.app(services=[chain]), cfg))


# ---- the driver ----

def register(admin, svc_port):
    import httpx
    end = time.time() + 60
    while True:
        r = httpx.post(f"http://127.0.0.1:{admin}/deployments", json={"uri": f"http://127.0.0.1:{svc_port}"},
                       timeout=30)
        if r.status_code in (200, 201):
            return r.json()
        note(f"admin answered {r.status_code}: {r.text[:200]}")
        if time.time() > end:
            raise RuntimeError(f"registering the deployment failed: {r.status_code} {r.text[:2000]}")
        time.sleep(0.2)


def call(ingress, key, steps, mark):
    """One workflow, request-response through the ingress; retried while the ingress does
    not know the service yet (just after registration)."""
    import httpx
    end = time.time() + 60
    while True:
        r = httpx.post(f"http://127.0.0.1:{ingress}/{SERVICE}/{key}/run", json={"steps": steps, "mark": mark},
                       timeout=600)
        if r.status_code == 200:
            return r.json()
        note(f"ingress answered {r.status_code}: {r.text[:200]}")
        if time.time() > end or r.status_code not in (404, 503):
            raise RuntimeError(f"invoking {SERVICE}/{key} failed: {r.status_code} {r.text[:2000]}")
        time.sleep(0.2)


def w1(a, ingress, tag):
    t = time.perf_counter()
    out = call(ingress, f"w1-{tag}", a.steps, True)
    total = time.perf_counter() - t
    assert out["steps"] == a.steps
    return {"workload": "w1", "steps": a.steps, "total_ms": total * 1e3, "gap": spread(out["gaps_us"])}


class Conn:
    """A minimal keep-alive HTTP/1.1 client connection (httpx's pool costs the client
    process seconds of CPU with hundreds of requests queued on it)."""

    def __init__(self, port):
        self.port = port
        self.r = self.w = None

    async def request(self, method, path, body=b""):
        if self.w is None:
            self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port)
        self.w.write(f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n\r\n".encode() + body)
        status = int((await self.r.readline()).split()[1])
        length, chunked = 0, False
        while (line := await self.r.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            k = k.strip().lower()
            if k == "content-length":
                length = int(v)
            elif k == "transfer-encoding" and "chunked" in v.lower():
                chunked = True
        if not chunked:
            return status, await self.r.readexactly(length)
        data = b""
        while (size := int((await self.r.readline()).split(b";")[0], 16)) > 0:
            data += await self.r.readexactly(size)
            await self.r.readline()
        await self.r.readline()
        return status, data

    def close(self):
        if self.w is not None:
            self.w.close()


async def w2_async(a, ingress, pids, conns=64):
    body = json.dumps({"steps": a.steps, "mark": False}).encode()
    start = {}
    lat = []

    async def send(c, i):
        start[i] = time.perf_counter()
        st, out = await c.request("POST", f"/{SERVICE}/w2-{i}/run/send", body)
        if st not in (200, 202):
            raise RuntimeError(f"/send failed: {st} {out[:1000]}")

    async def attach(c, i):
        st, out = await c.request("GET", f"/restate/workflow/{SERVICE}/w2-{i}/attach")
        if st != 200 or json.loads(out)["steps"] != a.steps:
            raise RuntimeError(f"attach failed: {st} {out[:1000]}")
        lat.append((time.perf_counter() - start[i]) * 1e6)

    async def worker(c, op, items):
        while items:
            await op(c, items.pop())

    pool = [Conn(ingress) for _ in range(conns)]
    c0, s0, t = self_cpu(), {k: proc_cpu(p) for k, p in pids.items()}, time.perf_counter()
    items = list(range(a.n))[::-1]
    await asyncio.gather(*(worker(c, send, items) for c in pool))
    items = list(range(a.n))[::-1]
    await asyncio.gather(*(worker(c, attach, items) for c in pool))
    secs = time.perf_counter() - t
    c = self_cpu() - c0
    sc = {k: proc_cpu(p) - s0[k] for k, p in pids.items()}
    for x in pool:
        x.close()
    steps = a.n * a.steps
    total = sc["worker"] + sc["server"]
    return {"workload": "w2", "workflows": a.n, "steps_per_workflow": a.steps, "secs": secs,
            "steps_per_sec": steps / secs, "workflows_per_sec": a.n / secs, "cpu_secs": total,
            "cpu_secs_worker": sc["worker"], "cpu_secs_server": sc["server"], "cpu_secs_client": c,
            "cpu_secs_per_1k_steps": total * 1000 / steps,
            "cpu_secs_per_1k_steps_with_client": (total + c) * 1000 / steps, "workflow_latency": spread(lat)}


def child_of(pid):
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return int(kids[0]) if kids else pid


def stop(proc, pid):
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(a):
    os.makedirs(a.dir, exist_ok=True)
    data = tempfile.mkdtemp(prefix="restate-", dir=a.dir)
    ingress, admin, fabric, svc_port = free_port(), free_port(), free_port(), free_port()
    env = dict(os.environ, RESTATE_DISABLE_TELEMETRY="true", RESTATE_LISTEN_MODE="tcp", RESTATE_BIND_IP="127.0.0.1",
               RESTATE_INGRESS__BIND_PORT=str(ingress), RESTATE_ADMIN__BIND_PORT=str(admin),
               RESTATE_BIND_PORT=str(fabric), RESTATE_SHUTDOWN_TIMEOUT="10s",
               RESTATE_LOG_FORMAT="compact", RESTATE_LOG_DISABLE_ANSI_CODES="true")
    wrap = shlex.split(a.wrap) if a.wrap else []
    log = open(os.path.join(data, "server.log"), "ab")
    server = subprocess.Popen(wrap + [a.server, "--no-logo", "--node-name", "bench", "--base-dir", data],
                              stdout=log, stderr=log, env=env)
    worker = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", "--port", str(svc_port)],
                              stdout=log, stderr=log)
    try:
        wait_port(admin, "the Restate server's admin API")
        wait_port(ingress, "the Restate ingress")
        wait_port(svc_port, "the service endpoint")
        spid = child_of(server.pid) if wrap else server.pid
        note("server and service listening")
        dep = register(admin, svc_port)
        note(f"deployment registered: {dep.get('id')}")
        w1(argparse.Namespace(steps=5), ingress, "warm")  # warm-up; also waits for the ingress to know the service
        note("warm-up done")
        out = w1(a, ingress, "run") if a.workload == "w1" else \
            asyncio.run(w2_async(a, ingress, {"server": spid, "worker": worker.pid}))
        out["deployment"] = {"id": dep.get("id"), "protocol": [dep.get("min_protocol_version"), dep.get("max_protocol_version")]}
    finally:
        worker.kill()  # the service holds no state (hypercorn's serve() leaves SIGTERM to its caller)
        worker.wait()
        stop(server, child_of(server.pid) if wrap else server.pid)
        log.close()
        if not a.keep:
            shutil.rmtree(data, ignore_errors=True)
    from importlib import metadata
    out["system"] = "restate"
    out["version"] = subprocess.run([a.server, "--version"], capture_output=True, text=True).stdout.strip()
    out["sdk"] = f"restate-sdk {metadata.version('restate-sdk')}, hypercorn {metadata.version('hypercorn')}"
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve":
        p = argparse.ArgumentParser()
        p.add_argument("cmd")
        p.add_argument("--port", type=int, required=True)
        serve(p.parse_args().port)
        sys.exit(0)
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--wrap", default="")
    p.add_argument("--keep", action="store_true", help="keep the data directory and server log")
    a = parse_args(p)
    sys.exit(main(a))
