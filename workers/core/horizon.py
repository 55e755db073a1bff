"""The retention horizon: how long receipts, inbox rows and tombstones are kept, and
the archive horizon: how long a finished instance stays in the hot tables. Pure.

"Receipt retention and deduplication history must cover every permitted retry,
replay and restore horizon." :func:`check` refuses, at start-up, a configuration
whose horizon is shorter, or whose archive horizon is shorter than the retention
horizon (an instance would leave while its receipts' deduplication rows, which refer
to it, are still kept); the engine's and each participant's cleanup remove what is
older (``workers.engine.retention``, ``workers.participant.retention``).
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.core import process
from workers.errors import ConfigError
from workers.settings import Settings


@dataclass(frozen=True)
class Window:
    seconds: float
    where: str


def longest_retry_window(catalog: process.Catalog) -> Window:
    """The longest time a node may keep issuing attempts: every attempt's deadline plus
    every backoff between them, over all nodes of all loaded definitions."""
    longest = Window(0.0, "no node")
    for (name, version), definition in catalog.definitions.items():
        for node in definition.nodes.values():
            attempts = node.retry.max_attempts if node.retry else 1
            backoff = sum(node.retry.delay(a) for a in range(1, attempts)) if node.retry else 0.0
            window = attempts * node.deadline_seconds + backoff
            if window > longest.seconds:
                longest = Window(window, f"node {node.name!r} of {name} v{version}")
    return longest


def archive_after(settings: Settings) -> float:
    """Seconds after it finished that an instance moves to the archive
    (``CUSTODY_ARCHIVE_AFTER_S``; 0 means the retention horizon)."""
    return settings.archive_after_s or settings.retention_s


def check(settings: Settings, catalog: process.Catalog) -> None:
    if settings.archive_after_s and settings.archive_after_s < settings.retention_s:
        raise ConfigError(
            f"CUSTODY_ARCHIVE_AFTER_S={settings.archive_after_s:g}s is shorter than "
            f"CUSTODY_RETENTION_S ({settings.retention_s:g}s): a finished instance would "
            "leave the hot tables while the receipts that deduplicate its operations are "
            "still kept"
        )
    retry = longest_retry_window(catalog)
    needed = retry.seconds + settings.replay_horizon_s + settings.restore_horizon_s
    if settings.retention_s < needed:
        raise ConfigError(
            f"CUSTODY_RETENTION_S={settings.retention_s:g}s is shorter than the longest retry "
            f"window ({retry.seconds:g}s, {retry.where}) + CUSTODY_REPLAY_HORIZON_S "
            f"({settings.replay_horizon_s:g}s) + CUSTODY_RESTORE_HORIZON_S "
            f"({settings.restore_horizon_s:g}s) = {needed:g}s: a permitted retry, replay or "
            "restore could then find its deduplication history gone"
        )
