"""One runtime owns a worker's life.

Signal handlers only set the stop event. On stop the worker stops claiming, drains
what is in flight within the grace period, and exits 0. A side task that dies
(heartbeat, consumer, metrics server) stops the whole worker with a non-zero exit.
It serves ``/metrics``, ``/healthz`` (the process is alive: no dependency checked)
and ``/readyz`` (its connections are up) when a port is configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from workers import errors

log = logging.getLogger("custody")


_STABLE = ("ts", "level", "event", "logger")
_EVENT_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")


def _text(value: object) -> str:
    try:
        return str(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"


def _plain(value: object, depth: int = 0) -> Any:
    """A JSON-safe copy: strings for anything exotic, no NaN, keys as strings."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _text(value)
    if depth > 16:
        return _text(value)
    if isinstance(value, dict):
        return {
            k if isinstance(k, str) else _text(k): _plain(v, depth + 1) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    return _text(value)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: a stable event name and structured fields. Records
    of libraries (free text) become ``log.library`` with their text as ``message``."""

    def format(self, record: logging.LogRecord) -> str:
        message = _text(record.getMessage())
        ours = record.name == "custody" and _EVENT_NAME.match(message) is not None
        payload: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "event": message if ours else "log.library",
            "logger": record.name,
        }
        if not ours:
            payload["message"] = message
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                name = _text(key)
                payload[f"field_{name}" if name in _STABLE else name] = value
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return json.dumps(_plain(payload), allow_nan=False)


def setup_logging(fmt: str, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s %(fields)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("aio_pika", "aiormq", "psycopg.pool"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log an event with structured fields."""
    log.log(level, name, extra={"fields": fields})


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


async def _serve_http(port: int, health: Health) -> asyncio.Server:
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


class Stop:
    """The stop event, plus how long in-flight work may take to drain."""

    def __init__(self, grace_s: float) -> None:
        self.event = asyncio.Event()
        self.grace_s = grace_s

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if stop was requested meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.event.wait(), seconds)
        return self.event.is_set()


WorkerMain = Callable[[Stop, Health], Coroutine[Any, Any, None]]


async def run(name: str, main: WorkerMain, *, metrics_port: int = 0, grace_s: float = 20.0) -> int:
    """Run one worker until SIGTERM/SIGINT; returns the process exit code."""
    stop = Stop(grace_s)
    health = Health()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.event.set)
    server = await _serve_http(metrics_port, health) if metrics_port else None
    event("worker.started", worker=name, metrics_port=metrics_port)
    started = time.monotonic()
    task = asyncio.create_task(main(stop, health), name=name)
    stopper = asyncio.create_task(stop.event.wait())
    code = 0
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            event("worker.draining", worker=name, grace_s=grace_s)
            done, _ = await asyncio.wait({task}, timeout=grace_s)
            if not done:
                event("worker.drain_timeout", logging.ERROR, worker=name)
                task.cancel()
                code = 3
        if task.done() and not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            event("worker.crashed", logging.ERROR, worker=name, error=repr(exc))
            code = 2 if isinstance(exc, errors.CustodyError) else 1
        elif not stop.requested:
            event("worker.exited_unexpectedly", logging.ERROR, worker=name)
            code = 1
    finally:
        stopper.cancel()
        if server is not None:
            server.close()
    event(
        "worker.stopped", worker=name, exit_code=code, uptime_s=round(time.monotonic() - started, 3)
    )
    return code


async def supervise(main: Sequence[Awaitable[None]], side: Sequence[Awaitable[None]] = ()) -> None:
    """Run a worker's loops: ``main`` ones end by themselves after stop (draining);
    ``side`` ones (listeners, heartbeats) run until then. The first failure of any,
    or a side task ending on its own, stops all and is raised."""
    mains = [asyncio.ensure_future(t) for t in main]
    sides = [asyncio.ensure_future(t) for t in side]
    try:
        pending = set(mains) | set(sides)
        while any(not t.done() for t in mains):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
                if t in sides:
                    raise errors.CustodyError(f"side task {t.get_name()} ended unexpectedly")
    finally:
        for t in mains + sides:
            if not t.done():
                t.cancel()
        await asyncio.gather(*mains, *sides, return_exceptions=True)


async def next_batch(
    inbox: asyncio.Queue[Any], stop: Stop, *, size: int, linger_s: float, idle_s: float = 0.5
) -> list[Any]:
    """Up to ``size`` items: wait for the first (waking to check stop), then linger."""
    batch: list[Any] = []
    while not batch:
        if stop.requested:
            return batch
        try:
            batch.append(await asyncio.wait_for(inbox.get(), idle_s))
        except TimeoutError:
            continue
    deadline = time.monotonic() + linger_s
    while len(batch) < size:
        try:
            batch.append(inbox.get_nowait())
            continue
        except asyncio.QueueEmpty:
            pass
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            batch.append(await asyncio.wait_for(inbox.get(), remaining))
        except TimeoutError:
            break
    return batch


class Waker:
    """Wake a claim loop on NOTIFY, on a local kick, or at the polling interval."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self._event = asyncio.Event()

    def kick(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), self.poll_s)
        self._event.clear()

    async def follow(self, listen: Callable[[], Any], *, worker: str = "") -> None:
        """Kick on every notification of ``listen()`` (a db.listen); re-open it after
        a database outage, with backoff — the polling fallback covers the gap."""
        attempt = 0
        while True:
            try:
                async for _ in listen():
                    attempt = 0
                    self.kick()
            except errors.DatabaseError as exc:
                if exc.kind in (errors.Retry.FATAL, errors.Retry.BROKEN):
                    raise
                event(
                    "listen.retry",
                    logging.WARNING,
                    worker=worker,
                    attempt=attempt + 1,
                    error=str(exc)[:300],
                )
            self.kick()
            await asyncio.sleep(errors.backoff_seconds(attempt))
            attempt += 1


async def redo(
    unit: Callable[[], Awaitable[Any]],
    *,
    worker: str,
    stop: Stop,
    on_fenced: Callable[[], Awaitable[Any]],
) -> Any:
    """Run a unit of work, redoing it whole on transient failures until it commits.

    Every unit is idempotent by identity (dedup keys, guarded UPDATEs), so a redo
    after a commit in doubt re-reads what committed instead of doing it twice. A
    transient failure (database or broker down) is retried with capped backoff for
    as long as it lasts — never turned into a crash loop that would spend the
    deliveries' redelivery budget; only a stop request ends the wait. Anything not
    transient is raised at once.
    """
    from workers import metrics

    attempt = 0
    while True:
        try:
            return await unit()
        except errors.Fenced as exc:
            metrics.LEASE_LOSSES.labels(worker).inc()
            event("lease.fenced", logging.WARNING, worker=worker, error=str(exc))
            await on_fenced()
        except (errors.DatabaseError, errors.BrokerError) as exc:
            if exc.kind in (errors.Retry.FATAL, errors.Retry.BROKEN):
                raise
            metrics.UNIT_FAILURES.labels(worker, exc.kind.value).inc()
            event(
                "unit.retry",
                logging.WARNING,
                worker=worker,
                kind=exc.kind.value,
                attempt=attempt + 1,
                error=str(exc)[:300],
            )
            if await stop.sleep(errors.backoff_seconds(attempt)):
                raise
        attempt += 1
