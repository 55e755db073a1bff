"""The one consume loop: batches in, one commit per batch, acks after commit.

AckPolicy: a delivery is acked only after the transaction that recorded it (applied,
quarantined or deduplicated) committed. A batch that fails for a reason that is not
transient is split: each delivery is redone alone, and the one that still fails is
a poison message — it goes to the dead-letter exchange with its reason in the
``x-custody-reason`` header (or, if even that publish fails, is rejected so the
queue's policy dead-letters it), so it never blocks the queue behind it.

Log correlation: a unit of one delivery runs with its ``message_id`` and ``trace_id``
bound (every line inside carries them); a unit of a batch carries ``batch_size``, and
its handler binds each message's ids where it handles that message alone. At debug
level each delivery of a committed unit gets one ``unit.done`` line (its ids, what its
handler learnt of it in ``Delivery.ids``, its outcome and the unit's duration).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from workers import errors
from workers.core import tracing
from workers.io import broker
from workers.runtime import batching, faults, logs, metrics, otel, supervisor
from workers.settings import Settings

Handle = Callable[[Sequence[broker.Delivery]], Awaitable[Any]]


async def run(
    amqp: broker.Broker,
    queues: Sequence[str],
    *,
    settings: Settings,
    stop: supervisor.Stop,
    worker: str,
    handle: Handle,
    on_fenced: Callable[[], Awaitable[Any]],
    after_commit: Callable[[], None] = lambda: None,
    publish_dead_letters: bool = True,
) -> None:
    """``publish_dead_letters``: a poison delivery is published to the dead-letter
    exchange with its reason in headers (engine workers); if False (participants, who
    have no write permission there) it is rejected, the queue's policy dead-letters it
    (``x-death`` reason ``rejected``) and the reason is in the log and the metrics."""
    dead = (
        await amqp.publisher(window=8, timeout_s=settings.confirm_timeout_s, user_id=None)
        if publish_dead_letters
        else None
    )
    attempt = 0
    while not stop.requested:
        try:
            async with amqp.consume(queues, settings.prefetch) as inbox:
                attempt = 0
                while not stop.requested:
                    batch = await batching.next_batch(
                        inbox, stop, size=settings.batch_size, linger_s=settings.linger_ms / 1000
                    )
                    if not batch:
                        continue
                    metrics.REDELIVERIES.labels(worker).inc(sum(d.redelivered for d in batch))
                    metrics.UNDECODABLE.labels(worker).inc(
                        sum(d.undecodable is not None for d in batch)
                    )
                    if faults.broken("ack_before_commit"):  # chaos self-test only
                        for d in batch:
                            await d.ack()
                    with otel.consuming(worker, batch):  # a span per delivery, if on
                        await process(
                            batch,
                            worker=worker,
                            stop=stop,
                            handle=handle,
                            on_fenced=on_fenced,
                            dead=dead,
                        )
                        # one turn of the loop first: what its commit set going (a
                        # sender's wake-up) runs ahead of its acks; a publish handed to
                        # an idle sender is on the wire already (OutboxPublisher.hand_over)
                        await asyncio.sleep(0)
                        await broker.ack_all(batch)  # a dead-lettered one is settled already
                    after_commit()
            return
        except errors.BrokerError as exc:
            # the broker went away while the consumer was being set up: try again (a
            # robust connection restores consumers that were already running)
            if exc.kind is errors.Retry.FATAL or stop.requested:
                raise
            logs.event(
                "consumer.retry",
                logging.WARNING,
                worker=worker,
                attempt=attempt + 1,
                error=str(exc)[:300],
            )
            if await stop.sleep(errors.backoff_seconds(attempt)):
                return
            attempt += 1


async def process(
    batch: Sequence[broker.Delivery],
    *,
    worker: str,
    stop: supervisor.Stop,
    handle: Handle,
    on_fenced: Callable[[], Awaitable[Any]],
    dead: broker.Publisher | None,
) -> None:
    """Handle a batch; isolate and dead-letter what cannot be handled at all."""

    async def unit(items: Sequence[broker.Delivery]) -> Any:
        faults.poison_check(worker, [d.body for d in items])
        started = time.monotonic()
        if len(items) == 1:
            with logs.bound(message_id=items[0].message_id, trace_id=_trace_id(items[0])):
                result = await handle(items)
        else:
            with logs.bound(batch_size=len(items)):
                result = await handle(items)
        if logs.enabled(logging.DEBUG):
            _done(items, result, started)
        return result

    def nobody_to_blame(exc: Exception) -> bool:
        # stopping, or a broken deployment (grants, schema): no message is poison, so
        # none is dead-lettered; the deliveries go back to the queue
        broken = isinstance(exc, errors.DatabaseError) and exc.kind is errors.Retry.BROKEN
        return stop.requested or broken

    try:
        await supervisor.redo(lambda: unit(batch), worker=worker, stop=stop, on_fenced=on_fenced)
        return
    except Exception as exc:
        if nobody_to_blame(exc):
            raise
        if len(batch) == 1:
            await dead_letter(batch[0], worker=worker, error=exc, dead=dead)
            return
        logs.event(
            "consumer.batch_failed",
            logging.WARNING,
            worker=worker,
            size=len(batch),
            error=repr(exc)[:300],
        )
    for d in batch:
        try:
            await supervisor.redo(
                functools.partial(unit, [d]), worker=worker, stop=stop, on_fenced=on_fenced
            )
        except Exception as exc:
            if nobody_to_blame(exc):
                raise
            await dead_letter(d, worker=worker, error=exc, dead=dead)


async def dead_letter(
    d: broker.Delivery, *, worker: str, error: BaseException, dead: broker.Publisher | None
) -> None:
    reason = f"{type(error).__name__}: {error}"[:500]
    metrics.DEAD_LETTERED.labels(worker).inc()
    ids = {k: v for k, v in d.ids.items() if k != "outcome"}
    fields = {"message_id": d.message_id, "trace_id": _trace_id(d), **ids}
    logs.event(
        "consumer.dead_lettered",
        logging.ERROR,
        **fields,
        worker=worker,
        routing_key=d.routing_key,
        reason=reason,
    )
    if dead is None:
        await d.reject()
        return
    # strings only: whatever a hostile publisher put in its headers, the dead letter
    # must be encodable (pamqp cannot encode every value it decodes)
    headers: dict[str, Any] = {
        k: v for k, v in broker.safe_headers(d.headers).items() if not k.startswith("x-custody-")
    }
    headers.update(
        {
            "x-custody-reason": reason,
            "x-custody-worker": worker,
            "x-custody-routing-key": d.routing_key,
            "x-custody-exchange": d.exchange,  # where `custody dead-letters replay` sends it
        }
    )
    [outcome] = await dead.publish_many(
        [
            broker.Outgoing(
                d.message_id or "", broker.EXCHANGE_DEAD, f"poison.{worker}", d.body, headers
            )
        ]
    )
    if not outcome.ok:
        await d.reject()


def _trace_id(d: broker.Delivery) -> str | None:
    return tracing.trace_id_of(d.headers)


def _done(items: Sequence[broker.Delivery], result: Any, started: float) -> None:
    """The debug ``unit.done`` line of each delivery of a committed unit."""
    ms = round((time.monotonic() - started) * 1000, 3)
    outcomes = result if isinstance(result, list) and len(result) == len(items) else None
    for i, d in enumerate(items):
        fields: dict[str, Any] = {
            "message_id": d.message_id,
            "trace_id": _trace_id(d),
            "outcome": str(outcomes[i]) if outcomes is not None else "committed",
            **d.ids,
            "batch_size": len(items),
            "duration_ms": ms,
        }
        logs.event("unit.done", logging.DEBUG, **fields)


def quarantined(source: str, reason: str, detail: str, **ids: Any) -> None:
    """A message kept in quarantine, once its transaction committed: its metric and its
    custody event (``quarantine.recorded``, with its reason and the ids known of it)."""
    metrics.quarantined(source, reason)
    logs.event(
        "quarantine.recorded",
        logging.WARNING,
        **{k: v for k, v in ids.items() if v is not None},
        source=source,
        reason=str(reason),
        detail=detail[:300],
    )
