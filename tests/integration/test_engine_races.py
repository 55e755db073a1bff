"""The engine's race windows, forced at an exact step instead of hoped for.

Each test runs the real workers in-process and makes a second actor (the operator CLI
as its own process, or a participant's broker user) commit in the middle of a
worker's unit of work, through a fault-point hook (``workers.runtime.faults.set_hook``). A
hook never waits for the other actor to finish: it waits until that actor either
finished or is blocked on a lock the unit holds, so the test passes only where the
unit and the actor are serialised by the database.

The seed: "Cancellation is a request to settle work consistently with the executor's
durable state."
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from contracts import codec, identity
from contracts.models import CancelRequest
from tests.conftest import DEV_PASSWORD, MGMT, Env, wait_until
from tests.harness import InProcessFleet, order, publish_raw, publish_starts
from tests.integration.test_recovery import custody, env_vars
from workers.core import process
from workers.io import broker, db
from workers.participant import retention
from workers.runtime import faults
from workers.settings import ROOT

TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
async def fleet(env: Env) -> AsyncIterator[InProcessFleet]:
    f = InProcessFleet(env)
    yield f
    for name in faults.POINTS:
        faults.set_hook(name, None)
    await f.stop_all()


class Cli:
    """The operator CLI started as its own process (its own database session)."""

    def __init__(self, env: Env, *args: str) -> None:
        self.env = env
        self.args = args
        self.proc: asyncio.subprocess.Process | None = None
        self.stdout = ""
        self.stderr = ""

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "workers.cli",
            *self.args,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **env_vars(self.env)},
        )

    async def finished_or_blocked(self, timeout: float = 20) -> str:
        """'finished' once the command exited, 'blocked' once its session waits on a
        lock (held by the unit of work under test)."""
        assert self.proc is not None
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if self.proc.returncode is not None:
                return "finished"
            waiting = await self.env.scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                " AND application_name = 'custody-cli' AND wait_event_type = 'Lock'",
                (self.env.engine_db,),
            )
            if waiting:
                return "blocked"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 0.05)
        raise AssertionError(f"custody {' '.join(self.args)} neither finished nor blocked")

    async def result(self) -> int:
        assert self.proc is not None
        out, err = await asyncio.wait_for(self.proc.communicate(), 60)
        self.stdout, self.stderr = out.decode(), err.decode()
        assert self.proc.returncode is not None
        return self.proc.returncode


def once_at(calls: int, action: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """A hook that runs ``action`` the ``calls``-th time its point is reached."""
    seen = 0

    async def hook() -> None:
        nonlocal seen
        seen += 1
        if seen == calls:
            await action()

    return hook


async def the_instance(env: Env) -> str:
    return str(await env.scalar("SELECT id::text FROM custody.instances"))


async def settled(env: Env, iid: str, status: str) -> None:
    async def done() -> bool:
        rows = await env.sql(
            "SELECT i.status::text, count(o.id) FILTER (WHERE o.status::text <> ALL(%s))"
            " FROM custody.instances i LEFT JOIN custody.operations o ON o.instance_id = i.id"
            " WHERE i.id = %s GROUP BY i.status",
            (list(TERMINAL), iid),
        )
        return rows == [(status, 0)]

    await wait_until(done, timeout=30, what=f"instance {status} with every operation settled")


async def effects(env: Env, schema: str, table: str) -> int:
    return int(
        await env.scalar(f"SELECT count(*) FROM participant_{schema}.{table}", participant=True)
    )


# where a successor is activated: by the committer's claim of its intent (the receipt
# consumer told to leave every intent to it), or in the receipt's own transaction; the
# point inside that transaction where the instance is already locked
ACTIVATORS = {"committer": "successor_claimed", "receipts": "receipts_locked"}


def _activated_by(env: Env, activator: str) -> None:
    if activator == "committer":
        env.settings = dataclasses.replace(env.settings, receipts_activate=False)


async def _raced_in(env: Env, iid: str, activator: str) -> None:
    """The race ran against the activator under test: the nodes after the first were
    activated by it (the hook's point is inside its transaction)."""
    actors = await env.sql(
        "SELECT DISTINCT actor FROM custody.history WHERE instance_id = %s"
        " AND event = 'node.activated' AND detail->>'node' <> 'reserve'",
        (iid,),
    )
    assert actors in ([], [(activator,)]), actors


@pytest.mark.parametrize("activator", list(ACTIVATORS))
async def test_a_cancel_committing_while_a_successor_is_activated_gets_no_new_work_behind_it(
    env: Env, fleet: InProcessFleet, activator: str
) -> None:
    """The seed: "Cancellation is a request to settle work consistently with the
    executor's durable state." A cancel that commits while the committer, or the receipt
    consumer, is inside the transaction that activates the next node must be serialised
    with it: either the new operation exists before the cancel (and the cancel settles
    it), or the activation sees the cancel and creates nothing. No node is activated
    after the instance's cancellation committed, and every effect is one the engine
    knows."""
    _activated_by(env, activator)
    fleet.start_all()
    cancel: list[Cli] = []

    async def cancel_now() -> None:
        cli = Cli(env, "cancel", await the_instance(env), "--reason", "customer withdrew")
        await cli.start()
        cancel.append(cli)
        await cli.finished_or_blocked()

    faults.set_hook(ACTIVATORS[activator], once_at(1, cancel_now))  # reserve -> charge
    await publish_starts(env.settings, [order(1)])
    await wait_until(lambda: _true(cancel), what="the cancel raced the activation")
    assert await cancel[0].result() == 0, cancel[0].stderr
    iid = await the_instance(env)
    await settled(env, iid, "cancelled")

    events = await env.sql(
        "SELECT id, event, detail->>'node' FROM custody.history WHERE instance_id = %s ORDER BY id",
        (iid,),
    )
    [cancelling] = [i for i, e, _ in events if e == "instance.cancelling"]
    late = [(e, n) for i, e, n in events if e == "node.activated" and i > cancelling]
    assert late == [], f"work created after the cancellation committed: {late}"
    await _raced_in(env, iid, activator)
    charged = await effects(env, "payments", "charges")
    succeeded = await env.scalar(
        "SELECT count(*) FROM custody.operations WHERE node = 'charge' AND status = 'succeeded'"
    )
    assert charged == succeeded, "every charge is one the engine holds as succeeded"


@pytest.mark.parametrize("activator", list(ACTIVATORS))
async def test_an_end_node_racing_a_cancel_leaves_one_terminal_instance_event(
    env: Env, fleet: InProcessFleet, activator: str
) -> None:
    """The seed: "Cancellation is a request to settle work consistently with the
    executor's durable state." The last node's successor (@completed), taken by the
    committer or by the receipt consumer, and a cancel race: exactly one of them decides
    the instance, and its history says the same (no ``instance.completed`` row for an
    instance that ended cancelled)."""
    _activated_by(env, activator)
    fleet.start_all()
    cancel: list[Cli] = []

    async def cancel_now() -> None:
        cli = Cli(env, "cancel", await the_instance(env), "--reason", "too late to matter")
        await cli.start()
        cancel.append(cli)
        await cli.finished_or_blocked()

    faults.set_hook(ACTIVATORS[activator], once_at(3, cancel_now))  # ship -> @completed
    await publish_starts(env.settings, [order(1)])
    await wait_until(lambda: _true(cancel), timeout=30, what="the cancel raced the end node")
    code = await cancel[0].result()
    iid = await the_instance(env)

    async def ended() -> bool:
        status = await env.scalar("SELECT status::text FROM custody.instances")
        return status in ("completed", "cancelled")

    await wait_until(ended, what="the instance to end")
    status = await env.scalar("SELECT status::text FROM custody.instances")
    finals = [
        e
        for (e,) in await env.sql(
            "SELECT event FROM custody.history WHERE instance_id = %s AND event = ANY(%s)"
            " ORDER BY id",
            (iid, ["instance.completed", "instance.failed", "instance.cancelled"]),
        )
    ]
    assert finals == [f"instance.{status}"], finals
    if status == "completed":
        assert code == 3 and "already completed" in cancel[0].stderr, cancel[0].stderr
    await _raced_in(env, iid, activator)


async def test_cancel_start_under_another_spelling_of_the_id_is_serialised_with_the_start(
    env: Env, fleet: InProcessFleet
) -> None:
    """The seed: "The same principle applies to an authorized cancellation of a start
    request before an instance exists." The operator types the start request id in
    upper case with braces while the start is being committed: the cancel takes the
    same lock as the start (ids are canonical at the edge), so it is never told
    "tombstoned" while the start goes on to run."""
    fleet.start_all(participants=())
    start_id = str(uuid.uuid4())
    cancel: list[Cli] = []

    async def cancel_now() -> None:
        spelled = "{" + start_id.upper() + "}"
        cli = Cli(env, "cancel-start", spelled, "--tenant", "acme", "--reason", "withdrawn")
        cli.args = (*cli.args, "--json")
        await cli.start()
        cancel.append(cli)
        await cli.finished_or_blocked()

    faults.set_hook("starts_locked", once_at(1, cancel_now))
    await publish_starts(env.settings, [order(1)], start_request_ids=[start_id])
    await wait_until(lambda: _true(cancel), what="the cancel-start raced the start")
    assert await cancel[0].result() == 0, cancel[0].stderr
    said = json.loads(cancel[0].stdout)

    async def start_decided() -> bool:
        # the start's unit has committed: an instance, or the late start recorded
        return bool(
            await env.sql(
                "SELECT 1 FROM custody.instances UNION ALL"
                " SELECT 1 FROM custody.start_tombstones WHERE late_start_at IS NOT NULL"
            )
        )

    await wait_until(start_decided, what="the start to commit one way or the other")
    instances = await env.sql("SELECT id::text FROM custody.instances")
    if said.get("tombstoned"):
        assert instances == [], "told tombstoned, yet the start created an instance"
    else:
        assert len(instances) == 1
        assert await env.scalar("SELECT status::text FROM custody.instances") == "cancelling"
    assert await env.scalar("SELECT count(*) FROM custody.start_tombstones") == (
        1 if said.get("tombstoned") else 0
    )


def test_an_id_has_one_canonical_spelling() -> None:
    """Every spelling uuid accepts maps to the one the wire and the database use."""
    raw = "6F6B9D8E-2A55-4C1E-9A51-637573746F64"
    want = raw.lower()
    for spelling in (raw, "{" + raw + "}", "urn:uuid:" + raw, raw.replace("-", ""), f" {want} "):
        assert identity.canonical(spelling) == want
    assert identity.canonical("not-a-uuid") is None


async def test_a_cancelled_operations_held_submit_is_never_sent_even_after_participant_retention(
    env: Env, fleet: InProcessFleet
) -> None:
    """The seed: "Cancellation before acceptance also requires a durable record.
    Otherwise a delayed command could arrive after an apparently successful
    cancellation and still execute." The submit is held (dispatch paused) while the
    operation is cancelled at the participant (a tombstone); the participant's
    retention later forgets the tombstone; dispatch resumes. The submit of the
    cancelled operation is retired, never dispatched, and nothing executes."""
    fleet.start_all()
    paused = await custody(env, "dispatch", "pause", "--reason", "maintenance")
    assert paused.returncode == 0, paused.stderr
    await publish_starts(env.settings, [order(1)])

    async def created() -> bool:
        return await env.scalar("SELECT count(*) FROM custody.operations") == 1

    await wait_until(created, what="the first operation, its submit held")
    iid = await the_instance(env)
    cancelled = await custody(env, "cancel", iid, "--reason", "customer withdrew")
    assert cancelled.returncode == 0, cancelled.stderr
    await settled(env, iid, "cancelled")

    inventory = db.Database(
        env.settings.participant_database_url, schema="participant_inventory", name="test"
    )
    await inventory.open()
    try:
        removed = await retention.cleanup(inventory, 0)
    finally:
        await inventory.close()
    assert removed["inbox"] == 1, "the tombstone is gone from the participant"

    resumed = await custody(env, "dispatch", "resume", "--reason", "maintenance over")
    assert resumed.returncode == 0, resumed.stderr
    await publish_starts(env.settings, [order(2)])  # the publisher claims many times

    async def second_done() -> bool:
        return (
            await env.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
            == 1
        )

    await wait_until(second_done, what="a later instance to complete")
    [(status, published)] = await env.sql(
        "SELECT b.status, b.published_at IS NOT NULL FROM custody.outbox b"
        " JOIN custody.operations o ON o.id = b.operation_id"
        " WHERE o.instance_id = %s AND b.kind = 'submit'",
        (iid,),
    )
    assert (status, published) == ("retired", False)
    assert await effects(env, "inventory", "reservations") == 1, "only the second order's"
    retired = await env.scalar(
        "SELECT count(*) FROM custody.history WHERE instance_id = %s AND event = 'command.retired'",
        (iid,),
    )
    assert retired == 1


async def _true(box: list[Any]) -> bool:
    return bool(box)


# --- one bad definition never stops the committer or the receipts worker ---------------


def _definitions(directory: Path, *versions: int, deadline_s: int = 60) -> str:
    """order-fulfilment at the given versions (the same graph), nothing else."""
    text = (ROOT / "deploy" / "processes" / "order-fulfilment.v1.toml").read_text()
    text = text.replace("deadline_seconds = 60", f"deadline_seconds = {deadline_s}")
    directory.mkdir(parents=True, exist_ok=True)
    for v in versions:
        (directory / f"order-fulfilment.v{v}.toml").write_text(
            text.replace("version = 1", f"version = {v}")
        )
    return str(directory)


async def _instance_of(env: Env, order_id: str) -> tuple[str, str, int]:
    [row] = await env.sql(
        "SELECT id::text, status::text, process_version FROM custody.instances"
        " WHERE input->>'order_id' = %s",
        (order_id,),
    )
    return row


async def _until_instance(env: Env, order_id: str, status: str, timeout: float = 30) -> None:
    async def reached() -> bool:
        rows = await env.sql(
            "SELECT status::text FROM custody.instances WHERE input->>'order_id' = %s",
            (order_id,),
        )
        return rows == [(status,)]

    await wait_until(reached, timeout=timeout, what=f"{order_id} {status}")


async def _first_dispatched(env: Env) -> None:
    async def dispatched() -> bool:
        return (
            await env.scalar("SELECT count(*) FROM custody.operations WHERE status = 'dispatched'")
            == 1
        )

    await wait_until(dispatched, what="the first operation dispatched")


async def test_a_missing_pinned_version_suspends_its_instance_in_the_committer_and_resumes(
    env: Env, fleet: InProcessFleet, tmp_path: Path
) -> None:
    """The seed: "Instances pin the route and binding used for their operations" — and
    their definition version. A committer whose deployment lacks an instance's pinned
    version does not crash or redirect it to another version: the instance is
    suspended with the reason (an alert), every other instance goes on, and once the
    version is loaded again the suspended instance resumes by itself."""
    v1, v2, both = (
        _definitions(tmp_path / "v1", 1),
        _definitions(tmp_path / "v2", 2),
        _definitions(tmp_path / "both", 1, 2),
    )
    s = env.settings
    for w in ("committer", "publisher", "receipts", "reconciler"):
        fleet.start(w, dataclasses.replace(s, processes_dir=v1))
    await publish_starts(s, [order(1)])  # pins version 1
    await _first_dispatched(env)
    await fleet.stop_all()

    fleet.start("committer", dataclasses.replace(s, processes_dir=v2, definition_retry_s=0.5))
    # the receipt consumer leaves every successor to the committer (one that activates
    # successors itself, holding the version, would activate this one)
    for w in ("publisher", "receipts", "reconciler"):
        fleet.start(w, dataclasses.replace(s, processes_dir=both, receipts_activate=False))
    fleet.start_all(engine=())
    await _until_instance(env, "order-00001", "suspended")
    [(reason,)] = await env.sql("SELECT suspended_reason FROM custody.instances")
    assert reason == "definition_missing"
    await publish_starts(s, [order(2)])  # version 2: unaffected
    await _until_instance(env, "order-00002", "completed")
    fleet.check_alive()
    assert (await _instance_of(env, "order-00001"))[1:] == ("suspended", 1)

    committer = next(r for r in fleet.running if r.name == "committer")
    await fleet.stop(committer)
    fleet.start("committer", dataclasses.replace(s, processes_dir=both, definition_retry_s=0.5))
    await _until_instance(env, "order-00001", "completed")
    iid = (await _instance_of(env, "order-00001"))[0]
    events = [
        e
        for (e,) in await env.sql(
            "SELECT event FROM custody.history WHERE instance_id = %s"
            " AND event LIKE 'instance.%%' ORDER BY id",
            (iid,),
        )
    ]
    assert events == [
        "instance.started",
        "instance.suspended",
        "instance.resumed",
        "instance.completed",
    ]
    assert await effects(env, "payments", "charges") == 2


async def test_a_missing_pinned_version_in_the_receipts_worker_quarantines_and_recovers(
    env: Env, fleet: InProcessFleet, tmp_path: Path
) -> None:
    """A receipt for an instance whose pinned version the receipts worker does not hold
    is not a poison message: it is kept in quarantine with the reason
    ``definition_missing``, the instance is suspended, nothing is dead-lettered, the
    worker keeps applying every other receipt; reconcile recovers it once the version
    is back ("Query results pass through the same receipt validation path")."""
    v1 = _definitions(tmp_path / "v1", 1, deadline_s=3)
    v2 = _definitions(tmp_path / "v2", 2, deadline_s=3)
    both = _definitions(tmp_path / "both", 1, 2, deadline_s=3)
    s = env.settings
    for w in ("committer", "publisher", "receipts", "reconciler"):
        fleet.start(w, dataclasses.replace(s, processes_dir=v1))
    await publish_starts(s, [order(1)])
    await _first_dispatched(env)
    await fleet.stop_all()

    for w in ("committer", "publisher", "receipts", "reconciler"):
        fleet.start(w, dataclasses.replace(s, processes_dir=v2))
    fleet.start_all(engine=())
    await _until_instance(env, "order-00001", "suspended")
    [(reason,)] = await env.sql("SELECT reason FROM custody.quarantine")
    assert reason == "definition_missing"
    await publish_starts(s, [order(2)])
    await _until_instance(env, "order-00002", "completed")
    fleet.check_alive()
    depths = await broker.queue_depths(MGMT, env.vhost)
    assert depths.get(broker.QUEUE_DEAD, 0) == 0

    await fleet.stop_all()
    env.settings = dataclasses.replace(s, processes_dir=both)
    fleet.start_all()

    async def unknown() -> bool:
        return bool(
            await env.sql("SELECT 1 FROM custody.operations WHERE status = 'outcome_unknown'")
        )

    await wait_until(unknown, what="the unanswered operation past its deadline")
    op = await env.scalar(
        "SELECT id::text FROM custody.operations WHERE status = 'outcome_unknown'"
    )
    asked = await custody(env, "reconcile", op, "--reason", "version 1 is deployed again")
    assert asked.returncode == 0, asked.stderr
    await _until_instance(env, "order-00001", "completed")
    assert await effects(env, "inventory", "reservations") == 2, "each reserved once"


def _with_a_bad_definition(catalog: process.Catalog) -> process.Catalog:
    """A definition that slipped past load-time validation (built directly): its
    second node's name is outside the contract's Name pattern, so activating it fails."""
    good = catalog.latest("order-fulfilment")
    reserve = dataclasses.replace(good.node("reserve"), on_succeeded="Bad Node")
    bad_node = dataclasses.replace(good.node("charge"), name="Bad Node")
    broken = process.Definition(
        name="broken-flow",
        version=1,
        start="reserve",
        nodes={"reserve": reserve, "Bad Node": bad_node},
    )
    starts_bad = process.Definition(
        name="broken-start",
        version=1,
        start="Bad Node",
        nodes={
            "Bad Node": dataclasses.replace(reserve, name="Bad Node", on_succeeded="@completed")
        },
    )
    return process.Catalog(
        {
            **catalog.definitions,
            ("broken-flow", 1): broken,
            ("broken-start", 1): starts_bad,
        }
    )


async def test_an_activation_that_fails_fails_that_instance_and_never_the_committer(
    env: Env, fleet: InProcessFleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bad process definition must not stop every tenant's work: a start that
    cannot be activated is quarantined with the reason, an instance whose next node
    cannot be activated fails with the reason, and the committer goes on."""
    real = process.load_config

    def load(settings: Any) -> tuple[Any, process.Catalog]:
        table, catalog = real(settings)
        return table, _with_a_bad_definition(catalog)

    monkeypatch.setattr(process, "load_config", load)
    fleet.start_all()
    await publish_starts(env.settings, [order(1)], process="broken-start")
    await publish_starts(env.settings, [order(2)], process="broken-flow")
    await publish_starts(env.settings, [order(3)])
    await _until_instance(env, "order-00003", "completed")
    await _until_instance(env, "order-00002", "failed")
    iid = (await _instance_of(env, "order-00002"))[0]
    [(detail,)] = await env.sql(
        "SELECT detail FROM custody.history WHERE instance_id = %s AND event = 'instance.failed'",
        (iid,),
    )
    assert detail["reason"] == "activation_failed" and detail["node"] == "Bad Node"

    async def quarantined() -> bool:
        return bool(
            await env.sql("SELECT 1 FROM custody.quarantine WHERE reason = 'activation_failed'")
        )

    await wait_until(quarantined, what="the unstartable start quarantined")
    assert await env.scalar("SELECT count(*) FROM custody.instances") == 2
    fleet.check_alive()


async def test_a_queued_cancel_request_for_a_running_instance_settles_it_under_the_committer_role(
    env: Env, fleet: InProcessFleet
) -> None:
    """The seed: "Cancellation is a request to settle work consistently with the
    executor's durable state." A ``custody.cancel.v1`` request from the queue, for an
    instance whose first operation is in flight, goes through the same cancel path as
    the CLI, under the committer's own database role (which must be allowed every
    write of that path, the retiring of the submit included): the operation becomes
    cancelling, its cancel is sent, the committer stays up."""
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
    [start] = await publish_starts(env.settings, [order(1)])
    await _first_dispatched(env)
    request = CancelRequest(
        tenant="acme", start_request_id=start, reason="withdrawn", requested_by="custody-frontend"
    )
    frontend = dataclasses.replace(
        env.settings,
        amqp_url=env.settings.amqp_url.replace("guest:guest", f"custody-frontend:{DEV_PASSWORD}"),
    )
    await publish_raw(
        frontend,
        broker.EXCHANGE_REQUESTS,
        broker.CANCEL_KEY,
        [codec.encode(request)],
        user_id="custody-frontend",
    )

    async def cancelling() -> bool:
        return await env.sql(
            "SELECT i.status::text, o.status::text FROM custody.instances i"
            " JOIN custody.operations o ON o.instance_id = i.id"
        ) == [("cancelling", "cancelling")]

    await wait_until(cancelling, what="the instance and its operation cancelling")
    sent = await env.scalar("SELECT count(*) FROM custody.outbox WHERE kind = 'cancel'")
    assert sent == 1
    fleet.check_alive()
