"""The reconciler: owner of timeouts and recovery transitions.

Here it owns deadlines: an operation whose deadline passed without a terminal
receipt becomes ``outcome_unknown`` and its instance is suspended (no further
command is dispatched for it). A timeout never creates a new operation or attempt,
and the reconciler never performs an effect itself: recovery goes back through the
same transition path (outbox, receipts) as ordinary work.
"""

from __future__ import annotations

import time
from typing import Any

from workers import errors
from workers.core import horizon, lifecycle, records
from workers.engine import context, retention, transitions
from workers.io import db
from workers.runtime import faults, logs, metrics, otel, probes, supervisor
from workers.settings import Settings

ACTOR = "reconciler"
IE = lifecycle.InstanceEvent
CLEANUP_EVERY_S = 60.0


class Reconciler:
    def __init__(self, settings: Settings, database: db.Database, lease: db.Lease | None) -> None:
        self.settings = settings
        self.db = database
        self.lease = lease
        self.policy = transitions.Operator(database, lease)
        self._settled_at: float | None = None  # when the settled counts were last taken

    async def resend_cancels(self) -> int:
        """Cancels left unanswered past their deadline are asked again (the operation
        stays cancelling: silence is neither an answer nor a cancellation)."""
        async with (
            otel.claimed("cancels", ACTOR) as span,
            self.db.transaction(self.lease) as tx,
        ):
            row = await tx.one(
                "t_resend_cancels", {"actor": ACTOR, "limit": self.settings.batch_size}
            )
            if row and row["n"]:
                span.set(resent=int(row["n"]))
        return int(row["n"]) if row else 0

    async def sweep_queries(self) -> int:
        """Reconcile queries left unanswered past the deadline go back to
        outcome_unknown: silence is not an answer."""
        async with (
            otel.claimed("queries", ACTOR) as span,
            self.db.transaction(self.lease) as tx,
        ):
            rows = await tx.rows("queries_overdue", {"limit": self.settings.batch_size})
            for row in rows:
                target = lifecycle.next_status(
                    lifecycle.Status.RECONCILE_PENDING, lifecycle.Event.QUERY_TIMEOUT
                )
                assert isinstance(target, lifecycle.Status)
                if (
                    await tx.run(
                        "operation_set_status",
                        {"id": row["id"], "expected": row["status"], "status": target.value},
                    )
                    != 1
                ):
                    raise errors.RowChanged("an overdue operation changed under its row lock")
                await tx.run(
                    "history_insert",
                    records.History(
                        instance_id=row["instance_id"],
                        operation_id=row["id"],
                        event=f"operation.{target.value}",
                        detail={"from": row["status"], "cause": "query unanswered"},
                        actor=ACTOR,
                    ).params(db.jsonb),
                )
            if span.recording and rows:
                span.set(
                    operation_id=[r["id"] for r in rows],
                    instance_id=[r["instance_id"] for r in rows],
                )
        return len(rows)

    async def retry_due(self) -> int:
        """Automatic retries from a node's retry policy: the same path as retry-safe."""
        async with self.db.transaction(self.lease) as tx:
            due = await tx.rows("retries_due", {"limit": self.settings.batch_size})
        done = 0
        for row in due:
            outcome = await self.policy.retry_safe(
                transitions.POLICY, str(row["id"]), "the node's retry policy"
            )
            done += outcome.result is transitions.Result.DONE
        return done

    async def reconcile_due(self) -> int:
        """Optional policy: reconcile outcome_unknown operations with a doubling backoff."""
        if self.settings.auto_reconcile_s <= 0:
            return 0
        async with self.db.transaction(self.lease) as tx:
            due = await tx.rows(
                "unknown_due",
                {"base": self.settings.auto_reconcile_s, "limit": self.settings.batch_size},
            )
        for row in due:
            await self.policy.reconcile(
                transitions.POLICY, str(row["id"]), "automatic reconcile policy"
            )
        return len(due)

    async def sweep_deadlines(self) -> int:
        """Overdue operations to ``outcome_unknown``, up to a batch of each in-flight
        status, in one transaction."""
        async with (
            otel.claimed("deadlines", ACTOR) as span,
            self.db.transaction(self.lease) as tx,
        ):
            rows = await tx.rows("operations_overdue", {"limit": self.settings.batch_size})
            if rows:
                await faults.point("deadlines_claimed")
            updates: list[dict[str, Any]] = []
            history: list[records.History] = []
            for row in rows:
                status = lifecycle.Status(row["status"])
                target = lifecycle.next_status(status, lifecycle.Event.DEADLINE)
                assert isinstance(target, lifecycle.Status)
                updates.append({"id": row["id"], "expected": status.value, "status": target.value})
                history.append(
                    records.History(
                        instance_id=row["instance_id"],
                        operation_id=row["id"],
                        event=f"operation.{target.value}",
                        detail={"from": status.value, "cause": "deadline"},
                        actor=ACTOR,
                    )
                )
            changed = await tx.run_many("operation_set_status", updates)
            if changed != len(updates):
                raise errors.RowChanged("an overdue operation changed under its row lock")
            suspend = [records.InstanceChange(r["instance_id"], IE.SUSPEND) for r in rows]
            await tx.run_many(records.INSTANCE_QUERIES[IE.SUSPEND], [c.params() for c in suspend])
            await tx.run_many("history_insert", [h.params(db.jsonb) for h in history])
            if span.recording and rows:
                span.set(
                    operation_id=[r["id"] for r in rows],
                    instance_id=[r["instance_id"] for r in rows],
                )
        metrics.transitions("deadline", len(rows))
        return len(rows)

    async def sample(self) -> None:
        """The gauges: live operations on every poll (their partial index), settled ones
        at most every ``settled_sample_s`` (a count over the whole table); the successor
        backlog and the dispatch state (pauses, held submits) on every poll."""
        now = time.monotonic()
        settled = (
            self._settled_at is None or now - self._settled_at >= self.settings.settled_sample_s
        )
        async with self.db.transaction() as tx:
            rows = await tx.rows("operations_by_status" if settled else "operations_open_by_status")
            backlog = await tx.one("successor_intents_pending")
            dispatch = await tx.one("dispatch_stats")
        metrics.SUCCESSOR_PENDING.set(backlog["n"] if backlog else 0)
        if dispatch:
            metrics.dispatch(
                paused=bool(dispatch["paused"]),
                paused_instances=int(dispatch["paused_instances"]),
                held=int(dispatch["held"]),
            )
        counts = {r["status"]: r["n"] for r in rows}
        if settled:
            self._settled_at = now
        for status in lifecycle.Status:
            if settled or status not in lifecycle.TERMINAL:
                metrics.OPERATIONS.labels(status.value).set(counts.get(status.value, 0))


async def main(settings: Settings, stop: supervisor.Stop, health: probes.Health) -> None:
    async with context.running(settings, ACTOR, health) as ctx:
        rec = Reconciler(settings, ctx.db, ctx.lease)

        async def deadlines() -> None:
            while not stop.requested:
                n = 0
                for sweep in (
                    rec.sweep_deadlines,
                    rec.sweep_queries,
                    rec.resend_cancels,
                    rec.retry_due,
                    rec.reconcile_due,
                ):
                    n = max(
                        n,
                        await supervisor.redo(
                            sweep,
                            worker=ACTOR,
                            stop=stop,
                            on_fenced=ctx.reacquire,
                            name=f"reconciler.{sweep.__name__}",
                        ),
                    )
                await supervisor.redo(rec.sample, worker=ACTOR, stop=stop, on_fenced=ctx.reacquire)
                if n < settings.batch_size:
                    await stop.sleep(settings.poll_interval_s)

        async def cleanup() -> None:
            while not await stop.sleep(CLEANUP_EVERY_S):
                removed = await supervisor.redo(
                    lambda: retention.cleanup(
                        ctx.db,
                        settings.retention_s,
                        ctx.lease,
                        archive_s=horizon.archive_after(settings),
                    ),
                    worker=ACTOR,
                    stop=stop,
                    on_fenced=ctx.reacquire,
                )
                if any(removed.values()):
                    logs.event("retention.cleanup", **removed)

        await supervisor.supervise(main=[deadlines(), cleanup()], side=[ctx.heartbeat()])
