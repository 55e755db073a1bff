"""Databases and vhosts a run owns beyond what ``workers.harness.env`` provides:
dropping a database, a fresh vhost, a one-off query, and the lock that keeps two bench
runs on the same services from running at once."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, LiteralString

import psycopg

from workers.harness import env
from workers.io import broker
from workers.settings import Settings

# a Postgres advisory lock key (int8): "custbnch"
BENCH_LOCK = int.from_bytes(b"custbnch", "big", signed=True)


@contextlib.asynccontextmanager
async def exclusive(settings: Settings) -> AsyncIterator[None]:
    """One bench run at a time against this Postgres: two would drop and recreate each
    other's databases and vhosts (they have fixed names), and share the cores. A second
    run waits (a session advisory lock, released when this connection closes)."""
    admin = env.with_db(settings.database_url, "postgres")
    async with await psycopg.AsyncConnection.connect(
        admin, autocommit=True, application_name="bench-lock"
    ) as conn:
        row = await (
            await conn.execute("SELECT pg_try_advisory_lock(%s)", (BENCH_LOCK,))
        ).fetchone()
        if row is None or not row[0]:
            print(
                "another bench run is using these services (it holds the bench lock):"
                " waiting for it to finish",
                flush=True,
            )
            await conn.execute("SELECT pg_advisory_lock(%s)", (BENCH_LOCK,))
        yield


async def drop_database(url: str) -> None:
    admin = psycopg.conninfo.make_conninfo(url, dbname="postgres")
    name = str(psycopg.conninfo.conninfo_to_dict(url)["dbname"])
    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
        await conn.execute(
            psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                psycopg.sql.Identifier(name)
            )
        )


async def fresh_vhost(settings: Settings, vhost: str) -> None:
    await broker.delete_vhost(settings.amqp_management_url, vhost)
    await broker.ensure_vhost(
        settings.amqp_management_url, vhost, [broker.user_of(settings.amqp_url)]
    )


async def query(url: str, statement: LiteralString, params: Sequence[Any] = ()) -> list[Any]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return list(await (await conn.execute(statement, params)).fetchall())
