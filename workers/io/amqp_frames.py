"""A total decoder for the AMQP frames that carry a publisher's bytes to a consumer.

pamqp 4.0.1 decodes AMQP short strings and header-table keys strictly
(``bytes.decode("utf-8")``), and its timestamp decoder lets ``OverflowError`` escape;
aiormq 7.2.4 turns any such error into ``InvalidFrameError`` and closes the whole
connection. RabbitMQ does not check UTF-8, so any user allowed to publish to a queue
could take every consumer of that queue down, and with it every delivery prefetched on
the connection (requeued, each one a step closer to the delivery limit).

This module replaces the two decoding steps that see publisher-controlled bytes:

- the content header frame (``pamqp.frame._unmarshal_header_frame``): decoded by the
  linear, total decoder below. Invalid UTF-8 is kept losslessly with
  ``surrogateescape``; a value that cannot be represented at all (a timestamp out of
  range, an unknown field type, a nesting deeper than ``MAX_DEPTH``, a
  ``delivery_mode`` or ``expiration`` aio-pika would choke on) becomes ``None``. Either
  way the headers get the key ``MARK`` with an :class:`Undecodable` value (a type no
  wire value can have), which ``workers.io.broker`` turns into ``Delivery.undecodable``.
- method frames (``pamqp.frame._unmarshal_method_frame``): decoded strictly as
  before; only a ``Basic.Deliver``/``Basic.GetOk``/``Basic.Return`` whose short strings
  are not UTF-8 (a routing key chosen by the publisher, delivered through ``CC``) is
  decoded again with ``surrogateescape``. A string with a lone surrogate is never the
  result of decoding valid UTF-8, so it marks itself.

The patch is pinned: :func:`install` refuses to run on other versions of pamqp/aiormq
than the ones it was written and tested against (``tests/unit/test_amqp_frames.py``
fails too), so an upgrade cannot silently undo it. Only ``workers.io.broker`` imports this.
"""

from __future__ import annotations

import datetime
import decimal
import importlib.metadata
import struct
from collections.abc import Callable
from typing import Any, Final

import pamqp.frame
from pamqp import commands, exceptions, header

PINNED: Final = {"pamqp": "4.0.1", "aiormq": "7.2.4", "aio-pika": "10.2.1"}
MARK: Final = "\x00custody-undecodable"
MAX_DEPTH: Final = 32
_PROBLEMS_KEPT: Final = 8

_Properties = commands.Basic.Properties
_DELIVERABLE: Final = (commands.Basic.Deliver, commands.Basic.GetOk, commands.Basic.Return)


class Undecodable:
    """What was wrong with a message's properties (never a value off the wire)."""

    __slots__ = ("problems", "raw")

    def __init__(self, problems: list[str], raw: bytes) -> None:
        self.problems = problems[:_PROBLEMS_KEPT]
        self.raw = raw

    def describe(self) -> str:
        more = " …" if len(self.problems) >= _PROBLEMS_KEPT else ""
        return "; ".join(self.problems) + more + f"; raw properties (hex) {self.raw[:600].hex()}"

    def __repr__(self) -> str:
        return f"Undecodable({self.problems!r})"


class _Skip(Exception):
    """A value whose extent is unknown: the enclosing table or array is abandoned."""


_S = struct.Struct
_B, _b = _S(">B"), _S(">b")
_H, _h = _S(">H"), _S(">h")
_I, _i = _S(">I"), _S(">i")
_Q, _q = _S(">Q"), _S(">q")
_f, _d = _S(">f"), _S(">d")


class _Reader:
    """Offsets into one immutable buffer: linear in its size, whatever it holds."""

    def __init__(self, data: bytes, problems: list[str]) -> None:
        self.data = data
        self.problems = problems

    def problem(self, text: str) -> None:
        if len(self.problems) < _PROBLEMS_KEPT:
            self.problems.append(text)

    def unpack(self, fmt: struct.Struct, at: int) -> tuple[Any, int]:
        end = at + fmt.size
        if end > len(self.data):
            raise _Skip(f"truncated at byte {at}")
        return fmt.unpack_from(self.data, at)[0], end

    def text(self, raw: bytes, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.problem(f"{what}: not UTF-8 ({exc.reason} at byte {exc.start})")
            return raw.decode("utf-8", "surrogateescape")

    def short_str(self, at: int, what: str) -> tuple[str, int]:
        length, at = self.unpack(_B, at)
        if at + length > len(self.data):
            raise _Skip(f"{what}: truncated")
        return self.text(self.data[at : at + length], what), at + length

    def timestamp(self, at: int, what: str) -> tuple[datetime.datetime | None, int]:
        value, at = self.unpack(_Q, at)
        seconds = value / 1000.0 if value > 0xFFFFFFFF else value  # pamqp's heuristic
        try:
            return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC), at
        except (OverflowError, OSError, ValueError):
            self.problem(f"{what}: timestamp {value} out of range")
            return None, at

    def table(self, at: int, what: str, depth: int) -> tuple[dict[str, Any], int]:
        length, at = self.unpack(_I, at)
        end = at + length
        if end > len(self.data):
            raise _Skip(f"{what}: table length {length} exceeds the frame")
        out: dict[str, Any] = {}
        if depth > MAX_DEPTH:
            self.problem(f"{what}: nested deeper than {MAX_DEPTH}")
            return out, end
        try:
            while at < end:
                key_length, at = self.unpack(_B, at)
                if at + key_length > end:
                    raise _Skip(f"{what}: key length exceeds the table")
                key = self.text(self.data[at : at + key_length], f"{what} key")
                at += key_length
                out[key], at = self.value(at, f"{what}[{key[:40]!r}]", depth, end)
        except _Skip as exc:
            self.problem(str(exc))
        return out, end

    def array(self, at: int, what: str, depth: int) -> tuple[list[Any], int]:
        length, at = self.unpack(_I, at)
        end = at + length
        if end > len(self.data):
            raise _Skip(f"{what}: array length {length} exceeds the frame")
        out: list[Any] = []
        if depth > MAX_DEPTH:
            self.problem(f"{what}: nested deeper than {MAX_DEPTH}")
            return out, end
        try:
            while at < end:
                item, at = self.value(at, f"{what}[{len(out)}]", depth, end)
                out.append(item)
        except _Skip as exc:
            self.problem(str(exc))
        return out, end

    def value(self, at: int, what: str, depth: int, limit: int) -> tuple[Any, int]:
        """One field value, the same Python value pamqp 4.0.1 gives for it."""
        kind, at = self.unpack(_B, at)
        tag = bytes((kind,))
        simple = _SIMPLE.get(tag)
        if simple is not None:
            result, end = self.unpack(simple, at)
        elif tag == b"t":
            flag, end = self.unpack(_B, at)
            result = bool(flag)
        elif tag == b"D":
            places, at = self.unpack(_B, at)
            raw, end = self.unpack(_i, at)  # pamqp's "uint" is signed
            result = decimal.Decimal(raw) * (decimal.Decimal(10) ** -places)
        elif tag in (b"S", b"x"):
            length, at = self.unpack(_I, at)
            end = at + length
            if end > limit:
                raise _Skip(f"{what}: string length {length} exceeds the table")
            raw_value = self.data[at:end]
            if tag == b"x":
                result = bytearray(raw_value)
            else:
                try:
                    result = raw_value.decode("utf-8")
                except UnicodeDecodeError:
                    result = raw_value  # a long string is binary: pamqp gives bytes too
        elif tag == b"T":
            result, end = self.timestamp(at, what)
        elif tag == b"F":
            result, end = self.table(at, what, depth + 1)
        elif tag == b"A":
            result, end = self.array(at, what, depth + 1)
        elif tag in (b"V", b"\x00"):
            result, end = None, at
        else:
            raise _Skip(f"{what}: unknown field type {tag!r}")
        if end > limit:
            raise _Skip(f"{what}: value exceeds the table")
        return result, end


_SIMPLE: Final[dict[bytes, struct.Struct]] = {
    b"b": _b,
    b"B": _B,
    b"s": _h,
    b"u": _H,
    b"I": _i,
    b"i": _I,
    b"l": _q,
    b"L": _q,
    b"f": _f,
    b"d": _d,
}


def decode_properties(flags: int, data: bytes) -> tuple[commands.Basic.Properties, list[str]]:
    """Basic.Properties from a content header's property list; never raises. Returns
    the properties and what was wrong with them (empty: pamqp would agree)."""
    problems: list[str] = []
    reader = _Reader(data, problems)
    props = _Properties()
    at = 0
    try:
        for name in _Properties.__slots__:
            if not flags & _Properties.flags[name]:
                continue
            kind = getattr(_Properties, "_" + name)
            value: Any
            if kind == "shortstr":
                value, at = reader.short_str(at, name)
            elif kind == "octet":
                value, at = reader.unpack(_B, at)
            elif kind == "timestamp":
                value, at = reader.timestamp(at, name)
            else:  # table
                value, at = reader.table(at, name, 0)
            setattr(props, name, value)
    except _Skip as exc:
        problems.append(f"properties: {exc}")
    # what aio-pika 10.2.1's IncomingMessage would raise on, outside the consumer
    # callback, leaving the delivery unacked and its prefetch slot taken for good
    if props.delivery_mode not in (None, 0, 1, 2):
        problems.append(f"delivery_mode {props.delivery_mode!r}")
        props.delivery_mode = None
    if props.expiration is not None:
        try:
            float(props.expiration)
        except ValueError:
            problems.append("expiration is not a number")
            props.expiration = None
    return props, problems


def _flags(data: bytes) -> tuple[int, int]:
    """The property flags (pamqp's layout: continuation words shifted by 16 each)."""
    flags, at, index = 0, 0, 0
    while True:
        if len(data) < at + 2:
            raise ValueError("Content header flags are truncated")
        word = _H.unpack_from(data, at)[0]
        at += 2
        flags |= word << (index * 16)
        if not word & 1:
            return flags, at
        index += 1


def unmarshal_header_frame(frame_data: bytes) -> header.ContentHeader:
    """The replacement of ``pamqp.frame._unmarshal_header_frame``: raises only when
    the frame's own structure (class, weight, body size, flags) is broken, exactly as
    pamqp does; whatever a publisher put in the properties is decoded or marked."""
    content = header.ContentHeader()
    try:
        content.class_id, content.weight, content.body_size = struct.unpack(
            ">HHQ", frame_data[0:12]
        )
        flags, used = _flags(frame_data[12:])
    except (struct.error, ValueError) as error:
        raise exceptions.UnmarshalingException("ContentHeader", error) from error
    raw = frame_data[12 + used :]
    props, problems = decode_properties(flags, raw)
    if problems:
        headers: dict[str, Any] = dict(props.headers or {})
        headers[MARK] = Undecodable(problems, raw)
        props.headers = headers
    content.properties = props
    return content


def _lenient_method(frame_data: bytes) -> Any:
    index = _I.unpack_from(frame_data, 0)[0]
    cls = commands.INDEX_MAPPING.get(index)
    if cls is None or not issubclass(cls, _DELIVERABLE):
        return None
    method = cls()
    problems: list[str] = []
    reader = _Reader(frame_data, problems)
    at, bit, byte = 4, -1, 0
    for name in method.__slots__:
        kind = method.amqp_type(name)
        if kind == "bit":
            bit += 1
            if bit == 0:
                byte, at = reader.unpack(_B, at)
            setattr(method, name, bool(byte & (1 << bit)))
            continue
        bit = -1
        if kind == "shortstr":
            value, at = reader.short_str(at, name)
        else:
            fmt = {"longlong": _Q, "long": _I, "short": _H, "octet": _B}[kind]
            value, at = reader.unpack(fmt, at)
        setattr(method, name, value)
    return method


def unmarshal_method_frame(frame_data: bytes) -> Any:
    """The replacement of ``pamqp.frame._unmarshal_method_frame``: pamqp's own decoding,
    except that a delivery whose short strings are not UTF-8 is decoded with
    ``surrogateescape`` instead of closing the connection."""
    try:
        return UPSTREAM_METHOD(frame_data)
    except exceptions.UnmarshalingException as error:
        if not isinstance(error.__cause__, UnicodeDecodeError):
            raise
        try:
            method = _lenient_method(frame_data)
        except (_Skip, struct.error, KeyError):
            method = None
        if method is None:
            raise
        return method


# pamqp's own decoders, kept before install() replaces them: the method decoder tries
# pamqp's first, and the tests hold the patch equal to them.
UPSTREAM_HEADER: Final[Callable[[bytes], header.ContentHeader]] = (
    pamqp.frame._unmarshal_header_frame
)
UPSTREAM_METHOD: Final[Callable[[bytes], Any]] = pamqp.frame._unmarshal_method_frame


def installed_versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in PINNED}


def install() -> None:
    """Put the total decoders in place (idempotent). Refuses other library versions:
    the patch must be re-checked against them first."""
    found = installed_versions()
    if found != PINNED:
        raise RuntimeError(
            f"workers.io.amqp_frames is pinned to {PINNED}, found {found}: re-check the "
            "frame decoder patch (tests/unit/test_amqp_frames.py) before upgrading"
        )
    pamqp.frame._unmarshal_header_frame = unmarshal_header_frame
    pamqp.frame._unmarshal_method_frame = unmarshal_method_frame


def is_installed() -> bool:
    return (
        pamqp.frame._unmarshal_header_frame is unmarshal_header_frame
        and pamqp.frame._unmarshal_method_frame is unmarshal_method_frame
    )
