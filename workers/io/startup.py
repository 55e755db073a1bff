"""What a connection does when its service is unreachable at start-up.

A long-running worker waits for RabbitMQ and Postgres: a container restart order or a
rolling restart of the broker can start it first, and exiting would only have the
orchestrator restart it into the same state. A command (the CLI, the harnesses' own
clients) fails fast instead, after one pass over the nodes, and says why.

The policy belongs to the process's runtime: ``supervisor.run`` installs a waiting
:class:`Patience` in the context its worker's task is created in (a context variable,
so the worker's code passes nothing along), ``Broker.connect`` and ``Database.open``
read it with :func:`current`. Everything else gets :data:`FAIL_FAST`.

A refused login is never waited for: it is configuration, and no retry fixes it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol


class Report(Protocol):
    """Where connection events go: ``workers.runtime.logs.event`` in a worker."""

    def __call__(self, name: str, level: int = logging.INFO, **fields: Any) -> None: ...


def _quiet(name: str, level: int = logging.INFO, **fields: Any) -> None:
    return None


@dataclass
class Patience:
    """``wait``: keep trying (a worker) or give up after one pass (a command).
    ``waiting``: what start-up waits for right now, and the last reason (shown on
    /readyz); shared with the worker's ``Health``."""

    wait: bool
    report: Report = _quiet
    waiting: dict[str, str] = field(default_factory=dict)

    @contextlib.contextmanager
    def waiting_for(self, dependency: str) -> Iterator[None]:
        """Mark ``dependency`` as waited for while the block runs (a worker stopped
        meanwhile has nothing in flight, and is stopped at once)."""
        self.waiting[dependency] = "connecting"
        try:
            yield
        finally:
            self.waiting.pop(dependency, None)


FAIL_FAST = Patience(wait=False)
_CURRENT: ContextVar[Patience] = ContextVar("custody_patience", default=FAIL_FAST)


def current() -> Patience:
    return _CURRENT.get()


@contextlib.contextmanager
def patient(patience: Patience) -> Iterator[Patience]:
    """``patience`` for the tasks created inside the block (they copy the context)."""
    token = _CURRENT.set(patience)
    try:
        yield patience
    finally:
        _CURRENT.reset(token)
