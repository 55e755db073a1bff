"""The one pure classifier of what is retryable (workers/errors.py).

"A connection cut during COMMIT leaves the outcome in doubt: re-read by identity (or
pg_xact_status), never redo blindly." "A commit checks, inside its own transaction,
that the worker's lease is still current; a worker that was paused past its lease (a
zombie) cannot commit."
"""

from __future__ import annotations

import itertools

import pytest

from workers import errors
from workers.errors import (
    FENCE_SQLSTATE,
    BrokerError,
    ConfigError,
    CustodyError,
    DatabaseError,
    Fenced,
    Retry,
    classify_sqlstate,
)

BOTH = pytest.mark.parametrize("during_commit", [False, True], ids=["statement", "commit"])


@BOTH
def test_the_fence_code_means_our_lease_is_gone(during_commit: bool) -> None:
    """A zombie worker cannot commit: CU001 is FENCED, never retried as such."""
    assert FENCE_SQLSTATE == "CU001"
    assert classify_sqlstate("CU001", during_commit=during_commit) is Retry.FENCED


@BOTH
@pytest.mark.parametrize("sqlstate", ["40001", "40P01"], ids=["serialization", "deadlock"])
def test_serialization_failures_and_deadlocks_are_redone(
    sqlstate: str, during_commit: bool
) -> None:
    """The transaction was rolled back, even when reported at COMMIT: redo it whole."""
    assert classify_sqlstate(sqlstate, during_commit=during_commit) is Retry.RETRY


@pytest.mark.parametrize("sqlstate", [None, "08000", "08003", "08006", "08001", "08P01"])
def test_a_connection_lost_during_commit_leaves_the_outcome_in_doubt(
    sqlstate: str | None,
) -> None:
    """A connection cut during COMMIT leaves the outcome in doubt."""
    assert classify_sqlstate(sqlstate, during_commit=True) is Retry.IN_DOUBT


@pytest.mark.parametrize("sqlstate", [None, "08000", "08003", "08006", "08001", "08P01"])
def test_a_connection_lost_before_commit_is_redone(sqlstate: str | None) -> None:
    """Nothing was committed: the unit of work is redone whole."""
    assert classify_sqlstate(sqlstate, during_commit=False) is Retry.RETRY


@pytest.mark.parametrize(
    "sqlstate",
    ["55P03", "57014", "25P03", "53300", "57P01", "57P02", "57P03", "53100"],
)
def test_transient_server_conditions_before_commit_are_redone(sqlstate: str) -> None:
    """Lock and statement timeouts, too many connections, a server shutting down or
    a full disk: nothing committed, the unit of work is redone once it passes."""
    assert classify_sqlstate(sqlstate, during_commit=False) is Retry.RETRY


@BOTH
@pytest.mark.parametrize(
    "sqlstate", ["23505", "23503", "23514", "22P02", "42804", "XX000", "P0001", "CU002", ""]
)
def test_everything_else_is_fatal(sqlstate: str, during_commit: bool) -> None:
    """A unit that cannot succeed (a bug, or a message that triggers one): redoing it
    would only fail again, so it is not retried (a consumer isolates the message)."""
    assert classify_sqlstate(sqlstate, during_commit=during_commit) is Retry.FATAL


@BOTH
@pytest.mark.parametrize("sqlstate", ["42501", "42P01", "42703", "42601", "3F000", "28P01"])
def test_a_broken_deployment_is_nobody_s_message(sqlstate: str, during_commit: bool) -> None:
    """Missing grants, tables, columns or schemas, or a bad login: every message would
    fail the same way, so none is dead-lettered; the worker stops instead."""
    assert classify_sqlstate(sqlstate, during_commit=during_commit) is Retry.BROKEN


def test_fenced_is_a_database_error_and_every_error_is_a_custody_error() -> None:
    fenced = Fenced("lease lost", Retry.FENCED, FENCE_SQLSTATE)
    assert isinstance(fenced, DatabaseError)
    assert (fenced.kind, fenced.sqlstate) == (Retry.FENCED, "CU001")
    assert BrokerError("nack", Retry.RETRY).kind is Retry.RETRY
    for cls in (ConfigError, DatabaseError, Fenced, BrokerError):
        assert issubclass(cls, CustodyError)


def test_backoff_grows_exponentially_and_is_capped() -> None:
    delays = [errors.backoff_seconds(n) for n in range(40)]
    assert delays[0] == pytest.approx(0.2)
    assert delays[1] == pytest.approx(0.4)
    assert all(a <= b for a, b in itertools.pairwise(delays))
    assert max(delays) == 30.0
    assert errors.backoff_seconds(10_000) == 30.0
    assert errors.backoff_seconds(3, base=1.0, cap=5.0) == 5.0
