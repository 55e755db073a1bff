"""The pinned patch of the AMQP frame decoder (workers.io.amqp_frames): it agrees with
pamqp on everything pamqp can decode, never raises on what a publisher controls, and
fails loudly if an upgrade changes what it patches."""

from __future__ import annotations

import datetime
import decimal
import importlib.metadata
import inspect
import struct
import time
from pathlib import Path
from typing import Any

import aiormq.connection
import pamqp.frame
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands, exceptions, header

from tests.amqp_raw import F, content_header, properties, short, table
from workers.io import amqp_frames, broker

ROOT = Path(__file__).resolve().parents[2]
SHORT_STRINGS = [
    n
    for n in commands.Basic.Properties.__slots__
    if getattr(commands.Basic.Properties, "_" + n) == "shortstr"
]


def frame_payload(props: commands.Basic.Properties, body_size: int = 3) -> bytes:
    return header.ContentHeader(body_size=body_size, properties=props).marshal()


def raw_payload(**fields: Any) -> bytes:
    flags, props = properties(**fields)
    return content_header(3, flags, props)


def mark(content: header.ContentHeader) -> amqp_frames.Undecodable | None:
    value = (content.properties.headers or {}).get(amqp_frames.MARK)
    assert value is None or isinstance(value, amqp_frames.Undecodable)
    return value


# The pin ---------------------------------------------------------------------------


def test_the_patch_is_pinned_to_the_installed_versions() -> None:
    assert amqp_frames.installed_versions() == amqp_frames.PINNED
    project = (ROOT / "pyproject.toml").read_text()
    for name, version in amqp_frames.PINNED.items():
        assert f'"{name}=={version}"' in project, f"pyproject.toml must pin {name}=={version}"


def test_install_refuses_other_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "4.0.2" if name == "pamqp" else real(name),
    )
    with pytest.raises(RuntimeError, match="pinned"):
        amqp_frames.install()


def test_importing_the_broker_installs_the_patch() -> None:
    assert broker.UNDECODABLE == "undecodable_properties"
    assert amqp_frames.is_installed()


def test_upstream_still_decodes_strictly_and_calls_what_is_patched() -> None:
    """If pamqp or aiormq change the code paths the patch replaces (or stop raising on
    invalid UTF-8), this fails: re-check the patch before moving the pin."""
    upstream_header = amqp_frames.UPSTREAM_HEADER
    upstream_method = amqp_frames.UPSTREAM_METHOD
    assert upstream_header.__module__ == "pamqp.frame"
    assert upstream_method.__module__ == "pamqp.frame"
    for fn in (upstream_header, upstream_method):
        assert list(inspect.signature(fn).parameters) == ["frame_data"]
    names = pamqp.frame.unmarshal.__code__.co_names
    assert "_unmarshal_header_frame" in names and "_unmarshal_method_frame" in names
    # aiormq reads every frame through pamqp.frame.unmarshal, looked up at call time
    assert "unmarshal" in aiormq.connection.FrameReceiver.get_frame.__code__.co_names
    assert aiormq.connection.pamqp.frame is pamqp.frame
    with pytest.raises(exceptions.UnmarshalingException, match="utf-8"):
        upstream_header(raw_payload(message_id=b"\xff"))
    with pytest.raises((OverflowError, ValueError, exceptions.UnmarshalingException)):
        upstream_header(raw_payload(timestamp=2**64 - 1))
    # the property layout the total decoder relies on
    assert commands.Basic.Properties.__slots__ == [
        "content_type", "content_encoding", "headers", "delivery_mode", "priority",
        "correlation_id", "reply_to", "expiration", "message_id", "timestamp",
        "message_type", "user_id", "app_id", "cluster_id",
    ]  # fmt: skip
    flags = commands.Basic.Properties.flags
    assert [flags[n] for n in commands.Basic.Properties.__slots__] == [
        1 << b for b in range(15, 1, -1)
    ]


def test_only_the_broker_imports_the_patch() -> None:
    importers = sorted(
        str(p.relative_to(ROOT))
        for d in ("workers", "participants", "contracts")
        for p in (ROOT / d).rglob("*.py")
        if "amqp_frames" in p.read_text() and p.name != "amqp_frames.py"
    )
    # amqp_writes and amqp_marshal share the pin (the versions the patches were checked
    # against)
    assert importers == [
        "workers/io/amqp_marshal.py",
        "workers/io/amqp_writes.py",
        "workers/io/broker.py",
    ]


# Agreement with pamqp on what it can decode -----------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_short = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60).filter(
    lambda s: len(s.encode()) < 256
)
_key = _short.filter(lambda s: len(s.encode()) < 128)
_leaf = st.one_of(
    _text,
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.none(),
    st.decimals(min_value=-(2**31), max_value=2**31 - 1, places=2, allow_nan=False),
    st.datetimes(
        min_value=datetime.datetime(1970, 1, 2),
        max_value=datetime.datetime(2100, 1, 1),
        timezones=st.just(datetime.UTC),
    ).map(lambda d: d.replace(microsecond=0)),
    st.floats(allow_nan=False, allow_infinity=False),
)
_values = st.recursive(
    _leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_key, inner, max_size=4)),
    max_leaves=12,
)


@st.composite
def _properties(draw: st.DrawFn) -> commands.Basic.Properties:
    fields: dict[str, Any] = {}
    for name in SHORT_STRINGS:
        if name not in ("cluster_id", "expiration") and draw(st.booleans()):
            fields[name] = draw(_short)
    if draw(st.booleans()):
        fields["expiration"] = str(draw(st.integers(0, 10**9)))
    if draw(st.booleans()):
        fields["headers"] = draw(st.dictionaries(_key, _values, max_size=6))
    if draw(st.booleans()):
        fields["delivery_mode"] = draw(st.sampled_from([1, 2]))
    if draw(st.booleans()):
        fields["priority"] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        fields["timestamp"] = datetime.datetime.fromtimestamp(
            draw(st.integers(0, 2**32 - 1)), tz=datetime.UTC
        )
    return commands.Basic.Properties(**fields)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_properties())
def test_the_total_decoder_agrees_with_pamqp_on_valid_frames(
    props: commands.Basic.Properties,
) -> None:
    try:
        payload = frame_payload(props)
    except (ValueError, TypeError, OverflowError, struct.error, decimal.InvalidOperation):
        return  # pamqp cannot encode it: nothing to compare
    ours = amqp_frames.unmarshal_header_frame(payload)
    theirs = amqp_frames.UPSTREAM_HEADER(payload)
    assert mark(ours) is None
    assert ours.body_size == theirs.body_size == 3
    for name in commands.Basic.Properties.__slots__:
        assert getattr(ours.properties, name) == getattr(theirs.properties, name), name


# Totality ---------------------------------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(st.integers(0, 0xFFFE), st.binary(max_size=400))
def test_the_total_decoder_never_raises_on_publisher_bytes(flags: int, data: bytes) -> None:
    flags &= ~1  # one flag word: the frame's own structure is the broker's to check
    content = amqp_frames.unmarshal_header_frame(struct.pack(">HHQH", 60, 0, 7, flags) + data)
    assert content.body_size == 7
    props = content.properties
    assert props.delivery_mode in (None, 0, 1, 2)


@pytest.mark.parametrize("name", SHORT_STRINGS)
def test_invalid_utf8_in_any_short_string_is_kept_and_marked(name: str) -> None:
    raw = b"ok\xff\xfe\xc3("
    content = amqp_frames.unmarshal_header_frame(raw_payload(**{name: raw}))
    value = getattr(content.properties, name)
    found = mark(content)
    assert found is not None and name in found.describe()
    if name == "expiration":  # not a number either: dropped (RabbitMQ refuses it anyway)
        assert value is None
        return
    assert value.encode("utf-8", "surrogateescape") == raw  # lossless
    assert broker.printable(value) == "ok\\xff\\xfe\\xc3("


def test_invalid_utf8_in_a_header_name_is_kept_and_marked() -> None:
    headers = table([(b"good", F.longstr(b"v")), (b"bad\xff", F.i32(7))])
    content = amqp_frames.unmarshal_header_frame(raw_payload(headers=headers))
    found = mark(content)
    assert found is not None and "headers key" in found.describe()
    assert content.properties.headers["good"] == "v"
    assert content.properties.headers["bad\udcff"] == 7


@pytest.mark.parametrize(
    "value",
    [
        F.timestamp(2**64 - 1),
        F.timestamp(2**63),
        F.f64(float("nan")),
        b"Zjunk",  # a field type AMQP does not have
        b"S\xff\xff\xff\xff",  # a long string longer than the frame
    ],
)
def test_undecodable_header_values_mark_the_message(value: bytes) -> None:
    headers = table([(b"k", value), (b"after", F.u8(1))])
    content = amqp_frames.unmarshal_header_frame(raw_payload(headers=headers))
    if value.startswith(b"d"):  # NaN decodes: a float, not a problem (RabbitMQ refuses it)
        assert mark(content) is None
        return
    assert mark(content) is not None
    assert content.properties.headers.get("k") is None


def test_an_absurd_timestamp_property_is_none_and_marked() -> None:
    content = amqp_frames.unmarshal_header_frame(
        raw_payload(timestamp=2**64 - 1, message_id=b"id-1")
    )
    assert content.properties.timestamp is None
    assert content.properties.message_id == "id-1"  # what follows is still decoded
    assert mark(content) is not None


def test_every_field_type_decodes_without_a_mark() -> None:
    headers = table(
        [
            (b"S", F.longstr(b"text")),
            (b"Sbin", F.longstr(b"\xff\x00")),  # a long string is binary: bytes
            (b"t", F.boolean(True)),
            (b"b", F.i8(-1)),
            (b"B", F.u8(255)),
            (b"s", F.i16(-2)),
            (b"u", F.u16(65535)),
            (b"I", F.i32(-3)),
            (b"i", F.u32(2**32 - 1)),
            (b"l", F.i64(-(2**63))),
            (b"f", F.f32(1.5)),
            (b"d", F.f64(2.25)),
            (b"D", F.dec(2, 12345)),
            (b"Dneg", b"D" + struct.pack(">Bi", 2, -1)),
            (b"T", F.timestamp(1_700_000_000)),
            (b"x", F.binary(b"\x00\xff")),
            (b"V", F.void()),
            (b"F", F.table([(b"inner", F.array([F.u8(1), F.longstr(b"a")]))])),
        ]
    )
    content = amqp_frames.unmarshal_header_frame(raw_payload(headers=headers))
    assert mark(content) is None
    h = content.properties.headers
    assert h["S"] == "text" and h["Sbin"] == b"\xff\x00" and h["t"] is True
    assert (h["b"], h["B"], h["s"], h["u"], h["I"], h["i"]) == (-1, 255, -2, 65535, -3, 2**32 - 1)
    assert h["l"] == -(2**63) and h["f"] == 1.5 and h["d"] == 2.25
    assert h["D"] == decimal.Decimal("123.45") and h["Dneg"] == decimal.Decimal("-0.01")
    assert h["T"] == datetime.datetime.fromtimestamp(1_700_000_000, tz=datetime.UTC)
    assert h["x"] == bytearray(b"\x00\xff") and h["V"] is None
    assert h["F"] == {"inner": [1, "a"]}


def test_nesting_deeper_than_the_limit_is_marked_not_a_recursion_error() -> None:
    value = F.u8(1)
    for _ in range(5000):
        value = F.array([value])
    content = amqp_frames.unmarshal_header_frame(raw_payload(headers=table([(b"k", value)])))
    found = mark(content)
    assert found is not None and "nested deeper" in found.describe()


def test_an_oversized_header_table_decodes_in_linear_time() -> None:
    """60,000 entries in one 128 KiB frame: pamqp slices the rest of the table for
    every entry (quadratic); the total decoder walks offsets."""
    headers = table([(b"", F.void())] * 60_000)
    payload = raw_payload(headers=headers)
    started = time.perf_counter()
    content = amqp_frames.unmarshal_header_frame(payload)
    assert time.perf_counter() - started < 1.0
    assert content.properties.headers == {"": None}


def test_values_aio_pika_would_raise_on_are_dropped_and_marked() -> None:
    content = amqp_frames.unmarshal_header_frame(raw_payload(delivery_mode=3, expiration=b"x"))
    assert content.properties.delivery_mode is None
    assert content.properties.expiration is None
    assert mark(content) is not None


def test_a_broken_frame_structure_still_raises_as_upstream_does() -> None:
    with pytest.raises(exceptions.UnmarshalingException):
        amqp_frames.unmarshal_header_frame(b"\x00\x3c\x00")


# Method frames ----------------------------------------------------------------------


def _deliver(routing_key: bytes) -> bytes:
    return (
        struct.pack(">I", commands.Basic.Deliver.index)
        + short(b"ctag")
        + struct.pack(">QB", 42, 1)
        + short(b"custody.receipts")
        + short(routing_key)
    )


def test_a_delivery_with_an_undecodable_routing_key_is_decoded_with_surrogates() -> None:
    method = amqp_frames.unmarshal_method_frame(_deliver(b"receipts\xff"))
    assert isinstance(method, commands.Basic.Deliver)
    assert (method.consumer_tag, method.delivery_tag, method.redelivered) == ("ctag", 42, True)
    assert method.exchange == "custody.receipts"
    assert method.routing_key.encode("utf-8", "surrogateescape") == b"receipts\xff"
    valid = amqp_frames.unmarshal_method_frame(_deliver(b"receipts"))
    assert valid.routing_key == "receipts"


def test_other_method_frame_errors_still_raise() -> None:
    bad_close = struct.pack(">IH", commands.Channel.Close.index, 200) + short(b"\xff")
    with pytest.raises(exceptions.UnmarshalingException):
        amqp_frames.unmarshal_method_frame(bad_close + struct.pack(">HH", 0, 0))
