"""Versioned migrations of the engine schema: ordered SQL files, applied once each and
recorded in ``custody.schema_migrations``, then the repeatable definitions re-applied.

One session holds ``pg_advisory_lock`` for the whole run (the server releases it if the
migrator dies, so a killed Job never leaves a stale lock); the set of applied migrations
is read only after the lock is held, so a second migrator waits and then finds nothing
to do. Each migration runs in its own transaction together with the row that records
it: it is applied and recorded, or neither. Why not yoyo-migrations: the README's
"Schema migrations".
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psycopg

from workers import errors

LOCK = "SELECT pg_advisory_lock(hashtext('custody.migrate'))"
UNLOCK = "SELECT pg_advisory_unlock(hashtext('custody.migrate'))"
BASELINE = "0001_baseline"
_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")

_TABLE = """
CREATE SCHEMA IF NOT EXISTS custody;
CREATE TABLE IF NOT EXISTS custody.schema_migrations (
  id         text PRIMARY KEY,
  checksum   text NOT NULL,
  applied_at timestamptz NOT NULL DEFAULT now(),
  adopted    boolean NOT NULL DEFAULT false
);
REVOKE ALL ON custody.schema_migrations FROM PUBLIC;
"""
# a database made before versioned migrations: schema.sql's first and last objects
_BASELINE_PRESENT = """
SELECT to_regclass('custody.control') IS NOT NULL
   AND to_regclass('custody_archive.successor_intents') IS NOT NULL
"""
_APPLIED = "SELECT id, checksum, applied_at FROM custody.schema_migrations"


@dataclass(frozen=True)
class Migration:
    id: str  # the file's name without .sql: "0001_baseline"
    path: Path
    checksum: str  # sha256 of the file's text

    @classmethod
    def from_file(cls, path: Path) -> Migration:
        return cls(path.stem, path, hashlib.sha256(path.read_bytes()).hexdigest())


@dataclass(frozen=True)
class MigrationState:
    """One migration as ``custody db status`` shows it. ``modified``: applied, but its
    file has changed since (an applied migration is history: add a new one instead)."""

    id: str
    state: Literal["applied", "pending", "modified"]
    applied_at: datetime.datetime | None

    def as_dict(self) -> dict[str, str | None]:
        at = self.applied_at.isoformat() if self.applied_at else None
        return {"id": self.id, "state": self.state, "applied_at": at}


def discover(directory: Path) -> list[Migration]:
    """The migrations of ``directory`` in order; a misnamed file or a number used twice is
    a configuration error, not a migration silently skipped."""
    found: dict[str, Path] = {}
    for path in sorted(directory.glob("*.sql")):
        match = _FILE.match(path.name)
        if match is None:
            raise errors.ConfigError(f"{path}: a migration is named NNNN_name.sql")
        if match.group(1) in found:
            raise errors.ConfigError(f"{path}: number {match.group(1)} is used twice")
        found[match.group(1)] = path
    if not found:
        raise errors.ConfigError(f"no migrations in {directory}")
    return [Migration.from_file(p) for p in found.values()]


def states(
    migrations: Sequence[Migration], applied: dict[str, tuple[str, Any]]
) -> list[MigrationState]:
    out = []
    for m in migrations:
        if m.id not in applied:
            out.append(MigrationState(m.id, "pending", None))
        else:
            checksum, at = applied[m.id]
            out.append(
                MigrationState(m.id, "applied" if checksum == m.checksum else "modified", at)
            )
    return out


async def _applied_table(conn: psycopg.AsyncConnection[Any]) -> bool:
    cur = await conn.execute("SELECT to_regclass('custody.schema_migrations') IS NOT NULL")
    row = await cur.fetchone()
    return row is not None and bool(row[0])


async def _applied(conn: psycopg.AsyncConnection[Any]) -> dict[str, tuple[str, Any]]:
    if not await _applied_table(conn):
        return {}
    cur = await conn.execute(_APPLIED)
    return {r[0]: (r[1], r[2]) for r in await cur.fetchall()}


async def status(url: str, directory: Path) -> list[MigrationState]:
    """Each migration, applied or pending; reads only (a database made before versioned
    migrations shows its baseline pending until ``custody db migrate`` adopts it)."""
    migrations = await asyncio.to_thread(discover, directory)
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            return states(migrations, await _applied(conn))
    except psycopg.Error as exc:
        raise errors.DatabaseError(
            f"cannot read the migrations: {_line(exc)}", errors.Retry.BROKEN
        ) from exc


async def migrate(
    url: str, directory: Path, repeatable: Sequence[Path]
) -> tuple[list[str], list[str]]:
    """Apply the pending migrations of ``directory``, then re-apply ``repeatable`` (views,
    functions, grants: ``CREATE OR REPLACE``), all under one advisory lock. Returns the
    ids applied and the ids adopted (recorded without running)."""
    migrations = await asyncio.to_thread(discover, directory)
    scripts = [(p.name, await asyncio.to_thread(p.read_text)) for p in repeatable]
    applied_now: list[str] = []
    adopted: list[str] = []
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(LOCK)
            try:
                async with conn.transaction():
                    await conn.execute("SET LOCAL client_min_messages = warning")
                    # adoption: a schema.sql database (no record yet) has its baseline
                    first = not await _applied_table(conn)
                    cur = await conn.execute(_BASELINE_PRESENT)
                    row = await cur.fetchone()
                    present = first and row is not None and bool(row[0])
                    await conn.execute(_TABLE)
                    if present and migrations[0].id == BASELINE:
                        await _record(conn, migrations[0], adopted=True)
                        adopted.append(BASELINE)
                done = await _applied(conn)
                # refused before anything runs: an edited history is not a pending change
                for m in migrations:
                    if m.id in done and done[m.id][0] != m.checksum:
                        raise errors.ConfigError(
                            f"migration {m.id} was changed after it was applied "
                            "(an applied migration is history: add a new one instead)"
                        )
                for m in migrations:
                    if m.id not in done:
                        await _apply(conn, m)
                        applied_now.append(m.id)
                for name, text in scripts:
                    try:
                        async with conn.transaction():
                            await conn.execute("SET LOCAL client_min_messages = warning")
                            await conn.execute(text.encode())
                    except psycopg.Error as exc:
                        raise errors.DatabaseError(
                            f"{name} failed and was rolled back: {_line(exc)}",
                            errors.Retry.BROKEN,
                        ) from exc
            finally:
                if not conn.closed:
                    await conn.execute(UNLOCK)
    except psycopg.Error as exc:
        raise errors.DatabaseError(f"migrate: {_line(exc)}", errors.Retry.BROKEN) from exc
    return applied_now, adopted


async def _apply(conn: psycopg.AsyncConnection[Any], m: Migration) -> None:
    text = await asyncio.to_thread(m.path.read_bytes)
    try:
        async with conn.transaction():
            await conn.execute("SET LOCAL client_min_messages = warning")
            await conn.execute(text)
            await _record(conn, m, adopted=False)
    except psycopg.Error as exc:
        raise errors.DatabaseError(
            f"migration {m.id} failed and was rolled back (nothing recorded): {_line(exc)}",
            errors.Retry.BROKEN,
        ) from exc


async def _record(conn: psycopg.AsyncConnection[Any], m: Migration, *, adopted: bool) -> None:
    await conn.execute(
        "INSERT INTO custody.schema_migrations (id, checksum, adopted) VALUES (%s, %s, %s)",
        (m.id, m.checksum, adopted),
    )


def _line(exc: psycopg.Error) -> str:
    """Postgres's message (its first line), with the sqlstate."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    text = text.rsplit("failed: ", 1)[-1].strip()  # libpq's "connection to ... failed:"
    state = getattr(exc, "sqlstate", None)
    return f"{text} (sqlstate {state})" if state else text
