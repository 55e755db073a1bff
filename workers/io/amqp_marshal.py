"""The frames of a publish, encoded without pamqp's general machinery.

Every message custody sends (a submit, a receipt, a query's answer) is three frames:
``Basic.Publish``, its content header, its body. pamqp encodes each through its
generic, attribute-by-attribute marshalling: 8 µs of a publish's CPU, in every worker
that publishes, for frames whose shape never changes.

- ``Basic.Publish`` depends only on the channel, the exchange, the routing key and the
  two flags: its bytes are kept by those (a worker sends to a handful of them), after
  pamqp encoded (and validated) it the first time.
- The content header is encoded directly when its properties are the ones custody
  sets (content type, headers whose values are all strings, delivery mode, priority,
  message id, user id); any other property, or any other value type, goes to pamqp
  as before.
- The body frame is the body between its frame header and frame end.

Anything else (every other method, heartbeats) is pamqp's. The output is pamqp's,
byte for byte: ``tests/unit/test_amqp_marshal.py`` holds it to pamqp's own encoder over
generated frames. The pinned versions are those of ``amqp_frames``, checked the same way.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

import pamqp.frame
from pamqp import body, commands, constants, header

from workers.io import amqp_frames

_Publish = commands.Basic.Publish
_Properties = commands.Basic.Properties
_FRAME: Final = struct.Struct(">BHI")  # type, channel, payload size
_HEADER: Final = struct.Struct(">HxxQ")  # class id, weight, body size
_FRAME_END: Final = constants.FRAME_END_CHAR
_PUBLISHES_KEPT: Final = 4096
# The flag bit of each property. The fast path encodes those of _ENCODERS (in wire
# order); the others must be absent (None or ''), which pamqp leaves out.
_FLAGS: Final = _Properties.flags

UPSTREAM: Final[Callable[[pamqp.frame.FrameTypes, int], bytes]] = pamqp.frame.marshal
_publishes: dict[tuple[int, str, str, bool, bool], bytes] = {}


def marshal(frame_value: pamqp.frame.FrameTypes, channel_id: int) -> bytes:
    """``pamqp.frame.marshal``, faster for the three frames of a publish."""
    frame = frame_value
    if type(frame) is body.ContentBody:
        value = frame.value
        return b"".join(
            (_FRAME.pack(constants.FRAME_BODY, channel_id, len(value)), value, _FRAME_END)
        )
    if type(frame) is header.ContentHeader:
        payload = encode_properties(frame.properties)
        if payload is not None:
            payload = _HEADER.pack(commands.Basic.frame_id, frame.body_size) + payload
            return b"".join(
                (_FRAME.pack(constants.FRAME_HEADER, channel_id, len(payload)), payload, _FRAME_END)
            )
    elif (
        type(frame) is _Publish
        and frame.ticket == 0
        and type(frame.mandatory) is bool
        and type(frame.immediate) is bool
    ):
        # nothing else is in the frame: its bytes are those of its key (1 == 1.0 == True
        # would share a key, hence bools only)
        key = (channel_id, frame.exchange, frame.routing_key, frame.mandatory, frame.immediate)
        known = _publishes.get(key)
        if known is None:
            known = UPSTREAM(frame, channel_id)  # validated and encoded by pamqp, once
            if len(_publishes) < _PUBLISHES_KEPT:
                _publishes[key] = known
        return known
    return UPSTREAM(frame, channel_id)


def encode_properties(p: Any) -> bytes | None:
    """The encoded properties (flags, then values), or None if they are not the plain
    ones this encodes (pamqp does those)."""
    if type(p) is not _Properties:
        return None
    for name in _ABSENT:
        value = getattr(p, name)
        if value is not None and value != "":
            return None
    flags = 0
    parts: list[bytes] = []
    for name, encode in _ENCODERS:  # in wire order
        value = getattr(p, name)
        if value is not None and value != "":  # pamqp's test for a present property
            encoded = encode(value)
            if encoded is None:
                return None
            flags |= _FLAGS[name]
            parts.append(encoded)
    return flags.to_bytes(2, "big") + b"".join(parts)


def _octet(value: Any) -> bytes | None:
    return bytes((value,)) if type(value) is int and 0 <= value <= 255 else None


def _short(value: Any) -> bytes | None:
    if type(value) is not str:
        return None
    raw = value.encode("utf-8")
    return bytes((len(raw),)) + raw if len(raw) <= 255 else None


def _table(table: Any) -> bytes | None:
    """A field table whose keys are short and whose values are all strings (``S``)."""
    if type(table) is not dict:
        return None
    out: list[bytes] = []
    for key, value in sorted(table.items()):
        if type(key) is not str or type(value) is not str:
            return None
        k = key.encode("utf-8")
        if len(k) > 128:  # pamqp truncates such a key (with a warning): its way, not ours
            return None
        v = value.encode("utf-8")
        out.append(bytes((len(k),)) + k + b"S" + len(v).to_bytes(4, "big") + v)
    data = b"".join(out)
    return len(data).to_bytes(4, "big") + data


_ENCODERS: Final[tuple[tuple[str, Callable[[Any], bytes | None]], ...]] = (
    ("content_type", _short),
    ("headers", _table),
    ("delivery_mode", _octet),
    ("priority", _octet),
    ("message_id", _short),
    ("user_id", _short),
)
_ABSENT: Final = tuple(n for n in _Properties.__slots__ if n not in dict(_ENCODERS))


def install() -> None:
    """Put the encoder in place (idempotent); the pinned versions of ``amqp_frames``."""
    found = amqp_frames.installed_versions()
    if found != amqp_frames.PINNED:
        raise RuntimeError(
            f"workers.io.amqp_marshal is pinned to {amqp_frames.PINNED}, found {found}:"
            " re-check the publish encoder (tests/unit/test_amqp_marshal.py) before upgrading"
        )
    pamqp.frame.marshal = marshal


def is_installed() -> bool:
    return pamqp.frame.marshal is marshal
