"""What tracing costs a worker, per message handled: ``python -m bench.otel_overhead``.

One *step* is what a worker wraps around one delivery: its consume span, the
transaction span under it (with its ids set), an outbox row's traceparent
(``tracing.child``), the handler span, and the publish span of one outbox row settled
by its confirm. Off, every wrapper is the shared no-op; on, the SDK's tracer with the
``BatchSpanProcessor`` the workers use, into an exporter that drops the spans (the OTLP
export itself runs on the processor's thread, off the event loop). The unit of work it
wraps costs milliseconds (a transaction, a confirm); these are microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from typing import Any

from workers.core import tracing
from workers.io import broker
from workers.runtime import otel

PARENT = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"


def _delivery() -> broker.Delivery:
    return broker.Delivery(
        body=b"{}",
        message_id="m-1",
        user_id=None,
        headers={"traceparent": PARENT},
        redelivered=False,
        routing_key="inventory.v1",
        _message=None,  # type: ignore[arg-type]
        exchange="custody.commands",
    )


async def step(d: broker.Delivery, out: Sequence[broker.Outgoing]) -> None:
    with otel.consuming("committer", [d]):
        async with otel.transaction("starts", "committer") as span:
            if span.recording:
                span.set(operation_id=["op-1"], instance_id=["i-1"], message_id=["m-1"])
            row = tracing.child(otel.delivery_context(d) or tracing.from_headers(d.headers))
            with otel.handler("reserve", row, "participant-inventory"):
                pass
    sent, spans = otel.publishing(out, "engine")
    if spans is not None:
        spans.settled([broker.Outcome(m.message_id, True) for m in sent])


async def measure(n: int) -> float:
    d = _delivery()
    out = [
        broker.Outgoing("m-2", "custody.commands", "inventory.v1", b"{}", {"traceparent": PARENT})
    ]
    for _ in range(min(n, 1000)):
        await step(d, out)
    began = time.perf_counter()
    for _ in range(n):
        await step(d, out)
    return (time.perf_counter() - began) / n * 1e6


async def baseline(n: int) -> float:
    """The same loop with nothing wrapped: what the no-op path is compared with."""

    async def bare(d: broker.Delivery) -> None:
        tracing.child(tracing.from_headers(d.headers))

    d = _delivery()
    began = time.perf_counter()
    for _ in range(n):
        await bare(d)
    return (time.perf_counter() - began) / n * 1e6


def on() -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    otel.install(provider)
    return provider


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.otel_overhead", description=__doc__)
    p.add_argument("-n", type=int, default=50_000, help="steps per measurement (default 50000)")
    p.add_argument("--rounds", type=int, default=5, help="best of this many (default 5)")
    n, rounds = p.parse_args(argv).n, p.parse_args(argv).rounds
    otel.install(None)
    bare = min(asyncio.run(baseline(n)) for _ in range(rounds))
    off = min(asyncio.run(measure(n)) for _ in range(rounds))
    on()
    traced = min(asyncio.run(measure(n)) for _ in range(rounds))
    otel.shutdown()
    print(f"per step (best of {rounds} x {n}):")
    print(f"  nothing wrapped    {bare:7.2f} us")
    print(f"  tracing off        {off:7.2f} us  (+{off - bare:.2f} us for the no-op wrappers)")
    print(f"  tracing on         {traced:7.2f} us  (+{traced - bare:.2f} us, 4 spans)")


if __name__ == "__main__":
    main()
