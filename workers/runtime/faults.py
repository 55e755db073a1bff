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
