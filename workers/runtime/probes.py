"""What a worker serves on its port: ``/metrics``, ``/healthz`` (the process is alive:
no dependency checked) and ``/readyz`` (its connections are up, start-up is not
waiting for one, and it is not draining: from SIGTERM on it is 503, so that a Service
or a load balancer in front stops counting it at once)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


class Health:
    """What /readyz reports: every named check must be true, and start-up must not be
    waiting for a dependency (``waiting``: what it waits for, and the last reason; the
    supervisor shares it with the connections' ``startup.Patience``)."""

    def __init__(self) -> None:
        self.checks: dict[str, Callable[[], bool]] = {}
        self.waiting: dict[str, str] = {}
        self.draining = False  # set by the supervisor as soon as a stop is requested

    def ready(self) -> tuple[bool, dict[str, bool]]:
        states = {}
        for name, check in self.checks.items():
            try:
                states[name] = bool(check())
            except Exception:
                states[name] = False
        ok = bool(states) and all(states.values()) and not self.waiting and not self.draining
        return ok, states

    def body(self) -> dict[str, object]:
        """The JSON of /readyz: ``ready``, each check, ``waiting`` while start-up waits
        (``{"ready": false, "waiting": {"broker": "127.0.0.1:5672: ..."}}``) and
        ``draining`` once a stop was requested."""
        ok, states = self.ready()
        out: dict[str, object] = {"ready": ok, **states}
        waiting = dict(self.waiting)
        if waiting:
            out["waiting"] = waiting
        if self.draining:
            out["draining"] = True
        return out


async def serve(port: int, health: Health) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            path = line.split()[1].decode() if len(line.split()) > 1 else "/"
            if path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest()
            elif path == "/healthz":
                status, ctype, body = "200 OK", "application/json", b'{"status":"alive"}'
            elif path == "/readyz":
                shown = health.body()
                status = "200 OK" if shown["ready"] is True else "503 Service Unavailable"
                ctype, body = "application/json", json.dumps(shown).encode()
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, "0.0.0.0", port)
