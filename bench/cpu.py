"""CPU accounting: the utime + stime of every process on the machine, sampled from
``/proc`` at the start and the end of a measured window, and the machine's own totals."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench.pg_activity import PgActivity

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of one process, in seconds (None once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


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


@dataclass
class Snapshot:
    wall: float
    cpu: dict[int, tuple[str, float]]  # pid -> (label, CPU seconds so far)
    machine: MachineCpu


@dataclass
class CpuRow:
    label: str
    group: str
    seconds: float


@dataclass
class CpuWindow:
    seconds: float  # wall-clock length of the window
    rows: list[CpuRow]
    machine: MachineCpu
    activity: PgActivity | None = None

    @property
    def accounted(self) -> float:
        return sum(r.seconds for r in self.rows)

    @property
    def own(self) -> float:
        """CPU of this run's processes, the broker and the database (not "other")."""
        return sum(r.seconds for r in self.rows if r.group != "other")


class Probe:
    """Samples the CPU time of every process on the machine: the ones this run started
    (labelled), the broker (beam.smp), the Postgres processes (labelled with the
    ``application_name`` of the client they serve, when it is one of this run's
    databases), and everything else by its command name, so that another workload on
    the machine shows up instead of hiding in the figures."""

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

    async def __aenter__(self) -> Probe:
        self._conn = await psycopg.AsyncConnection.connect(
            self.admin_url, autocommit=True, application_name="bench-probe"
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
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
        for pid, name, datname in rows:
            if datname is None or datname in self.databases or str(name).startswith("bench-"):
                names[int(pid)] = f"postgres ← {name}"
            else:
                names[int(pid)] = f"other: postgres ← {name} (database {datname})"
        return _snapshot(self.own, names)

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
        )

    def _group(self, label: str) -> str:
        if label in self.groups:
            return self.groups[label]
        for prefix in ("postgres", "rabbitmq", "other"):
            if label.startswith(prefix):
                return prefix
        return "bench"


def _snapshot(own: Mapping[str, int], pg_names: Mapping[int, str]) -> Snapshot:
    """Synchronous /proc reads (one sample takes a few milliseconds)."""
    wall = time.monotonic()
    label_of = {pid: label for label, pid in own.items()}
    cpu: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        used = _proc_cpu_s(pid)
        if not used:
            continue
        comm = _comm(pid)
        if pid in label_of:
            label = label_of[pid]
        elif comm == "beam.smp":
            label = "rabbitmq (beam.smp)"
        elif comm == "postgres":
            label = pg_names.get(pid, "postgres: postmaster and others")
        else:
            label = "other: " + ("kworker" if comm.startswith("kworker") else comm)
        cpu[pid] = (label, used)
    return Snapshot(wall, cpu, MachineCpu.now())
