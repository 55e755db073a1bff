"""Several messages in one AMQP message: the envelope's framing. Pure.

A sender that has several messages for the same exchange and routing key at once (the
submits one commit made for a participant's queue, the receipts one participant
commit made) publishes them as one AMQP message whose ``content_type`` is
:data:`CONTENT_TYPE`. The broker stores, replicates, confirms and delivers one message
instead of dozens, and each worker pays its per-message cost (frames, a confirm, a
delivery, an ack) once per envelope (docs/performance.md, *The envelope*).

Every item is still a message of its own to everything above ``workers.io.broker``:
the consumer splits an envelope into one ``Delivery`` per item (its own body,
``message_id`` and headers, the envelope's ``user_id`` and routing), which is decoded,
validated, quarantined, refused or dead-lettered alone. The envelope is acked once
every item of it is settled, after their commits (``broker.Delivery``).

The body is the items one after another, each::

    meta length   4 bytes, unsigned, big-endian
    body length   4 bytes, unsigned, big-endian
    meta          a JSON object: {"message_id": "...", "headers": {name: value}}
    body          the item's message, exactly the bytes it would carry alone

A header value is a string, an integer, a float, a boolean or null, and no header name
begins with ``x-``: those are the broker's and custody's own (``x-death``,
``x-delivery-count``, ``x-custody-reason``, ...), which only the envelope itself
carries, so an item cannot pose as a dead letter bound elsewhere. An envelope holds 1
to :data:`MAX_ITEMS` items in at most :data:`MAX_BYTES` and nothing after the last; a
body that breaks any of this is malformed, and a consumer isolates the whole message
(reason ``malformed_envelope``, its raw body kept), never a part of it. Each item's
own size is checked by its decoder against ``max_message_bytes``, like a message sent
alone.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import orjson

CONTENT_TYPE: Final = "application/vnd.custody.envelope"
MAX_ITEMS: Final = 256  # what a consumer accepts; senders use CUSTODY_ENVELOPE_MAX
MAX_META_BYTES: Final = 64 * 1024
# a sender closes an envelope before its bodies pass this (a larger item goes alone)
MAX_PACKED_BYTES: Final = 512 * 1024
# what a consumer splits: a larger envelope is isolated whole, so that what one AMQP
# message makes a consumer hold stays bounded (the items' bodies are copies)
MAX_BYTES: Final = 1024 * 1024
RESERVED_PREFIX: Final = "x-"
_LENGTHS: Final = struct.Struct(">II")
_SCALARS: Final = (str, int, float, bool, type(None))

HeaderValue = str | int | float | bool | None
T = TypeVar("T")


@dataclass(frozen=True)
class Item:
    message_id: str
    headers: Mapping[str, HeaderValue]
    body: bytes


class Malformed(ValueError):
    """An envelope that breaks its framing: the message is isolated whole."""


def packable(headers: Mapping[str, object]) -> bool:
    """Whether an item with these headers can travel in an envelope (else it is sent
    alone, with its headers as AMQP carries them)."""
    return all(
        isinstance(k, str) and not _reserved(k) and isinstance(v, _SCALARS)
        for k, v in headers.items()
    )


def _reserved(name: str) -> bool:
    return name[:2].lower() == RESERVED_PREFIX


def group(
    items: Sequence[T],
    route: Callable[[T], Hashable | None],
    size: Callable[[T], int],
    max_items: int,
) -> list[list[T]]:
    """The envelopes ``items`` travel in, in their order: those of one ``route`` (a
    sender's exchange, routing key and tenant) in groups of up to ``max_items`` whose
    sizes add up to at most :data:`MAX_PACKED_BYTES`; an item whose route is None, or
    larger than half of that, alone. A group of one is sent as a plain message."""
    alone: list[list[T]] = []
    routes: dict[Hashable, list[list[T]]] = {}
    filled: dict[Hashable, int] = {}  # the bytes of each route's last group
    for item in items:
        key, n = route(item), size(item)
        if key is None or n > MAX_PACKED_BYTES // 2:
            alone.append([item])
            continue
        groups = routes.setdefault(key, [[]])
        if len(groups[-1]) == max_items or filled.get(key, 0) + n > MAX_PACKED_BYTES:
            groups.append([])
            filled[key] = 0
        groups[-1].append(item)
        filled[key] = filled.get(key, 0) + n
    return alone + [g for groups in routes.values() for g in groups]


def pack(items: Sequence[Item]) -> bytes:
    """The envelope's body for ``items`` (their headers :func:`packable`)."""
    if not 1 <= len(items) <= MAX_ITEMS:
        raise ValueError(f"an envelope holds 1 to {MAX_ITEMS} items, not {len(items)}")
    parts: list[bytes] = []
    for item in items:
        meta = orjson.dumps({"message_id": item.message_id, "headers": dict(item.headers)})
        if len(meta) > MAX_META_BYTES:
            raise ValueError(f"an item's message id and headers exceed {MAX_META_BYTES} bytes")
        parts += (_LENGTHS.pack(len(meta), len(item.body)), meta, item.body)
    return b"".join(parts)


def unpack(body: bytes) -> list[Item]:
    """The items of an envelope's body, in order; :class:`Malformed` says why not."""
    items: list[Item] = []
    view = memoryview(body)
    at, end = 0, len(body)
    if end > MAX_BYTES:
        raise Malformed(f"{end} bytes, more than {MAX_BYTES}")
    while at < end:
        if len(items) == MAX_ITEMS:
            raise Malformed(f"more than {MAX_ITEMS} items")
        if end - at < _LENGTHS.size:
            raise Malformed(f"item {len(items) + 1}: truncated lengths at byte {at}")
        meta_len, body_len = _LENGTHS.unpack_from(body, at)
        at += _LENGTHS.size
        if meta_len > MAX_META_BYTES or at + meta_len + body_len > end:
            raise Malformed(f"item {len(items) + 1}: lengths {meta_len}, {body_len} overrun")
        meta, at = view[at : at + meta_len], at + meta_len
        items.append(_item(len(items) + 1, meta, body[at : at + body_len]))
        at += body_len
    if not items:
        raise Malformed("no items")
    return items


def _item(n: int, meta_bytes: memoryview, body: bytes) -> Item:
    try:
        meta = orjson.loads(meta_bytes)
    except orjson.JSONDecodeError as exc:
        raise Malformed(f"item {n}: meta is not JSON: {exc}") from None
    if not isinstance(meta, dict) or set(meta) != {"message_id", "headers"}:
        raise Malformed(f"item {n}: meta must be {{message_id, headers}}")
    message_id, headers = meta["message_id"], meta["headers"]
    if not isinstance(message_id, str) or not isinstance(headers, dict):
        raise Malformed(f"item {n}: message_id must be a string, headers an object")
    if not all(isinstance(v, _SCALARS) for v in headers.values()):
        raise Malformed(f"item {n}: a header value is not a string, number, boolean or null")
    if any(_reserved(k) for k in headers):
        raise Malformed(
            f"item {n}: a header name begins with {RESERVED_PREFIX!r} (the envelope's own)"
        )
    return Item(message_id, headers, body)
