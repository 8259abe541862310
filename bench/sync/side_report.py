#!/usr/bin/env python3
"""Turns bench/sync/side.py's raw lines (and the held-state line of `ferry-bench-sync
held`) into bench/results/sync.md and bench/results/sync-lag.png: medians per point,
ferry against magic_sync 0.5.1 as ratios.

    side_report.py RAW.jsonl HELD.jsonl MACHINE.json
"""

import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench/results"
F, M = "ferry", "magic_sync 0.5.1"


def med(runs, key):
    vals = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and r[key] == r[key]]
    return statistics.median(vals) if vals else float("nan")


def fmt(x, digits=1, unit=""):
    if x != x:
        return "—"
    return f"{x:,.{digits}f}{unit}"


def ratio(a, b, digits=1):
    """How many times b is a (b / a): above 1 means ferry's a is smaller."""
    if a != a or b != b or a == 0:
        return "—"
    return f"{b / a:,.{digits}f}×"


def main():
    raw = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
    held = [json.loads(l) for l in open(sys.argv[2]) if l.startswith("{")] if len(sys.argv) > 2 else []
    machine = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else {}
    groups = {}
    for r in raw:
        key = (r["products"], r["replicas"], r.get("rate", 0), r.get("mode", "broadcast"), "heal_lost_bytes" in r)
        groups.setdefault(key, {}).setdefault(r["engine"], []).append(r)
    runs = max((len(v) for g in groups.values() for v in g.values()), default=0)
    failed = [r for r in raw if "failed" in r]

    out = ["# ferry-sync side by side with magic_sync 0.5.1", ""]
    out.append(f"Measured {datetime.date.today()} by `bench/sync/run`; ferry at commit {machine.get('ferry', '?')}, "
               f"magic_sync 0.5.1 from crates.io (harness: `bench/sync/magic`). Machine: {machine.get('cpu', '?')}, "
               f"{machine.get('cores', '?')} cores, Linux {machine.get('kernel', '?')}, PostgreSQL {machine.get('postgres', '?')} "
               f"on loopback. **Medians of {runs} runs** of each point, engines interleaved.")
    out.append("")
    out.append("Each engine runs as its own server process (`ferry sync serve`; magic_sync's `Server` with a "
               "loopback store-and-forward queue served over HTTP by our harness) and one replica host process "
               "with R replicas, one SQLite file each (WAL, `synchronous=FULL`), both engines' own replica loops. "
               "The writer is a psql session at a fixed rate. Lag: from the change's commit (Postgres's clock in "
               "the row) to the replica's apply, every replica. Server CPU: the engine's server process plus "
               "every Postgres process, over the stream, per 1,000 changes. Wire bytes: frames down and reports "
               "up as the replica hosts' transports counted them, per delivery (a change to one replica). "
               "Sync schema: every relation outside `public` after the run. Method and contract: "
               "`bench/sync/side.py`, `bench/sync/magic/README.md`.")
    out.append("")
    if failed:
        out.append(f"**{len(failed)} runs failed** (listed at the end); a point's medians are over the runs that finished.")
        out.append("")

    # Targets.
    t = []
    if held:
        h = held[-1]
        t.append(("held state for a broadcast table, 10k rows × 1,000 replicas, under 5 % of one row per replica per row",
                  f"{h['held_bytes'] / 1e6:.2f} MB vs {h['per_row_held_bytes_estimate'] / 1e9:.2f} GB ({h['ratio_pct']:.3f} %)",
                  h["ratio_pct"] < 5))
    cpu = groups.get((10_000, 100, 100, "broadcast", False), {})
    fc, mc = med(cpu.get(F, []), "server_cpu_ms_per_1000"), med(cpu.get(M, []), "server_cpu_ms_per_1000")
    t.append(("server CPU per change at R = 100 broadcast (100 changes/s) at least 3× below magic_sync's",
              f"{fmt(fc, 0)} vs {fmt(mc, 0)} ms per 1,000 changes ({ratio(fc, mc)})", mc == mc and fc * 3 <= mc))
    lag = cpu.get(F, [])
    p99 = med(lag, "p99_ms")
    t.append(("change-to-applied p99 under 100 ms at 100 changes/s to R = 100", f"{fmt(p99)} ms (magic_sync {fmt(med(cpu.get(M, []), 'p99_ms'))} ms)",
              p99 < 100))
    p100 = [r for r in raw if r["products"] == 100_000 and r["replicas"] == 1 and "failed" not in r]
    fp = med([r for r in p100 if r["engine"] == F], "provision_s")
    mp = med([r for r in p100 if r["engine"] == M], "provision_s")
    t.append(("provisioning 100k rows under 10 s and at least 2× faster than magic_sync",
              f"{fmt(fp, 2)} s vs {fmt(mp, 2)} s ({ratio(fp, mp)})", fp < 10 and mp == mp and fp * 2 <= mp))
    heal = groups.get((10_000, 1, 0, "broadcast", True), {}).get(F, [])
    hl, hn = med(heal, "heal_lost_bytes"), med(heal, "heal_normal_bytes")
    t.append(("healing one lost message costs under 2× that message's bytes",
              f"{fmt(hl, 0)} B against {fmt(hn, 0)} B for the same two changes delivered normally ({fmt(hl / hn if hn else float('nan'), 2)}×)",
              hn == hn and hl < 2 * hn))
    out += ["## Targets (issue 27)", "", "| target | measured | met |", "|---|---|---|"]
    out += [f"| {a} | {b} | {'yes' if ok else 'NO'} |" for a, b, ok in t]
    out.append("")
    ups = {k: g for k, g in groups.items() if k[3] == "up"}
    if ups:
        u = []
        g100 = ups.get((1_000, 100, 1, "up", False), {})
        p99 = med(g100.get(F, []), "p99_ms")
        u.append(("commit-to-filed p99 under 100 ms at R = 100 replicas × 1 record/s",
                  f"{fmt(p99)} ms (magic_sync {fmt(med(g100.get(M, []), 'p99_ms'))} ms)", p99 < 100))
        fc, mc = med(g100.get(F, []), "filing_cpu_ms_per_1000"), med(g100.get(M, []), "filing_cpu_ms_per_1000")
        gf, gm = med(g100.get(F, []), "server_cpu_ms_per_1000"), med(g100.get(M, []), "server_cpu_ms_per_1000")
        u.append(("filing CPU at least 2× below magic_sync's (R = 100 × 1 record/s)",
                  f"{fmt(fc, 0)} vs {fmt(mc, 0)} ms per 1,000 records, net of each server's idle CPU "
                  f"({ratio(fc, mc)}); gross {fmt(gf, 0)} vs {fmt(gm, 0)} ({ratio(gf, gm)})", mc == mc and fc * 2 <= mc))
        once = [r for r in raw if r.get("mode") == "up" and r["engine"] == F and "failed" not in r]
        u.append(("every record filed exactly once (every way-up run)",
                  f"{sum(1 for r in once if r.get('exactly_once'))} of {len(once)} ferry runs; magic_sync "
                  f"{sum(1 for r in raw if r.get('mode') == 'up' and r['engine'] == M and r.get('exactly_once'))} of "
                  f"{sum(1 for r in raw if r.get('mode') == 'up' and r['engine'] == M and 'failed' not in r)}",
                  bool(once) and all(r.get("exactly_once") for r in once)))
        out += ["## Targets (issue 28, the way up, so far)", "", "| target | measured | met |", "|---|---|---|"]
        out += [f"| {a} | {b} | {'yes' if ok else 'NO'} |" for a, b, ok in u]
        out.append("")

    out += ["## Provisioning", "",
            "From the stores turning live to every replica holding all its rows (N products, 10 orders each).", "",
            "| products | replicas | ferry | magic_sync | magic_sync / ferry | bytes down, ferry | magic_sync |",
            "|---|---|---|---|---|---|---|"]
    prov = {}
    for r in raw:
        if "heal_lost_bytes" in r or "failed" in r or r.get("mode") in ("up", "offline"):
            continue
        # One provisioning per run: a run's streams repeat its figures.
        g = prov.setdefault((r["products"], r["replicas"]), {}).setdefault(r["engine"], {})
        g.setdefault(r["run"], r)
    prov = {k: {e: list(v.values()) for e, v in g.items()} for k, g in prov.items()}
    for (n, r) in sorted(prov):
        g = prov[(n, r)]
        a, b = med(g.get(F, []), "provision_s"), med(g.get(M, []), "provision_s")
        out.append(f"| {n:,} | {r} | {fmt(a, 2)} s | {fmt(b, 2)} s | {ratio(a, b)} | "
                   f"{fmt(med(g.get(F, []), 'provision_bytes') / 1e6, 2)} MB | {fmt(med(g.get(M, []), 'provision_bytes') / 1e6, 2)} MB |")
    out.append("")

    out += ["## Steady streams", "",
            "10,000 products; broadcast: updates to 100 hot products (each reaches every replica); "
            "assigned: updates to orders spread over the replicas (each reaches one).", "",
            "| mode | R | changes/s | lag p50 ferry / magic | p99 ferry / magic | lag grows? (first → last third p50, ms) | "
            "server CPU per 1,000 changes, ferry / magic (ratio) | WAL per change | wire bytes per delivery | sync schema |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(k for k in groups if k[2] and k[3] not in ("up", "offline")):
        n, r, rate, mode, _ = key
        g = groups[key]
        f, m = g.get(F, []), g.get(M, [])

        def pair(k, d=1, unit=""):
            return f"{fmt(med(f, k), d)} / {fmt(med(m, k), d)}{unit}"

        grow = (f"{fmt(med(f, 'first_third_p50_ms'), 0)} → {fmt(med(f, 'last_third_p50_ms'), 0)} / "
                f"{fmt(med(m, 'first_third_p50_ms'), 0)} → {fmt(med(m, 'last_third_p50_ms'), 0)}")
        fc, mc = med(f, "server_cpu_ms_per_1000"), med(m, "server_cpu_ms_per_1000")
        out.append(f"| {mode} | {r} | {rate:,} | {pair('p50_ms', 1, ' ms')} | {pair('p99_ms', 1, ' ms')} | {grow} | "
                   f"{fmt(fc, 0)} / {fmt(mc, 0)} ({ratio(fc, mc)}) | {pair('wal_bytes_per_change', 0, ' B')} | "
                   f"{pair('wire_bytes_per_delivery', 0, ' B')} | "
                   f"{fmt(med(f, 'sync_schema_bytes') / 1e6, 1)} / {fmt(med(m, 'sync_schema_bytes') / 1e6, 1)} MB |")
    out.append("")
    out.append("A sample is one row version applied on one replica; when a row changes twice before a message "
               "carries it, an engine that sends the latest version (both do) applies it once, so samples can be "
               "fewer than changes × replicas. `—`: no figure (the run failed or took no samples).")
    out.append("")

    if ups:
        out += ["## The way up", "",
                "R replicas, each an app writing W sales a second into its SQLite file (one row a transaction, "
                "open loop, replica i offset by i/R of an interval) into a table the replica writes and the "
                "server files. Lag: from the app's commit (its wall clock in the row) to the row's insert into "
                "Postgres (a trigger neither engine knows of records the clock). Server CPU: as above, from the "
                "first write until the last is filed, per 1,000 records; filing CPU is that less what the same "
                "stretch costs the server idle (its long polls, reports and keepalives, measured over the 10 s "
                "just before), and the idle cost is shown per second. Exactly once: every sale in the "
                "server's table once, none missing. Both engines at their default settings (magic_sync's "
                "replica looks for rows to upload every second: `bench/sync/magic/README.md`).", "",
                "| R | records/s each | commit-to-filed p50 ferry / magic | p99 ferry / magic | "
                "server CPU per 1,000 records, ferry / magic (ratio) | filing CPU (net of idle) | "
                "idle CPU per s | filed exactly once, ferry / magic |",
                "|---|---|---|---|---|---|---|---|"]
        for key in sorted(ups, key=lambda k: k[1]):
            _, r, rate, _, _ = key
            f, m = ups[key].get(F, []), ups[key].get(M, [])
            fc, mc = med(f, "server_cpu_ms_per_1000"), med(m, "server_cpu_ms_per_1000")
            nf, nm = med(f, "filing_cpu_ms_per_1000"), med(m, "filing_cpu_ms_per_1000")
            ok = lambda rs: f"{sum(1 for x in rs if x.get('exactly_once'))}/{len(rs)} runs"
            out.append(f"| {r} | {rate} | {fmt(med(f, 'p50_ms'))} / {fmt(med(m, 'p50_ms'))} ms | "
                       f"{fmt(med(f, 'p99_ms'))} / {fmt(med(m, 'p99_ms'))} ms | {fmt(fc, 0)} / {fmt(mc, 0)} ({ratio(fc, mc)}) | "
                       f"{fmt(nf, 0)} / {fmt(nm, 0)} ({ratio(nf, nm)}) | "
                       f"{fmt(med(f, 'idle_cpu_ms_per_s'), 0)} / {fmt(med(m, 'idle_cpu_ms_per_s'), 0)} ms | "
                       f"{ok(f)} / {ok(m)} |")
        out.append("")

    offs = {k: g for k, g in groups.items() if k[3] == "offline"}
    if offs:
        out += ["## A store offline for a day of writes", "",
                "One store reaches its server through a TCP relay the benchmark can cut (`Link` in "
                "`bench/sync/side.py`: every connection closed, new ones refused at once). With the link cut, the "
                "store's app writes W sales a second for S seconds (a busy till's day, written faster than a "
                "day), the link stays cut 20 s more so each engine's wait before trying again has grown, then it "
                "comes back. From its return: time to the first byte over the link (the engine's wait), time until "
                "the last sale is filed, and the bytes each way over the link meanwhile (HTTP headers included, the "
                "same relay for both).", "",
                "| sales | first byte after return, ferry / magic | all filed, ferry / magic | bytes up per sale, "
                "ferry / magic (ratio) | bytes down | filed exactly once, ferry / magic |",
                "|---|---|---|---|---|---|"]
        for key in sorted(offs):
            f, m = offs[key].get(F, []), offs[key].get(M, [])
            bf, bm = med(f, "bytes_up_per_record"), med(m, "bytes_up_per_record")
            ok = lambda rs: f"{sum(1 for x in rs if x.get('exactly_once'))}/{len(rs)} runs"
            out.append(f"| {fmt(med(f or m, 'changes'), 0)} | {fmt(med(f, 'first_byte_s'), 2)} / {fmt(med(m, 'first_byte_s'), 2)} s | "
                       f"{fmt(med(f, 'back_in_s'), 2)} / {fmt(med(m, 'back_in_s'), 2)} s | "
                       f"{fmt(bf, 0)} / {fmt(bm, 0)} B ({ratio(bf, bm)}) | "
                       f"{fmt(med(f, 'bytes_down') / 1e3, 1)} / {fmt(med(m, 'bytes_down') / 1e3, 1)} kB | {ok(f)} / {ok(m)} |")
        out.append("")

    hk = groups.get((10_000, 1, 0, "broadcast", True), {})
    if hk:
        out += ["## Healing one lost message", "",
                "One replica, 10,000 products. Two changes a second apart delivered normally, then two more where "
                "the transport loses the first one's message (the second reveals the loss to an engine that waits "
                "for a gap). ferry: the fetch's answer is lost (its outbox keeps the message; the replica asks again from "
                "its position). magic_sync: the harness's store-and-forward queue takes the message and drops it "
                "(magic_sync heals by its own means; its settings are in `bench/sync/magic/README.md`). Bytes are "
                "both directions until both changes are applied and their reports have gone up; time from the "
                "first change until both are applied.", "",
                "| engine | normal: time, bytes | one lost: time, bytes | bytes ratio |", "|---|---|---|---|"]
        for e in [F, M]:
            g = hk.get(e, [])
            a, b = med(g, "heal_normal_bytes"), med(g, "heal_lost_bytes")
            out.append(f"| {e} | {fmt(med(g, 'heal_normal_s'), 2)} s, {fmt(a, 0)} B | {fmt(med(g, 'heal_lost_s'), 2)} s, "
                       f"{fmt(b, 0)} B | {fmt(b / a if a else float('nan'), 2)}× |")
        out.append("")

    if held:
        h = held[-1]
        out += ["## Held state (ferry alone, one run: sizes do not vary)", "",
                f"{h['rows']:,} broadcast rows provisioned to {h['replicas']:,} replicas and confirmed: ferry-sync's held state "
                f"(`ferry_sync.rows`, `replicas`, `held`, `points`) is {h['held_bytes'] / 1e6:.2f} MB; a table shaped "
                f"like magic_sync's `sync.held` (one row per replica per row), filled for 20 replicas and scaled, "
                f"would be {h['per_row_held_bytes_estimate'] / 1e9:.2f} GB ({h['ratio_pct']:.3f} %). The side-by-side "
                "streams above measure both engines' whole sync schemas at R ≤ 100.", ""]
    out += ["![lag](sync-lag.png)", ""]
    if failed:
        out += ["## Failed runs", ""]
        out += [f"- {r['engine']} {({k: r[k] for k in ('products', 'replicas', 'rate', 'mode') if k in r})}: {r['failed']}"
                for r in failed]
        out.append("")
    (RESULTS / "sync.md").write_text("\n".join(out))
    plot(groups)


def plot(groups):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, mode in zip(axes, ["broadcast", "assigned"]):
        for engine, style in [(F, "-"), (M, "--")]:
            for rate, color in [(10, "tab:blue"), (100, "tab:orange"), (1000, "tab:green")]:
                xs, ys = [], []
                for r in [1, 10, 100]:
                    g = groups.get((10_000, r, rate, mode, False), {}).get(engine, [])
                    y = med(g, "p99_ms")
                    if y == y:
                        xs.append(r)
                        ys.append(y)
                if xs:
                    ax.plot(xs, ys, style, marker="o", color=color, label=f"{engine}, {rate}/s")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("replicas")
        ax.set_title(f"{mode}: change-to-applied p99")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ms (log)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "sync-lag.png", dpi=110)


if __name__ == "__main__":
    main()
