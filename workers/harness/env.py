"""What the harnesses share (the demo, the bench, the tests): connection strings for a
database or a vhost of their own, a fresh database, and the counts a run is judged by."""

from __future__ import annotations

from typing import Any

from participants import samples
from workers.core import amqp_url
from workers.io import db


def with_db(url: str, name: str) -> str:
    return db.with_dbname(url, name)


def with_vhost(url: str, vhost: str, user: str | None = None, password: str | None = None) -> str:
    """The same broker URL (one node or several) for another vhost, and optionally as
    another user (the URL's own, or guest, otherwise)."""
    parsed = amqp_url.parse(url)
    parsed = parsed.with_user(user or parsed.user, password or parsed.password)
    return str(parsed.with_vhost(vhost))


async def reset_database(url: str) -> None:
    await db.recreate_database(url)


async def counts(engine_url: str, part_url: str) -> dict[str, Any]:
    """Instances and operations by status, what is pending or quarantined, and every
    participant effect with its duplicates (an effect applied twice for one operation)."""
    engine = db.Database(engine_url, schema="custody", name="harness", min_size=1, max_size=1)
    await engine.open()
    try:
        async with engine.transaction() as tx:
            inst = {r["status"]: r["n"] for r in await tx.rows("instances_by_status")}
            ops = {r["status"]: r["n"] for r in await tx.rows("operations_by_status")}
            pending = (await tx.one("harness_outbox_pending") or {"n": 0})["n"]
            quarantined = (await tx.one("harness_quarantined") or {"n": 0})["n"]
            succeeded = {
                r["operation"]: r["n"] for r in await tx.rows("harness_succeeded_by_operation")
            }
    finally:
        await engine.close()
    found = await db.effect_counts(
        part_url,
        [(f"participant_{owner}", t) for owner, ts in samples.EFFECT_TABLES.items() for t in ts],
    )
    return {
        "instances": inst,
        "operations": ops,
        "outbox_pending": pending,
        "quarantined": quarantined,
        "effects": {k.removeprefix("participant_"): rows for k, (rows, _) in found.items()},
        "duplicates": sum(dup for _, dup in found.values()),
        "succeeded_by_operation": succeeded,
    }
