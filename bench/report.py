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

from bench import profile
from bench.baseline_run import BaselineResult
from bench.cpu import CpuWindow
from bench.custody_run import CustodyResult
from bench.hop import BrokerHop
from bench.peers import PeerResult
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


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


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
        f"{name} {_version(name)}"
        for name in (
            "aio-pika",
            "aiormq",
            "psycopg",
            "pydantic",
            "orjson",
            "uvloop",
            "celery",
            "kombu",
            "amqp",
            "pgqueuer",
            "asyncpg",
        )
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


# the CPU groups of each system's own processes (not the broker, the database, the bench)
WORKER_GROUPS = ("custody workers", "baseline", "celery", "pgqueuer")
# the bench's own Postgres clients (polling, sampling, seeding, submitting)
BENCH_CLIENTS = (
    "bench-poll",
    "bench-activity",
    "bench-probe",
    "bench-client",
    "bench-seed",
    "bench-lock",
)


def _ms(value: float) -> str:
    return f"{value:,.0f} ms" if value >= 10 else f"{value:,.1f} ms"


def _ms2(value: float) -> str:
    return f"{value:,.2f} ms"


def _mib(kib: int) -> str:
    return f"{kib / 1024:,.0f} MiB"


def _ratio(x: float) -> str:
    return f"{x:.2f}"


def _pace(window: CpuWindow) -> str:
    return f"{window.pace_us:,.0f}" if window.pace_us is not None else ""


def machine_pace(reference: CpuWindow, other: CpuWindow) -> float | None:
    """How much slower the machine ran in the ``other`` window than in the
    ``reference`` one (bench/pace.py: the same fixed work's CPU time per unit; above 1:
    slower). None when either window has no pace."""
    if reference.pace_us is None or other.pace_us is None or reference.pace_us <= 0:
        return None
    return other.pace_us / reference.pace_us


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
        + (
            f" The machine's pace: {window.pace_us:,.0f} µs of CPU per unit of"
            " bench/pace.py's fixed work (higher is slower)."
            if window.pace_us is not None
            else ""
        )
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
    workers = [r for r in own if r.group in WORKER_GROUPS]
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
            if not k[1].startswith("(") and k[0] not in BENCH_CLIENTS
        ]
        if running:
            (client, what, wait), n = max(running, key=lambda x: x[1])
            parts.append(
                f"Postgres busiest statement `{what}` from {client} ({wait},"
                f" {n / activity.ticks:.2f} backends on average)"
            )
    return "; ".join(parts) + "."


def _memory_table(window: CpuWindow) -> list[str]:
    """Peak resident memory per process type: this system's processes, its Postgres
    backends and the broker (the bench's own and Postgres' shared processes left out)."""
    rows = [
        [
            m.kind,
            m.group,
            f"{m.processes}",
            _mib(m.largest_kib),
            _mib(m.total_kib),
            "peak (VmHWM)" if m.peak else "at the end (VmRSS)",
        ]
        for m in window.memory
        if m.group != "bench"
        and (m.peak or m.group == "rabbitmq")
        and m.kind.removeprefix("postgres ← ") not in BENCH_CLIENTS
    ]
    if not rows:
        return []
    return _table(
        ["process type", "group", "processes", "largest", "sum", "measured"],
        rows,
    )


@dataclass
class Round:
    """custody's burst and then each peer's, back to back: one round of the ratios."""

    custody: CustodyResult
    peers: list[PeerResult] = field(default_factory=list)


def round_ratios(rounds: Sequence[Round], system: str) -> list[float]:
    """custody's operations/s over ``system``'s, in each round that ran it."""
    return [
        r.custody.ops_per_s / p.ops_per_s for r in rounds for p in r.peers if p.system == system
    ]


def light_medians(rounds: Sequence[Round]) -> tuple[float | None, float | None]:
    """custody's light-load operation p50 and instance p50, each the median over the
    rounds that measured them (None: none did)."""
    measured = [r.custody for r in rounds if r.custody.light_ops]
    if not measured:
        return None, None
    return (
        median([c.light_op_p50_ms for c in measured]),
        median([c.light_inst_p50_ms for c in measured]),
    )


def backlog_ratios(
    rounds: Sequence[Round], backlog: CustodyResult
) -> tuple[list[float], list[float | None]]:
    """The backlog burst's operations/s over custody's empty-table burst of each round,
    raw and each at that round's machine pace (None: a window without a pace)."""
    raw = [backlog.ops_per_s / r.custody.ops_per_s for r in rounds]
    paces = [machine_pace(r.custody.cpu, backlog.cpu) for r in rounds]
    return raw, [None if p is None else x * p for x, p in zip(raw, paces, strict=True)]


def median(values: Sequence[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count)."""
    if not values:
        raise ValueError("the median of nothing")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass
class Report:
    started: datetime
    command: str
    machine: Machine
    settings: Settings
    baseline: BaselineResult
    custody: list[CustodyResult] = field(default_factory=list)
    peers: list[PeerResult] = field(default_factory=list)
    # rounds 2..N of custody r1 and the peers, alternated (round 1 is head and peers)
    rounds: list[Round] = field(default_factory=list)
    # the broker's own hop, measured alone right after custody r1's run (bench/hop.py)
    broker_hops: list[BrokerHop] = field(default_factory=list)
    total_s: float = 0.0

    @property
    def head(self) -> CustodyResult | None:
        """custody r1 on empty tables (else the first custody run): the reference."""
        plain = [c for c in self.custody if c.backlog is None]
        return next((c for c in plain if c.replicas == 1), plain[0] if plain else None)

    def all_rounds(self) -> list[Round]:
        """Round 1 (the head and the peers of the main table), then the others."""
        head = self.head
        if head is None:
            return []
        return [Round(head, list(self.peers)), *self.rounds]

    def _rounds(self) -> list[str]:
        rounds = self.all_rounds()
        head = self.head
        if head is None or len(rounds) < 2 or not self.peers:
            return []
        systems = [p.system for p in self.peers]
        label = f"custody r{head.replicas}"
        header = [
            "round",
            f"{label} operations/s",
            "its CPU ms / operation",
            "its pace (µs)",
            "its light load: an operation p50 / an instance p50",
        ]
        for name in systems:
            header += [
                f"{name} operations/s",
                "its pace (µs)",
                f"{label} ÷ {name}",
                "its light load: a step p50",
            ]
        rows = []
        for n, r in enumerate(rounds, 1):
            c = r.custody
            row = [
                str(n),
                f"{c.ops_per_s:,.0f}",
                f"{1000 * c.cpu.own / c.ops:.2f}",
                _pace(c.cpu),
                f"{_ms(c.light_op_p50_ms)} / {_ms(c.light_inst_p50_ms)}" if c.light_ops else "",
            ]
            for name in systems:
                p = next((p for p in r.peers if p.system == name), None)
                row += (
                    ["", "", "", ""]
                    if p is None
                    else [
                        f"{p.ops_per_s:,.0f}",
                        _pace(p.cpu),
                        _ratio(c.ops_per_s / p.ops_per_s),
                        _ms(p.light_step_p50_ms) if p.light_workflows else "",
                    ]
                )
            rows.append(row)
        ops, instances = light_medians(rounds)
        last = [
            "**median**",
            f"{median([r.custody.ops_per_s for r in rounds]):,.0f}",
            f"{median([1000 * r.custody.cpu.own / r.custody.ops for r in rounds]):.2f}",
            "",
            f"**{_ms(ops)} / {_ms(instances)}**"
            if ops is not None and instances is not None
            else "",
        ]
        for name in systems:
            theirs = [p.ops_per_s for r in rounds for p in r.peers if p.system == name]
            steps = [
                p.light_step_p50_ms
                for r in rounds
                for p in r.peers
                if p.system == name and p.light_workflows
            ]
            last += [
                f"{median(theirs):,.0f}",
                "",
                f"**{_ratio(median(round_ratios(rounds, name)))}**",
                _ms(median(steps)) if steps else "",
            ]
        rows.append(last)
        return [
            f"### Rounds: {label} and each peer, alternated",
            "",
            f"The machine's speed drifts from one window to the next (the pace columns),"
            f" and each system's burst has its own window; so the run repeats {label}'s"
            f" burst and light load and then each peer's, {len(rounds)} times in all. Round 1"
            " is the table above; the others are checked exactly once like the first"
            " (*Correctness* below). A round's ratio compares two windows minutes apart at"
            " most; the median of the rounds' ratios is the run's figure, and the median"
            " of the rounds' light-load p50s its light-load figure (one window's pace moves"
            " a light-load p50 by a third and more). The last row gives each column's own"
            " median (the median ratio is not the ratio of the median operations/s).",
            "",
            *_table(header, rows),
            "",
        ]

    def _against_peers(self) -> list[str]:
        head, b = self.head, self.baseline
        if head is None:
            return []
        lines = [
            "## custody against the peers",
            "",
            "Same run, same machine, same Postgres and RabbitMQ; the same workload shape"
            " (a workflow of three operations in sequence, each operation's effect written"
            " exactly once and checked). The ratio column is custody r1's burst"
            " operations/s divided by each system's: the figure that holds across"
            " machines (above 1: custody is faster).",
            "",
        ]
        rows = []
        for c in self.custody:
            what = (
                f"{c.processes} processes ({c.replicas} per worker type)"
                if c.backlog is None
                else f"{c.processes} processes, on {c.backlog.finished_ops:,} finished +"
                f" {c.backlog.pending_ops:,} pending operations"
            )
            light = (
                f"{_ms(c.light_op_p50_ms)} / {_ms(c.light_op_p99_ms)}"
                if c.light_ops
                else "(not measured)"
            )
            rows.append(
                [
                    f"**{c.label}**",
                    what,
                    f"{c.instances:,}",
                    f"{c.ops:,}",
                    f"**{c.ops_per_s:,.0f}**",
                    f"{c.workflows_per_s:,.0f}",
                    f"**{_ratio(head.ops_per_s / c.ops_per_s)}**",
                    f"{1000 * c.cpu.own / c.ops:.2f}",
                    light,
                    _mib(c.cpu.worker_rss_kib(WORKER_GROUPS)),
                    _pace(c.cpu),
                ]
            )
        for r in self.peers:
            rows.append(
                [
                    f"**{r.system} {r.version}**",
                    r.setup,
                    f"{r.workflows:,}",
                    f"{r.ops:,}",
                    f"**{r.ops_per_s:,.0f}**",
                    f"{r.workflows_per_s:,.0f}",
                    f"**{_ratio(head.ops_per_s / r.ops_per_s)}**",
                    f"{1000 * r.cpu.own / r.ops:.2f}",
                    f"{_ms(r.light_step_p50_ms)} / {_ms(r.light_step_p99_ms)}",
                    _mib(r.cpu.worker_rss_kib(WORKER_GROUPS)),
                    _pace(r.cpu),
                ]
            )
        rows.append(
            [
                "baseline",
                "naive outbox, one message at a time, 3 processes",
                "",
                f"{b.ops:,}",
                f"{b.ops_per_s:,.0f}",
                "",
                _ratio(head.ops_per_s / b.ops_per_s),
                f"{1000 * b.cpu.own / b.ops:.2f}",
                "",
                _mib(b.cpu.worker_rss_kib(WORKER_GROUPS)),
                _pace(b.cpu),
            ]
        )
        lines += _table(
            [
                "system",
                "how it ran",
                "workflows",
                "operations",
                "operations/s (burst)",
                "workflows/s",
                f"custody r{head.replicas} ÷ this",
                "CPU ms / operation",
                "light load, one operation p50 / p99",
                "peak RSS, its own processes",
                "machine pace (µs per unit, bench/pace.py)",
            ],
            rows,
        )
        lines.append("")
        lines += self._rounds()
        parts = []
        rounds = self.all_rounds()
        if len(rounds) > 1:
            each = []
            for r in self.peers:
                ratios = round_ratios(rounds, r.system)
                each.append(
                    f"**{_ratio(median(ratios))} x** the operations/s of {r.system}"
                    f" (the rounds: {', '.join(_ratio(x) for x in ratios)})"
                )
            parts.append(
                f"the median of {len(rounds)} alternated rounds: custody r{head.replicas}"
                f" moves {' and '.join(each)}"
            )
            ops, instances = light_medians(rounds)
            if ops is not None and instances is not None:
                measured = [r.custody for r in rounds if r.custody.light_ops]
                parts.append(
                    f"at light load, the median of the rounds: an operation p50 **{_ms(ops)}**"
                    f" (the rounds: {', '.join(_ms(c.light_op_p50_ms) for c in measured)}),"
                    f" an instance p50 **{_ms(instances)}**"
                    f" ({', '.join(_ms(c.light_inst_p50_ms) for c in measured)})"
                )
        for r in self.peers:
            ratio = head.ops_per_s / r.ops_per_s
            parts.append(
                f"custody r{head.replicas} moves {_ratio(ratio)} x the operations/s of {r.system}"
                + (" in round 1" if len(rounds) > 1 else "")
            )
            pace = machine_pace(r.cpu, head.cpu)
            if pace is not None:
                parts[-1] += f" ({_ratio(ratio * pace)} x at the same machine pace)"
        for c in self.custody:
            if c.backlog is not None:
                parts.append(
                    f"on a backlog ({c.backlog.finished_ops:,} finished and"
                    f" {c.backlog.pending_ops:,} pending operations already in its tables,"
                    f" {c.backlog.rows:,} rows, {c.backlog.database_mb:,.0f} MB) custody"
                    f" r{c.replicas} moves "
                )
                if len(rounds) > 1:
                    # against every round's empty tables: one window's pace decides
                    # less (test_the_backlog_figure_is_the_median_against_every_…)
                    raw, paced = backlog_ratios(rounds, c)
                    parts[-1] += (
                        f"**{_ratio(median(raw))} x** its empty-table figure, the median"
                        f" against the {len(rounds)} rounds' bursts on empty tables"
                        f" (the rounds: {', '.join(_ratio(x) for x in raw)})"
                    )
                    known = [x for x in paced if x is not None]
                    if len(known) == len(paced):
                        parts[-1] += (
                            "; at each round's machine pace (bench/pace.py), about"
                            f" **{_ratio(median(known))} x**"
                            f" ({', '.join(_ratio(x) for x in known)})"
                        )
                    continue
                ratio = c.ops_per_s / head.ops_per_s
                parts[-1] += f"**{_ratio(ratio)} x** its empty-table figure"
                pace = machine_pace(head.cpu, c.cpu)
                if pace is not None:
                    parts[-1] += (
                        f" (the machine's pace in its window: {_ratio(pace)} x the"
                        " empty-table window's, bench/pace.py, above 1 slower; at the same"
                        f" pace, about **{_ratio(ratio * pace)} x**)"
                    )
        if parts:
            lines += ["In short: " + "; ".join(parts) + ".", ""]
        lines += [
            "- *operations/s (burst)*: all the workflows submitted at once, from the first"
            " submit to the last effect (database clock). An operation is one step of a"
            " workflow: for custody one call to a participant (a submit and a terminal"
            " receipt, each through an outbox, and an `accepted` receipt when the handler"
            " runs after acceptance; an order-fulfilment instance averages"
            f" {head.ops / max(head.instances, 1):.2f}), for Celery one task, for pgqueuer"
            " one job, for the baseline one command and its reply.",
            "- *CPU ms / operation*: CPU time in the burst window of the system's processes,"
            " the database, the broker (not for pgqueuer, which does not use it) and the"
            " bench, per operation; other workloads on the machine excluded.",
            "- *light load*: one workflow at a time, the next submitted once the previous"
            " one finished. custody: an operation from its creation to its terminal"
            " receipt (`operations.created_at` → `finished_at`); the peers: a step from the"
            " previous step's effect (or the submit, for the first) to its own effect row.",
            "- *peak RSS*: the sum of the peak resident sets (VmHWM) of the system's own"
            " processes (workers, pool children), without the broker and the database;"
            " per process type in *Memory* below.",
            "- *machine pace*: the median CPU time of a fixed piece of pure-Python work,"
            " timed every 100 ms in its own process through the burst window"
            " (bench/pace.py; higher is slower). The machine's speed moves by a tenth or"
            " more from one minute to the next, and each system's burst has its own"
            ' window: a ratio "at the same machine pace" multiplies the ratio by the two'
            " windows' paces. It is rough: the probe shares the caches of whatever runs"
            " beside it, so a system's own mix of processes moves it too.",
            "",
        ]
        return lines

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
            f" poll_interval_s {os.environ.get('CUSTODY_POLL_INTERVAL_S', '0.5')},"
            f" event_loop {s.event_loop}",
            "- Broker, database, every worker and the bench share the same cores.",
            "",
        ]
        lines += self._against_peers()
        lines += ["## Throughput (operations fully round-tripped, end to end)", ""]
        rows = [
            [
                "baseline: naive hand-rolled outbox, one message at a time (3 processes)",
                f"{b.ops:,}",
                f"{b.seconds:.1f}",
                f"**{b.ops_per_s:,.0f}**",
                "1.00",
                f"{1000 * b.cpu.own / b.ops:.2f}",
            ]
        ]
        for c in self.custody:
            backlog = (
                f", on a backlog of {c.backlog.finished_ops:,} finished +"
                f" {c.backlog.pending_ops:,} pending operations"
                if c.backlog
                else ""
            )
            rows.append(
                [
                    f"custody, {c.replicas} replica(s) per worker ({c.processes} processes),"
                    f" {c.instances:,} instances{backlog}",
                    f"{c.ops:,}",
                    f"{c.seconds:.1f}",
                    f"**{c.ops_per_s:,.0f}**",
                    f"**{c.ops_per_s / b.ops_per_s:.2f}**",
                    f"{1000 * c.cpu.own / c.ops:.2f}",
                ]
            )
        for r in self.peers:
            rows.append(
                [
                    f"{r.system} {r.version}: {r.setup}, {r.workflows:,} workflows",
                    f"{r.ops:,}",
                    f"{r.seconds:.1f}",
                    f"**{r.ops_per_s:,.0f}**",
                    f"{r.ops_per_s / b.ops_per_s:.2f}",
                    f"{1000 * r.cpu.own / r.ops:.2f}",
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
            " reply; for custody a submit command and a terminal receipt (and an `accepted`"
            " receipt when the handler runs after acceptance), each through an outbox,"
            " applied with validation and history; for a peer one"
            " step of a workflow (a task, a job) with its effect row. Baseline"
            f" window: first outbox insert to last reply applied ({b.warmup} warm-up"
            " operations before it). Custody window: the first start request published"
            " to the last instance finished (database clock). Peer window: just before"
            " the first submit to the last effect row (database clock). CPU ms /"
            " operation: the CPU time of this run's processes, the broker and the"
            " database in the window, per operation (other workloads on the machine"
            " excluded); on a saturated machine, operations/s is about cores x 1000 /"
            " this.",
            "",
        ]
        for c in self.custody:
            lines.append(f"- {c.label}: {_reading(c.cpu, m.nproc)}")
        for r in self.peers:
            lines.append(f"- {r.system}: {_reading(r.cpu, m.nproc)}")
        for c in self.custody:
            if c.backlog is not None:
                sd = c.backlog
                lines += [
                    "",
                    f"Backlog ({c.label}): before the burst, {sd.rows:,} rows were seeded"
                    f" into custody's tables with SQL ({sd.finished_ops:,} finished"
                    f" operations of {sum(v for k, v in sd.instances.items() if k != 'running'):,}"
                    f" finished instances, {sd.pending_ops:,} operations accepted and"
                    f" waiting, with a deadline two days away, in"
                    f" {sd.instances.get('running', 0):,} running instances; copies of the"
                    " run's warm-up instances, see bench/README.md), then VACUUM ANALYZE and"
                    f" CHECKPOINT: {sd.seconds:.0f} s, the engine database"
                    f" {sd.database_mb:,.0f} MB. The seeded rows are left untouched (checked).",
                ]
        if self.peers:
            lines += ["", "### How the peers ran", ""]
            for r in self.peers:
                lines.append(f"- **{r.system} {r.version}**, {r.setup}: " + "; ".join(r.settings))
        lines += [
            "",
            "## Latency",
            "",
        ]
        lat = [
            [
                "baseline, one operation (outbox insert → reply applied), during its run",
                _ms(b.p50_ms),
                _ms(b.p99_ms),
                _ms(b.max_ms),
            ]
        ]
        for c in self.custody:
            if c.light_instances:
                lat += [
                    [
                        f"{c.label}, one operation (created → terminal), light load"
                        f" ({c.light_ops} operations of {c.light_instances} instances run"
                        " one at a time)",
                        _ms(c.light_op_p50_ms),
                        _ms(c.light_op_p99_ms),
                        "",
                    ],
                    [
                        f"{c.label}, one instance of 3 sequential operations (created →"
                        f" finished), light load ({c.light_instances}, one at a time)",
                        _ms(c.light_inst_p50_ms),
                        _ms(c.light_inst_p99_ms),
                        "",
                    ],
                ]
            lat += [
                [
                    f"{c.label}, one instance of 3 sequential operations"
                    f" (created → finished), burst of {c.instances:,}",
                    _ms(c.inst_p50_ms),
                    _ms(c.inst_p99_ms),
                    _ms(c.inst_max_ms),
                ],
                [
                    f"{c.label}, one operation (created → terminal), burst of {c.instances:,}",
                    _ms(c.op_p50_ms),
                    _ms(c.op_p99_ms),
                    "",
                ],
                [
                    f"{c.label}, one instance, unloaded"
                    f" (warm-up trickle of {c.warm_instances}, 20/s)",
                    _ms(c.warm_p50_ms),
                    "",
                    _ms(c.warm_max_ms),
                ],
            ]
        for r in self.peers:
            lat += [
                [
                    f"{r.system}, one step (previous effect → its effect), light load"
                    f" ({r.light_workflows} workflows one at a time)",
                    _ms(r.light_step_p50_ms),
                    _ms(r.light_step_p99_ms),
                    "",
                ],
                [
                    f"{r.system}, one workflow of 3 steps (submit → last effect), light load",
                    _ms(r.light_wf_p50_ms),
                    _ms(r.light_wf_p99_ms),
                    "",
                ],
            ]
        lines += _table(["what", "p50", "p99", "max"], lat)
        lines += [
            "",
            "Under a burst every instance waits behind the others: the burst latencies"
            " measure queueing at saturation, not the cost of one instance.",
        ]
        for c in self.custody:
            if c.light_hops and not c.backlog:
                lines += [
                    "",
                    f"Where a light-load operation's time goes, {c.label}: each leg from the"
                    " rows' own timestamps (a transaction's `now()`, the engine's and the"
                    " participant's), so the legs are comparable across runs:",
                    "",
                ]
                lines += _table(
                    ["leg", "p50", "p90", "operations"],
                    [[h.what, _ms(h.p50_ms), _ms(h.p90_ms), f"{h.count:,}"] for h in c.light_hops],
                )
        if self.broker_hops:
            lines += [
                "",
                "The broker's own hop, alone, right after custody r1's run"
                " (`python -m bench.hop`: one persistent message at a time, published with a"
                " confirm and consumed with an ack by aio-pika, nothing else): a light-load"
                " operation crosses a quorum queue twice, its submit and its receipt.",
                "",
            ]
            lines += _table(
                ["queue", "publish → delivery p50", "p90", "publish → confirm p50", "messages"],
                [
                    [
                        h.queue,
                        _ms2(h.delivered_p50_ms),
                        _ms2(h.delivered_p90_ms),
                        _ms2(h.confirmed_p50_ms),
                        f"{h.messages:,}",
                    ]
                    for h in self.broker_hops
                ],
            )
        lines += [
            "",
            "## Correctness (checked; a mismatch fails the run)",
            "",
        ]
        for c in self.custody:
            effects = ", ".join(f"{k} {v[0]} (expected {v[1]})" for k, v in c.effects.items())
            total = c.instances + c.warm_instances + c.light_instances
            lines.append(
                f"- {c.label}: {total:,} instances finished"
                f" (measured: completed {c.completed}, failed and compensated {c.failed});"
                f" effects {effects}; duplicates {c.duplicates}; quarantined"
                f" {c.quarantined}; shutdown exit codes {sorted(set(c.shutdown_codes))}"
                + ("; every seeded row left as seeded" if c.backlog else "")
            )
        for r in self.peers:
            total = r.workflows + r.warmup + r.light_workflows
            lines.append(
                f"- {r.system}: {total:,} workflows ({r.warmup} warm-up, {r.light_workflows}"
                f" one at a time, {r.workflows:,} in the burst), {r.effects:,} effect rows:"
                " every workflow exactly its steps 1, 2 and 3, none missing, none extra;"
                f" redeliveries absorbed by the key: {r.redeliveries}; " + "; ".join(r.checks)
            )
        for n, again in enumerate(self.rounds, 2):
            c = again.custody
            lines.append(
                f"- round {n}: {c.label} {c.instances + c.warm_instances:,} instances"
                f" finished, effects as expected, duplicates {c.duplicates}, quarantined"
                f" {c.quarantined}, shutdown exit codes {sorted(set(c.shutdown_codes))}; "
                + "; ".join(
                    f"{r.system} {r.workflows + r.warmup:,} workflows, {r.effects:,} effect"
                    " rows, each exactly once"
                    for r in again.peers
                )
            )
        lines.append(
            f"- baseline: {b.ops + b.warmup:,} commands published, received and replied,"
            " each exactly once"
        )
        lines += ["", "## Memory (resident set per process type)", ""]
        lines += [
            "The peak (VmHWM, read at the end of the burst) of every process the run"
            " started and of its Postgres backends; for the broker, which is older than"
            " the run, its resident set at the end of the window. A Postgres backend's"
            " resident set counts the shared buffers it touched, which every backend"
            " shares: its sum over-counts.",
            "",
        ]
        sections: list[tuple[str, CpuWindow]] = [("baseline", b.cpu)]
        sections += [(c.label, c.cpu) for c in self.custody]
        sections += [(f"{r.system} {r.version}", r.cpu) for r in self.peers]
        for title, window in sections:
            table = _memory_table(window)
            if table:
                lines += [f"### {title}", "", *table, ""]
        lines += ["## Where the CPU goes (utime + stime in the measured window)", ""]
        lines += [f"### baseline ({b.ops:,} operations)", ""]
        lines += _cpu_table(b.cpu, b.ops, m.nproc)
        lines += _activity_table(b.cpu.activity)
        for c in self.custody:
            lines += ["", f"### {c.label}, {c.replicas} replica(s) ({c.ops:,} operations)", ""]
            lines += _cpu_table(c.cpu, c.ops, m.nproc)
            lines += _activity_table(c.cpu.activity)
            if c.light_cpu is not None and c.light_ops:
                lines += [
                    "",
                    f"### {c.label}, light load ({c.light_ops:,} operations of"
                    f" {c.light_instances:,} instances run one at a time)",
                    "",
                    "Each unit of work here carries one item, so each process pays its fixed"
                    " cost per unit (a transaction and its statements, a delivery, an ack, a"
                    " confirm) once per operation; `bench-poll` is the bench waiting for each"
                    " instance to finish (every 10 ms).",
                    "",
                ]
                lines += _cpu_table(c.light_cpu, c.light_ops, m.nproc)
        for r in self.peers:
            lines += ["", f"### {r.system} {r.version} ({r.ops:,} operations)", ""]
            lines += _cpu_table(r.cpu, r.ops, m.nproc)
            lines += _activity_table(r.cpu.activity)
        for c in self.custody:
            if c.profile:
                lines += [
                    "",
                    f"## Where each worker's busy time goes, {c.label} (py-spy, the burst)",
                    "",
                    f"Every custody worker process sampled {profile.RATE} times a second by"
                    " `py-spy record --nonblocking` from the burst's first submit to its last"
                    " instance finished (`--profile`; bench/profile.py).",
                    "",
                    *profile.markdown(c.profile),
                ]
        lines += [
            "",
            "`postgres ← X` is the backend serving the client whose application_name is X"
            " (`custody-<worker>` for a worker's pool; LISTEN connections have no name and"
            " show as `client backend`; `bench-celery-task`, `bench-pgqueuer-*` are the"
            " peers' connections). `X (children)` are the child processes of X (Celery's"
            " prefork pool).",
            "",
        ]
        return "\n".join(lines)
