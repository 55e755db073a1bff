"""Poison messages: bounded redeliveries, then the dead-letter queue, with a reason;
never blocking the queue behind them."""

from __future__ import annotations

from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, client, drain, order, publish_starts
from workers.io import broker


async def test_a_message_that_fails_its_consumer_is_dead_lettered_with_its_reason(
    env: Env, fleet: InProcessFleet, poison_marker: str
) -> None:
    """A message that makes its consumer's unit of work fail (a bug it triggers, not a
    transient outage) is isolated from its batch and sent to the dead-letter queue with
    its reason; the good messages of the same batch and behind it all complete."""
    fleet.start_all()
    n = 20
    orders = [order(i) for i in range(n)]
    orders.insert(7, order(99, address=poison_marker))
    await publish_starts(env.settings, orders)

    async def finished() -> bool:
        return (
            await env.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
            == n
        )

    await wait_until(finished, timeout=60, what="the good instances to complete")
    fleet.check_alive()
    dead = await drain(env.settings, broker.QUEUE_DEAD, timeout=1.0)
    assert len(dead) == 1
    assert poison_marker.encode() in dead[0].body
    assert "InjectedPoison" in str(dead[0].headers["x-custody-reason"])
    assert dead[0].headers["x-custody-worker"] == "committer"
    assert await env.scalar("SELECT count(*) FROM custody.instances") == n


async def test_the_delivery_limit_dead_letters_what_a_consumer_keeps_requeueing(env: Env) -> None:
    """RabbitMQ 3.10 quorum queues have no default delivery limit; ours is set by policy
    together with a dead-letter exchange, so a message a consumer keeps failing ends in
    the dead-letter queue instead of looping forever or being dropped."""
    await publish_starts(env.settings, [order(1)])
    requeues = 0
    async with (
        client(env.settings) as amqp,
        amqp.consume([broker.QUEUE_REQUESTS], prefetch=1) as inbox,
    ):

        async def dead_lettered() -> bool:
            nonlocal requeues
            try:
                d = inbox.get_nowait()
            except Exception:
                depths = await broker.queue_depths(env.settings.amqp_management_url, env.vhost)
                return depths.get(broker.QUEUE_DEAD, 0) == 1
            requeues += 1
            await d.requeue()
            return False

        await wait_until(dead_lettered, timeout=30, interval=0.05, what="the message dead-lettered")
    assert requeues == env.settings.delivery_limit + 1
    [dead] = await drain(env.settings, broker.QUEUE_DEAD, timeout=1.0)
    deaths = dead.headers["x-death"]
    assert deaths[0]["reason"] == "delivery_limit"
    assert deaths[0]["queue"] == broker.QUEUE_REQUESTS
