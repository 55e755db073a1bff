"""The restore runbook (DESIGN §7) as operator commands, never hand edits of rows.

1. Before restoring, hold effect dispatch in a way the restore cannot undo: start the
   engine's senders of submits, the publishers, the committers and the receipt
   consumers, with ``CUSTODY_DISPATCH_PAUSED=true`` (and ``custody dispatch pause``).
2. Restore the database; then ``custody restore mark-restored``: the database's own
   pause flag is set again and the restore generation is bumped.
3. ``custody restore reconcile``: every operation the restored state does not know
   the outcome of goes to outcome_unknown ("a restored engine can predate an effect
   that already committed elsewhere") and is queried at its pinned executor through
   the normal query path; answers pass the same validation as any receipt.
4. ``custody restore report``: participant journals against engine rows — work the
   restored engine does not know about, and what is still unresolved.
5. ``custody restore resume``: refused while queries are unanswered (unless
   ``--force``); clears the database flag. Then restart the publishers, the
   committers and the receipt consumers without the start-up switch.

Re-created transitions get the same deterministic command identities, so the
participants deduplicate whatever the lost future had already executed.
"""

from __future__ import annotations

from typing import Any

from workers.engine import transitions
from workers.engine.transitions import Outcome, Result
from workers.io import db

BATCH = 200
# after `restore reconcile`, what still waits for an answer from its pinned executor
UNANSWERED = ("reconcile_pending", "cancelling")


class Restore:
    """The runbook's steps, each a controlled command in the database
    (``transitions.sql``: ``restore_mark``, ``restore_reconcile``, ``restore_resume``)."""

    def __init__(self, ops: transitions.Operator) -> None:
        self.ops = ops

    async def mark_restored(self, actor: str | None, reason: str) -> Outcome:
        return await self.ops.call("restore_mark", actor, {"reason": reason})

    async def reconcile(self, actor: str | None, reason: str) -> Outcome:
        """Query the pinned executor of every unsettled operation, in batches."""
        done: list[str] = []
        while True:
            outcome = await self.ops.call(
                "restore_reconcile", actor, {"reason": reason, "done": done, "limit": BATCH}
            )
            if outcome.result is not Result.DONE:
                return outcome
            batch = [str(i) for i in outcome.data.get("ids", [])]
            done.extend(batch)
            if len(batch) < BATCH:
                break
        return Outcome(
            Result.DONE,
            f"{len(done)} unsettled operation(s) queried at their pinned "
            "executors; answers are applied by the receipt consumer",
            {"queried": len(done)},
        )

    async def resume(self, actor: str | None, reason: str, force: bool) -> Outcome:
        return await self.ops.call("restore_resume", actor, {"reason": reason, "force": force})


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
