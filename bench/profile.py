"""Where each worker's own time goes in a burst: py-spy samples every custody worker
process while the burst runs (``python -m bench.run --profile``, ``make profile``).

py-spy reads a process's Python stacks from outside (``--nonblocking``: it never stops
the process, so the figures it samples are not slowed by it), at ``RATE`` samples a
second; each sample is one stack. A sample whose innermost frame is the event loop's
``select`` is the process waiting for work, not using the CPU: it is counted apart. Of
the others, each is charged to the library its innermost Python frame belongs to (the
time of a C call — libpq's send and receive, pydantic-core's validation — shows in the
Python frame that made it), and each custody function on the stack gets the sample
inclusively: what the report gives per process is where the busy time goes, in shares
that compare across runs, not seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from bench.common import BenchFailure

RATE: Final = 200  # samples a second per process
TOP: Final = 10  # entries kept per process and list

# (group, top-level modules): a leaf frame's group is the one its module belongs to (py-spy
# names a frame's file relative to its entry of sys.path: ``psycopg/_pipeline_base.py``)
GROUPS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("custody", ("workers", "contracts", "participants")),
    ("psycopg", ("psycopg", "psycopg_pool", "psycopg_binary")),
    ("aio-pika, aiormq, pamqp", ("aio_pika", "aiormq", "pamqp")),
    ("pydantic", ("pydantic", "pydantic_core")),
    ("asyncio", ("asyncio", "selectors.py")),
    ("logging, metrics, tracing", ("structlog", "logging", "prometheus_client", "opentelemetry")),
)
OTHER: Final = "other (standard library, orjson, ...)"
_FRAME: Final = re.compile(r"^(?P<function>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_GROUP_OF: Final = {module: name for name, modules in GROUPS for module in modules}
# a process's scaffolding, on every stack of its work (the process, its supervised
# loops, the consume loop and its unit): left out of the inclusive list
_SCAFFOLDING: Final = (
    "workers/cli/",
    "workers/runtime/supervisor.py",
    "workers/runtime/consume.py",
)


@dataclass(frozen=True)
class Frame:
    function: str
    file: str

    @property
    def label(self) -> str:
        """``function (package/module.py)``: the last two parts of the path."""
        return f"{self.function} ({'/'.join(Path(self.file).parts[-2:])})"

    @property
    def module(self) -> str:
        """The frame's top-level module: the first part of its path that names a known
        one (so an absolute path works too), else the first part."""
        parts = self.file.replace("\\", "/").split("/")
        for part in parts:
            if part in _GROUP_OF:
                return part
        return parts[0]

    @property
    def custody(self) -> bool:
        return _GROUP_OF.get(self.module) == "custody"

    @property
    def idle(self) -> bool:
        """The event loop waiting for work (``selectors.EpollSelector.select``)."""
        return self.module == "selectors.py" and self.function.endswith("select")


def parse_frame(text: str) -> Frame:
    m = _FRAME.match(text)
    if m is None:
        return Frame(text, "")
    return Frame(m["function"], m["file"])


def group_of(frame: Frame) -> str:
    return _GROUP_OF.get(frame.module, OTHER)


@dataclass
class ProcessProfile:
    """One process's samples: ``busy`` of ``samples`` were not waiting in select."""

    process: str
    samples: int = 0
    busy: int = 0
    groups: Counter[str] = field(default_factory=Counter)  # busy samples by leaf library
    custody: Counter[str] = field(default_factory=Counter)  # custody functions, inclusive
    leaves: Counter[str] = field(default_factory=Counter)  # innermost frames (self)

    def share(self, count: int) -> float:
        return count / self.busy if self.busy else 0.0


def summarize(process: str, lines: Iterable[str]) -> ProcessProfile:
    """Fold py-spy's ``--format raw`` output (``frame;frame;... count`` per line, the
    outermost frame first) into one :class:`ProcessProfile`."""
    p = ProcessProfile(process)
    for line in lines:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [parse_frame(f) for f in stack.split(";") if f]
        if not frames:
            continue
        p.samples += count
        leaf = frames[-1]
        if leaf.idle:
            continue
        p.busy += count
        p.groups[group_of(leaf)] += count
        p.leaves[leaf.label] += count
        for label in {
            f.label for f in frames if f.custody and not any(s in f.file for s in _SCAFFOLDING)
        }:
            p.custody[label] += count
    return p


class Sampler:
    """py-spy on each of ``pids`` from entering to leaving: ``profiles`` after exit.

    Each process gets a ``py-spy record`` of its own, stopped with SIGINT (py-spy then
    writes what it sampled). A process that is gone before the end leaves what was
    sampled until then."""

    def __init__(self, pids: Mapping[str, int], rate: int = RATE) -> None:
        self.pids = dict(pids)
        self.rate = rate
        self.profiles: list[ProcessProfile] = []
        self._dir: Path | None = None
        self._procs: dict[str, asyncio.subprocess.Process] = {}

    @staticmethod
    def available() -> str | None:
        """py-spy beside this Python (the venv's bin), else on PATH."""
        beside = Path(sys.executable).parent / "py-spy"
        return str(beside) if beside.is_file() else shutil.which("py-spy")

    async def __aenter__(self) -> Sampler:
        exe = self.available()
        if exe is None:
            raise BenchFailure(
                "py-spy is not installed (the bench extra): `make profile` installs it,"
                " or `.venv/bin/pip install -e '.[bench]'`"
            )
        self._dir = Path(tempfile.mkdtemp(prefix="custody-profile-"))
        for label, pid in self.pids.items():
            self._procs[label] = await asyncio.create_subprocess_exec(
                exe,
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(self.rate),
                "--nonblocking",
                "--format",
                "raw",
                "--output",
                str(self._dir / f"{pid}.txt"),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
        await asyncio.sleep(0.5)  # py-spy attaches before the window opens
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._dir is not None
        try:
            for proc in self._procs.values():
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGINT)
            problems = []
            for label, proc in self._procs.items():
                try:
                    _, err = await asyncio.wait_for(proc.communicate(), 30)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
                    err = b"py-spy did not stop within 30 s"
                out = self._dir / f"{self.pids[label]}.txt"
                if out.exists():
                    with out.open() as f:
                        self.profiles.append(summarize(label, f))
                else:
                    problems.append(f"{label}: {err.decode(errors='replace').strip()[-300:]}")
            if problems and not self.profiles:
                raise BenchFailure("py-spy sampled nothing: " + "; ".join(problems))
        finally:
            keep = os.environ.get("BENCH_PROFILE_KEEP")
            if keep:
                shutil.copytree(self._dir, keep, dirs_exist_ok=True)
            shutil.rmtree(self._dir, ignore_errors=True)


def combined(profiles: Sequence[ProcessProfile]) -> ProcessProfile:
    """All the processes' samples as one profile (``all workers``)."""
    every = ProcessProfile("all workers")
    for p in profiles:
        every.samples += p.samples
        every.busy += p.busy
        every.groups.update(p.groups)
        every.custody.update(p.custody)
        every.leaves.update(p.leaves)
    return every


def markdown(profiles: Sequence[ProcessProfile], top: int = TOP) -> list[str]:
    """Per process: its busy share by library, and the custody functions and innermost
    frames that hold the most of it."""
    if not profiles:
        return []
    names = [g for g, _ in GROUPS] + [OTHER]
    lines = [
        "| process | samples | busy | " + " | ".join(names) + " |",
        "|" + "|".join("---" for _ in range(3 + len(names))) + "|",
    ]
    every = combined(profiles)
    for p in [*sorted(profiles, key=lambda p: -p.busy), every]:
        name = f"**{p.process}**" if p is every else p.process
        lines.append(
            f"| {name} | {p.samples:,} | {100 * p.busy / max(p.samples, 1):.0f} % | "
            + " | ".join(f"{100 * p.share(p.groups[g]):.0f} %" for g in names)
            + " |"
        )
    lines += [
        "",
        "*busy*: the samples not waiting in the event loop's `select`; each library column"
        " is its share of those, by the innermost Python frame (a C call's time shows in"
        " the Python frame that made it). Every process is sampled at the same rate, so"
        " the last row, all of them together, weighs each by its busy time.",
        "",
    ]
    for p in sorted(profiles, key=lambda p: -p.busy):
        if not p.busy:
            continue
        lines += [f"**{p.process}**: custody functions, inclusive (share of busy samples)", ""]
        lines += [f"- {100 * p.share(n):.0f} % `{k}`" for k, n in p.custody.most_common(top)]
        lines += ["", f"**{p.process}**: innermost frames (self)", ""]
        lines += [f"- {100 * p.share(n):.0f} % `{k}`" for k, n in p.leaves.most_common(top)]
        lines.append("")
    return lines
