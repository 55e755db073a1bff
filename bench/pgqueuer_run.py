"""The pgqueuer run: its own database, pgqueuer's schema installed by pgqueuer, N worker
processes (``bench/pgqueuer_worker.py``), the three phases of ``bench/peers.py`` and the
exactness check. pgqueuer needs no broker: RabbitMQ's CPU is not counted as its own."""

from __future__ import annotations

import asyncio
import importlib.metadata
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from bench.common import BenchFailure
from bench.peers import STEPS, Harness, PeerResult, all_ids, create_effects, percentile
from bench.processes import spawn, stop_all
from bench.resources import drop_database
from workers.harness import env
from workers.settings import Settings

DB = "custody_bench_pgqueuer"
GROUP = "pgqueuer"
BATCH_SIZE = 10  # pgqueuer's default
MAX_TASKS = 20  # per worker: the least pgqueuer accepts for that batch size (2 x batch)
POOL_SIZE = 5  # per worker, for the jobs' transactions (pgqueuer's own pool default)


async def _wait_workers(
    conn: psycopg.AsyncConnection[tuple[Any, ...]], procs: Sequence[subprocess.Popen[bytes]]
) -> None:
    """Until every worker has connected its queue manager (the warm-up then shows that
    they consume)."""
    deadline = time.monotonic() + 60
    while True:
        row = await (
            await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'bench-pgqueuer-manager'"
            )
        ).fetchone()
        if row is not None and int(row[0]) >= len(procs):
            return
        dead = [p.returncode for p in procs if p.poll() is not None]
        if dead:
            raise BenchFailure(f"a pgqueuer worker exited while starting: {dead}")
        if time.monotonic() > deadline:
            raise BenchFailure("the pgqueuer workers did not connect")
        await asyncio.sleep(0.2)


async def _wait_queue_empty(conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
    """Every job finished and logged (the workers buffer their completions briefly)."""
    deadline = time.monotonic() + 15
    while True:
        row = await (await conn.execute("SELECT count(*) FROM pgqueuer")).fetchone()
        if row is None or int(row[0]) == 0:
            return
        if time.monotonic() > deadline:
            raise BenchFailure(f"pgqueuer: {row[0]} jobs still in the queue after the run")
        await asyncio.sleep(0.2)


async def run_pgqueuer(
    settings: Settings,
    *,
    workflows: int,
    warmup: int,
    light: int,
    workers: int,
    logs: Path,
) -> PeerResult:
    try:  # imported here: pgqueuer is an optional dependency
        from pgqueuer import (  # type: ignore[import-not-found, unused-ignore]
            PsycopgDriver,
            Queries,
        )

        from bench import pgqueuer_worker
    except ImportError as exc:
        raise BenchFailure(
            f"pgqueuer is not installed ({exc}): `make bench` installs the bench extra,"
            " or run `.venv/bin/pip install -e '.[bench]'`"
        ) from exc
    db_url = env.with_db(settings.database_url, DB)
    admin_url = env.with_db(settings.database_url, "postgres")
    version = importlib.metadata.version("pgqueuer")
    print(
        f"pgqueuer {version}: {workflows} workflows of 3 chained jobs (+{warmup} warm-up,"
        f" {light} one at a time), {workers} worker processes",
        flush=True,
    )
    await env.reset_database(db_url)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        await create_effects(db_url)
        async with await psycopg.AsyncConnection.connect(
            db_url, autocommit=True, application_name="bench-client"
        ) as client:
            queries = Queries(PsycopgDriver(client))
            await queries.install()
            for i in range(1, workers + 1):
                procs[f"pgqueuer worker-{i}"] = spawn(
                    [
                        sys.executable,
                        "-m",
                        "bench.pgqueuer_worker",
                        "--db-url",
                        db_url,
                        "--batch-size",
                        str(BATCH_SIZE),
                        "--max-tasks",
                        str(MAX_TASKS),
                        "--pool-size",
                        str(POOL_SIZE),
                    ],
                    logs / f"pgqueuer-worker-{i}.log",
                )
            await _wait_workers(client, list(procs.values()))

            async def submit(ids: Sequence[str]) -> None:
                """The first step of every workflow, in one batched ``enqueue``."""
                await queries.enqueue(
                    [pgqueuer_worker.ENTRYPOINT] * len(ids),
                    [pgqueuer_worker.payload(wf, 1) for wf in ids],
                    [0] * len(ids),
                )

            # the broker is not pgqueuer's: its CPU counts as another workload's
            groups = {**dict.fromkeys(procs, GROUP), "rabbitmq (beam.smp)": "other"}
            async with Harness("pgqueuer", db_url, admin_url, DB, procs, groups) as h:
                ph = await h.phases(submit, warmup=warmup, light=light, workflows=workflows)
                effects, redeliveries = await h.check_exact(all_ids(warmup, light, workflows))
            await _wait_queue_empty(client)
        codes = stop_all(list(procs.values()), grace_s=20)
        procs = {}
        if any(codes):
            raise BenchFailure(f"a pgqueuer worker did not stop cleanly: exit codes {codes}")
        return PeerResult(
            system="pgqueuer",
            version=version,
            setup=f"{workers} worker processes (one QueueManager each)",
            settings=[
                "durable (logged) tables, pgqueuer's default; LISTEN/NOTIFY wake-ups",
                f"`batch_size={BATCH_SIZE}` (the default), `max_concurrent_tasks={MAX_TASKS}`"
                f" per worker, a pool of {POOL_SIZE} connections per worker for the jobs",
                "a job writes its effect and enqueues the next step in one transaction;"
                " its completion is logged by pgqueuer afterwards (buffered)",
                f"the first steps submitted in one batched `enqueue` call ({STEPS} steps"
                " per workflow)",
            ],
            group=GROUP,
            processes=workers,
            workflows=workflows,
            seconds=ph.seconds,
            warmup=warmup,
            light_workflows=light,
            light_step_p50_ms=percentile(ph.light_step_ms, 0.5),
            light_step_p99_ms=percentile(ph.light_step_ms, 0.99),
            light_wf_p50_ms=percentile(ph.light_wf_ms, 0.5),
            light_wf_p99_ms=percentile(ph.light_wf_ms, 0.99),
            effects=effects,
            redeliveries=redeliveries,
            cpu=ph.cpu,
            checks=["no job left in the queue", "clean SIGTERM shutdown"],
        )
    finally:
        stop_all(list(procs.values()), grace_s=20)
        await drop_database(db_url)
