"""A transaction's statements in libpq's pipeline mode, through psycopg's own low
level (:mod:`psycopg.pq` and the connection's ``Transformer``) rather than its cursors.

psycopg's pipeline (``AsyncConnection.pipeline``) flushes every statement as it is
executed and waits on the socket for it, through a cursor, a query object and a
generator each time: about 80-100 µs of the worker's CPU a statement on this
workplace's 2-core machines, where a unit of one receipt sends thirteen and every one
of them is on a light-load operation's way. Here a statement is written into libpq's
output buffer (its parameters dumped by the connection's own adapters, so a
:class:`psycopg.types.json.Jsonb` goes through the same orjson dumps) and the flight
leaves when an answer is needed: one flush and one wait for the round trip. The
answers are read up to the flight's sync and kept by the statements that asked for
them (:class:`Slot`); the first error among them is raised by :meth:`Pipe.sync`.

Statements are prepared on a connection on their first use (by query text and
parameter types, as psycopg keys them), in the same flight as their first execution;
a connection keeps at most :data:`PREPARED_MAX`, and runs any other statement
unprepared. A prepared statement is a connection's for its life (a ROLLBACK keeps it).

This module knows nothing of custody's transactions: :class:`workers.io.db.Tx` and
:meth:`workers.io.db.Database.transaction` are built on it.
"""

from __future__ import annotations

import asyncio
import functools
import re
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg import errors as pg_errors
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer

# prepared statements a connection keeps; a statement beyond them runs unprepared
PREPARED_MAX: Final = 256

_FATAL: Final = pq.ExecStatus.FATAL_ERROR
_ABORTED: Final = pq.ExecStatus.PIPELINE_ABORTED
_SYNC: Final = pq.ExecStatus.PIPELINE_SYNC
_COMMAND_OK: Final = pq.ExecStatus.COMMAND_OK
_TUPLES_OK: Final = pq.ExecStatus.TUPLES_OK
_NO_SUCH_STATEMENT: Final = "26000"  # invalid_sql_statement_name
_PLAN_CHANGED: Final = "0A000"  # "cached plan must not change result type"

# psycopg's placeholders: %s, %b, %t, %(name)s (…b, …t) and %% (a literal %)
_PLACEHOLDER: Final = re.compile(r"%(?:\(([^)]+)\))?(.)", re.DOTALL)
_FORMATS: Final = {"s": PyFormat.AUTO, "b": PyFormat.BINARY, "t": PyFormat.TEXT}


@dataclass(frozen=True, slots=True)
class Query:
    """A statement with psycopg's placeholders, as libpq takes it: ``$1``, ``$2`` …,
    and where each parameter comes from (by position, or by name)."""

    text: bytes
    names: tuple[str, ...] | None  # by name (a mapping's keys, in $ order); None: by position
    formats: tuple[PyFormat, ...]

    def values(self, params: Mapping[str, Any] | Sequence[Any] | None) -> Sequence[Any]:
        if isinstance(params, (str, bytes)):
            raise TypeError("query parameters must be a sequence or a mapping, not a string")
        if self.names is None:
            if params is None:
                params = ()
            if isinstance(params, Mapping) or len(params) != len(self.formats):
                raise psycopg.ProgrammingError(
                    f"the query takes {len(self.formats)} positional parameters,"
                    f" {'a mapping' if isinstance(params, Mapping) else len(params)} given"
                )
            return params
        if not isinstance(params, Mapping):
            raise psycopg.ProgrammingError("the query takes named parameters: give a mapping")
        try:
            return [params[n] for n in self.names]
        except KeyError as exc:
            raise psycopg.ProgrammingError(f"query parameter missing: {exc.args[0]}") from None


@functools.lru_cache(maxsize=4096)
def compile_query(query: str) -> Query:
    """``query`` with psycopg's placeholders turned into libpq's (the same rules:
    positional and named ones are not mixed, ``%%`` is one ``%``, a repeated name is one
    parameter, any other ``%x`` is an error)."""
    out: list[str] = []
    names: dict[str, int] = {}
    formats: list[PyFormat] = []
    positional = named = False
    cur = 0
    for m in _PLACEHOLDER.finditer(query):
        out.append(query[cur : m.start()])
        cur = m.end()
        name, kind = m.group(1), m.group(2)
        if name is None and kind == "%":
            out.append("%")
            continue
        if kind not in _FORMATS:
            raise psycopg.ProgrammingError(
                f"only '%s', '%b', '%t' are allowed as placeholders, got {m.group(0)!r}"
            )
        if name is None:
            positional = True
            formats.append(_FORMATS[kind])
            out.append(f"${len(formats)}")
        else:
            named = True
            if name not in names:
                formats.append(_FORMATS[kind])
                names[name] = len(formats)
            out.append(f"${names[name]}")
        if positional and named:
            raise psycopg.ProgrammingError("positional and named placeholders cannot be mixed")
    if "%" in query[cur:]:
        raise psycopg.ProgrammingError("incomplete placeholder: a '%' at the end of the query")
    out.append(query[cur:])
    return Query("".join(out).encode(), tuple(names) if named else None, tuple(formats))


@functools.lru_cache(maxsize=1024)
def _verbatim(query: str) -> Query:
    return Query(query.encode(), None, ())


def query(text: str, params: object) -> Query:
    """``text`` as libpq takes it with ``params``: as psycopg does, a statement sent
    without parameters (None) is sent as it is written, ``%`` and all."""
    return _verbatim(text) if params is None else compile_query(text)


class Slot:
    """The answer of one statement sent: there once its flight's sync was read."""

    __slots__ = ("_pipe", "aborted", "failed", "keep", "key", "loaded", "result")

    def __init__(self, pipe: Pipe, key: _Key | None) -> None:
        self._pipe = pipe
        self.key = key  # its prepared statement's, if it ran one
        self.result: pq.abc.PGresult | None = None
        self.aborted = False  # skipped: an earlier statement of its flight failed
        self.failed = False  # its own error (the one raised by the flight's sync)
        # rows loaded as they arrive, for an answer read after its connection went
        # back to the pool (a loader may need the connection: a timestamptz's zone)
        self.keep = False
        self.loaded: list[dict[str, Any]] | None = None

    @property
    def answered(self) -> bool:
        return self.result is not None or self.aborted

    @property
    def has_rows(self) -> bool:
        return self.result is not None and self.result.nfields > 0

    @property
    def rowcount(self) -> int:
        r = self.result
        if r is None:
            return -1
        if r.status == _TUPLES_OK:
            return r.ntuples
        n = r.command_tuples
        return -1 if n is None else n

    def rows(self) -> list[dict[str, Any]]:
        """Its rows as dicts (column name → value, loaded by the connection's
        adapters); none for a statement that returns none."""
        if self.loaded is not None:
            return self.loaded
        r = self.result
        if r is None or r.status != _TUPLES_OK:
            if self.aborted or self.failed:
                raise psycopg.errors.PipelineAborted("the statement did not run")
            return []
        return self._pipe.load(r)


_Key = tuple[bytes, tuple[int, ...]]  # a statement's text and its parameters' types


class _Prepare:
    """A statement's preparation, sent before its first execution."""

    __slots__ = ("key",)

    def __init__(self, key: _Key) -> None:
        self.key = key


class _Prepared:
    """A connection's prepared statements: (query text, parameter types) → name."""

    __slots__ = ("made", "names")

    def __init__(self) -> None:
        self.names: dict[_Key, bytes] = {}
        self.made = 0  # names given so far (a name is never given twice)


_PREPARED: weakref.WeakKeyDictionary[Any, _Prepared] = weakref.WeakKeyDictionary()


def prepared(conn: psycopg.AsyncConnection[Any]) -> set[bytes]:
    """The query texts prepared on ``conn`` (as libpq takes them)."""
    found = _PREPARED.get(conn)
    return set() if found is None else {text for text, _ in found.names}


class Pipe:
    """One connection in libpq's pipeline mode for the length of a unit of work.

    :meth:`send` and :meth:`control` write a statement into libpq's buffer and return
    its :class:`Slot`; :meth:`sync` sends everything written and reads every answer up
    to it (one round trip), raising the first error among them. :meth:`close` leaves
    pipeline mode; it refuses while answers are unread (:meth:`drain` reads them,
    errors or not)."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.connection = conn
        self._pg = conn.pgconn
        self._tx = Transformer(conn)
        self._encoding = conn.info.encoding
        self._pending: deque[Slot | _Prepare] = deque()
        self._statements = 0  # statements (not commands) written since the last sync
        self._unsynced = False  # something was written since the last sync was
        self._syncs = 0  # syncs sent whose answer was not read yet
        self._error: psycopg.Error | None = None  # the first error read, not raised yet
        self._prepared = _PREPARED.setdefault(conn, _Prepared())
        self._pg.enter_pipeline_mode()
        self.open = True

    @property
    def unanswered(self) -> bool:
        """Statements were written whose answers were not read (a command written by
        :meth:`control` alone does not count: it leaves with what follows), or a round
        trip was cut short."""
        return self._statements > 0 or self._syncs > 0

    @property
    def waiting(self) -> bool:
        """Anything was sent, or written, whose answer was not read."""
        return bool(self._pending) or self._syncs > 0

    def send(self, query: Query, params: Mapping[str, Any] | Sequence[Any] | None) -> Slot:
        values = query.values(params)
        tx = self._tx
        dumped = tx.dump_sequence(values, query.formats) if values else ()
        types: tuple[int, ...] = tuple(tx.types or ()) if values else ()
        formats = list(tx.formats or ()) if values else None
        key = (query.text, types)
        pg = self._pg
        prepared = self._prepared
        name = prepared.names.get(key)
        if name is None and len(prepared.names) < PREPARED_MAX:
            name = b"custody_%d" % prepared.made
            prepared.made += 1
            prepared.names[key] = name
            pg.send_prepare(name, query.text, param_types=types or None)
            self._pending.append(_Prepare(key))
        if name is None:
            pg.send_query_params(
                query.text, dumped or None, param_types=types or None, param_formats=formats
            )
        else:
            pg.send_query_prepared(name, dumped or None, param_formats=formats)
        slot = Slot(self, None if name is None else key)
        self._pending.append(slot)
        self._statements += 1
        self._unsynced = True
        return slot

    def control(self, command: bytes) -> Slot:
        """A command without parameters, never prepared (BEGIN, COMMIT, SAVEPOINT …)."""
        self._pg.send_query_params(command, None)
        slot = Slot(self, None)
        self._pending.append(slot)
        self._unsynced = True
        return slot

    async def sync(self) -> None:
        """Send what was written and read every answer up to here; the first error among
        them is raised (the statements after it were skipped, and are marked so)."""
        if not self.waiting:
            return
        error = await self._round_trip()
        if error is not None:
            raise error

    async def drain(self) -> None:
        """:meth:`sync`, its errors not raised (they were raised already, or do not
        matter now: the transaction is being rolled back)."""
        if self.waiting:
            await self._round_trip()

    def close(self) -> None:
        """Leave pipeline mode (every answer read)."""
        if self.open:
            self.open = False
            self._pg.exit_pipeline_mode()

    def load(self, r: pq.abc.PGresult) -> list[dict[str, Any]]:
        tx = self._tx
        tx.set_pgresult(r)
        names = tuple((r.fname(i) or b"").decode(self._encoding) for i in range(r.nfields))
        return tx.load_rows(0, r.ntuples, lambda values: dict(zip(names, values, strict=True)))

    async def _round_trip(self) -> psycopg.Error | None:
        """Sync what was written (unless a sync already follows it: a round trip cut
        short, by a cancellation, is finished first) and read up to the last sync."""
        pg = self._pg
        if self._unsynced:
            pg.pipeline_sync()
            self._syncs += 1
            self._unsynced = False
        while pg.flush():
            await self._ready(write=True)
            pg.consume_input()
        pending = self._pending
        while True:
            pg.consume_input()
            ended = False  # the last result read ended a statement's results
            while not pg.is_busy():
                r = pg.get_result()
                if r is None:
                    if ended:  # nothing left in libpq's queue, and the sync not read
                        raise psycopg.InterfaceError("a pipeline's sync went missing")
                    ended = True
                    continue
                ended = False
                status = r.status
                if status == _SYNC:
                    self._syncs -= 1
                    if self._syncs == 0:
                        self._statements = 0
                        error, self._error = self._error, None
                        return error
                    continue
                item = pending.popleft()
                if isinstance(item, _Prepare):
                    if status != _COMMAND_OK:
                        self._prepared.names.pop(item.key, None)
                        if status == _FATAL:
                            self._failed(r)
                    continue
                if status == _FATAL:
                    item.failed = True
                    self._failed(r, item.key)
                elif status == _ABORTED:
                    item.aborted = True
                else:
                    item.result = r
                    if item.keep and status == _TUPLES_OK:
                        item.loaded = self.load(r)
            await self._ready(write=False)

    def _failed(self, r: pq.abc.PGresult, key: _Key | None = None) -> None:
        """A statement's error: kept to be raised (the first of its flight). A prepared
        statement the server no longer has (someone said DEALLOCATE or DISCARD), or whose
        plan cannot serve it any more (a table it reads changed its columns), is
        prepared again at its next use."""
        error = pg_errors.error_from_result(r, encoding=self._encoding)
        if self._error is None:
            self._error = error
        if key is not None:
            if error.sqlstate == _NO_SUCH_STATEMENT:
                self._prepared.names.clear()
            elif error.sqlstate == _PLAN_CHANGED:
                self._prepared.names.pop(key, None)

    async def _ready(self, *, write: bool) -> None:
        """Wait until the socket can be read (or, with ``write``, written)."""
        loop = asyncio.get_running_loop()
        fd = self._pg.socket
        done = loop.create_future()

        def wake() -> None:
            if not done.done():
                done.set_result(None)

        loop.add_reader(fd, wake)
        if write:
            loop.add_writer(fd, wake)
        try:
            await done
        finally:
            loop.remove_reader(fd)
            if write:
                loop.remove_writer(fd)
