"""The restore runbook (DESIGN §7) as operator commands, never hand edits of rows.

1. Before restoring, hold effect dispatch in a way the restore cannot undo: start the
   publishers with ``CUSTODY_DISPATCH_PAUSED=true`` (and ``custody dispatch pause``).
2. Restore the database; then ``custody restore mark-restored``: the database's own
   pause flag is set again and the restore generation is bumped.
3. ``custody restore reconcile``: every operation the restored state does not know
   the outcome of goes to outcome_unknown ("a restored engine can predate an effect
   that already committed elsewhere") and is queried at its pinned executor through
   the normal query path; answers pass the same validation as any receipt.
4. ``custody restore report``: participant journals against engine rows — work the
   restored engine does not know about, and what is still unresolved.
5. ``custody restore resume``: refused while queries are unanswered (unless
   ``--force``); clears the database flag. Then restart the publishers without the
   start-up switch.

Re-created transitions get the same deterministic command identities, so the
participants deduplicate whatever the lost future had already executed.
"""

from __future__ import annotations

from typing import Any

from workers import adapter, db, lifecycle, operator
from workers.operator import Outcome, Result, _Refused

BATCH = 200
# after `restore reconcile`, what still waits for an answer from its pinned executor
UNANSWERED = ("reconcile_pending", "cancelling")


class Restore:
    def __init__(self, ops: operator.Operator) -> None:
        self.ops = ops

    async def mark_restored(self, actor: str, reason: str) -> Outcome:
        async def body(tx: db.Tx) -> tuple[str, None, dict[str, Any]]:
            self.ops._authorize(actor, "restore", None, reason)
            row = await tx.one("control_mark_restored")
            assert row is not None
            generation = int(row["restore_generation"])
            return (
                f"dispatch paused; restore generation is now {generation}",
                None,
                {"dispatch_paused": True, "restore_generation": generation},
            )

        return await self.ops._run(actor, "restore", "mark-restored", reason, {}, body)

    async def reconcile(self, actor: str, reason: str) -> Outcome:
        """Query the pinned executor of every unsettled operation, in batches."""
        done: list[str] = []
        total = 0
        while True:
            batch: list[str] = []

            async def body(tx: db.Tx, batch: list[str] = batch) -> tuple[str, None, dict[str, Any]]:
                self.ops._authorize(actor, "restore", None, reason)
                batch.clear()  # a redo of this batch starts afresh
                rows = await tx.rows("restore_candidates", {"done": done, "limit": BATCH})
                for row in rows:
                    await _query(tx, row, actor, reason)
                    batch.append(str(row["id"]))
                return (f"{len(rows)} operation(s) queried", None, {"queried": len(rows)})

            outcome = await self.ops._run(actor, "restore", "reconcile", reason, {}, body)
            if outcome.result is not Result.DONE:
                return outcome
            done.extend(batch)
            total += len(batch)
            if len(batch) < BATCH:
                break
        return Outcome(
            Result.DONE,
            f"{total} unsettled operation(s) queried at their pinned "
            "executors; answers are applied by the receipt consumer",
            {"queried": total},
        )

    async def resume(self, actor: str, reason: str, force: bool) -> Outcome:
        async def body(tx: db.Tx) -> tuple[str, None, dict[str, Any]]:
            self.ops._authorize(actor, "resume", None, reason)
            waiting = await tx.one("operations_count_by_status", {"statuses": list(UNANSWERED)})
            pending = int(waiting["n"]) if waiting else 0
            if pending and not force:
                raise _Refused(
                    Result.REFUSED,
                    f"{pending} operation(s) still wait for their executor's answer "
                    "(reconcile_pending or cancelling); wait, or --force",
                )
            await tx.run("control_set_paused", {"paused": False})
            return (
                "effect dispatch resumed in the database; restart publishers without "
                "CUSTODY_DISPATCH_PAUSED",
                None,
                {"dispatch_paused": False, "unanswered": pending},
            )

        return await self.ops._run(actor, "resume", "restore", reason, {"force": force}, body)


async def _query(tx: db.Tx, row: dict[str, Any], actor: str, reason: str) -> None:
    status = lifecycle.Status(row["status"])
    if status in (lifecycle.Status.DISPATCHED, lifecycle.Status.ACCEPTED):
        unknown = lifecycle.next_status(status, lifecycle.Event.RESTORED)
        assert unknown is lifecycle.Status.OUTCOME_UNKNOWN
        await tx.run(
            "operation_set_status",
            {"id": row["id"], "expected": status.value, "status": unknown.value},
        )
        await tx.run("instance_suspend", {"id": row["instance_id"]})
        await tx.run(
            "history_insert",
            {
                "instance_id": row["instance_id"],
                "operation_id": row["id"],
                "event": "operation.outcome_unknown",
                "detail": db.jsonb({"from": status.value, "cause": "restore"}),
                "actor": actor,
            },
        )
        status = unknown
    if status in (lifecycle.Status.OUTCOME_UNKNOWN, lifecycle.Status.RECONCILE_PENDING):
        # a restored reconcile_pending gets a fresh deadline for the new question
        await tx.run("operation_reconcile", {"id": row["id"], "expected": status.value})
    # pending and cancelling stay as they are: only the question is asked
    event = (
        "operation.reconcile_pending"
        if status in (lifecycle.Status.OUTCOME_UNKNOWN, lifecycle.Status.RECONCILE_PENDING)
        else "operation.queried"
    )
    count = await tx.one(
        "queries_issued", {"id": row["id"], "attempt": row["attempt"], "kind": "query"}
    )
    rows = adapter.query(adapter.Pinned.from_row(row), sequence=int(count["n"]) + 1 if count else 1)
    await tx.run("attempt_insert", rows.attempt_row)
    await tx.run("outbox_insert", rows.outbox_row)
    await tx.run(
        "history_insert",
        {
            "instance_id": row["instance_id"],
            "operation_id": row["id"],
            "event": event,
            "detail": db.jsonb(
                {
                    "from": status.value,
                    "cause": "restore",
                    "reason": reason,
                    "query_request_id": rows.request_id,
                }
            ),
            "actor": actor,
        },
    )


async def report(engine: db.Database, journals: dict[str, db.Database]) -> dict[str, Any]:
    """Participant journals against engine rows, after a restore."""
    unknown: list[dict[str, Any]] = []
    for owner, participant_db in journals.items():
        async with participant_db.transaction() as tx:
            journal = await tx.rows("p_journal")
        async with engine.transaction() as tx:
            known: set[str] = set()
            ids = [r["request_id"] for r in journal]
            for i in range(0, len(ids), 1000):
                known |= {
                    r["request_id"]
                    for r in await tx.rows("attempts_known", {"ids": ids[i : i + 1000]})
                }
        unknown += [{"participant": owner, **r} for r in journal if r["request_id"] not in known]
    async with engine.transaction() as tx:
        counts = {r["status"]: r["n"] for r in await tx.rows("operations_by_status")}
    return {
        "unknown_to_engine": unknown,
        "effects_unknown_to_engine": sum(1 for r in unknown if r["effect"] == "applied"),
        "operations_by_status": counts,
        "needs_operator": counts.get("outcome_unknown", 0),
        "unanswered": sum(counts.get(s, 0) for s in UNANSWERED),
        "cancelling": counts.get("cancelling", 0),
    }
