"""The durable happy path, end to end, across the five commit boundaries."""

from __future__ import annotations

from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, order, publish_starts


async def _finished(env: Env, n: int) -> bool:
    return (
        await env.scalar(
            "SELECT count(*) FROM custody.instances WHERE status IN ('completed', 'failed')"
        )
        >= n
    )


async def test_instances_of_a_three_step_process_complete_with_each_effect_once(
    env: Env, fleet: InProcessFleet
) -> None:
    """N instances complete; each participant applied each effect exactly once (counted
    in its own tables); history shows the transitions in order."""
    fleet.start_all()
    n = 40
    await publish_starts(env.settings, [order(i) for i in range(n)])
    await wait_until(lambda: _finished(env, n), timeout=60, what=f"{n} instances finished")
    fleet.check_alive()
    assert (
        await env.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'") == n
    )
    for table, schema in (
        ("reservations", "inventory"),
        ("charges", "payments"),
        ("shipments", "shipping"),
    ):
        rows = await env.sql(
            f"SELECT count(*), count(DISTINCT operation_id) FROM participant_{schema}.{table}",
            participant=True,
        )
        assert rows[0] == (n, n), f"{schema}.{table}: (rows, distinct operations) = {rows[0]}"
    # history: per instance, node activations in process order, each operation settled
    # after it was activated and dispatched
    events = await env.sql(
        "SELECT instance_id, event, detail->>'node' FROM custody.history ORDER BY id"
    )
    by_instance: dict[object, list[tuple[str, str | None]]] = {}
    for iid, event, node in events:
        by_instance.setdefault(iid, []).append((event, node))
    assert len(by_instance) == n
    for seq in by_instance.values():
        names = [e for e, _ in seq]
        assert names[0] == "instance.started"
        assert names[-1] == "instance.completed"
        assert [node for e, node in seq if e == "node.activated"] == ["reserve", "charge", "ship"]
        assert names.count("operation.succeeded") == 3
        for i, e in enumerate(names):
            if e == "operation.succeeded":
                assert "node.activated" in names[:i]
