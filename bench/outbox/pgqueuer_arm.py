#!/usr/bin/env python3
"""The Postgres-queue arm of bench/outbox: pgqueuer (installed from PyPI by
bench/outbox/run) drains N jobs of 256 B, each handler publishing its job to JetStream
with Nats-Msg-Id and awaiting the acknowledgement, as a relay would. Prints one JSON
line.

  pgqueuer_arm.py --dsn DSN --nats URL --n N --batch B
"""

import argparse
import asyncio
import json
import time

import asyncpg
import nats
from pgqueuer import AsyncpgDriver, Queries, QueueManager
from pgqueuer.types import QueueExecutionMode


async def main(a):
    conn = await asyncpg.connect(a.dsn)
    driver = AsyncpgDriver(conn)
    q = Queries(driver)
    await q.install()
    body = b"x" * 256
    for i in range(0, a.n, 1000):
        k = min(1000, a.n - i)
        await q.enqueue(["publish"] * k, [body] * k, [0] * k)
    nc = await nats.connect(a.nats)
    js = nc.jetstream()
    published = 0

    qm = QueueManager(q)

    @qm.entrypoint("publish")
    async def publish(job):
        nonlocal published
        await js.publish("bench.pgq", job.payload, headers={"Nats-Msg-Id": f"pgq-{job.id}"})
        published += 1

    start = time.time()
    await qm.run(batch_size=a.batch, mode=QueueExecutionMode.drain, dequeue_timeout=__import__("datetime").timedelta(seconds=1))
    secs = time.time() - start
    await nc.close()
    await conn.close()
    print(json.dumps({"messages": a.n, "published": published, "secs": secs, "per_sec": published / secs}))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--dsn", required=True)
    p.add_argument("--nats", required=True)
    p.add_argument("--n", type=int, default=30000)
    p.add_argument("--batch", type=int, default=100)
    asyncio.run(main(p.parse_args()))
