"""The redo policy (workers.runtime.supervisor.redo): a transient failure is retried for
as long as it lasts; a row that changed under its lock is a race, redone a few times, and
then the unit's own failure, raised so that a batch is split and the delivery that still
fails alone is isolated instead of being held unacked forever."""

from __future__ import annotations

import pytest

from workers import errors
from workers.runtime import supervisor


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(errors, "backoff_seconds", lambda attempt, **_: 0.0)


async def _nothing() -> None:
    return None


async def test_a_race_that_ends_is_redone_until_the_unit_commits() -> None:
    calls = 0

    async def unit() -> str:
        nonlocal calls
        calls += 1
        if calls <= 3:
            raise errors.RowChanged("operation changed under its row lock")
        return "committed"

    result = await supervisor.redo(unit, worker="test", stop=supervisor.Stop(1), on_fenced=_nothing)
    assert (result, calls) == ("committed", 4)


async def test_a_row_that_keeps_changing_is_raised_after_a_few_redos() -> None:
    calls = 0

    async def unit() -> None:
        nonlocal calls
        calls += 1
        raise errors.DatabaseError("changed under its row lock", errors.Retry.RETRY, "CU004")

    with pytest.raises(errors.DatabaseError):
        await supervisor.redo(unit, worker="test", stop=supervisor.Stop(1), on_fenced=_nothing)
    assert calls == supervisor.ROW_CHANGED_REDOS + 1


async def test_an_outage_is_retried_for_as_long_as_it_lasts() -> None:
    calls = 0

    async def unit() -> str:
        nonlocal calls
        calls += 1
        if calls <= 3 * supervisor.ROW_CHANGED_REDOS:
            raise errors.DatabaseError("connection refused", errors.Retry.RETRY)
        return "committed"

    result = await supervisor.redo(unit, worker="test", stop=supervisor.Stop(1), on_fenced=_nothing)
    assert result == "committed"
