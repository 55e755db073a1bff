"""Hostile messages mixed into every queue, from the generators of the hostile-corpus
and hostile-frames tests: malformed and oversized bodies, wrong schemas, forged and
replayed receipts, commands with a wrong digest or owner, each alone and again in an
envelope, envelopes that break their framing, and frames whose AMQP properties the
client library cannot parse (sent by the raw client)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from typing import Any

import aio_pika
import psycopg

from chaos import faults
from tests import amqp_raw
from tests.integration import test_hostile_corpus as corpus
from workers.core import envelope
from workers.io import broker

BAD = b"\xff\xfe\xc3("
PER_FAULT = 12


async def _publish(url: str, exchange: str, key: str, bodies: list[bytes], user: str | None) -> int:
    """Each body alone, then all of them again in one envelope (each item refused or
    quarantined alone), then one envelope that breaks its framing (isolated whole)."""
    conn = await faults.connect(url)
    async with conn:
        ch = await conn.channel(publisher_confirms=True)
        ex = await ch.get_exchange(exchange, ensure=False)
        for body in bodies:
            await ex.publish(
                aio_pika.Message(body, message_id=str(uuid.uuid4()), user_id=user),
                key,
                mandatory=False,
            )
        packed = envelope.pack([envelope.Item(str(uuid.uuid4()), {}, b) for b in bodies])
        for body in (packed, packed[: len(packed) // 2]):
            await ex.publish(
                aio_pika.Message(
                    body,
                    message_id=str(uuid.uuid4()),
                    user_id=user,
                    content_type=envelope.CONTENT_TYPE,
                ),
                key,
                mandatory=False,
            )
    return len(bodies) + 2


async def _done_inventory_ops(engine_dsn: str) -> list[dict[str, Any]]:
    async with await psycopg.AsyncConnection.connect(engine_dsn, autocommit=True) as c:
        cur = await c.execute(
            "SELECT o.id::text, a.request_id::text, o.digest FROM custody.operations o"
            " JOIN custody.attempts a ON a.operation_id = o.id AND a.kind = 'submit'"
            " AND a.attempt = o.attempt WHERE o.status = 'succeeded' AND o.owner = 'inventory'"
            " ORDER BY random() LIMIT 10"
        )
        return [{"id": r[0], "request_id": r[1], "digest": r[2]} for r in await cur.fetchall()]


def frames(rng: random.Random) -> list[amqp_raw.Hostile]:
    """Messages whose properties are not valid UTF-8 or not decodable at all."""
    mid = uuid.uuid4().hex.encode()
    start = broker.start_request(
        tenant="acme",
        process="order-fulfilment",
        input={
            "order_id": "hostile",
            "sku": "sku-1",
            "quantity": 1,
            "amount_cents": 1,
            "address": "x",
        },
        requested_by="hostile",
    ).body
    table = amqp_raw.table([(b"ok", amqp_raw.F.longstr(b"v")), (BAD + b"-n", amqp_raw.F.i32(1))])
    return [
        amqp_raw.Hostile(
            broker.EXCHANGE_REQUESTS,
            broker.START_KEY.encode(),
            start,
            *amqp_raw.properties(message_id=BAD + mid, content_type=b"application/json"),
        ),
        amqp_raw.Hostile(
            broker.EXCHANGE_RECEIPTS,
            broker.RECEIPTS_KEY.encode(),
            b'{"type": "custody.receipt"}',
            *amqp_raw.properties(correlation_id=BAD, message_id=mid),
        ),
        amqp_raw.Hostile(
            broker.EXCHANGE_COMMANDS,
            rng.choice([b"inventory.v1", b"payments.v1", b"shipping.v1"]),
            b'{"type": "custody.submit"}',
            *amqp_raw.properties(message_type=BAD, message_id=mid),
        ),
        amqp_raw.Hostile(
            broker.EXCHANGE_RECEIPTS,
            broker.RECEIPTS_KEY.encode(),
            b"raw \x00 bytes \xff kept",
            *amqp_raw.properties(headers=table, message_id=mid),
        ),
        amqp_raw.Hostile(
            broker.EXCHANGE_COMMANDS,
            rng.choice([b"inventory.v1", b"payments.v1", b"shipping.v1"]),
            b"{}",
            *amqp_raw.properties(message_id=BAD),
        ),
    ]


async def send(
    target: str,
    seed: int,
    engine_dsn: str,
    admin_url: str,
    user_url: Callable[[str], str],
) -> int:
    rng = random.Random(seed)
    if target == "requests":
        bodies = corpus.hostile_starts(str(uuid.uuid4()))
        pick = rng.sample(bodies, min(PER_FAULT, len(bodies)))
        return await _publish(admin_url, broker.EXCHANGE_REQUESTS, broker.START_KEY, pick, None)
    if target == "commands":
        owner = rng.choice(["inventory", "payments", "shipping"])
        bodies = corpus.hostile_commands(owner)
        pick = rng.sample(bodies, min(PER_FAULT, len(bodies)))
        return await _publish(admin_url, broker.EXCHANGE_COMMANDS, f"{owner}.v1", pick, None)
    if target == "receipts":
        done = await _done_inventory_ops(engine_dsn)
        if not done:
            return 0
        groups = corpus.hostile_receipts(done)
        sent = 0
        for who, bodies in groups.items():
            pick = rng.sample(bodies, min(4, len(bodies)))
            if who == "guest":
                sent += await _publish(
                    admin_url, broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY, pick, None
                )
            else:
                user = "custody-inventory" if who in ("inventory", "stale") else f"custody-{who}"
                sent += await _publish(
                    user_url(user), broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY, pick, user
                )
        return sent
    if target == "frames":
        messages = frames(rng)
        await (await faults.connect(admin_url)).close()  # wait for the broker to be up
        async with amqp_raw.RawPublisher(admin_url) as raw:
            await raw.publish(messages, window=1, refusal_timeout=10)
        return len(messages)
    raise ValueError(f"unknown hostile target {target!r}")
