"""Acks after commit, batched: one ``multiple`` ack per batch, never one that reaches
a delivery outside the batch. Real RabbitMQ.

The ack is the consumer's side of every commit boundary ("The deliveries are acked
only after that commit"): a multiple-ack that covered a delivery received but not yet
committed would lose it on a crash. These tests take deliveries, ack some of them
through :func:`workers.io.broker.ack_all`, drop the connection, and read back what the
broker redelivers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aio_pika
from aiormq.abc import DeliveredMessage

from tests.conftest import Env
from tests.harness import client, drain, publish_raw
from workers.io import broker

QUEUE = broker.command_queue("inventory.v1")


async def _received_then_acked(env: Env, n: int, ack: Sequence[int]) -> list[broker.Delivery]:
    """Publish ``n`` messages, take all ``n`` on one channel, ``ack_all`` the ones at
    the positions ``ack`` (in one call), then close without settling the others."""
    bodies = [f'{{"n": {i}}}'.encode() for i in range(n)]
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", bodies)
    async with client(env.settings, "acks") as amqp, amqp.consume([QUEUE], prefetch=100) as inbox:
        got = [await asyncio.wait_for(inbox.get(), 10) for _ in range(n)]
        assert [d.body for d in got] == bodies
        await broker.ack_all([got[i] for i in ack])
        await asyncio.sleep(0.2)  # the acks reach the broker before the channel closes
    return await drain(env.settings, QUEUE, timeout=1.0)


async def test_a_whole_batch_is_acked_and_nothing_comes_back(env: Env) -> None:
    back = await _received_then_acked(env, 40, range(40))
    assert back == []


async def test_acking_a_later_batch_does_not_ack_an_earlier_unsettled_delivery(env: Env) -> None:
    """The first five are received but not committed when the next five are acked: a
    plain ``multiple`` ack of the tenth tag would settle them too; they must come back."""
    back = await _received_then_acked(env, 10, range(5, 10))
    assert sorted(d.body for d in back) == sorted(f'{{"n": {i}}}'.encode() for i in range(5))
    assert all(d.redelivered for d in back)


async def test_a_batch_with_a_gap_never_acks_the_delivery_in_the_gap(env: Env) -> None:
    back = await _received_then_acked(env, 6, [0, 1, 3, 4, 5])
    assert [d.body for d in back] == [b'{"n": 2}']


async def test_a_delivery_settled_before_the_batch_ack_is_not_settled_twice(env: Env) -> None:
    """A dead-lettered delivery is rejected inside its batch; the batch's ack skips it
    (a second settle of one tag closes the channel with PRECONDITION_FAILED)."""
    bodies = [f'{{"n": {i}}}'.encode() for i in range(4)]
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", bodies)
    async with client(env.settings, "acks") as amqp, amqp.consume([QUEUE], prefetch=100) as inbox:
        got = [await asyncio.wait_for(inbox.get(), 10) for _ in range(4)]
        await got[1].requeue()
        again = await asyncio.wait_for(inbox.get(), 10)
        assert again.body == bodies[1]
        await broker.ack_all([*got, again])
        await asyncio.sleep(0.2)
        assert amqp.connected
    assert await drain(env.settings, QUEUE, timeout=1.0) == []


async def test_a_delivery_is_read_from_the_frames_without_an_aio_pika_message(env: Env) -> None:
    """Issue 14 (a delivery's client CPU): the consumer takes aiormq's delivered frames
    as they are, with no aio-pika ``IncomingMessage`` built per delivery and no second
    task to run its callback, and still hands over every property the workers rely on;
    its settles (ack, requeue, reject) go to the frames' own channel."""
    body = b'{"n": 1}'
    await publish_raw(
        env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [body], message_id="m-frames"
    )
    async with client(env.settings, "acks") as amqp, amqp.consume([QUEUE], prefetch=10) as inbox:
        first = await asyncio.wait_for(inbox.get(), 10)
        assert isinstance(first._message, DeliveredMessage)
        assert not isinstance(first._message, aio_pika.abc.AbstractIncomingMessage)
        assert (first.body, first.message_id, first.redelivered) == (body, "m-frames", False)
        assert (first.exchange, first.routing_key) == (broker.EXCHANGE_COMMANDS, "inventory.v1")
        assert first.undecodable is None and first.headers == {}
        await first.requeue()
        again = await asyncio.wait_for(inbox.get(), 10)
        assert (again.message_id, again.redelivered) == ("m-frames", True)
        await again.ack()
        await asyncio.sleep(0.2)
        assert amqp.connected
    assert await drain(env.settings, QUEUE, timeout=1.0) == []
