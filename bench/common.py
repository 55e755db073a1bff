"""What every part of the bench shares: the failure that voids a run."""

from __future__ import annotations


class BenchFailure(Exception):
    """The run cannot produce a trustworthy figure (wrong effects, a dead worker, a
    timeout): fail loudly, never report it."""
