"""What a decision does: the typed writes of one applied receipt or query answer. Pure.

:func:`workers.core.validation.judge` decides; :func:`of_receipt` and
:func:`of_no_news` turn that decision into the operation's status change (status,
effect, owner revision, result, retry delay), its history, the instance's changes
(suspend while an outcome is unknown, resume once resolved, cancelling when the owner
cancelled, settle a cancelled instance once its work has all settled), the node's end
and the successor intent. The receipt consumer writes them in one transaction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

from contracts.models import OperationReceipt
from workers.core import lifecycle, validation
from workers.core.records import (
    History,
    InstanceChange,
    NodeFinish,
    OperationRow,
    OperationUpdate,
    SuccessorIntent,
)

S = lifecycle.Status
IE = lifecycle.InstanceEvent
UNKNOWN: Final = frozenset({S.OUTCOME_UNKNOWN, S.RECONCILE_PENDING})


@dataclass(frozen=True)
class Effects:
    """The writes of one decision, and the operation as it is after them."""

    view: validation.OperationView
    update: OperationUpdate
    history: tuple[History, ...] = ()
    instance: tuple[InstanceChange, ...] = ()
    node: NodeFinish | None = None
    successor: SuccessorIntent | None = None

    @property
    def terminal(self) -> bool:
        return self.update.terminal


def of_receipt(
    row: OperationRow,
    op: validation.OperationView,
    receipt: OperationReceipt,
    judgement: validation.Judgement,
    *,
    actor: str,
    recheck_instance: bool = True,
) -> Effects:
    """The writes of an APPLY decision about ``receipt`` for the operation ``op`` (its
    current view in this batch; ``row`` as it was locked). ``recheck_instance=False``
    is the chaos checker's deliberately broken build only (successors for a cancelling
    instance)."""
    decision = judgement.decision
    assert decision is not None and decision.status is not None and decision.effect is not None
    status, effect = decision.status, decision.effect
    terminal = status in lifecycle.TERMINAL
    update = OperationUpdate(
        id=op.id,
        expected=op.status,
        status=status,
        effect=effect,
        owner_revision=receipt.owner_revision,
        receipt_hash=decision.content_hash,
        result=receipt.result,
        error=receipt.error.model_dump() if receipt.error else None,
        terminal=terminal,
        retry_in=judgement.retry_in,
    )
    view = replace(
        op,
        status=status,
        effect=effect,
        owner_revision=receipt.owner_revision,
        receipt_hash=decision.content_hash,
    )
    history = History(
        instance_id=row.instance_id,
        operation_id=op.id,
        event=f"operation.{status.value}",
        detail={
            "from": op.status.value,
            "owner_revision": receipt.owner_revision,
            "effect": effect.value,
            "receipt_id": receipt.receipt_id,
            "attempt": receipt.attempt,
        },
        actor=actor,
    )
    instance: list[InstanceChange] = []
    if status is S.OUTCOME_UNKNOWN:
        instance.append(InstanceChange(row.instance_id, IE.SUSPEND))
    elif op.status in UNKNOWN:
        instance.append(InstanceChange(row.instance_id, IE.RESUME))
    if not terminal:
        return Effects(view, update, (history,), tuple(instance))
    if status is S.CANCELLED and op.status is not S.CANCELLING:
        # the owner settled the work as cancelled under a cancel this engine does not
        # hold (it predates it): the instance was being cancelled
        instance.append(
            InstanceChange(
                row.instance_id,
                IE.CANCEL,
                History(
                    row.instance_id,
                    "instance.cancelling",
                    actor,
                    {"cause": "the owner cancelled an operation"},
                ),
            )
        )
    node = NodeFinish(op.id, status)
    if status is S.CANCELLED or (
        recheck_instance
        and (
            op.status is S.CANCELLING or row.instance_status is lifecycle.InstanceStatus.CANCELLING
        )
    ):
        # a success that wins the race stays succeeded, but the cancelled instance
        # gets no successors; it settles once all its work has
        instance.append(
            InstanceChange(
                row.instance_id, IE.SETTLE, History(row.instance_id, "instance.cancelled", actor)
            )
        )
        return Effects(view, update, (history,), tuple(instance), node)
    successor = (
        SuccessorIntent(row.instance_id, op.id, status, judgement.successor)
        if judgement.successor is not None
        else None
    )
    return Effects(view, update, (history,), tuple(instance), node, successor)


def of_no_news(
    row: OperationRow,
    op: validation.OperationView,
    target: lifecycle.Status,
    fact: str,
    *,
    actor: str,
) -> Effects:
    """A query found no authoritative outcome: back to ``target`` (outcome_unknown),
    nothing else about the operation changes, and the fact is in its history."""
    update = OperationUpdate(
        id=op.id,
        expected=op.status,
        status=target,
        effect=op.effect,
        owner_revision=op.owner_revision,
        receipt_hash=op.receipt_hash,
    )
    history = History(
        instance_id=row.instance_id,
        operation_id=op.id,
        event=f"operation.{target.value}",
        detail={"from": op.status.value, "fact": fact},
        actor=actor,
    )
    # the batch's view follows, so a later delivery for this operation in the same batch
    # is judged (and its guarded UPDATE expects) the status this one leaves
    return Effects(replace(op, status=target), update, (history,))
