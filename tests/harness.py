"""In-process workers and clients for integration tests (real Postgres, real RabbitMQ)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from participants import samples
from workers.engine import committer, publisher, receipts, reconciler
from workers.harness import fleet
from workers.io import broker, db, flights
from workers.participant import service
from workers.runtime import probes, supervisor
from workers.settings import Settings

ENGINE = ("committer", "publisher", "receipts", "reconciler")
PARTICIPANTS = ("inventory", "payments", "shipping")
_MAINS = {
    "committer": committer.main,
    "publisher": publisher.main,
    "receipts": receipts.main,
    "reconciler": reconciler.main,
}


def order(i: int = 0, **overrides: Any) -> dict[str, Any]:
    base = {
        "order_id": f"order-{i:05d}",
        "sku": "sku-1",
        "quantity": 1,
        "amount_cents": 1_000 + i,
        "address": f"{i} Test Road",
    }
    return {**base, **overrides}


@dataclass
class Running:
    name: str
    stop: supervisor.Stop
    task: asyncio.Task[None]


@dataclass
class InProcessFleet:
    """Each worker's real ``main`` as an asyncio task with its own stop event."""

    env: Any  # tests.conftest.Env
    running: list[Running] = field(default_factory=list)

    def start(
        self,
        worker: str,
        settings: Settings | None = None,
        handlers: Mapping[str, service.Handler] | None = None,
    ) -> Running:
        """Start one worker in this event loop; a participant runs the sample handlers,
        or ``handlers``."""
        stop = supervisor.Stop(grace_s=10)
        health = probes.Health()
        if worker in PARTICIPANTS:
            s = settings or self.env.participant_settings(worker)
            s = dataclasses.replace(
                s,
                participant_database_url=db.with_user(
                    s.participant_database_url, f"custody_participant_{worker}"
                ),
            )
            me = service.Identity(
                owner=worker, principal=f"custody-{worker}", bindings=frozenset({f"{worker}.v1"})
            )
            coro = service.serve(
                me,
                handlers or samples.HANDLERS[worker],
                s,
                stop,
                health,
                schema=f"participant_{worker}",
                inline=samples.INLINE[worker] if s.participant_inline else (),
            )
        else:
            s = settings or self.env.settings
            s = dataclasses.replace(
                s,
                database_url=db.with_user(s.database_url, f"custody_{worker}"),
                amqp_url=broker.url_with_user(s.amqp_url, f"custody-{worker}", fleet.DEV_PASSWORD),
            )
            coro = _MAINS[worker](s, stop, health)
        run = Running(worker, stop, asyncio.create_task(coro, name=worker))
        self.running.append(run)
        return run

    def start_all(
        self, engine: Sequence[str] = ENGINE, participants: Sequence[str] = PARTICIPANTS
    ) -> None:
        for w in (*engine, *participants):
            self.start(w)

    async def stop(self, run: Running) -> None:
        run.stop.event.set()
        try:
            await asyncio.wait_for(run.task, 15)
        finally:
            self.running.remove(run)

    async def stop_all(self) -> None:
        for run in list(self.running):
            await self.stop(run)

    def check_alive(self) -> None:
        for run in self.running:
            if run.task.done():
                exc = run.task.exception() if not run.task.cancelled() else None
                raise AssertionError(f"worker {run.name} stopped: {exc!r}")


@contextlib.asynccontextmanager
async def running(env: Any) -> AsyncIterator[InProcessFleet]:
    """An in-process fleet whose workers are all stopped when the block ends."""
    fleet = InProcessFleet(env)
    try:
        yield fleet
    finally:
        await fleet.stop_all()


@contextlib.asynccontextmanager
async def held_instances(env: Any) -> AsyncIterator[None]:
    """Every instance's row locked by another transaction (as a cancel or the committer's
    claim holds one) while the block runs: the receipt consumer, which locks an
    instance only when no one holds it, leaves each successor intent pending for the
    committer. Instances created meanwhile are not held."""
    async with await psycopg.AsyncConnection.connect(env.settings.database_url) as holder:
        await holder.execute("SELECT 1 FROM custody.instances FOR UPDATE")
        yield
        await holder.rollback()


@contextlib.asynccontextmanager
async def client(settings: Settings, name: str = "test-client") -> Any:
    amqp = broker.Broker(settings.amqp_url, name)
    await amqp.connect()
    try:
        yield amqp
    finally:
        await amqp.close()


async def publish_starts(
    settings: Settings,
    orders: Sequence[Mapping[str, Any]],
    tenant: str = "acme",
    process: str = "order-fulfilment",
    start_request_ids: Sequence[str] | None = None,
    traceparent: str | None = None,
) -> list[str]:
    """Publish start requests (broker-confirmed), under the given start request ids or
    fresh ones, each with the caller's ``traceparent`` header if given; returns their
    start request ids."""
    ids, items = [], []
    chosen: Sequence[str | None] = start_request_ids or [None] * len(orders)
    for o, start_id in zip(orders, chosen, strict=True):
        item = broker.start_request(
            tenant=tenant, process=process, input=o, requested_by="test", start_request_id=start_id
        )
        if traceparent is not None:
            item = dataclasses.replace(item, headers={"traceparent": traceparent})
        ids.append(item.message_id)
        items.append(item)
    async with client(settings) as amqp:
        pub = await amqp.publisher(window=64, timeout_s=10, user_id=None)
        outcomes = await pub.publish_many(items)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    return ids


async def publish_raw(
    settings: Settings,
    exchange: str,
    routing_key: str,
    bodies: Sequence[bytes],
    *,
    user_id: str | None = None,
    message_id: str | None = None,
) -> None:
    async with client(settings) as amqp:
        pub = await amqp.publisher(window=64, timeout_s=10, user_id=user_id)
        outcomes = await pub.publish_many(
            [
                broker.Outgoing(message_id or str(uuid.uuid4()), exchange, routing_key, b)
                for b in bodies
            ]
        )
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]


async def drain(settings: Settings, queue: str, *, timeout: float = 2.0) -> list[broker.Delivery]:
    """Take every message currently in ``queue`` (acked), waiting ``timeout`` for quiet."""
    out: list[broker.Delivery] = []
    async with client(settings, "drain") as amqp, amqp.consume([queue], prefetch=500) as inbox:
        while True:
            try:
                d = await asyncio.wait_for(inbox.get(), timeout)
            except TimeoutError:
                return out
            out.append(d)
            await d.ack()


def seed_unknown_operation(
    conn: psycopg.Connection[Any], tenant: str, *, route: str = "inventory", age_h: float = 0
) -> tuple[str, str]:
    """A suspended instance of ``tenant`` with one outcome_unknown operation on ``route``
    (its digest the one its attempt binds) and its active node, created or last changed
    ``age_h`` hours ago, written as the superuser: (instance id, operation id)."""
    iid, oid = str(uuid.uuid4()), str(uuid.uuid4())
    conn.execute(
        "INSERT INTO custody.instances (id, tenant, start_request_id, process,"
        " process_version, input, status, requested_by, routes, created_at)"
        " VALUES (%s, %s, gen_random_uuid(), 'order-fulfilment', 1, '{}', 'suspended',"
        " 'test', '{}', now() - make_interval(hours => %s))",
        (iid, tenant, age_h),
    )
    conn.execute(
        "INSERT INTO custody.operations (id, tenant, instance_id, node, activation,"
        " operation, route, owner, principal, binding, input, lineage, attempt,"
        " digest, status, deadline_seconds, updated_at) VALUES (%s, %s, %s, 'reserve',"
        " 1, 'inventory.reserve', %s, 'inventory', 'custody-inventory',"
        " 'inventory.v1', '{}', jsonb_build_object('instance_id', %s::text,"
        " 'process', 'order-fulfilment', 'process_version', 1, 'node', 'reserve',"
        " 'activation', 1), 1, 'x', 'outcome_unknown', 60,"
        " now() - make_interval(hours => %s))",
        (oid, tenant, iid, route, iid, age_h),
    )
    conn.execute(
        "UPDATE custody.operations SET digest = custody.attempt_digest(id, 1) WHERE id = %s",
        (oid,),
    )
    conn.execute(
        "INSERT INTO custody.node_states (instance_id, node, activation, operation_id,"
        " status) VALUES (%s, 'reserve', 1, %s, 'active')",
        (iid, oid),
    )
    return iid, oid


class RoundTrips:
    """Counts the round trips to Postgres of every transaction from now on (``n``),
    those made in pipeline mode (``db.Database.transaction``, over ``flights.Pipe``):
    each time a unit sends what it wrote and reads the answers up to there (``db.Tx``
    waiting for a statement's answer, the flight with the COMMIT, the ROLLBACK of a unit
    that failed). Statements outside a pipeline are not counted. A test that pins how
    many a unit costs fails when a change adds one. ``where``: only those made while it
    says so (one worker's units among an in-process fleet's)."""

    def __init__(self, monkeypatch: Any, where: Callable[[], bool] = lambda: True) -> None:
        self.n = 0
        round_trip = flights.Pipe._round_trip

        async def counted(pipe: flights.Pipe) -> psycopg.Error | None:
            if where():
                self.n += 1
            return await round_trip(pipe)

        monkeypatch.setattr(flights.Pipe, "_round_trip", counted)


class Statements:
    """Counts the statements every connection sends from now on (``n``), in a pipeline
    or not (transaction commands included): what a unit costs its worker's client path,
    whether or not it waits. ``where``: only those sent while it says so (as for
    :class:`RoundTrips`)."""

    def __init__(self, monkeypatch: Any, where: Callable[[], bool] = lambda: True) -> None:
        self.n = 0
        execute = psycopg.AsyncConnection.execute
        send = flights.Pipe.send
        control = flights.Pipe.control

        def tick() -> None:
            if where():
                self.n += 1

        async def counted(conn: psycopg.AsyncConnection[Any], *a: Any, **k: Any) -> Any:
            tick()
            return await execute(conn, *a, **k)

        def counted_send(pipe: flights.Pipe, *a: Any) -> flights.Slot:
            tick()
            return send(pipe, *a)

        def counted_control(pipe: flights.Pipe, command: bytes) -> flights.Slot:
            tick()
            return control(pipe, command)

        monkeypatch.setattr(psycopg.AsyncConnection, "execute", counted)
        monkeypatch.setattr(flights.Pipe, "send", counted_send)
        monkeypatch.setattr(flights.Pipe, "control", counted_control)


@contextlib.asynccontextmanager
async def role_database(
    url: str, role: str, *, schema: str = "custody", name: str = "test"
) -> AsyncIterator[db.Database]:
    """A pool of one connection logged in as ``role`` (a worker's own least-privilege
    Postgres role), open for the block."""
    database = db.Database(db.with_user(url, role), schema=schema, name=name, max_size=1)
    await database.open()
    try:
        yield database
    finally:
        await database.close()
