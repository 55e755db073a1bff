"""The durable happy path with a real fleet: two replicas of every worker, and a
graceful SIGTERM of everything while work is in flight (DESIGN §1, §9; FAULTS 26)."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from contracts import codec
from contracts.models import StartRequest
from tests.acceptance.support import (
    Crew,
    assert_durable_happy_end,
    count,
    finished,
    queue_state,
    settled,
    state,
)
from tests.conftest import Env
from tests.harness import client, order, publish_starts
from workers.harness.fleet import PARTICIPANTS
from workers.io import broker

pytestmark = pytest.mark.acceptance

GRACE_S = 25.0  # the workers drain for up to 20 s (CUSTODY_DRAIN_GRACE_S), plus start-up slack


@pytest.mark.timeout(120)
async def test_two_replicas_of_every_worker_claim_disjointly_and_apply_each_effect_once(
    env: Env, crew: Crew
) -> None:
    """ "Two replicas of any worker must be safe" (DESIGN §9): with every worker type run
    twice, ~200 instances complete with no duplicate effect, and the two publishers'
    claims are disjoint: every outbox row was claimed once and published, none is left
    pending (FAULTS 26)."""
    n = 200
    crew.start_all(replicas=2)
    await publish_starts(env.settings, [order(i) for i in range(n)])
    try:
        await crew.wait(settled(env, n), timeout=90, what=f"{n} instances settled")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; state: {await state(env)}") from None

    await assert_durable_happy_end(env, n)
    claims = await env.sql(
        "SELECT publish_attempts, count(*) FROM custody.outbox GROUP BY 1 ORDER BY 1"
    )
    assert claims == [(1, 3 * n)], (
        f"(publish_attempts, rows) = {claims}: a row was claimed by more than one publisher "
        f"(or a publish failed and was retried)"
    )
    leases = await env.sql("SELECT worker, count(*) FROM custody.leases GROUP BY 1 ORDER BY 1")
    assert leases == [("committer", 2), ("publisher", 2), ("receipts", 2), ("reconciler", 2)]


@pytest.mark.timeout(60)
async def test_a_worker_stopped_while_still_starting_exits_cleanly(env: Env, crew: Crew) -> None:
    """A SIGTERM while a worker is still importing (a scale-down or a rollout right after
    a start; a second or more on a busy machine) is kept, not fatal: the worker begins
    nothing (no connection, no lease), logs its stop and exits 0 (it died of the
    signal, exit -15 and no line, before workers/runtime/stopping.py)."""
    proc = crew.fleet.start("reconciler")
    status = Path(f"/proc/{proc.popen.pid}/status")

    def catches_sigterm() -> bool:  # its SigCgt mask: a SIGTERM handler is in place
        [mask] = [x.split()[1] for x in status.read_text().splitlines() if x.startswith("SigCgt")]
        return bool(int(mask, 16) & (1 << (signal.SIGTERM - 1)))

    deadline = time.monotonic() + 20
    while not await asyncio.to_thread(catches_sigterm):
        assert proc.popen.poll() is None and time.monotonic() < deadline, "no SIGTERM handler"
        await asyncio.sleep(0.005)
    # the handler comes before the worker's imports (about a second), not with the event
    # loop's, just before worker.started
    started = await asyncio.to_thread(proc.log.read_text, errors="replace")
    assert '"event":"worker.started"' not in started, "SIGTERM is caught only once started"
    proc.popen.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(proc.popen.wait, 30)
    log = proc.log.read_text(errors="replace")
    assert code == 0, log
    assert '"event":"worker.stopped"' in log, log
    assert '"event":"worker.started"' not in log, "it began its work after all"
    assert await count(env, "SELECT count(*) FROM custody.leases") == 0, "a lease was left"


@pytest.mark.timeout(120)
async def test_sigterm_drains_every_worker_and_a_restarted_fleet_loses_and_doubles_nothing(
    env: Env, crew: Crew
) -> None:
    """Each owner controls its own transaction, so a stop at any moment leaves only
    committed facts: SIGTERM to every process while work is in flight, each drains and
    exits 0 within the grace period; a restarted fleet then completes every instance
    with every effect exactly once (nothing lost, nothing doubled)."""
    n = 150
    crew.start_all()
    await crew.wait_started()
    await publish_starts(env.settings, [order(i) for i in range(n)])

    async def in_flight() -> bool:
        return (
            await count(env, "SELECT count(*) FROM custody.operations WHERE status = 'succeeded'")
            > 0
        )

    await crew.wait(in_flight, timeout=60, what="the first operation to succeed")
    started = time.monotonic()
    codes = await asyncio.to_thread(crew.stop_all, GRACE_S)
    took = time.monotonic() - started
    assert codes, "no process was running"
    assert set(codes.values()) == {0}, f"exit codes after SIGTERM: {codes}"
    assert took < GRACE_S, f"the fleet took {took:.1f}s to drain"
    done_at_stop = await finished(env)
    assert done_at_stop < n, "everything finished before SIGTERM: nothing was in flight"
    assert await count(env, "SELECT count(*) FROM custody.leases") == 0, "a lease was not released"
    held = await count(env, "SELECT count(*) FROM custody.outbox WHERE claimed_by IS NOT NULL")
    assert held == 0, "a drained publisher left claimed outbox rows behind"
    for owner in PARTICIPANTS:
        held = await count(
            env,
            f"SELECT count(*) FROM participant_{owner}.outbox WHERE claimed_by IS NOT NULL",
            participant=True,
        )
        assert held == 0, f"participant {owner} left claimed outbox rows behind"

    crew.start_all()
    try:
        await crew.wait(settled(env, n), timeout=60, what=f"{n} instances settled after restart")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; state: {await state(env)}") from None
    await assert_durable_happy_end(env, n)


class DuplicateStartAsPoisonError(AssertionError):
    """The losing committer replica failed the duplicate start instead of deduplicating
    it: it dead-lettered it (or died)."""


async def _waiting_committers(env: Env) -> int:
    """Committer backends waiting: one on custody.instances (held by the test), the
    other on the start request's advisory lock (held by the first committer)."""
    return await count(
        env,
        "SELECT count(DISTINCT l.pid) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE NOT l.granted AND l.database = (SELECT oid FROM pg_database"
        " WHERE datname = current_database())"
        " AND (l.relation = 'custody.instances'::regclass OR l.locktype = 'advisory')"
        " AND a.application_name = 'custody-committer'",
    )


@pytest.mark.timeout(90)
async def test_two_committer_replicas_given_the_same_start_request_commit_it_once(
    env: Env, crew: Crew
) -> None:
    """Workflow transition with two committer replicas: a start request delivered twice
    (a client that re-sent it after a lost confirm) reaches both replicas, whose
    transactions overlap. Identity makes it one instance ("the same principle applies to
    ... a start request"): the duplicate is deduplicated and acked, not treated as poison,
    and neither replica dies (DESIGN §9: two replicas of any worker must be safe).

    The overlap is made certain, not hoped for: the test holds a SHARE lock on
    custody.instances (reads pass, inserts wait) and re-sends the same start until both
    replicas are waiting to insert it; then it lets them go."""
    crew.start_all(skip=["committer"])
    crew.start("committer")
    crew.start("committer")

    async def two_consumers() -> bool:
        return (await queue_state(env, broker.QUEUE_REQUESTS))[1] == 2

    await crew.wait(two_consumers, timeout=30, what="both committers consuming start requests")
    request = StartRequest(
        tenant="acme",
        start_request_id=str(uuid.uuid4()),
        process="order-fulfilment",
        input=order(0),
        requested_by="test",
    )
    copy = broker.Outgoing(
        request.start_request_id, broker.EXCHANGE_REQUESTS, broker.START_KEY, codec.encode(request)
    )

    async def both_waiting() -> bool:
        return await _waiting_committers(env) == 2

    async with await psycopg.AsyncConnection.connect(env.settings.database_url) as gate:
        await gate.execute("LOCK TABLE custody.instances IN SHARE MODE")
        async with client(env.settings) as amqp:
            pub = await amqp.publisher(window=8, timeout_s=10, user_id=None)
            for _ in range(20):
                assert all(o.ok for o in await pub.publish_many([copy]))
                try:
                    await crew.wait(both_waiting, timeout=1.0, what="both committers waiting")
                    break
                except AssertionError:
                    crew.check_alive()
            else:
                pytest.fail("the same start request never reached both committers at once")
        await gate.rollback()  # both replicas now insert the same instance

    settle = crew.wait(settled(env, 1), timeout=30, what="the instance settled")
    try:
        await settle
    except AssertionError:
        if not crew.unexpected_deaths():
            raise
    died = crew.unexpected_deaths()
    codes = await asyncio.to_thread(crew.stop_all, GRACE_S)  # nothing in flight after this
    dead_letters, _ = await queue_state(env, broker.QUEUE_DEAD)
    if died or dead_letters:
        raise DuplicateStartAsPoisonError(
            f"died: {died}; dead-lettered: {dead_letters}; exit codes {codes}"
        )
    assert set(codes.values()) == {0}, codes
    await assert_durable_happy_end(env, 1)
