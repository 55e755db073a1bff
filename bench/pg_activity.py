"""What Postgres is doing: ``pg_stat_activity`` sampled during a window, each active
statement named by its ``queries.sql`` name."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from workers.io import sql


def _normalise(text: str) -> str:
    """A statement without comments, placeholders or repeated whitespace."""
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith("--")]
    flat = " ".join(" ".join(lines).split())
    return re.sub(r"%\(\w+\)s|%s|\$\d+", "", flat.replace("%%", "%"))


def _statement_names() -> list[tuple[str, str]]:
    """(normalised text, name) of every named query (queries.sql and the participants')."""
    return [(_normalise(text)[:200], name) for name, text in sql.queries().items()]


def statement_name(query: str, names: Sequence[tuple[str, str]]) -> str:
    """The queries.sql name of a statement, or its first words."""
    flat = _normalise(query)
    for text, name in names:
        n = min(len(text), len(flat))
        if n >= 20 and flat[:n] == text[:n]:
            return name
    return " ".join(query.split())[:60] or "?"


@dataclass
class PgActivity:
    """Samples of pg_stat_activity: which client's backend ran what, or waited on what."""

    ticks: int = 0
    counts: dict[tuple[str, str, str], int] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(self.counts.values())


class ActivitySampler:
    """Every ``interval_s``, the non-idle backends of this run's databases."""

    def __init__(self, admin_url: str, databases: Sequence[str], interval_s: float = 0.05) -> None:
        self.admin_url = admin_url
        self.databases = list(databases)
        self.interval_s = interval_s
        self.result = PgActivity()
        self._names = _statement_names()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ActivitySampler:
        conn = await psycopg.AsyncConnection.connect(
            self.admin_url, autocommit=True, application_name="bench-activity"
        )
        self._task = asyncio.ensure_future(self._run(conn))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
        try:
            while True:
                rows = await (
                    await conn.execute(
                        "SELECT coalesce(nullif(application_name, ''), backend_type), state,"
                        " wait_event_type, wait_event, query FROM pg_stat_activity"
                        " WHERE datname = ANY(%s) AND pid <> pg_backend_pid()"
                        " AND state IS NOT NULL AND state <> 'idle'",
                        (self.databases,),
                    )
                ).fetchall()
                self.result.ticks += 1
                for client, state, wait_type, wait_event, query in rows:
                    if state == "active":
                        what = statement_name(str(query or ""), self._names)
                        wait = f"{wait_type}:{wait_event}" if wait_type else "CPU"
                    else:
                        what, wait = f"({state})", "client"
                    key = (str(client), what, wait)
                    self.result.counts[key] = self.result.counts.get(key, 0) + 1
                await asyncio.sleep(self.interval_s)
        finally:
            await conn.close()
