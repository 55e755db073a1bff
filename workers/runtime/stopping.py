"""A stop asked for while the process is still starting.

A worker's imports take a second or more on a busy machine, and the event loop's own
SIGTERM handler (:func:`workers.runtime.supervisor.run`) comes after them: a SIGTERM
in between (a scale-down, a rollout, a test's fleet stopped right after its work) would
end the process by the signal's default action, exit code -15 and no line logged. The
entry point keeps such a request instead (:func:`keep`, before its imports; standard
library only), and ``run`` then begins nothing (no connection, no consumer), logs
``worker.stopped`` and exits 0.
"""

from __future__ import annotations

import signal
from types import FrameType

_asked: list[int] = []


def _keep(signum: int, _frame: FrameType | None) -> None:
    _asked.append(signum)


def runs_a_worker(args: list[str]) -> bool:
    """Whether the command line runs a worker (``run X``, ``workers run X``): only then is
    a SIGTERM kept; any other command ends on it as a command should."""
    return args[:1] == ["run"] or args[:2] == ["workers", "run"]


def keep() -> None:
    """Keep a SIGTERM that comes before the event loop handles it."""
    signal.signal(signal.SIGTERM, _keep)


def asked() -> bool:
    """Whether a SIGTERM came before the event loop handled it."""
    return bool(_asked)
