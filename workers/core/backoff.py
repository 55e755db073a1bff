"""When to try a connection again: exponential backoff with full jitter, capped.

Full jitter (a uniform draw in ``[0, min(cap, base * 2**attempt)]``) keeps replicas
that lost their broker or database together from coming back together: each draws
its own delay. With a list of nodes (a RabbitMQ cluster) the next node is tried at
once after a failure, and only a round in which every node failed waits.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Final

BASE_S: Final = 0.5
CAP_S: Final = 10.0

_RNG: Final = random.SystemRandom()


def full_jitter(
    attempt: int,
    *,
    base: float = BASE_S,
    cap: float = CAP_S,
    rand: Callable[[], float] = _RNG.random,
) -> float:
    """The delay after the ``attempt``-th consecutive failure (0-based)."""
    return float(rand() * min(cap, base * 2 ** min(max(attempt, 0), 32)))


def before_attempt(
    failures: int,
    *,
    nodes: int,
    base: float = BASE_S,
    cap: float = CAP_S,
    rand: Callable[[], float] = _RNG.random,
) -> float:
    """The delay before the next attempt, after ``failures`` consecutive failures over a
    list of ``nodes``: none while the round has nodes left to try, then a full-jitter
    backoff that grows with every round that failed whole."""
    if failures <= 0 or failures % max(nodes, 1):
        return 0.0
    return full_jitter(failures // max(nodes, 1) - 1, base=base, cap=cap, rand=rand)
