"""ferry over HTTP and over NATS JetStream, side by side: R = 100 replicas x 1 record/s,
3 runs each, interleaved; commit-to-Filed lag, provisioning time and server filing CPU
(serve, every Postgres process and, over NATS, the nats-server process). Reuses
side.py's point; needs bench/sync/run's builds (bench/.work/sync-bin) and nats-server.
Appends one JSON line per run to /tmp/nats-bench.jsonl and prints a summary line each.

    python3 bench/sync/nats_vs_http.py

Results: docs/notes/2026-12-07-nats-vs-http.md."""
import sys, os, subprocess, time, json, tempfile, socket
sys.argv = ["side.py"]
sys.path.insert(0, "bench/sync")
import side

state = {"nats": None}
orig_start, orig_argv, orig_ticks = side.start_server, side.host_argv, side.cpu_ticks

def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def start_server(engine, db, d, port, replicas_file, stores):
    if not state["nats"]:
        return orig_start(engine, db, d, port, replicas_file, stores)
    # as the original, with --nats
    url = f"{side.PG}/{db}"
    rules = d / "rules.toml"; rules.write_text(side.RULES)
    subprocess.run([side.FERRY, "sync", "install", "--rules", rules, "--db", url], check=True, capture_output=True)
    lines = []
    for s in stores:
        tok = subprocess.run([side.FERRY, "sync", "enroll", "--db", url, "--replica", s, "--json"], check=True, capture_output=True, text=True).stdout
        lines.append(f"{s} {json.loads(tok)['token']}")
    replicas_file.write_text("\n".join(lines) + "\n")
    p = subprocess.Popen([side.FERRY, "sync", "serve", "--rules", rules, "--db", url, "--listen", f"127.0.0.1:{port}", "--nats", state["nats"]["url"]],
                         stdout=subprocess.DEVNULL, stderr=open(d / "server.log", "w"), env={**os.environ, "RUST_LOG": "warn"})
    side.wait_http(f"http://127.0.0.1:{port}/status")
    return p

def host_argv(engine, port, replicas_file, d, products):
    argv = orig_argv(engine, port, replicas_file, d, products)
    if state["nats"]:
        argv[argv.index("--server") + 1] = state["nats"]["url"]
    return argv

orig_pg = side.postgres_ticks
def postgres_ticks():
    # the nats-server is part of the server side: counted with the Postgres processes
    ticks = orig_pg()
    if state["nats"]:
        pid = state["nats"]["p"].pid
        ticks[pid] = orig_ticks([pid])
    return ticks

side.start_server, side.host_argv, side.postgres_ticks = start_server, host_argv, postgres_ticks
out = open("/tmp/nats-bench.jsonl", "a")
for run in range(3):
    for transport in ["http", "nats"]:
        if transport == "nats":
            d = tempfile.mkdtemp(prefix="nats-bench-")
            port = free_port()
            p = subprocess.Popen(["nats-server", "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
            state["nats"] = {"url": f"nats://127.0.0.1:{port}", "p": p}
        try:
            r = side.point("ferry", products=1000, replicas=100, writes=[(1, 10)])
        finally:
            if state["nats"]:
                state["nats"]["p"].terminate(); state["nats"]["p"].wait(); state["nats"] = None
        for x in r:
            x.update(transport=transport, run=run)
            out.write(json.dumps(x) + "\n"); out.flush()
            print(transport, run, {k: x.get(k) for k in ["p50_ms", "p99_ms", "filing_cpu_ms_per_1000", "server_cpu_ms_per_1000", "idle_cpu_ms_per_s", "exactly_once", "provision_s"]}, flush=True)
