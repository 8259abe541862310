"""Turns bench/sync/run's JSON lines into bench/results/sync.md (medians per point)."""
import json, platform, statistics, subprocess, sys, datetime

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def med(xs): return statistics.median(xs) if xs else float("nan")
def sh(cmd):
    try: return subprocess.check_output(cmd, shell=True, text=True).strip()
    except Exception: return "?"

print("# ferry-sync: figures (ferry alone)\n")
print(f"Measured {datetime.date.today()} by `bench/sync/run`; commit {sh('git rev-parse --short HEAD')}.")
print(f"Machine: {sh('nproc')} cores, {platform.processor() or platform.machine()}, "
      f"{sh('psql -V')}, relay, serve, the replicas and the writer in one process "
      "(`ferry-bench-sync`), replicas over the HTTP transport.\n")
print("**Not yet side by side with magic_sync 0.5.1**, which issue 27 asks for; the "
      "ratios against it are the next step. Medians of the runs of each point.\n")
held = [r for r in rows if r["bench"] == "held"]
if held:
    h = held[-1]
    print("## Held state (broadcast)\n")
    print("| rows | replicas | held state | one row per replica per row (estimated) | ratio | first provisioning pass |")
    print("|---|---|---|---|---|---|")
    print(f"| {h['rows']:,} | {h['replicas']:,} | {h['held_bytes']/1e6:.2f} MB | "
          f"{h['per_row_held_bytes_estimate']/1e9:.2f} GB | {h['ratio_pct']:.3f} % | {h['provision_pass_s']:.1f} s |\n")
    print("Held state is `ferry_sync.rows`, `replicas`, `held` and `points` after every "
          "replica confirmed (no outbox left). The estimate is a table shaped like "
          "magic_sync's `sync.held` filled for 20 replicas and scaled. Target: under 5 %.\n")
lag = [r for r in rows if r["bench"] == "lag"]
groups = {}
for r in lag: groups.setdefault((r["rows"], r["replicas"], r["rate"]), []).append(r)
print("## Provisioning and change-to-applied lag\n")
print("| rows | replicas | changes/s | provisioning | lag p50 | p99 | max | first third p50 → last third p50 | WAL per change | harness CPU per 1,000 changes |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (n, r, m), g in sorted(groups.items()):
    print(f"| {n:,} | {r} | {m} | {med([x['provision_s'] for x in g]):.2f} s | "
          f"{med([x['p50_ms'] for x in g]):.1f} ms | {med([x['p99_ms'] for x in g]):.1f} ms | "
          f"{med([x['max_ms'] for x in g]):.0f} ms | {med([x['first_third_p50_ms'] for x in g]):.1f} → "
          f"{med([x['last_third_p50_ms'] for x in g]):.1f} ms | {med([x['wal_bytes_per_change'] for x in g]):,.0f} B | "
          f"{med([x['harness_cpu_ms_per_1000_changes'] for x in g]):,.0f} ms |")
print("\nLag is from the change's commit (a timestamp the writer puts in the row) to the "
      "moment the replica's apply committed, for every replica. Harness CPU counts the "
      "relay, the serve and every replica together; Postgres's CPU is not counted.")
