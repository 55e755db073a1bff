"""The report: the machine and versions, throughput and its ratio, latency, the
correctness checks, where the CPU went and what Postgres did; as markdown."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench.baseline_run import BaselineResult
from bench.cpu import CpuWindow
from bench.custody_run import CustodyResult
from bench.pg_activity import PgActivity
from bench.resources import query
from workers.harness import env
from workers.io import broker
from workers.settings import ROOT, Settings


@dataclass
class Machine:
    nproc: int
    cpu_model: str
    kernel: str
    python: str
    rabbitmq: str
    erlang: str
    postgres: str
    libraries: str
    load_before: str
    revision: str


def _read(path: str) -> str:
    return Path(path).read_text()


async def machine_facts(settings: Settings) -> Machine:
    model = "unknown"
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    overview = await broker.management(settings.amqp_management_url, "GET", "/api/overview")
    [[pg_version]] = await query(
        env.with_db(settings.database_url, "postgres"), "SHOW server_version"
    )
    libs = ", ".join(
        f"{name} {importlib.metadata.version(name)}"
        for name in ("aio-pika", "aiormq", "psycopg", "pydantic", "orjson")
    )
    return Machine(
        nproc=os.cpu_count() or 0,
        cpu_model=model,
        kernel=platform.release(),
        python=platform.python_version(),
        rabbitmq=str(overview.get("rabbitmq_version", "?")),
        erlang=str(overview.get("erlang_version", "?")),
        postgres=str(pg_version),
        libraries=libs,
        load_before=" ".join(_read("/proc/loadavg").split()[:3]),
        revision=await asyncio.to_thread(_revision),
    )


CODE_PATHS = (
    "workers",
    "contracts",
    "participants",
    "bench",
    ":(exclude)bench/results",
    "schema.sql",
    "commands.sql",
    "transitions.sql",
    "participant_schema.sql",
    "queries.sql",
    "participant_queries.sql",
    "deploy",
)


def _revision() -> str:
    """The commit measured, and whether the code differed from it (read-only git)."""
    worker_env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            env=worker_env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *CODE_PATHS],
            cwd=ROOT,
            env=worker_env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    changed = sorted({line[3:].split("/")[0] for line in dirty if line.strip()})
    if not changed:
        return f"commit {head}, clean"
    return f"commit {head} with uncommitted changes in {', '.join(changed)}"


def command() -> str:
    exe = Path(sys.executable)
    with contextlib.suppress(ValueError):
        exe = exe.relative_to(Path.cwd())
    return shlex.join([str(exe), "-m", "bench.run", *sys.argv[1:]])


def _ms(value: float) -> str:
    return f"{value:,.0f} ms"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _cpu_table(window: CpuWindow, ops: int, nproc: int) -> list[str]:
    """Every process of this run, the broker and the database; other processes only
    when they used a noticeable share (the rest folded into one row)."""

    def row(label: str, group: str, seconds: float) -> list[str]:
        return [
            label,
            group,
            f"{seconds:.2f}",
            f"{100 * seconds / window.seconds:.0f} %",
            f"{1000 * seconds / ops:.2f}",
        ]

    rows = []
    folded = 0.0
    for r in window.rows:
        if r.group == "other" and r.seconds < 0.05:
            folded += r.seconds
        elif r.seconds >= 0.005:
            rows.append(row(r.label, r.group, r.seconds))
    rows.append(row("other: smaller processes", "other", folded))
    m = window.machine
    unattributed = max(0.0, m.busy - window.accounted)
    rows.append(
        row(
            "not charged to a live process (interrupts, processes that exited)",
            "other",
            unattributed,
        )
    )
    by_group: dict[str, float] = {"other": unattributed}
    for r in window.rows:
        by_group[r.group] = by_group.get(r.group, 0.0) + r.seconds
    capacity = nproc * window.seconds
    lines = _table(["process", "group", "CPU s", "% of one core", "CPU ms / operation"], rows)
    lines.append("")
    lines.append(
        f"Window {window.seconds:.1f} s; machine busy {m.busy:.1f} of {capacity:.1f}"
        f" CPU-seconds ({100 * m.busy / capacity:.0f} % of {nproc} cores; of which"
        f" interrupts {m.irq:.1f} s), hypervisor steal {m.steal:.1f} s. By group: "
        + ", ".join(f"{g} {s:.1f} s" for g, s in sorted(by_group.items(), key=lambda x: -x[1]))
        + "."
    )
    foreign = sum(r.seconds for r in window.rows if r.group == "other")
    if foreign + unattributed > 0.1 * m.busy:
        lines += [
            "",
            f"**Another workload shared the machine**: {foreign + unattributed:.1f} CPU-s"
            " (other processes and unattributed time) in this window; this run's figures"
            " are pessimistic. Re-run on a quiet machine to compare.",
        ]
    return lines


def _activity_table(activity: PgActivity | None, top: int = 12) -> list[str]:
    if activity is None or not activity.ticks:
        return []
    total = activity.samples
    rows = [
        [client, f"`{what}`", wait, f"{n}", f"{n / activity.ticks:.2f}", f"{100 * n / total:.0f} %"]
        for (client, what, wait), n in sorted(activity.counts.items(), key=lambda x: -x[1])[:top]
    ]
    lines = [
        "",
        f"Postgres sessions of this run, sampled {activity.ticks} times (every 50 ms):"
        f" on average {total / activity.ticks:.2f} backends were not idle.",
        "",
    ]
    lines += _table(
        [
            "client",
            "statement (queries.sql name)",
            "running or waiting on",
            "samples",
            "avg backends",
            "share",
        ],
        rows,
    )
    return lines


def _reading(window: CpuWindow, nproc: int) -> str:
    """Where the time went, in one sentence: saturation, the busiest processes, and
    what Postgres was doing most."""
    capacity = nproc * window.seconds
    busy = 100 * window.machine.busy / capacity
    own = [r for r in window.rows if r.group != "other"]
    workers = [r for r in own if r.group in ("custody workers", "baseline")]
    by_group: dict[str, float] = {}
    for r in own:
        by_group[r.group] = by_group.get(r.group, 0.0) + r.seconds
    parts = [
        f"machine {busy:.0f} % busy"
        + (" (CPU-bound as a whole)" if busy >= 90 else " (not CPU-bound: waiting somewhere)"),
        "CPU by group "
        + ", ".join(
            f"{g} {100 * v / max(window.own, 1e-9):.0f} %"
            for g, v in sorted(by_group.items(), key=lambda x: -x[1])
        ),
    ]
    if workers:
        top = workers[0]
        parts.append(
            f"busiest worker {top.label} ({100 * top.seconds / window.seconds:.0f} % of a core)"
        )
    activity = window.activity
    if activity is not None and activity.ticks:
        running = [
            (k, n)
            for k, n in activity.counts.items()
            if not k[1].startswith("(") and not k[0].startswith("bench")
        ]
        if running:
            (client, what, wait), n = max(running, key=lambda x: x[1])
            parts.append(
                f"Postgres busiest statement `{what}` from {client} ({wait},"
                f" {n / activity.ticks:.2f} backends on average)"
            )
    return "; ".join(parts) + "."


@dataclass
class Report:
    started: datetime
    command: str
    machine: Machine
    settings: Settings
    baseline: BaselineResult
    custody: list[CustodyResult] = field(default_factory=list)
    total_s: float = 0.0

    def markdown(self) -> str:
        m, b = self.machine, self.baseline
        s = self.settings
        lines = [
            f"# custody benchmark, {self.started.strftime('%Y-%m-%d %H:%M UTC')}",
            "",
            f"Command: `{self.command}` (`make bench` runs it without arguments);"
            f" the whole run took {self.total_s:.0f} s.",
            "",
            f"- Machine: {m.nproc} x {m.cpu_model}, Linux {m.kernel};"
            f" load average before the run {m.load_before}",
            f"- Python {m.python}; RabbitMQ {m.rabbitmq} (Erlang {m.erlang});"
            f" PostgreSQL {m.postgres}",
            f"- Code: {m.revision}",
            f"- Libraries: {m.libraries}",
            f"- Fleet settings: batch_size {s.batch_size}, prefetch {s.prefetch},"
            f" confirm_window {s.confirm_window}, linger_ms {s.linger_ms},"
            f" poll_interval_s {os.environ.get('CUSTODY_POLL_INTERVAL_S', '0.5')}",
            "- Broker, database, every worker and the bench share the same cores.",
            "",
            "## Throughput (operations fully round-tripped, end to end)",
            "",
        ]
        rows = [
            [
                "baseline: naive hand-rolled outbox, one message at a time (3 processes)",
                f"{b.ops:,}",
                f"{b.seconds:.1f}",
                f"**{b.ops_per_s:,.0f}**",
                "1.00",
                f"{1000 * b.cpu.own / b.ops:.1f}",
            ]
        ]
        for c in self.custody:
            rows.append(
                [
                    f"custody, {c.replicas} replica(s) per worker ({c.processes} processes),"
                    f" {c.instances:,} instances",
                    f"{c.ops:,}",
                    f"{c.seconds:.1f}",
                    f"**{c.ops_per_s:,.0f}**",
                    f"**{c.ops_per_s / b.ops_per_s:.2f}**",
                    f"{1000 * c.cpu.own / c.ops:.1f}",
                ]
            )
        lines += _table(
            [
                "run",
                "operations",
                "seconds",
                "operations/s",
                "x baseline",
                "CPU ms / operation",
            ],
            rows,
        )
        lines += [
            "",
            "An operation is one call to a participant: for the baseline a command and its"
            " reply; for custody a submit command, an `accepted` and a terminal receipt,"
            " each through an outbox, applied with validation and history. Baseline"
            f" window: first outbox insert to last reply applied ({b.warmup} warm-up"
            " operations before it). Custody window: the first start request published"
            " to the last instance finished (database clock). CPU ms / operation: the CPU"
            " time of this run's processes, the broker and the database in the window, per"
            " operation (other workloads on the machine excluded); on a saturated machine,"
            " operations/s is about cores x 1000 / this.",
            "",
        ]
        for c in self.custody:
            lines.append(f"- custody r{c.replicas}: {_reading(c.cpu, m.nproc)}")
        lines += [
            "",
            "## Latency",
            "",
        ]
        lat = [
            [
                "baseline, one operation (outbox insert → reply applied)",
                _ms(b.p50_ms),
                _ms(b.p99_ms),
                _ms(b.max_ms),
            ]
        ]
        for c in self.custody:
            lat += [
                [
                    f"custody r{c.replicas}, one instance of 3 sequential operations"
                    f" (created → finished), burst of {c.instances:,}",
                    _ms(c.inst_p50_ms),
                    _ms(c.inst_p99_ms),
                    _ms(c.inst_max_ms),
                ],
                [
                    f"custody r{c.replicas}, one operation (created → terminal),"
                    f" burst of {c.instances:,}",
                    _ms(c.op_p50_ms),
                    _ms(c.op_p99_ms),
                    "",
                ],
                [
                    f"custody r{c.replicas}, one instance, unloaded"
                    f" (warm-up trickle of {c.warm_instances}, 20/s)",
                    _ms(c.warm_p50_ms),
                    "",
                    _ms(c.warm_max_ms),
                ],
            ]
        lines += _table(["what", "p50", "p99", "max"], lat)
        lines += [
            "",
            "Under a burst every instance waits behind the others: the burst latencies"
            " measure queueing at saturation, not the cost of one instance.",
            "",
            "## Correctness (checked; a mismatch fails the run)",
            "",
        ]
        for c in self.custody:
            effects = ", ".join(f"{k} {v[0]} (expected {v[1]})" for k, v in c.effects.items())
            lines.append(
                f"- custody r{c.replicas}: {c.instances + c.warm_instances:,} instances finished"
                f" (measured: completed {c.completed}, failed and compensated {c.failed});"
                f" effects {effects}; duplicates {c.duplicates}; quarantined"
                f" {c.quarantined}; shutdown exit codes {sorted(set(c.shutdown_codes))}"
            )
        lines.append(
            f"- baseline: {b.ops + b.warmup:,} commands published, received and replied,"
            " each exactly once"
        )
        lines += ["", "## Where the CPU goes (utime + stime in the measured window)", ""]
        lines += [f"### baseline ({b.ops:,} operations)", ""]
        lines += _cpu_table(b.cpu, b.ops, m.nproc)
        lines += _activity_table(b.cpu.activity)
        for c in self.custody:
            lines += ["", f"### custody, {c.replicas} replica(s) ({c.ops:,} operations)", ""]
            lines += _cpu_table(c.cpu, c.ops, m.nproc)
            lines += _activity_table(c.cpu.activity)
        lines += [
            "",
            "`postgres ← X` is the backend serving the client whose application_name is X"
            " (`custody-<worker>` for a worker's pool; LISTEN connections have no name and"
            " show as `client backend`).",
            "",
        ]
        return "\n".join(lines)
