"""Operator recovery commands: the same transition path as the workers, never a hand
edit of runtime rows.

Each command checks the operator's authorization (``deploy/operators.toml``) and
writes its audit row (who, what, why, outcome) in the same transaction as its
effect; a refusal is audited too. Automatic policies (retries, reconcile) run the
same functions with a policy actor and no authorization check.

No command here can set an operation ``succeeded``, and none replays a command
whose effect is unknown: ``reconcile`` only asks the pinned executor, and
``retry-safe`` only proceeds from ``retry_waiting`` with effect ``none``
established by a validated receipt.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from contracts import identity
from workers import adapter, authz, db, errors, lifecycle

POLICY = "policy"
RETRIES = 3  # redos of a command that lost a deadlock to a worker


class Result(enum.Enum):
    DONE = "done"
    REFUSED = "refused"
    NOT_FOUND = "not_found"


@dataclass(frozen=True)
class Outcome:
    result: Result
    message: str
    data: dict[str, Any] = field(default_factory=dict)


class _Refused(Exception):
    def __init__(self, result: Result, message: str, tenant: str | None = None) -> None:
        super().__init__(message)
        self.result = result
        self.message = message
        self.tenant = tenant


class Operator:
    def __init__(
        self, database: db.Database, roles: authz.Roles | None, lease: db.Lease | None = None
    ) -> None:
        self.db = database
        self.roles = roles
        self.lease = lease

    async def _run(
        self, actor: str, action: str, target: str, reason: str, inputs: dict[str, Any], body: Any
    ) -> Outcome:
        try:
            for attempt in range(RETRIES + 1):
                try:
                    async with self.db.transaction(self.lease) as tx:
                        message, tenant, data = await body(tx)
                        await _audit(tx, actor, action, tenant, target, reason, inputs, "done")
                    return Outcome(Result.DONE, message, data)
                except errors.DatabaseError as exc:
                    # a deadlock or serialization failure against a worker's unit: the
                    # whole command is redone (it re-reads everything under its locks)
                    if exc.kind is not errors.Retry.RETRY or attempt == RETRIES:
                        raise
                    await asyncio.sleep(errors.backoff_seconds(attempt, base=0.05))
            raise AssertionError("unreachable")
        except _Refused as refused:
            if actor != POLICY:
                async with self.db.transaction() as tx:
                    await _audit(
                        tx,
                        actor,
                        action,
                        refused.tenant,
                        target,
                        reason,
                        {**inputs, "refusal": refused.message},
                        refused.result.value,
                    )
            return Outcome(refused.result, refused.message)

    def _authorize(self, actor: str, action: str, tenant: str | None, reason: str) -> None:
        if actor == POLICY:
            return
        if self.roles is None:
            raise _Refused(Result.REFUSED, "no operators file is configured", tenant)
        why = self.roles.refusal(actor, action, tenant, reason)
        if why is not None:
            raise _Refused(Result.REFUSED, why, tenant)

    async def _operation(
        self, tx: db.Tx, op_id: str, actor: str, action: str, reason: str
    ) -> dict[str, Any]:
        canonical = identity.canonical(op_id)
        row = await tx.one("operation_for_update", {"id": canonical}) if canonical else None
        if row is None:
            raise _Refused(Result.NOT_FOUND, f"no operation {op_id}")
        self._authorize(actor, action, row["tenant"], reason)
        return row

    async def reconcile(self, actor: str, op_id: str, reason: str) -> Outcome:
        """Record ReconcilePending and a query intent against the pinned executor."""

        async def body(tx: db.Tx) -> tuple[str, str, dict[str, Any]]:
            row = await self._operation(tx, op_id, actor, "reconcile", reason)
            status = lifecycle.Status(row["status"])
            try:
                target = lifecycle.next_status(status, lifecycle.Event.RECONCILE)
            except lifecycle.IllegalTransition:
                raise _Refused(
                    Result.REFUSED,
                    f"reconcile needs outcome_unknown; operation {op_id} is {status.value}",
                    row["tenant"],
                ) from None
            count = await tx.one(
                "queries_issued", {"id": op_id, "attempt": row["attempt"], "kind": "query"}
            )
            rows = adapter.query(
                adapter.Pinned.from_row(row), sequence=int(count["n"]) + 1 if count else 1
            )
            if await tx.run("operation_reconcile", {"id": op_id, "expected": status.value}) != 1:
                raise RuntimeError("operation changed under its row lock")
            await tx.run("attempt_insert", rows.attempt_row)
            await tx.run("outbox_insert", rows.outbox_row)
            await _history(
                tx,
                row,
                f"operation.{target}",
                actor,
                {"from": status.value, "query_request_id": rows.request_id, "reason": reason},
            )
            return (
                f"operation {op_id} is reconcile_pending; query {rows.request_id} sent to "
                f"{row['owner']} on {row['binding']}",
                row["tenant"],
                {
                    "operation_id": op_id,
                    "status": "reconcile_pending",
                    "query_request_id": rows.request_id,
                },
            )

        return await self._run(actor, "reconcile", op_id, reason, {"operation_id": op_id}, body)

    async def retry_safe(self, actor: str, op_id: str, reason: str) -> Outcome:
        """A new attempt, only from authoritative RetryWaiting with effect none."""

        async def body(tx: db.Tx) -> tuple[str, str, dict[str, Any]]:
            row = await self._operation(tx, op_id, actor, "retry-safe", reason)
            status = lifecycle.Status(row["status"])
            effect = lifecycle.Effect(row["effect"])
            if status is not lifecycle.Status.RETRY_WAITING or effect is not lifecycle.Effect.NONE:
                raise _Refused(
                    Result.REFUSED,
                    f"retry-safe needs retry_waiting with effect none established by "
                    f"a validated receipt; operation {op_id} is {status.value} with "
                    f"effect {effect.value}",
                    row["tenant"],
                )
            rows = await new_attempt(tx, row, actor, reason)
            return (
                f"operation {op_id} attempt {row['attempt'] + 1} dispatched as {rows.request_id}",
                row["tenant"],
                {
                    "operation_id": op_id,
                    "attempt": row["attempt"] + 1,
                    "request_id": rows.request_id,
                },
            )

        return await self._run(actor, "retry-safe", op_id, reason, {"operation_id": op_id}, body)

    async def set_paused(
        self, actor: str, paused: bool, reason: str, instance_id: str | None = None
    ) -> Outcome:
        action = "pause" if paused else "resume"

        async def body(tx: db.Tx) -> tuple[str, str | None, dict[str, Any]]:
            if instance_id is None:
                self._authorize(actor, action, None, reason)
                await tx.run("control_set_paused", {"paused": paused})
                return (
                    f"effect dispatch {'paused' if paused else 'resumed'} globally",
                    None,
                    {"dispatch_paused": paused},
                )
            canonical = identity.canonical(instance_id)
            inst = await tx.one("instance_get", {"id": canonical}) if canonical else None
            if inst is None:
                raise _Refused(Result.NOT_FOUND, f"no instance {instance_id}")
            self._authorize(actor, action, inst["tenant"], reason)
            await tx.run("instance_set_paused", {"id": instance_id, "paused": paused})
            await tx.run(
                "history_insert",
                {
                    "instance_id": instance_id,
                    "operation_id": None,
                    "event": f"dispatch.{'paused' if paused else 'resumed'}",
                    "detail": db.jsonb({"reason": reason}),
                    "actor": actor,
                },
            )
            return (
                f"effect dispatch {'paused' if paused else 'resumed'} for instance {instance_id}",
                inst["tenant"],
                {"instance_id": instance_id, "dispatch_paused": paused},
            )

        return await self._run(
            actor, action, instance_id or "*", reason, {"instance_id": instance_id}, body
        )

    async def cancel_instance(self, actor: str, instance_id: str, reason: str) -> Outcome:
        """Cancel an instance: a request to settle its work consistently with the
        executors' durable state. Unresolved operations become ``cancelling`` and a
        cancel goes to each pinned executor; they stay ``cancelling`` until
        authoritative evidence. Repeating it re-sends the cancels."""

        async def body(tx: db.Tx) -> tuple[str, str, dict[str, Any]]:
            canonical = identity.canonical(instance_id)
            inst = await tx.one("instance_for_update", {"id": canonical}) if canonical else None
            if inst is None:
                raise _Refused(Result.NOT_FOUND, f"no instance {instance_id}")
            self._authorize(actor, "cancel", inst["tenant"], reason)
            data = await cancel_in(tx, inst, actor, reason)
            return (
                f"instance {instance_id} is {data['instance_status']}; "
                f"{len(data['cancelling'])} operation(s) cancelling",
                inst["tenant"],
                data,
            )

        return await self._run(
            actor, "cancel", instance_id, reason, {"instance_id": instance_id}, body
        )

    async def cancel_start(
        self, actor: str, tenant: str, start_request_id: str, reason: str
    ) -> Outcome:
        """Cancel a start request: its instance if it exists, otherwise a durable
        tombstone, so that a late start creates nothing."""

        # one spelling, so that the lock below is the one the start takes
        canonical = identity.canonical(start_request_id)

        async def body(tx: db.Tx) -> tuple[str, str, dict[str, Any]]:
            if canonical is None:
                raise _Refused(Result.NOT_FOUND, f"{start_request_id!r} is not a start request id")
            self._authorize(actor, "cancel-start", tenant, reason)
            keys = {"tenant": tenant, "start_request_id": canonical}
            await tx.rows("start_locks", {"tenant": [tenant], "start_request_id": [canonical]})
            found = await tx.one("instance_by_start", keys)
            if found is not None:
                inst = await tx.one("instance_for_update", {"id": found["id"]})
                assert inst is not None
                self._authorize(actor, "cancel", tenant, reason)
                data = await cancel_in(tx, inst, actor, reason)
                return (
                    f"start {start_request_id} had created instance {inst['id']}: it is "
                    f"{data['instance_status']}",
                    tenant,
                    data,
                )
            await tx.run("start_tombstone_insert", {**keys, "actor": actor, "reason": reason})
            return (
                f"start {canonical} is tombstoned: if it arrives, it creates nothing",
                tenant,
                {"start_request_id": canonical, "tombstoned": True},
            )

        return await self._run(
            actor,
            "cancel-start",
            f"{tenant}/{canonical or start_request_id}",
            reason,
            {"tenant": tenant, "start_request_id": canonical or start_request_id},
            body,
        )


async def cancel_in(tx: db.Tx, inst: dict[str, Any], actor: str, reason: str) -> dict[str, Any]:
    """The cancellation transition of one locked instance, inside the caller's transaction."""
    status = inst["status"]
    if status in ("completed", "failed", "cancelled"):
        raise _Refused(Result.REFUSED, f"instance {inst['id']} is already {status}", inst["tenant"])
    await tx.run("instance_set_cancelling", {"id": inst["id"]})
    cancelling, cancelled = [], []
    for row in await tx.rows("instance_unresolved", {"id": inst["id"]}):
        current = lifecycle.Status(row["status"])
        if current is lifecycle.Status.CANCELLING:
            target: lifecycle.Status = current  # a repeated cancel re-sends the command
        else:
            nxt = lifecycle.next_status(current, lifecycle.Event.CANCEL)
            assert isinstance(nxt, lifecycle.Status)
            target = nxt
            if (
                await tx.run(
                    "operation_cancel",
                    {"id": row["id"], "expected": current.value, "status": target.value},
                )
                != 1
            ):
                raise RuntimeError("operation changed under its row lock")
        if target is lifecycle.Status.CANCELLED:
            # retry_waiting with effect none: nothing is in flight, nothing to ask
            await tx.run("node_finish", {"operation_id": row["id"], "status": "cancelled"})
            cancelled.append(str(row["id"]))
        else:
            count = await tx.one(
                "queries_issued", {"id": row["id"], "attempt": row["attempt"], "kind": "cancel"}
            )
            rows = adapter.cancel(
                adapter.Pinned.from_row(row),
                reason=reason,
                sequence=int(count["n"]) + 1 if count else 1,
            )
            await tx.run("attempt_insert", rows.attempt_row)
            await tx.run("outbox_insert", rows.outbox_row)
            cancelling.append(str(row["id"]))
        await _history(
            tx, row, f"operation.{target.value}", actor, {"from": current.value, "reason": reason}
        )
        await retire_submits(tx, actor, operation_id=row["id"])
    for intent in await tx.rows("successors_suppress", {"id": inst["id"]}):
        await tx.run(
            "history_insert",
            {
                "instance_id": inst["id"],
                "operation_id": intent["from_operation_id"],
                "event": "successor.suppressed",
                "detail": db.jsonb({"next_node": intent["next_node"], "cause": "cancel"}),
                "actor": actor,
            },
        )
    await tx.run(
        "history_insert",
        {
            "instance_id": inst["id"],
            "operation_id": None,
            "event": "instance.cancelling",
            "detail": db.jsonb({"reason": reason}),
            "actor": actor,
        },
    )
    settled = await tx.run("instance_settle_cancel", {"id": inst["id"]})
    if settled:
        await tx.run(
            "history_insert",
            {
                "instance_id": inst["id"],
                "operation_id": None,
                "event": "instance.cancelled",
                "detail": db.jsonb({}),
                "actor": actor,
            },
        )
    return {
        "instance_id": inst["id"],
        "instance_status": "cancelled" if settled else "cancelling",
        "cancelling": cancelling,
        "cancelled": cancelled,
    }


async def retire_submits(tx: db.Tx, actor: str, operation_id: Any = None) -> int:
    """Retire the pending submits that must never be sent (of one operation, or all):
    the operation is settled or cancelling, or the submit is for an earlier attempt."""
    retired = await tx.rows("submits_retire", {"operation_id": operation_id})
    await tx.run_many(
        "history_insert",
        [
            {
                "instance_id": r["instance_id"],
                "operation_id": r["operation_id"],
                "event": "command.retired",
                "detail": db.jsonb(
                    {"request_id": r["request_id"], "operation_status": r["operation_status"]}
                ),
                "actor": actor,
            }
            for r in retired
        ],
    )
    return len(retired)


async def new_attempt(
    tx: db.Tx, row: dict[str, Any], actor: str, reason: str
) -> adapter.CommandRows:
    """Attempt n+1 of the same operation and input: a new command identity."""
    attempt = int(row["attempt"]) + 1
    rows = adapter.submit(adapter.Pinned.from_row(row, attempt=attempt))
    changed = await tx.run(
        "operation_new_attempt", {"id": row["id"], "attempt": attempt, "digest": rows.digest}
    )
    if changed != 1:
        raise RuntimeError("operation changed under its row lock")
    await tx.run("attempt_insert", rows.attempt_row)
    await tx.run("outbox_insert", rows.outbox_row)
    await _history(
        tx,
        row,
        "operation.pending",
        actor,
        {
            "from": "retry_waiting",
            "attempt": attempt,
            "request_id": rows.request_id,
            "reason": reason,
        },
    )
    return rows


async def _history(
    tx: db.Tx, row: dict[str, Any], event: str, actor: str, detail: dict[str, Any]
) -> None:
    await tx.run(
        "history_insert",
        {
            "instance_id": row["instance_id"],
            "operation_id": row["id"],
            "event": event,
            "detail": db.jsonb(detail),
            "actor": actor,
        },
    )


async def _audit(
    tx: db.Tx,
    actor: str,
    action: str,
    tenant: str | None,
    target: str,
    reason: str,
    inputs: dict[str, Any],
    outcome: str,
) -> None:
    if actor == POLICY:
        return
    await tx.run(
        "audit_insert",
        {
            "actor": actor,
            "action": action,
            "tenant": tenant,
            "target": target,
            "reason": reason,
            "inputs": db.jsonb(inputs),
            "outcome": outcome,
        },
    )
