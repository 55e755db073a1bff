"""A worker's loops at a stop: ``supervisor.supervise`` ends its side loops (heartbeat,
LISTEN follower) once its main loops drained, even when a cancellation is lost.

OPERATIONS.md: "SIGTERM drains: no new deliveries, in-flight finish, confirms settled,
exit before the grace period". A side loop that lost its cancellation used to hold the
drain until the grace period ran out (exit code 3, ``worker.drain_timeout``)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from workers.runtime import supervisor


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio.wait_for no longer loses it")
async def test_python_3_11_wait_for_loses_a_cancellation_that_comes_as_its_wait_completes() -> None:
    """Why the supervisor cancels again: on this Python a task in ``asyncio.wait_for``
    (our batching and Waker, psycopg_pool's wait for a connection) whose inner wait
    completes in the same turn as its cancellation returns normally, as if never
    cancelled."""
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def waiter() -> str:
        await asyncio.wait_for(fut, 10)
        return "returned"

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    fut.set_result(None)
    task.cancel()
    assert await task == "returned"


async def test_a_side_loop_that_lost_its_cancellation_is_cancelled_again() -> None:
    """The main loop drains and ends; the side loop swallows the first cancellation (as
    ``wait_for`` does above) and would run on: it is cancelled again, and ``supervise``
    returns within about a second instead of never."""
    cancelled = 0
    drained = asyncio.Event()

    async def main_loop() -> None:
        await asyncio.sleep(0.01)
        drained.set()

    async def heartbeat() -> None:
        nonlocal cancelled
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled += 1
                if cancelled == 1:
                    continue  # lost: the loop goes on
                raise

    async with asyncio.timeout(5):
        await supervisor.supervise(main=[main_loop()], side=[heartbeat()])
    assert drained.is_set()
    assert cancelled == 2, "cancelled once, lost, cancelled again"


async def test_a_side_loop_that_ends_on_its_first_cancellation_is_cancelled_once() -> None:
    """The usual stop: one cancellation, at once."""
    cancelled = 0

    async def heartbeat() -> None:
        nonlocal cancelled
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled += 1
            raise

    async with asyncio.timeout(1):
        await supervisor.supervise(main=[asyncio.sleep(0.01)], side=[heartbeat()])
    assert cancelled == 1
