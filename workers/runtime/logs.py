"""Structured logs: one JSON object per line on stdout, stable keys and event names.

structlog renders every line, custody's own events and the stdlib records of the
libraries (aio-pika, aiormq, psycopg) alike, through one ``ProcessorFormatter`` on the
root handler: ``ts`` (ISO-8601 UTC, microseconds), ``level``, ``event``, ``logger``
first, then the unit's correlation ids, then the event's fields. A library record
becomes ``log.library`` with its text as ``message``.

Correlation: :func:`bound` puts ids (``trace_id``, ``message_id``, ``operation_id``,
``instance_id``, ``worker``) in a context variable for the duration of a unit of
work, and every line logged inside it carries them, library lines and errors
included. It is one context variable holding a small dict, not structlog's
``bound_contextvars`` (one variable per key): it is entered once per message on the
hot path, and costs a few microseconds where the other costs tens.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import re
import sys
from collections.abc import Mapping, MutableMapping
from contextvars import ContextVar, Token
from types import TracebackType
from typing import Any, Final

import orjson
import structlog

log = logging.getLogger("custody")

_STABLE: Final = ("ts", "level", "event", "logger")
_EVENT_NAME: Final = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
LIBRARY: Final = "log.library"
# what ProcessorFormatter adds to an event dict for its own use
_META: Final = frozenset(("_record", "_from_structlog"))

_EMPTY: Mapping[str, Any] = {}
_UNIT: ContextVar[Mapping[str, Any]] = ContextVar("custody_log_unit", default=_EMPTY)


class bound:  # noqa: N801 (used as a function: ``with logs.bound(message_id=...):``)
    """The ids of a unit of work (``None`` values left out), on every line logged
    inside the block, nested scopes adding to the outer one."""

    __slots__ = ("_ids", "_token")

    def __init__(self, **ids: Any) -> None:
        self._ids = {k: v for k, v in ids.items() if v is not None}
        self._token: Token[Mapping[str, Any]] | None = None

    def __enter__(self) -> None:
        outer = _UNIT.get()
        self._token = _UNIT.set({**outer, **self._ids} if outer else self._ids)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _UNIT.reset(self._token)


def current() -> Mapping[str, Any]:
    """The ids bound right now (what a line logged here would carry)."""
    return _UNIT.get()


def _text(value: object) -> str:
    try:
        return str(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"


def _plain(value: object, depth: int = 0) -> Any:
    """A JSON-safe copy: strings for anything exotic, no NaN, keys as strings."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _text(value)
    if depth > 16:
        return _text(value)
    if isinstance(value, dict):
        return {
            k if isinstance(k, str) else _text(k): _plain(v, depth + 1) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    return _text(value)


_TRACEBACKS = logging.Formatter()


def _exc(exc_info: object) -> str | None:
    if exc_info is True:
        exc_info = sys.exc_info()
    elif isinstance(exc_info, BaseException):
        exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
    if isinstance(exc_info, tuple) and len(exc_info) == 3 and exc_info[0] is not None:
        return _TRACEBACKS.formatException(exc_info)
    return None


def iso(created: float) -> str:
    """A record's time as ISO-8601 UTC with microseconds (``2026-12-01T21:39:38.123456Z``)."""
    return dt.datetime.fromtimestamp(created, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_SKIP: Final = _META | {"event", "exc_info"}


def _shape(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The line's object: the stable keys first and in order, then the unit's ids, then
    the fields (one named like a stable key gets a ``field_`` prefix), then ``exc``.

    A custody record (from :func:`event`, or a stdlib record of the ``custody`` logger
    whose message is an event name, with its ``fields`` extra) keeps its name; any other
    record is ``log.library`` with its text as ``message``."""
    record: logging.LogRecord = event_dict["_record"]
    fields: Mapping[str, Any]
    if event_dict.get("_from_structlog"):
        name = _text(event_dict.get("event"))
        fields = {k: v for k, v in event_dict.items() if k not in _SKIP}
    else:
        message = _text(event_dict.get("event"))
        extra = getattr(record, "fields", None)
        if record.name == log.name and _EVENT_NAME.match(message):
            name = message
            fields = {**_UNIT.get(), **(extra if isinstance(extra, dict) else {})}
        else:
            name = LIBRARY
            fields = {**_UNIT.get(), "message": message}
    out: dict[str, Any] = {
        "ts": iso(record.created),
        "level": record.levelname.lower(),
        "event": name,
        "logger": record.name,
    }
    for key, value in fields.items():
        k = _text(key)
        out[f"field_{k}" if k in _STABLE else k] = value
    exc_info = event_dict.get("exc_info")
    exc = _exc(exc_info) if exc_info else None
    if exc is not None:
        out["exc"] = exc
    return out


def _json(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> str:
    return orjson.dumps(_plain(event_dict)).decode()


def _unit(_: Any, __: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    ids = _UNIT.get()
    return {**ids, **event_dict} if ids else event_dict


class _Text:
    """structlog's console renderer (no colours) for a human at a terminal."""

    def __init__(self) -> None:
        self._render = structlog.dev.ConsoleRenderer(
            colors=False,
            timestamp_key="ts",
            sort_keys=False,
            pad_event_to=28,
            exception_formatter=structlog.dev.plain_traceback,
        )

    def __call__(self, logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> str:
        plain = _plain(dict(event_dict))
        if "exc" in plain:
            plain["exception"] = plain.pop("exc")
        return str(self._render(logger, method, plain))


def formatter(fmt: str = "json") -> logging.Formatter:
    """The one formatter of every record: ``json`` (production) or ``text`` (a human at
    a terminal)."""
    render = _json if fmt == "json" else _Text()
    return structlog.stdlib.ProcessorFormatter(processors=[_shape, render])


def setup_logging(fmt: str, level: int = logging.INFO) -> None:
    """Every record of the process, ours and the libraries', to stdout through
    :func:`formatter`."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("aio_pika", "aiormq", "psycopg.pool"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    # every connection attempt is custody's own event (broker.connect_retry, with the
    # node and the real delay); aio-pika's warning about the same attempt only repeats it
    logging.getLogger("aio_pika.robust_connection").setLevel(logging.ERROR)


def level_of(name: str) -> int:
    """``debug``, ``info``, ``warning``, ``error`` (CUSTODY_LOG_LEVEL) as a stdlib level."""
    value = logging.getLevelName(name.strip().upper())
    if not isinstance(value, int):
        raise ValueError(name)
    return value


class _Message(dict[str, Any]):
    """The event dict as a record's ``msg``: a handler other than ours (pytest's capture
    handler, one a library adds) reads its text as the event name, and never calls the
    ``repr`` of a field, which may raise."""

    def __str__(self) -> str:
        return _text(self.get("event"))

    __repr__ = __str__


def _wrap(logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> Any:
    return (_Message(event_dict),), {"extra": {"_logger": logger, "_name": name}}


# custody's own events: structlog's stdlib bound logger over the ``custody`` logger, its
# event dict handed to the root handler's ProcessorFormatter (no global configuration;
# ``_wrap`` is structlog's ``ProcessorFormatter.wrap_for_formatter`` with a safe msg)
_events = structlog.wrap_logger(
    log,
    processors=[_unit, _wrap],
    wrapper_class=structlog.stdlib.BoundLogger,
)


def enabled(level: int) -> bool:
    """Whether a line at ``level`` would be written: check it before building the
    fields of a line on the hot path (the debug ``unit.done``)."""
    return log.isEnabledFor(level)


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log an event with structured fields (and the ids bound by :func:`bound`)."""
    if not log.isEnabledFor(level):
        return
    if "event" in fields:
        fields["field_event"] = fields.pop("event")
    _events.log(level, name, **fields)
