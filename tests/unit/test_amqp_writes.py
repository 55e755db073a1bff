"""The pinned patch of aiormq's frame writer (workers.io.amqp_writes): the frames
already queued together go out in one socket write, in their order, and nothing else
changes (a lone frame, a close, a drain). No broker needed: the iterator reads a real
aiormq write queue of real marshalled frames."""

from __future__ import annotations

import asyncio
from typing import Any

import aiormq.connection
import pytest
from aiormq.abc import ChannelFrame
from pamqp import commands

from workers.io import amqp_frames, amqp_writes, broker


def frame(
    n: int, *, close: bool = False, drain: asyncio.Future[None] | None = None
) -> ChannelFrame:
    method = commands.Connection.CloseOk() if close else commands.Basic.Ack(delivery_tag=n)
    return ChannelFrame.marshall(1, [method], drain_future=drain)


async def take(queue: asyncio.Queue[ChannelFrame]) -> Any:
    """The next write the patched writer makes: a frame, or frames joined."""
    return await amqp_writes.CoalescingFrameGenerator(queue).__anext__()


def test_importing_the_broker_installs_the_writer_patch() -> None:
    assert broker.EXCHANGE_COMMANDS
    assert amqp_writes.is_installed()
    assert aiormq.connection.FrameGenerator is amqp_writes.CoalescingFrameGenerator


def test_install_refuses_other_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(amqp_frames, "installed_versions", lambda: {"aiormq": "7.2.5"})
    with pytest.raises(RuntimeError, match="pinned"):
        amqp_writes.install()


def test_upstream_writer_still_reads_its_queue_through_the_patched_name() -> None:
    """If aiormq stops looking FrameGenerator up at run time, or changes what the writer
    reads of a frame, this fails: re-check the patch before moving the pin."""
    writer = aiormq.connection.Connection._Connection__writer  # type: ignore[attr-defined]
    names = writer.__code__.co_names
    assert "FrameGenerator" in names
    assert {"payload", "should_close", "should_drain", "drain"} <= set(names)


async def test_frames_queued_together_are_written_as_one_payload_in_order() -> None:
    queue: asyncio.Queue[ChannelFrame] = asyncio.Queue()
    frames = [frame(i) for i in range(1, 65)]
    for f in frames:
        queue.put_nowait(f)
    joined = await take(queue)
    assert joined.payload == b"".join(f.payload for f in frames)
    assert queue.empty()


async def test_a_lone_frame_is_written_as_it_is() -> None:
    queue: asyncio.Queue[ChannelFrame] = asyncio.Queue()
    lone = frame(1)
    queue.put_nowait(lone)
    assert await take(queue) is lone


async def test_nothing_is_joined_after_a_close() -> None:
    queue: asyncio.Queue[ChannelFrame] = asyncio.Queue()
    for f in (frame(1), frame(2, close=True), frame(3)):
        queue.put_nowait(f)
    joined = await take(queue)
    assert joined.should_close
    assert queue.qsize() == 1  # the frame after the close stays queued (aiormq drops it)


async def test_draining_a_joined_write_drains_every_frame_in_it() -> None:
    loop = asyncio.get_running_loop()
    waits = [loop.create_future(), loop.create_future()]
    queue: asyncio.Queue[ChannelFrame] = asyncio.Queue()
    for f in (frame(1, drain=waits[0]), frame(2), frame(3, drain=waits[1])):
        queue.put_nowait(f)
    joined = await take(queue)
    assert joined.should_drain
    joined.drain()
    assert all(w.done() for w in waits)
    assert not joined.should_drain


async def test_a_write_is_bounded_and_the_rest_waits_for_the_next() -> None:
    queue: asyncio.Queue[ChannelFrame] = asyncio.Queue()
    big = [ChannelFrame.marshall(1, [commands.Basic.Ack(delivery_tag=i)]) for i in range(1, 20001)]
    for f in big:
        queue.put_nowait(f)
    first = await take(queue)
    size = len(first.payload)
    assert amqp_writes.MAX_PAYLOAD <= size < amqp_writes.MAX_PAYLOAD + 64
    rest = b""
    while not queue.empty():
        rest += (await take(queue)).payload
    assert first.payload + rest == b"".join(f.payload for f in big)
