"""Receipt validation: one path for replies and query answers. Pure.

The checks run in the order the design fixes (schema happens in the codec): tenant
→ owner and principal (and the broker-validated user id) → receipt identity (derived
from the request and revision; a known receipt id) → operation exists → attempt and
request id issued for it → command digest → owner revision (every revision seen, with
its content) → lifecycle. The first failure decides; a quarantine decision carries a
stable reason code, used for the quarantine row and the metric label.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from contracts import digest, identity
from contracts.models import OperationReceipt
from workers.core import lifecycle


class Verdict(enum.StrEnum):
    APPLY = "apply"  # changes the operation
    DUPLICATE = "duplicate"  # seen before, identical: no-op, ack
    STALE = "stale"  # older revision or attempt: recorded, never applied
    IGNORED = "ignored"  # valid, newer, but changes nothing (e.g. late accepted)
    QUARANTINE = "quarantine"  # refused with a reason; no state change


REASONS: tuple[str, ...] = (
    "oversized",
    "not_utf8",
    "malformed_json",
    "schema",
    "unknown_type",
    "non_canonical_value",
    "receipt_id_reuse",
    "receipt_id_mismatch",
    "wrong_tenant",
    "missing_user_id",
    "principal_mismatch",
    "wrong_owner",
    "unknown_operation",
    "unknown_request",
    "digest_mismatch",
    "revision_conflict",
    "inconsistent_effect",
    "illegal_transition",
    "restore_generation",
    "definition_missing",
    "undecodable_properties",
)


@dataclass(frozen=True)
class OperationView:
    """What validation needs of an operation row (and what applying it changes)."""

    id: str
    tenant: str
    owner: str
    principal: str
    attempt: int
    status: lifecycle.Status
    effect: lifecycle.Effect
    owner_revision: int
    receipt_hash: str | None


@dataclass(frozen=True)
class IssuedRequest:
    request_id: str
    operation_id: str
    attempt: int
    kind: str
    digest: str


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str = ""
    detail: str = ""
    status: lifecycle.Status | None = None
    effect: lifecycle.Effect | None = None
    content_hash: str = ""


_EFFECT_OF: Mapping[str, frozenset[str]] = {
    "accepted": frozenset({"none", "unknown"}),
    "succeeded": frozenset({"applied"}),
    "failed": frozenset({"none", "applied", "unknown"}),
    "cancelled": frozenset({"none"}),
    "rejected": frozenset({"none"}),
}


def _quarantine(reason: str, detail: str) -> Decision:
    return Decision(Verdict.QUARANTINE, reason, detail)


# How many queries or cancels of one attempt an inner receipt's in_reply_to may be
# derived from when the engine no longer holds the request (after a restore).
MAX_DERIVED_SEQUENCE = 1024


def derived_request(operation_id: str, attempt: int, request_id: str) -> bool:
    """Whether ``request_id`` is one of the command identities the engine derives for
    this operation and attempt: a command it issued and may have forgotten (a restored
    engine predates it), never one made up by someone else."""
    if request_id == identity.request_id(operation_id, attempt, "submit"):
        return True
    return any(
        request_id == identity.request_id(operation_id, attempt, kind, n)
        for kind in ("query", "cancel")
        for n in range(1, MAX_DERIVED_SEQUENCE + 1)
    )


def decide(
    receipt: OperationReceipt,
    *,
    user_id: str | None,
    op: OperationView | None,
    issued: Mapping[str, IssuedRequest],
    seen_hash: str | None,
    retryable: bool = False,
    seen_revision_hash: str | None = None,
    answer: bool = False,
) -> Decision:
    """Decide what one schema-valid receipt does to the operation it names.

    ``retryable``: the node's retry policy allows another attempt after this
    receipt's error (only ever used for a failure with effect none).
    ``seen_hash``: the content of an earlier receipt with this receipt id;
    ``seen_revision_hash``: of an earlier receipt at this attempt and owner revision.
    ``answer``: the receipt came inside a query answer (the answer itself was checked
    against the query): the statement it answers may be one the engine forgot, so its
    ``in_reply_to`` need only be derivable for the operation, and a ``cancelled``
    statement about work the engine did not know was being cancelled is evidence.
    """
    content_hash = digest.content_hash(receipt.content())
    if op is not None and op.tenant != receipt.tenant:
        return _quarantine(
            "wrong_tenant", f"receipt tenant {receipt.tenant!r} is not the operation's"
        )
    if not user_id:
        return _quarantine("missing_user_id", "the delivery carries no broker-validated user id")
    if user_id != receipt.principal:
        return _quarantine(
            "principal_mismatch", f"delivered by {user_id!r}, claims {receipt.principal!r}"
        )
    if op is not None and (receipt.owner, receipt.principal) != (op.owner, op.principal):
        return _quarantine(
            "wrong_owner",
            f"{receipt.owner}/{receipt.principal} is not the pinned {op.owner}/{op.principal}",
        )
    if receipt.receipt_id not in (
        identity.receipt_id(receipt.request_id, receipt.owner_revision),
        identity.conflict_receipt_id(receipt.request_id, receipt.command_digest),
    ):
        return _quarantine(
            "receipt_id_mismatch", "receipt id is not derived from its request and revision"
        )
    if seen_hash is not None:
        if seen_hash == content_hash:
            return Decision(Verdict.DUPLICATE, "duplicate_receipt", content_hash=content_hash)
        return _quarantine("receipt_id_reuse", "a known receipt id with different content")
    if op is None:
        return _quarantine("unknown_operation", f"no operation {receipt.operation_id}")
    submit = issued.get(receipt.request_id)
    reply_to = issued.get(receipt.in_reply_to)
    replies_to_ours = (reply_to is not None and reply_to.operation_id == op.id) or (
        answer and derived_request(op.id, receipt.attempt, receipt.in_reply_to)
    )
    if (
        submit is None
        or submit.kind != "submit"
        or submit.operation_id != op.id
        or submit.attempt != receipt.attempt
        or not replies_to_ours
    ):
        return _quarantine(
            "unknown_request", "request id, attempt or in_reply_to was not issued for it"
        )
    if receipt.command_digest != submit.digest:
        return _quarantine("digest_mismatch", "command digest differs from the issued command's")
    if receipt.effect not in _EFFECT_OF[receipt.status]:
        return _quarantine(
            "inconsistent_effect", f"status {receipt.status} with effect {receipt.effect}"
        )
    if receipt.attempt < op.attempt or receipt.owner_revision < op.owner_revision:
        return Decision(
            Verdict.STALE, "stale", "older attempt or owner revision", content_hash=content_hash
        )
    if seen_revision_hash is not None:
        if seen_revision_hash == content_hash:
            return Decision(Verdict.DUPLICATE, "duplicate_revision", content_hash=content_hash)
        return _quarantine("revision_conflict", "a seen owner revision with different content")
    if receipt.owner_revision == op.owner_revision:
        if content_hash == op.receipt_hash:
            return Decision(Verdict.DUPLICATE, "duplicate_revision", content_hash=content_hash)
        return _quarantine("revision_conflict", "same owner revision with different content")
    error_code = receipt.error.code if receipt.error else None
    event = lifecycle.receipt_event(
        receipt.status, receipt.effect, error_code, retryable=retryable, answer=answer
    )
    try:
        target = lifecycle.next_status(op.status, event)
    except lifecycle.IllegalTransition as exc:
        return _quarantine("illegal_transition", str(exc))
    if target is lifecycle.IGNORE:
        return Decision(Verdict.IGNORED, "ignored", str(event), content_hash=content_hash)
    return Decision(
        Verdict.APPLY,
        status=target,
        effect=_effect_after(event, op.effect, receipt.effect),
        content_hash=content_hash,
    )


def _effect_after(
    event: lifecycle.Event, current: lifecycle.Effect, reported: str
) -> lifecycle.Effect:
    E = lifecycle.Event  # noqa: N806
    if event is E.SUCCEEDED:
        return lifecycle.Effect.APPLIED
    if event in (E.CANCELLED, E.QUERY_CANCELLED, E.REJECTED):
        return lifecycle.Effect.NONE
    if event in (E.FAILED, E.FAILED_UNKNOWN, E.FAILED_RETRYABLE):
        return lifecycle.Effect(reported)
    if event is E.CONFLICT:
        return lifecycle.Effect.UNKNOWN
    return current
