"""A participant's acceptance decisions, without I/O. Pure.

What a participant does with each command it receives, decided from its durable
state as the acceptance transaction read it: refused (not for us, or its digest does
not match its fields), a query or a cancel (answered from the journal), cancelled
before acceptance (tombstoned), a new identity (accepted, or rejected when there is
no handler), the same identity and digest again (duplicate: the stored receipt is
sent again) or the same identity with another digest (conflict: recorded, answered,
never executed). And what a handler's run comes to (:func:`completion`).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal

from contracts import identity
from contracts.models import (
    CancelCommand,
    OperationReceipt,
    QueryAnswer,
    QueryCommand,
    ReceiptError,
    SubmitCommand,
)
from workers.core.reasons import Reason
from workers.errors import BusinessFailure, backoff_seconds

Command = SubmitCommand | QueryCommand | CancelCommand


class Verdict(enum.StrEnum):
    REFUSED = "refused"
    QUERY = "query"
    CANCEL = "cancel"
    TOMBSTONED = "tombstoned"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class Refusal:
    reason: Reason
    detail: str


@dataclass(frozen=True)
class Stored:
    """What the inbox holds under an identity."""

    digest: str
    owner_revision: int


@dataclass(frozen=True)
class Classified:
    verdict: Verdict
    refusal: Refusal | None = None
    error_code: str = ""  # REJECTED: why
    stored_digest: str = ""  # CONFLICT: the digest the identity holds
    revision: int = 1  # CONFLICT: the revision the answer is at


def refusal(c: Command, *, owner: str, bindings: Collection[str]) -> Refusal | None:
    """Whether a decoded command is refused before its identity is looked at."""
    if c.target.owner != owner or c.target.binding not in bindings:
        return Refusal(
            Reason.WRONG_OWNER, f"target {c.target.owner}/{c.target.binding} is not ours"
        )
    if isinstance(c, SubmitCommand) and c.semantic_digest() != c.digest:
        return Refusal(Reason.DIGEST_MISMATCH, "the digest does not match the command's fields")
    return None


def admission(c: SubmitCommand, handled: Collection[str]) -> tuple[Verdict, str]:
    """A new command's status and error code: accepted, or rejected without a handler."""
    if c.operation in handled:
        return Verdict.ACCEPTED, ""
    return Verdict.REJECTED, "unknown_operation"


def classify(
    c: Command,
    *,
    refused: Refusal | None,
    tombstoned: Collection[str],
    inserted: Collection[str],
    offered: Mapping[str, SubmitCommand],
    stored: Mapping[str, Stored],
    handled: Collection[str],
) -> Classified:
    """What one admissible-or-not command is, given the acceptance transaction's reads:
    ``inserted``, the identities this transaction took (the first offered command of
    each); ``stored``, what the inbox already held for the others."""
    if refused is not None:
        return Classified(Verdict.REFUSED, refusal=refused)
    if isinstance(c, QueryCommand):
        return Classified(Verdict.QUERY)
    if isinstance(c, CancelCommand):
        return Classified(Verdict.CANCEL)
    if c.request_id in tombstoned:
        # cancelled before acceptance: refused, answered with the cancellation
        return Classified(
            Verdict.TOMBSTONED, refusal=Refusal(Reason.TOMBSTONED, "cancelled before acceptance")
        )
    if c.request_id in inserted and offered[c.request_id] is c:
        verdict, code = admission(c, handled)
        return Classified(verdict, error_code=code)
    known = stored.get(c.request_id)
    # an identity this batch inserted is compared with what it inserted
    known_digest = known.digest if known else offered[c.request_id].digest
    if known_digest == c.digest:
        return Classified(Verdict.DUPLICATE)
    return Classified(
        Verdict.CONFLICT,
        stored_digest=known_digest,
        revision=known.owner_revision if known else 1,
    )


def query_answer(
    q: QueryCommand,
    latest: OperationReceipt | None,
    *,
    owner: str,
    principal: str,
    now: datetime,
) -> QueryAnswer:
    """The answer to a query: our latest receipt for the work it asks about, or none
    (none also when our receipt is about other work under that identity)."""
    receipt = latest if latest is not None and latest.command_digest == q.digest else None
    return QueryAnswer(
        answer_id=identity.answer_id(q.request_id, receipt.owner_revision if receipt else 0),
        tenant=q.tenant,
        operation_id=q.operation_id,
        attempt=q.attempt,
        request_id=q.submit_request_id,
        in_reply_to=q.request_id,
        owner=owner,
        principal=principal,
        receipt=receipt,
        emitted_at=now,
    )


# --- completion: what a handler's run comes to -----------------------------------------

MAX_EXECUTIONS: Final = 5  # a handler that keeps raising is failed after this many runs


@dataclass(frozen=True)
class Completed:
    """The terminal state a handler's run commits with its effect (or without it)."""

    status: Literal["succeeded", "failed"]
    effect: Literal["applied", "none"]
    result: Mapping[str, Any] | None = None
    error: ReceiptError | None = None


@dataclass(frozen=True)
class Deferred:
    """A handler bug (it raised; its savepoint rolled back, so no effect): run it again
    after ``delay`` seconds."""

    delay: float


def completion(
    result: Mapping[str, Any] | None,
    failure: BaseException | None,
    *,
    executions: int,
    max_executions: int = MAX_EXECUTIONS,
) -> Completed | Deferred:
    """A handler returned ``result``, or raised ``failure`` (a :class:`BusinessFailure`:
    the work fails, effect none; anything else: a bug, deferred with backoff until
    ``max_executions`` runs, then failed with ``handler_error``)."""
    if failure is None:
        return Completed("succeeded", "applied", result=result)
    if isinstance(failure, BusinessFailure):
        return Completed(
            "failed", "none", error=ReceiptError(code=failure.code, message=failure.message[:2000])
        )
    if executions + 1 < max_executions:
        return Deferred(backoff_seconds(executions, base=1))
    return Completed(
        "failed", "none", error=ReceiptError(code="handler_error", message=repr(failure)[:2000])
    )
