"""W3C trace context: carried in AMQP headers and outbox rows, never in a digest."""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from contextvars import ContextVar, Token
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


# Set only while a tracer is on (workers.runtime.otel): then a row continues a span that
# was really exported, never a span id of its own that no trace backend has seen. The
# mapping sends a span to the one that continues it here (a consume span to the
# transaction span under it); any other span is continued as it is. Unset, as when
# tracing is off, every row gets a new span id, as it always did.
_SPANS: ContextVar[Mapping[str, str] | None] = ContextVar("custody_trace_spans", default=None)
Continuing = Token[Mapping[str, str] | None]


def child(traceparent: str | None) -> str:
    """A new span in the same trace (a new trace if there is none); while a tracer is
    on, the real span that continues ``traceparent``."""
    match = _TRACEPARENT.match(traceparent or "")
    if not match:
        return new_traceparent()
    spans = _SPANS.get()
    if spans is not None:
        return spans.get(match.group(0), match.group(0))
    return f"00-{match.group(1)}-{secrets.token_hex(8)}-{match.group(3)}"


def continuing(spans: Mapping[str, str]) -> Continuing:
    """Rows written from now on (in this context) continue real spans (see ``child``)."""
    outer = _SPANS.get()
    return _SPANS.set({**outer, **spans} if outer else dict(spans))


def done_continuing(token: Continuing) -> None:
    _SPANS.reset(token)


def valid(traceparent: str | None) -> bool:
    match = _TRACEPARENT.match(traceparent or "")
    return match is not None and match.group(1) != "0" * 32


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
