"""The machine's pace: a fixed piece of CPU work, timed again and again in its own
process while a window is measured.

A shared 2-core machine's speed moves by a tenth or more from one minute to the next
(the host's other tenants, frequency, caches), and every figure of a run moves with it:
two runs a minute apart are compared at different speeds. The probe measures that speed
apart from any system under test: the same pure-Python work (arithmetic, a dict, no
I/O), its CPU time (``time.process_time_ns``: not the time it waited for a core) per
unit, a sample every 100 ms, about 1 % of one core. Its process is labelled and counted
as "other", outside every system's figures. ``Probe`` (bench/cpu.py) runs it for each
window; the report gives each window's median (µs per unit: higher is slower) and uses
the ratio of two windows' medians to give each ratio (custody against a peer, the
backlog against the empty tables) also at the same pace. Rough: the probe shares the
caches of whatever runs beside it.

Run as ``python -m bench.pace <file>``: one line per sample, ``<time.monotonic()>
<µs of CPU per unit>``, until terminated.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

EVERY_S = 0.1


def unit() -> int:
    """The fixed work: about a millisecond of interpreted arithmetic and dict inserts."""
    total = 0
    for i in range(12_000):
        total += i * i % 7
    table = {}
    for i in range(1_500):
        table[str(i)] = i
    return total + len(table)


def sample() -> float:
    """µs of this process's CPU for one unit."""
    start = time.process_time_ns()
    unit()
    return (time.process_time_ns() - start) / 1000


def read(path: Path) -> str:
    """The samples written so far ("" when there are none)."""
    try:
        return path.read_text()
    except OSError:
        return ""


def between(samples: str, start: float, end: float) -> float | None:
    """The median µs per unit of the samples (as :func:`main` writes them) taken in
    ``[start, end]`` (monotonic clock), None with fewer than three."""
    values = []
    for line in samples.splitlines():
        parts = line.split()
        if len(parts) == 2 and start <= float(parts[0]) <= end:
            values.append(float(parts[1]))
    return statistics.median(values) if len(values) >= 3 else None


def main(argv: list[str]) -> int:
    with open(argv[0], "a", buffering=1) as out:
        while True:
            value = sample()
            out.write(f"{time.monotonic():.3f} {value:.1f}\n")
            time.sleep(EVERY_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
