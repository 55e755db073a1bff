"""Pinned routes, branching on outcomes, and the declared broker topology."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from prometheus_client import REGISTRY

from tests.conftest import MGMT, Env, wait_until
from tests.harness import InProcessFleet, order, publish_starts
from workers import provision
from workers.io import broker
from workers.settings import ROOT


async def test_a_changed_routes_file_does_not_redirect_an_instance_that_pinned_its_binding(
    env: Env, fleet: InProcessFleet, tmp_path: Path
) -> None:
    """ "Instances pin the route and binding used for their operations. New
    configuration cannot silently redirect existing work to another owner." A later
    node of an old instance keeps the old binding; only new instances use the new file."""
    fleet.start_all(participants=("inventory", "shipping"))
    [_] = await publish_starts(env.settings, [order(1)])

    async def charge_waiting() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM custody.operations WHERE node = 'charge'"
                " AND status = 'dispatched'"
            )
            == 1
        )

    await wait_until(charge_waiting, what="the charge operation dispatched")
    # the new file rolls out to both workers that activate nodes
    for run in [r for r in fleet.running if r.name in ("committer", "receipts")]:
        await fleet.stop(run)
    moved = tmp_path / "routes.toml"
    moved.write_text((ROOT / "deploy" / "routes.toml").read_text().replace('.v1"', '.v2"'))
    drift_before = (
        REGISTRY.get_sample_value("custody_route_drift_total", {"route": "shipping"}) or 0
    )
    fleet.start("committer", dataclasses.replace(env.settings, routes_file=str(moved)))
    fleet.start("receipts", dataclasses.replace(env.settings, routes_file=str(moved)))
    fleet.start("payments")

    async def completed() -> bool:
        return (
            await env.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
            == 1
        )

    await wait_until(completed, timeout=30, what="the pinned instance to complete")
    bindings = await env.sql("SELECT node, binding FROM custody.operations ORDER BY created_at")
    assert bindings == [
        ("reserve", "inventory.v1"),
        ("charge", "payments.v1"),
        ("ship", "shipping.v1"),
    ]
    drift_after = REGISTRY.get_sample_value("custody_route_drift_total", {"route": "shipping"}) or 0
    assert drift_after > drift_before, "a changed binding for pinned work is an alert"
    shipments = await env.scalar(
        "SELECT count(*) FROM participant_shipping.shipments", participant=True
    )
    assert shipments == 1

    await publish_starts(env.settings, [order(2)])

    async def new_instance_pinned() -> bool:
        rows = await env.sql(
            "SELECT binding FROM custody.operations WHERE node = 'reserve' ORDER BY created_at"
        )
        return len(rows) == 2

    await wait_until(new_instance_pinned, what="the new instance's first operation")
    rows = await env.sql(
        "SELECT i.routes->'shipping'->>'binding', o.binding FROM custody.operations o"
        " JOIN custody.instances i ON i.id = o.instance_id WHERE o.node = 'reserve'"
        " ORDER BY o.created_at"
    )
    assert rows == [("shipping.v1", "inventory.v1"), ("shipping.v2", "inventory.v2")]


async def test_branching_on_an_operation_outcome_runs_the_compensation(
    env: Env, fleet: InProcessFleet
) -> None:
    """A declined charge (a failed receipt, effect none) branches to `release`; the
    instance ends failed with the reservation released, each effect once."""
    fleet.start_all()
    await publish_starts(env.settings, [order(1, amount_cents=500_000), order(2)])

    async def finished() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM custody.instances WHERE status IN ('completed', 'failed')"
            )
            == 2
        )

    await wait_until(finished, what="both instances finished")
    statuses = await env.sql(
        "SELECT input->>'order_id', status::text FROM custody.instances ORDER BY 1"
    )
    assert statuses == [("order-00001", "failed"), ("order-00002", "completed")]
    charge = await env.sql(
        "SELECT status::text, effect::text, error->>'code' FROM custody.operations"
        " WHERE node = 'charge' AND input->>'order_id' = 'order-00001'"
    )
    assert charge == [("failed", "none", "declined")]
    counts = await env.sql(
        "SELECT (SELECT count(*) FROM participant_inventory.reservations),"
        " (SELECT count(*) FROM participant_inventory.releases),"
        " (SELECT count(*) FROM participant_payments.charges),"
        " (SELECT count(*) FROM participant_shipping.shipments)",
        participant=True,
    )
    assert counts == [(2, 1, 1, 1)]


async def test_topology_declares_quorum_queues_with_dead_lettering_and_a_delivery_limit(
    env: Env,
) -> None:
    """Durable quorum queues; a dead-letter exchange and an explicit delivery limit set
    by policy (3.10 has no default limit, and a limit without a DLX drops messages)."""

    async def policy_applied() -> bool:
        queues = await broker.management(MGMT, "GET", f"/api/queues/{env.vhost}")
        return all(
            q.get("policy") == broker.POLICY_NAME for q in queues if q["name"] != broker.QUEUE_DEAD
        )

    await wait_until(policy_applied, timeout=10, what="the policy on every queue")
    queues = {
        q["name"]: q for q in await broker.management(MGMT, "GET", f"/api/queues/{env.vhost}")
    }
    expected = {broker.command_queue(b) for b in ("inventory.v1", "payments.v1", "shipping.v1")}
    expected |= {broker.QUEUE_RECEIPTS, broker.QUEUE_REQUESTS, broker.QUEUE_DEAD}
    assert set(queues) == expected
    for name, q in queues.items():
        assert q["type"] == "quorum" and q["durable"], name
        if name != broker.QUEUE_DEAD:
            definition = q["effective_policy_definition"]
            assert definition["dead-letter-exchange"] == broker.EXCHANGE_DEAD
            assert definition["delivery-limit"] == env.settings.delivery_limit


async def test_topology_apply_is_idempotent(env: Env) -> None:
    """Declaring twice changes nothing and does not fail (workers and the migrate Job
    may both run it)."""

    for _ in range(2):
        await provision.apply_topology(env.settings)
