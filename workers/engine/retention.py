"""The engine's retention cleanup: receipt inbox, published outbox and quarantine rows
older than the horizon (``workers.core.horizon``), then the finished instances past the
archive horizon, moved to ``custody_archive`` with their operations and history. In
batches, one transaction each.

The archival runs last: an instance is due only once no receipt-inbox or outbox row of
its operations is left, and those are the rows the first passes remove."""

from __future__ import annotations

from workers.io import db

BATCH = 1000
# instances per archival transaction (each brings its operations, attempts, node
# states, successor intents and history along: some tens of rows apiece)
ARCHIVE_BATCH = 200
# (table as reported, its named query); every query is under an EXPLAIN guard
# (tests/integration/test_query_plans.py)
DELETES = (
    ("receipt_inbox", "retention_receipts"),
    ("outbox", "retention_outbox"),
    ("outbox", "retention_outbox_retired"),
    ("quarantine", "retention_quarantine"),
)
ARCHIVE = "retention_archive"


async def cleanup(
    database: db.Database, horizon_s: float, lease: db.Lease | None = None, *, archive_s: float
) -> dict[str, int]:
    removed = {table: 0 for table, _ in DELETES}
    for table, query in DELETES:
        while True:
            async with database.transaction(lease) as tx:
                n = await tx.run(query, {"horizon": horizon_s, "limit": BATCH})
            removed[table] += n
            if n < BATCH:
                break
    removed["archived_instances"] = await archive(database, archive_s, lease)
    return removed


async def archive(database: db.Database, after_s: float, lease: db.Lease | None = None) -> int:
    """Move the instances finished more than ``after_s`` ago (and everything of theirs)
    to the archive, :data:`ARCHIVE_BATCH` per transaction; the number moved."""
    moved = 0
    while True:
        async with database.transaction(lease) as tx:
            row = await tx.one(ARCHIVE, {"horizon": after_s, "limit": ARCHIVE_BATCH})
        n = int(row["n"]) if row else 0
        moved += n
        if n < ARCHIVE_BATCH:
            return moved
