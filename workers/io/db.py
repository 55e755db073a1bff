"""The one module that talks to Postgres (with :mod:`workers.io.flights`, the pipeline
under its transactions).

Queries are named and live in ``queries.sql`` (the engine's) and
``participant_queries.sql`` (the participants'), loaded on first use by
:mod:`workers.io.sql`; workers run them by name through a :class:`Tx`. JSON parameters
go through :func:`jsonb`, dumped by orjson on every pooled connection. psycopg errors
are translated here, once, into :class:`workers.errors.DatabaseError` with a retry
classification.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import functools
import json
import logging
import os
import re
import socket
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, LiteralString, TypeVar

import orjson
import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb, set_json_dumps, set_json_loads
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from workers import errors
from workers.core import backoff
from workers.io import flights, startup
from workers.io import sql as sql_files

Row = dict[str, Any]
# What a caller above this layer may catch as a last resort (the CLI's top level: one
# line, never a traceback) without importing the driver; everything here translates.
DRIVER_ERRORS: Final[tuple[type[Exception], ...]] = (psycopg.Error,)
Params = Mapping[str, Any] | Sequence[Any] | None


if TYPE_CHECKING:
    SQL_DIR: Path  # the SQL directory: workers.io.sql.directory()
    QUERIES: Mapping[str, str]  # every named query: workers.io.sql.queries()
else:

    def __getattr__(name: str) -> Any:
        """``db.SQL_DIR`` and ``db.QUERIES``, for callers older than
        :mod:`workers.io.sql`: resolved on first access, never at import."""
        if name == "SQL_DIR":
            return sql_files.directory()
        if name == "QUERIES":
            return sql_files.queries()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _row_value(value: Any) -> Any:
    """What a value of a multi-row parameter is in JSON: a jsonb value is itself, bytes
    are base64 (the statement decodes them: ``decode(r.body, 'base64')``)."""
    if isinstance(value, Jsonb):
        return value.obj
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(value).decode()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _dumps(value: Any) -> bytes:
    """JSON for a jsonb parameter: orjson; the standard library for what orjson refuses
    and JSON allows (an integer beyond 64 bits, as a participant's result may hold)."""
    try:
        return orjson.dumps(value, default=_row_value, option=orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), default=_std_value).encode()


def _std_value(value: Any) -> Any:
    if isinstance(value, (uuid.UUID, datetime.datetime, datetime.date)):
        return str(value) if isinstance(value, uuid.UUID) else value.isoformat()
    return _row_value(value)


def jsonb(value: Any) -> Jsonb:
    """Wrap a JSON value for a jsonb parameter (the one way callers send JSON; the
    pool's connections dump it with orjson)."""
    return Jsonb(value)


# a run of digits that may be an integer beyond 64 bits, which orjson would read as a
# float (the standard library keeps it an int, as it was written)
_LONG_DIGITS: Final = re.compile(rb"[0-9]{19}")


def _loads(data: str | bytes | memoryview) -> Any:
    """A jsonb value read back: orjson, unless the text holds a number orjson would
    read otherwise than the standard library (an integer beyond 64 bits): then the
    standard library, so a value reads back as it was written."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if _LONG_DIGITS.search(raw):
        return json.loads(raw)
    return orjson.loads(raw)


async def _configure(conn: psycopg.AsyncConnection[Any]) -> None:
    """Every pooled connection: JSON parameters are dumped, and jsonb values read, by
    orjson."""
    set_json_dumps(_dumps, conn)
    set_json_loads(_loads, conn)


def _translate(exc: psycopg.Error, *, during_commit: bool) -> errors.DatabaseError:
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate is None and not isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
        # a client-side error (a bad parameter, a programming error): not a lost
        # connection, and redoing it would only fail again
        return errors.DatabaseError(f"{type(exc).__name__}: {exc}", errors.Retry.FATAL)
    kind = errors.classify_sqlstate(sqlstate, during_commit=during_commit)
    cls = errors.Fenced if kind is errors.Retry.FENCED else errors.DatabaseError
    return cls(f"{type(exc).__name__}: {exc}".strip(), kind, sqlstate)


def statement_error(exc: BaseException | None) -> bool:
    """An error Postgres (or the driver) raised for a statement: the transaction is
    aborted by it, whatever the caller does next."""
    return isinstance(exc, DRIVER_ERRORS)


def transient(exc: BaseException) -> bool:
    """A Postgres error raised inside a transaction that says nothing about the work
    (a deadlock, a serialization failure, a lock timeout, a lost connection): redoing
    the same work later is expected to succeed."""
    if not isinstance(exc, psycopg.Error):
        return False
    kind = errors.classify_sqlstate(getattr(exc, "sqlstate", None), during_commit=False)
    return kind is errors.Retry.RETRY


class Tx:
    """One open transaction; every statement is a named query.

    The transaction runs in libpq's pipeline mode (:class:`workers.io.flights.Pipe`): a
    statement is written at once and its answer read only when it is needed. ``rows``,
    ``one``, ``run`` and ``business`` wait for their answer (and so for every statement
    written before them: one round trip); ``send`` and ``send_many`` do not, so the
    writes at the end of a unit leave in one flight with the fence and the COMMIT
    (:meth:`Database.transaction`). BEGIN leaves with the first statement. An error of
    a statement sent without waiting is raised by the next statement that waits, or by
    the commit: the transaction is rolled back all the same, and nothing it wrote is
    kept."""

    def __init__(self, pipe: flights.Pipe) -> None:
        self._pipe = pipe
        self._savepoints = 0  # savepoints open (nesting depth)
        self._unreleased: int | None = None  # the depth of a finished, unreleased one
        # statements sent in it so far (savepoint commands included), and how many of
        # them were declared reads (read): a participant tells by them whether a
        # handler that failed wrote anything
        self.statements = 0
        self.reads = 0
        # while on, a business write that returns no rows is sent without waiting for
        # its answer (see business); ``deferred`` counts those sent so far
        self.defer_writes = False
        self.deferred = 0
        # set once the COMMIT answered, and once the transaction is over: an Answer is
        # readable after the transaction only if it committed
        self.committed = False
        self.ended = False
        # the lease (holder, epoch) its commit is fenced by, if any (Database.transaction)
        self.fenced_by: tuple[str, int | None] | None = None

    @property
    def _conn(self) -> psycopg.AsyncConnection[Any]:
        """Its connection (a test traces its protocol through it)."""
        return self._pipe.connection

    async def fence(self) -> None:
        """Check the lease now, as the commit will again: sent without waiting, so that
        a statement sent after it is answered only if the lease was still current when
        it ran (its error is raised by the next statement that waits). Nothing without
        a lease."""
        if self.fenced_by is None:
            return
        self._pipe.send(_FENCE, self.fenced_by)

    async def rows(self, name: str, params: Params = None) -> list[Row]:
        self.statements += 1
        slot = self._pipe.send(_named(name, params), params)
        await self._pipe.sync()
        return slot.rows()

    async def one(self, name: str, params: Params = None) -> Row | None:
        found = await self.rows(name, params)
        return found[0] if found else None

    async def ask(self, name: str, params: Params = None) -> Answer:
        """A query sent now whose rows are read later (``await answer.rows()``):
        queries that do not depend on one another's rows leave, and are answered, in
        one round trip. They run in the order they were sent. An answer may also be
        read after the transaction committed: it came with the commit's answer, so a
        unit that needs a statement's rows only once its work is durable (a claim, the
        ids an insert took) costs no round trip of its own."""
        self.statements += 1
        slot = self._pipe.send(_named(name, params), params)
        slot.keep = True  # its rows loaded as they come: it may be read after the unit
        return Answer(self, slot)

    async def run(self, name: str, params: Params = None) -> int:
        """A statement whose row count is returned (so it waits for its answer)."""
        if sql_files.takes_rows(name) and isinstance(params, Mapping):
            return await self.run_many(name, [params])
        self.statements += 1
        slot = self._pipe.send(_named(name, params), params)
        await self._pipe.sync()
        return slot.rowcount

    async def run_many(self, name: str, params: Iterable[Mapping[str, Any]]) -> int:
        """One statement per row (pipelined), or, for a statement that takes
        ``%(rows)s``, one statement for all the rows (a jsonb array of row objects);
        returns the rows changed (so it waits for the answer)."""
        slots = self._send_many(name, list(params))
        if not slots:
            return 0
        await self._pipe.sync()
        return sum(max(s.rowcount, 0) for s in slots)

    async def send(self, name: str, params: Params = None) -> None:
        """A write whose answer nobody reads: sent now, answered with what follows."""
        if sql_files.takes_rows(name) and isinstance(params, Mapping):
            self._send_many(name, [params])
            return
        self.statements += 1
        self._pipe.send(_named(name, params), params)

    async def send_many(self, name: str, params: Iterable[Mapping[str, Any]]) -> None:
        """:meth:`run_many` without waiting for the answer (see :meth:`send`)."""
        self._send_many(name, list(params))

    def _send_many(self, name: str, seq: Sequence[Mapping[str, Any]]) -> list[flights.Slot]:
        if not seq:
            return []
        self.statements += 1
        if sql_files.takes_rows(name):
            return [self._pipe.send(_named(name, seq), {"rows": Jsonb(seq)})]
        return [self._pipe.send(_named(name, p), p) for p in seq]

    async def business(self, statement: LiteralString, params: Params = None) -> list[Row]:
        """A participant's own SQL on its own tables, inside this transaction.

        While ``defer_writes`` is on, a write that returns no rows
        (:func:`returns_nothing`) is sent without waiting for its answer and returns
        ``[]`` at once, so the writes of a batch of handlers leave and are answered
        together. Its error is raised by the next statement that waits, or by
        :meth:`settle`, possibly in a later handler's statement; a savepoint answers
        what was sent inside it before it ends. The participant runtime, which turns
        this on, redoes a unit whose such error it cannot place with every handler in a
        savepoint (``workers.participant.service``)."""
        self.statements += 1
        slot = self._pipe.send(flights.query(statement, params), params)
        if self.defer_writes and returns_nothing(statement):
            self.deferred += 1
            return []
        await self._pipe.sync()
        return slot.rows() if slot.has_rows else []

    async def read(self, statement: LiteralString, params: Params = None) -> list[Row]:
        """A participant's own statement that changes nothing, inside this transaction:
        a ``SELECT`` (``FOR UPDATE`` or ``FOR SHARE`` to lock what it read until the
        commit), its rows waited for. A handler that fails after only reads had nothing
        to undo: its unit is not redone and its operation's next runs need no
        savepoint (``workers.participant.service``). By contract it writes nothing,
        not even through a function it calls: such a statement goes through
        :meth:`business`. A statement that does not begin with ``SELECT``, or says
        ``INTO`` (a ``SELECT … INTO`` creates a table), is refused before it is sent;
        that check is a guard, not a proof. A read that fails counts as a write (its
        error aborted the transaction): the unit is redone."""
        if not _SELECT.match(statement) or _INTO.search(statement):
            raise ValueError(f"Tx.read takes a SELECT that writes nothing: {statement[:60]!r}")
        self.statements += 1
        slot = self._pipe.send(flights.query(statement, params), params)
        await self._pipe.sync()
        rows = slot.rows()
        self.reads += 1  # answered: it changed nothing
        return rows

    async def settle(self) -> None:
        """Wait for the answers of everything sent: an error of a statement sent
        without waiting is raised here."""
        if self._pipe.unanswered:
            await self._pipe.sync()

    @contextlib.asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        """A savepoint: an error inside rolls back only what was done inside, and is
        raised. Statements sent before it are answered first, so that an error of
        theirs is never taken for one inside. The savepoint leaves with the first
        statement inside; a savepoint that finished is released lazily, by the next
        one at its depth or by the commit."""
        depth = self._savepoints
        name = _SAVEPOINTS[depth] if depth < len(_SAVEPOINTS) else None
        if name is None:
            raise errors.CustodyError(f"savepoints nested deeper than {len(_SAVEPOINTS)}")
        if self._pipe.unanswered:
            await self._pipe.sync()
        if self._unreleased == depth:
            self._pipe.control(b"RELEASE SAVEPOINT " + name)
        self.statements += 1
        self._pipe.control(b"SAVEPOINT " + name)
        self._unreleased = None
        self._savepoints = depth + 1
        try:
            yield
            # what was sent inside without waiting is answered inside: its error rolls
            # back this savepoint, like the error of a statement that waited
            if self._pipe.unanswered:
                await self._pipe.sync()
        except BaseException:
            self._savepoints, self._unreleased = depth, None
            await self._pipe.drain()
            self._pipe.control(b"ROLLBACK TO SAVEPOINT " + name)
            self._pipe.control(b"RELEASE SAVEPOINT " + name)
            await self._pipe.sync()
            raise
        # released with the next one at this depth, or with everything at commit (a
        # RELEASE of an outer savepoint releases this one too)
        self._savepoints, self._unreleased = depth, depth


class Answer:
    """The rows of a query sent by :meth:`Tx.ask`, read when they are needed: inside
    the transaction (waiting for them if they have not come yet) or after it committed
    (they came with the commit's answer; reading them is no I/O). After a transaction
    that did not commit they are refused: its rows were never kept."""

    def __init__(self, tx: Tx, slot: flights.Slot) -> None:
        self._tx = tx
        self._slot = slot

    async def rows(self) -> list[Row]:
        if self._tx.ended and not self._tx.committed:
            # its rows were never kept, and its connection may be another unit's by now
            raise errors.CustodyError("an answer read after its transaction rolled back")
        if not self._slot.answered:
            await self._tx._pipe.sync()  # reading one answer reads all those sent
        return self._slot.rows()


_T = TypeVar("_T")

_FENCE: Final = flights.compile_query("SELECT custody.fence(%s, %s)")
_ROLLBACK: Final = sql.SQL("ROLLBACK")


async def _control(conn: psycopg.AsyncConnection[Any], statement: sql.SQL | sql.Composed) -> None:
    """A transaction command through psycopg itself (out of pipeline mode), never
    prepared nor counted for preparing: psycopg forgets every prepared statement of the
    session when it sees a ROLLBACK answer to a statement it counts."""
    threshold = conn.prepare_threshold
    conn.prepare_threshold = None
    try:
        await conn.execute(statement)
    finally:
        conn.prepare_threshold = threshold


async def _abandon(conn: psycopg.AsyncConnection[Any]) -> None:
    """After a failed last flight (its COMMIT not run): leave the transaction, so the
    connection goes back to the pool idle. A broken connection is the pool's to drop."""
    if conn.info.transaction_status in (
        psycopg.pq.TransactionStatus.INTRANS,
        psycopg.pq.TransactionStatus.INERROR,
    ):
        with contextlib.suppress(psycopg.Error):
            await _control(conn, _ROLLBACK)


async def _leave(conn: psycopg.AsyncConnection[Any], pipe: flights.Pipe) -> None:
    """Out of pipeline mode, every answer read, no transaction open, whatever happened
    in the unit; a connection that cannot be brought back (lost, left mid-flight, or
    still in its transaction: a second cancellation skipped its ROLLBACK) is closed, so
    the pool drops it (and Postgres rolls its transaction back) rather than lend it."""
    if conn.closed:
        return
    try:
        await pipe.drain()
        pipe.close()
    except BaseException:
        await conn.close()
        raise
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        await conn.close()


async def _give_up(conn: psycopg.AsyncConnection[Any]) -> None:
    """A unit cancelled while Postgres is still working for it (a statement waiting
    for a lock, a server gone silent): its statement is cancelled on the server (at
    most :data:`CANCEL_TIMEOUT_S`) and the connection closed, so Postgres rolls the
    transaction back and lets its locks go; the cancelled unit does not wait for
    answers nobody will read (as psycopg does for a cancelled query)."""
    try:
        with contextlib.suppress(Exception):
            await conn.cancel_safe(timeout=CANCEL_TIMEOUT_S)
    finally:
        await conn.close()


def _committed(commit: flights.Slot) -> None:
    """A COMMIT of a transaction that had failed is answered ROLLBACK: nothing was kept
    (a unit that went on after catching a statement's error)."""
    status = commit.result.command_status if commit.result is not None else None
    if status != b"COMMIT":
        raise psycopg.errors.InFailedSqlTransaction(
            f"the COMMIT was answered {status!r}: the transaction had failed, nothing was kept"
        )


_PLAIN_WRITE: Final = re.compile(r"\s*(INSERT|UPDATE|DELETE)\s", re.IGNORECASE)
# Tx.read's guard (not WITH: a CTE may write; not SELECT ... INTO: it creates a table)
_SELECT: Final = re.compile(r"\s*SELECT\s", re.IGNORECASE)
_INTO: Final = re.compile(r"\bINTO\b", re.IGNORECASE)
_RETURNING: Final = re.compile(r"\bRETURNING\b", re.IGNORECASE)


@functools.lru_cache(maxsize=1024)
def returns_nothing(statement: str) -> bool:
    """Whether a statement is a plain write that returns no rows, so that nothing is
    lost by not waiting for its answer: it begins with INSERT, UPDATE or DELETE (not
    WITH, not a comment) and says RETURNING nowhere (in a string or a comment too: a
    false "no" only means waiting, as every other statement does)."""
    return _PLAIN_WRITE.match(statement) is not None and _RETURNING.search(statement) is None


_SAVEPOINTS: Final = tuple(b"custody_sp_%d" % i for i in range(8))


def _q(name: str) -> LiteralString:
    return sql_files.query(name)


def _named(name: str, params: object) -> flights.Query:
    return flights.query(sql_files.query(name), params)


@dataclass
class Lease:
    """A worker's fencing token: its holder row and the epoch it acquired."""

    worker: str
    holder: str = field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    epoch: int = 0
    ttl_s: float = 15.0


# libpq says why a connection failed in words only (no SQLSTATE): these server answers
# are a login refused for good (a wrong password, a role or database that does not
# exist, no pg_hba entry, a role without LOGIN). Anything else (refused, reset, timed
# out, the server starting up or out of connection slots) is an outage, waited out.
_LOGIN_REFUSED: Final = re.compile(
    r"FATAL:\s+(password authentication failed|role \".*\" does not exist"
    r"|database \".*\" does not exist|no pg_hba\.conf entry|role \".*\" is not permitted"
    r"|pg_hba\.conf rejects connection|certificate authentication failed)",
    re.IGNORECASE,
)
PROBE_TIMEOUT_S: Final = 5


def login_refused(message: str) -> bool:
    """Whether a failed connection's message is Postgres refusing the login for good."""
    return _LOGIN_REFUSED.search(message) is not None


# how long a stopping worker tries to give its lease back (Database.release)
RELEASE_TIMEOUT_S = 2.0
# how long a cancelled unit waits for Postgres to take its statement's cancel request
CANCEL_TIMEOUT_S: Final = 1.0


class Database:
    """A pool of connections whose ``search_path`` is the owner's schema."""

    def __init__(
        self, url: str, *, schema: str, name: str, min_size: int = 1, max_size: int = 4
    ) -> None:
        self.url = url
        self.schema = schema
        self.name = name
        self.healthy = False  # /readyz: the last transaction reached the database
        self._sizes = (min_size, max_size)
        self._pool = self._new_pool()

    def _new_pool(self) -> AsyncConnectionPool[psycopg.AsyncConnection[Row]]:
        min_size, max_size = self._sizes
        return AsyncConnectionPool(
            self.url,
            connection_class=psycopg.AsyncConnection[Row],
            min_size=min_size,
            max_size=max_size,
            open=False,
            kwargs={
                "row_factory": dict_row,
                "autocommit": True,  # transaction() says BEGIN and COMMIT itself
                "application_name": f"custody-{self.name}",
                "options": f"-c search_path={self.schema},public",
            },
            name=f"custody-{self.name}",
            configure=_configure,
        )

    async def open(self) -> None:
        """Open the pool, after one probe connection that says at once why Postgres
        cannot be reached. In a worker (``supervisor.run``) an unreachable Postgres is
        waited for, with a full-jitter backoff and a ``database.connect_retry`` event per
        attempt; elsewhere the first failure is raised (``Retry.RETRY``). A refused login
        (see :func:`login_refused`) is a :class:`ConfigError` at once, everywhere."""
        sql_files.queries()  # a missing or broken SQL file stops a worker at start-up

        async def connect() -> None:
            await self._probe()
            await self._open_pool()

        def fresh_pool() -> None:
            self._pool = self._new_pool()  # a pool that timed out is closed for good

        _, attempt = await self._waited("start", connect, {errors.Retry.RETRY}, fresh_pool)
        startup.current().report(
            "database.connected",
            worker=self.name,
            node=_address(self.url),
            phase="start",
            failed_attempts=attempt,
        )

    async def _probe(self) -> None:
        """One connection, as the pool would make it: says at once why it cannot."""
        try:
            conn = await psycopg.AsyncConnection.connect(self.url, connect_timeout=PROBE_TIMEOUT_S)
        except psycopg.Error as exc:
            text = str(exc).strip()
            if login_refused(text):
                raise errors.ConfigError(
                    f"Postgres refused the login for {self.name} ({_last_line(text)}):"
                    " check the user, password and database of its URL; not retried"
                ) from exc
            raise errors.DatabaseError(
                f"cannot connect to Postgres for {self.name}: {_last_line(text)}",
                errors.Retry.RETRY,
            ) from exc
        await conn.close()

    async def _open_pool(self) -> None:
        try:
            await self._pool.open(wait=True, timeout=15)
            self.healthy = True
        except psycopg.Error as exc:
            raise _translate(exc, during_commit=False) from exc
        except PoolTimeout as exc:
            raise errors.DatabaseError(
                f"cannot connect to Postgres for {self.name}: {exc}", errors.Retry.RETRY
            ) from exc

    async def close(self) -> None:
        await self._pool.close()

    @contextlib.asynccontextmanager
    async def transaction(
        self, lease: Lease | None = None, *, epoch: int | None = None
    ) -> AsyncIterator[Tx]:
        """One transaction; with a lease, the commit is fenced by the epoch the lease had
        when the transaction began — or by ``epoch``, the one a multi-step unit started
        under (a claim, then a mark)."""
        # The epoch is the one in force when the unit *began*: a heartbeat that takes
        # the lease back (epoch + 1) while this unit was paused must not make the
        # paused unit's commit current again.
        fence_epoch = None if lease is None else (lease.epoch if epoch is None else epoch)
        tx: Tx | None = None
        try:
            async with self._pool.connection() as conn:
                committing = False
                try:
                    # pipeline mode (flights.Pipe), on a connection in autocommit mode
                    # so that psycopg adds no BEGIN, COMMIT or sync of its own: BEGIN
                    # leaves with the first statement; the writes sent last, the fence
                    # and the COMMIT leave together, answered in one round trip, and an
                    # error of any of them is raised there
                    pipe = flights.Pipe(conn)
                    try:
                        pipe.control(b"BEGIN")
                        tx = Tx(pipe)
                        if lease is not None:
                            tx.fenced_by = (lease.holder, fence_epoch)
                        try:
                            yield tx
                            await tx.fence()  # again, with the COMMIT
                        except asyncio.CancelledError:
                            if pipe.waiting:  # its statements may run for long yet
                                await _give_up(conn)
                            else:
                                pipe.control(b"ROLLBACK")
                            raise
                        except BaseException:
                            await pipe.drain()
                            pipe.control(b"ROLLBACK")
                            raise
                        commit = pipe.control(b"COMMIT")
                        committing = True
                        await pipe.sync()
                        _committed(commit)
                        tx.committed = True  # the COMMIT answered COMMIT
                    finally:
                        await _leave(conn, pipe)
                except psycopg.Error as exc:
                    await _abandon(conn)
                    error = _translate(exc, during_commit=committing)
                    if error.kind in (errors.Retry.RETRY, errors.Retry.IN_DOUBT):
                        self.healthy = False
                    raise error from exc
        except PoolTimeout as exc:
            self.healthy = False
            raise errors.DatabaseError(
                f"no connection to Postgres: {exc}", errors.Retry.RETRY
            ) from exc
        finally:
            if tx is not None:
                tx.ended = True
        self.healthy = True

    async def acquire(self, lease: Lease) -> int:
        """Take (or take back) the lease with a new epoch; returns the epoch."""
        async with self.transaction() as tx:
            row = await tx.one(
                "lease_acquire",
                {"holder": lease.holder, "worker": lease.worker, "ttl": lease.ttl_s},
            )
        assert row is not None
        lease.epoch = int(row["epoch"])
        return lease.epoch

    async def first_lease(self, lease: Lease) -> int:
        """The lease at start-up. Postgres may have gone away since the pool opened (it
        restarted while the broker was still being waited for, and the pooled
        connection is dead): in a worker that is waited for as at :meth:`open`, with a
        ``database.connect_retry`` event per attempt (phase ``lease``); elsewhere, and
        for a wrong deployment, the failure is raised."""
        epoch, _ = await self._waited(
            "lease", lambda: self.acquire(lease), {errors.Retry.RETRY, errors.Retry.IN_DOUBT}
        )
        return epoch

    async def _waited(
        self,
        phase: str,
        attempt_once: Callable[[], Awaitable[_T]],
        waited_out: Collection[errors.Retry],
        after_failure: Callable[[], None] | None = None,
    ) -> tuple[_T, int]:
        """``attempt_once`` until it gets through, and how many attempts failed. In a
        worker (start-up patience) a failure of a kind in ``waited_out`` is waited out:
        a full-jitter backoff, ``/readyz`` saying why, a ``database.connect_retry``
        event per attempt. Any other failure, and any failure outside a worker, is
        raised."""
        patience = startup.current()
        waiting = patience.waiting_for("database") if patience.wait else contextlib.nullcontext()
        attempt = 0
        with waiting:
            while True:
                try:
                    return await attempt_once(), attempt
                except errors.DatabaseError as exc:
                    if exc.kind not in waited_out or not patience.wait:
                        raise
                    if after_failure is not None:
                        after_failure()
                    delay = backoff.full_jitter(attempt)
                    attempt += 1
                    patience.waiting["database"] = str(exc)[:300]
                    patience.report(
                        "database.connect_retry",
                        logging.WARNING,
                        worker=self.name,
                        node=_address(self.url),
                        phase=phase,
                        attempt=attempt,
                        retry_in_s=round(delay, 3),
                        error=str(exc)[:300],
                    )
                    await asyncio.sleep(delay)

    async def renew(self, lease: Lease) -> bool:
        """Extend the lease; False when it had already expired (we were a zombie)."""
        async with self.transaction() as tx:
            n = await tx.run(
                "lease_renew", {"holder": lease.holder, "epoch": lease.epoch, "ttl": lease.ttl_s}
            )
        return n == 1

    async def release(self, lease: Lease, *, timeout_s: float = RELEASE_TIMEOUT_S) -> None:
        """Give the lease up at shutdown, so that a replica takes it at once rather than
        after its TTL. A courtesy, bounded: with Postgres unreachable (a worker stopped
        during an outage) it gives up after ``timeout_s`` and the lease expires by its
        TTL, instead of holding the drain until the pool's connection timeout."""
        async with asyncio.timeout(timeout_s):
            async with self.transaction() as tx:
                await tx.run("lease_release", {"holder": lease.holder, "epoch": lease.epoch})

    async def listen(self, *channels: str) -> AsyncIterator[None]:
        """Yield on each notification; NOTIFY is a hint, so callers also poll."""
        try:
            conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        except psycopg.Error as exc:
            raise _translate(exc, during_commit=False) from exc
        try:
            for channel in channels:
                await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
            async for _ in conn.notifies():
                yield
        except psycopg.Error as exc:
            raise _translate(exc, during_commit=False) from exc
        finally:
            await conn.close()


@contextlib.asynccontextmanager
async def connected(url: str, *, schema: str, name: str = "cli") -> AsyncIterator[Database]:
    """A one-connection :class:`Database` for a command's lifetime (the CLI). An
    unreachable database is said at once, in libpq's words, not after a pool timeout."""
    try:
        probe = await psycopg.AsyncConnection.connect(url, connect_timeout=5)
    except psycopg.Error as exc:
        raise errors.DatabaseError(
            f"cannot connect to Postgres: {str(exc).strip()}", errors.Retry.FATAL
        ) from exc
    await probe.close()
    database = Database(url, schema=schema, name=name, min_size=1, max_size=1)
    await database.open()
    try:
        yield database
    finally:
        await database.close()


async def apply_script(url: str, path: Path, *, schema: str | None = None) -> None:
    """Run a DDL script idempotently, serialised across runners by an advisory lock."""
    text = await asyncio.to_thread(path.read_text)
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute("SELECT pg_advisory_lock(hashtext('custody.migrate'))")
            try:
                async with conn.transaction():
                    await conn.execute("SET LOCAL client_min_messages = warning")
                    if schema is not None:
                        await conn.execute(
                            sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema))
                        )
                        await conn.execute(
                            sql.SQL("SET LOCAL search_path = {}").format(sql.Identifier(schema))
                        )
                    await conn.execute(text)
            finally:
                await conn.execute("SELECT pg_advisory_unlock(hashtext('custody.migrate'))")
    except psycopg.Error as exc:
        raise _translate(exc, during_commit=False) from exc


async def grant_schema(url: str, schema: str, role: str) -> None:
    """A LOGIN role that may use ``schema``'s tables and nothing else (least privilege)."""
    ident_role, ident_schema = sql.Identifier(role), sql.Identifier(schema)
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,))
            if await cur.fetchone() is None:
                with contextlib.suppress(psycopg.errors.DuplicateObject):
                    await conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident_role))
            for statement in (
                "GRANT USAGE ON SCHEMA {s} TO {r}",
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {s} TO {r}",
                "GRANT USAGE ON ALL SEQUENCES IN SCHEMA {s} TO {r}",
            ):
                await conn.execute(sql.SQL(statement).format(s=ident_schema, r=ident_role))
            cur = await conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'custody_operators'")
            if await cur.fetchone() is not None:
                # operators read journals for `custody restore report`, and write nothing
                for statement in (
                    "GRANT USAGE ON SCHEMA {s} TO custody_operators",
                    "GRANT SELECT ON ALL TABLES IN SCHEMA {s} TO custody_operators",
                ):
                    await conn.execute(sql.SQL(statement).format(s=ident_schema))
    except psycopg.Error as exc:
        raise _translate(exc, during_commit=False) from exc


@dataclass(frozen=True)
class OperatorLogins:
    """What ``sync_operators`` found: operators with a login (members of
    custody_operators), logins it created, and operators with no login role (broker-only
    principals such as the front end's broker user, or a login the DBA has yet to make)."""

    members: list[str]
    created: list[str]
    without_login: list[str]


# never operators, whatever a file says: the workers' and the definer's roles
_RESERVED_ROLES = frozenset(
    {
        "custody_committer",
        "custody_publisher",
        "custody_receipts",
        "custody_reconciler",
        "custody_definer",
        "custody_operators",
        "policy",
    }
)


async def sync_operators(
    url: str, operators: Mapping[str, tuple[Sequence[str], Sequence[str]]], *, create_logins: bool
) -> OperatorLogins:
    """Make ``custody.operators`` say what ``operators`` (name -> actions, tenants) says,
    and make each operator's own login role a member of custody_operators. Creating
    login roles (``create_logins``) is for development and tests; a deployment's DBA
    creates them, with its own authentication."""
    reserved = sorted(set(operators) & _RESERVED_ROLES)
    if reserved:
        raise errors.ConfigError(f"operators file: {reserved} are custody's own roles")
    members: list[str] = []
    created: list[str] = []
    without: list[str] = []
    try:
        async with (
            await psycopg.AsyncConnection.connect(url, autocommit=True) as conn,
            conn.transaction(),
        ):
            for name, (actions, tenants) in sorted(operators.items()):
                await conn.execute(
                    _q("operators_sync"),
                    {"name": name, "actions": list(actions), "tenants": list(tenants)},
                )
            await conn.execute(_q("operators_prune"), {"names": sorted(operators)})
            for name in sorted(operators):
                cur = await conn.execute(
                    "SELECT rolcanlogin FROM pg_roles WHERE rolname = %s", (name,)
                )
                found = await cur.fetchone()
                if found is None and create_logins:
                    await conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
                    created.append(name)
                elif found is None or not found[0]:
                    without.append(name)
                    continue
                await conn.execute(
                    sql.SQL("GRANT custody_operators TO {}").format(sql.Identifier(name))
                )
                members.append(name)
    except psycopg.Error as exc:
        raise _translate(exc, during_commit=False) from exc
    return OperatorLogins(members, created, without)


def _last_line(text: str) -> str:
    """libpq's message without its "connection to server at ... failed:" preamble."""
    return text.rsplit("failed: ", 1)[-1].strip()


def _address(url: str) -> str:
    """``host:port`` of a connection string (never its password), for events."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.Error:
        return "?"
    return f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}"


def with_dbname(url: str, name: str) -> str:
    """The same connection string, for another database."""
    return psycopg.conninfo.make_conninfo(url, dbname=name)


async def recreate_database(url: str) -> None:
    """Drop and create the database named in ``url`` (the demo and the bench only)."""
    admin = psycopg.conninfo.make_conninfo(url, dbname="postgres")
    name = str(psycopg.conninfo.conninfo_to_dict(url)["dbname"])
    try:
        async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
            await conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.Error as exc:
        raise _translate(exc, during_commit=False) from exc


async def effect_counts(url: str, tables: Sequence[tuple[str, str]]) -> dict[str, tuple[int, int]]:
    """Rows and repeated operation ids of each ``schema.table`` (the harnesses' check that
    every effect happened once)."""
    out: dict[str, tuple[int, int]] = {}
    try:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            for schema, table in tables:
                cur = await conn.execute(
                    sql.SQL(
                        "SELECT count(*), count(*) - count(DISTINCT operation_id) FROM {}"
                    ).format(sql.Identifier(schema, table))
                )
                row = await cur.fetchone()
                assert row is not None
                out[f"{schema}.{table}"] = (int(row[0]), int(row[1]))
    except psycopg.Error as exc:
        raise _translate(exc, during_commit=False) from exc
    return out


def with_user(url: str, user: str) -> str:
    """The same connection string, as another role (each worker has its own)."""
    return psycopg.conninfo.make_conninfo(url, user=user)


async def ensure_database(url: str) -> None:
    """Create the database named in ``url`` if it does not exist (dev and demo)."""
    info = psycopg.conninfo.conninfo_to_dict(url)
    dbname = str(info.get("dbname") or "")
    if not dbname:
        return
    admin = psycopg.conninfo.make_conninfo(url, dbname="postgres")
    try:
        async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
            cur = await conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,))
            if await cur.fetchone() is None:
                # two migrators at once: the loser sees one or the other error
                with contextlib.suppress(
                    psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation
                ):
                    await conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    except psycopg.Error as exc:
        raise _translate(exc, during_commit=False) from exc


async def wait_until_reachable(url: str, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            conn = await psycopg.AsyncConnection.connect(url, connect_timeout=2)
            await conn.close()
            return
        except psycopg.OperationalError as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise _translate(exc, during_commit=False) from exc
            await asyncio.sleep(0.5)
