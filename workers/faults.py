"""Crash points: exact places where a test can make a worker die by SIGKILL.

Enabled only through ``CUSTODY_CRASH_POINTS`` (comma-separated names), which the
fault tests set for one worker process. Each point fires once per process.

Points inside a unit's transaction (:func:`point`) can also freeze the process there
(``CUSTODY_STOP_POINTS``: a pause past its lease, a zombie) or, for tests that run
workers in-process, await a hook the test registered (:func:`set_hook`): that is how
a race is forced at an exact step instead of hoped for.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Final

POINTS: Final = frozenset(
    {
        "before_commit",
        "after_publish_before_confirm",
        "after_confirm_before_mark",
        "after_commit_before_ack",
        "mid_effect",
        "after_effect_before_receipt_sent",
        "receipts_after_commit_before_ack",
        "receipts_between_result_and_successor",
        # inside a unit's transaction, after its rows were claimed and locked
        "starts_locked",
        "successor_claimed",
        "receipts_locked",
        "deadlines_claimed",
    }
)
# After a stop point resumes, the unit yields this long before its next statement, as a
# unit with more I/O to do would: the worker's other tasks (the heartbeat) run first.
RESUME_YIELD_S: Final = 0.5

_enabled = frozenset(p for p in os.environ.get("CUSTODY_CRASH_POINTS", "").split(",") if p)
# Stop points: the process SIGSTOPs itself there (a pause past its lease: a zombie).
_stops = frozenset(p for p in os.environ.get("CUSTODY_STOP_POINTS", "").split(",") if p)
_unknown = (_enabled | _stops) - POINTS
if _unknown:
    raise RuntimeError(f"unknown crash points: {sorted(_unknown)}")


_stopped: set[str] = set()


def crash_point(name: str) -> None:
    """Die here (SIGKILL), or freeze here once (SIGSTOP), if the test enabled this point."""
    if name in _enabled:
        os.kill(os.getpid(), signal.SIGKILL)
    if name in _stops and name not in _stopped:
        _stopped.add(name)
        os.kill(os.getpid(), signal.SIGSTOP)


_hooks: dict[str, Callable[[], Awaitable[None]]] = {}


def set_hook(name: str, hook: Callable[[], Awaitable[None]] | None) -> None:
    """Tests with in-process workers: await ``hook`` whenever :func:`point` ``name`` is
    reached (None removes it)."""
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}")
    if hook is None:
        _hooks.pop(name, None)
    else:
        _hooks[name] = hook


async def point(name: str) -> None:
    """A point inside a unit of work: crash, freeze (then let the other tasks run), or
    await the test's hook there."""
    frozen = name in _stops and name not in _stopped
    crash_point(name)
    if frozen:
        await asyncio.sleep(RESUME_YIELD_S)
    hook = _hooks.get(name)
    if hook is not None:
        await hook()


def enabled(name: str) -> bool:
    return name in _enabled


# Deliberately broken builds (``CUSTODY_BROKEN``): the chaos checker's own tests arm one
# and expect the run to fail. Never set outside those tests.
BROKEN: Final = frozenset(
    {
        "ack_before_commit",
        "mark_before_confirm",
        "ignore_lease",
        "skip_instance_recheck",
        "accepted_as_success",
    }
)
_broken = frozenset(p for p in os.environ.get("CUSTODY_BROKEN", "").split(",") if p)
if _broken - BROKEN:
    raise RuntimeError(f"unknown broken builds: {sorted(_broken - BROKEN)}")


def broken(name: str) -> bool:
    return name in _broken


class InjectedPoison(RuntimeError):
    """Raised for a delivery carrying the test's poison marker (tests only)."""


_poison = os.environ.get("CUSTODY_FAULT_POISON_MARKER", "").encode()


def set_poison_marker(marker: str) -> None:
    """Tests: make any delivery whose body contains ``marker`` fail its unit of work."""
    global _poison
    _poison = marker.encode()


def poison_check(worker: str, bodies: list[bytes]) -> None:
    if _poison and any(_poison in b for b in bodies):
        raise InjectedPoison(f"{worker}: injected poison message")
