"""Operator recovery commands: the same transition path as the workers, never a hand
edit of runtime rows.

The transitions live in the database (``transitions.sql``), as SECURITY DEFINER
functions that check the lifecycle and the operator's authorization (the
``custody.operators`` table, synced from ``deploy/operators.toml``) and write the
history and the audit row (who, what, why, outcome) in the same transaction as the
effect; a refusal is audited too. An operator's own login role may run them and may
write no row itself, so the controlled commands are the only way in.

Two callers, one path:

* an operator (``actor=None``): the database takes the actor from ``session_user``,
  the authenticated login; nothing the operator types can change it;
* a worker (a policy actor, or the committer acting for a broker-validated user): the
  ``t_*`` functions, which only the worker roles may execute.

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

from workers import errors
from workers.io import db
from workers.runtime import otel

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

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Outcome:
        return cls(Result(value["result"]), str(value["message"]), dict(value.get("data") or {}))


class Operator:
    def __init__(self, database: db.Database, lease: db.Lease | None = None) -> None:
        self.db = database
        self.lease = lease

    async def call(self, command: str, actor: str | None, params: dict[str, Any]) -> Outcome:
        """Run one controlled command in its own transaction: ``op_<command>`` as the
        login (an operator), ``t_<command>`` with ``actor`` (a worker)."""
        name = f"op_{command}" if actor is None else f"t_{command}"
        args = params if actor is None else {"actor": actor, **params}
        for attempt in range(RETRIES + 1):
            try:
                async with (
                    otel.transaction(command, actor or "operator") as span,
                    self.db.transaction(self.lease) as tx,
                ):
                    row = await tx.one(name, args)
                    if span.recording and row is not None:
                        span.set(operation_id=params.get("target"), result=row["outcome"]["result"])
                assert row is not None
                return Outcome.from_json(row["outcome"])
            except errors.DatabaseError as exc:
                # a deadlock or serialization failure against a worker's unit, or a row
                # changed under its lock: the whole command is redone (it re-reads
                # everything under its locks)
                if exc.kind is not errors.Retry.RETRY or attempt == RETRIES:
                    raise
                await asyncio.sleep(errors.backoff_seconds(attempt, base=0.05))
        raise AssertionError("unreachable")

    async def reconcile(self, actor: str | None, op_id: str, reason: str) -> Outcome:
        """Record ReconcilePending and a query intent against the pinned executor."""
        return await self.call("reconcile", actor, {"target": op_id, "reason": reason})

    async def retry_safe(self, actor: str | None, op_id: str, reason: str) -> Outcome:
        """A new attempt, only from authoritative RetryWaiting with effect none."""
        return await self.call("retry_safe", actor, {"target": op_id, "reason": reason})

    async def set_paused(
        self, actor: str | None, paused: bool, reason: str, instance_id: str | None = None
    ) -> Outcome:
        return await self.call(
            "set_paused", actor, {"paused": paused, "reason": reason, "instance": instance_id}
        )

    async def cancel_instance(self, actor: str | None, instance_id: str, reason: str) -> Outcome:
        """Cancel an instance: a request to settle its work consistently with the
        executors' durable state. Unresolved operations become ``cancelling`` and a
        cancel goes to each pinned executor; they stay ``cancelling`` until
        authoritative evidence. Repeating it re-sends the cancels."""
        return await self.call("cancel", actor, {"target": instance_id, "reason": reason})

    async def cancel_start(
        self, actor: str | None, tenant: str, start_request_id: str, reason: str
    ) -> Outcome:
        """Cancel a start request: its instance if it exists, otherwise a durable
        tombstone, so that a late start creates nothing."""
        return await self.call(
            "cancel_start",
            actor,
            {"tenant": tenant, "target": start_request_id, "reason": reason},
        )


async def retire_submits(tx: db.Tx, actor: str, operation_id: Any = None) -> int:
    """Retire the pending submits that must never be sent (of one operation, or all):
    the operation is settled or cancelling, or the submit is for an earlier attempt.
    Inside the caller's transaction."""
    row = await tx.one("t_retire_submits", {"actor": actor, "operation_id": operation_id})
    return int(row["n"]) if row else 0
