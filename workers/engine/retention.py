"""The engine's retention cleanup: receipt inbox, published outbox and quarantine rows
older than the horizon (``workers.core.horizon``), in batches."""

from __future__ import annotations

from workers.io import db

BATCH = 1000


async def cleanup(
    database: db.Database, horizon_s: float, lease: db.Lease | None = None
) -> dict[str, int]:
    removed = {"receipt_inbox": 0, "outbox": 0, "quarantine": 0}
    for table, query in (
        ("receipt_inbox", "retention_receipts"),
        ("outbox", "retention_outbox"),
        ("quarantine", "retention_quarantine"),
    ):
        while True:
            async with database.transaction(lease) as tx:
                n = await tx.run(query, {"horizon": horizon_s, "limit": BATCH})
            removed[table] += n
            if n < BATCH:
                break
    return removed
