"""The chaos tier: real chaos runs against the harness's own private services.

The checker's self-tests (one run per deliberately broken build, about a minute
each) are collected only with ``CUSTODY_CHAOS_SELFTEST=1`` (``make chaos-selftest``),
so that ``make test`` stays within CI's time limit; the CI-sized run always is.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # under pytest-xdist (make test) every chaos run goes to one test process: the runs
    # bind fixed ports and each takes both cores for a while
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here):
            item.add_marker(pytest.mark.xdist_group("chaos"))
    if os.environ.get("CUSTODY_CHAOS_SELFTEST"):
        return
    keep = [i for i in items if i.get_closest_marker("chaos_selftest") is None]
    dropped = [i for i in items if i.get_closest_marker("chaos_selftest") is not None]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
