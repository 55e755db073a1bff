"""The pure decision modules of issue 11: one closed reason list, one home for every
receipt and query-answer decision (validation.judge), the effects of a decision as
typed writes (effects), a participant's acceptance (acceptance), a start request
(activation), and one error root (errors)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from contracts import identity
from contracts.models import QueryAnswer, ReceiptError
from tests.unit.test_validation import (
    ISSUED,
    OP,
    QUERY_1,
    SUBMIT_1,
    USER,
    op_view,
    receipt,
)
from workers import errors
from workers.core import acceptance, activation, effects, lifecycle, process, records, validation
from workers.core.lifecycle import InstanceEvent, InstanceStatus, Status
from workers.core.reasons import REASONS, Reason

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2024, 1, 1, 12, 0, tzinfo=UTC)


# --- one closed reason list -----------------------------------------------------------


def test_every_codec_and_broker_reason_is_in_the_one_enum() -> None:
    """contracts cannot import workers, so the codec's literals are read from its
    source: every DecodeError reason it raises is a Reason member."""
    codec_src = (ROOT / "contracts" / "codec.py").read_text()
    raised = set(re.findall(r'DecodeError\("([a-z_]+)"', codec_src))
    assert raised and raised <= set(REASONS)
    from workers.io import broker

    assert broker.UNDECODABLE in set(REASONS)
    assert tuple(Reason) == REASONS
    assert validation.REASONS == REASONS


def test_the_committer_and_participant_emit_no_free_reason_strings() -> None:
    """Quarantine and refusal rows are built from Reason members only."""
    for path in ("workers/engine/committer.py", "workers/participant/service.py"):
        src = (ROOT / path).read_text()
        assert not re.search(r'_(quarantine_row|refused)\(\s*d,\s*"', src), path


# --- query answers: the same speaker checks as receipts --------------------------------


def answer(**changes: Any) -> QueryAnswer:
    inner = changes.pop("receipt", receipt())
    values: dict[str, Any] = {
        "answer_id": identity.answer_id(QUERY_1, 1),
        "tenant": "acme",
        "operation_id": OP,
        "attempt": 1,
        "request_id": SUBMIT_1,
        "in_reply_to": QUERY_1,
        "owner": "inventory",
        "principal": USER,
        "receipt": inner,
        "emitted_at": T0,
    }
    values.update(changes)
    return QueryAnswer(**values)


@pytest.mark.parametrize(
    ("user_id", "changes", "reason"),
    [
        (None, {}, Reason.MISSING_USER_ID),
        ("", {}, Reason.MISSING_USER_ID),
        ("custody-payments", {}, Reason.PRINCIPAL_MISMATCH),
        (USER, {"tenant": "globex"}, Reason.WRONG_TENANT),
        (
            "custody-payments",
            {"owner": "payments", "principal": "custody-payments"},
            Reason.WRONG_OWNER,
        ),
    ],
)
def test_a_receipt_and_an_answer_are_refused_for_the_same_reason(
    user_id: str | None, changes: dict[str, Any], reason: Reason
) -> None:
    """Before issue 11 a missing user id was missing_user_id for a receipt and
    principal_mismatch for an answer: one check now serves both."""
    op = op_view()
    as_receipt = validation.decide(
        receipt(**changes), user_id=user_id, op=op, issued=ISSUED, seen_hash=None
    )
    as_answer = validation.refuse_answer(answer(**changes), user_id=user_id, op=op, issued=ISSUED)
    assert as_receipt.reason == reason
    assert as_answer is not None and as_answer.reason == reason


def test_an_answer_is_refused_for_what_only_an_answer_can_get_wrong() -> None:
    op = op_view()

    def refused(a: QueryAnswer, view: validation.OperationView | None = op) -> str | None:
        d = validation.refuse_answer(a, user_id=USER, op=view, issued=ISSUED)
        return None if d is None else d.reason

    assert refused(answer()) is None
    assert refused(answer(), None) == Reason.UNKNOWN_OPERATION
    assert refused(answer(in_reply_to=SUBMIT_1)) == Reason.UNKNOWN_REQUEST
    other = receipt(operation_id=identity.operation_id("acme", "x", "y", 1))
    assert refused(answer(receipt=other)) == Reason.SCHEMA


# --- validation.judge: the receipt consumer's whole decision --------------------------


def node(**changes: Any) -> process.Node:
    values: dict[str, Any] = {
        "name": "reserve",
        "route": "inventory",
        "operation": "inventory.reserve",
        "input": {},
        "on_succeeded": "charge",
        "on_failed": process.END_FAILED,
        "deadline_seconds": 30,
        "retry": process.RetryPolicy(3, 2.0, frozenset({"busy"})),
    }
    values.update(changes)
    return process.Node(**values)


def pinned(n: process.Node | None = None) -> validation.PinnedNode:
    n = n or node()
    return validation.PinnedNode(n.name, process.Definition("p", 1, n.name, {n.name: n}))


MISSING = validation.PinnedNode("reserve", None, "unknown process 'p' version 1")


def judge(message: Any, **kw: Any) -> validation.Judgement:
    args: dict[str, Any] = {
        "user_id": USER,
        "op": op_view(),
        "issued": ISSUED,
        "seen": {},
        "revisions": {},
        "node": pinned(),
    }
    args.update(kw)
    return validation.judge(message, **args)


def test_a_success_applies_with_its_successor() -> None:
    j = judge(receipt())
    assert (j.result, j.labels, j.record, j.successor) == ("apply", ("apply",), True, "charge")
    assert j.applies and j.decision is not None and j.decision.status is Status.SUCCEEDED


def test_a_retryable_failure_waits_with_the_nodes_delay() -> None:
    failed = receipt(
        status="failed", effect="none", result=None, error=ReceiptError(code="busy", message="")
    )
    j = judge(failed)
    assert j.decision is not None and j.decision.status is Status.RETRY_WAITING
    assert j.retry_in == 2.0
    no_policy = judge(failed, node=pinned(node(retry=None)))
    assert no_policy.decision is not None and no_policy.decision.status is Status.FAILED


def test_a_valid_receipt_whose_definition_is_not_loaded_is_kept_in_quarantine() -> None:
    j = judge(receipt(), node=MISSING)
    assert (j.result, j.labels) == ("quarantine", ("apply", "quarantine"))
    assert j.definition_missing and j.refused is not None
    assert j.refused.reason == Reason.DEFINITION_MISSING
    # a cancelling operation needs no successor, so no definition
    settling = judge(receipt(), node=MISSING, op=op_view(status=Status.CANCELLING), cancelling=True)
    assert settling.result == "apply" and settling.successor is None


def test_a_query_that_finds_nothing_authoritative_is_no_news() -> None:
    op = op_view(status=Status.RECONCILE_PENDING)
    j = judge(answer(receipt=None), op=op)
    assert (j.result, j.labels, j.no_news) == ("apply", ("no_news",), Status.OUTCOME_UNKNOWN)
    accepted = receipt(status="accepted", effect="none", result=None)
    j = judge(answer(receipt=accepted), op=op)  # a late accepted is ignored, and recorded
    assert (j.labels, j.no_news, j.record) == (("ignored", "no_news"), Status.OUTCOME_UNKNOWN, True)
    # an owner that holds the work unsettled: not recorded (delivered directly, it applies)
    j = judge(answer(receipt=accepted))
    assert (j.result, j.labels, j.record) == ("ignored", ("apply", "no_news"), False)
    assert judge(answer(receipt=None)).result == "ignored"  # dispatched: nothing to undo


def test_a_refused_answer_is_quarantined_about_the_answer() -> None:
    a = answer()
    j = judge(a, user_id=None)
    assert (j.result, j.labels, j.about) == ("quarantine", ("quarantine",), a)
    assert j.refused is not None and j.refused.reason == Reason.MISSING_USER_ID


# --- effects: typed writes -------------------------------------------------------------


def row(**changes: Any) -> records.OperationRow:
    values: dict[str, Any] = {
        "id": OP,
        "tenant": "acme",
        "instance_id": "i-1",
        "node": "reserve",
        "owner": "inventory",
        "principal": USER,
        "attempt": 1,
        "status": "dispatched",
        "effect": "unknown",
        "owner_revision": 0,
        "receipt_hash": None,
        "process": "p",
        "process_version": 1,
        "created_at": T0,
        "instance_status": "running",
    }
    values.update(changes)
    return records.OperationRow.from_row(values)


def test_the_effects_of_a_success() -> None:
    r, j = row(), judge(receipt())
    done = effects.of_receipt(r, r.view(), receipt(), j, actor="receipts")
    assert done.update.status is Status.SUCCEEDED and done.update.terminal
    assert done.node == records.NodeFinish(OP, Status.SUCCEEDED)
    assert done.successor == records.SuccessorIntent("i-1", OP, Status.SUCCEEDED, "charge")
    assert [h.event for h in done.history] == ["operation.succeeded"]
    assert done.instance == ()
    assert done.view.status is Status.SUCCEEDED and done.view.owner_revision == 1
    params = done.update.params(lambda v: ("jsonb", v))
    assert params["result"] == ("jsonb", {"reservation_id": "r-1"})
    assert params["expected"] == "dispatched"


def test_the_effects_on_the_instance() -> None:
    unknown = receipt(status="failed", effect="unknown", result=None)
    r = row()
    done = effects.of_receipt(r, r.view(), unknown, judge(unknown), actor="receipts")
    assert [c.event for c in done.instance] == [InstanceEvent.SUSPEND]
    assert done.instance[0].target is InstanceStatus.SUSPENDED
    r = row(status="outcome_unknown")
    j = judge(receipt(), op=r.view())
    done = effects.of_receipt(r, r.view(), receipt(), j, actor="receipts")
    assert [c.event for c in done.instance] == [InstanceEvent.RESUME]
    cancelled = receipt(status="cancelled", effect="none", result=None)
    r = row(status="reconcile_pending")
    j = judge(answer(receipt=cancelled), op=r.view())
    assert j.applies
    done = effects.of_receipt(r, r.view(), cancelled, j, actor="receipts")
    events = [c.event for c in done.instance]
    assert events == [InstanceEvent.RESUME, InstanceEvent.CANCEL, InstanceEvent.SETTLE]
    assert done.successor is None


def test_no_news_goes_back_to_outcome_unknown_and_says_what_was_found() -> None:
    r = row(status="reconcile_pending")
    done = effects.of_no_news(r, r.view(), Status.OUTCOME_UNKNOWN, "found nothing", actor="x")
    assert done.update.status is Status.OUTCOME_UNKNOWN and not done.update.terminal
    assert done.history[0].detail == {"from": "reconcile_pending", "fact": "found nothing"}
    # the batch's view follows: a later update of this operation in the same batch
    # expects the status this one leaves (else its guarded UPDATE matches nothing)
    assert done.view.status is Status.OUTCOME_UNKNOWN


# --- acceptance ------------------------------------------------------------------------


def test_acceptance_classifies_each_command() -> None:
    from contracts import codec
    from contracts.models import SubmitCommand
    from workers.core import commands

    rows = commands.submit(
        commands.Pinned(
            operation_id=OP,
            tenant="acme",
            attempt=1,
            operation="inventory.reserve",
            route="inventory",
            owner="inventory",
            binding="inventory.v1",
            input={"sku": "a"},
            lineage={
                "instance_id": "3f0b6c1e-8a1d-4d2b-9f3a-2c5e7d9b1a00",
                "process": "p",
                "process_version": 1,
                "node": "reserve",
                "activation": 1,
            },
        )
    )
    c = codec.decode_command(rows.outbox_row["body"])
    assert isinstance(c, SubmitCommand)
    classify = acceptance.classify
    base: dict[str, Any] = {
        "refused": None,
        "tombstoned": set(),
        "inserted": set(),
        "offered": {c.request_id: c},
        "stored": {},
        "handled": {c.operation},
    }
    assert classify(c, **{**base, "inserted": {c.request_id}}).verdict == "accepted"
    no_handler = classify(c, **{**base, "inserted": {c.request_id}, "handled": set()})
    assert (no_handler.verdict, no_handler.error_code) == ("rejected", "unknown_operation")
    same = {c.request_id: acceptance.Stored(c.digest, 2)}
    assert classify(c, **{**base, "stored": same}).verdict == "duplicate"
    other = classify(c, **{**base, "stored": {c.request_id: acceptance.Stored("f" * 64, 2)}})
    assert (other.verdict, other.stored_digest, other.revision) == ("conflict", "f" * 64, 2)
    gone = classify(c, **{**base, "tombstoned": {c.request_id}})
    assert gone.verdict == "tombstoned" and gone.refusal is not None
    assert gone.refusal.reason is Reason.TOMBSTONED
    refusal = acceptance.refusal(c, owner="payments", bindings={"x"})
    assert refusal is not None and refusal.reason is Reason.WRONG_OWNER
    assert acceptance.refusal(c, owner=c.target.owner, bindings={c.target.binding}) is None


# --- errors ----------------------------------------------------------------------------


def test_one_error_root() -> None:
    for cls in (
        errors.IllegalTransition,
        errors.DefinitionError,
        errors.InputError,
        errors.RouteConfigError,
        errors.Refused,
        errors.BusinessFailure,
        errors.RowChanged,
    ):
        assert issubclass(cls, errors.CustodyError), cls
    assert issubclass(errors.RouteConfigError, errors.ConfigError)
    assert lifecycle.IllegalTransition is errors.IllegalTransition
    assert process.DefinitionError is errors.DefinitionError
    assert process.InputError is errors.InputError
    changed = errors.RowChanged("an operation changed under its row lock")
    assert changed.kind is errors.Retry.RETRY
    assert changed.kind is errors.classify_sqlstate("CU004", during_commit=False)


def test_a_start_for_an_unknown_process_is_refused_with_its_reason() -> None:
    from contracts.models import StartRequest
    from workers.core import routes

    start = StartRequest(
        start_request_id="3f0b6c1e-8a1d-4d2b-9f3a-2c5e7d9b1a00",
        tenant="acme",
        process="returns",
        input={},
        requested_by="ops",
    )
    decided = activation.plan_start(
        start,
        instance_id="i",
        catalog=process.Catalog({}),
        table=routes.Routes({}),
        traceparent=None,
        actor="committer",
    )
    assert isinstance(decided, activation.StartRefused)
    assert decided.reason is Reason.UNKNOWN_PROCESS


def test_what_a_handlers_run_comes_to() -> None:
    ok = acceptance.completion({"id": 1}, None, executions=0)
    assert ok == acceptance.Completed("succeeded", "applied", result={"id": 1})
    declined = acceptance.completion(None, errors.BusinessFailure("declined", "no"), executions=0)
    assert isinstance(declined, acceptance.Completed)
    assert (declined.status, declined.effect) == ("failed", "none")
    assert declined.error is not None and declined.error.code == "declined"
    bug = acceptance.completion(None, ZeroDivisionError("x"), executions=0)
    assert bug == acceptance.Deferred(errors.backoff_seconds(0, base=1))
    last = acceptance.MAX_EXECUTIONS - 1
    gave_up = acceptance.completion(None, ZeroDivisionError("x"), executions=last)
    assert isinstance(gave_up, acceptance.Completed)
    assert gave_up.error is not None and gave_up.error.code == "handler_error"


def test_a_query_is_answered_with_our_latest_receipt_only_for_the_same_work() -> None:
    from contracts.models import QueryCommand, Target

    q = QueryCommand(
        request_id=QUERY_1,
        tenant="acme",
        operation_id=OP,
        attempt=1,
        operation="inventory.reserve",
        target=Target(route="inventory", owner="inventory", binding="inventory.v1"),
        digest=receipt().command_digest,
        issued_at=T0,
        submit_request_id=SUBMIT_1,
    )
    kw: dict[str, Any] = {"owner": "inventory", "principal": USER, "now": T0}
    ours = acceptance.query_answer(q, receipt(), **kw)
    assert ours.receipt == receipt() and ours.answer_id == identity.answer_id(QUERY_1, 1)
    other = acceptance.query_answer(q, receipt(command_digest="f" * 64), **kw)
    assert other.receipt is None and other.answer_id == identity.answer_id(QUERY_1, 0)
    assert acceptance.query_answer(q, None, **kw).receipt is None


def test_a_missing_routes_file_is_one_line_configuration_error(tmp_path: Path) -> None:
    """The CLI and the supervisor turn a ConfigError into one line and exit 2."""
    from workers.core import routes

    with pytest.raises(errors.ConfigError) as caught:
        routes.load(tmp_path / "routes.toml")
    assert isinstance(caught.value, routes.RouteConfigError)
    message = str(caught.value)
    assert "\n" not in message and "does not exist" in message
    assert str(tmp_path / "routes.toml") in message
