"""The baseline: a deliberately naive, hand-rolled outbox pipeline of the same shape.

Three processes, each doing one thing at a time, the way a first hand-rolled version
is usually written:

* ``producer``: for each operation, one transaction that inserts an outbox row, then
  one publish awaiting its own confirm (``publisher_confirms``, ``on_return_raises``,
  ``mandatory``, persistent), then one transaction that marks the row published;
* ``worker`` (the participant): for each command, one transaction that inserts it into
  an inbox table (``ON CONFLICT DO NOTHING``), the ack after that commit, then the
  reply published awaiting its own confirm;
* ``replier`` (the engine's reply side): for each reply, one transaction that applies
  it (``ON CONFLICT DO NOTHING``), the ack after that commit.

It runs on the same Postgres and RabbitMQ as custody, on its own database and vhost,
with the same kind of queues (durable quorum queues, persistent messages). No
batching, no confirm window, no validation, no history, no leases: the floor that a
durable round trip costs on this machine, done one message at a time.

``bench.run`` creates the database, the vhost and the topology (:func:`setup`),
starts ``worker`` and ``replier``, then one ``producer`` that runs a warm-up, prints
``ready``, waits for a line on stdin, runs the measured operations, prints ``done``,
and exits at the next line (so that its CPU time, and its Postgres backend's, are
still there to be sampled at the end of the window). Every timestamp is the
database's (``clock_timestamp()``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import uuid
from typing import Final, LiteralString

import aio_pika
import orjson
import psycopg
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractIncomingMessage
from pamqp import commands as spec

EXCHANGE: Final = "bench.baseline"
COMMANDS: Final = "bench.baseline.commands"
REPLIES: Final = "bench.baseline.replies"
COMMAND_KEY: Final = "command"
REPLY_KEY: Final = "reply"
PREFETCH: Final = 64
CONFIRM_TIMEOUT_S: Final = 10.0

SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS outbox (
  id           uuid PRIMARY KEY,
  phase        text NOT NULL,
  body         jsonb NOT NULL,
  status       text NOT NULL DEFAULT 'pending',
  created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
  published_at timestamptz
);
CREATE TABLE IF NOT EXISTS inbox (
  id          uuid PRIMARY KEY,
  body        jsonb NOT NULL,
  received_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE IF NOT EXISTS replies (
  id         uuid PRIMARY KEY,
  body       jsonb NOT NULL,
  applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


def command_body(op_id: uuid.UUID, seq: int) -> bytes:
    """A command of roughly the size of a custody submit command."""
    return orjson.dumps(
        {
            "kind": "submit",
            "tenant": "acme",
            "operation_id": str(op_id),
            "request_id": str(op_id),
            "attempt": 1,
            "operation": "inventory.reserve",
            "target": {"owner": "inventory", "binding": "inventory.v1"},
            "input": {"order_id": f"order-{seq:06d}", "sku": "sku-1", "quantity": 1},
            "lineage": {"process": "order-fulfilment", "node": "reserve", "activation": 1},
            "digest": "0" * 64,
            "pad": "x" * 300,
        }
    )


async def setup(amqp_url: str, db_url: str) -> None:
    """Tables, exchange and two durable quorum queues (the vhost and database exist)."""
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        await conn.execute(SCHEMA)
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(EXCHANGE, "direct", durable=True)
        for queue_name, key in ((COMMANDS, COMMAND_KEY), (REPLIES, REPLY_KEY)):
            queue = await channel.declare_queue(
                queue_name, durable=True, arguments={"x-queue-type": "quorum"}
            )
            await queue.bind(exchange, key)


async def _confirm_channel(connection: aio_pika.abc.AbstractConnection) -> AbstractChannel:
    return await connection.channel(publisher_confirms=True, on_return_raises=True)


async def _publish(exchange: AbstractExchange, body: bytes, message_id: str, key: str) -> None:
    """One publish, awaiting its own confirm; anything but a positive confirm is fatal."""
    confirm = await exchange.publish(
        aio_pika.Message(
            body,
            message_id=message_id,
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        ),
        key,
        mandatory=True,
        timeout=CONFIRM_TIMEOUT_S,
    )
    if not isinstance(confirm, spec.Basic.Ack):
        raise RuntimeError(f"publish {message_id} not confirmed: {confirm!r}")


async def _connect_db(db_url: str, role: str) -> psycopg.AsyncConnection[tuple[object, ...]]:
    return await psycopg.AsyncConnection.connect(
        db_url, autocommit=False, application_name=f"bench-baseline-{role}"
    )


async def produce(amqp_url: str, db_url: str, *, warmup: int, ops: int) -> None:
    connection = await aio_pika.connect(
        amqp_url, client_properties={"connection_name": "bench-baseline-producer"}
    )
    conn = await _connect_db(db_url, "producer")
    try:
        channel = await _confirm_channel(connection)
        exchange = await channel.get_exchange(EXCHANGE, ensure=False)

        async def one(phase: str, seq: int) -> None:
            op_id = uuid.uuid4()
            body = command_body(op_id, seq)
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO outbox (id, phase, body) VALUES (%s, %s, %s::jsonb)",
                    (op_id, phase, body.decode()),
                )
            await _publish(exchange, body, str(op_id), COMMAND_KEY)
            async with conn.transaction():
                await conn.execute(
                    "UPDATE outbox SET status = 'published', published_at = clock_timestamp()"
                    " WHERE id = %s AND status = 'pending'",
                    (op_id,),
                )

        for i in range(warmup):
            await one("warmup", i)
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        for i in range(ops):
            await one("measure", i)
        print("done", flush=True)
        # stay (with the database session) until the measurement window has closed
        await asyncio.to_thread(sys.stdin.readline)
    finally:
        await conn.close()
        await connection.close()


async def _consume(
    amqp_url: str,
    db_url: str,
    *,
    role: str,
    queue_name: str,
    statement: LiteralString,
    reply: bool,
) -> None:
    """Handle one delivery at a time: one transaction, ack after commit, then (for the
    worker) the reply with an awaited confirm. Runs until cancelled (SIGTERM)."""
    connection = await aio_pika.connect(
        amqp_url, client_properties={"connection_name": f"bench-baseline-{role}"}
    )
    conn = await _connect_db(db_url, role)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        queue = await channel.get_queue(queue_name, ensure=False)
        reply_exchange: AbstractExchange | None = None
        if reply:
            confirm_channel = await _confirm_channel(connection)
            reply_exchange = await confirm_channel.get_exchange(EXCHANGE, ensure=False)
        async with queue.iterator() as messages:
            message: AbstractIncomingMessage
            async for message in messages:
                message_id = message.message_id or ""
                async with conn.transaction():
                    await conn.execute(statement, (message_id, message.body.decode()))
                await message.ack()
                if reply_exchange is not None:
                    body = orjson.dumps({"in_reply_to": message_id, "status": "succeeded"})
                    await _publish(reply_exchange, body, message_id, REPLY_KEY)
    finally:
        await conn.close()
        await connection.close()


async def work(amqp_url: str, db_url: str) -> None:
    await _consume(
        amqp_url,
        db_url,
        role="worker",
        queue_name=COMMANDS,
        statement="INSERT INTO inbox (id, body) VALUES (%s, %s::jsonb) ON CONFLICT (id) DO NOTHING",
        reply=True,
    )


async def apply_replies(amqp_url: str, db_url: str) -> None:
    await _consume(
        amqp_url,
        db_url,
        role="replier",
        queue_name=REPLIES,
        statement=(
            "INSERT INTO replies (id, body) VALUES (%s, %s::jsonb) ON CONFLICT (id) DO NOTHING"
        ),
        reply=False,
    )


async def _until_sigterm(role: str, amqp_url: str, db_url: str) -> None:
    if role == "worker":
        task = asyncio.ensure_future(work(amqp_url, db_url))
    else:
        task = asyncio.ensure_future(apply_replies(amqp_url, db_url))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.baseline")
    parser.add_argument("role", choices=["producer", "worker", "replier"])
    parser.add_argument("--amqp-url", required=True)
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--ops", type=int, default=0)
    args = parser.parse_args(argv)
    if args.role == "producer":
        asyncio.run(produce(args.amqp_url, args.db_url, warmup=args.warmup, ops=args.ops))
    else:
        asyncio.run(_until_sigterm(args.role, args.amqp_url, args.db_url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
