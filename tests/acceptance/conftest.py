"""Acceptance fixtures: a fleet of real worker processes per test, always stopped."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.acceptance.support import Crew
from tests.conftest import Env
from workers.harness.fleet import Fleet


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item, so a fixture knows the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture
def crew(env: Env, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Crew]:
    """Real worker processes (``python -m workers.cli run ...``) for one test's world;
    at teardown every one is stopped (SIGTERM, then SIGKILL after the grace period)
    and, if the test failed, the tail of every worker's log is printed."""
    crew = Crew(env, Fleet(env=env.fleet_env(), log_dir=tmp_path / "logs"))
    try:
        yield crew
    finally:
        codes = crew.fleet.stop(grace_s=25)
        report = getattr(request.node, "rep_call", None)
        if report is None or report.failed:
            print(crew.report(codes))
