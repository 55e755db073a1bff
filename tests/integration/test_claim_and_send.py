"""The engine's publisher publishes a claimed batch while the claim commits
(workers/runtime/outbox.py, ``OutboxPublisher._claim_and_send``). Real Postgres, real
RabbitMQ.

Issue 14 (light load: "a few fsync'd commits and two broker hops"): the claim's rows
are read with the answer of a fence sent before the claim, and their publishes leave
while the COMMIT waits for its flush, so the claim's commit is no longer on the path
of every command to its participant. What must not move: the broker confirmation
boundary ("the outbox row's confirmed mark, only after RabbitMQ confirmed the
publish"), marked only under this publisher's committed claim; a publisher whose lease
was taken back publishes nothing; and a claim that does not commit loses nothing: its
rows stay pending and are sent again under the same message ids (every consumer
deduplicates by them).

The commit is made slow, or made to fail, by a deferred constraint trigger on the test
row alone: it runs inside the claim's COMMIT, after the claim's rows were answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import Env
from tests.harness import RoundTrips, client, drain, role_database
from workers import errors
from workers.io import broker, db
from workers.runtime.outbox import OutboxPublisher

QUEUE = broker.command_queue("inventory.v1")
SLOW_COMMIT_S = 1.5


@pytest.fixture
async def engine(env: Env) -> AsyncIterator[db.Database]:
    async with role_database(env.settings.database_url, "custody_publisher") as d:
        yield d


async def _row(env: Env) -> str:
    """A query command waiting in the engine's outbox (a query's claim needs no
    operation), routed to the inventory command queue."""
    row_id = str(uuid.uuid4())
    await env.sql(
        "INSERT INTO custody.outbox (id, kind, exchange, routing_key, body)"
        " VALUES (%s, 'query', %s, 'inventory.v1', '{}')",
        (row_id, broker.EXCHANGE_COMMANDS),
    )
    return row_id


@contextlib.asynccontextmanager
async def _at_commit(env: Env, row_id: str, body: str) -> AsyncIterator[None]:
    """Run ``body`` (plpgsql) inside the COMMIT of any transaction that updates the row."""
    name = f"t{uuid.uuid4().hex[:12]}"
    await env.sql(
        f"CREATE FUNCTION custody.{name}() RETURNS trigger LANGUAGE plpgsql AS $$"
        f" BEGIN {body}; RETURN NULL; END $$"
    )
    await env.sql(
        f"CREATE CONSTRAINT TRIGGER {name} AFTER UPDATE ON custody.outbox"
        " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW"
        f" WHEN (NEW.id = '{row_id}'::uuid) EXECUTE FUNCTION custody.{name}()"
    )
    try:
        yield
    finally:
        await env.sql(f"DROP TRIGGER {name} ON custody.outbox")
        await env.sql(f"DROP FUNCTION custody.{name}()")


async def _publisher(engine: db.Database, amqp: broker.Broker) -> OutboxPublisher:
    lease = db.Lease("publisher", ttl_s=60)
    await engine.acquire(lease)
    return OutboxPublisher(
        owner="engine",
        database=engine,
        lease=lease,
        publisher=await amqp.publisher(window=8, timeout_s=10, user_id=None),
        batch_size=10,
        claim_ttl_s=60,
        engine=True,
    )


async def _state(env: Env, row_id: str) -> tuple[Any, ...]:
    [row] = await env.sql(
        "SELECT status, claimed_by, publish_attempts FROM custody.outbox WHERE id = %s",
        (row_id,),
    )
    return row


async def test_a_claimed_batch_is_published_while_its_claim_commits(
    env: Env, engine: db.Database
) -> None:
    """The command reaches its queue while the claim's COMMIT is still flushing (here:
    held for 1.5 s); the row is marked published only after both the confirm and that
    commit, under the publisher's claim."""
    row_id = await _row(env)
    async with (
        client(env.settings, "claim-and-send") as amqp,
        amqp.consume([QUEUE], prefetch=10) as inbox,
    ):
        pub = await _publisher(engine, amqp)
        async with _at_commit(env, row_id, f"PERFORM pg_sleep({SLOW_COMMIT_S})"):
            began = time.monotonic()
            cycle = asyncio.ensure_future(pub.run_once())
            delivered = await asyncio.wait_for(inbox.get(), 10)
            arrived = time.monotonic() - began
            assert delivered.message_id == row_id
            assert not cycle.done(), "the mark waits for the claim's commit"
            assert await cycle == 1
            took = time.monotonic() - began
        await delivered.ack()
    assert arrived < SLOW_COMMIT_S / 2, f"published {arrived:.2f} s in, after the commit"
    assert took >= SLOW_COMMIT_S
    assert await _state(env, row_id) == ("published", None, 1)


async def test_a_claim_that_does_not_commit_leaves_its_row_to_be_sent_again(
    env: Env, engine: db.Database
) -> None:
    """Nothing is lost when the claim's commit fails after its publishes left: the
    cycle raises (its unit is redone), the row stays pending and unclaimed, and the
    next cycle sends it again under the same message id and marks it."""
    row_id = await _row(env)
    async with client(env.settings, "claim-and-send") as amqp:
        pub = await _publisher(engine, amqp)
        async with _at_commit(env, row_id, "RAISE EXCEPTION 'the commit failed'"):
            with pytest.raises(errors.DatabaseError, match="the commit failed"):
                await pub.run_once()
        assert await _state(env, row_id) == ("pending", None, 0)
        assert await pub.run_once() == 1
    assert await _state(env, row_id) == ("published", None, 1)
    sent = await drain(env.settings, QUEUE, timeout=1.0)
    assert [d.message_id for d in sent] == [row_id, row_id]  # one id, deduplicated by it


async def test_a_publisher_whose_lease_was_taken_back_publishes_nothing(
    env: Env, engine: db.Database
) -> None:
    """The broker confirmation boundary under fencing: the lease is checked before the
    claim runs, so a publisher paused past its lease reads no row and sends nothing;
    the row waits, unclaimed, for the live one."""
    row_id = await _row(env)
    async with client(env.settings, "claim-and-send") as amqp:
        paused = await _publisher(engine, amqp)
        assert paused.lease is not None
        await engine.acquire(db.Lease("publisher", paused.lease.holder, 0, 60))
        with pytest.raises(errors.Fenced):
            await paused.run_once()
        assert await _state(env, row_id) == ("pending", None, 0)
    assert await drain(env.settings, QUEUE, timeout=1.0) == []


async def test_a_confirm_mark_commits_in_one_round_trip(
    env: Env, engine: db.Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker confirmation boundary, marked in one flight: the confirmed rows, the
    dispatch of the confirmed submits with their history (``outbox_mark_dispatched``),
    the releases of the failed rows, the fence and the COMMIT leave together and are
    answered in one round trip (they were three: the mark's rows, the dispatch's rows,
    then the rest). A failed publish is released for a retry, not marked."""
    sent, lost = await _row(env), await _row(env)
    async with client(env.settings, "claim-and-send") as amqp:
        pub = await _publisher(engine, amqp)
        rows = await pub.claim()
        assert {str(r["id"]) for r in rows} == {sent, lost}
        trips = RoundTrips(monkeypatch)
        await pub.mark(
            rows, [broker.Outcome(sent, True), broker.Outcome(lost, False, "nacked: test")]
        )
        assert trips.n == 1
    assert await _state(env, sent) == ("published", None, 1)
    assert await _state(env, lost) == ("pending", None, 1)
    assert await drain(env.settings, QUEUE, timeout=0.5) == []
