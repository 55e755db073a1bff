"""Batches from a delivery queue: wait for the first item, then linger for more."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from workers.runtime.supervisor import Stop


async def next_batch(
    inbox: asyncio.Queue[Any], stop: Stop, *, size: int, linger_s: float, idle_s: float = 0.5
) -> list[Any]:
    """Up to ``size`` items: wait for the first (waking to check stop), then linger."""
    batch: list[Any] = []
    while not batch:
        if stop.requested:
            return batch
        try:
            batch.append(await asyncio.wait_for(inbox.get(), idle_s))
        except TimeoutError:
            continue
    deadline = time.monotonic() + linger_s
    while len(batch) < size:
        try:
            batch.append(inbox.get_nowait())
            continue
        except asyncio.QueueEmpty:
            pass
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            batch.append(await asyncio.wait_for(inbox.get(), remaining))
        except TimeoutError:
            break
    return batch
