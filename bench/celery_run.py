"""The Celery run: its own database and vhost, one prefork worker (``bench/celery_app.py``),
the three phases of ``bench/peers.py`` and the exactness check."""

from __future__ import annotations

import asyncio
import importlib.metadata
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import BenchFailure
from bench.peers import Harness, PeerResult, all_ids, create_effects, percentile
from bench.processes import spawn, stop_all
from bench.resources import drop_database, fresh_vhost
from workers.harness import env
from workers.io import broker
from workers.settings import Settings

DB = "custody_bench_celery"
VHOST = "custody-bench-celery"
GROUP = "celery"


async def _wait_consumer(settings: Settings, queue: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 90
    path = f"/api/queues/{VHOST}?columns=name,consumers,arguments"
    while True:
        rows = await broker.management(settings.amqp_management_url, "GET", path)
        for r in rows or []:
            if r["name"] == queue and int(r.get("consumers") or 0) >= 1:
                kind = (r.get("arguments") or {}).get("x-queue-type")
                if kind != "quorum":
                    raise BenchFailure(f"celery: {queue} is a {kind!r} queue, not a quorum one")
                return
        if proc.poll() is not None:
            raise BenchFailure(f"the Celery worker exited while starting ({proc.returncode})")
        if time.monotonic() > deadline:
            raise BenchFailure(f"the Celery worker did not consume {queue}: {rows}")
        await asyncio.sleep(0.3)


async def _wait_queue_empty(settings: Settings, queue: str) -> None:
    """The broker holds nothing once every effect is in (its statistics lag by up to
    ``collect_statistics_interval``, 5 s by default)."""
    deadline = time.monotonic() + 20
    path = f"/api/queues/{VHOST}?columns=name,messages"
    while True:
        rows = await broker.management(settings.amqp_management_url, "GET", path)
        left = {r["name"]: int(r.get("messages") or 0) for r in rows or [] if r["name"] == queue}
        if left and not any(left.values()):
            return
        if time.monotonic() > deadline:
            raise BenchFailure(f"celery: messages left in the broker after the run: {left}")
        await asyncio.sleep(0.5)


async def run_celery(
    settings: Settings,
    *,
    workflows: int,
    warmup: int,
    light: int,
    concurrency: int,
    logs: Path,
) -> PeerResult:
    try:
        from bench import celery_app  # imported here: Celery is an optional dependency
    except ImportError as exc:
        raise BenchFailure(
            f"Celery is not installed ({exc}): `make bench` installs the bench extra,"
            " or run `.venv/bin/pip install -e '.[bench]'`"
        ) from exc
    queue = celery_app.QUEUE
    db_url = env.with_db(settings.database_url, DB)
    admin_url = env.with_db(settings.database_url, "postgres")
    amqp_url = env.with_vhost(settings.amqp_url, VHOST)
    version = importlib.metadata.version("celery")
    print(
        f"celery {version}: {workflows} workflows of 3 chained tasks (+{warmup} warm-up,"
        f" {light} one at a time), prefork x{concurrency}",
        flush=True,
    )
    await env.reset_database(db_url)
    await fresh_vhost(settings, VHOST)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await create_effects(db_url)
        worker = spawn(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "bench.celery_app",
                "worker",
                "--pool",
                "prefork",
                "--concurrency",
                str(concurrency),
                "--queues",
                queue,
                "--hostname",
                "bench@%h",
                "--loglevel",
                "WARNING",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            logs / "celery-worker.log",
            env={"BENCH_CELERY_BROKER": amqp_url, "BENCH_CELERY_DB": db_url},
        )
        procs.append(worker)
        await _wait_consumer(settings, queue, worker)

        async def submit(ids: Sequence[str]) -> None:
            await asyncio.to_thread(celery_app.submit, amqp_url, ids)

        labels = {"celery worker": worker}
        async with Harness(
            "celery", db_url, admin_url, DB, labels, dict.fromkeys(labels, GROUP)
        ) as h:
            ph = await h.phases(submit, warmup=warmup, light=light, workflows=workflows)
            effects, redeliveries = await h.check_exact(all_ids(warmup, light, workflows))
        await _wait_queue_empty(settings, queue)
        processes = sum(r.processes for r in ph.cpu.memory if r.kind.startswith("celery worker"))
        codes = stop_all(procs, grace_s=20)
        procs = []
        if any(codes):
            raise BenchFailure(f"the Celery worker did not stop cleanly: exit codes {codes}")
        return PeerResult(
            system="Celery",
            version=version,
            setup=f"1 worker, prefork pool of {concurrency} (+ its main process)",
            settings=[
                f"RabbitMQ quorum queue `{queue}` (durable), persistent messages",
                "publisher confirms (`broker_transport_options={'confirm_publish': True}`):"
                " each `apply_async` waits for its confirm",
                "`task_acks_late=True`, `task_reject_on_worker_lost=True`, no result backend",
                f"`--pool prefork --concurrency {concurrency}`, prefetch multiplier 4 (the"
                " default; quorum queues get per-consumer QoS)",
                "`--without-gossip --without-mingle --without-heartbeat`",
                "a workflow is `chain(step.s(...), step.s(...), step.s(...))`: the worker"
                " publishes the next step after a step returns, before acking it",
            ],
            group=GROUP,
            processes=processes,
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
            checks=["no message left in the broker", "clean SIGTERM shutdown"],
        )
    finally:
        stop_all(procs, grace_s=20)
        await drop_database(db_url)
        await broker.delete_vhost(settings.amqp_management_url, VHOST)
