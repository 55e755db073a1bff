"""Receipt validation (DESIGN §4): one path for replies and query answers.

"ApplyReceiptAsync validates the receipt/result schema and the exact tenant, owner,
principal, operation, attempt and request identity. Older owner revisions cannot roll
state backward. A repeated owner revision with changed content is rejected."

The checks run in a fixed order; the first failure decides, with a stable reason.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from contracts import digest, identity
from contracts.models import OperationReceipt, ReceiptError
from workers.core import lifecycle
from workers.core.lifecycle import Effect, Status
from workers.core.validation import (
    REASONS,
    Decision,
    IssuedRequest,
    OperationView,
    Verdict,
    decide,
)

FAST = settings(deadline=None, database=None, max_examples=200)
T0 = datetime(2024, 1, 1, 12, 0, tzinfo=UTC)

INSTANCE = identity.instance_id("acme", "3f0b6c1e-8a1d-4d2b-9f3a-2c5e7d9b1a00")
OP = identity.operation_id("acme", INSTANCE, "reserve", 1)
OTHER_OP = identity.operation_id("acme", INSTANCE, "charge", 1)
SUBMIT_1 = identity.request_id(OP, 1, "submit")
SUBMIT_2 = identity.request_id(OP, 2, "submit")
QUERY_1 = identity.request_id(OP, 1, "query")
CANCEL_1 = identity.request_id(OP, 1, "cancel")
OTHER_SUBMIT = identity.request_id(OTHER_OP, 1, "submit")
NEVER_ISSUED = identity.request_id(OP, 9, "submit")
DIGEST_1 = "d1" * 32
DIGEST_2 = "d2" * 32
USER = "custody-inventory"

ISSUED: dict[str, IssuedRequest] = {
    SUBMIT_1: IssuedRequest(SUBMIT_1, OP, 1, "submit", DIGEST_1),
    QUERY_1: IssuedRequest(QUERY_1, OP, 1, "query", DIGEST_1),
    CANCEL_1: IssuedRequest(CANCEL_1, OP, 1, "cancel", DIGEST_1),
    OTHER_SUBMIT: IssuedRequest(OTHER_SUBMIT, OTHER_OP, 1, "submit", DIGEST_1),
}


def op_view(**changes: Any) -> OperationView:
    values: dict[str, Any] = {
        "id": OP,
        "tenant": "acme",
        "owner": "inventory",
        "principal": USER,
        "attempt": 1,
        "status": Status.DISPATCHED,
        "effect": Effect.UNKNOWN,
        "owner_revision": 0,
        "receipt_hash": None,
    }
    values.update(changes)
    return OperationView(**values)


def receipt(**changes: Any) -> OperationReceipt:
    revision = changes.get("owner_revision", 1)
    values: dict[str, Any] = {
        "receipt_id": identity.receipt_id(changes.get("request_id", SUBMIT_1), revision),
        "tenant": "acme",
        "operation_id": OP,
        "attempt": 1,
        "request_id": SUBMIT_1,
        "in_reply_to": SUBMIT_1,
        "owner": "inventory",
        "principal": USER,
        "command_digest": DIGEST_1,
        "owner_revision": 1,
        "status": "succeeded",
        "effect": "applied",
        "result": {"reservation_id": "r-1"},
        "error": None,
        "emitted_at": T0,
    }
    values.update(changes)
    return OperationReceipt(**values)


def run(
    r: OperationReceipt,
    *,
    user_id: str | None = USER,
    op: OperationView | bool | None = True,
    issued: dict[str, IssuedRequest] | None = None,
    seen_hash: str | None = None,
    retryable: bool = False,
) -> Decision:
    view = op_view() if op is True else op
    assert view is not False
    return decide(
        r,
        user_id=user_id,
        op=view,
        issued=ISSUED if issued is None else issued,
        seen_hash=seen_hash,
        retryable=retryable,
    )


def hash_of(r: OperationReceipt) -> str:
    return digest.content_hash(r.content())


def assert_quarantined(decision: Decision, reason: str) -> None:
    assert decision.verdict is Verdict.QUARANTINE
    assert decision.reason == reason
    assert reason in REASONS
    assert decision.status is None
    assert decision.effect is None


# --- a valid receipt ------------------------------------------------------------------


def test_a_valid_receipt_is_applied_with_its_result_status_and_content_hash() -> None:
    """Successful application records the result: the decision carries the new status,
    the effect and the content hash to store."""
    r = receipt()
    decision = run(r)
    assert decision.verdict is Verdict.APPLY
    assert decision.status is Status.SUCCEEDED
    assert decision.effect is Effect.APPLIED
    assert decision.content_hash == hash_of(r)


def test_a_receipt_overtaking_the_confirm_mark_is_applied() -> None:
    """Receipts may overtake the publisher's confirm mark."""
    decision = run(receipt(status="accepted", effect="none"), op=op_view(status=Status.PENDING))
    assert decision.verdict is Verdict.APPLY
    assert decision.status is Status.ACCEPTED


# --- one test per rule, in the design's order ------------------------------------------


def test_a_known_receipt_id_with_the_same_content_is_a_duplicate() -> None:
    """The same command identity with the same semantic input returns the existing
    receipt: a redelivered receipt is a no-op, whatever its transport facts."""
    r = receipt()
    redelivered = r.model_copy(update={"emitted_at": T0 + timedelta(seconds=5)})
    decision = run(redelivered, seen_hash=hash_of(r))
    assert decision.verdict is Verdict.DUPLICATE
    assert decision.status is None


def test_a_known_receipt_id_with_different_content_is_quarantined_as_reuse() -> None:
    decision = run(receipt(), seen_hash=hash_of(receipt(result={"reservation_id": "r-2"})))
    assert_quarantined(decision, "receipt_id_reuse")


def test_a_receipt_for_another_tenant_is_quarantined() -> None:
    """validates ... the exact tenant"""
    assert_quarantined(run(receipt(tenant="globex")), "wrong_tenant")


def test_a_delivery_without_a_broker_validated_user_id_is_quarantined() -> None:
    """The broker-validated user_id is the only proof of who published the receipt."""
    assert_quarantined(run(receipt(), user_id=None), "missing_user_id")
    assert_quarantined(run(receipt(), user_id=""), "missing_user_id")


def test_a_receipt_claiming_another_principal_than_its_publisher_is_quarantined() -> None:
    """validates ... the exact principal: the broker user must be the claimed one."""
    assert_quarantined(run(receipt(), user_id="custody-payments"), "principal_mismatch")


@pytest.mark.parametrize(
    "changes",
    [{"owner": "payments"}, {"principal": "custody-payments"}],
    ids=["owner", "principal"],
)
def test_a_receipt_from_another_owner_than_the_pinned_route_is_quarantined(
    changes: dict[str, str],
) -> None:
    """validates ... the exact owner: instances pin the route used for their
    operations, and new configuration cannot redirect existing work."""
    r = receipt(**changes)
    assert_quarantined(run(r, user_id=r.principal), "wrong_owner")


def test_a_receipt_for_an_unknown_operation_is_quarantined() -> None:
    assert_quarantined(run(receipt(), op=None), "unknown_operation")


@pytest.mark.parametrize(
    "changes",
    [
        {"request_id": NEVER_ISSUED},
        {"request_id": QUERY_1},
        {"request_id": CANCEL_1},
        {"request_id": OTHER_SUBMIT},
        {"attempt": 2},
        {"in_reply_to": NEVER_ISSUED},
        {"in_reply_to": OTHER_SUBMIT},
    ],
    ids=[
        "request-never-issued",
        "request-is-a-query",
        "request-is-a-cancel",
        "request-of-another-operation",
        "attempt-not-the-requests",
        "reply-to-never-issued",
        "reply-to-another-operation",
    ],
)
def test_a_receipt_naming_a_request_not_issued_for_the_operation_is_quarantined(
    changes: dict[str, Any],
) -> None:
    """validates ... the exact operation, attempt and request identity"""
    assert_quarantined(run(receipt(**changes)), "unknown_request")


@pytest.mark.parametrize("reply_to", [SUBMIT_1, QUERY_1, CANCEL_1], ids=str)
def test_a_receipt_may_answer_any_command_issued_for_the_operation(reply_to: str) -> None:
    """Query results pass through the same receipt validation path as ordinary
    responses: a receipt in reply to a query or a cancel of this operation is valid."""
    assert run(receipt(in_reply_to=reply_to)).verdict is Verdict.APPLY


def test_a_receipt_with_another_command_digest_is_quarantined() -> None:
    """Reusing that identity with changed input conflicts: the receipt must be about
    the command the engine issued, digest for digest."""
    assert_quarantined(run(receipt(command_digest=DIGEST_2)), "digest_mismatch")


@pytest.mark.parametrize(
    ("status", "effect"),
    [
        ("succeeded", "none"),
        ("succeeded", "unknown"),
        ("accepted", "applied"),
        ("cancelled", "applied"),
        ("cancelled", "unknown"),
        ("rejected", "applied"),
        ("rejected", "unknown"),
    ],
)
def test_a_status_with_an_impossible_effect_is_quarantined(status: str, effect: str) -> None:
    """Succeeded means the effect is applied; cancelled and rejected mean none."""
    assert_quarantined(run(receipt(status=status, effect=effect)), "inconsistent_effect")


def test_an_older_owner_revision_cannot_roll_state_backward() -> None:
    """Older owner revisions cannot roll state backward: recorded as stale, never
    applied."""
    op = op_view(status=Status.SUCCEEDED, effect=Effect.APPLIED, owner_revision=3)
    decision = run(receipt(status="accepted", effect="none", owner_revision=2), op=op)
    assert decision.verdict is Verdict.STALE
    assert decision.status is None


def test_a_receipt_for_an_older_attempt_is_stale() -> None:
    """Retry-safe creates a new attempt: a late receipt about the old one changes
    nothing."""
    op = op_view(attempt=2, status=Status.DISPATCHED, owner_revision=1)
    decision = run(receipt(owner_revision=5), op=op)
    assert decision.verdict is Verdict.STALE
    assert decision.status is None


def test_a_repeated_owner_revision_with_the_same_content_is_a_duplicate() -> None:
    r = receipt(owner_revision=2)
    op = op_view(
        status=Status.SUCCEEDED, effect=Effect.APPLIED, owner_revision=2, receipt_hash=hash_of(r)
    )
    decision = run(r.model_copy(update={"emitted_at": T0 + timedelta(minutes=1)}), op=op)
    assert decision.verdict is Verdict.DUPLICATE
    assert decision.status is None


def test_a_repeated_owner_revision_with_changed_content_is_rejected() -> None:
    """A repeated owner revision with changed content is rejected."""
    applied = receipt(owner_revision=2)
    op = op_view(
        status=Status.SUCCEEDED,
        effect=Effect.APPLIED,
        owner_revision=2,
        receipt_hash=hash_of(applied),
    )
    changed = receipt(owner_revision=2, result={"reservation_id": "r-other"})
    assert_quarantined(run(changed, op=op), "revision_conflict")


def test_succeeded_after_authoritative_retry_waiting_is_an_illegal_transition() -> None:
    """Unknown effects cannot become success through an operator assertion or blind
    replay; an operation waiting for retry with effect none cannot turn succeeded."""
    op = op_view(status=Status.RETRY_WAITING, effect=Effect.NONE, owner_revision=1)
    assert_quarantined(run(receipt(owner_revision=2), op=op), "illegal_transition")


def test_a_new_statement_about_a_terminal_operation_is_an_illegal_transition() -> None:
    op = op_view(status=Status.SUCCEEDED, effect=Effect.APPLIED, owner_revision=1)
    r = receipt(
        status="failed",
        effect="none",
        result=None,
        owner_revision=2,
        error=ReceiptError(code="declined", message="no"),
    )
    assert_quarantined(run(r, op=op), "illegal_transition")


def test_a_late_accepted_receipt_is_ignored() -> None:
    """Acceptance is progress only while nothing later is known."""
    op = op_view(status=Status.CANCELLING, owner_revision=1)
    decision = run(receipt(status="accepted", effect="none", owner_revision=2), op=op)
    assert decision.verdict is Verdict.IGNORED
    assert decision.status is None


# --- what an applied receipt does ---------------------------------------------------------


def test_a_success_that_wins_the_cancel_race_is_applied_as_succeeded() -> None:
    """A success that wins the race remains Succeeded on the operation."""
    decision = run(receipt(), op=op_view(status=Status.CANCELLING))
    assert (decision.verdict, decision.status, decision.effect) == (
        Verdict.APPLY,
        Status.SUCCEEDED,
        Effect.APPLIED,
    )


def test_a_cancelled_receipt_settles_a_cancelling_operation_with_effect_none() -> None:
    r = receipt(status="cancelled", effect="none", result=None)
    decision = run(r, op=op_view(status=Status.CANCELLING))
    assert (decision.status, decision.effect) == (Status.CANCELLED, Effect.NONE)


def test_a_failure_with_unknown_effect_leaves_the_outcome_unknown() -> None:
    r = receipt(
        status="failed",
        effect="unknown",
        result=None,
        error=ReceiptError(code="timeout", message="upstream"),
    )
    decision = run(r, op=op_view(status=Status.ACCEPTED))
    assert (decision.status, decision.effect) == (Status.OUTCOME_UNKNOWN, Effect.UNKNOWN)


def test_a_digest_conflict_rejection_leaves_the_outcome_unknown() -> None:
    """Same identity + different digest -> conflict, recorded, nothing executed by the
    participant; the engine does not conclude anything about the effect."""
    r = receipt(
        status="rejected",
        effect="none",
        result=None,
        error=ReceiptError(code="digest_conflict", message="other work"),
    )
    decision = run(r)
    assert (decision.status, decision.effect) == (Status.OUTCOME_UNKNOWN, Effect.UNKNOWN)


def failed(effect: str, code: str = "busy") -> OperationReceipt:
    return receipt(
        status="failed", effect=effect, result=None, error=ReceiptError(code=code, message="m")
    )


def test_a_retryable_failure_with_effect_none_waits_for_a_retry() -> None:
    """The action retry-safe requires authoritative RetryWaiting with effect none: a
    validated failure with effect none that the node may retry establishes both."""
    decision = run(failed("none"), retryable=True)
    assert (decision.verdict, decision.status, decision.effect) == (
        Verdict.APPLY,
        Status.RETRY_WAITING,
        Effect.NONE,
    )


@pytest.mark.parametrize(
    ("effect", "status"),
    [("applied", Status.FAILED), ("unknown", Status.OUTCOME_UNKNOWN)],
)
def test_a_failure_with_an_applied_or_unknown_effect_is_never_retried(
    effect: str, status: Status
) -> None:
    """Unknown effects cannot become success through blind replay: whatever the retry
    policy, only effect none leads to retry_waiting."""
    decision = run(failed(effect), retryable=True)
    assert decision.status is status
    assert decision.effect is Effect(effect)


def test_a_failure_the_policy_does_not_retry_is_a_failure() -> None:
    decision = run(failed("none", code="declined"), retryable=False)
    assert (decision.status, decision.effect) == (Status.FAILED, Effect.NONE)


def test_a_retryable_failure_of_a_cancelling_operation_settles_the_cancel() -> None:
    """Cancellation prevents further work: nothing happened (effect none), so the
    cancel wins instead of a retry."""
    decision = run(failed("none"), op=op_view(status=Status.CANCELLING), retryable=True)
    assert (decision.status, decision.effect) == (Status.CANCELLED, Effect.NONE)


def test_a_query_answer_resolves_reconcile_pending_through_the_same_path() -> None:
    """Query results pass through the same receipt validation path as ordinary
    responses."""
    op = op_view(status=Status.RECONCILE_PENDING, owner_revision=1)
    decision = run(receipt(owner_revision=2, in_reply_to=QUERY_1), op=op)
    assert (decision.verdict, decision.status) == (Verdict.APPLY, Status.SUCCEEDED)


def test_the_content_hash_ignores_only_transport_facts() -> None:
    """A repeated statement keeps its revision and its receipt_id; transport facts
    (receipt_id, in_reply_to, emitted_at) are not its content."""
    r = receipt()
    same = r.model_copy(
        update={
            "emitted_at": T0 + timedelta(hours=1),
            "in_reply_to": QUERY_1,
            "receipt_id": identity.receipt_id(QUERY_1, 1),
        }
    )
    assert hash_of(same) == hash_of(r)
    for change in (
        {"status": "failed"},
        {"result": None},
        {"owner_revision": 2},
        {"principal": "x"},
        {"attempt": 2},
    ):
        assert hash_of(r.model_copy(update=change)) != hash_of(r), change


# --- the order of the checks ----------------------------------------------------------


class Case:
    """A mutable validation context that defects are applied to."""

    def __init__(self) -> None:
        self.receipt: dict[str, Any] = {}
        self.op: dict[str, Any] | None = {}
        self.user_id: str | None = USER
        self.seen_hash: str | None = None

    def decide(self) -> Decision:
        return run(
            receipt(**self.receipt),
            user_id=self.user_id,
            op=None if self.op is None else op_view(**self.op),
            seen_hash=self.seen_hash,
        )


def _set_op(**values: Any) -> Callable[[Case], None]:
    def apply(c: Case) -> None:
        if c.op is not None:
            c.op.update(values)

    return apply


# (reason, what it changes, how): in the order the design fixes.
DEFECTS: list[tuple[str, str, Callable[[Case], None]]] = [
    ("wrong_tenant", "tenant", lambda c: c.receipt.update(tenant="globex")),
    ("missing_user_id", "user", lambda c: setattr(c, "user_id", None)),
    ("principal_mismatch", "user", lambda c: setattr(c, "user_id", "custody-payments")),
    ("wrong_owner", "owner", lambda c: c.receipt.update(owner="payments")),
    ("receipt_id_mismatch", "receipt_id", lambda c: c.receipt.update(receipt_id=NEVER_ISSUED)),
    ("receipt_id_reuse", "seen", lambda c: setattr(c, "seen_hash", "0" * 64)),
    ("unknown_operation", "op", lambda c: setattr(c, "op", None)),
    ("unknown_request", "request", lambda c: c.receipt.update(request_id=NEVER_ISSUED)),
    ("digest_mismatch", "digest", lambda c: c.receipt.update(command_digest=DIGEST_2)),
    ("inconsistent_effect", "effect", lambda c: c.receipt.update(effect="none")),
    ("stale", "revision", _set_op(owner_revision=2)),
    ("revision_conflict", "revision", _set_op(owner_revision=1, receipt_hash="0" * 64)),
    ("illegal_transition", "status", _set_op(status=Status.RETRY_WAITING)),
]
# Tenant and owner are compared with the operation's: without one there is nothing
# to differ from, and the receipt is refused as unknown_operation.
NEEDS_OPERATION = {"wrong_tenant", "wrong_owner"}
PAIRS = [
    (a, b)
    for a, b in itertools.combinations(DEFECTS, 2)
    if a[1] != b[1] and not (a[0] in NEEDS_OPERATION and b[0] == "unknown_operation")
]


@pytest.mark.parametrize("defect", DEFECTS, ids=[d[0] for d in DEFECTS])
def test_each_defect_alone_gives_its_reason(defect: tuple[str, str, Any]) -> None:
    case = Case()
    defect[2](case)
    decision = case.decide()
    assert decision.reason == defect[0]
    assert decision.verdict is not Verdict.APPLY


@pytest.mark.parametrize(("first", "second"), PAIRS, ids=[f"{a[0]}+{b[0]}" for a, b in PAIRS])
def test_a_receipt_failing_two_rules_gets_the_earlier_reason(
    first: tuple[str, str, Any], second: tuple[str, str, Any]
) -> None:
    """In order: tenant -> owner and principal (and user_id) -> receipt identity
    (derived id, known id) -> operation exists -> attempt and request -> digest ->
    owner revision -> lifecycle. The seen-receipt check comes after tenant and
    principal: a known receipt id re-sent by someone else is refused, not a duplicate."""
    case = Case()
    second[2](case)
    first[2](case)
    assert case.decide().reason == first[0]


def test_every_quarantine_reason_is_a_stable_code() -> None:
    """Quarantine rows and metric labels use REASONS: no two codes collide."""
    assert len(REASONS) == len(set(REASONS))
    assert all(r == r.strip().lower() and " " not in r for r in REASONS)
    produced = {d[0] for d in DEFECTS} - {"stale"}
    assert produced <= set(REASONS)


# --- properties -------------------------------------------------------------------------

_EFFECT_OF = {
    "accepted": {"none", "unknown"},
    "succeeded": {"applied"},
    "failed": {"none", "applied", "unknown"},
    "cancelled": {"none"},
    "rejected": {"none"},
}
_STATUS_EFFECT = [
    (s, e)
    for s in ("accepted", "succeeded", "failed", "cancelled", "rejected")
    for e in ("none", "applied", "unknown")
]


def mostly(valid: Any, *invalid: Any) -> st.SearchStrategy[Any]:
    """The valid value ten times as often as each invalid one: every rule gets
    exercised, and enough receipts pass all of them to be applied."""
    return st.sampled_from([valid] * 10 * max(1, len(invalid)) + list(invalid))


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """A receipt, its delivery and the operation it names, each part usually valid."""
    status, effect = draw(
        st.sampled_from(_STATUS_EFFECT).filter(lambda p: p[1] in _EFFECT_OF[p[0]])
        | st.sampled_from(_STATUS_EFFECT)
    )
    code = draw(st.sampled_from([None, "declined", "digest_conflict"]))
    attempt = draw(mostly(1, 2))
    r = receipt(
        tenant=draw(mostly("acme", "globex")),
        owner=draw(mostly("inventory", "payments")),
        principal=draw(mostly(USER, "custody-payments")),
        attempt=attempt,
        request_id=draw(
            mostly(
                SUBMIT_1 if attempt == 1 else SUBMIT_2,
                QUERY_1,
                OTHER_SUBMIT,
                NEVER_ISSUED,
                SUBMIT_2 if attempt == 1 else SUBMIT_1,
            )
        ),
        in_reply_to=draw(mostly(SUBMIT_1, QUERY_1, CANCEL_1, OTHER_SUBMIT, NEVER_ISSUED)),
        command_digest=draw(mostly(DIGEST_1 if attempt == 1 else DIGEST_2, "ee" * 32)),
        owner_revision=draw(st.integers(1, 3)),
        status=status,
        effect=effect,
        result=draw(st.sampled_from([None, {"r": 1}])),
        error=None if code is None else ReceiptError(code=code, message="m"),
    )
    op = draw(
        mostly(
            op_view(
                tenant=draw(mostly("acme", "globex")),
                attempt=draw(mostly(1, 2)),
                status=draw(st.sampled_from(list(Status))),
                effect=draw(st.sampled_from(list(Effect))),
                owner_revision=draw(mostly(0, 1, 2, 3)),
                receipt_hash=draw(st.sampled_from([None, "0" * 64, hash_of(r)])),
            ),
            None,
        )
    )
    issued = dict(ISSUED)
    if draw(st.booleans()):
        issued[SUBMIT_2] = IssuedRequest(SUBMIT_2, OP, 2, "submit", DIGEST_2)
    return {
        "receipt": r,
        "user_id": draw(mostly(r.principal, None, USER, "custody-payments")),
        "op": op,
        "issued": issued,
        "seen_hash": draw(mostly(None, "0" * 64, hash_of(r))),
        "retryable": draw(st.booleans()),
    }


def context(s: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """The keyword arguments of decide() in a scenario."""
    keys = ("user_id", "op", "issued", "seen_hash", "retryable")
    return {**{k: s[k] for k in keys}, **changes}


@FAST
@given(scenarios())
def test_decide_never_applies_a_receipt_unless_every_rule_holds(s: dict[str, Any]) -> None:
    r: OperationReceipt = s["receipt"]
    op: OperationView | None = s["op"]
    decision = decide(r, **context(s))
    if decision.verdict is Verdict.QUARANTINE:
        assert decision.reason in REASONS
    if decision.verdict is not Verdict.APPLY:
        assert decision.status is None
        return
    assert op is not None
    submit = s["issued"][r.request_id]
    assert s["seen_hash"] is None
    assert r.tenant == op.tenant
    assert s["user_id"] == r.principal == op.principal
    assert r.owner == op.owner
    assert r.operation_id == op.id
    assert (submit.kind, submit.operation_id, submit.attempt) == ("submit", op.id, r.attempt)
    assert s["issued"][r.in_reply_to].operation_id == op.id
    assert r.command_digest == submit.digest
    assert r.attempt >= op.attempt
    assert r.owner_revision > op.owner_revision
    code = r.error.code if r.error else None
    event = lifecycle.receipt_event(r.status, r.effect, code, retryable=s["retryable"])
    assert decision.status is lifecycle.next_status(op.status, event)  # never refused
    assert isinstance(decision.status, Status)
    assert decision.effect is not None
    assert decision.content_hash == hash_of(r)
    if decision.status is Status.SUCCEEDED:
        assert r.status == "succeeded"
        assert decision.effect is Effect.APPLIED
    if decision.status is Status.RETRY_WAITING:
        assert (r.status, r.effect, decision.effect) == ("failed", "none", Effect.NONE)


def test_the_property_scenarios_reach_every_verdict() -> None:
    """The properties here are not vacuous: their scenarios reach every verdict."""
    seen: set[Verdict] = set()

    @settings(
        database=None, deadline=None, max_examples=600, phases=[Phase.generate], derandomize=True
    )
    @given(scenarios())
    def collect(s: dict[str, Any]) -> None:
        seen.add(decide(s["receipt"], **context(s)).verdict)

    collect()
    assert seen == set(Verdict)


@FAST
@given(scenarios())
def test_decide_is_a_pure_function_of_its_inputs(s: dict[str, Any]) -> None:
    """Every replica decides the same: a redelivery to another consumer is validated
    exactly as the first delivery was."""
    assert decide(s["receipt"], **context(s)) == decide(s["receipt"], **context(s))


@FAST
@given(scenarios())
def test_an_applied_receipt_replayed_is_never_applied_twice(s: dict[str, Any]) -> None:
    """Every consumer must be idempotent: after applying a receipt, the same receipt
    again (by id, or by owner revision) is a duplicate."""
    r: OperationReceipt = s["receipt"]
    op: OperationView | None = s["op"]
    first = decide(r, **context(s))
    if first.verdict is not Verdict.APPLY:
        return
    assert op is not None
    assert first.status is not None
    assert first.effect is not None
    after = replace(
        op,
        status=first.status,
        effect=first.effect,
        owner_revision=r.owner_revision,
        receipt_hash=first.content_hash,
    )
    for seen in (first.content_hash, None):
        again = decide(r, **context(s, op=after, seen_hash=seen))
        assert again.verdict is Verdict.DUPLICATE
