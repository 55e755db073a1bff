"""What every engine worker shares: its connections, its lease and its config."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field

from workers import errors
from workers.core import horizon, process, records, routes, tracing
from workers.core.reasons import Reason
from workers.io import broker
from workers.io import db as dbm
from workers.runtime import consume, logs, metrics, outbox, probes, supervisor
from workers.settings import Settings


@dataclass
class Context:
    settings: Settings
    worker: str
    db: dbm.Database
    broker: broker.Broker
    lease: dbm.Lease
    routes: routes.Routes
    catalog: process.Catalog

    _renewing: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def _keep(self) -> bool:
        """Renew the lease, or take it back under a new epoch if it had expired (then
        whatever the old epoch had in flight cannot commit). Single-flight: the
        heartbeat and a fenced unit never both take a new epoch. True if renewed."""
        async with self._renewing:
            if await self.db.renew(self.lease):
                return True
            metrics.LEASE_LOSSES.labels(self.worker).inc()
            logs.event(
                "lease.lost",
                logging.WARNING,
                worker=self.worker,
                holder=self.lease.holder,
                epoch=self.lease.epoch,
            )
            await self.db.acquire(self.lease)
            return False

    async def reacquire(self) -> None:
        """After a fenced commit: the lease back under a new epoch (unless current)."""
        await self._keep()

    async def engine_outbox(
        self, before_sample: Callable[[dbm.Tx], Awaitable[object]] | None = None
    ) -> outbox.OutboxPublisher:
        """A publisher of the engine's outbox on this worker's database, lease and
        broker, held by the start-up switch (CUSTODY_DISPATCH_PAUSED): the publisher
        worker's, and the committer's and the receipt consumer's senders of the submits
        they commit."""
        s = self.settings
        return outbox.OutboxPublisher(
            owner="engine",
            database=self.db,
            lease=self.lease,
            publisher=await self.broker.publisher(
                window=s.confirm_window,
                timeout_s=s.confirm_timeout_s,
                user_id=None,
                envelope_max=s.envelope_max,
            ),
            batch_size=s.batch_size,
            claim_ttl_s=s.lease_ttl_s,
            engine=True,
            hold_submits=s.dispatch_paused,
            before_sample=before_sample,
            worker=self.worker,
        )

    def sending(
        self, sender: outbox.OutboxPublisher, stop: supervisor.Stop
    ) -> Coroutine[object, object, None]:
        """The loop of a worker's own sender (:meth:`engine_outbox`): it sends the
        submits the worker's commits hand it, never claims (the publisher worker claims
        what they leave behind). Its rows still handed over when it ends are the
        worker's to give back (``sender.release_handed()``), once nothing can hand more."""
        return outbox.loop(
            sender,
            stop,
            supervisor.Waker(self.settings.poll_interval_s),
            self.reacquire,
            self.worker,
            claims=False,
        )

    async def heartbeat(self) -> None:
        """Renew at a third of the TTL; a database outage is waited out (commits fail
        anyway; if it outlasts the lease, the next beat takes a new epoch)."""
        while True:
            await asyncio.sleep(self.lease.ttl_s / 3)
            try:
                await self._keep()
            except errors.DatabaseError as exc:
                if exc.kind in (errors.Retry.FATAL, errors.Retry.BROKEN):
                    raise
                logs.event(
                    "lease.renew_failed", logging.WARNING, worker=self.worker, error=str(exc)[:300]
                )


@contextlib.asynccontextmanager
async def running(settings: Settings, worker: str, health: probes.Health) -> AsyncIterator[Context]:
    table, catalog = process.load_config(settings)
    horizon.check(settings, catalog)
    database = dbm.Database(settings.database_url, schema="custody", name=worker)
    amqp = broker.Broker(settings.amqp_url, worker, broker.tls(settings))
    lease = dbm.Lease(worker, ttl_s=settings.lease_ttl_s)
    await database.open()
    try:
        await amqp.connect()
        await database.first_lease(lease)
        health.checks["broker"] = lambda: amqp.connected
        health.checks["database"] = lambda: database.healthy
        yield Context(settings, worker, database, amqp, lease, table, catalog)
    finally:
        with contextlib.suppress(Exception):
            await database.release(lease)
        await amqp.close()
        await database.close()


def quarantine(
    d: broker.Delivery,
    *,
    source: str,
    worker: str,
    reason: Reason,
    detail: str,
    tenant: str | None = None,
    operation_id: str | None = None,
    instance_id: str | None = None,
) -> records.Quarantine:
    """The one constructor of an engine quarantine row for a delivery: its raw body,
    its bounded headers, the broker-validated user id, and the closed reason."""
    return records.Quarantine(
        source=source,
        worker=worker,
        reason=reason,
        detail=detail,
        message_id=d.message_id,
        user_id=d.user_id,
        body=d.body,
        headers=broker.safe_headers(d.headers),
        tenant=tenant,
        operation_id=operation_id,
        instance_id=instance_id,
    )


def quarantined(rows: Sequence[records.Quarantine]) -> None:
    """After the commit that kept them: each quarantined message's metric and event."""
    for q in rows:
        consume.quarantined(
            q.source,
            q.reason,
            q.detail,
            message_id=q.message_id,
            trace_id=tracing.trace_id_of(q.headers),
            operation_id=q.operation_id,
            instance_id=q.instance_id,
            tenant=q.tenant,
        )
