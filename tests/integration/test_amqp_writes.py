"""Publishes that are ready together leave in a few socket writes, on the real
RabbitMQ, and nothing about them changes (workers/io/amqp_writes.py).

The seed: "The configured broker accepted the publication under its transport
policy": every publish still gets its own confirm, and the broker still receives
each message once, in order. Coalescing is only how the bytes reach the socket.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import Env
from tests.harness import client, drain
from workers.io import broker

QUEUE = broker.command_queue("inventory.v1")


async def test_a_window_of_publishes_is_written_in_a_few_socket_writes_and_each_is_confirmed(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 256
    items = [
        broker.Outgoing(f"m-{i:04d}", broker.EXCHANGE_COMMANDS, "inventory.v1", b'{"n": %d}' % i)
        for i in range(n)
    ]
    async with client(env.settings, "writes") as amqp:
        pub = await amqp.publisher(window=64, timeout_s=10, user_id=None)
        await pub.publish_many(items[:1])  # the channel is open before counting
        writes: list[int] = []
        real = asyncio.selector_events._SelectorSocketTransport.write  # type: ignore[attr-defined]

        def counted(self: Any, data: Any) -> None:
            writes.append(len(data))
            real(self, data)

        monkeypatch.setattr(asyncio.selector_events._SelectorSocketTransport, "write", counted)  # type: ignore[attr-defined]
        outcomes = await pub.publish_many(items[1:])
        monkeypatch.undo()
    assert [o.message_id for o in outcomes if o.ok] == [i.message_id for i in items[1:]]
    # 255 publishes through a window of 64: a handful of writes, not one per publish
    assert len(writes) <= (n - 1) // 8, f"{len(writes)} socket writes for {n - 1} publishes"
    got = await drain(env.settings, QUEUE, timeout=1.0)
    assert [d.message_id for d in got] == [i.message_id for i in items]
