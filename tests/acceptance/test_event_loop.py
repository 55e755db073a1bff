"""Issue 14 (performance): every worker runs on uvloop, libuv's event loop in C, unless
``CUSTODY_EVENT_LOOP=asyncio`` asks for the standard library's; and with the garbage
collector's youngest-generation threshold of ``CUSTODY_GC_THRESHOLD`` (10,000 by default).

A worker's time goes to many small waits (a statement's answer, a delivery, a confirm,
a NOTIFY); on uvloop each costs less, and every worker of the bench's fleet spent 8-15 %
less CPU per operation (docs/performance.md). The loop is the process's own choice, so
it is checked on real processes: each says its loop in ``worker.started`` and does its
work on it (an engine worker and a participant, each isolating a malformed message),
then drains on SIGTERM; a loop that is not one of the two is refused at once.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.acceptance.observability import consumes, events, sigterm, start, tail, wait_ready
from tests.acceptance.support import Crew
from tests.conftest import Env

pytestmark = pytest.mark.acceptance


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("worker", ["receipts", "inventory"])
async def test_a_worker_runs_and_drains_on_the_event_loop_it_is_given(
    env: Env, crew: Crew, worker: str, loop: str
) -> None:
    # uvloop is the default: nothing set (and the garbage collector's default threshold)
    s = (
        start(crew, worker)
        if loop == "uvloop"
        else start(crew, worker, CUSTODY_EVENT_LOOP=loop, CUSTODY_GC_THRESHOLD="2500")
    )
    await wait_ready(crew, [s])
    [started] = events(s.proc, "worker.started")
    assert started["event_loop"] == loop, started
    # the collector's threshold the process runs with (the setting gc_threshold)
    assert started["gc_threshold"] == (10_000 if loop == "uvloop" else 2500), started
    await consumes(env, crew, worker)
    assert await sigterm(crew, s.proc) == 0, tail(s.proc)


@pytest.mark.timeout(60)
async def test_an_unknown_event_loop_is_refused_at_once(env: Env, crew: Crew) -> None:
    s = start(crew, "receipts", CUSTODY_EVENT_LOOP="trio")
    code = await asyncio.to_thread(s.proc.popen.wait, 15)
    crew.retired.add(s.proc.name)
    assert code == 2, tail(s.proc)
    assert "CUSTODY_EVENT_LOOP must be one of uvloop, asyncio" in tail(s.proc), tail(s.proc)
