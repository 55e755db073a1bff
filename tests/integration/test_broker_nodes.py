"""Issue 12 (the chaos harness): a RabbitMQ cluster without a load balancer.

``CUSTODY_AMQP_URL`` names several nodes (``amqp://u:p@h1:5672,h2:5672/vhost``); a
broker connection that loses its node reconnects to another one by itself, and keeps
today's guarantees across the move: its consumers are declared and subscribed again,
publishing counts only a confirm (a publish nobody confirmed is a failed outcome, which
the outbox sends again), and a delivery taken before the move is never acked on the
new channel (the broker redelivers it, and it is acked once).

Two TCP proxies (``tests/proxy.py``) in front of the one real RabbitMQ play two nodes;
closing a proxy is a node going away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import Env, wait_until
from tests.proxy import Proxy, amqp_port
from workers import errors
from workers.core import amqp_url
from workers.io import broker, startup

Events = list[tuple[str, dict[str, Any]]]


def nodes_url(url: str, *proxies: Proxy) -> str:
    """The same URL (user, vhost, options), naming one node per proxy."""
    return str(amqp_url.parse(url).with_addresses([f"127.0.0.1:{p.port}" for p in proxies]))


@pytest.fixture
async def proxies(env: Env) -> AsyncIterator[tuple[Proxy, Proxy]]:
    port = amqp_port(env.settings.amqp_url)
    async with Proxy(port) as a, Proxy(port) as b:
        yield a, b


def patience(seen: Events) -> startup.Patience:
    def report(name: str, level: int = logging.INFO, **fields: Any) -> None:
        seen.append((name, fields))

    return startup.Patience(wait=True, report=report)


def receipt(message_id: str) -> broker.Outgoing:
    return broker.Outgoing(message_id, broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY, b"{}")


@pytest.mark.timeout(90)
async def test_a_connection_moves_to_the_second_node_when_the_first_goes_away(
    env: Env, proxies: tuple[Proxy, Proxy]
) -> None:
    """Issue 12: reconnect to another node of the host list when the node goes away,
    without a load balancer, keeping consumers, publisher confirms and single acks."""
    seen: Events = []
    url = nodes_url(env.settings.amqp_url, *proxies)
    amqp = broker.Broker(url, "test-nodes")
    with startup.patient(patience(seen)):
        await amqp.connect()
    try:
        first, second = proxies if proxies[0].accepted else proxies[::-1]
        assert (first.accepted, second.accepted) == (1, 0)
        pub = await amqp.publisher(window=8, timeout_s=5, user_id=None)
        async with amqp.consume([broker.QUEUE_RECEIPTS], prefetch=10) as inbox:
            [sent] = await pub.publish_many([receipt("m-1")])
            assert sent.ok, sent
            taken = await asyncio.wait_for(inbox.get(), 10)
            assert (taken.message_id, taken.redelivered) == ("m-1", False)

            first.cut()  # the node goes away, and refuses every reconnect from now on

            async def moved() -> bool:
                return amqp.connected and second.accepted >= 1

            await wait_until(moved, timeout=30, what="a connection through the second node")
            await taken.ack()  # its channel is gone: never acked on the new one
            again = await asyncio.wait_for(inbox.get(), 15)
            assert (again.message_id, again.redelivered) == ("m-1", True)
            await again.ack()

            [sent] = await pub.publish_many([receipt("m-2")])
            assert sent.ok, f"a confirm through the second node: {sent}"
            fresh = await asyncio.wait_for(inbox.get(), 10)
            assert (fresh.message_id, fresh.redelivered) == ("m-2", False)
            await fresh.ack()

            refused = first.refused
            second.cut()  # no node at all: a publish is not confirmed, and says so

            async def down() -> bool:
                return not amqp.connected and first.refused > refused

            await wait_until(down, timeout=15, what="a reconnect refused by the first node")
            [lost] = await pub.publish_many([receipt("m-3")])
            assert not lost.ok and lost.error, lost

            first.heal()

            async def up() -> bool:
                return amqp.connected

            await wait_until(up, timeout=30, what="a connection through the first node again")
            [sent] = await pub.publish_many([receipt("m-3")])
            assert sent.ok, sent
            late = await asyncio.wait_for(inbox.get(), 15)
            while late.message_id == "m-2":  # its ack may have been lost with the node
                assert late.redelivered, "a second delivery is flagged redelivered"
                await late.ack()
                late = await asyncio.wait_for(inbox.get(), 15)
            assert late.message_id == "m-3"
            await late.ack()
            extra = []  # every message was acked once: none is delivered again
            with contextlib.suppress(TimeoutError):
                extra.append(await asyncio.wait_for(inbox.get(), 2))
            assert not extra, [d.message_id for d in extra]
    finally:
        await amqp.close()

    names = [name for name, _ in seen]
    assert names[0] == "broker.connected", seen
    moves = [f for name, f in seen if name == "broker.connected" and f["phase"] == "reconnect"]
    assert moves and moves[0]["node"] == f"127.0.0.1:{second.port}", seen
    retries = [f for name, f in seen if name == "broker.connect_retry"]
    assert retries and all(f["phase"] == "reconnect" for f in retries), seen
    assert all("guest" not in str(f) for _, f in seen), "no credentials in the events"


async def test_a_command_tries_every_node_once_then_fails(
    env: Env, proxies: tuple[Proxy, Proxy]
) -> None:
    """Outside a worker (the CLI), a connection tries each node of the list once: the
    first node refusing is not the end, but no node at all fails fast, naming each."""
    a, b = proxies
    a.cut()
    amqp = broker.Broker(nodes_url(env.settings.amqp_url, a, b), "test-cli")
    await amqp.connect()  # whichever node its order put first
    assert amqp.node == f"127.0.0.1:{b.port}"
    await amqp.close()
    assert a.refused <= 1 and b.accepted == 1
    refused = a.refused

    b.cut()
    amqp = broker.Broker(nodes_url(env.settings.amqp_url, a, b), "test-cli")
    with pytest.raises(errors.BrokerError, match="cannot connect to RabbitMQ") as raised:
        await asyncio.wait_for(amqp.connect(), 15)
    assert raised.value.kind is errors.Retry.RETRY
    assert f"127.0.0.1:{a.port}" in str(raised.value) and f"127.0.0.1:{b.port}" in str(raised.value)
    assert (a.refused - refused, b.refused) == (1, 1)
