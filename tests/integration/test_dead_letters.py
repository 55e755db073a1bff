"""``custody dead-letters list|show|replay`` (issue 13): reading the dead-letter queue
changes nothing in it (not its depth, not its order, and no delivery limit applies
to it); a replay goes to the original exchange and routing key with the same
message_id, body and headers, once, authorized and audited, and only then leaves the
queue. The CLI connects as the ``custody-operator`` broker user."""

from __future__ import annotations

import json
from dataclasses import replace
from urllib.parse import quote

import pytest

from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, order, publish_starts
from tests.integration.test_recovery import custody
from workers.core import deadletters as letters
from workers.io import broker
from workers.runtime import faults


def as_operator(env: Env) -> Env:
    """The env with the operator's broker user (its database login is custody()'s)."""
    return Env(
        replace(env.settings, amqp_url=env.participant_amqp("operator")),
        env.vhost,
        env.engine_db,
        env.part_db,
    )


async def _depth(env: Env) -> int:
    depths = await broker.queue_depths(env.settings.amqp_management_url, env.vhost)
    return depths.get(broker.QUEUE_DEAD, 0)


async def _instances(env: Env) -> int:
    return int(await env.scalar("SELECT count(*) FROM custody.instances"))


async def _dead_lettered_start(env: Env, fleet: InProcessFleet, marker: str) -> None:
    """Three good starts complete; the poison one is dead-lettered by the committer."""
    fleet.start_all()
    await publish_starts(env.settings, [order(1), order(2, address=marker), order(3)])

    async def settled() -> bool:
        done = await env.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
        return done == 2 and await _depth(env) == 1

    await wait_until(settled, timeout=60, what="two completed, one dead-lettered")


async def test_a_poison_start_is_listed_shown_replayed_once_audited_and_leaves_the_queue(
    env: Env, fleet: InProcessFleet, poison_marker: str
) -> None:
    await _dead_lettered_start(env, fleet, poison_marker)
    op = as_operator(env)
    listed = await custody(op, "dead-letters", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    assert "InjectedPoison" in row["reason"] and row["worker"] == "committer"
    assert (row["exchange"], row["routing_key"]) == (broker.EXCHANGE_REQUESTS, broker.START_KEY)
    shown = await custody(op, "dead-letters", "show", row["message_id"])
    assert shown.returncode == 0, shown.stderr
    [full] = json.loads(shown.stdout)
    assert full["replayable"] is True and poison_marker in full["body"]
    assert full["headers"]["x-custody-worker"] == "committer"

    # the bug is fixed: the replay goes through the normal path, once
    faults.set_poison_marker("")
    refused = await custody(
        op,
        "dead-letters",
        "replay",
        row["message_id"],
        "--reason",
        "not mine",
        actor="acme-support",
    )
    assert refused.returncode == 3 and "may not replay" in refused.stderr
    assert await _depth(env) == 1
    replayed = await custody(
        op, "dead-letters", "replay", row["message_id"], "--reason", "the fix for #12 is deployed"
    )
    assert replayed.returncode == 0, replayed.stderr
    assert "replayed to custody.requests" in replayed.stdout

    async def three() -> bool:
        return (
            await env.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
            == 3
        )

    await wait_until(three, timeout=60, what="the replayed start to complete")

    async def empty() -> bool:  # the management API's counts lag by a few seconds
        return await _depth(env) == 0

    await wait_until(empty, timeout=30, what="the dead-letter queue empty")
    assert await _instances(env) == 3
    audit = await env.sql(
        "SELECT actor, action, target, outcome, inputs->>'exchange' FROM custody.audit ORDER BY id"
    )
    assert audit == [
        ("acme-support", "replay", row["message_id"], "refused", broker.EXCHANGE_REQUESTS),
        ("oncall", "replay", row["message_id"], "done", broker.EXCHANGE_REQUESTS),
    ]
    again = await custody(op, "dead-letters", "replay", row["message_id"], "--reason", "once more")
    assert again.returncode == 4  # gone from the queue: nothing replayed twice
    fleet.check_alive()


async def test_listing_changes_neither_the_depth_nor_the_content_nor_the_order(
    env: Env, fleet: InProcessFleet, poison_marker: str
) -> None:
    fleet.start_all()
    orders = [order(i, address=f"{poison_marker} {i}") for i in range(4)]
    await publish_starts(env.settings, orders)

    async def four() -> bool:
        return await _depth(env) == 4

    await wait_until(four, timeout=60, what="four dead letters")
    await fleet.stop_all()
    op = as_operator(env)
    seen = []
    for _ in range(4):
        listed = await custody(op, "dead-letters", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        rows = json.loads(listed.stdout)
        seen.append([(r["message_id"], r["reason"], r["bytes"]) for r in rows])
        assert await _depth(env) == 4
    assert all(s == seen[0] for s in seen) and len(seen[0]) == 4
    # no delivery limit applies to the dead letters: listing can never drop one
    queue = await broker.management(
        env.settings.amqp_management_url,
        "GET",
        f"/api/queues/{quote(env.vhost, safe='')}/{quote(broker.QUEUE_DEAD, safe='')}",
    )
    assert "delivery-limit" not in (queue.get("effective_policy_definition") or {})
    assert "x-delivery-limit" not in queue.get("arguments", {})


async def test_the_operator_broker_user_reads_only_the_dead_letters(env: Env) -> None:
    """custody-operator may read custody.dead-letters and nothing else."""
    amqp = broker.Broker(env.participant_amqp("operator"), "perm-check")
    await amqp.connect()
    try:
        with pytest.raises(Exception, match=r"ACCESS_REFUSED|access"):
            async with amqp.consume([broker.QUEUE_REQUESTS], 1):
                pass
    finally:
        await amqp.close()


def test_a_receipt_or_a_cancel_request_is_never_replayed() -> None:
    """Their consumers authenticate the publisher's broker user, which a replay cannot
    carry; the exchanges named here are the broker's."""
    assert (letters.COMMANDS, letters.REQUESTS, letters.RECEIPTS) == (
        broker.EXCHANGE_COMMANDS,
        broker.EXCHANGE_REQUESTS,
        broker.EXCHANGE_RECEIPTS,
    )
    receipt = letters.DeadLetter.from_message(
        "m1", {"x-custody-worker": "receipts", "x-custody-routing-key": "receipts"}, b"{}"
    )
    assert receipt.exchange == broker.EXCHANGE_RECEIPTS
    assert "reconcile" in (receipt.unreplayable() or "")
    cancel = letters.DeadLetter.from_message(
        "m2",
        {"x-custody-exchange": broker.EXCHANGE_REQUESTS, "x-custody-routing-key": "cancel"},
        b"{}",
    )
    assert cancel.unreplayable() is not None
    command = letters.DeadLetter.from_message(
        "m3",
        {
            "traceparent": "00-abc-def-01",
            "x-delivery-count": 3,
            "x-death": [
                {
                    "count": 1,
                    "exchange": broker.EXCHANGE_COMMANDS,
                    "queue": "custody.commands.inventory.v1",
                    "reason": "rejected",
                    "routing-keys": ["inventory.v1"],
                }
            ],
        },
        b"{}",
    )
    assert command.unreplayable() is None
    assert (command.exchange, command.routing_key, command.reason) == (
        broker.EXCHANGE_COMMANDS,
        "inventory.v1",
        "rejected",
    )
    assert command.replay_headers() == {"traceparent": "00-abc-def-01"}
