"""One socket write for the frames that are ready together.

aiormq's connection writer takes one queued ``ChannelFrame`` (a publish, an ack, a
heartbeat) at a time and writes it: one ``send()`` per message. A publisher with 64
publishes in its confirm window, or a consumer acking a batch, queues them in one
turn of the event loop, so the writer can take every frame already waiting and write
them as one payload, in their order. Nothing waits for more frames to arrive: a lone
frame is written at once, as before.

The patch point is ``aiormq.connection.FrameGenerator``, the iterator the writer
reads its queue through; the pinned versions are those of ``amqp_frames`` and are
checked the same way (``tests/unit/test_amqp_writes.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

import aiormq.connection
from aiormq.abc import ChannelFrame

from workers.io import amqp_frames

MAX_PAYLOAD: Final = 256 * 1024  # bytes written at once, at most (a frame is never split)
# aiormq's write queue holds 10 frames, so an eleventh publish waits for the writer
# and a window of 64 leaves in seven writes at best; the publisher's confirm window
# and the consumers' batches bound what is queued, not this buffer.
FRAME_BUFFER: Final = 512
_ORIGINAL: Final = aiormq.connection.FrameGenerator


class _Joined:
    """Frames written as one payload; draining it drains each of them. It has what
    the writer reads of a ``ChannelFrame`` (which is a frozen dataclass)."""

    __slots__ = ("frames", "payload", "should_close")

    def __init__(self, frames: list[ChannelFrame]) -> None:
        self.frames = frames
        self.payload = b"".join(f.payload for f in frames)
        self.should_close = frames[-1].should_close

    @property
    def should_drain(self) -> bool:
        return any(f.should_drain for f in self.frames)

    def drain(self) -> None:
        for f in self.frames:
            f.drain()

    def __repr__(self) -> str:
        return f"<{len(self.frames)} frames joined, {len(self.payload)} bytes>"


class CoalescingFrameGenerator(_ORIGINAL):  # type: ignore[misc, valid-type]
    """The writer's iterator: the next frame, joined with those already queued."""

    async def __anext__(self) -> ChannelFrame | _Joined:
        first: ChannelFrame = await super().__anext__()
        queue: asyncio.Queue[Any] = self.queue
        if first.should_close or queue.empty():
            return first
        frames, size = [first], len(first.payload)
        while size < MAX_PAYLOAD and not queue.empty():
            frame: ChannelFrame = queue.get_nowait()
            queue.task_done()
            frames.append(frame)
            size += len(frame.payload)
            if frame.should_close:  # nothing is sent after a close
                break
        return _Joined(frames)


def install() -> None:
    """Put the coalescing iterator in place (idempotent), for the pinned versions only."""
    found = amqp_frames.installed_versions()
    if found != amqp_frames.PINNED:
        raise RuntimeError(
            f"workers.io.amqp_writes is pinned to {amqp_frames.PINNED}, found {found}: re-check"
            " the frame writer patch (tests/unit/test_amqp_writes.py) before upgrading"
        )
    aiormq.connection.FrameGenerator = CoalescingFrameGenerator  # type: ignore[misc]
    aiormq.connection.Connection.FRAME_BUFFER_SIZE = FRAME_BUFFER


def is_installed() -> bool:
    return (
        aiormq.connection.FrameGenerator is CoalescingFrameGenerator
        and aiormq.connection.Connection.FRAME_BUFFER_SIZE == FRAME_BUFFER
    )
