"""The savepoint each handler runs in (workers/io/db.py ``Tx.savepoint``), on the real
Postgres.

The seed: "The participant commits the business effect and the terminal receipt
together" — and a handler that fails leaves no effect. Each handler of a batch runs
in its own savepoint, so a failure rolls back that handler's writes only. The
transaction runs in pipeline mode: the savepoint leaves with the handler's first
statement, and is released lazily (with the next one at its depth, or by the
commit), so a savepoint costs no round trip of its own; these tests pin that this
changes nothing a handler or its batch can see. A handler writes through
``Tx.business``, which waits for its answer.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from tests.conftest import Env
from workers.io import db, flights


class _HandlerBug(Exception):
    pass


def _round_trips(trace: str) -> int:
    """The times the client waited for the server in a libpq protocol trace: each
    turn from messages it sent (F) to answers it read (B)."""
    directions = [line.split("\t")[1] for line in trace.splitlines() if "\t" in line]
    return sum(1 for a, b in itertools.pairwise(directions) if (a, b) == ("F", "B"))


async def _table(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute("CREATE TEMP TABLE effects (n int)")
    await conn.commit()


@contextlib.asynccontextmanager
async def _effects_table(env: Env) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A connection with an empty table of effects."""
    async with await psycopg.AsyncConnection.connect(
        env.settings.database_url, row_factory=dict_row, autocommit=True
    ) as conn:
        await _table(conn)
        yield conn


@contextlib.asynccontextmanager
async def _batch(conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[db.Tx]:
    """The transaction of a batch of handlers, as Database.transaction opens it (in
    pipeline mode); it commits on leaving."""
    pipe = flights.Pipe(conn)
    pipe.control(b"BEGIN")
    yield db.Tx(pipe)
    pipe.control(b"COMMIT")
    await pipe.sync()
    pipe.close()


async def _effects(conn: psycopg.AsyncConnection[Any]) -> list[int]:
    cur = await conn.execute("SELECT coalesce(array_agg(n ORDER BY n), '{}') AS n FROM effects")
    row = await cur.fetchone()
    assert row is not None
    return list(row["n"])


async def test_a_failing_handler_rolls_back_its_own_writes_only(env: Env) -> None:
    """Handlers 0, 3, 6, 9 fail after writing (one with a database error that aborts
    its subtransaction); the batch commits the others' effects, each once."""
    async with _effects_table(env) as conn:
        async with _batch(conn) as tx:
            for i in range(10):
                try:
                    async with tx.savepoint():
                        await tx.business("INSERT INTO effects VALUES (%s)", (i,))
                        if i == 3:
                            await tx.business("SELECT 1 / 0")
                        elif i % 3 == 0:
                            raise RuntimeError("a handler bug")
                except (RuntimeError, psycopg.errors.DivisionByZero):
                    pass
        assert await _effects(conn) == [1, 2, 4, 5, 7, 8]


async def test_a_write_sent_without_waiting_that_fails_rolls_back_its_savepoint_only(
    env: Env,
) -> None:
    """A handler in a savepoint may send its writes without waiting
    (``Tx.defer_writes``): they are answered before the savepoint ends, so the error of
    one is raised there, rolls back that savepoint's writes only, and the batch goes
    on and commits the others' effects, each once."""
    async with _effects_table(env) as conn:
        async with _batch(conn) as tx:
            tx.defer_writes = True
            for i in range(6):
                try:
                    async with tx.savepoint():
                        await tx.business("INSERT INTO effects VALUES (%s)", (i,))
                        if i % 2:
                            await tx.business("INSERT INTO effects VALUES (%s / 0)", (i,))
                except psycopg.errors.DivisionByZero:
                    pass
            assert tx.deferred == 9, "every write sent without waiting"
        assert await _effects(conn) == [0, 2, 4]


async def test_a_savepoint_inside_a_handler_is_its_own(env: Env) -> None:
    """A handler may use a savepoint of its own: its failure rolls back the inner
    writes only, and the handler's savepoint is not released by it."""
    async with _effects_table(env) as conn:
        async with _batch(conn) as tx:
            async with tx.savepoint():
                await tx.business("INSERT INTO effects VALUES (1)")
                async with tx.savepoint():
                    await tx.business("INSERT INTO effects VALUES (2)")
                with contextlib.suppress(_HandlerBug):
                    async with tx.savepoint():
                        await tx.business("INSERT INTO effects VALUES (3)")
                        raise _HandlerBug
                await tx.business("INSERT INTO effects VALUES (4)")
            with contextlib.suppress(_HandlerBug):
                async with tx.savepoint():
                    await tx.business("INSERT INTO effects VALUES (5)")
                    async with tx.savepoint():
                        await tx.business("INSERT INTO effects VALUES (6)")
                    raise _HandlerBug  # rolls back 5 and its finished inner savepoint, 6
            async with tx.savepoint():
                await tx.business("INSERT INTO effects VALUES (7)")
        assert await _effects(conn) == [1, 2, 4, 7]


async def test_a_handlers_savepoint_costs_no_round_trip_of_its_own(
    env: Env, tmp_path: Path
) -> None:
    """N handlers of one statement each cost N round trips in all: each savepoint
    (and the release of the one before) travels with its handler's statement, not
    2N (a savepoint's own round trip) or 3N (its release's)."""
    n = 20
    trace = tmp_path / "libpq.trace"
    async with _effects_table(env) as conn:
        async with _batch(conn) as tx:
            with trace.open("w") as out:
                conn.pgconn.trace(out.fileno())
                try:
                    for i in range(n):
                        async with tx.savepoint():
                            await tx.business("INSERT INTO effects VALUES (%s)", (i,))
                finally:
                    conn.pgconn.untrace()
        assert _round_trips(trace.read_text()) == n
        assert await _effects(conn) == list(range(n))
