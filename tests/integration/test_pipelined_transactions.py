"""A unit's transaction in pipeline mode (workers/io/db.py ``Tx``, ``Database.transaction``),
on the real Postgres.

The seed: "Node state, history, operation/attempt and dispatch intent commit together",
and a fenced worker's work never commits. The writes at the end of a unit are sent
without waiting for their answers and leave with the fence and the COMMIT, in one round
trip; these tests pin that this changes nothing a unit can rely on: a write that fails,
however late its error is read, keeps nothing of its transaction; a statement that
waits raises the error of a write sent before it; a fenced unit keeps nothing; and the
end of a unit costs one round trip, whatever it writes.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import Env
from workers import errors
from workers.io import db


@pytest.fixture
async def database(env: Env) -> AsyncIterator[db.Database]:
    d = db.Database(env.settings.database_url, schema="custody", name="pipeline-test", max_size=1)
    await d.open()
    try:
        yield d
    finally:
        await d.close()


def _history(instance: str, event: str | None) -> dict[str, Any]:
    return {
        "instance_id": instance,
        "operation_id": None,
        "event": event,
        "detail": db.jsonb({}),
        "actor": "test",
    }


async def _history_rows(env: Env, instance: str) -> int:
    return int(
        await env.scalar("SELECT count(*) FROM custody.history WHERE instance_id = %s", (instance,))
    )


async def test_a_sent_write_that_fails_at_commit_keeps_nothing_of_its_transaction(
    env: Env, database: db.Database
) -> None:
    """History and the rest of a transition commit together: a write sent without
    waiting whose error is read only with the COMMIT fails the whole unit, with the
    database's reason, and the writes sent before it are not kept."""
    instance = str(uuid.uuid4())

    async def unit() -> None:
        async with database.transaction() as tx:
            await tx.send_many("history_insert", [_history(instance, "first")])
            await tx.send_many("history_insert", [_history(instance, None)])  # NOT NULL

    with pytest.raises(errors.DatabaseError) as raised:
        await unit()
    assert raised.value.sqlstate == "23502"
    assert raised.value.kind is errors.Retry.FATAL  # not "in doubt": it never committed
    assert await _history_rows(env, instance) == 0


async def test_a_statement_that_waits_raises_the_error_of_a_write_sent_before_it(
    env: Env, database: db.Database
) -> None:
    """A unit never reads on past a write that failed: the next statement that waits
    raises that write's error, and nothing of the unit is kept."""
    instance = str(uuid.uuid4())
    went_on = False

    async def unit() -> None:
        nonlocal went_on
        async with database.transaction() as tx:
            await tx.send_many("history_insert", [_history(instance, "first")])
            await tx.send_many("history_insert", [_history(instance, None)])
            await tx.rows("instance_history", {"id": instance})
            went_on = True

    with pytest.raises(errors.DatabaseError) as raised:
        await unit()
    assert raised.value.sqlstate == "23502"
    assert not went_on
    assert await _history_rows(env, instance) == 0
    async with database.transaction() as tx:  # the pooled connection is usable again
        await tx.send_many("history_insert", [_history(instance, "after")])
    assert await _history_rows(env, instance) == 1


async def test_a_fenced_unit_keeps_nothing_it_sent(env: Env, database: db.Database) -> None:
    """A worker whose lease was taken over (a stale epoch) commits nothing: its fence
    fails in the same flight as its writes and its COMMIT."""
    lease = db.Lease("committer", ttl_s=60)
    await database.acquire(lease)
    stale = lease.epoch
    await database.acquire(lease)  # taken back: the epoch moved on
    instance = str(uuid.uuid4())

    async def unit() -> None:
        async with database.transaction(lease, epoch=stale) as tx:
            await tx.send_many("history_insert", [_history(instance, "zombie")])

    with pytest.raises(errors.Fenced):
        await unit()
    assert await _history_rows(env, instance) == 0


def _round_trips(trace: str) -> int:
    """The times the client waited for the server in a libpq protocol trace: each
    turn from messages it sent (F) to answers it read (B)."""
    directions = [line.split("\t")[1] for line in trace.splitlines() if "\t" in line]
    return sum(1 for a, b in itertools.pairwise(directions) if (a, b) == ("F", "B"))


async def test_the_end_of_a_unit_costs_one_round_trip_whatever_it_writes(
    env: Env, database: db.Database, tmp_path: Path
) -> None:
    """BEGIN leaves with the first statement, and the writes at the end, the fence and
    the COMMIT leave together: a unit that reads once and then writes five times costs
    two round trips, where one statement per round trip cost eight."""
    lease = db.Lease("committer", ttl_s=60)
    await database.acquire(lease)
    instance = str(uuid.uuid4())
    trace = tmp_path / "libpq.trace"
    with trace.open("w") as out:
        conn: psycopg.AsyncConnection[Any] | None = None
        async with database.transaction(lease) as tx:
            conn = tx._conn
            conn.pgconn.trace(out.fileno())
            await tx.rows("instance_history", {"id": instance})
            for i in range(5):
                await tx.send_many("history_insert", [_history(instance, f"event {i}")])
        assert conn is not None
        conn.pgconn.untrace()
    assert await _history_rows(env, instance) == 5
    assert _round_trips(trace.read_text()) == 2


async def test_an_answer_is_read_after_its_transaction_only_if_it_committed(
    env: Env, database: db.Database
) -> None:
    """A query sent with ``Tx.ask`` may be read after its transaction, its answer having
    come with the commit's (what a claim does): those rows are durable. The answer of a
    transaction that rolled back is refused: its rows were never kept, and its
    connection may be another unit's by then."""
    instance = str(uuid.uuid4())
    async with database.transaction() as tx:
        await tx.send_many("history_insert", [_history(instance, "kept")])
        kept = await tx.ask("instance_history", {"id": instance})
    assert [r["event"] for r in await kept.rows()] == ["kept"]

    class Undone(Exception):
        pass

    asked: list[db.Answer] = []

    async def undone() -> None:
        async with database.transaction() as tx:
            await tx.send_many("history_insert", [_history(instance, "undone")])
            asked.append(await tx.ask("instance_history", {"id": instance}))
            raise Undone

    with pytest.raises(Undone):
        await undone()
    [lost] = asked
    with pytest.raises(errors.CustodyError, match="rolled back"):
        await lost.rows()
    assert await _history_rows(env, instance) == 1
