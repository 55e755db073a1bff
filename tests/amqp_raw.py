"""A minimal AMQP 0-9-1 publisher for tests that must send what no client library
would: content header frames built byte by byte (invalid UTF-8 in short strings and
header names, field types and values chosen freely, absurd timestamps).

Method frames are marshalled by pamqp (they are ours and valid); the content header
payload is the caller's bytes, framed as they are. Publishes are confirmed; a publish
RabbitMQ refuses closes the channel, which is reported as ``"refused"`` and reopened.
"""

from __future__ import annotations

import asyncio
import struct
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pamqp.frame
from pamqp import commands, heartbeat
from pamqp import header as pheader

FRAME_METHOD, FRAME_HEADER, FRAME_BODY = 1, 2, 3
_PROPS = commands.Basic.Properties


# Building blocks of a content header ----------------------------------------------


def short(raw: bytes) -> bytes:
    assert len(raw) < 256
    return bytes([len(raw)]) + raw


def long(raw: bytes) -> bytes:
    return struct.pack(">I", len(raw)) + raw


def table(entries: Sequence[tuple[bytes, bytes]]) -> bytes:
    """A field table from (raw key, encoded value) pairs."""
    return long(b"".join(short(k) + v for k, v in entries))


def array(values: Sequence[bytes]) -> bytes:
    return long(b"".join(values))


class F:
    """Encoded field values, one per type RabbitMQ 3.10 parses."""

    @staticmethod
    def longstr(raw: bytes) -> bytes:
        return b"S" + long(raw)

    @staticmethod
    def boolean(v: bool) -> bytes:
        return b"t" + bytes([int(v)])

    @staticmethod
    def i8(v: int) -> bytes:
        return b"b" + struct.pack(">b", v)

    @staticmethod
    def u8(v: int) -> bytes:
        return b"B" + struct.pack(">B", v)

    @staticmethod
    def i16(v: int) -> bytes:
        return b"s" + struct.pack(">h", v)

    @staticmethod
    def u16(v: int) -> bytes:
        return b"u" + struct.pack(">H", v)

    @staticmethod
    def i32(v: int) -> bytes:
        return b"I" + struct.pack(">i", v)

    @staticmethod
    def u32(v: int) -> bytes:
        return b"i" + struct.pack(">I", v)

    @staticmethod
    def i64(v: int) -> bytes:
        return b"l" + struct.pack(">q", v)

    @staticmethod
    def f32(v: float) -> bytes:
        return b"f" + struct.pack(">f", v)

    @staticmethod
    def f64(v: float) -> bytes:
        return b"d" + struct.pack(">d", v)

    @staticmethod
    def dec(places: int, raw: int) -> bytes:
        return b"D" + struct.pack(">BI", places, raw)

    @staticmethod
    def timestamp(v: int) -> bytes:
        return b"T" + struct.pack(">Q", v)

    @staticmethod
    def binary(raw: bytes) -> bytes:
        return b"x" + long(raw)

    @staticmethod
    def void() -> bytes:
        return b"V"

    @staticmethod
    def table(entries: Sequence[tuple[bytes, bytes]]) -> bytes:
        return b"F" + table(entries)

    @staticmethod
    def array(values: Sequence[bytes]) -> bytes:
        return b"A" + array(values)


def properties(**fields: Any) -> tuple[int, bytes]:
    """(flags, property bytes) from raw values: short strings as bytes, ``headers`` as
    an encoded table (bytes), octets and the timestamp as ints."""
    flags, out = 0, b""
    for name in _PROPS.__slots__:
        if name not in fields:
            continue
        value = fields.pop(name)
        flags |= _PROPS.flags[name]
        kind = getattr(_PROPS, "_" + name)
        if kind == "shortstr":
            out += short(value)
        elif kind == "octet":
            out += struct.pack(">B", value)
        elif kind == "timestamp":
            out += struct.pack(">Q", value)
        else:
            out += value
    assert not fields, fields
    return flags, out


def content_header(body_size: int, flags: int, props: bytes) -> bytes:
    return struct.pack(">HHQH", 60, 0, body_size, flags) + props


@dataclass
class Hostile:
    """One message: where it goes, its properties (raw), its body."""

    exchange: str
    routing_key: bytes
    body: bytes
    flags: int
    props: bytes
    kind: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


# The client ------------------------------------------------------------------------


def _frame(kind: int, channel: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", kind, channel, len(payload)) + payload + b"\xce"


class RawPublisher:
    """One connection, one confirm channel at a time."""

    def __init__(self, amqp_url: str) -> None:
        self.url = urllib.parse.urlparse(amqp_url)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.channel = 0
        self.frame_max = 131072
        self.seq = 0
        self.returns = 0

    async def __aenter__(self) -> RawPublisher:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _read(self) -> tuple[int, Any]:
        assert self.reader is not None
        head = await self.reader.readexactly(7)
        size = struct.unpack(">I", head[3:7])[0]
        rest = await self.reader.readexactly(size + 1)
        _, channel, frame = pamqp.frame.unmarshal(head + rest)
        return channel, frame

    async def _expect(self, cls: type) -> Any:
        while True:
            _, frame = await self._read()
            if isinstance(frame, heartbeat.Heartbeat):
                continue
            if not isinstance(frame, cls):
                raise AssertionError(f"expected {cls.__name__}, got {frame!r}")
            return frame

    def _send(self, channel: int, frame: Any) -> None:
        assert self.writer is not None
        self.writer.write(pamqp.frame.marshal(frame, channel))

    async def open(self) -> None:
        host = self.url.hostname or "127.0.0.1"
        self.reader, self.writer = await asyncio.open_connection(host, self.url.port or 5672)
        self.writer.write(pheader.ProtocolHeader().marshal())
        await self._expect(commands.Connection.Start)
        user = urllib.parse.unquote(self.url.username or "guest")
        password = urllib.parse.unquote(self.url.password or "guest")
        self._send(
            0,
            commands.Connection.StartOk(
                client_properties={"connection_name": "hostile-raw"},
                mechanism="PLAIN",
                response=f"\0{user}\0{password}",
            ),
        )
        tune = await self._expect(commands.Connection.Tune)
        self.frame_max = tune.frame_max or 131072
        self._send(0, commands.Connection.TuneOk(tune.channel_max, self.frame_max, 0))
        vhost = urllib.parse.unquote(self.url.path[1:]) if len(self.url.path) > 1 else "/"
        self._send(0, commands.Connection.Open(virtual_host=vhost))
        await self._expect(commands.Connection.OpenOk)
        await self._open_channel()

    async def _open_channel(self) -> None:
        self.channel += 1
        self._send(self.channel, commands.Channel.Open())
        await self._expect(commands.Channel.OpenOk)
        self._send(self.channel, commands.Confirm.Select())
        await self._expect(commands.Confirm.SelectOk)
        self.seq = 0

    def _write_message(self, m: Hostile) -> None:
        assert self.writer is not None
        publish = commands.Basic.Publish(exchange=m.exchange, routing_key="x", mandatory=True)
        method = pamqp.frame.marshal(publish, self.channel)
        # the routing key as raw bytes (it may be invalid UTF-8): re-frame by hand
        payload = method[7:-1]
        prefix = struct.pack(">IH", publish.index, 0) + short(m.exchange.encode())
        assert payload.startswith(prefix + short(b"x"))
        payload = prefix + short(m.routing_key) + payload[len(prefix) + 2 :]
        out = [_frame(FRAME_METHOD, self.channel, payload)]
        out.append(
            _frame(FRAME_HEADER, self.channel, content_header(len(m.body), m.flags, m.props))
        )
        step = self.frame_max - 8
        for i in range(0, len(m.body), step):
            out.append(_frame(FRAME_BODY, self.channel, m.body[i : i + step]))
        self.writer.write(b"".join(out))

    async def publish(
        self, messages: Sequence[Hostile], window: int = 256, refusal_timeout: float | None = None
    ) -> list[str]:
        """Outcome per message: "ack", "nack" or "refused" (the broker closed the channel
        on it, so the channel is reopened). Messages that may be refused must be sent
        with ``window=1``: confirms of a quorum queue can arrive after the close, so a
        refusal inside a window would leave the others' fate unknown. Unroutable
        (returned) messages are counted in ``returns``."""
        outcomes: list[str] = []
        for i in range(0, len(messages), window):
            chunk = messages[i : i + window]
            try:
                outcomes.extend(
                    await asyncio.wait_for(self._publish_window(chunk), refusal_timeout)
                )
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                # some values (an unknown field type) crash the broker's channel process,
                # which closes the whole connection
                if len(chunk) > 1:
                    raise AssertionError(f"connection lost inside a window: {exc!r}") from exc
                chunk[0].meta["refusal"] = f"connection closed: {exc!r}"
                outcomes.append("refused")
                if self.writer is not None:
                    self.writer.close()
                self.writer = None
                self.channel = 0
                await self.open()
        return outcomes

    async def _publish_window(self, chunk: Sequence[Hostile]) -> list[str]:
        assert self.writer is not None
        base = self.seq
        for m in chunk:
            self._write_message(m)
        await self.writer.drain()
        self.seq += len(chunk)
        result: dict[int, str] = {}
        while len(result) < len(chunk):
            channel, frame = await self._read()
            if channel != self.channel:
                continue
            if isinstance(frame, commands.Basic.Return):
                self.returns += 1
                continue
            if isinstance(frame, commands.Basic.Ack | commands.Basic.Nack):
                tag = frame.delivery_tag - base
                verdict = "ack" if isinstance(frame, commands.Basic.Ack) else "nack"
                for t in range(1, tag + 1) if frame.multiple else [tag]:
                    result.setdefault(t, verdict)
                continue
            if isinstance(frame, commands.Channel.Close):
                self._send(self.channel, commands.Channel.CloseOk())
                if len(chunk) > 1:
                    raise AssertionError(f"refused inside a window of {len(chunk)}: {frame!r}")
                chunk[0].meta["refusal"] = f"{frame.reply_code} {frame.reply_text}"
                await self._open_channel()
                return ["refused"]
        return [result[t] for t in range(1, len(chunk) + 1)]

    async def close(self) -> None:
        if self.writer is None:
            return
        try:
            self._send(
                0,
                commands.Connection.Close(
                    reply_code=200, reply_text="bye", class_id=0, method_id=0
                ),
            )
            await self.writer.drain()
            await asyncio.wait_for(self._expect(commands.Connection.CloseOk), 5)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, AssertionError, TypeError):
            pass
        self.writer.close()
        self.writer = None
