"""What the peer arms of bench/flow share: ports, CPU seconds, percentiles."""

import os
import resource
import socket
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def wait_port(port, what, limit=60):
    end = time.time() + limit
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {limit}s")


def proc_cpu(pid):
    """User + system seconds of a process (all its threads) and its reaped children."""
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")


def self_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def pct(sorted_us, p):
    if not sorted_us:
        return float("nan")
    return sorted_us[round(p / 100 * (len(sorted_us) - 1))]


def spread(us):
    us = sorted(us)
    return {"n": len(us), "p50_us": pct(us, 50), "p99_us": pct(us, 99), "p999_us": pct(us, 99.9),
            "max_us": pct(us, 100)}


def parse_args(p):
    """Parse an arm's arguments, with those every arm takes added: the workload, its
    steps per workflow (W1 200, W2 10 unless given) and W2's number of workflows."""
    p.add_argument("workload", choices=["w1", "w2"])
    p.add_argument("--steps", type=int)
    p.add_argument("--n", type=int, default=1000)
    a = p.parse_args()
    if a.steps is None:
        a.steps = 200 if a.workload == "w1" else 10
    return a
