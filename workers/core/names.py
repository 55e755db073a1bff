"""The names of custody's worker types: one vocabulary for the ``worker`` field of the
logs, the ``worker`` label of the metrics, the Deployments and ScaledObjects of
deploy/k8s and the PodMonitors that scrape them. Pure.

An engine worker is named by its type (``committer``); a participant by its owner
name with a prefix (``participant-inventory``), as ``custody run participant --name
inventory`` logs it and as its Deployment is called (``custody-participant-inventory``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

ENGINE_WORKERS: Final[tuple[str, ...]] = (
    "committer",
    "publisher",
    "receipts",
    "reconciler",
)
# The kind of every participant process: the families it exports are the same for each.
PARTICIPANT: Final = "participant"
PARTICIPANT_PREFIX: Final = "participant-"
KINDS: Final[tuple[str, ...]] = (*ENGINE_WORKERS, PARTICIPANT)


def participant_worker(owner: str) -> str:
    """The worker name of participant ``owner`` (``inventory`` → ``participant-inventory``)."""
    return PARTICIPANT_PREFIX + owner


def kind_of(worker: str) -> str:
    """The worker type of a worker name: an engine worker, or ``participant``."""
    if worker in ENGINE_WORKERS:
        return worker
    if worker.startswith(PARTICIPANT_PREFIX) and len(worker) > len(PARTICIPANT_PREFIX):
        return PARTICIPANT
    raise ValueError(f"not a custody worker name: {worker!r}")


def worker_names(participants: Iterable[str]) -> tuple[str, ...]:
    """Every worker name of a fleet whose participants are ``participants`` (owners)."""
    return (*ENGINE_WORKERS, *(participant_worker(p) for p in sorted(set(participants))))
