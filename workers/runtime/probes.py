"""What a worker serves on its port: ``/metrics``, ``/healthz`` (the process is alive:
no dependency checked) and ``/readyz`` (its connections are up)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


class Health:
    """What /readyz reports: every named check must be true."""

    def __init__(self) -> None:
        self.checks: dict[str, Callable[[], bool]] = {}

    def ready(self) -> tuple[bool, dict[str, bool]]:
        states = {}
        for name, check in self.checks.items():
            try:
                states[name] = bool(check())
            except Exception:
                states[name] = False
        return bool(states) and all(states.values()), states


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
                ok, states = health.ready()
                status = "200 OK" if ok else "503 Service Unavailable"
                ctype, body = "application/json", json.dumps({"ready": ok, **states}).encode()
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
