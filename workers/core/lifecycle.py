"""The operation lifecycle: a transition table as data and one function over it.

Pure: no I/O. Every transition the engine writes goes through :func:`next_status`
(operations) or :func:`next_instance_status` (instances); the database guards the same
transitions with the expected current status in each UPDATE's WHERE clause.
``docs/lifecycle.md`` is generated from :data:`TRANSITIONS` and :data:`INSTANCE_TABLE`.
"""

from __future__ import annotations

import enum
from typing import Final

from workers.errors import IllegalTransition as IllegalTransition  # under the custody root


class Status(enum.StrEnum):
    PENDING = "pending"
    DISPATCHED = "dispatched"
    ACCEPTED = "accepted"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    RETRY_WAITING = "retry_waiting"
    OUTCOME_UNKNOWN = "outcome_unknown"
    RECONCILE_PENDING = "reconcile_pending"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class Effect(enum.StrEnum):
    NONE = "none"
    APPLIED = "applied"
    UNKNOWN = "unknown"


class InstanceStatus(enum.StrEnum):
    RUNNING = "running"
    SUSPENDED = "suspended"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    COMPLETED = "completed"
    FAILED = "failed"


class Event(enum.StrEnum):
    CONFIRMED = "confirmed"  # the broker confirmed the submit's publication
    ACCEPTED = "receipt.accepted"
    SUCCEEDED = "receipt.succeeded"
    FAILED = "receipt.failed"  # failed, effect none or applied: authoritative
    FAILED_RETRYABLE = "receipt.failed.retryable"  # effect none, and the node may retry
    FAILED_UNKNOWN = "receipt.failed.effect_unknown"
    CANCELLED = "receipt.cancelled"
    # a query found the owner cancelled the work, under a cancel the engine does not
    # hold (a restored engine predates it): authoritative, effect none
    QUERY_CANCELLED = "query.cancelled"
    REJECTED = "receipt.rejected"  # refused before any effect (effect none)
    CONFLICT = "receipt.conflict"  # the owner holds other work under this identity
    DEADLINE = "deadline"
    RESTORED = "restored"  # the engine database was restored: in-flight work may be ahead
    RECONCILE = "reconcile"
    QUERY_NONE = "query.none"  # a query found no (newer) receipt: proves nothing
    QUERY_TIMEOUT = "query.timeout"  # no answer to the query within the deadline
    RETRY_SAFE = "retry_safe"
    CANCEL = "cancel"


TERMINAL: Final = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED})


class Ignore(enum.Enum):
    """The event is valid but no longer changes anything (e.g. a late ``accepted``)."""

    IGNORE = "ignore"


IGNORE: Final = Ignore.IGNORE

S, E = Status, Event
_IN_FLIGHT = (S.PENDING, S.DISPATCHED, S.ACCEPTED)
_UNRESOLVED = (*_IN_FLIGHT, S.OUTCOME_UNKNOWN, S.RECONCILE_PENDING)

TRANSITIONS: Final[dict[tuple[Status, Event], Status | Ignore]] = {
    # The publisher's confirm mark never moves an operation backward.
    (S.PENDING, E.CONFIRMED): S.DISPATCHED,
    **{(s, E.CONFIRMED): IGNORE for s in Status if s is not S.PENDING},
    # Acceptance is progress only while nothing later is known.
    (S.PENDING, E.ACCEPTED): S.ACCEPTED,
    (S.DISPATCHED, E.ACCEPTED): S.ACCEPTED,
    **{
        (s, E.ACCEPTED): IGNORE
        for s in (
            S.ACCEPTED,
            S.SUCCEEDED,
            S.FAILED,
            S.CANCELLED,
            S.CANCELLING,
            S.OUTCOME_UNKNOWN,
            S.RECONCILE_PENDING,
        )
    },
    # Authoritative outcomes resolve every unresolved state, and win a cancel race.
    **{(s, E.SUCCEEDED): S.SUCCEEDED for s in (*_UNRESOLVED, S.CANCELLING)},
    **{(s, E.FAILED): S.FAILED for s in (*_UNRESOLVED, S.CANCELLING)},
    **{(s, E.FAILED_RETRYABLE): S.RETRY_WAITING for s in _UNRESOLVED},
    (S.CANCELLING, E.FAILED_RETRYABLE): S.CANCELLED,
    **{(s, E.FAILED_UNKNOWN): S.OUTCOME_UNKNOWN for s in _UNRESOLVED},
    (S.CANCELLING, E.FAILED_UNKNOWN): S.CANCELLING,
    (S.CANCELLING, E.CANCELLED): S.CANCELLED,
    **{(s, E.QUERY_CANCELLED): S.CANCELLED for s in (*_UNRESOLVED, S.CANCELLING)},
    **{(s, E.REJECTED): S.FAILED for s in _UNRESOLVED},
    (S.CANCELLING, E.REJECTED): S.CANCELLED,
    **{(s, E.CONFLICT): S.OUTCOME_UNKNOWN for s in _UNRESOLVED},
    (S.CANCELLING, E.CONFLICT): S.CANCELLING,
    # A timeout is never permission to create new work: it only suspends.
    **{(s, E.DEADLINE): S.OUTCOME_UNKNOWN for s in _IN_FLIGHT},
    # "A restored engine can predate an effect that already committed elsewhere." Sent
    # work is unknown; a pending operation (never confirmed sent) stays pending: its
    # submit goes out again under the same identity, which the owner deduplicates.
    **{(s, E.RESTORED): S.OUTCOME_UNKNOWN for s in (S.DISPATCHED, S.ACCEPTED)},
    (S.OUTCOME_UNKNOWN, E.RECONCILE): S.RECONCILE_PENDING,
    (S.RECONCILE_PENDING, E.QUERY_NONE): S.OUTCOME_UNKNOWN,
    (S.RECONCILE_PENDING, E.QUERY_TIMEOUT): S.OUTCOME_UNKNOWN,
    (S.RETRY_WAITING, E.RETRY_SAFE): S.PENDING,
    **{(s, E.CANCEL): S.CANCELLING for s in _UNRESOLVED},
    (S.RETRY_WAITING, E.CANCEL): S.CANCELLED,
}


class InstanceEvent(enum.StrEnum):
    SUSPEND = "suspend"  # an outcome unknown, or its pinned version not loaded
    RESUME = "resume"  # resolved, or the version is loaded again
    CANCEL = "cancel"  # an operator's cancel, or the owner cancelled an operation
    SETTLE = "settle"  # a cancelling instance's every operation has authoritative evidence
    COMPLETE = "complete"  # the process reached @completed
    FAIL = "fail"  # the process reached @failed, or an activation cannot be built


IS, IE = InstanceStatus, InstanceEvent
# The instance lifecycle, as data like the operation's. Every instance status change the
# engine writes goes through :func:`next_instance_status` over this table; the database
# refuses any other change (the baseline migration's trigger, over :data:`INSTANCE_TRANSITIONS`).
INSTANCE_TABLE: Final[dict[tuple[InstanceStatus, InstanceEvent], InstanceStatus]] = {
    (IS.RUNNING, IE.SUSPEND): IS.SUSPENDED,
    (IS.SUSPENDED, IE.RESUME): IS.RUNNING,
    (IS.RUNNING, IE.CANCEL): IS.CANCELLING,
    (IS.SUSPENDED, IE.CANCEL): IS.CANCELLING,
    (IS.CANCELLING, IE.SETTLE): IS.CANCELLED,
    (IS.RUNNING, IE.COMPLETE): IS.COMPLETED,
    (IS.RUNNING, IE.FAIL): IS.FAILED,
}
INSTANCE_TERMINAL: Final = frozenset({IS.CANCELLED, IS.COMPLETED, IS.FAILED})
INSTANCE_TRANSITIONS: Final[frozenset[tuple[InstanceStatus, InstanceStatus]]] = frozenset(
    (source, target) for (source, _), target in INSTANCE_TABLE.items()
)


def next_instance_status(status: InstanceStatus | str, event: InstanceEvent) -> InstanceStatus:
    """The instance status after ``event``, or :class:`IllegalTransition`."""
    try:
        return INSTANCE_TABLE[(InstanceStatus(status), event)]
    except (KeyError, ValueError):
        raise IllegalTransition(status, event) from None


def instance_allows(status: InstanceStatus | str, event: InstanceEvent) -> bool:
    """Whether ``event`` changes an instance in ``status`` (the same table)."""
    try:
        next_instance_status(status, event)
    except IllegalTransition:
        return False
    return True


def instance_target(event: InstanceEvent) -> InstanceStatus:
    """The one status ``event`` leads to, from whichever status allows it (what a
    guarded UPDATE sets when the current status is only known to the database)."""
    (target,) = {t for (_, e), t in INSTANCE_TABLE.items() if e is event}
    return target


def status_changes() -> frozenset[tuple[Status, Status]]:
    """Every operation status change the table allows (a change of status, not a
    repeat): what the database's transition guard admits."""
    return frozenset(
        (source, target)
        for (source, _), target in TRANSITIONS.items()
        if isinstance(target, Status) and target is not source
    )


def next_status(status: Status, event: Event) -> Status | Ignore:
    """The status after ``event``, :data:`IGNORE`, or :class:`IllegalTransition`."""
    try:
        return TRANSITIONS[(status, event)]
    except KeyError:
        raise IllegalTransition(status, event) from None


def receipt_event(
    status: str,
    effect: str,
    error_code: str | None,
    *,
    retryable: bool = False,
    answer: bool = False,
) -> Event:
    """Map a validated receipt's (status, effect) to the lifecycle event it is.

    ``retryable``: the node's retry policy allows another attempt for this error. A
    retry is only ever planned on an authoritative effect ``none``. ``answer``: the
    receipt came inside a query answer.
    """
    if status == "cancelled" and answer:
        return Event.QUERY_CANCELLED
    if status == "accepted":
        return Event.ACCEPTED
    if status == "succeeded":
        return Event.SUCCEEDED
    if status == "failed":
        if effect == "unknown":
            return Event.FAILED_UNKNOWN
        if effect == "none" and retryable:
            return Event.FAILED_RETRYABLE
        return Event.FAILED
    if status == "cancelled":
        return Event.CANCELLED
    if error_code == "digest_conflict":
        return Event.CONFLICT
    return Event.REJECTED


def mermaid() -> str:
    """The state diagram, generated from the table so it cannot drift."""
    lines = ["stateDiagram-v2", "    [*] --> pending"]
    for (source, event), target in TRANSITIONS.items():
        if target is IGNORE or target == source:
            continue
        lines.append(f"    {source.value} --> {target.value}: {event.value}")
    lines.extend(f"    {s.value} --> [*]" for s in sorted(TERMINAL))
    return "\n".join(lines) + "\n"


def instance_mermaid() -> str:
    """The instance state diagram, generated from :data:`INSTANCE_TABLE`."""
    lines = ["stateDiagram-v2", "    [*] --> running"]
    for (source, event), target in INSTANCE_TABLE.items():
        lines.append(f"    {source.value} --> {target.value}: {event.value}")
    lines.extend(f"    {s.value} --> [*]" for s in sorted(INSTANCE_TERMINAL))
    return "\n".join(lines) + "\n"
