"""W3C trace context: carried in AMQP headers and outbox rows, never in a digest."""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from typing import Any

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def new_traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


def from_headers(headers: Mapping[str, Any]) -> str:
    """The caller's traceparent if it is valid, else a new trace."""
    value = headers.get("traceparent")
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and _TRACEPARENT.match(value) and value[3:35] != "0" * 32:
        return value
    return new_traceparent()


def child(traceparent: str | None) -> str:
    """A new span in the same trace (a new trace if there is none)."""
    match = _TRACEPARENT.match(traceparent or "")
    if not match:
        return new_traceparent()
    return f"00-{match.group(1)}-{secrets.token_hex(8)}-{match.group(3)}"


def trace_id(traceparent: object) -> str | None:
    """The 32-hex trace id of a traceparent (a str or the bytes of a header), or None."""
    if isinstance(traceparent, bytes):
        traceparent = traceparent.decode("ascii", "replace")
    if not isinstance(traceparent, str):
        return None
    match = _TRACEPARENT.match(traceparent)
    return match.group(1) if match else None


def trace_id_of(headers: Mapping[str, Any]) -> str | None:
    """The trace id a message's headers carry, or None (never a new one)."""
    return trace_id(headers.get("traceparent"))
