"""The operation lifecycle (DESIGN §3): the transition table, checked exhaustively.

Every (status, event) pair is checked against the table, then the properties the seed
requires are checked over the whole table rather than over a few examples.
"""

from __future__ import annotations

import itertools
import re
from collections import deque
from pathlib import Path

import pytest

from workers.core import lifecycle
from workers.core.lifecycle import (
    IGNORE,
    TERMINAL,
    TRANSITIONS,
    Effect,
    Event,
    IllegalTransition,
    InstanceStatus,
    Status,
    next_status,
)

ROOT = Path(__file__).resolve().parents[2]
ALL_PAIRS = list(itertools.product(Status, Event))
IN_FLIGHT = (Status.PENDING, Status.DISPATCHED, Status.ACCEPTED)
OPERATOR_AND_TIMER_EVENTS = (
    Event.CONFIRMED,
    Event.DEADLINE,
    Event.RECONCILE,
    Event.QUERY_NONE,
    Event.QUERY_TIMEOUT,
    Event.RETRY_SAFE,
    Event.CANCEL,
)


def outcome(status: Status, event: Event) -> Status | lifecycle.Ignore | None:
    """next_status, with ``None`` standing for IllegalTransition."""
    try:
        return next_status(status, event)
    except IllegalTransition:
        return None


# --- the table itself --------------------------------------------------------------


@pytest.mark.parametrize(("status", "event"), ALL_PAIRS, ids=lambda v: v.value)
def test_next_status_returns_the_table_entry_or_refuses_the_pair(
    status: Status, event: Event
) -> None:
    """next_status returns exactly the table's value, or refuses the pair with
    IllegalTransition carrying the status and event (an integrity violation). That the
    engine's writes go through the table is checked on a real run:
    tests/integration/test_seed_rules.py::
    test_every_status_change_the_engine_writes_is_a_transition_of_the_table."""
    if (status, event) in TRANSITIONS:
        assert next_status(status, event) is TRANSITIONS[(status, event)]
    else:
        with pytest.raises(IllegalTransition) as info:
            next_status(status, event)
        assert info.value.status is status
        assert info.value.event is event
        assert status.value in str(info.value)
        assert event.value in str(info.value)


def test_the_table_only_names_real_statuses_and_events() -> None:
    for (source, event), target in TRANSITIONS.items():
        assert isinstance(source, Status)
        assert isinstance(event, Event)
        assert target is IGNORE or isinstance(target, Status)


def test_terminal_statuses_are_succeeded_failed_and_cancelled() -> None:
    """Terminal: succeeded, failed, cancelled."""
    assert frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED}) == TERMINAL


# --- properties the seed and the design require ----------------------------------


@pytest.mark.parametrize("status", sorted(TERMINAL), ids=str)
def test_a_terminal_status_is_never_left(status: Status) -> None:
    """Terminal statuses are final: every event is either ignored or refused."""
    for event in Event:
        assert outcome(status, event) in (IGNORE, None), event


@pytest.mark.parametrize("status", list(Status), ids=str)
def test_the_confirm_mark_never_moves_an_operation_backward(status: Status) -> None:
    """Receipts may overtake the publisher's confirm mark: the mark never moves an
    operation backward. Only a pending operation becomes dispatched; any later status
    ignores the confirm."""
    expected = Status.DISPATCHED if status is Status.PENDING else IGNORE
    assert next_status(status, Event.CONFIRMED) is expected


def test_a_timeout_never_creates_new_work() -> None:
    """A timeout can produce OutcomeUnknown. It does not interpret timeout as
    permission to create a new operation: DEADLINE only ever yields outcome_unknown,
    and only from the in-flight statuses."""
    for status in Status:
        result = outcome(status, Event.DEADLINE)
        if status in IN_FLIGHT:
            assert result is Status.OUTCOME_UNKNOWN, status
        else:
            assert result is None, status


def test_the_reconciler_sweeps_exactly_the_statuses_a_deadline_applies_to() -> None:
    """The reconciler asserts next_status(DEADLINE) for every row operations_overdue
    selects: the SQL status list and the table must agree, or the reconciler crashes."""
    text = (ROOT / "queries.sql").read_text()
    block = re.search(r"-- name: operations_overdue\n(.*?);", text, re.S)
    assert block is not None
    # one scan per status swept (WHERE status = '...'), the comment lines aside
    body = "\n".join(line for line in block.group(1).splitlines() if not line.startswith("--"))
    swept = set(re.findall(r"WHERE status = '(\w+)'", body))
    legal = {s.value for s in Status if outcome(s, Event.DEADLINE) is not None}
    assert swept == legal


@pytest.mark.parametrize("event", [e for e in Event if e is not Event.SUCCEEDED], ids=str)
def test_nothing_but_a_succeeded_receipt_yields_succeeded(event: Event) -> None:
    """No command sets succeeded by assertion; unknown effects cannot become success
    through an operator assertion or blind replay."""
    for status in Status:
        if status is Status.SUCCEEDED:
            continue  # staying succeeded (IGNORE) is not "becoming" succeeded
        assert outcome(status, event) is not Status.SUCCEEDED, status


@pytest.mark.parametrize("event", OPERATOR_AND_TIMER_EVENTS, ids=str)
@pytest.mark.parametrize("status", list(Status), ids=str)
def test_no_operator_or_timer_event_sets_an_authoritative_outcome(
    status: Status, event: Event
) -> None:
    """Reconcile, retry-safe, cancel, a null query answer, a deadline and a confirm
    never set succeeded or failed: only the executor's authoritative receipt does."""
    assert outcome(status, event) not in (Status.SUCCEEDED, Status.FAILED)


def test_retry_safe_only_from_retry_waiting() -> None:
    """The action retry-safe requires authoritative RetryWaiting: it keeps the
    operation and creates the allowed new attempt (back to pending)."""
    for status in Status:
        result = outcome(status, Event.RETRY_SAFE)
        if status is Status.RETRY_WAITING:
            assert result is Status.PENDING
        else:
            assert result is None, status


def test_only_retry_safe_creates_a_new_attempt() -> None:
    """Nothing else creates a new attempt for an operation whose effect is unknown:
    the only way back to pending is retry_safe from retry_waiting."""
    into_pending = {
        (s, e) for (s, e), t in TRANSITIONS.items() if t is Status.PENDING and s is not t
    }
    assert into_pending == {(Status.RETRY_WAITING, Event.RETRY_SAFE)}


def test_a_success_that_wins_the_cancel_race_stays_succeeded() -> None:
    """A success that wins the race remains Succeeded on the operation."""
    assert next_status(Status.CANCELLING, Event.SUCCEEDED) is Status.SUCCEEDED
    for event in Event:
        assert outcome(Status.SUCCEEDED, event) in (IGNORE, None), event


def test_cancelling_remains_until_authoritative_evidence_resolves_it() -> None:
    """Work with an unresolved effect remains Cancelling until authoritative evidence
    resolves it: an unknown-effect failure or a conflict keep it cancelling, no timer
    or operator event moves it, only succeeded/failed/cancelled/rejected receipts end it."""
    authoritative = {
        Event.SUCCEEDED: Status.SUCCEEDED,
        Event.FAILED: Status.FAILED,
        Event.CANCELLED: Status.CANCELLED,
        # a query found the owner's cancelled receipt (the answer to the cancel itself
        # may have been lost, e.g. in a restore): the same evidence
        Event.QUERY_CANCELLED: Status.CANCELLED,
        Event.REJECTED: Status.CANCELLED,
        # failed with effect none: nothing happened, so the cancel wins
        Event.FAILED_RETRYABLE: Status.CANCELLED,
    }
    for event in Event:
        result = outcome(Status.CANCELLING, event)
        if event in authoritative:
            assert result is authoritative[event], event
        else:
            assert result in (Status.CANCELLING, IGNORE, None), event


def test_a_cancelled_receipt_settles_only_a_cancelling_operation() -> None:
    """Cancel -> cancelling until a cancelled receipt: a cancelled receipt for an
    operation nobody asked to cancel is an integrity violation."""
    for status in Status:
        result = outcome(status, Event.CANCELLED)
        if status is Status.CANCELLING:
            assert result is Status.CANCELLED
        else:
            assert result in (IGNORE, None), status


@pytest.mark.parametrize("event", [Event.QUERY_NONE, Event.QUERY_TIMEOUT], ids=str)
def test_a_null_query_result_is_not_proof_of_no_effect(event: Event) -> None:
    """A null query result means no receipt was returned; it is not proof that no
    effect occurred: reconcile_pending goes back to outcome_unknown, and a query that
    found nothing (or got no answer) never ends or restarts an operation."""
    assert next_status(Status.RECONCILE_PENDING, event) is Status.OUTCOME_UNKNOWN
    for status in Status:
        if status is not Status.RECONCILE_PENDING:
            assert outcome(status, event) is None, status


def test_reconcile_records_a_query_intent_only_for_an_unknown_outcome() -> None:
    """The recovery action reconcile records a query intent, represented as
    ReconcilePending."""
    for status in Status:
        result = outcome(status, Event.RECONCILE)
        if status is Status.OUTCOME_UNKNOWN:
            assert result is Status.RECONCILE_PENDING
        else:
            assert result is None, status


def test_query_results_resolve_a_reconcile_like_any_receipt() -> None:
    """Query results pass through the same receipt validation path as ordinary
    responses: an authoritative receipt resolves reconcile_pending."""
    assert next_status(Status.RECONCILE_PENDING, Event.SUCCEEDED) is Status.SUCCEEDED
    assert next_status(Status.RECONCILE_PENDING, Event.FAILED) is Status.FAILED
    assert next_status(Status.RECONCILE_PENDING, Event.FAILED_UNKNOWN) is Status.OUTCOME_UNKNOWN


def test_an_unknown_effect_failure_is_not_a_failure() -> None:
    """A failed receipt with effect unknown does not settle the operation."""
    for status in Status:
        assert outcome(status, Event.FAILED_UNKNOWN) not in TERMINAL, status


def test_a_late_accepted_receipt_changes_nothing() -> None:
    """Acceptance is progress only while nothing later is known."""
    assert next_status(Status.PENDING, Event.ACCEPTED) is Status.ACCEPTED
    assert next_status(Status.DISPATCHED, Event.ACCEPTED) is Status.ACCEPTED
    for status in Status:
        if status not in (Status.PENDING, Status.DISPATCHED):
            assert outcome(status, Event.ACCEPTED) in (IGNORE, None), status


def test_every_unresolved_status_has_a_way_out() -> None:
    """No operation is stuck: every non-terminal status has an event leading elsewhere."""
    for status in Status:
        if status in TERMINAL:
            continue
        exits = {t for e in Event if isinstance(t := outcome(status, e), Status)} - {status}
        assert exits, status


def _reachable_from_pending() -> set[Status]:
    seen = {Status.PENDING}
    queue = deque(seen)
    while queue:
        current = queue.popleft()
        for event in Event:
            target = outcome(current, event)
            if isinstance(target, Status) and target not in seen:
                seen.add(target)
                queue.append(target)
    return seen


@pytest.mark.parametrize("status", list(Status), ids=str)
def test_every_status_is_reachable_from_pending(status: Status) -> None:
    """No status is dead: in particular the action retry-safe requires authoritative
    RetryWaiting, so some validated receipt must put an operation in retry_waiting."""
    assert status in _reachable_from_pending()


def test_retry_waiting_is_entered_only_by_a_retryable_failure() -> None:
    """The action retry-safe requires authoritative RetryWaiting with effect none: only
    a failed receipt that receipt_event marks retryable (effect none) leads there."""
    into = {e for (s, e), t in TRANSITIONS.items() if t is Status.RETRY_WAITING and s is not t}
    assert into == {Event.FAILED_RETRYABLE}


# --- receipt_event -----------------------------------------------------------------

RECEIPT_EVENTS = [
    ("accepted", "none", None, False, Event.ACCEPTED),
    ("accepted", "unknown", None, False, Event.ACCEPTED),
    ("succeeded", "applied", None, False, Event.SUCCEEDED),
    ("failed", "none", "declined", False, Event.FAILED),
    ("failed", "none", "busy", True, Event.FAILED_RETRYABLE),
    ("failed", "applied", "partial", False, Event.FAILED),
    ("failed", "applied", "partial", True, Event.FAILED),
    ("failed", "unknown", "timeout", False, Event.FAILED_UNKNOWN),
    ("failed", "unknown", "timeout", True, Event.FAILED_UNKNOWN),
    ("cancelled", "none", None, False, Event.CANCELLED),
    ("rejected", "none", "unknown_operation", False, Event.REJECTED),
    ("rejected", "none", None, False, Event.REJECTED),
    ("rejected", "none", "digest_conflict", False, Event.CONFLICT),
]


@pytest.mark.parametrize(("status", "effect", "code", "retryable", "event"), RECEIPT_EVENTS)
def test_receipt_event_maps_a_validated_receipt_to_its_lifecycle_event(
    status: str, effect: str, code: str | None, retryable: bool, event: Event
) -> None:
    """failed with effect unknown is not authoritative; a retry is only planned on an
    authoritative effect none; a digest conflict ("Reusing that identity with changed
    input conflicts") is its own event."""
    assert lifecycle.receipt_event(status, effect, code, retryable=retryable) is event


def test_receipt_event_covers_every_receipt_status() -> None:
    from typing import get_args

    from contracts.models import CommandStatus

    mapped = {s for s, _, _, _, _ in RECEIPT_EVENTS}
    assert mapped == set(get_args(CommandStatus))


@pytest.mark.parametrize("retryable", [False, True])
@pytest.mark.parametrize("effect", ["none", "applied", "unknown"])
@pytest.mark.parametrize("status", ["accepted", "succeeded", "failed", "cancelled", "rejected"])
def test_only_an_authoritative_effect_none_can_plan_a_retry(
    status: str, effect: str, retryable: bool
) -> None:
    """Retry-safe requires authoritative RetryWaiting with effect none: whatever a node's
    retry policy says, a receipt with an applied or unknown effect never plans one, and
    neither does a receipt that is not a failure."""
    for code in (None, "busy", "digest_conflict"):
        event = lifecycle.receipt_event(status, effect, code, retryable=retryable)
        if event is Event.FAILED_RETRYABLE:
            assert (status, effect, retryable) == ("failed", "none", True)


# --- the published diagram and the database enums ---------------------------------


def test_docs_lifecycle_diagram_is_the_current_table() -> None:
    """docs/lifecycle.md is generated from TRANSITIONS (and, second, INSTANCE_TABLE) so
    it cannot drift. Regenerate both blocks with: .venv/bin/python scripts/gen_docs.py"""
    text = (ROOT / "docs" / "lifecycle.md").read_text()
    blocks = re.findall(r"```mermaid\n(.*?)```", text, re.S)
    assert blocks[0] == lifecycle.mermaid(), "docs/lifecycle.md is stale: regenerate its diagram"
    assert blocks == [lifecycle.mermaid(), lifecycle.instance_mermaid()], (
        "docs/lifecycle.md is stale: regenerate its diagrams"
    )


def test_the_instance_table_is_the_instance_transitions_and_next_instance_status() -> None:
    """One table: INSTANCE_TRANSITIONS is its pairs, next_instance_status reads it, and
    any other (status, event) is an IllegalTransition; a terminal instance is never left."""
    from workers.core.lifecycle import (
        INSTANCE_TABLE,
        INSTANCE_TERMINAL,
        INSTANCE_TRANSITIONS,
        InstanceEvent,
        next_instance_status,
    )

    assert {(s, t) for (s, _), t in INSTANCE_TABLE.items()} == INSTANCE_TRANSITIONS
    for status in InstanceStatus:
        for event in InstanceEvent:
            if (status, event) in INSTANCE_TABLE:
                assert next_instance_status(status, event) is INSTANCE_TABLE[(status, event)]
                assert lifecycle.instance_target(event) is INSTANCE_TABLE[(status, event)]
            else:
                with pytest.raises(IllegalTransition):
                    next_instance_status(status, event)
            if status in INSTANCE_TERMINAL:
                assert not lifecycle.instance_allows(status, event)
    diagram = lifecycle.instance_mermaid()
    for (source, event), target in INSTANCE_TABLE.items():
        assert f"    {source.value} --> {target.value}: {event.value}\n" in diagram


def test_the_diagram_shows_every_status_changing_transition() -> None:
    diagram = lifecycle.mermaid()
    for (source, event), target in TRANSITIONS.items():
        line = f"    {source.value} --> {getattr(target, 'value', '')}: {event.value}\n"
        changes = isinstance(target, Status) and target is not source
        assert (line in diagram) is changes, line
    for status in TERMINAL:
        assert f"    {status.value} --> [*]\n" in diagram


def _sql_enum(type_name: str) -> list[str]:
    # the baseline migration; a later migration that adds a value (ALTER TYPE ... ADD
    # VALUE) makes this read the migrations in order
    text = (ROOT / "migrations" / "0001_baseline.sql").read_text()
    match = re.search(rf"CREATE TYPE {re.escape(type_name)} AS ENUM \((.*?)\);", text, re.S | re.I)
    assert match is not None, type_name
    return re.findall(r"'([^']*)'", match.group(1))


@pytest.mark.parametrize(
    ("type_name", "enum"),
    [
        ("custody.operation_status", Status),
        ("custody.effect", Effect),
        ("custody.instance_status", InstanceStatus),
    ],
)
def test_python_enums_match_the_schema_enums(type_name: str, enum: type) -> None:
    """The schema is the truth: Python enums are tested against its types."""
    assert _sql_enum(type_name) == [m.value for m in enum]  # type: ignore[attr-defined]


def _schema_pairs(table: str) -> set[tuple[str, str]]:
    from workers.settings import ROOT

    text = (ROOT / "migrations" / "0001_baseline.sql").read_text()
    start = text.index(f"INSERT INTO custody.{table} (from_status, to_status) VALUES")
    values = text[start : text.index(";", start)]
    return set(re.findall(r"\('([a-z_]+)', '([a-z_]+)'\)", values))


def test_the_database_guard_allows_exactly_the_lifecycle_tables_changes() -> None:
    """The baseline migration's transition tables (the trigger that refuses any other status change,
    whoever attempts it) are the Python lifecycle's, pair for pair."""
    from workers.core.lifecycle import INSTANCE_TRANSITIONS, status_changes

    ops = {(a.value, b.value) for a, b in status_changes()}
    assert _schema_pairs("operation_transitions") == ops
    instances = {(a.value, b.value) for a, b in INSTANCE_TRANSITIONS}
    assert _schema_pairs("instance_transitions") == instances
    assert ("failed", "succeeded") not in ops and ("cancelled", "succeeded") not in ops


# the events the database's controlled commands take (transitions.sql)
COMMAND_EVENTS = ("cancel", "reconcile", "restored", "retry_safe")


def test_the_controlled_commands_follow_the_lifecycle_table_event_for_event() -> None:
    """The seed: "Operators use controlled recovery commands rather than editing runtime
    rows directly." Those commands live in the database (transitions.sql) and look each
    transition up in custody.operation_events: that table is the Python lifecycle's,
    row for row, for every event a command takes."""
    from workers.core.lifecycle import TRANSITIONS, Status
    from workers.settings import ROOT

    text = (ROOT / "transitions.sql").read_text()
    start = text.index("INSERT INTO custody.operation_events (from_status, event, to_status)")
    rows = set(
        re.findall(
            r"\('([a-z_]+)', '([a-z_]+)', '([a-z_]+)'\)", text[start : text.index(";", start)]
        )
    )
    expected = {
        (source.value, event.value, target.value)
        for (source, event), target in TRANSITIONS.items()
        if event.value in COMMAND_EVENTS and isinstance(target, Status)
    }
    assert rows == expected
