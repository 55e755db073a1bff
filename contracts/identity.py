"""Deterministic identities, derived from lineage and never random per try.

Re-creating the same transition (after a crash or a restore) yields the same ids,
so the participant deduplicates instead of executing twice. Test vectors for these
live in ``contracts/vectors/identity.json``.
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from typing import Literal

NAMESPACE = uuid.UUID("6f6b9d8e-2a55-4c1e-9a51-637573746f64")
_NAMESPACE_BYTES = NAMESPACE.bytes

CommandKind = Literal["submit", "query", "cancel"]


def _derive(*parts: object) -> str:
    return uuid5_text("|".join(str(p) for p in parts))


@functools.lru_cache(maxsize=16_384)
def uuid5_text(name: str) -> str:
    """``str(uuid.uuid5(NAMESPACE, name))`` (RFC 4122 version 5), without building a UUID
    object: every worker derives several ids per message, often the same one twice (a
    receipt's id when it is made, journaled and checked), so the hot path pays for the
    SHA-1 once per name. The vectors in ``contracts/vectors/identity.json`` pin it."""
    h = bytearray(hashlib.sha1(_NAMESPACE_BYTES + name.encode()).digest()[:16])
    h[6] = (h[6] & 0x0F) | 0x50  # version 5
    h[8] = (h[8] & 0x3F) | 0x80  # the RFC 4122 variant
    x = h.hex()
    return f"{x[:8]}-{x[8:12]}-{x[12:16]}-{x[16:20]}-{x[20:]}"


def canonical(value: str) -> str | None:
    """The one spelling of an id (lower-case, hyphenated, no braces or urn prefix), or
    None if ``value`` is not a UUID. Every id that enters at an edge (the CLI, the
    broker) is canonicalised before it is compared, hashed into a lock or stored."""
    try:
        return str(uuid.UUID(value.strip()))
    except (ValueError, AttributeError):
        return None


def instance_id(tenant: str, start_request_id: str) -> str:
    return _derive("instance", tenant, start_request_id)


def operation_id(tenant: str, instance: str, node: str, activation: int) -> str:
    return _derive("operation", tenant, instance, node, activation)


def request_id(operation: str, attempt: int, kind: CommandKind, sequence: int = 1) -> str:
    return _derive("request", operation, attempt, kind, sequence)


def receipt_id(request: str, owner_revision: int) -> str:
    return _derive("receipt", request, owner_revision)


def answer_id(query_request: str, owner_revision: int) -> str:
    return _derive("answer", query_request, owner_revision)


def conflict_receipt_id(request: str, received_digest: str) -> str:
    """The answer to a command that reused ``request`` with another digest."""
    return _derive("conflict", request, received_digest)


def start_request_ids(first: str, count: int) -> list[str]:
    """The start request ids of ``custody instances start --start-request-id FIRST
    --count N``: ``first`` itself, then one derived from it per further instance, so
    the same command retried (after a confirm timeout) names the same starts and the
    engine, which deduplicates starts by ``(tenant, start_request_id)``, creates none
    twice."""
    return [first, *(_derive("start", first, i) for i in range(1, count))]
