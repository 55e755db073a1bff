"""A TCP fault proxy for tests: 127.0.0.1 in front of a local service port (RabbitMQ's
5672, Postgres's 5432) that a test can cut, hang or heal for the processes pointed at
it, so that a dependency becomes unreachable for one worker only while the shared
broker and database keep running."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.parse
from typing import Any

import psycopg


class Proxy:
    """127.0.0.1:<port> forwarding to a local service port. ``cut()`` aborts every
    connection and refuses new ones (accept, then reset); ``heal()`` forwards again;
    ``hang()`` accepts and never answers. Only the processes pointed at it are affected."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.mode = "open"
        self.accepted = 0
        self.refused = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self._abort_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def amqp_url(self, url: str) -> str:
        parsed = urllib.parse.urlsplit(url)
        creds = parsed.netloc.rsplit("@", 1)[0] + "@" if "@" in parsed.netloc else ""
        return parsed._replace(netloc=f"{creds}127.0.0.1:{self.port}").geturl()

    def cut(self) -> None:
        self.mode = "refuse"
        self._abort_all()

    def hang(self) -> None:
        self.mode = "hang"

    def heal(self) -> None:
        self.mode = "open"

    def cut_when_a_channel_opens(self) -> None:
        """Forward, and cut (as :meth:`cut`) the moment a client sends its first frame on
        a channel other than 0 (Channel.Open): its connection is up, nothing on it yet."""
        self.mode = "cut_on_channel"

    def _abort_all(self) -> None:
        for w in list(self._links):
            w.transport.abort()
        self._links.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        try:
            if self.mode == "refuse":
                self.refused += 1
                writer.transport.abort()
                return
            if self.mode == "hang":
                self._links.add(writer)
                with contextlib.suppress(OSError):
                    await reader.read()
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    "127.0.0.1", self.upstream_port
                )
            except OSError:
                writer.transport.abort()
                return
            self._links |= {writer, up_writer}
            watch = _ChannelWatch() if self.mode == "cut_on_channel" else None
            await asyncio.gather(
                self._pump(reader, up_writer, watch), self._pump(up_reader, writer)
            )
        finally:
            self._links.discard(writer)
            writer.transport.abort()
            self._tasks.discard(task)

    async def _pump(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        watch: _ChannelWatch | None = None,
    ) -> None:
        try:
            while data := await src.read(65536):
                if watch is not None and watch.channel_frame(data):
                    self.cut()
                    return
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            self._links.discard(dst)
            dst.transport.abort()


class _ChannelWatch:
    """Reads a client's AMQP 0-9-1 byte stream (protocol header, then frames of type(1)
    channel(2) size(4) payload frame-end(1)) and says when a frame on a channel other
    than 0 begins."""

    def __init__(self) -> None:
        self.buf = b""
        self.header = False

    def channel_frame(self, data: bytes) -> bool:
        self.buf += data
        if not self.header:
            if len(self.buf) < 8:
                return False
            self.buf, self.header = self.buf[8:], True
        while len(self.buf) >= 7:
            if int.from_bytes(self.buf[1:3], "big") != 0:
                return True
            size = int.from_bytes(self.buf[3:7], "big")
            if len(self.buf) < size + 8:
                return False
            self.buf = self.buf[size + 8 :]
        return False


def amqp_port(url: str) -> int:
    return urllib.parse.urlsplit(url).port or 5672


def pg_proxied_url(url: str, port: int) -> str:
    params = psycopg.conninfo.conninfo_to_dict(url)
    params.update(host="127.0.0.1", port=str(port))
    return psycopg.conninfo.make_conninfo("", **params)


def pg_port(url: str) -> int:
    return int(psycopg.conninfo.conninfo_to_dict(url).get("port") or 5432)
