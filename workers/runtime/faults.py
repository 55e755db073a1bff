"""Crash points: exact places where a test can make a worker die by SIGKILL.

Enabled only through ``CUSTODY_CRASH_POINTS`` (comma-separated names), which the
fault tests set for one worker process. Each point fires once per process. The
environment is read on first use, not at import: an unknown name is refused then.

Points inside a unit's transaction (:func:`point`) can also freeze the process there
(``CUSTODY_STOP_POINTS``: a pause past its lease, a zombie) or, for tests that run
workers in-process, await a hook the test registered (:func:`set_hook`): that is how
a race is forced at an exact step instead of hoped for.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from workers.errors import ConfigError

POINTS: Final = frozenset(
    {
        "before_commit",
        "after_commit_before_send",
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

# Deliberately broken builds (``CUSTODY_BROKEN``): the chaos checker's own tests arm one
# and expect the run to fail. Never set outside those tests.
BROKEN: Final = frozenset(
    {
        "ack_before_commit",
        "mark_before_confirm",
        "skip_instance_recheck",
        "accepted_as_success",
    }
)


@dataclass(frozen=True)
class Armed:
    """What the environment armed in this process (nothing, outside the fault tests)."""

    crash: frozenset[str] = frozenset()
    stops: frozenset[str] = frozenset()
    broken: frozenset[str] = frozenset()
    poison: bytes = b""


def _names(env: Mapping[str, str], key: str) -> frozenset[str]:
    return frozenset(p for p in env.get(key, "").split(",") if p)


def parse(env: Mapping[str, str]) -> Armed:
    """The points, stop points, broken builds and poison marker ``env`` arms; an unknown
    name is refused (a :class:`ConfigError`: the worker does not start)."""
    crash = _names(env, "CUSTODY_CRASH_POINTS")
    # Stop points: the process SIGSTOPs itself there (a pause past its lease: a zombie).
    stops = _names(env, "CUSTODY_STOP_POINTS")
    unknown = (crash | stops) - POINTS
    if unknown:
        raise ConfigError(f"unknown crash points: {sorted(unknown)}")
    broken = _names(env, "CUSTODY_BROKEN")
    if broken - BROKEN:
        raise ConfigError(f"unknown broken builds: {sorted(broken - BROKEN)}")
    poison = env.get("CUSTODY_FAULT_POISON_MARKER", "").encode()
    return Armed(crash, stops, broken, poison)


_armed: Armed | None = None


def armed() -> Armed:
    """This process's faults, parsed from the environment on first use (not at import)."""
    global _armed
    if _armed is None:
        _armed = parse(os.environ)
    return _armed


def arm(env: Mapping[str, str] | None = None) -> Armed:
    """Parse ``env`` (the environment by default) now and use it from now on: for a
    worker's start-up, so that an unknown name stops it before it takes work, and for
    tests."""
    global _armed
    _armed = parse(os.environ if env is None else env)
    return _armed


def reset() -> None:
    """Forget what was armed, as just after import: the next use parses the environment
    again (for tests)."""
    global _armed
    _armed = None


_stopped: set[str] = set()


def crash_point(name: str) -> None:
    """Die here (SIGKILL), or freeze here once (SIGSTOP), if the test enabled this point."""
    faults = armed()
    if name in faults.crash:
        os.kill(os.getpid(), signal.SIGKILL)
    if name in faults.stops and name not in _stopped:
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
    frozen = name in armed().stops and name not in _stopped
    crash_point(name)
    if frozen:
        await asyncio.sleep(RESUME_YIELD_S)
    hook = _hooks.get(name)
    if hook is not None:
        await hook()


def enabled(name: str) -> bool:
    return name in armed().crash


def broken(name: str) -> bool:
    return name in armed().broken


class InjectedPoison(RuntimeError):
    """Raised for a delivery carrying the test's poison marker (tests only)."""


def set_poison_marker(marker: str) -> None:
    """Tests: make any delivery whose body contains ``marker`` fail its unit of work."""
    global _armed
    _armed = replace(armed(), poison=marker.encode())


def poison_check(worker: str, bodies: list[bytes]) -> None:
    poison = armed().poison
    if poison and any(poison in b for b in bodies):
        raise InjectedPoison(f"{worker}: injected poison message")
