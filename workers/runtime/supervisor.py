"""One runtime owns a worker's life.

Signal handlers only set the stop event. On stop the worker stops claiming, drains
what is in flight within the grace period, and exits 0. A side task that dies
(heartbeat, consumer, metrics server) stops the whole worker with a non-zero exit.
It serves ``/metrics``, ``/healthz`` (the process is alive: no dependency checked)
and ``/readyz`` (its connections are up; 503 from the moment a drain starts) when a
port is configured.

A worker waits for its broker and database at start-up (``workers.io.startup``): its
task runs under a waiting ``Patience``, whose connection events are logged
(``broker.connect_retry``, ``database.connect_retry``, ``broker.connected``, ...) and
whose ``waiting`` /readyz shows. A stop while start-up waits ends the worker at once
(exit 0): nothing is in flight yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from workers import errors
from workers.io import startup
from workers.runtime import logs, loops, otel, stopping
from workers.runtime.logs import event
from workers.runtime.probes import Health, serve


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


async def run(
    name: str,
    main: WorkerMain,
    *,
    metrics_port: int = 0,
    grace_s: float,
    gc_threshold: int | None = None,
) -> int:
    """Run one worker until SIGTERM/SIGINT; returns the process exit code.
    ``gc_threshold``: the garbage collector's youngest-generation threshold for the
    process (the setting ``gc_threshold``; None leaves Python's)."""
    tracing = otel.configure(name)  # raises before anything starts if it cannot
    if gc_threshold is not None:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(gc_threshold, older, oldest)
    stop = Stop(grace_s)
    health = Health()
    patience = startup.Patience(wait=True, report=event, waiting=health.waiting)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.event.set)
    if stopping.asked():  # a SIGTERM while the process was still starting: begin nothing
        event("worker.stopped", worker=name, exit_code=0, uptime_s=0.0)
        return 0
    server = await serve(metrics_port, health) if metrics_port else None
    event(
        "worker.started",
        worker=name,
        metrics_port=metrics_port,
        tracing=tracing,
        event_loop=loops.name_of(loop),
        gc_threshold=gc.get_threshold()[0],
    )
    started = time.monotonic()
    # the worker's task (and its tasks) wait at start-up, and every line they log
    # carries the worker's name
    with startup.patient(patience), logs.bound(worker=name):
        task = asyncio.create_task(main(stop, health), name=name)
    stopper = asyncio.create_task(stop.event.wait())
    code = 0
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            health.draining = True  # /readyz 503 from the first moment of the drain
            event("worker.draining", worker=name, grace_s=grace_s)
            if not await _drain(name, task, patience, grace_s):
                event("worker.drain_timeout", logging.ERROR, worker=name)
                task.cancel()
                code = 3
        if task.done() and not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if stop.requested and exc is not None and transient(exc):
                # stopped while Postgres or RabbitMQ was down: the unit being redone was
                # given up (nothing acked, nothing committed; it is redone elsewhere),
                # which is a drain, not a crash
                event("worker.drain_gave_up", logging.WARNING, worker=name, error=repr(exc))
            else:
                # with its traceback: a crash must say where it came from
                event("worker.crashed", logging.ERROR, worker=name, error=repr(exc), exc_info=exc)
                code = 2 if isinstance(exc, errors.CustodyError) else 1
        elif not stop.requested:
            event("worker.exited_unexpectedly", logging.ERROR, worker=name)
            code = 1
    finally:
        stopper.cancel()
        if server is not None:
            server.close()
        if tracing:  # the spans still buffered are exported before the process ends
            await asyncio.to_thread(otel.shutdown)
    event(
        "worker.stopped", worker=name, exit_code=code, uptime_s=round(time.monotonic() - started, 3)
    )
    return code


def transient(exc: BaseException) -> bool:
    """A database or broker failure that a redo would wait out (not a bad deployment):
    what :func:`redo` redoes as it is (a fenced unit after re-acquiring the lease)."""
    return isinstance(exc, (errors.DatabaseError, errors.BrokerError)) and exc.kind not in (
        errors.Retry.FATAL,
        errors.Retry.BROKEN,
    )


async def _drain(
    name: str, task: asyncio.Task[None], patience: startup.Patience, grace_s: float
) -> bool:
    """Wait up to ``grace_s`` for a stopping worker's task; True if it ended in time. A
    worker that is (or gets) stuck connecting at start-up has begun no unit of work:
    there is nothing to drain, so it is cancelled at once."""
    deadline = asyncio.get_running_loop().time() + grace_s
    while not task.done():
        if patience.waiting:
            event("worker.stopped_waiting", worker=name, waiting=sorted(patience.waiting))
            task.cancel()
            await asyncio.wait({task})
            return True
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return False
        await asyncio.wait({task}, timeout=min(left, 0.1))
    return True


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
        await _cancel_all([*mains, *sides])


async def _cancel_all(tasks: Sequence[asyncio.Future[None]], *, again_s: float = 1.0) -> None:
    """Cancel the tasks and wait for them to end, cancelling again every ``again_s`` the
    ones that have not: a cancellation can be lost (Python 3.11's ``asyncio.wait_for``
    swallows one that comes as its inner wait completes, and psycopg_pool's wait for a
    connection uses it), and a loop that lost it would run on, holding the drain until
    its grace period ran out."""
    left = [t for t in tasks if not t.done()]
    while left:
        for t in left:
            t.cancel()
        await asyncio.wait(left, timeout=again_s)
        left = [t for t in left if not t.done()]
    await asyncio.gather(*tasks, return_exceptions=True)


class Waker:
    """Wake a claim loop on NOTIFY, on a local kick, or at the polling interval."""

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self._event = asyncio.Event()

    def kick(self) -> None:
        self._event.set()

    async def wait(self, also: asyncio.Event | None = None) -> bool:
        """Until a NOTIFY, a kick or the poll interval — or ``also`` is set (which is
        cleared too). True when woken by the first three (the table may hold work),
        False when only by ``also``."""
        if also is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), self.poll_s)
            self._event.clear()
            return True
        waits = [asyncio.ensure_future(self._event.wait()), asyncio.ensure_future(also.wait())]
        try:
            done, _ = await asyncio.wait(
                waits, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                w.cancel()
        table = self._event.is_set() or not done  # a kick, or the poll interval
        self._event.clear()
        also.clear()
        return table

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


ROW_CHANGED_REDOS = 5  # redos of a unit whose rows changed under their locks


def _row_changed(exc: Exception) -> bool:
    return isinstance(exc, errors.DatabaseError) and exc.sqlstate == errors.ROW_CHANGED_SQLSTATE


async def redo(
    unit: Callable[[], Awaitable[Any]],
    *,
    worker: str,
    stop: Stop,
    on_fenced: Callable[[], Awaitable[Any]],
    name: str | None = None,
) -> Any:
    """Run a unit of work, redoing it whole on transient failures until it commits.

    ``name`` (a polling loop's unit: ``outbox.publish``, ``committer.successors``, ...)
    gives it a debug ``unit.done`` line when it did something (its result, a count of
    rows, is not 0): with ``CUSTODY_LOG_LEVEL=debug`` every unit shows, the consumers'
    through :mod:`workers.runtime.consume` (one per delivery), the loops' here.

    Every unit is idempotent by identity (dedup keys, guarded UPDATEs), so a redo
    after a commit in doubt re-reads what committed instead of doing it twice. A
    transient failure (database or broker down) is retried with capped backoff for
    as long as it lasts — never turned into a crash loop that would spend the
    deliveries' redelivery budget; only a stop request ends the wait. Anything not
    transient is raised at once.

    A stop request also ends a redo *in progress*: once the unit has failed on a
    transient error, its next attempt (waiting, say, for a pool connection to a
    database that is still down) is cancelled when the drain starts, and the failure
    raised. Nothing is lost: the attempt's transaction rolls back, its deliveries were
    not acked, and the unit is idempotent when it is redone elsewhere. The first attempt
    is never cut: in-flight work drains within the grace period.
    """
    from workers.runtime import metrics

    attempt = changed = 0
    failure: BaseException | None = None
    started = time.monotonic()
    while True:
        try:
            if failure is None:
                result = await unit()
            else:
                result = await _unless_stopped(unit, stop, failure)
            if name is not None:
                _done(name, result, started, attempt + 1)
            return result
        except errors.Fenced as exc:
            # a consequence of the lease loss, which on_fenced's keeper counts (once,
            # however many units it fenced): custody_lease_losses_total
            event("lease.fenced", logging.WARNING, worker=worker, error=str(exc))
            await on_fenced()
        except (errors.DatabaseError, errors.BrokerError) as exc:
            if exc.kind in (errors.Retry.FATAL, errors.Retry.BROKEN):
                raise
            changed = changed + 1 if _row_changed(exc) else 0
            if changed > ROW_CHANGED_REDOS:
                # a race is over after a redo or two; the same mismatch again and again is
                # this unit's own (a bug): raised, so that a batch is split and the
                # delivery that still fails alone is isolated, never retried forever
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
            failure = exc
        attempt += 1


def _done(name: str, result: Any, started: float, attempts: int) -> None:
    """The debug ``unit.done`` line of a polling loop's unit that did something."""
    if not result or not logs.enabled(logging.DEBUG):
        return
    rows = result if isinstance(result, int) and not isinstance(result, bool) else None
    event(
        "unit.done",
        logging.DEBUG,
        unit=name,
        rows=rows,
        attempts=attempts,
        duration_ms=round((time.monotonic() - started) * 1000, 3),
    )


async def _unless_stopped(
    unit: Callable[[], Awaitable[Any]], stop: Stop, failure: BaseException
) -> Any:
    """``unit()``, unless stop is requested first: then it is cancelled and the last
    transient ``failure`` raised (the worker is draining; the unit is redone later)."""
    task = asyncio.ensure_future(unit())
    stopping = asyncio.ensure_future(stop.event.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
        raise failure
    return task.result()
