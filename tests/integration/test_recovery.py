"""Unknown outcomes and operator recovery: deadlines, reconcile, retry-safe, pause.

The seed: "A timeout can produce OutcomeUnknown. Workflow suspends progression and
pauses command dispatch while retaining custody records and obligations. It does not
interpret timeout as permission to create a new operation."
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from contracts import codec
from contracts.models import SubmitCommand
from tests.conftest import MGMT, Env, wait_until
from tests.fixtures import processes
from tests.harness import InProcessFleet, order, publish_starts
from workers.io import broker, db
from workers.settings import ROOT


@pytest.fixture
def short(env: Env, tmp_path: Path) -> Env:
    """The env with 2 s deadlines and a 0.2 s retry backoff."""
    env.settings = dataclasses.replace(
        env.settings, processes_dir=str(processes.write(tmp_path / "processes"))
    )
    return env


@pytest.fixture
async def fleet(short: Env) -> AsyncIterator[InProcessFleet]:
    f = InProcessFleet(short)
    yield f
    await f.stop_all()


async def custody(env: Env, *args: str, actor: str = "oncall") -> subprocess.CompletedProcess[str]:
    """The operator CLI, as a separate process against the test's database. Awaited, so
    the in-process workers keep running meanwhile (as they would beside a real
    operator): a blocking call would freeze their event loop, lose their leases and
    deadlock a CLI that waits on a row lock one of them holds."""
    argv = [sys.executable, "-m", "workers.cli", *args]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **env_vars(env, actor)},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise subprocess.TimeoutExpired(argv, 60) from None
    assert proc.returncode is not None
    return subprocess.CompletedProcess(argv, proc.returncode, out.decode(), err.decode())


def env_vars(env: Env, actor: str = "oncall") -> dict[str, str]:
    """An operator's environment: its own login role (the actor the database records),
    never the superuser."""
    return env.fleet_env() | {
        "CUSTODY_PROCESSES_DIR": env.settings.processes_dir,
        "CUSTODY_DATABASE_URL": db.with_user(env.settings.database_url, actor),
    }


async def status_of(env: Env, node: str) -> tuple[Any, ...]:
    rows = await env.sql(
        "SELECT o.status::text, o.effect::text, o.attempt, i.status::text"
        " FROM custody.operations o JOIN custody.instances i"
        " ON i.id = o.instance_id WHERE o.node = %s",
        (node,),
    )
    return rows[0] if rows else ()


async def until_status(env: Env, node: str, status: str, timeout: float = 20) -> None:
    async def reached() -> bool:
        s = await status_of(env, node)
        return bool(s) and s[0] == status

    await wait_until(reached, timeout=timeout, what=f"{node} {status}")


async def op_id(env: Env, node: str) -> str:
    return str(await env.scalar("SELECT id::text FROM custody.operations WHERE node = %s", (node,)))


async def purge(env: Env, queue: str) -> None:
    await broker.management(MGMT, "DELETE", f"/api/queues/{env.vhost}/{queue}/contents")


async def test_a_passed_deadline_makes_the_operation_outcome_unknown_and_suspends_the_instance(
    short: Env, fleet: InProcessFleet
) -> None:
    """Deadline without a terminal receipt → outcome_unknown; the instance is suspended,
    no new operation or attempt is created, custody records stay."""
    fleet.start_all(participants=())  # nobody executes: no receipt will come
    await publish_starts(short.settings, [order(1)])
    await until_status(short, "reserve", "outcome_unknown")
    assert await status_of(short, "reserve") == ("outcome_unknown", "unknown", 1, "suspended")
    assert await short.scalar("SELECT count(*) FROM custody.operations") == 1
    assert await short.scalar("SELECT count(*) FROM custody.attempts") == 1
    assert await short.scalar("SELECT count(*) FROM custody.outbox") == 1
    events = [e for (e,) in await short.sql("SELECT event FROM custody.history ORDER BY id")]
    assert events == [
        "instance.started",
        "node.activated",
        "operation.dispatched",
        "operation.outcome_unknown",
    ]


async def test_the_operator_story_timeout_reconcile_late_success_successors_run(
    short: Env, fleet: InProcessFleet
) -> None:
    """Timeout → outcome_unknown → reconcile → the late success is found (through the
    same validation as any receipt) and applied → successors run. The response was
    lost, the effect was not: it is counted once."""
    fleet.start_all()
    receipts = next(r for r in fleet.running if r.name == "receipts")
    await fleet.stop(receipts)  # the engine stops hearing from participants
    await publish_starts(short.settings, [order(1)])

    async def reserved() -> bool:
        return (
            await short.scalar(
                "SELECT count(*) FROM participant_inventory.inbox WHERE status = 'succeeded'",
                participant=True,
            )
            == 1
        )

    await wait_until(reserved, what="the participant to complete the reservation")
    await wait_until(lambda: _published(short), what="the participant's receipts sent")
    await purge(short, broker.QUEUE_RECEIPTS)  # the responses are lost
    await until_status(short, "reserve", "outcome_unknown")

    listed = await custody(short, "operations", "list", "--status", "outcome_unknown", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = json.loads(listed.stdout)
    done = await custody(
        short, "reconcile", row["id"], "--reason", "participant restarted, lost replies", "--json"
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "reconcile_pending"
    fleet.start("receipts")
    await until_status(short, "reserve", "succeeded")

    async def completed() -> bool:
        return (
            await short.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
            == 1
        )

    await wait_until(completed, what="the instance to complete after reconcile")
    assert (
        await short.scalar(
            "SELECT count(*) FROM participant_inventory.reservations", participant=True
        )
        == 1
    )
    kinds = await short.sql(
        "SELECT kind, count(*) FROM custody.attempts a JOIN custody.operations o"
        " ON o.id = a.operation_id WHERE o.node = 'reserve' GROUP BY 1 ORDER BY 1"
    )
    assert kinds == [("query", 1), ("submit", 1)], "reconcile never creates a new attempt"
    [audit] = await short.sql("SELECT actor, action, outcome, reason FROM custody.audit")
    assert audit == ("oncall", "reconcile", "done", "participant restarted, lost replies")


async def _published(env: Env) -> bool:
    return (
        await env.scalar(
            "SELECT count(*) FROM participant_inventory.outbox WHERE status = 'pending'",
            participant=True,
        )
        == 0
    )


async def test_a_null_query_answer_is_not_proof_that_no_effect_occurred(
    short: Env, fleet: InProcessFleet
) -> None:
    """ "A null query result means no receipt was returned; it is not proof that no
    effect occurred": the operation returns to outcome_unknown with the fact recorded."""
    fleet.start_all(participants=())
    await publish_starts(short.settings, [order(1)])
    await until_status(short, "reserve", "dispatched")
    await purge(short, broker.command_queue("inventory.v1"))  # the command is lost
    await until_status(short, "reserve", "outcome_unknown")
    fleet.start("inventory")
    oid = await op_id(short, "reserve")
    assert (
        await custody(short, "reconcile", oid, "--reason", "checking the lost command")
    ).returncode == 0

    async def answered() -> bool:
        facts = await short.sql(
            "SELECT detail->>'fact' FROM custody.history"
            " WHERE event = 'operation.outcome_unknown' AND detail ? 'fact'"
        )
        return facts == [("query answered: no receipt",)]

    await wait_until(answered, what="the null answer recorded")
    assert await status_of(short, "reserve") == ("outcome_unknown", "unknown", 1, "suspended")
    assert await short.scalar("SELECT count(*) FROM custody.attempts WHERE kind = 'submit'") == 1


async def test_a_late_receipt_after_the_deadline_is_applied_once(
    short: Env, fleet: InProcessFleet
) -> None:
    """A slow-but-alive participant: its receipt arrives after outcome_unknown and is
    applied once; the instance resumes and completes."""
    fleet.start_all(participants=("payments", "shipping"))
    await publish_starts(short.settings, [order(1)])
    await until_status(short, "reserve", "outcome_unknown")
    fleet.start("inventory")  # wakes up late and works through its queue

    async def completed() -> bool:
        return (
            await short.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
            == 1
        )

    await wait_until(completed, what="the instance to complete with the late receipt")
    assert (
        await short.scalar(
            "SELECT count(*) FROM participant_inventory.reservations", participant=True
        )
        == 1
    )
    assert (
        await short.scalar(
            "SELECT count(*) FROM custody.history WHERE event = 'operation.succeeded'"
        )
        == 3
    )


async def test_a_retryable_failure_with_effect_none_is_retried_as_a_new_attempt(
    short: Env, fleet: InProcessFleet
) -> None:
    """ "retry-safe requires authoritative RetryWaiting with effect none. It retains the
    operation/input identity while creating the allowed new attempt and command"; the
    node's retry policy takes the same path automatically."""
    fleet.start_all()
    await publish_starts(short.settings, [order(1, flaky=True)])

    async def completed() -> bool:
        return (
            await short.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
            == 1
        )

    await wait_until(completed, what="the flaky charge to succeed on attempt 2")
    attempts = await short.sql(
        "SELECT a.attempt, a.request_id::text, a.digest FROM custody.attempts a"
        " JOIN custody.operations o ON o.id = a.operation_id"
        " WHERE o.node = 'charge' AND a.kind = 'submit' ORDER BY a.attempt"
    )
    assert [a for a, _, _ in attempts] == [1, 2]
    assert attempts[0][1] != attempts[1][1] and attempts[0][2] != attempts[1][2]
    assert await status_of(short, "charge") == ("succeeded", "applied", 2, "completed")
    assert (
        await short.scalar("SELECT count(*) FROM participant_payments.charges", participant=True)
        == 1
    )
    history = [
        e
        for (e,) in await short.sql(
            "SELECT h.event FROM custody.history h"
            " JOIN custody.operations o ON o.id = h.operation_id"
            " WHERE o.node = 'charge' ORDER BY h.id"
        )
    ]
    assert "operation.retry_waiting" in history and history[-1] == "operation.succeeded"


async def test_retry_safe_is_refused_unless_retry_waiting_with_effect_none(
    short: Env, fleet: InProcessFleet
) -> None:
    """ "Unknown effects cannot become success through an operator assertion or blind
    replay": retry-safe on outcome_unknown is refused (exit 3), audited, and creates
    nothing; an unknown operation is exit 4; no command sets succeeded."""
    fleet.start_all(participants=())
    await publish_starts(short.settings, [order(1)])
    await until_status(short, "reserve", "outcome_unknown")
    oid = await op_id(short, "reserve")
    refused = await custody(short, "retry-safe", oid, "--reason", "please just run it again")
    assert refused.returncode == 3
    assert "retry_waiting with effect none" in refused.stderr
    missing = await custody(
        short, "retry-safe", "00000000-0000-4000-8000-000000000000", "--reason", "no such operation"
    )
    assert missing.returncode == 4
    assert await short.scalar("SELECT count(*) FROM custody.attempts") == 1
    assert await status_of(short, "reserve") == ("outcome_unknown", "unknown", 1, "suspended")
    audit = await short.sql("SELECT action, outcome FROM custody.audit ORDER BY id")
    assert audit == [("retry-safe", "refused"), ("retry-safe", "not_found")]
    commands = (await custody(short, "--help")).stdout
    assert "succeed" not in commands and "replay" not in commands


async def test_operator_retry_safe_from_retry_waiting_creates_attempt_two(
    env: Env, tmp_path: Path
) -> None:
    """The operator's retry-safe (here the policy's backoff is an hour) goes through
    the same path: attempt n+1, same operation id and input, a new command."""
    env.settings = dataclasses.replace(
        env.settings,
        processes_dir=str(processes.write(tmp_path / "p", deadline_s=30, retry_backoff_s=3600)),
    )
    fleet = InProcessFleet(env)
    fleet.start_all()
    try:
        await publish_starts(env.settings, [order(1, flaky=True)])
        await until_status(env, "charge", "retry_waiting")
        oid = await op_id(env, "charge")
        done = await custody(
            env, "retry-safe", oid, "--reason", "gateway is back, retrying", "--json"
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["attempt"] == 2
        await until_status(env, "charge", "succeeded")
        # the submits actually sent, not the operation row read twice: same operation,
        # input, lineage and target; attempt, request id and digest are new
        rows = await env.sql(
            "SELECT body FROM custody.outbox WHERE operation_id = %s AND kind = 'submit'"
            " ORDER BY created_at, id",
            (oid,),
        )
        first, second = (codec.decode_command(bytes(b)) for (b,) in rows)
        same = ("tenant", "operation_id", "operation", "input", "lineage", "target")
        assert [getattr(second, f) for f in same] == [getattr(first, f) for f in same]
        assert (first.attempt, second.attempt) == (1, 2)
        assert second.request_id == json.loads(done.stdout)["request_id"] != first.request_id
        assert isinstance(second, SubmitCommand)
        assert second.digest == second.semantic_digest() != first.digest
        assert (
            await env.scalar("SELECT count(*) FROM participant_payments.charges", participant=True)
            == 1
        )
    finally:
        await fleet.stop_all()


@pytest.mark.parametrize(
    ("actor", "args", "why"),
    [
        ("mallory", ["--reason", "I want to"], "is not an operator"),
        ("auditor", ["--reason", "looking around"], "may not reconcile"),
        ("oncall", ["--reason", "x"], "reason of at least"),
    ],
    ids=["not-an-operator", "no-permission", "no-reason"],
)
async def test_operator_commands_are_authorized_and_every_refusal_is_audited(
    short: Env, fleet: InProcessFleet, actor: str, args: list[str], why: str
) -> None:
    """Operator commands check the roles file (who may do what, per tenant); refused
    commands change nothing and leave an audit row."""
    fleet.start_all(participants=())
    await publish_starts(short.settings, [order(1)])
    await until_status(short, "reserve", "outcome_unknown")
    oid = await op_id(short, "reserve")
    result = await custody(short, "reconcile", oid, *args, actor=actor)
    assert result.returncode == 3
    assert why in result.stderr
    assert await status_of(short, "reserve") == ("outcome_unknown", "unknown", 1, "suspended")
    [(who, outcome)] = await short.sql("SELECT actor, outcome FROM custody.audit")
    assert (who, outcome) == (actor, "refused")


async def test_tenant_scoped_operators_cannot_act_on_other_tenants(
    short: Env, fleet: InProcessFleet
) -> None:
    """acme-support may reconcile acme's operations, not globex's."""
    fleet.start_all(participants=())
    await publish_starts(short.settings, [order(1)], tenant="globex")
    await until_status(short, "reserve", "outcome_unknown")
    oid = await op_id(short, "reserve")
    result = await custody(
        short, "reconcile", oid, "--reason", "support ticket 123", actor="acme-support"
    )
    assert result.returncode == 3 and "tenant 'globex'" in result.stderr


async def test_dispatch_pause_holds_effect_dispatch_and_resume_releases_it(
    short: Env, fleet: InProcessFleet
) -> None:
    """Global and per-instance pause hold submits in the outbox (nothing reaches a
    participant); resume releases them; both are audited."""
    fleet.start_all()
    assert (
        await custody(short, "dispatch", "pause", "--reason", "maintenance window")
    ).returncode == 0
    await publish_starts(short.settings, [order(1)])

    async def created() -> bool:
        return await short.scalar("SELECT count(*) FROM custody.outbox") == 1

    await wait_until(created, what="the first command in the outbox")
    ready = await short.scalar("SELECT count(*) FROM custody.outbox WHERE status = 'pending'")
    assert ready == 1
    assert await status_of(short, "reserve") == ("pending", "unknown", 1, "running")
    assert (
        await custody(short, "dispatch", "resume", "--reason", "maintenance is over")
    ).returncode == 0
    await until_status(short, "ship", "succeeded")

    # the next two submits wait in the outbox: no publisher, and a committer held by the
    # start-up switch (it sends the submits it commits otherwise)
    for name in ("publisher", "committer"):
        await fleet.stop(next(r for r in fleet.running if r.name == name))
    committer = fleet.start("committer", dataclasses.replace(short.settings, dispatch_paused=True))
    held, _free = await publish_starts(short.settings, [order(2), order(3)])

    async def started() -> bool:
        return await short.scalar("SELECT count(*) FROM custody.instances") == 3

    await wait_until(started, what="two more instances")
    instance = await short.scalar(
        "SELECT id::text FROM custody.instances WHERE start_request_id = %s", (held,)
    )
    paused = await custody(
        short, "dispatch", "pause", "--instance", instance, "--reason", "customer asked to hold"
    )
    assert paused.returncode == 0, paused.stderr
    await fleet.stop(committer)
    fleet.start("committer")
    fleet.start("publisher")

    async def other_done() -> bool:
        return (
            await short.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
            == 2
        )

    await wait_until(other_done, what="the unpaused instance to complete")
    held_ops = await short.sql(
        "SELECT o.status::text, x.status FROM custody.operations o"
        " JOIN custody.outbox x ON x.operation_id = o.id"
        " WHERE o.instance_id = %s",
        (instance,),
    )
    assert held_ops == [("pending", "pending")]
    audit = await short.sql("SELECT action, outcome FROM custody.audit ORDER BY id")
    assert audit == [("pause", "done"), ("resume", "done"), ("pause", "done")]
