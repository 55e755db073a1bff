"""Receipt validation: every decision about a receipt or a query answer. Pure.

The checks run in the order the design fixes (schema happens in the codec): tenant
→ owner and principal (and the broker-validated user id) → receipt identity (derived
from the request and revision; a known receipt id) → operation exists → attempt and
request id issued for it → command digest → owner revision (every revision seen, with
its content) → lifecycle. The first failure decides; a quarantine decision carries a
closed reason code (:class:`workers.core.reasons.Reason`), used for the quarantine row
and the metric label. A query answer is checked against its query by the same speaker
checks (:func:`refuse_answer`) before the receipt inside it goes the receipt's path;
:func:`judge` is the receipt consumer's whole decision for one delivery.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from contracts import digest, identity
from contracts.models import OperationReceipt, QueryAnswer
from workers.core import lifecycle, process
from workers.core.reasons import REASONS as ALL_REASONS
from workers.core.reasons import Reason


class Verdict(enum.StrEnum):
    APPLY = "apply"  # changes the operation
    DUPLICATE = "duplicate"  # seen before, identical: no-op, ack
    STALE = "stale"  # older revision or attempt: recorded, never applied
    IGNORED = "ignored"  # valid, newer, but changes nothing (e.g. late accepted)
    QUARANTINE = "quarantine"  # refused with a reason; no state change


REASONS: tuple[Reason, ...] = ALL_REASONS  # the one closed list (workers.core.reasons)
# A query answered with nothing newer: counted beside the receipt's own verdict.
NO_NEWS: Final = "no_news"
# Every label a judgement gives custody_receipts_total (Judgement.labels).
RECEIPT_LABELS: Final = (*(v.value for v in Verdict), NO_NEWS)


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


def _quarantine(reason: Reason, detail: str) -> Decision:
    return Decision(Verdict.QUARANTINE, reason, detail)


def _speaker(
    kind: str,
    *,
    tenant: str,
    owner: str,
    principal: str,
    user_id: str | None,
    op: OperationView | None,
) -> Decision | None:
    """Who speaks, for a receipt and a query answer alike: the operation's tenant, a
    broker-validated user id that is the claimed principal, the pinned owner."""
    if op is not None and op.tenant != tenant:
        return _quarantine(Reason.WRONG_TENANT, f"{kind} tenant {tenant!r} is not the operation's")
    if not user_id:
        return _quarantine(
            Reason.MISSING_USER_ID, "the delivery carries no broker-validated user id"
        )
    if user_id != principal:
        return _quarantine(
            Reason.PRINCIPAL_MISMATCH, f"delivered by {user_id!r}, claims {principal!r}"
        )
    if op is not None and (owner, principal) != (op.owner, op.principal):
        return _quarantine(
            Reason.WRONG_OWNER,
            f"{owner}/{principal} is not the pinned {op.owner}/{op.principal}",
        )
    return None


def refuse_answer(
    answer: QueryAnswer,
    *,
    user_id: str | None,
    op: OperationView | None,
    issued: Mapping[str, IssuedRequest],
) -> Decision | None:
    """Whether a query answer is refused before the receipt inside it is looked at:
    the speaker checks of a receipt, then the query it answers must be one the engine
    issued for this operation, and its receipt must be about this operation."""
    refused = _speaker(
        "answer",
        tenant=answer.tenant,
        owner=answer.owner,
        principal=answer.principal,
        user_id=user_id,
        op=op,
    )
    if refused is not None:
        return refused
    if op is None:
        return _quarantine(Reason.UNKNOWN_OPERATION, f"no operation {answer.operation_id}")
    query = issued.get(answer.in_reply_to)
    if query is None or query.kind != "query" or query.operation_id != op.id:
        return _quarantine(
            Reason.UNKNOWN_REQUEST, "in_reply_to is not a query issued for this operation"
        )
    if answer.receipt is not None and answer.receipt.operation_id != answer.operation_id:
        return _quarantine(Reason.SCHEMA, "the answer's receipt is about another operation")
    return None


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
    refused = _speaker(
        "receipt",
        tenant=receipt.tenant,
        owner=receipt.owner,
        principal=receipt.principal,
        user_id=user_id,
        op=op,
    )
    if refused is not None:
        return refused
    if receipt.receipt_id not in (
        identity.receipt_id(receipt.request_id, receipt.owner_revision),
        identity.conflict_receipt_id(receipt.request_id, receipt.command_digest),
    ):
        return _quarantine(
            Reason.RECEIPT_ID_MISMATCH, "receipt id is not derived from its request and revision"
        )
    if seen_hash is not None:
        if seen_hash == content_hash:
            return Decision(Verdict.DUPLICATE, "duplicate_receipt", content_hash=content_hash)
        return _quarantine(Reason.RECEIPT_ID_REUSE, "a known receipt id with different content")
    if op is None:
        return _quarantine(Reason.UNKNOWN_OPERATION, f"no operation {receipt.operation_id}")
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
            Reason.UNKNOWN_REQUEST, "request id, attempt or in_reply_to was not issued for it"
        )
    if receipt.command_digest != submit.digest:
        return _quarantine(
            Reason.DIGEST_MISMATCH, "command digest differs from the issued command's"
        )
    if receipt.effect not in _EFFECT_OF[receipt.status]:
        return _quarantine(
            Reason.INCONSISTENT_EFFECT, f"status {receipt.status} with effect {receipt.effect}"
        )
    if receipt.attempt < op.attempt or receipt.owner_revision < op.owner_revision:
        return Decision(
            Verdict.STALE, "stale", "older attempt or owner revision", content_hash=content_hash
        )
    if seen_revision_hash is not None:
        if seen_revision_hash == content_hash:
            return Decision(Verdict.DUPLICATE, "duplicate_revision", content_hash=content_hash)
        return _quarantine(Reason.REVISION_CONFLICT, "a seen owner revision with different content")
    if receipt.owner_revision == op.owner_revision:
        if content_hash == op.receipt_hash:
            return Decision(Verdict.DUPLICATE, "duplicate_revision", content_hash=content_hash)
        return _quarantine(Reason.REVISION_CONFLICT, "same owner revision with different content")
    error_code = receipt.error.code if receipt.error else None
    event = lifecycle.receipt_event(
        receipt.status, receipt.effect, error_code, retryable=retryable, answer=answer
    )
    try:
        target = lifecycle.next_status(op.status, event)
    except lifecycle.IllegalTransition as exc:
        return _quarantine(Reason.ILLEGAL_TRANSITION, str(exc))
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


# --- the receipt consumer's whole decision for one delivery ------------------------------


@dataclass(frozen=True)
class PinnedNode:
    """The node an operation's pinned process version defines, as loaded: the
    definition, or why it is not loaded (consulted only where it decides something)."""

    node: str
    definition: process.Definition | None
    missing: str = ""

    def get(self) -> process.Node:
        if self.definition is None:
            raise process.DefinitionError(self.missing)
        return self.definition.node(self.node)


@dataclass(frozen=True)
class Judgement:
    """What one receipt or query answer does (:func:`judge`), before any write.

    ``result`` is the delivery's verdict; ``labels`` the receipt-metric labels it
    counts. ``refused`` (with the message it is about) makes a quarantine row.
    ``decision`` is the receipt's; with ``record`` its identity is recorded, and an
    APPLY decision also carries ``retry_in`` and ``successor``. ``no_news`` is the
    status a query that found no authoritative outcome sends the operation back to,
    with ``fact`` saying what it found."""

    result: str
    labels: tuple[str, ...]
    refused: Decision | None = None
    about: OperationReceipt | QueryAnswer | None = None
    definition_missing: bool = False
    receipt: OperationReceipt | None = None
    decision: Decision | None = None
    record: bool = False
    retry_in: float | None = None
    successor: str | None = None
    no_news: lifecycle.Status | None = None
    fact: str = ""

    @property
    def applies(self) -> bool:
        return (
            self.decision is not None
            and self.decision.verdict is Verdict.APPLY
            and (self.result == "apply")
        )


def _no_news(op: OperationView, fact: str, labels: tuple[str, ...], **kept: Any) -> Judgement:
    """A query found no authoritative outcome. That proves nothing about the effect:
    the operation goes back to outcome_unknown, and the fact is recorded."""
    labels = (*labels, NO_NEWS)
    try:
        target = lifecycle.next_status(op.status, lifecycle.Event.QUERY_NONE)
    except lifecycle.IllegalTransition:
        return Judgement("ignored", labels, **kept)
    if target is lifecycle.IGNORE:
        return Judgement("ignored", labels, **kept)
    return Judgement("apply", labels, no_news=target, fact=fact, **kept)


def _definition_missing(
    receipt: OperationReceipt, error: str, labels: tuple[str, ...]
) -> Judgement:
    """The operation's pinned process version is not loaded, so what follows this
    (validated) receipt cannot be decided: kept in quarantine with the reason (and an
    alert), the operation left as it is, so its deadline runs out as usual and reconcile
    asks the owner again once the version is deployed again."""
    return Judgement(
        "quarantine",
        (*labels, "quarantine"),
        refused=_quarantine(Reason.DEFINITION_MISSING, error),
        about=receipt,
        definition_missing=True,
    )


def settling(status: lifecycle.Status | None, instance: lifecycle.InstanceStatus | None) -> bool:
    """The operation (as locked) or its instance is being cancelled: what follows an
    outcome is no successor but the instance's settling, so no definition is needed."""
    return status is lifecycle.Status.CANCELLING or instance is lifecycle.InstanceStatus.CANCELLING


_ANSWER_SETTLES: Final = lifecycle.TERMINAL | {
    lifecycle.Status.RETRY_WAITING,
    lifecycle.Status.OUTCOME_UNKNOWN,
}


def judge(
    message: OperationReceipt | QueryAnswer,
    *,
    user_id: str | None,
    op: OperationView | None,
    issued: Mapping[str, IssuedRequest],
    seen: Mapping[str, str],
    revisions: Mapping[tuple[str, int, int], str],
    node: PinnedNode | None,
    cancelling: bool = False,
) -> Judgement:
    """The receipt consumer's decision for one schema-valid delivery, in one place.

    ``seen``: content hashes of receipt ids seen before; ``revisions``: of (operation,
    attempt, owner revision); ``node``: the operation's pinned node (its definition is
    consulted only for a receipt that passed every trust check, and only where it
    decides something: a retry, or a successor); ``cancelling``: :func:`settling` of
    the operation's row as locked and its instance.
    """
    answer: QueryAnswer | None = None
    if isinstance(message, QueryAnswer):
        refused = refuse_answer(message, user_id=user_id, op=op, issued=issued)
        if refused is not None:
            return Judgement("quarantine", ("quarantine",), refused=refused, about=message)
        assert op is not None
        answer = message
        if message.receipt is None:
            return _no_news(op, "query answered: no receipt", ())
        receipt = message.receipt
    else:
        receipt = message
    revision_key = (receipt.operation_id, receipt.attempt, receipt.owner_revision)

    def decide_(retryable: bool) -> Decision:
        return decide(
            receipt,
            user_id=user_id,
            op=op,
            issued=issued,
            seen_hash=seen.get(receipt.receipt_id),
            retryable=retryable,
            seen_revision_hash=revisions.get(revision_key),
            answer=answer is not None,
        )

    decision = decide_(False)
    if (
        decision.verdict is Verdict.APPLY
        and receipt.status == "failed"
        and receipt.effect == "none"
        and node is not None
    ):
        try:
            policy = node.get().retry
            code = receipt.error.code if receipt.error else None
            if policy is not None and policy.allows(receipt.attempt, code):
                decision = decide_(True)
        except process.DefinitionError as exc:
            if not cancelling:
                return _definition_missing(receipt, str(exc), ())
    labels: tuple[str, ...] = (decision.verdict.value,)
    if decision.verdict is Verdict.QUARANTINE:
        return Judgement("quarantine", labels, refused=decision, about=receipt)
    assert op is not None
    if decision.verdict is Verdict.DUPLICATE:
        if answer is not None:
            return _no_news(op, "query answered: nothing newer", labels)
        return Judgement("duplicate", labels, receipt=receipt, decision=decision)
    if (
        answer is not None
        and decision.verdict is Verdict.APPLY
        and decision.status not in _ANSWER_SETTLES
    ):
        # the owner holds it but has not settled it: still no authoritative outcome.
        # Not recorded: the receipt itself, delivered directly, still applies once.
        return _no_news(op, f"query answered: {receipt.status}", labels)
    successor: str | None = None
    retry_in: float | None = None
    if decision.verdict is Verdict.APPLY and decision.status is not None:
        if (
            decision.status in lifecycle.TERMINAL
            and decision.status is not lifecycle.Status.CANCELLED
            and not cancelling
            and node is not None
        ):
            try:  # the definition is needed for what follows
                successor = (
                    node.get().on_succeeded
                    if (decision.status is lifecycle.Status.SUCCEEDED)
                    else node.get().on_failed
                )
            except process.DefinitionError as exc:
                return _definition_missing(receipt, str(exc), labels)
        if decision.status is lifecycle.Status.RETRY_WAITING and node is not None:
            retry = node.get().retry
            assert retry is not None
            retry_in = retry.delay(op.attempt)
    if decision.verdict is not Verdict.APPLY:  # stale, ignored: recorded, never applied
        kept: dict[str, Any] = {"receipt": receipt, "decision": decision, "record": True}
        if answer is not None:
            return _no_news(op, f"query answered: {decision.verdict}", labels, **kept)
        return Judgement(decision.verdict.value, labels, **kept)
    return Judgement(
        "apply",
        labels,
        receipt=receipt,
        decision=decision,
        record=True,
        retry_in=retry_in,
        successor=successor,
    )
