"""Crash points, stop points, broken builds and the poison marker (workers/runtime/faults.py)
are parsed from the environment on first use, not at import, and unknown names are refused
then with the same error."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from workers.errors import ConfigError
from workers.runtime import faults


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    faults.arm({})
    yield
    faults.arm({})


def test_nothing_is_armed_by_an_empty_environment() -> None:
    assert faults.arm({}) == faults.Armed()
    assert not faults.enabled("before_commit")
    assert not faults.broken("accepted_as_success")
    faults.crash_point("before_commit")  # does nothing
    faults.poison_check("w", [b"anything"])


def test_the_environment_arms_points_builds_and_the_poison_marker() -> None:
    armed = faults.arm(
        {
            "CUSTODY_CRASH_POINTS": "before_commit,mid_effect",
            "CUSTODY_STOP_POINTS": "starts_locked",
            "CUSTODY_BROKEN": "accepted_as_success",
            "CUSTODY_FAULT_POISON_MARKER": "POISON",
        }
    )
    assert armed.crash == {"before_commit", "mid_effect"}
    assert armed.stops == {"starts_locked"}
    assert faults.enabled("mid_effect") and faults.broken("accepted_as_success")
    with pytest.raises(faults.InjectedPoison):
        faults.poison_check("w", [b"x", b"a POISON pill"])


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("CUSTODY_CRASH_POINTS", "unknown crash points: \\['nope'\\]"),
        ("CUSTODY_STOP_POINTS", "unknown crash points: \\['nope'\\]"),
        ("CUSTODY_BROKEN", "unknown broken builds: \\['nope'\\]"),
    ],
)
def test_an_unknown_name_is_refused_on_first_use(
    monkeypatch: pytest.MonkeyPatch, key: str, message: str
) -> None:
    monkeypatch.setenv(key, "nope")
    faults.reset()  # as just after import
    with pytest.raises(ConfigError, match=message):
        faults.crash_point("before_commit")


def test_the_poison_marker_can_be_set_and_cleared() -> None:
    faults.set_poison_marker("M")
    with pytest.raises(faults.InjectedPoison):
        faults.poison_check("w", [b"xMx"])
    faults.set_poison_marker("")
    faults.poison_check("w", [b"xMx"])
