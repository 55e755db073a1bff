"""CPU and memory accounting: the utime + stime of every process on the machine, sampled
from ``/proc`` at the start and the end of a measured window, the machine's own totals,
and the peak resident memory of the processes a run is made of."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench import pace
from bench.pg_activity import PgActivity

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> tuple[float, int] | None:
    """utime + stime of one process, in seconds, and its parent's pid (None once it is
    gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK, int(fields[1])


def _proc_mem_kib(pid: int) -> tuple[int, int] | None:
    """VmHWM (the peak resident set since the process started) and VmRSS, in KiB."""
    try:
        raw = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values = {}
    for line in raw.splitlines():
        if line.startswith(("VmHWM:", "VmRSS:")):
            key, value = line.split(":", 1)
            values[key] = int(value.split()[0])
    if "VmRSS" not in values:
        return None  # a kernel thread, or a zombie
    return values.get("VmHWM", values["VmRSS"]), values["VmRSS"]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class MachineCpu:
    """CPU seconds of the whole machine (all cores), from /proc/stat."""

    busy: float  # user + nice + system + irq + softirq
    irq: float  # irq + softirq: not always charged to a process
    steal: float  # taken by the hypervisor for someone else
    total: float

    @classmethod
    def now(cls) -> MachineCpu:
        v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        v += [0] * (8 - len(v))
        user, nice, system, _idle, _iowait, irq, softirq, steal = v
        return cls(
            busy=(user + nice + system + irq + softirq) / CLK_TCK,
            irq=(irq + softirq) / CLK_TCK,
            steal=steal / CLK_TCK,
            total=sum(v) / CLK_TCK,
        )

    def __sub__(self, other: MachineCpu) -> MachineCpu:
        return MachineCpu(
            self.busy - other.busy,
            self.irq - other.irq,
            self.steal - other.steal,
            self.total - other.total,
        )


@dataclass(frozen=True)
class MemSample:
    label: str
    kib: int  # VmHWM for a process of this run (its peak), VmRSS for an older one
    peak: bool  # True: kib is VmHWM, the process's whole life is this run's


@dataclass
class Snapshot:
    wall: float
    cpu: dict[int, tuple[str, float]]  # pid -> (label, CPU seconds so far)
    machine: MachineCpu
    mem: dict[int, MemSample] = field(default_factory=dict)


@dataclass
class CpuRow:
    label: str
    group: str
    seconds: float


@dataclass
class MemRow:
    """The processes of one type (replicas and pool children folded together)."""

    kind: str
    group: str
    processes: int
    largest_kib: int  # the largest process's peak
    total_kib: int  # the sum of every process's peak
    peak: bool  # False: the resident set at the end of the window (a process older than
    # the run, e.g. the broker, whose lifetime peak says nothing about this run)


@dataclass
class CpuWindow:
    seconds: float  # wall-clock length of the window
    rows: list[CpuRow]
    machine: MachineCpu
    activity: PgActivity | None = None
    memory: list[MemRow] = field(default_factory=list)
    # the machine's pace in the window: µs of CPU per unit of bench/pace.py's fixed work
    # (median; higher is slower), None when it was not sampled
    pace_us: float | None = None

    def worker_rss_kib(self, groups: Sequence[str]) -> int:
        """The sum of the peaks of this system's own processes (broker and database
        excluded)."""
        return sum(r.total_kib for r in self.memory if r.group in groups)

    @property
    def accounted(self) -> float:
        return sum(r.seconds for r in self.rows)

    @property
    def own(self) -> float:
        """CPU of this run's processes, the broker and the database (not "other")."""
        return sum(r.seconds for r in self.rows if r.group != "other")


class Probe:
    """Samples the CPU time of every process on the machine: the ones this run started
    (labelled; their child processes, such as a prefork pool's, under the parent's
    label with " (children)"), the broker (beam.smp), the Postgres processes (labelled
    with the ``application_name`` of the client they serve, when it is one of this
    run's databases), and everything else by its command name, so that another
    workload on the machine shows up instead of hiding in the figures. Each snapshot
    also reads the resident memory of this run's processes, the broker's and the
    database's (``/proc/<pid>/status``)."""

    def __init__(
        self,
        admin_url: str,
        own: Mapping[str, int],
        groups: Mapping[str, str],
        databases: Sequence[str],
    ) -> None:
        self.admin_url = admin_url
        self.own = dict(own)
        self.groups = dict(groups)
        self.databases = set(databases)
        self._conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        self._pace: asyncio.subprocess.Process | None = None
        self._pace_file: Path | None = None
        self._pace_samples = ""

    async def __aenter__(self) -> Probe:
        self._conn = await psycopg.AsyncConnection.connect(
            self.admin_url, autocommit=True, application_name="bench-probe"
        )
        # the machine's pace through the window (bench/pace.py), counted as "other"
        fd, name = tempfile.mkstemp(prefix="bench-pace-", suffix=".txt")
        os.close(fd)
        self._pace_file = Path(name)
        self._pace = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.pace",
            name,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
        )
        self.own[PACE_LABEL] = self._pace.pid
        # the window starts once it samples (an interpreter's start takes a moment)
        for _ in range(300):  # 3 s at most
            if self._pace_file.stat().st_size:
                break
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._pace is not None:
            with contextlib.suppress(ProcessLookupError):
                self._pace.terminate()
            await self._pace.wait()
            self._pace = None
        if self._pace_file is not None:  # its samples stay for window()
            self._pace_samples = pace.read(self._pace_file)
            self._pace_file.unlink(missing_ok=True)
            self._pace_file = None
        if self._conn is not None:
            await self._conn.close()

    async def snapshot(self) -> Snapshot:
        assert self._conn is not None
        rows = await (
            await self._conn.execute(
                "SELECT pid, coalesce(nullif(application_name, ''), backend_type), datname"
                " FROM pg_stat_activity"
            )
        ).fetchall()
        names = {}
        fresh = set()  # backends of this run: their whole life is this run's
        for pid, name, datname in rows:
            if datname is None or datname in self.databases or str(name).startswith("bench-"):
                names[int(pid)] = f"postgres ← {name}"
                if datname is not None:
                    fresh.add(int(pid))
            else:
                names[int(pid)] = f"other: postgres ← {name} (database {datname})"
        return _snapshot(self.own, names, fresh)

    def window(self, start: Snapshot, end: Snapshot) -> CpuWindow:
        out: dict[str, CpuRow] = {}
        for pid, (label, value) in end.cpu.items():
            used = value - start.cpu.get(pid, ("", 0.0))[1]
            row = out.setdefault(label, CpuRow(label, self._group(label), 0.0))
            row.seconds += max(0.0, used)
        return CpuWindow(
            seconds=end.wall - start.wall,
            rows=sorted(out.values(), key=lambda r: -r.seconds),
            machine=end.machine - start.machine,
            memory=self._memory(end),
            pace_us=pace.between(
                pace.read(self._pace_file) if self._pace_file else self._pace_samples,
                start.wall,
                end.wall,
            ),
        )

    def _memory(self, end: Snapshot) -> list[MemRow]:
        rows: dict[str, MemRow] = {}
        for sample in end.mem.values():
            group = self._group(sample.label)
            if group == "other":
                continue
            kind = _kind(sample.label)
            row = rows.get(kind)
            if row is None:
                rows[kind] = MemRow(kind, group, 1, sample.kib, sample.kib, sample.peak)
            else:
                row.processes += 1
                row.largest_kib = max(row.largest_kib, sample.kib)
                row.total_kib += sample.kib
                row.peak = row.peak and sample.peak
        return sorted(rows.values(), key=lambda r: -r.total_kib)

    def _group(self, label: str) -> str:
        label = label.removesuffix(CHILDREN)
        if label in self.groups:
            return self.groups[label]
        for prefix in ("postgres", "rabbitmq", "other"):
            if label.startswith(prefix):
                return prefix
        return "bench"


CHILDREN = " (children)"
PACE_LABEL = "other: the pace probe (bench/pace.py)"


def _kind(label: str) -> str:
    """A process type: the label without its replica number (``receipts-2`` → ``receipts``)."""
    return re.sub(r"-\d+((?: \(children\))?)$", r"\1", label)


def _snapshot(own: Mapping[str, int], pg_names: Mapping[int, str], pg_fresh: set[int]) -> Snapshot:
    """Synchronous /proc reads (one sample takes a few milliseconds)."""
    wall = time.monotonic()
    label_of = {pid: label for label, pid in own.items()}
    stats: dict[int, tuple[float, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (stat := _proc_stat(int(entry.name))) is not None:
            stats[int(entry.name)] = stat
    cpu: dict[int, tuple[str, float]] = {}
    mem: dict[int, MemSample] = {}
    for pid, (used, _ppid) in stats.items():
        comm = _comm(pid)
        parent = _labelled_ancestor(pid, stats, label_of)
        fresh = False
        if pid in label_of:
            label, fresh = label_of[pid], True
        elif parent is not None and comm not in ("postgres", "beam.smp"):
            label, fresh = label_of[parent] + CHILDREN, True
        elif comm == "beam.smp":
            label = "rabbitmq (beam.smp)"
        elif comm == "postgres":
            label = pg_names.get(pid, "postgres: postmaster and others")
            fresh = pid in pg_fresh
        else:
            label = "other: " + ("kworker" if comm.startswith("kworker") else comm)
        if used:
            cpu[pid] = (label, used)
        if not label.startswith("other") and (kib := _proc_mem_kib(pid)) is not None:
            mem[pid] = MemSample(label, kib[0] if fresh else kib[1], fresh)
    return Snapshot(wall, cpu, MachineCpu.now(), mem)


def _labelled_ancestor(
    pid: int, stats: Mapping[int, tuple[float, int]], label_of: Mapping[int, str]
) -> int | None:
    """The nearest ancestor that this run started and labelled (a pool's parent)."""
    seen = 0
    while pid in stats and seen < 8:
        pid = stats[pid][1]
        if pid in label_of:
            return pid
        seen += 1
    return None
