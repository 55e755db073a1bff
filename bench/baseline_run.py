"""The baseline run: ``bench/baseline.py``'s three processes on their own database and
vhost, a warm-up, then the measured operations, with their CPU and Postgres activity."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psycopg

from bench import baseline
from bench.common import BenchFailure
from bench.cpu import CpuWindow, Probe
from bench.pg_activity import ActivitySampler
from bench.processes import spawn, stop_all
from bench.resources import drop_database, fresh_vhost, query
from workers.harness import env
from workers.io import broker
from workers.settings import Settings

BASELINE_DB = "custody_bench_baseline"
BASELINE_VHOST = "custody-bench-baseline"


@dataclass
class BaselineResult:
    ops: int
    warmup: int
    seconds: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    cpu: CpuWindow

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds


async def run_baseline(settings: Settings, *, ops: int, warmup: int, logs: Path) -> BaselineResult:
    db_url = env.with_db(settings.database_url, BASELINE_DB)
    amqp_url = env.with_vhost(settings.amqp_url, BASELINE_VHOST)
    admin_url = env.with_db(settings.database_url, "postgres")
    print(f"baseline: {ops} operations (+{warmup} warm-up), one message at a time", flush=True)
    await env.reset_database(db_url)
    await fresh_vhost(settings, BASELINE_VHOST)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await baseline.setup(amqp_url, db_url)
        common = ["--amqp-url", amqp_url, "--db-url", db_url]
        base = [sys.executable, "-m", "bench.baseline"]
        labels: dict[str, int] = {}
        for role in ("worker", "replier"):
            proc = spawn([*base, role, *common], logs / f"baseline-{role}.log")
            procs.append(proc)
            labels[f"baseline {role}"] = proc.pid
        producer = spawn(
            [*base, "producer", *common, "--warmup", str(warmup), "--ops", str(ops)],
            logs / "baseline-producer.log",
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        procs.append(producer)
        labels["baseline producer"] = producer.pid
        assert producer.stdout is not None and producer.stdin is not None
        line = await asyncio.wait_for(asyncio.to_thread(producer.stdout.readline), 120)
        if line.strip() != b"ready":
            raise BenchFailure(f"baseline producer did not get ready ({line!r}); see {logs}")
        await _wait_replies(db_url, "warmup", warmup, procs, timeout_s=60)
        labels["bench (this process)"] = os.getpid()
        groups = dict.fromkeys(labels, "baseline")
        groups["bench (this process)"] = "bench"
        async with (
            Probe(admin_url, labels, groups, [BASELINE_DB]) as probe,
            ActivitySampler(admin_url, [BASELINE_DB]) as sampler,
        ):
            start = await probe.snapshot()
            _send_go(producer.stdin)  # the measured operations
            await _wait_replies(db_url, "measure", ops, procs, timeout_s=30 + ops * 0.05)
            end = await probe.snapshot()
        cpu = probe.window(start, end)
        cpu.activity = sampler.result
        line = await asyncio.wait_for(asyncio.to_thread(producer.stdout.readline), 30)
        if line.strip() != b"done":
            raise BenchFailure(f"baseline producer did not finish ({line!r}); see {logs}")
        _send_go(producer.stdin)  # the producer may exit now
        [row] = await query(
            db_url,
            "SELECT count(*),"
            " extract(epoch FROM max(r.applied_at) - min(o.created_at)),"
            " percentile_cont(0.5) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM r.applied_at - o.created_at)),"
            " percentile_cont(0.99) WITHIN GROUP"
            "   (ORDER BY extract(epoch FROM r.applied_at - o.created_at)),"
            " extract(epoch FROM max(r.applied_at - o.created_at))"
            " FROM outbox o JOIN replies r USING (id) WHERE o.phase = 'measure'",
        )
        [counts] = await query(
            db_url,
            "SELECT (SELECT count(*) FROM outbox WHERE status = 'published'),"
            " (SELECT count(*) FROM inbox), (SELECT count(*) FROM replies)",
        )
        if list(counts) != [ops + warmup] * 3 or row[0] != ops:
            raise BenchFailure(
                f"baseline lost or doubled messages: published/inbox/replies {list(counts)},"
                f" expected {ops + warmup} each"
            )
        return BaselineResult(
            ops=ops,
            warmup=warmup,
            seconds=float(row[1]),
            p50_ms=float(row[2]) * 1000,
            p99_ms=float(row[3]) * 1000,
            max_ms=float(row[4]) * 1000,
            cpu=cpu,
        )
    finally:
        stop_all(procs)
        await drop_database(db_url)
        await broker.delete_vhost(settings.amqp_management_url, BASELINE_VHOST)


def _send_go(stdin: IO[bytes]) -> None:
    stdin.write(b"go\n")
    stdin.flush()


async def _wait_replies(
    db_url: str,
    phase: str,
    n: int,
    procs: Sequence[subprocess.Popen[bytes]],
    *,
    timeout_s: float,
) -> None:
    deadline = time.monotonic() + timeout_s
    async with await psycopg.AsyncConnection.connect(
        db_url, autocommit=True, application_name="bench-poll"
    ) as conn:
        while True:
            row = await (
                await conn.execute(
                    "SELECT count(*) FROM replies r JOIN outbox o USING (id) WHERE o.phase = %s",
                    (phase,),
                )
            ).fetchone()
            done = int(row[0]) if row else 0
            if done >= n:
                return
            dead = [p.args for p in procs if p.poll() not in (None, 0)]
            if dead:
                raise BenchFailure(f"a baseline process died: {dead}")
            if time.monotonic() > deadline:
                raise BenchFailure(f"baseline {phase}: {done}/{n} replies after {timeout_s:.0f}s")
            await asyncio.sleep(0.1)
