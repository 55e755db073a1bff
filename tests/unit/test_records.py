"""The fold of a batch's operation changes into one change per operation, for the one
set-based ``operation_apply`` (pure). The seed: "Older owner revisions cannot roll
state backward" and "Successful application records the result and next-step intent
atomically": folded, an operation's changes in one batch end where they end in
sequence, under the first change's guard."""

from __future__ import annotations

from workers.core import lifecycle
from workers.core.records import OperationUpdate, fold_updates

S, E = lifecycle.Status, lifecycle.Effect


def _update(
    oid: str, expected: lifecycle.Status, status: lifecycle.Status, revision: int, **kw: object
) -> OperationUpdate:
    return OperationUpdate(
        id=oid,
        expected=expected,
        status=status,
        effect=kw.pop("effect", E.NONE),  # type: ignore[arg-type]
        owner_revision=revision,
        receipt_hash=f"h{revision}",
        **kw,  # type: ignore[arg-type]
    )


def test_changes_of_different_operations_stay_as_they_are_in_order() -> None:
    a = _update("a", S.DISPATCHED, S.ACCEPTED, 1)
    b = _update("b", S.PENDING, S.ACCEPTED, 1)
    assert fold_updates([a, b]) == [a, b]
    assert fold_updates([]) == []


def test_accepted_then_succeeded_fold_into_one_change_guarded_by_the_first() -> None:
    """The guard is the status the first change was judged from; the rest is the last
    change's, so the row ends as the second statement would have left it."""
    accepted = _update("a", S.DISPATCHED, S.ACCEPTED, 1)
    succeeded = _update(
        "a", S.ACCEPTED, S.SUCCEEDED, 2, effect=E.APPLIED, result={"r": 1}, terminal=True
    )
    [folded] = fold_updates([accepted, succeeded])
    assert folded.expected is S.DISPATCHED
    assert (folded.status, folded.effect, folded.owner_revision) == (S.SUCCEEDED, E.APPLIED, 2)
    assert (folded.receipt_hash, folded.result, folded.terminal) == ("h2", {"r": 1}, True)


def test_a_result_or_error_given_earlier_is_kept_when_a_later_change_gives_none() -> None:
    """``coalesce(result, result)`` in sequence: a later change without a result keeps
    the earlier one; a later one with a result replaces it; the retry is the last's."""
    first = _update("a", S.ACCEPTED, S.FAILED, 2, error={"code": "x"}, retry_in=5.0)
    later = _update("a", S.FAILED, S.FAILED, 3)
    [folded] = fold_updates([first, later])
    assert (folded.error, folded.retry_in, folded.expected) == ({"code": "x"}, None, S.ACCEPTED)
    replaced = _update("a", S.FAILED, S.FAILED, 3, error={"code": "y"})
    assert fold_updates([first, replaced])[0].error == {"code": "y"}


def test_an_operation_keeps_its_first_position_among_the_others() -> None:
    a1 = _update("a", S.DISPATCHED, S.ACCEPTED, 1)
    b1 = _update("b", S.DISPATCHED, S.ACCEPTED, 1)
    a2 = _update("a", S.ACCEPTED, S.SUCCEEDED, 2, terminal=True)
    assert [u.id for u in fold_updates([a1, b1, a2])] == ["a", "b"]
