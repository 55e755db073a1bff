"""Fencing leases with real processes: a worker paused past its lease (SIGSTOP) cannot
commit when it resumes (SIGCONT); a replica has taken over, nothing is applied twice.

The seed: "A database worker lease prevents stale engine commits, but it cannot stop
an already-issued remote effect. The participant's idempotency and reconciliation
contract remains necessary."
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.support import (
    Crew,
    all_finished,
    assert_durable_happy_end,
    count,
    freeze_past_lease,
    process_state,
    queue_state,
)
from tests.conftest import Env, wait_until
from tests.fixtures import processes
from tests.harness import order, publish_starts
from workers.harness.fleet import Proc
from workers.io import broker

pytestmark = pytest.mark.acceptance


STOP_ENV = "CUSTODY_STOP_POINTS"


@pytest.mark.timeout(120)
async def test_a_sender_paused_past_its_lease_is_fenced_and_a_replica_takes_over(
    env: Env, crew: Crew
) -> None:
    """INV-5: the zombie's confirm mark is rejected by the epoch check inside its own
    transaction; the rows it had claimed are taken over (the publisher worker claims
    them once the zombie's claims expired and sends them again, or retires those whose
    operation settled meanwhile); the participant deduplicates a command published
    twice; every effect happens once. The zombie is the committer, which sends the
    submits it commits; a second committer carries the instances on."""
    crew.start_all(skip=("committer",))
    zombie = crew.fleet.start("committer", extra_env={STOP_ENV: "after_confirm_before_mark"})
    n = 10
    await publish_starts(env.settings, [order(i) for i in range(n)])

    holder = await freeze_past_lease(env, zombie, "committer")

    async def claims_expired() -> bool:
        # a claim outlives the lease by up to a third of its TTL (it was taken after the
        # last renewal); the publisher can find the operations settled by then, and the
        # woken zombie marks its rows itself (a fresh-clone run under load saw no row
        # taken over)
        return (
            await env.scalar(
                "SELECT count(*) FROM custody.outbox WHERE claimed_by LIKE %s"
                " AND claim_expires_at >= clock_timestamp()",
                (holder,),
            )
            == 0
        )

    await wait_until(claims_expired, timeout=30, what="the frozen committer's claims to expire")
    crew.start("committer")  # the replica
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

    # the zombie's claimed rows are taken over: sent again by the publisher, or, where
    # their operation had already settled meanwhile, retired (never sent again) by its
    # sample of the outbox (every few seconds)
    async def taken_over() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM custody.outbox"
                " WHERE publish_attempts > 1 OR status = 'retired'"
            )
            > 0
            and await env.scalar("SELECT count(*) FROM custody.outbox WHERE status = 'pending'")
            == 0
        )

    await wait_until(taken_over, timeout=30, what="the zombie's rows taken over")
    await assert_durable_happy_end(env, n)


# -- the fence is the epoch a unit began under (not the one in force at its commit) --


def _events(proc: Proc) -> list[dict[str, Any]]:
    out = []
    for line in proc.log.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


async def _assert_stale_commit_refused(env: Env, zombie: Proc, holder: str) -> None:
    """The zombie's heartbeat took its lease back (``lease.lost``, then epoch 2) and,
    after that, a commit of the zombie was refused for epoch 1: the unit that began
    under epoch 1 did not commit under epoch 2. (With the fence read at commit time a
    unit committing after the re-acquisition passes; any ``lease.fenced`` then can only
    come before ``lease.lost``.) The zombie lives on, holding a live lease."""

    async def refused() -> bool:
        events = [e.get("event") for e in _events(zombie)]
        return "lease.lost" in events and "lease.fenced" in events[events.index("lease.lost") :]

    try:
        await wait_until(refused, timeout=10, what="the zombie's stale commit to be fenced")
    except AssertionError:
        seen = [
            {k: e.get(k) for k in ("event", "epoch", "error")}
            for e in _events(zombie)
            if str(e.get("event", "")).startswith("lease.")
        ]
        raise AssertionError(
            f"no commit of the zombie was fenced after its lease was taken back; "
            f"its lease events: {seen}"
        ) from None
    events = _events(zombie)
    lost = next(i for i, e in enumerate(events) if e.get("event") == "lease.lost")
    assert events[lost].get("epoch") == 1, events[lost]
    fenced = [e for e in events[lost:] if e.get("event") == "lease.fenced"]
    assert any("epoch 1 is not current" in str(e.get("error")) for e in fenced), fenced
    lease = await env.sql(
        "SELECT epoch, expires_at > now() FROM custody.leases WHERE holder LIKE %s", (holder,)
    )
    assert lease == [(2, True)], f"the zombie's lease (epoch, live): {lease}"
    assert zombie.popen.poll() is None, "the zombie noticed, redid its unit, and carries on"


@pytest.mark.timeout(150)
async def test_a_committer_unit_begun_under_a_lost_epoch_cannot_commit_after_the_lease_is_retaken(
    env: Env, crew: Crew
) -> None:
    """ "A database worker lease prevents stale engine commits, but it cannot stop an
    already-issued remote effect."

    The committer freezes inside ``commit_successors`` with successor intents claimed
    and locked, past its lease. A replica cannot take those intents (the zombie's open
    transaction locks them) but carries on with everything else. On SIGCONT the
    zombie's heartbeat takes the lease back under epoch 2 before the paused unit
    commits; the unit began under epoch 1, so its commit is refused, and the zombie
    redoes it under epoch 2. Every instance completes, every effect happens once. (The
    receipt consumer leaves every successor to the committers here: CUSTODY_RECEIPTS_
    ACTIVATE=false; its own activation's lease: test_a_receipt_unit_begun_under_….)"""
    crew.start_all(skip=("committer", "receipts"))
    crew.start("receipts", env={"CUSTODY_RECEIPTS_ACTIVATE": "false"})
    zombie = crew.fleet.start("committer", extra_env={STOP_ENV: "successor_claimed"})
    first, n = 3, 9
    await publish_starts(env.settings, [order(i) for i in range(first)])
    holder = await freeze_past_lease(env, zombie, "committer")

    pending = set(
        await env.sql(
            "SELECT id, instance_id FROM custody.successor_intents WHERE status = 'pending'"
        )
    )
    free = set(
        await env.sql(
            "SELECT id, instance_id FROM custody.successor_intents WHERE status = 'pending'"
            " FOR SHARE SKIP LOCKED"
        )
    )
    held = pending - free
    assert held, "the zombie froze holding the successor intents it claimed"

    crew.start("committer")  # the replica

    async def two_consumers() -> bool:
        return (await queue_state(env, broker.QUEUE_REQUESTS))[1] == 2

    await wait_until(two_consumers, timeout=30, what="the replica to consume start requests")
    # round-robin: some go to the replica, the rest wait, unacked, in the frozen zombie
    await publish_starts(env.settings, [order(i) for i in range(first, n)])
    await crew.wait(
        all_finished(env, 1), timeout=60, what="the replica to complete work of its own"
    )
    assert process_state(zombie.popen.pid) == "T", "the zombie is still frozen"
    still = await env.sql(
        "SELECT id FROM custody.successor_intents WHERE status = 'pending' AND id = ANY(%s)",
        ([i for i, _ in held],),
    )
    assert len(still) == len(held), "the replica could not take the zombie's locked intents"
    stuck = await count(
        env,
        "SELECT count(*) FROM custody.instances WHERE id = ANY(%s) AND status = 'running'",
        ([iid for _, iid in held],),
    )
    assert stuck == len({iid for _, iid in held}), "their instances wait for the zombie"

    os.kill(zombie.popen.pid, signal.SIGCONT)
    await crew.wait(all_finished(env, n), timeout=60, what="every instance to complete")
    await _assert_stale_commit_refused(env, zombie, holder)
    await assert_durable_happy_end(env, n)


@pytest.mark.timeout(150)
async def test_a_receipt_unit_begun_under_a_lost_epoch_cannot_commit_after_the_lease_is_retaken(
    env: Env, crew: Crew
) -> None:
    """ "A database worker lease prevents stale engine commits, but it cannot stop an
    already-issued remote effect."

    The receipt consumer freezes inside ``apply`` with its batch's operations locked,
    past its lease. The remote effects go on regardless: the inventory participant
    reserves stock for every instance and sends every receipt, while the engine has
    applied none. A replica started then cannot take the zombie's deliveries (they are
    unacked on the zombie's live connection; nothing is ready in the queue). On SIGCONT
    the zombie's heartbeat takes the lease back under epoch 2 before the paused unit
    commits; the unit began under epoch 1, so its commit is refused, and the zombie
    redoes the batch under epoch 2, sharing later receipts with the replica. Every
    instance completes, every receipt is applied once, every effect happened once."""
    crew.start_all(skip=("receipts",))
    zombie = crew.fleet.start("receipts", extra_env={STOP_ENV: "receipts_locked"})
    n = 5
    await publish_starts(env.settings, [order(i) for i in range(n)])
    holder = await freeze_past_lease(env, zombie, "receipt consumer")

    async def effects_issued() -> bool:
        made = await count(
            env, "SELECT count(*) FROM participant_inventory.reservations", participant=True
        )
        unsent = await count(
            env,
            "SELECT count(*) FROM participant_inventory.outbox WHERE status = 'pending'",
            participant=True,
        )
        return made == n and unsent == 0

    await crew.wait(effects_issued, timeout=60, what="the participant's effects and receipts")
    crew.start("receipts")  # the replica

    async def held_by_zombie() -> bool:
        return await queue_state(env, broker.QUEUE_RECEIPTS) == (0, 2)

    await wait_until(
        held_by_zombie, timeout=30, what="the replica to consume, with nothing ready for it"
    )
    assert process_state(zombie.popen.pid) == "T", "the zombie is still frozen"
    applied = await count(env, "SELECT count(*) FROM custody.receipt_inbox")
    assert applied == 0, "no receipt was applied while the zombie held them all"
    succeeded = await count(
        env, "SELECT count(*) FROM custody.operations WHERE status = 'succeeded'"
    )
    assert succeeded == 0, "the effects happened; the engine does not know yet"

    os.kill(zombie.popen.pid, signal.SIGCONT)
    await crew.wait(all_finished(env, n), timeout=60, what="every instance to complete")
    await _assert_stale_commit_refused(env, zombie, holder)
    await assert_durable_happy_end(env, n)


@pytest.mark.timeout(150)
async def test_a_reconciler_unit_begun_under_a_lost_epoch_cannot_commit_after_the_lease_is_retaken(
    env: Env, crew: Crew, tmp_path: Path
) -> None:
    """ "A database worker lease prevents stale engine commits, but it cannot stop an
    already-issued remote effect."

    The reconciler freezes inside its deadline sweep, the overdue operations claimed
    and locked, past its lease. On SIGCONT its heartbeat takes the lease back under
    epoch 2 before the paused unit commits: the unit began under epoch 1, so its
    commit is refused and it is redone under epoch 2. Each overdue operation becomes
    outcome_unknown exactly once and its instance is suspended; nothing is applied
    twice or rolled back."""
    short = {"CUSTODY_PROCESSES_DIR": str(processes.write(tmp_path / "processes", deadline_s=2))}
    for worker in ("committer", "publisher", "receipts"):
        crew.fleet.start(worker, extra_env=short)
    zombie = crew.fleet.start("reconciler", extra_env={**short, STOP_ENV: "deadlines_claimed"})
    n = 5
    await publish_starts(env.settings, [order(i) for i in range(n)])  # nobody answers
    holder = await freeze_past_lease(env, zombie, "reconciler")
    os.kill(zombie.popen.pid, signal.SIGCONT)
    await _assert_stale_commit_refused(env, zombie, holder)

    async def all_unknown() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM custody.operations WHERE status = 'outcome_unknown'"
            )
            == n
        )

    await wait_until(all_unknown, timeout=30, what="every overdue operation outcome_unknown")
    twice = await env.sql(
        "SELECT operation_id, count(*) FROM custody.history"
        " WHERE event = 'operation.outcome_unknown' GROUP BY 1 HAVING count(*) <> 1"
    )
    assert twice == [], "each deadline applied exactly once"
    suspended = await env.scalar(
        "SELECT count(*) FROM custody.instances WHERE status = 'suspended'"
    )
    assert suspended == n
