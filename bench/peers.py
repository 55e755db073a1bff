"""What the two peer runs share (``celery_run.py``, ``pgqueuer_run.py``): the workload,
the effects table and its exactness check, and the phases of a run.

The workload is custody's shape without custody: a *workflow* is three steps run one
after the other, each step one task (Celery) or job (pgqueuer) that writes its effect
row to the peer's own database **exactly once**: ``INSERT ... ON CONFLICT DO NOTHING``
on ``(workflow_id, step)``. A delivery that finds its row already there (a redelivery
after a crash or a lost ack) writes a row to ``redeliveries`` instead, so that the
report can say how many the key absorbed. After the run every workflow must have
exactly the steps 1, 2 and 3 and nothing else: anything missing or extra fails the run.

The phases, for either peer, once its workers are up:

1. warm-up: ``warmup`` workflows at once (every worker process opens its connections);
2. light load: ``light`` workflows one at a time (the next is submitted when the last
   step of the previous one is in): the per-step latency of an idle system;
3. burst: ``workflows`` workflows submitted at once, the measured window from just
   before the first submit to the last effect row (database clock), with the CPU of
   every process and ``pg_stat_activity`` sampled as for the custody runs.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from bench.common import BenchFailure
from bench.cpu import CpuWindow, Probe
from bench.pg_activity import ActivitySampler

STEPS = 3

EFFECTS_DDL = (
    "CREATE TABLE effects ("
    " workflow_id text NOT NULL,"
    " step integer NOT NULL,"
    " at timestamptz NOT NULL DEFAULT clock_timestamp(),"
    " PRIMARY KEY (workflow_id, step))",
    "CREATE TABLE redeliveries ("
    " workflow_id text NOT NULL,"
    " step integer NOT NULL,"
    " at timestamptz NOT NULL DEFAULT clock_timestamp())",
)
# the step's effect, exactly once: a row comes back only if this delivery wrote it
INSERT_EFFECT = (
    "INSERT INTO effects (workflow_id, step) VALUES (%s, %s) ON CONFLICT DO NOTHING RETURNING 1"
)
INSERT_REDELIVERY = "INSERT INTO redeliveries (workflow_id, step) VALUES (%s, %s)"

Submit = Callable[[Sequence[str]], Awaitable[None]]


@dataclass
class PeerResult:
    system: str  # "Celery", "pgqueuer"
    version: str
    setup: str  # how it ran, in one line
    settings: list[str]  # the settings that matter for a fair comparison
    group: str  # the CPU group of its own processes
    processes: int
    workflows: int
    seconds: float
    warmup: int
    light_workflows: int
    light_step_p50_ms: float
    light_step_p99_ms: float
    light_wf_p50_ms: float
    light_wf_p99_ms: float
    effects: int
    redeliveries: int
    cpu: CpuWindow
    checks: list[str] = field(default_factory=list)  # what was checked, for the report

    @property
    def ops(self) -> int:
        return self.workflows * STEPS

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds

    @property
    def workflows_per_s(self) -> float:
        return self.workflows / self.seconds


@dataclass
class Phases:
    """The figures of the three phases, before the exactness check."""

    seconds: float
    light_step_ms: list[float]
    light_wf_ms: list[float]
    cpu: CpuWindow


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:05d}" for i in range(n)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1), interpolated like Postgres' percentile_cont."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def create_effects(db_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        for statement in EFFECTS_DDL:
            await conn.execute(statement)


class Harness:
    """One peer's database connection for polling, its processes, and the phases."""

    def __init__(
        self,
        name: str,
        db_url: str,
        admin_url: str,
        database: str,
        procs: Mapping[str, subprocess.Popen[bytes]],
        groups: Mapping[str, str],
    ) -> None:
        self.name = name
        self.db_url = db_url
        self.admin_url = admin_url
        self.database = database
        self.procs = dict(procs)
        self.groups = dict(groups)
        self._conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None

    async def __aenter__(self) -> Harness:
        self._conn = await psycopg.AsyncConnection.connect(
            self.db_url, autocommit=True, application_name="bench-poll"
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._conn is not None:
            await self._conn.close()

    @property
    def conn(self) -> psycopg.AsyncConnection[tuple[Any, ...]]:
        assert self._conn is not None
        return self._conn

    def check_alive(self) -> None:
        dead = {k: p.returncode for k, p in self.procs.items() if p.poll() is not None}
        if dead:
            raise BenchFailure(f"{self.name}: a worker process exited: {dead}")

    async def now(self) -> datetime:
        row = await (await self.conn.execute("SELECT clock_timestamp()")).fetchone()
        assert row is not None
        return row[0]  # type: ignore[no-any-return]

    async def effect_rows(self) -> int:
        row = await (await self.conn.execute("SELECT count(*) FROM effects")).fetchone()
        return int(row[0]) if row else 0

    async def wait_rows(
        self, n: int, *, timeout_s: float, interval_s: float = 0.1, progress: bool = False
    ) -> None:
        """Until the effects table has ``n`` rows."""
        started = time.monotonic()
        last = started
        while True:
            done = await self.effect_rows()
            if done >= n:
                return
            self.check_alive()
            if time.monotonic() - started > timeout_s:
                raise BenchFailure(
                    f"{self.name}: only {done}/{n} effect rows after {timeout_s:.0f}s"
                )
            if progress and time.monotonic() - last >= 5:
                print(f"    {time.monotonic() - started:5.1f}s: {done}/{n} steps done", flush=True)
                last = time.monotonic()
            await asyncio.sleep(interval_s)

    async def phases(self, submit: Submit, *, warmup: int, light: int, workflows: int) -> Phases:
        expected = 0
        if warmup:
            await submit(ids("warm", warmup))
            expected += warmup * STEPS
            await self.wait_rows(expected, timeout_s=60 + warmup * 0.2)
        light_step: list[float] = []
        light_wf: list[float] = []
        for wf in ids("light", light):
            submitted = await self.now()
            await submit([wf])
            expected += STEPS
            await self.wait_rows(expected, timeout_s=30, interval_s=0.01)
            rows = await (
                await self.conn.execute(
                    "SELECT at FROM effects WHERE workflow_id = %s ORDER BY step", (wf,)
                )
            ).fetchall()
            times = [submitted, *(r[0] for r in rows)]
            light_step += [(b - a).total_seconds() * 1000 for a, b in itertools.pairwise(times)]
            light_wf.append((times[-1] - submitted).total_seconds() * 1000)
        labels = {k: p.pid for k, p in self.procs.items()}
        labels["bench (this process)"] = os.getpid()
        groups = {**self.groups, "bench (this process)": "bench"}
        async with (
            Probe(self.admin_url, labels, groups, [self.database]) as probe,
            ActivitySampler(self.admin_url, [self.database]) as sampler,
        ):
            start = await probe.snapshot()
            t0 = await self.now()
            await submit(ids("burst", workflows))
            await self.wait_rows(
                expected + workflows * STEPS, timeout_s=120 + workflows * 0.1, progress=True
            )
            end = await probe.snapshot()
        cpu = probe.window(start, end)
        cpu.activity = sampler.result
        row = await (
            await self.conn.execute(
                "SELECT extract(epoch FROM max(at) - %s) FROM effects"
                " WHERE workflow_id LIKE 'burst-%%'",
                (t0,),
            )
        ).fetchone()
        assert row is not None
        return Phases(float(row[0]), light_step, light_wf, cpu)

    async def check_exact(self, expected: Sequence[str]) -> tuple[int, int]:
        """Every workflow has exactly the steps 1..3, no other row exists; the effect
        rows and the redeliveries the key absorbed."""
        rows = await (
            await self.conn.execute(
                "SELECT workflow_id, array_agg(step ORDER BY step) FROM effects GROUP BY 1"
            )
        ).fetchall()
        got = {str(r[0]): list(r[1]) for r in rows}
        want = set(expected)
        missing = sorted(want - got.keys())
        extra = sorted(got.keys() - want)
        wrong = sorted(k for k, v in got.items() if k in want and v != list(range(1, STEPS + 1)))
        total = sum(len(v) for v in got.values())
        row = await (await self.conn.execute("SELECT count(*) FROM redeliveries")).fetchone()
        redeliveries = int(row[0]) if row else 0
        problems = []
        if missing:
            problems.append(f"{len(missing)} workflows missing (e.g. {missing[:3]})")
        if extra:
            problems.append(f"{len(extra)} unexpected workflows (e.g. {extra[:3]})")
        if wrong:
            problems.append(
                f"{len(wrong)} workflows with wrong steps (e.g. {wrong[0]}: {got[wrong[0]]})"
            )
        if total != len(want) * STEPS:
            problems.append(f"{total} effect rows, expected {len(want) * STEPS}")
        if problems:
            raise BenchFailure(f"{self.name} gave a WRONG answer: " + "; ".join(problems))
        return total, redeliveries


def all_ids(warmup: int, light: int, workflows: int) -> list[str]:
    return ids("warm", warmup) + ids("light", light) + ids("burst", workflows)
