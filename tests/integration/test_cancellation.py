"""Cancellation races: cancelling, success wins, tombstones before acceptance and
before start.

The seed: "Cancellation is a request to settle work consistently with the executor's
durable state. Work with an unresolved effect remains Cancelling until authoritative
evidence resolves it. A success that wins the race remains Succeeded on the
operation, even when cancellation prevents further successors."
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from contracts import codec
from contracts.models import CancelRequest
from participants import samples
from tests.conftest import DEV_PASSWORD, MGMT, Env, wait_until
from tests.fixtures import processes
from tests.harness import InProcessFleet, client, order, publish_raw, publish_starts
from tests.integration.test_recovery import custody, purge, status_of, until_status
from workers.io import broker
from workers.participant import service
from workers.runtime import probes, supervisor


async def instance_of(env: Env, start_id: str) -> str:
    async def created() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM custody.instances WHERE start_request_id = %s", (start_id,)
            )
            == 1
        )

    await wait_until(created, what="the instance")
    return str(
        await env.scalar(
            "SELECT id::text FROM custody.instances WHERE start_request_id = %s", (start_id,)
        )
    )


async def instance_status(env: Env, iid: str) -> str:
    return str(await env.scalar("SELECT status::text FROM custody.instances WHERE id = %s", (iid,)))


async def until_instance(env: Env, iid: str, status: str) -> None:
    async def reached() -> bool:
        return await instance_status(env, iid) == status

    await wait_until(reached, what=f"instance {status}")


class Hold:
    """Hold a binding's commands back in the broker: they are routed to a holding queue
    instead of the participant's, until released into it (delayed delivery)."""

    def __init__(self, env: Env, binding: str) -> None:
        self.env = env
        self.binding = binding
        self.queue = f"held.{binding}"

    async def _bindings(self, hold: bool) -> None:
        async with client(self.env.settings) as amqp:
            channel = await amqp._connection().channel()
            held = await channel.declare_queue(self.queue, durable=True)
            target = await channel.get_queue(broker.command_queue(self.binding))
            if hold:
                await held.bind(broker.EXCHANGE_COMMANDS, self.binding)
                await target.unbind(broker.EXCHANGE_COMMANDS, self.binding)
            else:
                await target.bind(broker.EXCHANGE_COMMANDS, self.binding)
                await held.unbind(broker.EXCHANGE_COMMANDS, self.binding)
            await channel.close()

    async def __aenter__(self) -> Hold:
        await self._bindings(True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._bindings(False)

    async def depth(self) -> int:
        depths = await broker.queue_depths(MGMT, self.env.vhost)
        return depths.get(self.queue, 0)

    async def release(self) -> int:
        """Deliver what was held, late, to the participant's queue (same bytes)."""
        from tests.harness import drain

        held = await drain(self.env.settings, self.queue, timeout=1.0)
        await publish_raw(
            self.env.settings, broker.EXCHANGE_COMMANDS, self.binding, [d.body for d in held]
        )
        return len(held)


async def test_a_cancel_before_acceptance_leaves_a_tombstone_and_the_late_command_is_refused(
    env: Env, fleet: InProcessFleet
) -> None:
    """ "Cancellation before acceptance also requires a durable record. Otherwise a
    delayed command could arrive after an apparently successful cancellation and still
    execute." The command is really held back in the broker and delivered after the
    cancel: it is refused, never executed."""
    fleet.start_all()
    hold = Hold(env, "inventory.v1")
    async with hold:
        [start] = await publish_starts(env.settings, [order(1)])
        iid = await instance_of(env, start)
        await until_status(env, "reserve", "dispatched")

        async def held() -> bool:
            return await hold.depth() == 1

        await wait_until(held, timeout=15, what="the command held in the broker")
    done = await custody(env, "cancel", iid, "--reason", "customer cancelled the order")
    assert done.returncode == 0, done.stderr
    await until_instance(env, iid, "cancelled")
    assert await status_of(env, "reserve") == ("cancelled", "none", 1, "cancelled")
    assert await hold.release() == 1

    async def refused() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM participant_inventory.refused WHERE reason = 'tombstoned'",
                participant=True,
            )
            == 1
        )

    await wait_until(refused, what="the late command refused")
    assert (
        await env.scalar("SELECT count(*) FROM participant_inventory.tombstones", participant=True)
        == 1
    )
    assert (
        await env.scalar(
            "SELECT count(*) FROM participant_inventory.reservations", participant=True
        )
        == 0
    )
    assert await env.scalar("SELECT count(*) FROM custody.operations") == 1, "no successor"
    fleet.check_alive()


async def test_an_accepted_command_not_yet_executed_is_cancelled_with_effect_none(
    env: Env, fleet: InProcessFleet
) -> None:
    """A participant that has accepted but not completed tries the handler's
    cancellation hook; if the effect can still be prevented it answers cancelled,
    effect none, and the handler never runs."""
    gate = asyncio.Event()

    async def reserve_later(call: service.Call) -> Mapping[str, Any]:
        if not gate.is_set():
            raise RuntimeError("the warehouse system is not answering yet")  # deferred
        return await samples.reserve(call)

    fleet.start_all(participants=("payments", "shipping"))
    _start_custom(
        fleet, env, {"inventory.reserve": reserve_later, "inventory.release": samples.release}
    )
    [start] = await publish_starts(env.settings, [order(1)])
    iid = await instance_of(env, start)

    async def deferred() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM participant_inventory.inbox"
                " WHERE status = 'accepted' AND executions > 0",
                participant=True,
            )
            == 1
        )

    await wait_until(deferred, what="the command accepted, its handler deferred")
    assert (
        await custody(env, "cancel", iid, "--reason", "customer cancelled the order")
    ).returncode == 0
    await until_instance(env, iid, "cancelled")
    gate.set()
    assert await status_of(env, "reserve") == ("cancelled", "none", 1, "cancelled")
    assert (
        await env.scalar("SELECT status FROM participant_inventory.inbox", participant=True)
        == "cancelled"
    )
    assert (
        await env.scalar(
            "SELECT count(*) FROM participant_inventory.reservations", participant=True
        )
        == 0
    )


async def test_a_success_that_wins_the_race_stays_succeeded_and_no_successor_runs(
    env: Env, fleet: InProcessFleet
) -> None:
    """ "A success that wins the race remains Succeeded on the operation, even when
    cancellation prevents further successors." Here the effect can no longer be
    prevented (the cancel hook says so): the engine keeps cancelling until the
    success arrives, then the operation is succeeded and the instance cancelled."""
    gate = asyncio.Event()

    async def reserve_when_released(call: service.Call) -> Mapping[str, Any]:
        if not gate.is_set():
            raise RuntimeError("waiting for the warehouse")
        return await samples.reserve(call)

    async def too_late(call: service.Call) -> bool:
        return False  # the warehouse already picked the goods

    fleet.start_all(participants=("payments", "shipping"))
    _start_custom(
        fleet, env, {"inventory.reserve": reserve_when_released}, {"inventory.reserve": too_late}
    )
    [start] = await publish_starts(env.settings, [order(1)])
    iid = await instance_of(env, start)

    async def deferred() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM participant_inventory.inbox WHERE executions > 0",
                participant=True,
            )
            == 1
        )

    await wait_until(deferred, what="the command accepted, its handler deferred")
    assert (
        await custody(env, "cancel", iid, "--reason", "customer cancelled the order")
    ).returncode == 0
    await until_status(env, "reserve", "cancelling")
    gate.set()
    await until_instance(env, iid, "cancelled")
    assert await status_of(env, "reserve") == ("succeeded", "applied", 1, "cancelled")
    assert await env.scalar("SELECT count(*) FROM custody.operations") == 1, "no successor"
    assert (
        await env.scalar(
            "SELECT count(*) FROM participant_inventory.reservations", participant=True
        )
        == 1
    )


async def test_nothing_is_marked_cancelled_on_a_timeout(env: Env, tmp_path: Path) -> None:
    """Work with an unresolved effect remains Cancelling until authoritative evidence:
    with the executor silent, the deadline passes and the operation stays cancelling."""
    env.settings = dataclasses.replace(
        env.settings, processes_dir=str(processes.write(tmp_path / "p", deadline_s=1))
    )
    fleet = InProcessFleet(env)
    fleet.start_all(participants=())
    try:
        [start] = await publish_starts(env.settings, [order(1)])
        iid = await instance_of(env, start)
        await until_status(env, "reserve", "dispatched")
        assert (await custody(env, "cancel", iid, "--reason", "customer cancelled")).returncode == 0
        await until_status(env, "reserve", "cancelling")

        async def asked_again() -> bool:
            # the cancel's deadline passed and the reconciler asked again: silence is
            # neither an answer nor a cancellation
            n = await env.scalar("SELECT count(*) FROM custody.attempts WHERE kind = 'cancel'")
            return bool(n >= 2)

        await wait_until(asked_again, what="the deadline passed and the cancel asked again")
        await asyncio.sleep(0.5)  # a reconciler sweep (poll 0.2 s) has run since
        assert await status_of(env, "reserve") == ("cancelling", "unknown", 1, "cancelling")
    finally:
        await fleet.stop_all()


async def test_cancelling_a_start_before_its_instance_exists_makes_the_late_start_create_nothing(
    env: Env, fleet: InProcessFleet
) -> None:
    """ "The same principle applies to an authorized cancellation of a start request
    before an instance exists": a durable record; the late start creates nothing."""
    fleet.start_all()
    start_id = str(uuid.uuid4())
    done = await custody(
        env,
        "cancel-start",
        start_id,
        "--tenant",
        "acme",
        "--reason",
        "order withdrawn before it started",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    await publish_starts(env.settings, [order(1)], start_request_ids=[start_id])  # late

    async def seen() -> bool:
        return (
            await env.scalar(
                "SELECT late_start_at IS NOT NULL FROM custody.start_tombstones"
                " WHERE start_request_id = %s",
                (start_id,),
            )
            is True
        )

    await wait_until(seen, what="the late start recorded against the tombstone")
    assert await env.scalar("SELECT count(*) FROM custody.instances") == 0
    assert await env.scalar("SELECT count(*) FROM custody.operations") == 0
    [(actor, action, outcome)] = await env.sql("SELECT actor, action, outcome FROM custody.audit")
    assert (actor, action, outcome) == ("oncall", "cancel-start", "done")


async def test_cancel_requests_on_the_queue_are_authorized_as_their_broker_user(
    env: Env, fleet: InProcessFleet
) -> None:
    """Cancellation is authorized (roles file) and audited like every operator command:
    a cancel request is acted on as the delivery's broker-validated user_id."""
    fleet.start_all(participants=())
    await broker.management(
        MGMT, "PUT", "/api/users/custody-frontend", {"password": DEV_PASSWORD, "tags": ""}
    )
    await broker.management(
        MGMT,
        "PUT",
        f"/api/permissions/{env.vhost}/custody-frontend",
        {"configure": "^$", "write": "^custody\\.requests$", "read": "^$"},
    )
    stranger, allowed = str(uuid.uuid4()), str(uuid.uuid4())
    for start_id, user in ((stranger, "guest"), (allowed, "custody-frontend")):
        request = CancelRequest(
            tenant="acme", start_request_id=start_id, reason="withdrawn", requested_by=user
        )
        settings = (
            env.settings
            if user == "guest"
            else dataclasses.replace(
                env.settings,
                amqp_url=env.settings.amqp_url.replace(
                    "guest:guest", f"custody-frontend:{DEV_PASSWORD}"
                ),
            )
        )
        await publish_raw(
            settings,
            broker.EXCHANGE_REQUESTS,
            broker.CANCEL_KEY,
            [codec.encode(request)],
            user_id=user,
        )

    async def audited() -> bool:
        return await env.scalar("SELECT count(*) FROM custody.audit") == 2

    await wait_until(audited, what="both cancel requests audited")
    rows = await env.sql("SELECT actor, outcome FROM custody.audit ORDER BY id")
    assert sorted(rows) == [("custody-frontend", "done"), ("guest", "refused")]
    tombstoned = await env.sql("SELECT start_request_id::text FROM custody.start_tombstones")
    assert tombstoned == [(allowed,)]


async def test_cancellation_is_refused_for_an_operator_without_the_right(
    env: Env, fleet: InProcessFleet
) -> None:
    fleet.start_all(participants=())
    [start] = await publish_starts(env.settings, [order(1)])
    iid = await instance_of(env, start)
    result = await custody(env, "cancel", iid, "--reason", "just looking around", actor="auditor")
    assert result.returncode == 3 and "may not cancel" in result.stderr
    assert await instance_status(env, iid) == "running"
    assert await env.sql("SELECT actor, outcome FROM custody.audit") == [("auditor", "refused")]


def _start_custom(
    fleet: InProcessFleet,
    env: Env,
    handlers: Mapping[str, service.Handler],
    hooks: Mapping[str, service.CancelHook] | None = None,
) -> None:
    """The inventory participant with test handlers (and cancel hooks)."""
    from tests.harness import Running

    stop = supervisor.Stop(grace_s=10)
    me = service.Identity(
        owner="inventory", principal="custody-inventory", bindings=frozenset({"inventory.v1"})
    )
    coro = service.serve(
        me,
        handlers,
        env.participant_settings("inventory"),
        stop,
        probes.Health(),
        schema="participant_inventory",
        cancel_hooks=hooks,
    )
    fleet.running.append(Running("inventory", stop, asyncio.create_task(coro)))


async def test_a_cancel_whose_answer_is_lost_is_asked_again_and_settles(
    env: Env, tmp_path: Path
) -> None:
    """Found by the chaos soaks: the executor settled the cancel and its answer was lost
    in transit; the operation must not stay cancelling for ever. Past the cancel's
    deadline the reconciler asks again (the operation stays cancelling meanwhile), the
    executor answers with the receipt it holds, and the instance settles: "cancellation
    is a request to settle work consistently with the executor's durable state"."""
    env.settings = dataclasses.replace(
        env.settings, processes_dir=str(processes.write(tmp_path / "p", deadline_s=2))
    )
    fleet = InProcessFleet(env)
    fleet.start_all(participants=())  # the reserve is dispatched, nobody executes it yet
    try:
        [start] = await publish_starts(env.settings, [order(1)])
        iid = await instance_of(env, start)
        await until_status(env, "reserve", "dispatched")
        receipts = next(r for r in fleet.running if r.name == "receipts")
        await fleet.stop(receipts)  # the engine stops hearing from the participants
        assert (await custody(env, "cancel", iid, "--reason", "customer cancelled")).returncode == 0
        await until_status(env, "reserve", "cancelling")
        fleet.start("inventory")

        async def answered() -> bool:
            # the executor settled the cancel and every receipt it holds is sent
            settled = await env.scalar(
                "SELECT count(*) FROM participant_inventory.inbox WHERE status = 'cancelled'",
                participant=True,
            )
            unsent = await env.scalar(
                "SELECT count(*) FROM participant_inventory.outbox WHERE published_at IS NULL",
                participant=True,
            )
            return bool(settled == 1 and unsent == 0)

        await wait_until(answered, what="the participant's answer to the cancel sent")
        await purge(env, broker.QUEUE_RECEIPTS)  # and lost in transit
        fleet.start("receipts")
        await until_status(env, "reserve", "cancelled", timeout=30)
        assert await instance_status(env, iid) == "cancelled"
        resent = await env.scalar(
            "SELECT count(*) FROM custody.history WHERE event = 'operation.cancel_resent'"
        )
        assert resent >= 1
        effects = await env.scalar(
            "SELECT count(*) FROM participant_inventory.reservations", participant=True
        )
        assert effects == 0  # cancelled before it ran: no reservation, never one twice
    finally:
        await fleet.stop_all()
