"""Typed records: rows read are frozen records with ``from_row``; writes are frozen
records with ``params(jsonb)``. Pure.

``params`` takes the JSON wrapper of the I/O layer (``workers.io.db.jsonb``) so this
module stays free of it; JSON fields are kept as plain values until then. One
constructor each for what was built by hand at many sites: a history row
(:class:`History`), a quarantine row (:class:`Quarantine`), a participant's refused
row (:class:`Refusal`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Final

from workers.core import lifecycle, validation
from workers.core.reasons import Reason

Jsonb = Callable[[Any], Any]
IE = lifecycle.InstanceEvent
# the guarded UPDATE of each instance event that takes only the instance id, in the
# order a batch writes them (each after the operation changes it depends on)
INSTANCE_QUERIES: Final[dict[lifecycle.InstanceEvent, str]] = {
    IE.SUSPEND: "instance_suspend",
    IE.RESUME: "instance_unsuspend",
    IE.CANCEL: "instance_set_cancelling",
    IE.SETTLE: "instance_settle_cancel",
}
DETAIL_MAX = 2000  # quarantine and refusal details are bounded


@dataclass(frozen=True)
class History:
    """One row of an instance's history (``history_insert``)."""

    instance_id: Any
    event: str
    actor: str
    detail: Mapping[str, Any] = field(default_factory=dict)
    operation_id: Any = None

    def params(self, jsonb: Jsonb) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "operation_id": self.operation_id,
            "event": self.event,
            "detail": jsonb(dict(self.detail)),
            "actor": self.actor,
        }


@dataclass(frozen=True)
class Quarantine:
    """One engine quarantine row (``quarantine_insert``): the raw message kept with its
    closed reason, acked, and nothing else changed."""

    source: str
    worker: str
    reason: Reason
    detail: str
    message_id: str | None
    user_id: str | None
    body: bytes
    headers: Mapping[str, str]
    tenant: str | None = None
    operation_id: str | None = None
    # not a column: the instance, where the worker knew it, for the custody event
    instance_id: str | None = None

    def params(self, jsonb: Jsonb) -> dict[str, Any]:
        return {
            "source": self.source,
            "reason": self.reason.value,
            "detail": self.detail[:DETAIL_MAX],
            "message_id": self.message_id,
            "user_id": self.user_id,
            "tenant": self.tenant,
            "operation_id": self.operation_id,
            "body": self.body,
            "headers": jsonb(dict(self.headers)),
            "worker": self.worker,
        }


@dataclass(frozen=True)
class Refusal:
    """One participant refused row (``p_refused_insert``)."""

    reason: Reason
    detail: str
    message_id: str | None
    body: bytes
    # not columns: what the custody event says of it
    trace_id: str | None = None
    operation_id: str | None = None

    def params(self) -> dict[str, Any]:
        return {
            "reason": self.reason.value,
            "detail": self.detail[:DETAIL_MAX],
            "message_id": self.message_id,
            "body": self.body,
        }


@dataclass(frozen=True)
class Conflict:
    """A participant's recorded conflict (``p_conflict_insert``): the same identity
    with another digest, never executed."""

    request_id: str
    stored_digest: str
    received_digest: str
    command: Mapping[str, Any]

    def params(self, jsonb: Jsonb) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "stored_digest": self.stored_digest,
            "received_digest": self.received_digest,
            "command": jsonb(dict(self.command)),
        }


@dataclass(frozen=True)
class OperationRow:
    """An operation as the receipt consumer locks it (``operations_lock``)."""

    id: str
    tenant: str
    instance_id: Any
    node: str
    owner: str
    principal: str
    attempt: int
    status: lifecycle.Status
    effect: lifecycle.Effect
    owner_revision: int
    receipt_hash: str | None
    process: tuple[str, int]  # the pinned process name and version (its lineage's)
    created_at: datetime
    instance_status: lifecycle.InstanceStatus

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> OperationRow:
        return cls(
            id=str(row["id"]),
            tenant=row["tenant"],
            instance_id=row["instance_id"],
            node=row["node"],
            owner=row["owner"],
            principal=row["principal"],
            attempt=row["attempt"],
            status=lifecycle.Status(row["status"]),
            effect=lifecycle.Effect(row["effect"]),
            owner_revision=row["owner_revision"],
            receipt_hash=row["receipt_hash"],
            process=(row["process"], row["process_version"]),
            created_at=row["created_at"],
            instance_status=lifecycle.InstanceStatus(row["instance_status"]),
        )

    def view(self) -> validation.OperationView:
        return validation.OperationView(
            id=self.id,
            tenant=self.tenant,
            owner=self.owner,
            principal=self.principal,
            attempt=self.attempt,
            status=self.status,
            effect=self.effect,
            owner_revision=self.owner_revision,
            receipt_hash=self.receipt_hash,
        )


@dataclass(frozen=True)
class OperationUpdate:
    """One guarded operation status change (``operation_apply``: WHERE status =
    ``expected``; a change whose row is not in that status is a row changed under its
    lock, which fails the statement with CU004)."""

    id: str
    expected: lifecycle.Status
    status: lifecycle.Status
    effect: lifecycle.Effect
    owner_revision: int
    receipt_hash: str | None
    result: Mapping[str, Any] | None = None
    error: Mapping[str, Any] | None = None
    terminal: bool = False
    retry_in: float | None = None

    def params(self, jsonb: Jsonb) -> dict[str, Any]:
        return {
            "id": self.id,
            "expected": self.expected.value,
            "status": self.status.value,
            "effect": self.effect.value,
            "owner_revision": self.owner_revision,
            "receipt_hash": self.receipt_hash,
            "result": jsonb(dict(self.result)) if self.result is not None else None,
            "error": jsonb(dict(self.error)) if self.error is not None else None,
            "terminal": self.terminal,
            "retry_in": self.retry_in,
        }


def fold_updates(updates: Sequence[OperationUpdate]) -> list[OperationUpdate]:
    """A batch's operation changes, one per operation, for the one set-based statement
    that applies them (``operation_apply`` updates each row at most once). Several
    changes of one operation in a batch (its ``accepted`` then its terminal receipt)
    fold into the change they make in sequence: guarded by the first one's expected
    status, with the last one's status, effect, revision, hash, retry and end, and the
    latest result and error given (``coalesce`` keeps an earlier one)."""
    folded: dict[str, OperationUpdate] = {}
    for u in updates:
        before = folded.get(u.id)
        if before is not None:
            u = replace(
                u,
                expected=before.expected,
                result=u.result if u.result is not None else before.result,
                error=u.error if u.error is not None else before.error,
            )
        folded[u.id] = u
    return list(folded.values())


@dataclass(frozen=True)
class ReceiptRecord:
    """A receipt's identity and content, recorded so it applies at most once."""

    receipt_id: str
    operation_id: str
    attempt: int
    owner_revision: int
    status: str
    content_hash: str
    decision: str

    def params(self) -> dict[str, Any]:
        return {
            "receipt_id": self.receipt_id,
            "operation_id": self.operation_id,
            "attempt": self.attempt,
            "owner_revision": self.owner_revision,
            "status": self.status,
            "content_hash": self.content_hash,
            "decision": self.decision,
        }


@dataclass(frozen=True)
class NodeFinish:
    operation_id: str
    status: lifecycle.Status

    def params(self) -> dict[str, Any]:
        return {"operation_id": self.operation_id, "status": self.status.value}


@dataclass(frozen=True)
class SuccessorIntent:
    instance_id: Any
    from_operation_id: str
    outcome: lifecycle.Status
    next_node: str
    done: bool = False  # activated in the transaction that writes it (the receipt's)

    def params(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "from_operation_id": self.from_operation_id,
            "outcome": self.outcome.value,
            "next_node": self.next_node,
            "done": self.done,
        }


@dataclass(frozen=True)
class InstanceChange:
    """An instance status change by ``event`` (the database's guarded UPDATE decides
    whether the instance is in a status the table allows it from), with the history
    row to write if it changed."""

    instance_id: Any
    event: lifecycle.InstanceEvent
    history: History | None = None

    @property
    def target(self) -> lifecycle.InstanceStatus:
        return lifecycle.instance_target(self.event)

    @property
    def query(self) -> str:
        """The guarded UPDATE that makes this change (``queries.sql``)."""
        return INSTANCE_QUERIES[self.event]

    def params(self) -> dict[str, Any]:
        return {"id": self.instance_id}
