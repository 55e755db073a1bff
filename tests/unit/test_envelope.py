"""The envelope's framing (``workers.core.envelope``): pure.

A malformed message is isolated with its reason and never acted on: an envelope is
either split into exactly the items its sender packed, or refused whole with a reason
(``malformed_envelope``), whatever its bytes."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import orjson
import pytest

from workers import settings
from workers.core import envelope
from workers.core.reasons import REASONS


def _items(n: int) -> list[envelope.Item]:
    return [
        envelope.Item(
            f"id-{i}", {"traceparent": f"tp-{i}", "n": i, "ok": True}, f'{{"i":{i}}}'.encode()
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("n", [1, 2, 64, envelope.MAX_ITEMS])
def test_unpack_returns_exactly_the_items_packed_in_order(n: int) -> None:
    items = _items(n)
    assert envelope.unpack(envelope.pack(items)) == items


def test_an_item_s_body_is_carried_byte_for_byte() -> None:
    """The body is the item's own bytes, not re-encoded: its digest and its size check
    see what the sender committed."""
    odd = envelope.Item("x", {}, b'{"a":  1,\n "b": "\\u00e9"}')
    [back] = envelope.unpack(envelope.pack([odd, *_items(1)]))[:1]
    assert back.body == odd.body


def test_pack_refuses_no_items_and_more_than_the_limit() -> None:
    with pytest.raises(ValueError, match="1 to"):
        envelope.pack([])
    with pytest.raises(ValueError, match="1 to"):
        envelope.pack(_items(envelope.MAX_ITEMS + 1))


def test_packable_headers_are_scalars_under_string_names() -> None:
    assert envelope.packable({"a": "b", "n": 1, "f": 1.5, "t": False, "z": None})
    assert not envelope.packable({"a": b"bytes"})
    assert not envelope.packable({"a": {"nested": 1}})
    assert not envelope.packable({"a": [1]})
    assert not envelope.packable({"x-death": "none"}), "the broker's and custody's own"
    assert not envelope.packable({"X-Custody-Exchange": "custody.commands"})


def _frame(meta: bytes, body: bytes) -> bytes:
    return struct.pack(">II", len(meta), len(body)) + meta + body


GOOD_META = orjson.dumps({"message_id": "m", "headers": {}})


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"", "no items"),
        (b"\x00\x00\x00", "truncated"),
        (_frame(GOOD_META, b"{}") + b"\x00", "truncated"),
        (struct.pack(">II", 5, 100) + b"{}", "overrun"),
        (struct.pack(">II", envelope.MAX_META_BYTES + 1, 0), "overrun"),
        (_frame(b"not json", b"{}"), "not JSON"),
        (_frame(b"[]", b"{}"), "meta must be"),
        (_frame(orjson.dumps({"message_id": "m"}), b"{}"), "meta must be"),
        (_frame(orjson.dumps({"message_id": "m", "headers": {}, "x": 1}), b"{}"), "meta must be"),
        (_frame(orjson.dumps({"message_id": 1, "headers": {}}), b"{}"), "must be a string"),
        (_frame(orjson.dumps({"message_id": "m", "headers": []}), b"{}"), "must be a string"),
        (_frame(orjson.dumps({"message_id": "m", "headers": {"h": [1]}}), b"{}"), "header value"),
        (_frame(GOOD_META, b"{}") * (envelope.MAX_ITEMS + 1), "more than"),
        (_frame(orjson.dumps({"message_id": "m", "headers": {"x-death": "none"}}), b"{}"), "x-"),
        (
            _frame(orjson.dumps({"message_id": "m", "headers": {"X-Custody-Reason": 1}}), b"{}"),
            "x-",
        ),
        (_frame(GOOD_META, b"0" * envelope.MAX_BYTES), "more than"),
    ],
)
def test_a_malformed_envelope_is_refused_whole_with_its_reason(raw: bytes, why: str) -> None:
    with pytest.raises(envelope.Malformed, match=why):
        envelope.unpack(raw)


def test_an_empty_body_item_is_an_item() -> None:
    """An item whose body is empty is carried as such: its decoder, not the envelope,
    refuses it (malformed JSON), with its own message id."""
    [item] = envelope.unpack(_frame(GOOD_META, b""))
    assert (item.message_id, item.body) == ("m", b"")


def test_the_setting_s_limit_is_what_a_consumer_accepts() -> None:
    assert settings.ENVELOPE_LIMIT == envelope.MAX_ITEMS
    with pytest.raises(Exception, match="ENVELOPE_MAX"):
        settings.Settings(envelope_max=0).check()
    with pytest.raises(Exception, match="ENVELOPE_MAX"):
        settings.Settings(envelope_max=envelope.MAX_ITEMS + 1).check()
    settings.Settings(envelope_max=1).check()


def test_malformed_envelope_is_a_quarantine_reason() -> None:
    assert "malformed_envelope" in REASONS


def _group(items: Sequence[tuple[str | None, int]], max_items: int = 3) -> list[list[int]]:
    """``envelope.group`` over (route, size) pairs, returning their positions."""
    indexed = list(enumerate(items))
    groups = envelope.group(indexed, lambda t: t[1][0], lambda t: t[1][1], max_items)
    return [[i for i, _ in g] for g in groups]


def test_group_keeps_a_route_s_order_and_never_mixes_routes() -> None:
    """One tenant's messages per envelope: items of two routes interleaved make two
    groups, each in its items' order, split at ``max_items``."""
    items = [("a", 1), ("b", 1), ("a", 1), ("b", 1), ("a", 1), ("a", 1)]
    assert _group(items) == [[0, 2, 4], [5], [1, 3]]


def test_group_leaves_alone_what_has_no_route_or_is_large() -> None:
    half = envelope.MAX_PACKED_BYTES // 2
    items = [("a", 1), (None, 1), ("a", half + 1), ("a", 1)]
    assert _group(items) == [[1], [2], [0, 3]]


def test_group_closes_an_envelope_before_its_bodies_pass_the_limit() -> None:
    half = envelope.MAX_PACKED_BYTES // 2
    items = [("a", half), ("a", half), ("a", 1), ("a", 1)]
    assert _group(items, max_items=10) == [[0, 1], [2, 3]]
    assert sum(items[i][1] for i in [0, 1]) == envelope.MAX_PACKED_BYTES
