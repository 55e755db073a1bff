"""Observability of real worker processes: liveness and readiness.

Liveness (/healthz) does not depend on the broker or the database, while readiness
(/readyz) follows the connections: a broker or database outage turns it 503, and both
recover when the dependency comes back; a connection lost while a consumer is set up
does not kill the worker; and a drain turns /readyz 503 from its first moment.

The shared broker and database are never stopped: a dependency is made unreachable for
one worker only, through the TCP proxy in ``tests/proxy.py``. Every wait is a bounded
poll; nothing sleeps a fixed time. The helpers live in ``tests/acceptance/observability.py``.
"""

from __future__ import annotations

import json
import signal

import psycopg
import pytest

from tests.acceptance.observability import (
    http_get,
    poll,
    sigterm,
    start,
    status_of,
    tail,
    wait_ready,
)
from tests.acceptance.support import Crew, all_finished, state
from tests.conftest import Env
from tests.harness import order, publish_raw, publish_starts
from tests.proxy import Proxy, amqp_port, pg_port, pg_proxied_url
from workers.harness.fleet import ENGINE_WORKERS, PARTICIPANTS
from workers.io import broker

pytestmark = pytest.mark.acceptance


async def consuming(env: Env, crew: Crew, worker: str, n: int) -> None:
    """Wait until a consuming worker has handled its n-th malformed message (its
    consumer is really running): a receipt the receipts worker quarantines, a command
    a participant refuses. The publisher consumes nothing: no-op."""
    if worker == "receipts":
        await publish_raw(env.settings, broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY, [b"[1"])
        query, participant = "SELECT count(*) FROM custody.quarantine", False
    elif worker in PARTICIPANTS:
        binding = f"{worker}.v1"
        await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, binding, [b"[1"])
        query, participant = f"SELECT count(*) FROM participant_{worker}.refused", True
    else:
        return

    async def handled() -> bool:
        return int(await env.scalar(query, participant=participant)) >= n

    await crew.wait(handled, timeout=20, what=f"{worker} to consume its malformed message #{n}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("worker", ["publisher", "receipts", "inventory"])
async def test_a_broker_outage_turns_readyz_503_while_healthz_stays_200_and_both_recover(
    env: Env, crew: Crew, worker: str
) -> None:
    """One worker reaches RabbitMQ through a proxy the test owns. Cutting the proxy
    (every connection reset, reconnects refused) turns its /readyz 503 while /healthz
    stays 200 and the process lives through refused reconnects; healing the proxy brings
    /readyz back to 200 (aio-pika's robust connection), the worker does real work again,
    and a SIGTERM still drains it to exit 0."""
    url = env.participant_amqp(worker) if worker in PARTICIPANTS else env.settings.amqp_url
    async with Proxy(amqp_port(url)) as proxy:
        s = start(crew, worker, CUSTODY_AMQP_URL=proxy.amqp_url(url))
        await wait_ready(crew, [s])
        await consuming(env, crew, worker, 1)

        proxy.cut()

        async def not_ready_but_alive() -> bool:
            assert await status_of(s, "/healthz") == 200, f"/healthz failed:\n{tail(s.proc)}"
            return await status_of(s, "/readyz") == 503

        await poll(not_ready_but_alive, timeout=20, what="/readyz 503", alive=[s.proc])
        refused = proxy.refused

        async def tried_again() -> bool:
            assert await status_of(s, "/healthz") == 200, f"/healthz failed:\n{tail(s.proc)}"
            assert await status_of(s, "/readyz") == 503, "ready while the broker is unreachable"
            return proxy.refused > refused

        await poll(tried_again, timeout=30, what="a refused reconnect attempt", alive=[s.proc])

        proxy.heal()

        async def ready_again() -> bool:
            assert await status_of(s, "/healthz") == 200, f"/healthz failed:\n{tail(s.proc)}"
            return await status_of(s, "/readyz") == 200

        try:
            await poll(ready_again, timeout=30, what="/readyz 200 again", alive=[s.proc])
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{tail(s.proc)}") from None

        for other in (*ENGINE_WORKERS, *PARTICIPANTS):
            if other != worker:
                start(crew, other, port=0)
        n = 3
        await publish_starts(env.settings, [order(i) for i in range(n)])
        try:
            await crew.wait(all_finished(env, n), timeout=40, what="work through the worker")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {await state(env)}\n{tail(s.proc)}") from None
        assert await sigterm(crew, s.proc) == 0, tail(s.proc)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("worker", ["receipts", "inventory"])
async def test_a_connection_lost_while_the_consumer_is_set_up_does_not_kill_the_worker(
    env: Env, crew: Crew, worker: str
) -> None:
    """The broker connection drops right after the AMQP handshake, when the worker opens
    its first channel (to set up its consumer), and stays down a while: the worker lives
    (/healthz 200) and is not ready; once the broker is back it becomes ready and
    consumes."""
    url = env.participant_amqp(worker) if worker in PARTICIPANTS else env.settings.amqp_url
    async with Proxy(amqp_port(url)) as proxy:
        proxy.cut_when_a_channel_opens()
        s = start(crew, worker, CUSTODY_AMQP_URL=proxy.amqp_url(url))

        async def cut_and_retried() -> bool:
            assert await status_of(s, "/healthz") in (None, 200)
            return proxy.mode == "refuse" and proxy.refused > 0

        try:
            await poll(cut_and_retried, timeout=30, what="a refused reconnect", alive=[s.proc])
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{tail(s.proc)}") from None
        assert await status_of(s, "/healthz") == 200
        assert await status_of(s, "/readyz") == 503
        proxy.heal()
        await wait_ready(crew, [s])
        await consuming(env, crew, worker, 1)


@pytest.mark.timeout(90)
async def test_readyz_is_503_until_the_worker_has_connected(env: Env, crew: Crew) -> None:
    """While the broker does not answer the AMQP handshake, a starting worker is alive
    (/healthz 200) but not ready (/readyz 503)."""
    async with Proxy(amqp_port(env.settings.amqp_url)) as proxy:
        proxy.hang()
        s = start(crew, "publisher", CUSTODY_AMQP_URL=proxy.amqp_url(env.settings.amqp_url))

        async def alive() -> bool:
            return await status_of(s, "/healthz") == 200 and proxy.accepted > 0

        await poll(alive, timeout=20, what="/healthz 200 and a connection attempt", alive=[s.proc])
        readiness = await http_get(s.port, "/readyz")
        assert readiness is not None and readiness[0] == 503, (
            f"/readyz while the AMQP handshake is unanswered: {readiness}"
        )


@pytest.mark.timeout(90)
async def test_a_database_outage_keeps_healthz_200_turns_readyz_503_and_both_recover(
    env: Env, crew: Crew
) -> None:
    """The same contract for Postgres: one worker reaches it through a proxy; cut it,
    /healthz stays 200 and the process lives, /readyz turns 503; heal it, /readyz 200."""
    url = env.settings.database_url
    async with Proxy(pg_port(url)) as proxy:
        s = start(crew, "publisher", CUSTODY_DATABASE_URL=pg_proxied_url(url, proxy.port))
        await wait_ready(crew, [s])
        proxy.cut()

        async def not_ready_but_alive() -> bool:
            assert await status_of(s, "/healthz") == 200, f"/healthz failed:\n{tail(s.proc)}"
            return await status_of(s, "/readyz") == 503

        try:
            await poll(not_ready_but_alive, timeout=20, what="/readyz 503", alive=[s.proc])
        finally:
            proxy.heal()

        async def ready_again() -> bool:
            assert await status_of(s, "/healthz") == 200, f"/healthz failed:\n{tail(s.proc)}"
            return await status_of(s, "/readyz") == 200

        await poll(ready_again, timeout=30, what="/readyz 200 again", alive=[s.proc])


@pytest.mark.timeout(90)
async def test_readyz_turns_503_as_soon_as_a_drain_starts_and_healthz_stays_200(
    env: Env, crew: Crew
) -> None:
    """SIGTERM starts the drain: from then on /readyz is 503 with ``draining`` (a Service
    stops routing to the pod, a load balancer takes it out) while /healthz stays 200 and
    the in-flight unit finishes; then the worker exits 0. The publisher's claim is held
    in flight by a lock the test takes on the outbox, so the drain lasts until the test
    lets it end."""
    s = start(crew, "publisher", CUSTODY_DRAIN_GRACE_S="60")
    await wait_ready(crew, [s])
    async with await psycopg.AsyncConnection.connect(env.settings.database_url) as lock:
        await lock.execute("LOCK TABLE custody.outbox IN ACCESS EXCLUSIVE MODE")

        async def claim_blocked() -> bool:
            return bool(
                await env.scalar(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND usename = 'custody_publisher' AND wait_event_type = 'Lock'"
                )
            )

        await poll(
            claim_blocked, timeout=20, what="the publisher's claim on the lock", alive=[s.proc]
        )
        assert await status_of(s, "/readyz") == 200, "ready while a unit is merely in flight"
        crew.fleet.signal(s.proc, signal.SIGTERM)

        async def draining() -> bool:
            assert await status_of(s, "/healthz") == 200, f"/healthz failed:\n{tail(s.proc)}"
            got = await http_get(s.port, "/readyz")
            return got is not None and got[0] == 503 and json.loads(got[1]).get("draining") is True

        try:
            await poll(draining, timeout=10, what="/readyz 503 draining", alive=[s.proc])
        except AssertionError as exc:
            raise AssertionError(f"{exc}: /readyz {await http_get(s.port, '/readyz')}") from None
        assert "worker.stopped" not in s.proc.log.read_text(), "the drain ended too early"
        await lock.rollback()  # the claim goes on; the drain ends
    assert await sigterm(crew, s.proc) == 0, tail(s.proc)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("worker", "service"),
    [("publisher", "database"), ("receipts", "broker"), ("inventory", "broker")],
)
async def test_a_worker_stopped_during_an_outage_exits_0_without_waiting_out_the_grace(
    env: Env, crew: Crew, worker: str, service: str
) -> None:
    """SIGTERM while the worker's Postgres or RabbitMQ is unreachable: there is nothing
    it can finish (no commit, no ack), so it gives up the unit it is redoing and its
    lease hand-back (bounded; the lease expires by its TTL) and exits 0 at once, instead
    of holding a terminating pod for the whole drain grace and exiting 3."""
    if service == "database":
        url = env.settings.database_url
        proxy = Proxy(pg_port(url))
        async with proxy:
            s = start(crew, worker, CUSTODY_DATABASE_URL=pg_proxied_url(url, proxy.port))
            await wait_ready(crew, [s])
            proxy.cut()
            await poll(
                lambda: _is(s, "/readyz", 503), timeout=20, what="/readyz 503", alive=[s.proc]
            )
            code = await sigterm(crew, s.proc, timeout=8)
    else:
        url = env.participant_amqp(worker) if worker in PARTICIPANTS else env.settings.amqp_url
        async with Proxy(amqp_port(url)) as proxy:
            s = start(crew, worker, CUSTODY_AMQP_URL=proxy.amqp_url(url))
            await wait_ready(crew, [s])
            proxy.cut()
            await poll(
                lambda: _is(s, "/readyz", 503), timeout=20, what="/readyz 503", alive=[s.proc]
            )
            code = await sigterm(crew, s.proc, timeout=8)
    assert code == 0, tail(s.proc)


async def _is(s, path: str, status: int) -> bool:
    return await status_of(s, path) == status
