"""Structured logs: one JSON object per line, with stable keys and event names."""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from typing import Any

log = logging.getLogger("custody")


_STABLE = ("ts", "level", "event", "logger")
_EVENT_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")


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


class JsonFormatter(logging.Formatter):
    """One JSON object per line: a stable event name and structured fields. Records
    of libraries (free text) become ``log.library`` with their text as ``message``."""

    def format(self, record: logging.LogRecord) -> str:
        message = _text(record.getMessage())
        ours = record.name == "custody" and _EVENT_NAME.match(message) is not None
        payload: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "event": message if ours else "log.library",
            "logger": record.name,
        }
        if not ours:
            payload["message"] = message
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                name = _text(key)
                payload[f"field_{name}" if name in _STABLE else name] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(_plain(payload), allow_nan=False)


def setup_logging(fmt: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s %(fields)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("aio_pika", "aiormq", "psycopg.pool"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # every connection attempt is custody's own event (broker.connect_retry, with the
    # node and the real delay); aio-pika's warning about the same attempt only repeats it
    logging.getLogger("aio_pika.robust_connection").setLevel(logging.ERROR)


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log an event with structured fields."""
    log.log(level, name, extra={"fields": fields})
