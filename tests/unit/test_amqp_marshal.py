"""The pinned encoder of a publish's frames (workers.io.amqp_marshal): byte for byte
what pamqp writes, for the frames it encodes itself and for those it hands back to
pamqp. No broker needed: both encoders run on the same generated frames."""

from __future__ import annotations

import datetime
from typing import Any

import pamqp.frame
import pytest
from aiormq.abc import ChannelFrame
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import body, commands, header

from workers.io import amqp_frames, amqp_marshal, broker

FAST = settings(deadline=None, database=None, max_examples=300)

_TEXT = st.text(max_size=12) | st.sampled_from(["", "é" * 130, "x" * 300, "\ud800"])
_SHORT = st.none() | _TEXT | st.integers(0, 3)  # a wrong type falls back (or fails alike)
_OCTET = st.none() | st.sampled_from(["", 0, 1, 2, 255, 256, -1, True, "2"])
_HEADERS = (
    st.none()
    | st.just("")
    | st.dictionaries(_TEXT | st.just("k" * 200), _TEXT | st.integers(0, 9), max_size=3)
)


@st.composite
def properties(draw: st.DrawFn) -> commands.Basic.Properties:
    p = commands.Basic.Properties()
    # set after construction, which checks some of them: a value it would refuse there
    # may still reach the encoder, and both encoders must then agree (or both fail)
    for name, values in [
        ("content_type", _SHORT),
        ("headers", _HEADERS),
        ("delivery_mode", _OCTET),
        ("priority", _OCTET),
        ("message_id", _SHORT),
        ("user_id", _SHORT),
    ]:
        setattr(p, name, draw(values))
    # now and then a property the fast path leaves to pamqp
    extra = draw(st.sampled_from([None, "app_id", "correlation_id", "timestamp", "expiration"]))
    if extra == "timestamp":
        p.timestamp = datetime.datetime(2026, 12, 6, tzinfo=datetime.UTC)
    elif extra is not None:
        setattr(p, extra, draw(st.sampled_from(["", "a", None])))
    return p


def both(frame: Any, channel: int) -> tuple[Any, Any]:
    """Each encoder's bytes, or the type of the error it raised."""
    out: list[Any] = []
    for encode in (amqp_marshal.UPSTREAM, amqp_marshal.marshal):
        try:
            out.append(encode(frame, channel))
        except Exception as exc:
            out.append(type(exc))
    return out[0], out[1]


def test_importing_the_broker_installs_the_encoder() -> None:
    assert broker.EXCHANGE_COMMANDS
    assert amqp_marshal.is_installed()
    assert pamqp.frame.marshal is amqp_marshal.marshal
    assert amqp_marshal.UPSTREAM is not amqp_marshal.marshal


def test_install_refuses_other_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(amqp_frames, "installed_versions", lambda: {"pamqp": "4.0.2"})
    with pytest.raises(RuntimeError, match="pinned"):
        amqp_marshal.install()


def test_aiormq_still_encodes_through_the_patched_name() -> None:
    """If aiormq stops looking pamqp.frame.marshal up at run time, this fails: re-check
    the patch before moving the pin."""
    names = ChannelFrame.marshall.__func__.__code__.co_names  # type: ignore[attr-defined]
    assert {"pamqp", "frame", "marshal"} <= set(names)


@FAST
@given(properties(), st.integers(0, 2**40), st.integers(1, 2047))
def test_a_content_header_is_encoded_as_pamqp_does(
    props: commands.Basic.Properties, size: int, channel: int
) -> None:
    upstream, ours = both(header.ContentHeader(properties=props, body_size=size), channel)
    assert ours == upstream


_PLAIN_TEXT = st.text(max_size=20) | st.sampled_from(["é" * 70, "k" * 129])


@FAST
@given(
    st.none() | _PLAIN_TEXT,
    st.none() | st.dictionaries(_PLAIN_TEXT, _PLAIN_TEXT, max_size=5),
    st.none() | st.integers(0, 255),
    st.none() | st.integers(0, 255),
    st.none() | _PLAIN_TEXT,
    st.none() | _PLAIN_TEXT,
)
def test_plain_properties_are_encoded_as_pamqp_does(
    content_type: str | None,
    headers: dict[str, Any] | None,
    delivery_mode: int | None,
    priority: int | None,
    message_id: str | None,
    user_id: str | None,
) -> None:
    """The shapes the fast path takes (string headers, several keys in any order, long
    keys, non-ASCII text), compared on their own."""
    p = commands.Basic.Properties()
    p.content_type, p.delivery_mode = content_type, delivery_mode
    p.priority, p.message_id, p.user_id = priority, message_id, user_id
    setattr(p, "headers", headers)  # noqa: B010 (pamqp types them as FieldTable)
    upstream, ours = both(header.ContentHeader(properties=p, body_size=5), 1)
    assert ours == upstream


def test_custodys_own_properties_take_the_fast_path() -> None:
    """The properties every custody publish carries are encoded here, not by pamqp (a
    fast path that never fires would pass the test above and save nothing)."""
    props = commands.Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        headers={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
        message_id="6f6b9d8e-2a55-4c1e-9a51-637573746f64",
        priority=0,
        user_id="custody-receipts",
    )
    assert amqp_marshal.encode_properties(props) == props.marshal()
    assert amqp_marshal.encode_properties(commands.Basic.Properties(app_id="x")) is None


@FAST
@given(
    st.text(max_size=8) | st.sampled_from(["custody.commands", "x" * 300]),
    st.text(max_size=8) | st.sampled_from(["inventory.v1", "é" * 200]),
    st.booleans(),
    st.booleans(),
    st.integers(1, 3),
)
def test_a_publish_method_is_encoded_as_pamqp_does(
    exchange: str, routing_key: str, mandatory: bool, immediate: bool, channel: int
) -> None:
    for _ in range(2):  # the second time, from what was kept
        try:
            frame = commands.Basic.Publish(
                exchange=exchange, routing_key=routing_key, mandatory=mandatory, immediate=immediate
            )
        except ValueError:
            return  # pamqp refuses it as it is built: never reaches an encoder
        upstream, ours = both(frame, channel)
        assert ours == upstream


@pytest.mark.parametrize(
    ("field", "value"),
    [("ticket", 5), ("mandatory", 1.0), ("immediate", 1), ("mandatory", "yes")],
)
def test_a_publish_pamqp_would_refuse_is_never_answered_from_what_was_kept(
    field: str, value: Any
) -> None:
    """Once a (channel, exchange, routing key, flags) was encoded, a frame with the same
    key but a field pamqp refuses (set after construction) still goes to pamqp."""
    kept = commands.Basic.Publish(exchange="kept", routing_key="k", mandatory=True)
    amqp_marshal.marshal(kept, 1)  # kept now
    odd = commands.Basic.Publish(exchange="kept", routing_key="k", mandatory=True)
    setattr(odd, field, value)
    upstream, ours = both(odd, 1)
    assert ours == upstream
    assert not isinstance(upstream, bytes) or field == "immediate", upstream


@FAST
@given(st.binary(max_size=300), st.integers(1, 9))
def test_a_body_frame_is_encoded_as_pamqp_does(value: bytes, channel: int) -> None:
    assert amqp_marshal.marshal(body.ContentBody(value), channel) == amqp_marshal.UPSTREAM(
        body.ContentBody(value), channel
    )


@pytest.mark.parametrize(
    "frame",
    [
        commands.Basic.Ack(delivery_tag=7, multiple=True),
        commands.Basic.Nack(delivery_tag=3, requeue=False),
        commands.Channel.Open(),
    ],
    ids=["ack", "nack", "open"],
)
def test_every_other_frame_is_pamqps(frame: Any) -> None:
    assert amqp_marshal.marshal(frame, 1) == amqp_marshal.UPSTREAM(frame, 1)
