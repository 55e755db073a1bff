"""A participant's retention cleanup: inbox and published outbox rows older than the
horizon (``workers.core.horizon``), in batches."""

from __future__ import annotations

from workers.io import db

BATCH = 1000
# (table as reported, its named query); each under an EXPLAIN guard
# (tests/integration/test_query_plans.py). The outbox's is the engine's query: the same
# table in the participant's schema.
DELETES = (("inbox", "p_retention_inbox"), ("outbox", "retention_outbox"))


async def cleanup(database: db.Database, horizon_s: float) -> dict[str, int]:
    removed = {table: 0 for table, _ in DELETES}
    for table, query in DELETES:
        while True:
            async with database.transaction() as tx:
                n = await tx.run(query, {"horizon": horizon_s, "limit": BATCH})
            removed[table] += n
            if n < BATCH:
                break
    return removed
