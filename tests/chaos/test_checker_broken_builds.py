"""The checker is tested too: a deliberately broken build (``CUSTODY_BROKEN``, see
workers/runtime/faults.py) under the faults that expose it must make the run fail, in the
category that names the defect."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from chaos import schedule
from tests.chaos.support import chaos, workdir

DURATION = 40.0


def _early_committer_crash(f: schedule.Fault) -> bool:
    # acked start requests die with the committer before its commit: a lost start
    return f.kind == "crash_point" and f.params.get("point") == "before_commit" and f.at_s < 20


# broken build → (fault kinds, fault rate scale, a fault the schedule must contain,
# the category it must show up in, base port)
CASES: dict[str, tuple[str, float, Callable[[schedule.Fault], bool] | None, str, int]] = {
    "ack_before_commit": ("kill,crash_point", 1.0, _early_committer_crash, "lost", 21300),
    "mark_before_confirm": ("rabbit_kill,proxy_cut,kill", 1.0, None, "lost", 21400),
    "skip_instance_recheck": ("cancel,proxy_slow", 6.0, None, "unexpected", 21500),
    "accepted_as_success": ("kill", 1.0, None, "unexpected", 21600),
}


def _seed(kinds: str, scale: float, must: Callable[[schedule.Fault], bool] | None) -> int:
    """The first seed whose schedule has the fault that exposes the defect."""
    for seed in range(1, 10_000):
        plan = schedule.build(seed, DURATION, kinds=kinds.split(","), scale=scale)
        if must is None or any(must(f) for f in plan):
            return seed
    raise AssertionError("no seed schedules the fault")


@pytest.mark.chaos
@pytest.mark.chaos_selftest
@pytest.mark.timeout(400)  # 290 s, then up to 90 s to stop a run
@pytest.mark.parametrize("build", sorted(CASES))
def test_a_broken_build_makes_the_chaos_run_fail(build: str, tmp_path: Path) -> None:
    kinds, scale, must, category, port = CASES[build]
    seed = _seed(kinds, scale, must)
    code, output, report = chaos(
        f"run --seed {seed} --instances 400 --duration {DURATION:g} --kinds {kinds}"
        f" --scale {scale:g} --base-port {port} --settle 90".split(),
        workdir=workdir(tmp_path.name),
        timeout=290,
        env={"CUSTODY_BROKEN": build},
    )
    tail = "\n".join(output.splitlines()[-15:])
    assert report, f"no report:\n{tail}"
    assert code == 1, f"broken build {build} passed the checker:\n{tail}"
    assert report["checker"]["counts"][category] > 0, (build, report["checker"]["counts"], tail)
