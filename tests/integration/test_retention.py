"""The retention horizon: "Receipt retention and deduplication history must cover
every permitted retry, replay and restore horizon.\""""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest

from contracts import codec
from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, drain, publish_raw
from tests.integration.test_participant import submit
from tests.integration.test_recovery import custody
from workers.core import horizon, process
from workers.io import broker
from workers.settings import ROOT


def run_worker(env: Env, worker: str, **extra: str) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "workers.cli", "run", worker]
    if worker == "participant":
        args += ["--name", "inventory"]
        extra.setdefault("CUSTODY_AMQP_URL", env.participant_amqp("inventory"))
    return subprocess.run(
        args,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env.fleet_env(), **extra},
    )


@pytest.mark.parametrize("worker", ["committer", "participant"])
def test_start_up_refuses_a_horizon_shorter_than_retry_replay_and_restore(
    env: Env, worker: str
) -> None:
    """A configuration whose horizon is shorter than the longest retry window plus the
    replay and restore horizon is refused at start-up, naming the numbers."""
    _, catalog = process.load_config(env.settings)
    window = horizon.longest_retry_window(catalog)
    assert window.where == "node 'charge' of order-fulfilment v1"  # 3 attempts of 60 s + 1 + 2
    assert window.seconds == 183
    result = run_worker(
        env,
        worker,
        CUSTODY_RETENTION_S="1000",
        CUSTODY_REPLAY_HORIZON_S="600",
        CUSTODY_RESTORE_HORIZON_S="1200",
    )
    assert result.returncode == 2, result.stderr
    assert (
        "CUSTODY_RETENTION_S=1000s is shorter than the longest retry window (183s, node "
        "'charge' of order-fulfilment v1) + CUSTODY_REPLAY_HORIZON_S (600s) + "
        "CUSTODY_RESTORE_HORIZON_S (1200s) = 1983s"
    ) in result.stderr


@pytest.fixture
async def inventory(env: Env) -> AsyncIterator[InProcessFleet]:
    f = InProcessFleet(env)
    f.start("inventory")
    yield f
    await f.stop_all()


async def test_a_replay_inside_the_horizon_is_deduplicated_after_cleanup(
    env: Env, inventory: InProcessFleet
) -> None:
    """Cleanup keeps everything younger than the horizon: a replay of a settled command
    is still answered with its receipt, and executes nothing."""
    cmd = submit()
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)])

    async def done() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM participant_inventory.inbox WHERE status = 'succeeded'",
                participant=True,
            )
            == 1
        )

    await wait_until(done, what="the command to complete")
    first = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=1.0)
    cleaned = await custody(env, "retention", "cleanup", "--participant", "inventory", "--json")
    assert cleaned.returncode == 0, cleaned.stderr
    assert '"inbox": 0' in cleaned.stdout
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)])
    again = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=2.0)
    assert [d.body for d in again] == [first[-1].body]
    assert (
        await env.scalar(
            "SELECT count(*) FROM participant_inventory.reservations", participant=True
        )
        == 1
    )


async def test_cleanup_removes_settled_history_older_than_the_horizon_in_batches(
    env: Env, inventory: InProcessFleet
) -> None:
    """Older than the horizon: the settled command's identity, receipts and published
    outbox rows go; an unsettled (accepted) command is never removed."""
    cmds = [submit() for _ in range(3)]
    await publish_raw(
        env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(c) for c in cmds]
    )

    async def done() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM participant_inventory.inbox WHERE status = 'succeeded'",
                participant=True,
            )
            == 3
        )

    await wait_until(done, what="the commands to complete")

    async def published() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM participant_inventory.outbox WHERE status = 'pending'",
                participant=True,
            )
            == 0
        )

    await wait_until(published, what="the receipts published")
    # time passes (the test moves the settled rows' clocks back past the horizon)
    await env.sql(
        "UPDATE participant_inventory.inbox SET completed_at = now() - interval"
        " '40 days' WHERE request_id = %s",
        (cmds[0].request_id,),
        participant=True,
    )
    await env.sql(
        "UPDATE participant_inventory.outbox SET published_at = now() - interval '40 days'",
        participant=True,
    )
    cleaned = await custody(env, "retention", "cleanup", "--participant", "inventory", "--json")
    assert cleaned.returncode == 0, cleaned.stderr
    # one outbox row per command: the samples' handlers run inline, so the accepted
    # receipt is journaled only and the terminal one is the row that was sent
    assert '"inbox": 1' in cleaned.stdout and '"outbox": 3' in cleaned.stdout
    left = await env.sql(
        "SELECT request_id::text FROM participant_inventory.inbox ORDER BY 1", participant=True
    )
    assert sorted(r for (r,) in left) == sorted(c.request_id for c in cmds[1:])
    assert (
        await env.scalar(
            "SELECT count(*) FROM participant_inventory.receipts WHERE request_id = %s",
            (cmds[0].request_id,),
            participant=True,
        )
        == 0
    )
