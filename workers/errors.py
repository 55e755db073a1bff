"""One root error class, and the one pure classifier of what is retryable.

psycopg errors are translated in ``workers.io.db`` and aio-pika errors in
``workers.io.broker``, each with ``raise … from``; nothing else catches them.
"""

from __future__ import annotations

import enum


class CustodyError(Exception):
    """Root of every error custody raises on purpose."""


class ConfigError(CustodyError):
    """Configuration is missing or invalid: refuse to start, say what and why."""


class RouteConfigError(ConfigError, ValueError):
    """The routes file is missing, unreadable or invalid (one line says which and why)."""


class DefinitionError(CustodyError, ValueError):
    """A process definition is malformed, does not fit the routes, or is not loaded."""


class InputError(CustodyError, ValueError):
    """An input template references data that is not there."""


class IllegalTransition(CustodyError, ValueError):
    """An event is not allowed in the current status (an integrity violation).

    ``status`` and ``event`` are the lifecycle's enum members (``workers.core.lifecycle``
    raises it for operations and instances alike)."""

    def __init__(self, status: str, event: str) -> None:
        super().__init__(f"{event} is not allowed from {status}")
        self.status = status
        self.event = event


class Refused(CustodyError):
    """A request was refused on purpose, with a closed reason code (``Reason``)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class BusinessFailure(CustodyError):
    """A participant's handler decided the work fails; its effects are rolled back
    (effect none) and the receipt carries ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Retry(enum.Enum):
    RETRY = "retry"  # transient: redo the whole unit of work
    IN_DOUBT = "in_doubt"  # commit outcome unknown: re-read by identity, then redo
    FENCED = "fenced"  # our lease is gone: stop, re-acquire
    BROKEN = "broken"  # a broken deployment (grants, schema): no message is to blame
    FATAL = "fatal"  # this unit cannot succeed: a bug, or a message that triggers one


class DatabaseError(CustodyError):
    def __init__(self, message: str, kind: Retry, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.sqlstate = sqlstate


class Fenced(DatabaseError):
    """The worker's lease epoch is no longer current; its commit was refused."""


class RowChanged(DatabaseError):
    """A row changed under its row lock (an UPDATE guarded by the status it was read
    with matched fewer rows than were locked): redo the whole unit of work, re-reading
    everything. The Python twin of SQLSTATE CU004, classified the same (RETRY)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, classify_sqlstate(ROW_CHANGED_SQLSTATE, during_commit=False))
        self.sqlstate = ROW_CHANGED_SQLSTATE


class BrokerError(CustodyError):
    """RabbitMQ refused or lost something; ``kind`` says whether to retry."""

    def __init__(self, message: str, kind: Retry) -> None:
        super().__init__(message)
        self.kind = kind


FENCE_SQLSTATE = "CU001"
ROW_CHANGED_SQLSTATE = "CU004"
_RETRYABLE_SQLSTATES = frozenset(
    {
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available
        "CU004",  # a row changed under its lock (transitions.sql): redo, re-reading all
        "57014",  # query_canceled (statement timeout)
        "25P03",  # idle_in_transaction_session_timeout
        "53300",  # too_many_connections
        "57P01",
        "57P02",
        "57P03",  # admin shutdown, crash shutdown, cannot connect now
        "08000",
        "08003",
        "08006",
        "08001",
        "08004",  # connection exceptions
        "53100",  # disk_full: writes fail, nothing is acked, retried once space is back
    }
)


# class-42 states a message's content can cause (so they stay FATAL, i.e. poison)
_MESSAGE_SQLSTATES = frozenset({"42804", "42P18"})  # datatype mismatch, indeterminate type


def classify_sqlstate(sqlstate: str | None, *, during_commit: bool) -> Retry:
    """Whether a Postgres failure is worth redoing the unit of work for."""
    if sqlstate == FENCE_SQLSTATE:
        return Retry.FENCED
    if sqlstate is None or sqlstate.startswith("08"):
        # No SQLSTATE means the connection broke: if it broke during COMMIT the
        # outcome is unknown and the redo must re-read by identity (ours do).
        return Retry.IN_DOUBT if during_commit else Retry.RETRY
    if sqlstate in _RETRYABLE_SQLSTATES:
        return Retry.RETRY
    if sqlstate.startswith(("42", "3F", "28")) and sqlstate not in _MESSAGE_SQLSTATES:
        # insufficient privilege, undefined table or column, no such schema, bad login:
        # the deployment is wrong, and every message would fail the same way
        return Retry.BROKEN
    return Retry.FATAL


def backoff_seconds(attempt: int, *, base: float = 0.2, cap: float = 30.0) -> float:
    """Exponential backoff without jitter (callers add jitter where herds form)."""
    return float(min(cap, base * 2 ** min(attempt, 16)))
