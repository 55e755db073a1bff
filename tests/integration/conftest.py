"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from tests.conftest import Env
from tests.harness import InProcessFleet
from workers.runtime import faults


@pytest.fixture
async def fleet(env: Env) -> AsyncIterator[InProcessFleet]:
    """An in-process fleet of this test's world; the test starts what it needs, and
    whatever runs is stopped after it."""
    f = InProcessFleet(env)
    yield f
    await f.stop_all()


@pytest.fixture
def poison_marker() -> Iterator[str]:
    """A marker that makes any unit of work whose message carries it fail (a bug the
    message triggers, not an outage); disarmed after the test."""
    marker = "POISON-7f3a"
    faults.set_poison_marker(marker)
    yield marker
    faults.set_poison_marker("")
