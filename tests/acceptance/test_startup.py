"""Issue 12 (the chaos harness): a worker that starts before its broker or its database
waits for it instead of exiting.

A container restart order, or a rolling restart of the broker, can start a worker while
RabbitMQ or Postgres is unreachable. The worker keeps trying (full-jitter exponential
backoff, capped), stays live (/healthz 200) and not ready (/readyz 503, saying what it
waits for), logs a ``broker.connect_retry`` or ``database.connect_retry`` event on every
attempt, and starts working as soon as the dependency answers; SIGTERM while it waits
stops it at once with exit 0. A refused login (wrong user or password) is configuration,
not an outage: it still exits 2 at once, with a message that says so.

The shared broker and database are never stopped: the dependency is made unreachable
for one worker only, through the TCP proxy in ``tests/proxy.py``.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.acceptance.observability import (
    consumes,
    events,
    http_get,
    poll,
    sigterm,
    start,
    status_of,
    tail,
    wait_ready,
)
from tests.acceptance.support import Crew
from tests.conftest import Env
from tests.proxy import Proxy, amqp_port, pg_port, pg_proxied_url
from workers.harness.fleet import DEV_PASSWORD, PARTICIPANTS, Proc
from workers.io import broker, db

pytestmark = pytest.mark.acceptance


@pytest.mark.timeout(120)
@pytest.mark.parametrize("worker", ["receipts", "inventory"])
async def test_a_worker_started_before_the_broker_waits_for_it_and_then_works(
    env: Env, crew: Crew, worker: str
) -> None:
    """Issue 12: a worker started while RabbitMQ is unreachable must keep trying with
    backoff, stay live and not ready, log each attempt, and begin work as soon as the
    broker is reachable (today it exits 2 on the first refused connection)."""
    url = env.participant_amqp(worker) if worker in PARTICIPANTS else env.settings.amqp_url
    async with Proxy(amqp_port(url)) as proxy:
        proxy.cut()
        s = start(crew, worker, CUSTODY_AMQP_URL=proxy.amqp_url(url))
        began = time.monotonic()

        async def waiting() -> bool:
            health = await status_of(s, "/healthz")
            assert health in (None, 200), f"/healthz {health}:\n{tail(s.proc)}"
            readiness = await http_get(s.port, "/readyz")
            assert readiness is None or readiness[0] == 503, f"ready while refused: {readiness}"
            return (
                health == 200
                and proxy.refused >= 3
                and time.monotonic() - began > 3
                and len(events(s.proc, "broker.connect_retry")) >= 3
            )

        try:
            await poll(waiting, timeout=45, what="3 refused attempts", alive=[s.proc])
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{tail(s.proc)}") from None
        readiness = await http_get(s.port, "/readyz")
        assert readiness is not None and readiness[0] == 503
        body = json.loads(readiness[1])
        assert body["ready"] is False and "broker" in body["waiting"], body
        retries = events(s.proc, "broker.connect_retry")
        assert [r["attempt"] for r in retries[:3]] == [1, 2, 3], retries
        assert all(r["phase"] == "start" and r["worker"] for r in retries), retries
        assert all(f"127.0.0.1:{proxy.port}" == r["node"] for r in retries), retries
        assert not events(s.proc, "worker.crashed")

        proxy.heal()
        await wait_ready(crew, [s], timeout=30)
        [connected] = events(s.proc, "broker.connected")
        assert connected["phase"] == "start" and int(str(connected["failed_attempts"])) >= 3
        await consumes(env, crew, worker)
        assert await sigterm(crew, s.proc) == 0, tail(s.proc)


@pytest.mark.timeout(120)
async def test_a_worker_started_before_postgres_waits_for_it_and_then_works(
    env: Env, crew: Crew
) -> None:
    """Issue 12, the same for Postgres (today the pool gives up after 15 s and the worker
    exits 2): live, not ready, ``database.connect_retry`` on every attempt, ready and
    working once Postgres answers."""
    url = env.settings.database_url
    async with Proxy(pg_port(url)) as proxy:
        proxy.cut()
        s = start(crew, "receipts", CUSTODY_DATABASE_URL=pg_proxied_url(url, proxy.port))

        async def waiting() -> bool:
            health = await status_of(s, "/healthz")
            assert health in (None, 200), f"/healthz {health}:\n{tail(s.proc)}"
            assert await status_of(s, "/readyz") in (None, 503), "ready while refused"
            return health == 200 and len(events(s.proc, "database.connect_retry")) >= 3

        try:
            await poll(waiting, timeout=45, what="3 refused attempts", alive=[s.proc])
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{tail(s.proc)}") from None
        readiness = await http_get(s.port, "/readyz")
        assert readiness is not None and readiness[0] == 503
        assert "database" in json.loads(readiness[1])["waiting"], readiness
        proxy.heal()
        await wait_ready(crew, [s], timeout=30)
        await consumes(env, crew, "receipts")
        assert await sigterm(crew, s.proc) == 0, tail(s.proc)


@pytest.mark.timeout(90)
async def test_sigterm_while_waiting_for_the_broker_exits_0_at_once(env: Env, crew: Crew) -> None:
    """Issue 12: a worker still waiting for its broker has nothing in flight; SIGTERM stops
    it at once with exit 0, not after the drain grace period."""
    async with Proxy(amqp_port(env.settings.amqp_url)) as proxy:
        proxy.cut()
        s = start(crew, "publisher", CUSTODY_AMQP_URL=proxy.amqp_url(env.settings.amqp_url))

        async def waiting() -> bool:
            return bool(events(s.proc, "broker.connect_retry"))

        await poll(waiting, timeout=30, what="a refused attempt", alive=[s.proc])
        began = time.monotonic()
        assert await sigterm(crew, s.proc, timeout=10) == 0, tail(s.proc)
        assert time.monotonic() - began < 5
        assert events(s.proc, "worker.stopped")[-1]["exit_code"] == 0


async def crashes(crew: Crew, s: Proc, within_s: float) -> str:
    began = time.monotonic()
    code = await asyncio.to_thread(s.popen.wait, within_s + 5)
    took = time.monotonic() - began
    assert code == 2, f"exit {code}:\n{tail(s)}"
    assert took < within_s, f"took {took:.1f}s to refuse"
    crew.retired.add(s.name)
    [crashed] = events(s, "worker.crashed")
    return str(crashed["error"])


@pytest.mark.timeout(90)
async def test_a_refused_broker_login_exits_2_at_once_with_a_clear_message(
    env: Env, crew: Crew
) -> None:
    """Issue 12: ACCESS_REFUSED (a wrong user or password) is configuration, not an
    outage; retrying would hide it behind a worker that is never ready. It exits 2 at
    once, saying the login was refused, as whom, and not leaking the password."""
    url = broker.url_with_user(env.settings.amqp_url, "custody-receipts", "not-the-password")
    s = start(crew, "receipts", CUSTODY_AMQP_URL=url)
    error = await crashes(crew, s.proc, within_s=15)
    assert "ConfigError" in error and "refused the login" in error, error
    assert "custody-receipts" in error and "not-the-password" not in error, error
    assert DEV_PASSWORD not in error


@pytest.mark.timeout(90)
async def test_a_refused_postgres_login_exits_2_at_once_with_a_clear_message(
    env: Env, crew: Crew
) -> None:
    """Issue 12, the same for Postgres: a role that cannot log in exits 2 at once (today
    after the pool's 15 s timeout, with no reason), saying Postgres refused the login."""
    url = db.with_user(env.settings.database_url, "custody_nobody")
    s = start(crew, "receipts", CUSTODY_DATABASE_URL=url)
    error = await crashes(crew, s.proc, within_s=12)
    assert "ConfigError" in error and "refused the login" in error, error
    assert "custody_nobody" in error, error
