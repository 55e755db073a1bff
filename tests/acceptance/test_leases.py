"""Fencing leases with real processes: a worker paused past its lease (SIGSTOP) cannot
commit when it resumes (SIGCONT); a replica has taken over, nothing is applied twice.

The seed: "A database worker lease prevents stale engine commits, but it cannot stop
an already-issued remote effect. The participant's idempotency and reconciliation
contract remains necessary."
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.acceptance.support import Crew, all_finished, assert_durable_happy_end
from tests.conftest import Env, wait_until
from tests.harness import order, publish_starts

pytestmark = pytest.mark.acceptance


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(120)
async def test_a_publisher_paused_past_its_lease_is_fenced_and_a_replica_takes_over(
    env: Env, crew: Crew
) -> None:
    """INV-5: the zombie's commit is rejected by the epoch check inside its own
    transaction; the replica publishes the rows it had claimed; the participant
    deduplicates the command published twice; every effect happens once."""
    crew.start_all(skip=("publisher",))
    zombie = crew.fleet.start(
        "publisher", extra_env={"CUSTODY_STOP_POINTS": "after_confirm_before_mark"}
    )
    n = 10
    await publish_starts(env.settings, [order(i) for i in range(n)])

    async def frozen() -> bool:
        return _state(zombie.popen.pid) == "T"

    await wait_until(frozen, timeout=30, what="the publisher to freeze after its confirms")
    holder = f"%-{zombie.popen.pid}-%"

    async def expired() -> bool:
        return (
            await env.scalar(
                "SELECT bool_and(expires_at < now()) FROM custody.leases WHERE holder LIKE %s",
                (holder,),
            )
            is True
        )

    await wait_until(expired, timeout=30, what="the zombie's lease to expire")
    crew.start("publisher")  # the replica
    await crew.wait(all_finished(env, n), timeout=60, what="the replica to finish the work")

    os.kill(zombie.popen.pid, signal.SIGCONT)

    async def fenced() -> bool:
        return "lease.fenced" in zombie.log.read_text()

    await wait_until(fenced, timeout=30, what="the zombie to notice it was fenced")

    async def reacquired() -> bool:
        return (
            await env.scalar(
                "SELECT max(epoch) FROM custody.leases WHERE holder LIKE %s", (holder,)
            )
            == 2
        )

    await wait_until(reacquired, timeout=30, what="the zombie to take its lease back")
    assert zombie.popen.poll() is None, "the zombie noticed, logged, and carries on"
    dispatched = await env.sql(
        "SELECT operation_id, count(*) FROM custody.history"
        " WHERE event = 'operation.dispatched'"
        " GROUP BY 1 HAVING count(*) > 1"
    )
    assert dispatched == [], "no row was marked twice"
    assert await env.scalar("SELECT count(*) FROM custody.outbox WHERE publish_attempts > 1") > 0
    await assert_durable_happy_end(env, n)
