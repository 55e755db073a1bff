"""A participant's retention cleanup: inbox and published outbox rows older than the
horizon (``workers.core.horizon``), in batches."""

from __future__ import annotations

from workers.io import db

BATCH = 1000


async def cleanup(database: db.Database, horizon_s: float) -> dict[str, int]:
    removed = {"inbox": 0, "outbox": 0}
    for table, query in (("inbox", "p_retention_inbox"), ("outbox", "p_retention_outbox")):
        while True:
            async with database.transaction() as tx:
                n = await tx.run(query, {"horizon": horizon_s, "limit": BATCH})
            removed[table] += n
            if n < BATCH:
                break
    return removed
