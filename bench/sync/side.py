#!/usr/bin/env python3
"""ferry-sync side by side with magic_sync 0.5.1 (issue 27's benchmark; bench/sync/side runs it).

Each engine runs as the same three kinds of process on this machine:

1. Postgres (the one scripts/test uses, FERRY_TEST_PG), a fresh database per run;
2. the engine's server: `ferry sync serve` (relay + HTTP transport from its outbox), or
   `magic-sync-server` (magic_sync's Server + a loopback store-and-forward queue served
   over HTTP by our harness, bench/sync/magic);
3. one replica host running R replicas, one SQLite file each (WAL, synchronous=FULL):
   `ferry-bench-sync replicas` (ferry's own replica loop) or `magic-sync-replicas`
   (magic_sync's Replica, its own run loop). Both hosts share one contract (stdout JSON
   lines `provisioned`, `mark`, `done`) and measure lag the same way: each changed row
   carries `at_ns`, Postgres's clock at the change; the host samples `now - at_ns` right
   after the apply that brought it.

The writer is a psql session fed SQL at a fixed rate (synchronous_commit off, for both).
A point: load N products and R stores (K orders each, not live), start the server, wait
for it, flip the stores live and start the host (provisioning runs until every replica
holds all its rows), then M changes a second for S seconds to `products` (broadcast: each
change reaches every replica) or `orders` (assigned: each change reaches one replica),
then two seconds to drain. Server CPU = the engine's server process plus every Postgres
process (user + system, from /proc), over the stream. WAL from pg_current_wal_lsn. Wire
bytes are what the host's transport carried (frames down, reports up), over the stream.
Each point runs RUNS times per engine, engines interleaved; medians are reported.

To look into one engine (not for results): SIDE_ENGINE=ferry runs it alone;
SIDE_UP_SECS=N writes for N seconds at the way-up points; SIDE_PERF=FILE records a
system-wide `perf` profile of the write phase into FILE, `strace -c` of the server over
5 s idle and 5 s writing into FILE.strace-idle and FILE.strace-writes, and logs each
Postgres table's scans and writes over both stretches.
"""

import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / "bench/.work/sync-side"
RESULTS = ROOT / "bench/results"
PG = os.environ.get("FERRY_TEST_PG", "postgres://postgres@127.0.0.1:5432").rstrip("/")
FERRY = ROOT / "bench/.work/sync-bin/ferry"
FERRY_HOST = ROOT / "bench/.work/sync-bin/ferry-bench-sync"
MAGIC_SERVER = ROOT / "bench/sync/magic/target/release/magic-sync-server"
MAGIC_HOST = ROOT / "bench/sync/magic/target/release/magic-sync-replicas"
ORDERS_PER_STORE = 10
# How long past its last offline write a store stays away in the offline point.
OFFLINE_AWAY_S = 20
ENGINES = ["ferry", "magic_sync 0.5.1"]
# One engine alone, to profile it: SIDE_ENGINE=ferry (a run for the results keeps both).
if os.environ.get("SIDE_ENGINE"):
    ENGINES = [e for e in ENGINES if e.startswith(os.environ["SIDE_ENGINE"])]

SCHEMA = """
CREATE TABLE stores (id uuid PRIMARY KEY, live boolean NOT NULL DEFAULT false);
CREATE TABLE products (id int8 PRIMARY KEY, name text NOT NULL, price_cents int8 NOT NULL, at_ns int8 NOT NULL DEFAULT 0);
CREATE TABLE orders (id int8 PRIMARY KEY, store uuid NOT NULL, qty int8 NOT NULL, at_ns int8 NOT NULL DEFAULT 0);
CREATE TABLE sales (id uuid PRIMARY KEY, store uuid NOT NULL, amount int8 NOT NULL, at_ns int8 NOT NULL);
CREATE TABLE sales_filed (id uuid PRIMARY KEY, at_ns int8 NOT NULL, filed_ns int8 NOT NULL);
CREATE FUNCTION sales_filed() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
  INSERT INTO sales_filed VALUES (NEW.id, NEW.at_ns, (extract(epoch from clock_timestamp()) * 1e9)::int8) ON CONFLICT (id) DO NOTHING;
  RETURN NEW; END $$;
CREATE TRIGGER sales_filed AFTER INSERT ON sales FOR EACH ROW EXECUTE FUNCTION sales_filed();
"""
RULES = """
[replicas]
relation = "stores"
live = "live"

[tables.products]
sync = "broadcast"

[tables.orders]
sync = { assigned = "store" }

[tables.sales]
mirror = "record"
replica = "store"
"""
NOW_NS = "(extract(epoch from clock_timestamp()) * 1e9)::int8"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def psql(db, sql, *flags):
    r = subprocess.run(["psql", f"{PG}/{db}", "-X", "-q", "-v", "ON_ERROR_STOP=1", *flags, "-c", sql],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"psql failed: {r.stderr.strip()}\n{sql[:300]}")
    return r.stdout


def scalar(db, sql):
    return psql(db, sql, "-At").strip()


class Session:
    """One psql session kept open, for reads inside a measured stretch: a psql per read
    would start a Postgres backend each time, whose CPU the measurement would count."""

    def __init__(self, db):
        self.p = subprocess.Popen(["psql", f"{PG}/{db}", "-X", "-q", "-At"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, bufsize=1)

    def scalar(self, sql):
        self.p.stdin.write(sql.rstrip(";") + ";\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=10)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def cpu_ticks(pids):
    total = 0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError):
            pass
    return total


def postgres_ticks():
    """CPU ticks of every Postgres process by pid (backends keep the comm "postgres")."""
    out = subprocess.run(["pgrep", "-x", "postgres"], capture_output=True, text=True).stdout
    return {int(p): cpu_ticks([int(p)]) for p in out.split()}


class Link:
    """The store's network: a TCP relay between the replica host and the engine's server
    that can be taken away (every connection cut, new ones refused at once) and given back,
    counting the bytes each way. The same for both engines, so the offline point measures
    what each sends over the wire, headers included."""

    def __init__(self, target_port):
        self.target = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(256)
        self.port = self.listener.getsockname()[1]
        self.online = True
        self.up = self.down = 0
        self.conns = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.listener.accept()
            except OSError:
                return
            if not self.online:
                c.close()
                continue
            try:
                s = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                c.close()
                continue
            with self.lock:
                self.conns.update((c, s))
            threading.Thread(target=self._pipe, args=(c, s, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(s, c, False), daemon=True).start()

    def _pipe(self, a, b, up):
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                with self.lock:
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
                b.sendall(data)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self.lock:
            self.conns.discard(a)
            self.conns.discard(b)
        a.close()

    def set_online(self, online):
        self.online = online
        if not online:
            with self.lock:
                conns = list(self.conns)
            for c in conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def counts(self):
        with self.lock:
            return self.up, self.down

    def close(self):
        self.set_online(False)
        self.listener.close()


class Host:
    """A replica host process and its JSON lines."""

    def __init__(self, argv, log_path):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=open(log_path, "w"), text=True, bufsize=1)

    def read(self, event, timeout):
        import selectors
        sel = selectors.DefaultSelector()
        sel.register(self.p.stdout, selectors.EVENT_READ)
        end = time.time() + timeout
        while time.time() < end:
            if not sel.select(timeout=max(0.0, end - time.time())):
                break
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"the replica host ended before {event}")
            try:
                j = json.loads(line)
            except json.JSONDecodeError:
                continue
            if j.get("event") == event:
                return j
        raise TimeoutError(f"no {event} within {timeout} s")

    def say(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()

    def mark(self):
        self.say("mark")
        return self.read("mark", 30)

    def done(self):
        self.p.send_signal(signal.SIGTERM)
        j = self.read("done", 60)
        self.p.wait(timeout=30)
        return j


def wait_http(url, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except Exception:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer")


def start_server(engine, db, d, port, replicas_file, stores):
    url = f"{PG}/{db}"
    if engine == "ferry":
        rules = d / "rules.toml"
        rules.write_text(RULES)
        subprocess.run([FERRY, "sync", "install", "--rules", rules, "--db", url], check=True,
                       capture_output=True)
        lines = []
        for s in stores:
            tok = subprocess.run([FERRY, "sync", "enroll", "--db", url, "--replica", s, "--json"],
                                 check=True, capture_output=True, text=True).stdout
            lines.append(f"{s} {json.loads(tok)['token']}")
        replicas_file.write_text("\n".join(lines) + "\n")
        p = subprocess.Popen([FERRY, "sync", "serve", "--rules", rules, "--db", url,
                              "--listen", f"127.0.0.1:{port}"],
                             stdout=subprocess.DEVNULL, stderr=open(d / "server.log", "w"),
                             env={**os.environ, "RUST_LOG": "warn"})
        wait_http(f"http://127.0.0.1:{port}/status")
    else:
        replicas_file.write_text("\n".join(stores) + "\n")
        p = subprocess.Popen([MAGIC_SERVER, "--db", url, "--listen", f"127.0.0.1:{port}"],
                             stdout=subprocess.PIPE, stderr=open(d / "server.log", "w"), text=True)
        line = p.stdout.readline()
        if not line or json.loads(line).get("event") != "ready":
            raise RuntimeError(f"magic-sync-server did not get ready: {line!r}")
    return p


def host_argv(engine, port, replicas_file, d, products):
    exe = FERRY_HOST if engine == "ferry" else MAGIC_HOST
    argv = [exe] + (["replicas"] if engine == "ferry" else [])
    return argv + ["--server", f"http://127.0.0.1:{port}", "--stores", replicas_file,
                   "--dir", d / "replicas", "--products", str(products),
                   "--orders-per-store", str(ORDERS_PER_STORE)]


def sync_schema_bytes(db):
    return int(scalar(db, """SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname NOT IN ('public', 'pg_catalog', 'information_schema', 'pg_toast')
        AND c.relkind IN ('r', 'm')"""))


def wal(db):
    return int(scalar(db, "SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8"))


def point(engine, products, replicas, streams=(), seconds=8, heal=False, writes=(), offline=()):
    """One run of one point: provisioning, then each (mode, rate) stream in turn on the
    same server and replicas; returns one dict of figures per stream (or one for the
    provisioning alone). With `offline`, the host reaches the server through a `Link`."""
    db = f"bench_side_{uuid.uuid4().hex[:8]}"
    d = WORK / db
    d.mkdir(parents=True)
    psql("postgres", f"CREATE DATABASE {db}")
    server = host = link = None
    out = {"engine": engine, "products": products, "replicas": replicas, "rate": 0,
           "mode": "broadcast", "seconds": seconds}
    records = []
    try:
        psql(db, SCHEMA)
        psql(db, f"INSERT INTO products SELECT g, 'product ' || g, g, 0 FROM generate_series(1, {products}) g")
        stores = [str(uuid.uuid4()) for _ in range(replicas)]
        psql(db, "INSERT INTO stores (id) VALUES " + ",".join(f"('{s}')" for s in stores))
        psql(db, f"""INSERT INTO orders SELECT row_number() OVER (), s.id, 1, 0
                     FROM stores s, generate_series(1, {ORDERS_PER_STORE})""")
        psql(db, "VACUUM ANALYZE")
        port = free_port()
        replicas_file = d / "stores.txt"
        server = start_server(engine, db, d, port, replicas_file, stores)
        time.sleep(1.0)
        t0 = time.time()
        psql(db, "UPDATE stores SET live = true")
        if offline:
            link = Link(port)
        host = Host(host_argv(engine, link.port if link else port, replicas_file, d, products), d / "host.log")
        host.read("provisioned", 600)
        out["provision_s"] = time.time() - t0
        out["provision_bytes"] = host.mark()["bytes_down"]
        time.sleep(0.5)
        if heal:
            out.update(heal_one(engine, db, host, port))
        for mode, rate in streams:
            r = {**out, "mode": mode, "rate": rate}
            r.update(stream(engine, db, server, host, rate, mode, seconds, replicas))
            records.append(r)
        for rate, secs in writes:
            r = {**out, "mode": "up", "rate": rate, "seconds": secs}
            r.update(write_stream(db, server, host, rate, secs, replicas))
            records.append(r)
        for rate, secs in offline:
            r = {**out, "mode": "offline", "rate": rate, "seconds": secs}
            r.update(offline_day(db, host, link, rate, secs, replicas))
            records.append(r)
        schema = sync_schema_bytes(db)
        done = host.done()
        host = None
        if not records:
            records.append({**out, **{k: v for k, v in done.items() if k not in ("event", "samples")}})
        for r in records:
            r["sync_schema_bytes"] = schema
            r["gaps"] = done.get("gaps")
    finally:
        for p in [host.p if host else None, server]:
            if p and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
        if link:
            link.close()
        psql("postgres", f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        subprocess.run(["rm", "-rf", str(d)])
    return records


def offline_day(db, host, link, rate, secs, replicas, away=OFFLINE_AWAY_S):
    """A store offline for a day of writes, coming back. The link is cut; each store's
    app writes `rate` sales a second for `secs` seconds (a day's sales, faster than a day);
    the link stays cut `away` seconds more, so each engine's retry waits have grown as they
    would over a day; then it comes back. Measured from its return: the bytes each way over
    the link until every sale is filed, the time to the first byte (the engine's wait to
    try again) and to the last sale filed, and exactly once."""
    expected = rate * secs * replicas
    session = Session(db)
    link.set_online(False)
    t_off = time.time()
    host.say(f"write {rate} {secs}")
    host.read("written", secs + 600)
    written_s = time.time() - t_off
    time.sleep(away)
    filed_before = int(session.scalar("SELECT count(*) FROM sales_filed"))
    up0, down0 = link.counts()
    t0 = time.time()
    link.set_online(True)
    first, filed = None, 0
    while time.time() - t0 < 600:
        if first is None and link.counts() != (up0, down0):
            first = time.time() - t0
        filed = int(session.scalar("SELECT count(*) FROM sales_filed"))
        if filed >= expected:
            break
        time.sleep(0.02)
    took = time.time() - t0
    up1, down1 = link.counts()
    session.close()
    rows, distinct = (int(v) for v in scalar(db, "SELECT count(*) || ' ' || count(DISTINCT id) FROM sales").split())
    return {
        "changes": expected,
        "written_offline_s": written_s,
        "away_s": away,
        "filed_while_offline": filed_before,
        "filed": filed,
        "filed_rows": rows,
        "filed_distinct": distinct,
        "exactly_once": rows == expected and distinct == expected,
        "first_byte_s": first,
        "back_in_s": took,
        "bytes_up": up1 - up0,
        "bytes_down": down1 - down0,
        "bytes_up_per_record": (up1 - up0) / max(expected, 1),
    }


def stream(engine, db, server, host, rate, mode, seconds, replicas):
    keys = 100 if mode == "broadcast" else replicas * ORDERS_PER_STORE
    table = "products" if mode == "broadcast" else "orders"
    col = "price_cents" if mode == "broadcast" else "qty"
    host.say("stats")  # forget what came before this stream
    host.read("stats", 30)
    before = host.mark()
    cpu0, pg0, wal0 = cpu_ticks([server.pid]), postgres_ticks(), wal(db)
    w = subprocess.Popen(["psql", f"{PG}/{db}", "-X", "-q"], stdin=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, text=True)
    w.stdin.write("SET synchronous_commit = off;\n")
    start, n = time.time(), 0
    while time.time() - start < seconds:
        n += 1
        w.stdin.write(f"UPDATE {table} SET at_ns = {NOW_NS}, {col} = {col} + 1 WHERE id = {n % keys + 1};\n")
        w.stdin.flush()
        delay = start + n / rate - time.time()
        if delay > 0:
            time.sleep(delay)
    w.stdin.close()
    w.wait()
    time.sleep(2.0)
    cpu1, pg1, wal1 = cpu_ticks([server.pid]), postgres_ticks(), wal(db)
    engine_s = (cpu1 - cpu0) / os.sysconf("SC_CLK_TCK")
    pg_s = sum(t - pg0.get(pid, 0) for pid, t in pg1.items()) / os.sysconf("SC_CLK_TCK")
    after = host.mark()
    host.say("stats")
    lag = {k: v for k, v in host.read("stats", 30).items() if k not in ("event", "s", "bytes_down", "bytes_up", "lost")}
    deliveries = n * (replicas if mode == "broadcast" else 1)
    return {
        "changes": n,
        "expected_samples": deliveries,
        "server_cpu_ms_per_1000": (engine_s + pg_s) * 1e6 / n,
        "engine_cpu_ms_per_1000": engine_s * 1e6 / n,
        "postgres_cpu_ms_per_1000": pg_s * 1e6 / n,
        "wal_bytes_per_change": (wal1 - wal0) / n,
        "wire_bytes_per_delivery": (after["bytes_down"] + after["bytes_up"] - before["bytes_down"] - before["bytes_up"]) / deliveries,
        **lag,
    }


def write_stream(db, server, host, rate, secs, replicas):
    """The way up: every replica's app writes `rate` sales a second for `secs` seconds
    (one per transaction, `at_ns` its wall clock at the commit); the engine uploads and
    files them. Lag: `filed_ns - at_ns`, `filed_ns` the clock at the server's insert (a
    trigger on `sales` the engines do not know of). Exactly once: every sale in `sales`
    once, none missing. CPU from the first write until the last is filed; filing CPU is
    that less what the same stretch costs idle (long polls, reports, keepalives), measured
    just before over `min(secs, 10)` seconds."""
    expected = rate * secs * replicas
    tick = os.sysconf("SC_CLK_TCK")
    session = Session(db)
    def pg_counts():
        return psql(db, """SELECT 'xact', xact_commit, xact_rollback, tup_returned, tup_fetched FROM pg_stat_database WHERE datname = current_database()
            UNION ALL SELECT schemaname || '.' || relname, seq_scan, coalesce(idx_scan, 0), n_tup_ins + n_tup_upd + n_tup_del, n_tup_hot_upd
            FROM pg_stat_all_tables WHERE schemaname IN ('public', 'ferry_sync') ORDER BY 1""", "-At")
    def log_counts(label, c0):
        time.sleep(1)  # the statistics collector's flush
        before = {l.split("|")[0]: [int(x) for x in l.split("|")[1:]] for l in c0.split()}
        for l in pg_counts().split():
            name, *vals = l.split("|")
            delta = [int(v) - b for v, b in zip(vals, before.get(name, [0] * len(vals)))]
            if any(delta):
                log(f"  {label} {name}: {delta}")

    profiling = bool(os.environ.get("SIDE_PERF"))
    idle_counts = pg_counts() if profiling else None
    strace = lambda out: (subprocess.Popen(["timeout", "5", "strace", "-c", "-f", "-p", str(server.pid), "-o", out],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                          if profiling and shutil.which("strace") else None)
    strace(os.environ["SIDE_PERF"] + ".strace-idle") if profiling else None
    idle_cpu0, idle_pg0, idle_t0 = cpu_ticks([server.pid]), postgres_ticks(), time.time()
    time.sleep(min(secs, 10))
    idle_cpu1, idle_pg1 = cpu_ticks([server.pid]), postgres_ticks()
    if profiling:
        log_counts("idle", idle_counts)
    idle_s = ((idle_cpu1 - idle_cpu0) + sum(t - idle_pg0.get(pid, 0) for pid, t in idle_pg1.items())) / tick
    idle_per_s = idle_s / (time.time() - idle_t0)
    cpu0, pg0 = cpu_ticks([server.pid]), postgres_ticks()
    # SIDE_PERF=FILE: a system-wide profile of the write phase, to see where filing goes.
    perf = (subprocess.Popen(["perf", "record", "-a", "-F", "999", "-g", "-o", os.environ["SIDE_PERF"],
                              "--", "sleep", str(secs)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if os.environ.get("SIDE_PERF") else None)
    counts0 = pg_counts() if perf else None
    strace(os.environ["SIDE_PERF"] + ".strace-writes") if profiling else None
    t0 = time.time()
    host.say(f"write {rate} {secs}")
    host.read("written", secs + 120)
    filed = 0
    while time.time() - t0 < secs + 120:
        filed = int(session.scalar("SELECT count(*) FROM sales_filed"))
        if filed >= expected:
            break
        time.sleep(0.05)
    took = time.time() - t0
    cpu1, pg1 = cpu_ticks([server.pid]), postgres_ticks()
    if perf:
        perf.wait()
        log_counts("writes", counts0)
    session.close()
    engine_s = (cpu1 - cpu0) / os.sysconf("SC_CLK_TCK")
    pg_s = sum(t - pg0.get(pid, 0) for pid, t in pg1.items()) / os.sysconf("SC_CLK_TCK")
    rows, distinct = (int(v) for v in scalar(db, "SELECT count(*) || ' ' || count(DISTINCT id) FROM sales").split())
    lags = sorted(float(v) for v in psql(db, "SELECT (filed_ns - at_ns) / 1e6 FROM sales_filed", "-At").split())

    def pct(p):
        return lags[round((len(lags) - 1) * p)] if lags else float("nan")

    third = len(lags) // 3
    by_time = [float(v) for v in psql(db, "SELECT (filed_ns - at_ns) / 1e6 FROM sales_filed ORDER BY at_ns", "-At").split()]
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    return {
        "changes": expected,
        "expected_samples": expected,
        "samples": len(lags),
        "filed": filed,
        "filed_rows": rows,
        "filed_distinct": distinct,
        "exactly_once": rows == expected and distinct == expected,
        "filed_in_s": took,
        "p50_ms": pct(0.5), "p95_ms": pct(0.95), "p99_ms": pct(0.99), "max_ms": pct(1.0),
        "first_third_p50_ms": med(by_time[:third]), "last_third_p50_ms": med(by_time[-third:] if third else []),
        "server_cpu_ms_per_1000": (engine_s + pg_s) * 1e6 / max(expected, 1),
        "engine_cpu_ms_per_1000": engine_s * 1e6 / max(expected, 1),
        "postgres_cpu_ms_per_1000": pg_s * 1e6 / max(expected, 1),
        "idle_cpu_ms_per_s": idle_per_s * 1e3,
        "filing_cpu_ms_per_1000": max(engine_s + pg_s - idle_per_s * took, 0.0) * 1e6 / max(expected, 1),
    }


def heal_one(engine, db, host, port):
    """Two changes a second apart, delivered normally; then two more where the transport
    loses the first one's message. The second change is what reveals a loss to an
    engine that only notices a gap (magic_sync heals a lost *last* message only after
    `unconfirmed_after`, an hour by default). Bytes: both directions until both changes
    are applied and the reports after them have gone up."""

    def two(keys, lose):
        before = host.mark()
        if lose:
            if engine == "ferry":
                host.say("lose-next")
            else:
                urllib.request.urlopen(urllib.request.Request(
                    f"http://127.0.0.1:{port}/control/lose-next", method="POST"), timeout=5).read()
        t = time.time()
        for i, key in enumerate(keys):
            if i:
                time.sleep(1.0)
            psql(db, f"UPDATE products SET at_ns = {NOW_NS}, price_cents = price_cents + 1 WHERE id = {key}")
        while True:
            m = host.mark()
            if m["samples"] >= before["samples"] + len(keys):
                break
            if time.time() - t > 300:
                return None, None
            time.sleep(0.05)
        took = time.time() - t
        time.sleep(1.5)
        m = host.mark()
        return took, m["bytes_down"] + m["bytes_up"] - before["bytes_down"] - before["bytes_up"]

    t_ok, b_ok = two([1, 2], False)
    t_lost, b_lost = two([3, 4], True)
    return {"heal_normal_s": t_ok, "heal_normal_bytes": b_ok, "heal_lost_s": t_lost, "heal_lost_bytes": b_lost}


def median(runs, key):
    vals = [r[key] for r in runs if r.get(key) is not None and r[key] == r[key]]
    return statistics.median(vals) if vals else float("nan")


def machine():
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().split("\n")
                if l.startswith("model name")), "unknown")
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    pg = scalar("postgres", "SHOW server_version")
    return {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "ferry": git, "postgres": pg}


def plan(quick):
    streams = [(mode, m) for mode in ["broadcast", "assigned"] for m in [10, 100, 1000]]
    pts = [dict(products=100_000, replicas=r) for r in [1, 10]]
    pts += [dict(products=10_000, replicas=r, streams=streams, seconds=4 if quick else 8) for r in [1, 10, 100]]
    pts.append(dict(products=10_000, replicas=1, heal=True))
    # The way up: R replicas writing W sales a second each.
    up_secs = int(os.environ.get("SIDE_UP_SECS", 5 if quick else 10))
    pts += [dict(products=1_000, replicas=r, writes=[(w, up_secs)]) for r, w in [(1, 100), (10, 10), (100, 1)]]
    # A store offline for a day of writes: 10,000 sales (a busy till's day), then back.
    pts.append(dict(products=1_000, replicas=1, offline=[(500, 4 if quick else 20)]))
    return pts


def main():
    quick = "--quick" in sys.argv
    only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")]
    runs = 1 if quick else 3
    for b in [FERRY, FERRY_HOST, MAGIC_SERVER, MAGIC_HOST]:
        if not Path(b).exists():
            sys.exit(f"{b} is missing: run bench/sync/side, which builds everything")
    WORK.mkdir(parents=True, exist_ok=True)
    raw = WORK / "raw.jsonl"
    results = []
    pts = plan(quick)
    if only:
        pts = [p for p in pts if any(o in json.dumps(p) for o in only)]
    for i, p in enumerate(pts):
        for run in range(runs):
            for engine in ENGINES:
                log(f"[{i + 1}/{len(pts)} run {run + 1}/{runs}] {engine} {p}")
                try:
                    rs = point(engine, **p)
                except Exception as e:  # a point that fails is reported, not fatal
                    log(f"  failed: {e}")
                    rs = [{"engine": engine, "products": p["products"], "replicas": p["replicas"],
                           "failed": str(e)[:300]}]
                for r in rs:
                    r["run"] = run
                    results.append(r)
                    with raw.open("a") as f:
                        f.write(json.dumps(r) + "\n")
                    log("  " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()
                                           if k not in ("engine", "products", "replicas")}))
    (WORK / "machine.json").write_text(json.dumps(machine()))
    log(f"raw results in {raw}; report with bench/sync/side_report.py {raw}")


if __name__ == "__main__":
    main()
