"""The event loop every command and worker runs on (the setting ``event_loop``).

``uvloop`` (the default) is libuv's loop, written in C: a worker's time goes to many
small waits (a statement's answer, a delivery, a confirm, a NOTIFY), and each costs less
on it. Measured alternated on the bench's fleet, every worker spent 8-15 % less CPU per
operation with it (docs/performance.md). ``asyncio`` is the standard library's loop,
kept as the way back if a platform or a library ever disagrees with uvloop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from workers.errors import ConfigError
from workers.settings import PREFIX


def factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory for ``asyncio.Runner`` (None: asyncio's own). A uvloop that
    cannot be imported (a platform it does not support) is said, with the way out."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        raise ConfigError(
            f"{PREFIX}EVENT_LOOP={name} but uvloop cannot be imported ({exc}): install"
            f" custody's dependencies, or set {PREFIX}EVENT_LOOP=asyncio"
        ) from None
    return uvloop.new_event_loop


def name_of(loop: asyncio.AbstractEventLoop) -> str:
    """Which loop this is, as the setting names it (``worker.started`` says it)."""
    return "uvloop" if type(loop).__module__.split(".")[0] == "uvloop" else "asyncio"
