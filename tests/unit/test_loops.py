"""The event loop a command or worker runs on (workers/runtime/loops.py): uvloop by
default, asyncio's own when asked; a uvloop that cannot be imported is a configuration
error that says the way out, not a traceback."""

from __future__ import annotations

import asyncio
import sys

import pytest

from workers.errors import ConfigError
from workers.runtime import loops


def test_the_default_runs_on_uvloop_and_asyncio_on_its_own_loop() -> None:
    async def which() -> str:
        return loops.name_of(asyncio.get_running_loop())

    with asyncio.Runner(loop_factory=loops.factory("uvloop")) as runner:
        assert runner.run(which()) == "uvloop"
    assert loops.factory("asyncio") is None
    with asyncio.Runner(loop_factory=loops.factory("asyncio")) as runner:
        assert runner.run(which()) == "asyncio"


def test_a_uvloop_that_cannot_be_imported_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop: ImportError
    with pytest.raises(ConfigError, match="CUSTODY_EVENT_LOOP=asyncio"):
        loops.factory("uvloop")
