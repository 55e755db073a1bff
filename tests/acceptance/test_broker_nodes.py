"""Issue 12 (the chaos harness): a worker given several RabbitMQ nodes carries on through
another node when its node goes away, without a load balancer.

The worker's ``CUSTODY_AMQP_URL`` names two nodes (``amqp://u:p@h1:p1,h2:p2/vhost``):
two TCP proxies (``tests/proxy.py``) in front of the one real RabbitMQ. The proxy that
carries its connection is closed for good mid-run; the worker reconnects through the
other, is ready again, and the fleet's work goes through it to the end.
"""

from __future__ import annotations

import pytest

from tests.acceptance.observability import (
    log_objects,
    poll,
    sigterm,
    start,
    status_of,
    tail,
    wait_ready,
)
from tests.acceptance.support import Crew, all_finished, assert_effects_once, state
from tests.conftest import Env
from tests.harness import order, publish_starts
from tests.proxy import Proxy, amqp_port
from workers.core import amqp_url
from workers.harness.fleet import DEV_PASSWORD, ENGINE_WORKERS, PARTICIPANTS
from workers.io import broker

pytestmark = pytest.mark.acceptance


@pytest.mark.timeout(150)
@pytest.mark.parametrize("worker", ["publisher", "inventory"])
async def test_a_worker_moves_to_the_second_node_when_its_node_goes_away(
    env: Env, crew: Crew, worker: str
) -> None:
    """Issue 12: a worker must reconnect to another node of its host list when its node
    goes away; consumers re-subscribed, confirms still counted, nothing lost or doubled.
    The publisher (confirmed publishing) and a participant (consumer, acks after commit,
    and its own outbox) are the worker put behind the two nodes."""
    port = amqp_port(env.settings.amqp_url)
    async with Proxy(port) as a, Proxy(port) as b:
        own = (
            env.participant_amqp(worker)
            if worker in PARTICIPANTS
            else broker.url_with_user(env.settings.amqp_url, f"custody-{worker}", DEV_PASSWORD)
        )
        nodes = [f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"]
        url = str(amqp_url.parse(own).with_addresses(nodes))
        s = start(crew, worker, CUSTODY_AMQP_URL=url)
        await wait_ready(crew, [s])
        for other in (*ENGINE_WORKERS, *PARTICIPANTS):
            if other != worker:
                start(crew, other, port=0)
        await publish_starts(env.settings, [order(i) for i in range(3)])
        await crew.wait(all_finished(env, 3), timeout=40, what="work before the move")

        first, second = (a, b) if a.accepted else (b, a)
        accepted = second.accepted
        first.cut()  # the node goes away for good

        async def moved() -> bool:
            return second.accepted > accepted and await status_of(s, "/readyz") == 200

        try:
            await poll(moved, timeout=40, what="ready through the second node", alive=[s.proc])
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{tail(s.proc)}") from None
        n = 8
        await publish_starts(env.settings, [order(i) for i in range(3, n)])
        try:
            await crew.wait(all_finished(env, n), timeout=60, what="work after the move")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {await state(env)}\n{tail(s.proc)}") from None
        await assert_effects_once(env, n)
        moves = [
            o
            for o in log_objects(s.proc)
            if o.get("event") == "broker.connected" and o.get("phase") == "reconnect"
        ]
        assert moves and moves[-1]["node"] == f"127.0.0.1:{second.port}", tail(s.proc)
        assert await sigterm(crew, s.proc) == 0, tail(s.proc)
