"""Batches from a delivery queue: wait for the first item, then take what is there.

Batching is natural: while one batch's transaction runs, the next deliveries queue
up, so under load a batch fills by itself. A linger (waiting ``linger_s`` for more)
only pays while deliveries keep coming: a lone delivery at light load is handled at
once, never held back for a linger that nothing will fill.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from workers.runtime.supervisor import Stop


async def next_batch(
    inbox: asyncio.Queue[Any], stop: Stop, *, size: int, linger_s: float, idle_s: float = 0.5
) -> list[Any]:
    """Up to ``size`` items: wait for the first (waking to check stop), take what is
    queued behind it, and linger for more only if more were queued."""
    batch: list[Any] = []
    while not batch:
        if stop.requested:
            return batch
        try:
            batch.append(await asyncio.wait_for(inbox.get(), idle_s))
        except TimeoutError:
            continue
    _drain(inbox, batch, size)
    await asyncio.sleep(0)  # deliveries already read from the socket reach the queue
    _drain(inbox, batch, size)
    if len(batch) == 1:
        return batch  # nothing behind it: light load, no linger
    deadline = time.monotonic() + linger_s
    while len(batch) < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            batch.append(await asyncio.wait_for(inbox.get(), remaining))
        except TimeoutError:
            break
        _drain(inbox, batch, size)
    return batch


def _drain(inbox: asyncio.Queue[Any], batch: list[Any], size: int) -> None:
    while len(batch) < size:
        try:
            batch.append(inbox.get_nowait())
        except asyncio.QueueEmpty:
            return
