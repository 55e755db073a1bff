"""Consumer batching: natural batches under load, no linger at light load."""

from __future__ import annotations

import asyncio

from workers.runtime import batching, supervisor


async def test_a_lone_delivery_is_handled_at_once_not_after_the_linger() -> None:
    """Light-load latency is a few commits, not a poll or linger interval (issue 14):
    a delivery with nothing queued behind it is returned without waiting the linger
    (30 s here: waiting for it would fail the test's 5 s bound)."""
    inbox: asyncio.Queue[int] = asyncio.Queue()
    inbox.put_nowait(1)
    batch = await asyncio.wait_for(
        batching.next_batch(inbox, supervisor.Stop(grace_s=1), size=100, linger_s=30), 5
    )
    assert batch == [1]


async def test_under_load_a_batch_takes_everything_queued_up_to_its_size() -> None:
    inbox: asyncio.Queue[int] = asyncio.Queue()
    for i in range(250):
        inbox.put_nowait(i)
    stop = supervisor.Stop(grace_s=1)
    first = await batching.next_batch(inbox, stop, size=100, linger_s=0.01)
    second = await batching.next_batch(inbox, stop, size=100, linger_s=0.01)
    assert (first, second) == (list(range(100)), list(range(100, 200)))


async def test_while_deliveries_keep_coming_the_batch_lingers_for_them() -> None:
    """More behind the first delivery: the batch waits (up to the linger) for the
    rest of a burst that is still arriving, so it is not split into many."""
    inbox: asyncio.Queue[int] = asyncio.Queue()
    inbox.put_nowait(0)
    inbox.put_nowait(1)

    async def trickle() -> None:
        for i in range(2, 10):
            await asyncio.sleep(0.01)
            inbox.put_nowait(i)

    feeder = asyncio.create_task(trickle())
    batch = await batching.next_batch(inbox, supervisor.Stop(grace_s=1), size=10, linger_s=5)
    await feeder
    assert batch == list(range(10))


async def test_a_stop_request_ends_the_wait_for_a_first_delivery() -> None:
    stop = supervisor.Stop(grace_s=1)
    stop.event.set()
    assert await batching.next_batch(asyncio.Queue(), stop, size=10, linger_s=1) == []
