"""The bench's machine pace (bench/pace.py) and the report's use of it for the backlog
ratio: pure arithmetic on sampled figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import pace
from bench.cpu import CpuWindow, MachineCpu
from bench.report import machine_pace


def _window(pace_us: float | None) -> CpuWindow:
    return CpuWindow(seconds=10.0, rows=[], machine=MachineCpu(0.0, 0.0, 0.0, 0.0), pace_us=pace_us)


def test_the_pace_of_a_window_is_the_median_of_the_samples_taken_in_it(tmp_path: Path) -> None:
    path = tmp_path / "pace.txt"
    path.write_text("9.0 5000\n10.0 1000\n10.1 1200\n10.2 1100\n10.3 9000\n11.5 7000\n")
    samples = pace.read(path)
    assert pace.between(samples, 10.0, 10.3) == pytest.approx(1150)
    assert pace.between(samples, 10.0, 10.1) is None, "fewer than three samples"
    assert pace.between(pace.read(tmp_path / "missing.txt"), 0, 99) is None


def test_the_pace_is_the_cpu_time_of_a_fixed_piece_of_work() -> None:
    assert pace.unit() == pace.unit()
    assert pace.sample() > 0


def test_the_backlog_is_put_at_the_empty_table_windows_pace() -> None:
    """A window where the same work took 1.25 x the CPU ran on a machine 1.25 x
    slower; without a pace for both windows there is no comparison."""
    assert machine_pace(_window(1000.0), _window(1250.0)) == pytest.approx(1.25)
    assert machine_pace(_window(1000.0), _window(None)) is None
    assert machine_pace(_window(None), _window(1000.0)) is None
