"""Envelopes: several messages for one queue in one AMQP message, each still a delivery
of its own, acked only once every item of it is settled. Real RabbitMQ.

Issue 14's largest lever (docs/performance.md, *The envelope*). What must not change:
"Participant acceptance | The executor retained a recoverable operation and its
identity" and every other boundary is committed before its ack (an envelope acked
before its last item's commit would lose that item on a crash); a malformed message
is isolated with its reason, never acted on, never able to take good messages with it;
the dead-letter queue stays readable one message at a time.
"""

from __future__ import annotations

import asyncio

import aio_pika
import pytest

from contracts import codec
from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, client, drain, order, publish_starts
from workers.core import envelope
from workers.engine import deadletters
from workers.io import broker

QUEUE = broker.command_queue("inventory.v1")


def _items(n: int) -> list[broker.Outgoing]:
    return [
        broker.Outgoing(
            f"m-{i}",
            broker.EXCHANGE_COMMANDS,
            "inventory.v1",
            f'{{"n": {i}}}'.encode(),
            {"traceparent": f"00-{i:032x}-{i:016x}-01", "n": i},
        )
        for i in range(n)
    ]


async def _publish(env: Env, items: list[broker.Outgoing], envelope_max: int = 64) -> None:
    async with client(env.settings, "envelopes") as amqp:
        pub = await amqp.publisher(window=8, timeout_s=10, user_id=None, envelope_max=envelope_max)
        outcomes = await pub.publish_many(items)
    assert [o.message_id for o in outcomes] == [i.message_id for i in items]
    assert all(o.ok for o in outcomes), outcomes


async def _depth(env: Env, queue: str) -> int:
    """The messages ready in ``queue``, as the broker counts them (a passive declare)."""
    conn = await aio_pika.connect(env.settings.amqp_url)
    async with conn:
        channel = await conn.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


async def test_messages_for_one_queue_leave_in_one_envelope_and_arrive_each_as_itself(
    env: Env,
) -> None:
    """Ten messages of one ``publish_many`` call for one queue are one AMQP message on
    the broker, and ten deliveries to the consumer: each with its own body, message id
    and headers (a retry-varying tracing header stays the item's own), in order."""
    items = _items(10)
    await _publish(env, items)
    assert await _depth(env, QUEUE) == 1
    async with client(env.settings, "acks") as amqp, amqp.consume([QUEUE], prefetch=10) as inbox:
        got = [await asyncio.wait_for(inbox.get(), 10) for _ in range(10)]
        assert [(d.body, d.message_id, dict(d.headers)) for d in got] == [
            (i.body, i.message_id, dict(i.headers)) for i in items
        ]
        assert {(d.exchange, d.routing_key, d.undecodable) for d in got} == {
            (broker.EXCHANGE_COMMANDS, "inventory.v1", None)
        }
        await broker.ack_all(got)
        await asyncio.sleep(0.2)
        assert amqp.connected
    assert await drain(env.settings, QUEUE, timeout=1.0) == []


async def test_an_envelope_holds_one_tenant_s_messages(env: Env) -> None:
    """Messages about two tenants for one queue leave in two envelopes: a poison one, or
    an envelope a consumer keeps failing, never takes another tenant's work to the
    dead letters. A message whose headers an envelope may not carry (an ``x-`` name)
    leaves alone."""
    items = [
        broker.Outgoing(f"m-{i}", broker.EXCHANGE_COMMANDS, "inventory.v1", body, {})
        for i, body in enumerate(
            [b'{"tenant": "acme", "n": 0}', b'{"tenant": "globex", "n": 1}'] * 3
        )
    ]
    items.append(
        broker.Outgoing("m-x", broker.EXCHANGE_COMMANDS, "inventory.v1", b"{}", {"x-a": "b"})
    )
    await _publish(env, items)
    assert await _depth(env, QUEUE) == 3
    back = await drain(env.settings, QUEUE, timeout=1.0)
    assert sorted(d.message_id or "" for d in back) == sorted(i.message_id for i in items)
    by_envelope: dict[int, list[str]] = {}
    for d in back:
        by_envelope.setdefault(id(d._envelope), []).append(d.message_id or "")
    assert sorted(sorted(ids) for ids in by_envelope.values()) == [
        ["m-0", "m-2", "m-4"],  # acme's
        ["m-1", "m-3", "m-5"],  # globex's
        ["m-x"],  # alone
    ]


async def test_one_message_alone_and_envelope_max_1_send_plain_json_messages(env: Env) -> None:
    """A message with no sibling for its queue, and every message of a sender whose
    ``CUSTODY_ENVELOPE_MAX`` is 1, leave as plain JSON messages, as a consumer that
    does not read envelopes expects."""
    await _publish(env, _items(1))
    await _publish(env, _items(3), envelope_max=1)
    back = await drain(env.settings, QUEUE, timeout=1.0)
    assert [d.message_id for d in back] == ["m-0", "m-0", "m-1", "m-2"]
    assert all(d._envelope is None for d in back)
    assert all(d._message.header.properties.content_type == broker.JSON for d in back)


@pytest.mark.parametrize("acked", [range(9), range(1, 10), [0, 1, 2, 4, 5, 6, 7, 8, 9]])
async def test_an_envelope_is_not_acked_before_its_last_item_is(
    env: Env, acked: range | list[int]
) -> None:
    """Nine items of ten acked (in one ``ack_all``, the way a unit's commit acks its
    batch), the tenth not yet: the connection drops, and the whole envelope comes back,
    redelivered (the committed nine are absorbed by their consumers' inboxes). An
    envelope acked with its first items would lose the tenth: its commit never came."""
    items = _items(10)
    await _publish(env, items)
    async with client(env.settings, "acks") as amqp, amqp.consume([QUEUE], prefetch=10) as inbox:
        got = [await asyncio.wait_for(inbox.get(), 10) for _ in range(10)]
        await broker.ack_all([got[i] for i in acked])
        await asyncio.sleep(0.2)
    back = await drain(env.settings, QUEUE, timeout=1.0)
    assert [d.message_id for d in back] == [i.message_id for i in items]
    assert all(d.redelivered for d in back)


async def test_an_envelope_split_over_two_batches_is_acked_with_the_second(env: Env) -> None:
    items = _items(10)
    await _publish(env, items)
    async with client(env.settings, "acks") as amqp, amqp.consume([QUEUE], prefetch=10) as inbox:
        got = [await asyncio.wait_for(inbox.get(), 10) for _ in range(10)]
        await broker.ack_all(got[:6])
        await broker.ack_all(got[6:])
        await asyncio.sleep(0.2)
        assert amqp.connected
    assert await drain(env.settings, QUEUE, timeout=1.0) == []


async def test_an_item_given_back_gives_back_its_envelope(env: Env) -> None:
    """A stopping consumer requeues what it did not handle: the envelope comes back
    whole even though the others were acked first."""
    await _publish(env, _items(4))
    async with client(env.settings, "acks") as amqp, amqp.consume([QUEUE], prefetch=10) as inbox:
        got = [await asyncio.wait_for(inbox.get(), 10) for _ in range(4)]
        await got[2].requeue()
        await broker.ack_all([got[0], got[1], got[3]])
        again = [await asyncio.wait_for(inbox.get(), 10) for _ in range(4)]
        assert [d.message_id for d in again] == ["m-0", "m-1", "m-2", "m-3"]
        assert all(d.redelivered for d in again)
        await broker.ack_all(again)
        await asyncio.sleep(0.2)
        assert amqp.connected
    assert await drain(env.settings, QUEUE, timeout=1.0) == []


async def test_an_item_rejected_dead_letters_its_envelope_and_the_listing_shows_each_item(
    env: Env,
) -> None:
    """A participant cannot publish to the dead-letter exchange, so its poison command is
    rejected: the queue's policy dead-letters the envelope, with the siblings that were
    already applied (the price README *Envelopes* names). Nothing is lost, and
    ``custody dead-letters list`` still shows one letter per item."""
    await _publish(env, _items(3))
    async with client(env.settings, "acks") as amqp, amqp.consume([QUEUE], prefetch=10) as inbox:
        got = [await asyncio.wait_for(inbox.get(), 10) for _ in range(3)]
        await got[1].reject()
        await broker.ack_all([got[0], got[2]])
        await asyncio.sleep(0.2)
    async with client(env.settings, "dead") as amqp:

        async def arrived() -> bool:
            return len((await deadletters.read(amqp)).letters) == 3

        await wait_until(arrived, timeout=10, what="the envelope in the dead-letter queue")
        listing = await deadletters.read(amqp)
    assert listing.depth == 3
    assert [x.message_id for x in listing.letters] == ["m-0", "m-1", "m-2"]
    assert [x.body for x in listing.letters] == [i.body for i in _items(3)]
    # each letter names where it came from and why, so each can be replayed alone
    assert {(x.exchange, x.routing_key, x.reason) for x in listing.letters} == {
        (broker.EXCHANGE_COMMANDS, "inventory.v1", "rejected")
    }
    assert all(x.unreplayable() is None for x in listing.letters)
    assert await drain(env.settings, QUEUE, timeout=1.0) == []


async def _raw(env: Env, body: bytes) -> None:
    """Another AMQP client's message to inventory's queue, labelled an envelope."""
    conn = await aio_pika.connect(env.settings.amqp_url)
    async with conn:
        channel = await conn.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(broker.EXCHANGE_COMMANDS)
        await exchange.publish(
            aio_pika.Message(body, content_type=envelope.CONTENT_TYPE, message_id="hostile"),
            routing_key="inventory.v1",
        )


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\x00\x00\x00",
        b"\x00\x00\x00\x05\x00\x00\x00\x01{}",
        b"\x00\x00\x00\x02\x00\x00\x00\x00{}",
        b"\x00\x00\x00\x04\x00\x00\x00\x00null",
        b"\xff\xff\xff\xff\x00\x00\x00\x00",
    ],
    ids=["empty", "truncated", "overrun", "meta-keys", "meta-null", "huge-length"],
)
async def test_a_malformed_envelope_is_one_delivery_isolated_with_its_reason(
    env: Env, body: bytes
) -> None:
    """Bad input from another client: an envelope that cannot be split is one delivery
    whose payload raises ``malformed_envelope`` with the reason, its raw body kept, so
    every consumer quarantines or refuses it on its existing path; none of it is
    acted on and the connection stays up."""
    await _raw(env, body)
    async with client(env.settings, "acks") as amqp, amqp.consume([QUEUE], prefetch=10) as inbox:
        d = await asyncio.wait_for(inbox.get(), 10)
        assert (d.body, d.message_id) == (body, "hostile")
        assert d.undecodable is not None and d.undecodable.startswith("envelope: ")
        with pytest.raises(codec.DecodeError) as caught:
            d.payload()
        assert caught.value.reason == broker.MALFORMED_ENVELOPE
        await d.ack()
        await asyncio.sleep(0.2)
        assert amqp.connected
    assert await drain(env.settings, QUEUE, timeout=1.0) == []


async def test_a_hostile_envelope_s_bad_items_are_refused_and_its_good_ones_kept_apart(
    env: Env, fleet: InProcessFleet
) -> None:
    """A well-framed envelope from another client to a participant's queue, whose items
    are a non-JSON body and a JSON one of no known type: the participant refuses each
    with its own reason and message id (one refused row each), and keeps serving the
    engine's own work: the orders published after it complete."""
    fleet.start_all()
    body = envelope.pack(
        [
            envelope.Item("bad-1", {}, b"\xff not json"),
            envelope.Item("bad-2", {"x": "y"}, b'{"type": "nonsense"}'),
        ]
    )
    await _raw(env, body)
    await publish_starts(env.settings, [order(i) for i in range(3)])

    async def done() -> bool:
        finished = await env.scalar(
            "SELECT count(*) FROM custody.instances WHERE status = 'completed'"
        )
        return finished == 3

    await wait_until(done, timeout=60, what="the orders behind the hostile envelope")

    query = "SELECT message_id, reason FROM participant_inventory.refused ORDER BY message_id"

    async def refused() -> bool:
        return len(await env.sql(query, participant=True)) == 2

    await wait_until(refused, timeout=10, what="the two refusals")
    rows = await env.sql(query, participant=True)
    assert [(r[0], r[1]) for r in rows] == [("bad-1", "not_utf8"), ("bad-2", "unknown_type")]
    fleet.check_alive()
