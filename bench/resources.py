"""Databases and vhosts a run owns beyond what ``workers.harness.env`` provides:
dropping a database, a fresh vhost, and a one-off query."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, LiteralString

import psycopg

from workers.io import broker
from workers.settings import Settings


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
