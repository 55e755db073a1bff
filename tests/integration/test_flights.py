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
import contextlib
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


async def test_a_unit_cancelled_while_its_statement_waits_for_a_lock_does_not_wait_for_it(
    env: Env,
) -> None:
    """A timeout around a unit whose statement waits for a row lock ends the unit while
    the lock is still held: the statement is cancelled on the server and the connection
    closed, so the waiting backend lets its own locks go, and the pool lends a fresh
    connection. (Waiting for the answer instead would hold the unit, and a stopping
    worker, for as long as the lock.)"""
    url = env.settings.database_url
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as setup:
        await setup.execute("CREATE TABLE flights_lock (id int PRIMARY KEY, n int)")
        await setup.execute("INSERT INTO flights_lock VALUES (1, 0)")
    database = db.Database(url, schema="custody", name="flights-lock", max_size=1)
    await database.open()
    holder = await psycopg.AsyncConnection.connect(url)
    try:
        await holder.execute("UPDATE flights_lock SET n = n + 1 WHERE id = 1")  # locked

        async def blocked_unit() -> None:
            async with asyncio.timeout(0.3), database.transaction() as tx:
                await tx.business("UPDATE flights_lock SET n = n + 10 WHERE id = 1")

        # the lock is held throughout; the bound only turns a hang into a failure
        task = asyncio.create_task(blocked_unit())
        done, _ = await asyncio.wait({task}, timeout=10)
        assert task in done, "the cancelled unit waited for the lock"
        with pytest.raises(TimeoutError):
            await task
        waiting = 1
        for _ in range(50):
            cur = await holder.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            row = await cur.fetchone()
            waiting = row[0] if row else 0
            if waiting == 0:
                break
            await asyncio.sleep(0.1)
        assert waiting == 0, "the cancelled unit's statement still waits for the lock"
        await holder.commit()
        async with database.transaction() as tx:
            rows = await tx.business("SELECT n FROM flights_lock WHERE id = 1")
        assert rows == [{"n": 1}]  # the cancelled unit kept nothing
    finally:
        await holder.close()
        await database.close()


async def test_a_statement_without_parameters_is_sent_as_written(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """As psycopg: a participant's own SQL with a ``%`` and no parameters (a LIKE, a
    modulo) is not read for placeholders."""
    pipe = flights.Pipe(conn)
    like = pipe.send(flights.query("SELECT 'a' LIKE 'a%' AS ok, 5 % 3 AS r", None), None)
    doubled = pipe.send(flights.query("SELECT '100%%' AS t", None), None)
    param = pipe.send(flights.query("SELECT '100%%' AS t, %s::int AS n", (1,)), (1,))
    await pipe.sync()
    pipe.close()
    assert like.rows() == [{"ok": True, "r": 2}]
    assert doubled.rows() == [{"t": "100%%"}]
    assert param.rows() == [{"t": "100%", "n": 1}]


async def test_an_answer_kept_is_readable_after_its_connection_closed(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """An answer read after its unit (``Tx.ask``) may be read after the pool closed the
    connection (its lifetime over): its rows were loaded as they came, a timestamp's
    zone included."""
    pipe = flights.Pipe(conn)
    slot = pipe.send(flights.query("SELECT now() AS t, %s::int AS n", (7,)), (7,))
    slot.keep = True
    await pipe.sync()
    pipe.close()
    await conn.close()
    [row] = slot.rows()
    assert row["n"] == 7 and row["t"].tzinfo is not None


async def test_a_round_trip_cut_short_leaves_its_statements_unanswered(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """After a cancelled round trip the pipe still says its answers are owed, so that
    ``Tx.settle`` and a savepoint's end read them (and raise their errors) there."""
    pipe = flights.Pipe(conn)
    pipe.send(_SLOW, (0.2,))
    reading = asyncio.create_task(pipe.sync())
    await asyncio.sleep(0.05)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    assert pipe.unanswered
    await pipe.sync()
    assert not pipe.unanswered
    pipe.close()


async def test_a_unit_that_went_on_after_an_error_commits_nothing_and_says_so(
    env: Env,
) -> None:
    """A COMMIT after a statement's error (the unit caught it and went on) is answered
    ROLLBACK: the transaction raises, it is not said committed, and nothing is kept."""
    url = env.settings.database_url
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as setup:
        await setup.execute("CREATE TABLE flights_kept (n int)")
    database = db.Database(url, schema="custody", name="flights-commit", max_size=1)
    await database.open()
    seen: list[db.Tx] = []

    async def unit() -> None:
        async with database.transaction() as tx:
            seen.append(tx)
            await tx.business("INSERT INTO flights_kept VALUES (1)")
            with contextlib.suppress(psycopg.Error):
                await tx.business("SELECT 1 / 0")

    try:
        with pytest.raises(errors.DatabaseError) as raised:
            await unit()
        assert raised.value.sqlstate == "25P02"
        assert not seen[0].committed
        async with database.transaction() as tx:
            assert await tx.business("SELECT count(*) AS n FROM flights_kept") == [{"n": 0}]
    finally:
        await database.close()


async def test_a_statement_whose_table_changed_is_prepared_again(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    """A prepared ``SELECT *`` whose table gained a column fails once ("cached plan must
    not change result type"); its next use prepares it again and runs."""
    await conn.execute("CREATE TEMP TABLE flights_shape (a int)")
    await conn.execute("INSERT INTO flights_shape VALUES (1)")
    star = flights.query("SELECT * FROM flights_shape WHERE a = %s", (1,))
    pipe = flights.Pipe(conn)
    assert await _sync_rows(pipe, star, (1,)) == [{"a": 1}]
    pipe.close()
    await conn.execute("ALTER TABLE flights_shape ADD COLUMN b int DEFAULT 2")
    pipe = flights.Pipe(conn)
    with pytest.raises(psycopg.errors.FeatureNotSupported):
        await _sync_rows(pipe, star, (1,))
    assert await _sync_rows(pipe, star, (1,)) == [{"a": 1, "b": 2}]
    pipe.close()
