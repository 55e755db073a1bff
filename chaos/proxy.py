"""A small asyncio TCP fault proxy between the workers and RabbitMQ or Postgres.

Faults: ``cut`` (abort every open connection, optionally refusing new ones for a
while), ``stall`` (stop forwarding in both directions: bytes wait, nothing is
lost, heartbeats and keepalives miss), ``slow`` (delay every chunk). With several
upstreams (a RabbitMQ cluster) a new connection goes to the first upstream that
accepts it, starting at a rotating index: the fleet reconnects to a live node.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

CHUNK = 65536


@dataclass(eq=False)
class _Link:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def abort(self) -> None:
        for w in (self.client, self.upstream):
            with contextlib.suppress(Exception):
                w.transport.abort()


class FaultProxy:
    def __init__(self, name: str, listen_port: int, upstreams: list[tuple[str, int]]) -> None:
        self.name = name
        self.listen_port = listen_port
        self.upstreams = upstreams
        self.links: set[_Link] = set()
        self._server: asyncio.Server | None = None
        self._stall_until = 0.0
        self._slow_until = 0.0
        self._slow_delay = 0.0
        self._refuse_until = 0.0
        self._resume = asyncio.Event()
        self._resume.set()
        self._next = 0
        self.accepted = 0
        self.faults = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.listen_port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.abort()
        self._resume.set()

    # faults -------------------------------------------------------------------------

    def cut(self, refuse_s: float = 0.0) -> int:
        """Abort every open connection; refuse new ones for ``refuse_s``."""
        self.faults += 1
        self._refuse_until = time.monotonic() + refuse_s
        links = list(self.links)
        for link in links:
            link.abort()
        return len(links)

    async def stall(self, seconds: float) -> None:
        """Hold every byte for ``seconds`` (connections stay open)."""
        self.faults += 1
        self._stall_until = time.monotonic() + seconds
        self._resume.clear()
        await asyncio.sleep(seconds)
        if time.monotonic() >= self._stall_until:
            self._resume.set()

    def slow(self, seconds: float, delay_s: float) -> None:
        self.faults += 1
        self._slow_until = time.monotonic() + seconds
        self._slow_delay = delay_s

    def heal(self) -> None:
        self._stall_until = self._slow_until = self._refuse_until = 0.0
        self._resume.set()

    # forwarding ---------------------------------------------------------------------

    async def _connect_upstream(
        self,
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        n = len(self.upstreams)
        start = self._next
        self._next = (self._next + 1) % n
        for i in range(n):
            host, port = self.upstreams[(start + i) % n]
            try:
                return await asyncio.wait_for(asyncio.open_connection(host, port), 3)
            except (OSError, TimeoutError):
                continue
        return None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if time.monotonic() < self._refuse_until:
            writer.transport.abort()
            return
        up = await self._connect_upstream()
        if up is None:
            writer.transport.abort()
            return
        self.accepted += 1
        up_reader, up_writer = up
        link = _Link(writer, up_writer)
        self.links.add(link)
        link.tasks = [
            asyncio.create_task(self._pipe(reader, up_writer, link)),
            asyncio.create_task(self._pipe(up_reader, writer, link)),
        ]
        try:
            await asyncio.gather(*link.tasks, return_exceptions=True)
        finally:
            self.links.discard(link)
            link.abort()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                if not data:
                    break
                if not self._resume.is_set():
                    await self._resume.wait()
                if time.monotonic() < self._slow_until:
                    await asyncio.sleep(self._slow_delay)
                if link not in self.links:
                    break
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, RuntimeError):
            pass
        finally:
            link.abort()
