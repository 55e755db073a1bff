"""The pgqueuer peer's worker process: ``python -m bench.pgqueuer_worker --db-url URL``.

pgqueuer used as a library, the way its documentation shows: a ``QueueManager`` over an
asyncpg connection (``AsyncpgDriver``, pgqueuer's primary driver: its psycopg driver
holds the connection for up to a second while it waits for a notification, which
delays the dequeue queries behind it), one entrypoint, ``run`` until SIGTERM. A job is
one step of a workflow (``bench/peers.py``): in **one transaction** on a pooled asyncpg
connection it writes the step's effect row and enqueues the next step (pgqueuer's
queue is a Postgres table, so the enqueue commits with the effect). A redelivered job
(its effect already there) records the redelivery and enqueues nothing: the first
delivery's transaction already did.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from datetime import timedelta
from typing import Final

import asyncpg  # type: ignore[import-untyped, import-not-found, unused-ignore]
import orjson
import psycopg
from pgqueuer import (  # type: ignore[import-not-found, unused-ignore]
    AsyncpgDriver,
    Queries,
    QueueManager,
)
from pgqueuer.models import Job  # type: ignore[import-not-found, unused-ignore]

from bench.peers import STEPS

ENTRYPOINT: Final = "bench_step"
# bench/peers.py's statements, in asyncpg's placeholders
INSERT_EFFECT: Final = (
    "INSERT INTO effects (workflow_id, step) VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING 1"
)
INSERT_REDELIVERY: Final = "INSERT INTO redeliveries (workflow_id, step) VALUES ($1, $2)"


def payload(workflow: str, step: int) -> bytes:
    return orjson.dumps([workflow, step])


def _connect_args(conninfo: str) -> dict[str, object]:
    """asyncpg's keyword arguments for a libpq connection string (the harness's form)."""
    given = psycopg.conninfo.conninfo_to_dict(conninfo)
    names = {"host": "host", "port": "port", "user": "user", "password": "password"}
    args: dict[str, object] = {v: given[k] for k, v in names.items() if given.get(k)}
    args["database"] = given.get("dbname")
    return args


async def run(db_url: str, *, batch_size: int, max_tasks: int, pool_size: int) -> None:
    args = _connect_args(db_url)
    conn = await asyncpg.connect(
        **args, server_settings={"application_name": "bench-pgqueuer-manager"}
    )
    pool = await asyncpg.create_pool(
        **args,
        min_size=pool_size,
        max_size=pool_size,
        server_settings={"application_name": "bench-pgqueuer-job"},
    )
    queries = Queries(AsyncpgDriver(conn))
    qm = QueueManager(queries)

    async def step(job: Job) -> None:
        workflow, n = orjson.loads(job.payload or b"null")
        async with pool.acquire() as c, c.transaction():
            if await c.fetchrow(INSERT_EFFECT, workflow, n) is None:
                await c.execute(INSERT_REDELIVERY, workflow, n)
            elif n < STEPS:
                # the same query builders, on this transaction's connection
                await dataclasses.replace(queries, driver=AsyncpgDriver(c)).enqueue(
                    ENTRYPOINT, payload(workflow, n + 1)
                )

    qm.entrypoint(ENTRYPOINT)(step)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, qm.shutdown.set)
    try:
        await qm.run(
            batch_size=batch_size,
            max_concurrent_tasks=max_tasks,
            dequeue_timeout=timedelta(seconds=5),
        )
    finally:
        await pool.close()
        await conn.close()


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pgqueuer_worker")
    p.add_argument("--db-url", required=True)
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--max-tasks", type=int, default=20)
    p.add_argument("--pool-size", type=int, default=5)
    a = p.parse_args()
    asyncio.run(
        run(a.db_url, batch_size=a.batch_size, max_tasks=a.max_tasks, pool_size=a.pool_size)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
