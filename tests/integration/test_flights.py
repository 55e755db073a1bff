"""A transaction's flights over libpq's pipeline (workers/io/flights.py ``Pipe``), on the
real Postgres: what the connection pool relies on when a unit hands its connection
back, and what every unit relies on from a statement's preparation.

A unit cancelled in the middle of a round trip (a worker stopping, a timeout) must hand
back a connection that is out of pipeline mode with nothing unread and no transaction
open, or close it: the next unit on it would otherwise read another unit's answers. A
statement is prepared on its first use and kept for the connection's life; a
preparation that fails, or that an earlier error skipped, must not leave a name that
the next unit executes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from tests.conftest import Env
from workers import errors
from workers.io import db, flights

_SLOW = flights.compile_query("SELECT pg_sleep(%s) AS slept")
_ECHO = flights.compile_query("SELECT %s::int + 1 AS n")


@pytest.fixture
async def conn(env: Env) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(
        env.settings.database_url, row_factory=dict_row, autocommit=True
    ) as c:
        yield c


async def _prepared(conn: psycopg.AsyncConnection[Any]) -> set[str]:
    cur = await conn.execute("SELECT name FROM pg_prepared_statements")
    return {r["name"] for r in await cur.fetchall()}


async def test_a_unit_cancelled_mid_round_trip_hands_back_an_idle_connection(env: Env) -> None:
    """Cancelled while its answers are on their way, the unit still reads them and
    rolls back: the pool lends the connection again, idle, and the next unit on it
    reads its own answers."""
    database = db.Database(env.settings.database_url, schema="custody", name="flights", max_size=1)
    await database.open()
    try:

        async def slow_unit() -> None:
            async with database.transaction() as tx:
                await tx.business("SELECT pg_sleep(0.3)")

        task = asyncio.create_task(slow_unit())
        await asyncio.sleep(0.1)  # its flight is sent, its answer 0.2 s away
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with database.transaction() as tx:
            assert await tx.business("SELECT 41 + 1 AS n") == [{"n": 42}]
            status = tx._conn.info.transaction_status
        assert status is psycopg.pq.TransactionStatus.INTRANS
        async with database._pool.connection() as c:
            assert c.info.transaction_status is psycopg.pq.TransactionStatus.IDLE
            assert c.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF
    finally:
        await database.close()


async def test_a_round_trip_cut_short_is_finished_before_the_next_one(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A sync whose answer was not read (its reader was cancelled) is read first: the
    next flight's statements get their own answers, not the earlier ones'."""
    pipe = flights.Pipe(conn)
    first = pipe.send(_SLOW, (0.2,))
    reading = asyncio.create_task(pipe.sync())
    await asyncio.sleep(0.05)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    second = pipe.send(_ECHO, (1,))
    await pipe.sync()
    assert len(first.rows()) == 1  # pg_sleep returns void
    assert second.rows() == [{"n": 2}]
    pipe.close()
    assert conn.pgconn.pipeline_status == psycopg.pq.PipelineStatus.OFF


async def test_a_statement_is_prepared_once_and_kept_through_a_rollback(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    for n in range(3):
        pipe = flights.Pipe(conn)
        pipe.control(b"BEGIN")
        slot = pipe.send(_ECHO, (n,))
        pipe.control(b"ROLLBACK")
        await pipe.sync()
        pipe.close()
        assert slot.rows() == [{"n": n + 1}]
    names = await _prepared(conn)
    assert len([n for n in names if n.startswith("custody_")]) == 1


async def test_a_preparation_that_failed_or_was_skipped_is_made_again(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """In one flight: a statement that fails, so the preparation of the next one is
    skipped. The next flight prepares it again and it runs."""
    failing = flights.compile_query("SELECT 1 / %s::int AS q")
    skipped = flights.compile_query("SELECT %s::text AS t")
    pipe = flights.Pipe(conn)
    pipe.send(failing, (0,))
    later = pipe.send(skipped, ("x",))
    with pytest.raises(psycopg.errors.DivisionByZero):
        await pipe.sync()
    assert later.aborted
    again = pipe.send(skipped, ("y",))
    await pipe.sync()
    assert again.rows() == [{"t": "y"}]
    broken = flights.compile_query("SELEC %s")
    pipe.send(broken, (1,))
    with pytest.raises(psycopg.errors.SyntaxError):
        await pipe.sync()
    assert (await _sync_rows(pipe, _ECHO, (5,))) == [{"n": 6}]
    pipe.close()
    assert b"SELEC $1" not in flights.prepared(conn)
    assert b"SELECT %s::text AS t".replace(b"%s", b"$1") in flights.prepared(conn)


async def _sync_rows(pipe: flights.Pipe, query: flights.Query, params: Any) -> list[Any]:
    slot = pipe.send(query, params)
    await pipe.sync()
    return slot.rows()


async def test_statements_beyond_the_prepared_bound_run_unprepared(
    conn: psycopg.AsyncConnection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flights, "PREPARED_MAX", 2)
    pipe = flights.Pipe(conn)
    slots = [pipe.send(flights.compile_query(f"SELECT %s::int + {i} AS n"), (1,)) for i in range(5)]
    await pipe.sync()
    pipe.close()
    assert [s.rows() for s in slots] == [[{"n": 1 + i}] for i in range(5)]
    assert len([n for n in await _prepared(conn) if n.startswith("custody_")]) == 2


async def test_a_flight_larger_than_the_socket_buffers_is_sent_and_answered(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A burst's batch is one jsonb parameter of megabytes, with more statements after
    it: writing it must not wait on answers that nobody reads."""
    big = [{"k": i, "pad": "x" * 200} for i in range(40_000)]  # about 9 MB
    q = flights.compile_query("SELECT jsonb_array_length(%s::jsonb) AS n, %s::int AS m")
    pipe = flights.Pipe(conn)
    slots = [pipe.send(q, (Jsonb(big), i)) for i in range(3)]
    await pipe.sync()
    pipe.close()
    assert [s.rows() for s in slots] == [[{"n": 40_000, "m": i}] for i in range(3)]


async def test_a_lost_connection_mid_unit_is_a_retryable_error_and_not_lent_again(
    env: Env,
) -> None:
    database = db.Database(env.settings.database_url, schema="custody", name="flights", max_size=1)
    await database.open()

    async def unit_whose_backend_dies() -> None:
        async with database.transaction() as tx:
            pid = (await tx.business("SELECT pg_backend_pid() AS pid"))[0]["pid"]
            async with await psycopg.AsyncConnection.connect(
                env.settings.database_url, autocommit=True
            ) as killer:
                await killer.execute("SELECT pg_terminate_backend(%s)", (pid,))
            await tx.business("SELECT 1")

    try:
        with pytest.raises(errors.DatabaseError) as raised:
            await unit_whose_backend_dies()
        assert raised.value.kind is errors.Retry.RETRY
        async with database.transaction() as tx:
            assert await tx.business("SELECT 2 AS n") == [{"n": 2}]
    finally:
        await database.close()
