"""The broker's own hop at light load: the floor under a light-load operation.

A light-load operation crosses the broker twice (its submit to the participant, the
participant's receipt back), each time as one persistent message on a quorum queue,
published with a confirm and consumed with a manual ack. This measures that hop alone,
with the client library custody uses (aio-pika) on both ends and nothing else: one
message at a time (the next once the last was delivered and acked), the time from the
publish to its delivery and to its confirm, p50 and p90. A classic durable queue is
measured beside it, for what the quorum queue's replicated log costs on this machine
(custody needs the quorum queue: docs/performance.md, *Light load*).

``python -m bench.hop [--messages N]``, against the broker of ``CUSTODY_AMQP_URL`` (a
vhost of its own, created and deleted).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

import aio_pika

from bench.peers import percentile
from bench.resources import fresh_vhost
from workers.harness import env
from workers.io import broker
from workers.settings import Settings

VHOST = "custody_bench_hop"
BODY = b"x" * 600  # about a submit command's size
GAP_S = 0.005  # between messages: one at a time, the broker idle in between


@dataclass(frozen=True)
class BrokerHop:
    queue: str
    delivered_p50_ms: float
    delivered_p90_ms: float
    confirmed_p50_ms: float
    messages: int

    def line(self) -> str:
        return (
            f"{self.queue:>8} queue: publish → delivery p50 {self.delivered_p50_ms:.2f} ms"
            f" (p90 {self.delivered_p90_ms:.2f}), publish → confirm p50"
            f" {self.confirmed_p50_ms:.2f} ms, {self.messages} messages"
        )


async def one_queue(url: str, kind: str, messages: int) -> BrokerHop:
    """``messages`` persistent messages through a queue of ``kind``, one at a time."""
    publisher = await aio_pika.connect(url)
    consumer = await aio_pika.connect(url)
    try:
        pch = await publisher.channel(publisher_confirms=True)
        cch = await consumer.channel()
        await cch.set_qos(prefetch_count=10)
        name = f"hop-{kind}"
        await pch.declare_queue(name, durable=True, arguments={"x-queue-type": kind})
        queue = await cch.get_queue(name)
        arrived: asyncio.Queue[float] = asyncio.Queue()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            arrived.put_nowait(time.perf_counter())
            await message.ack()

        await queue.consume(on_message)
        delivered: list[float] = []
        confirmed: list[float] = []
        for _ in range(messages):
            sent = time.perf_counter()
            await pch.default_exchange.publish(
                aio_pika.Message(BODY, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=name,
            )
            confirmed.append((time.perf_counter() - sent) * 1000)
            delivered.append((await asyncio.wait_for(arrived.get(), 10) - sent) * 1000)
            await asyncio.sleep(GAP_S)
        return BrokerHop(
            kind,
            percentile(delivered, 0.5),
            percentile(delivered, 0.9),
            percentile(confirmed, 0.5),
            messages,
        )
    finally:
        await consumer.close()
        await publisher.close()


async def run(messages: int, warmup: int = 20) -> list[BrokerHop]:
    settings = Settings.from_env()
    await fresh_vhost(settings, VHOST)
    try:
        url = env.with_vhost(settings.amqp_url, VHOST)
        # the warm-up: connections, channels and the queues' first messages
        for kind in ("quorum", "classic"):
            await one_queue(url, kind, warmup)
        return [await one_queue(url, kind, messages) for kind in ("quorum", "classic")]
    finally:
        await broker.delete_vhost(settings.amqp_management_url, VHOST)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.hop", description=__doc__.split("\n")[0])
    p.add_argument("--messages", type=int, default=500, help="messages per queue (default 500)")
    a = p.parse_args(argv)
    for hop in asyncio.run(run(a.messages)):
        print(hop.line(), flush=True)


if __name__ == "__main__":
    main()
