"""Crash points: exact places where a test can make a worker die by SIGKILL.

Enabled only through ``CUSTODY_CRASH_POINTS`` (comma-separated names), which the
fault tests set for one worker process. Each point fires once per process.
"""

from __future__ import annotations

import os
import signal
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
    }
)

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


def enabled(name: str) -> bool:
    return name in _enabled


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
