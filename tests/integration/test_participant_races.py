"""Participant runtime races: repeated queries, concurrent replicas, slow handlers.

Real Postgres and RabbitMQ; the races are forced with barriers, never with sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, cast

import psycopg
import pytest

from contracts import codec, identity
from contracts.models import CancelCommand, OperationReceipt, QueryAnswer, QueryCommand
from participants import samples
from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, RoundTrips, Running, client, drain, publish_raw
from tests.integration.test_participant import _status, submit
from workers import errors
from workers.io import broker, db
from workers.participant import service
from workers.participant.service import Call
from workers.runtime import probes, supervisor
from workers.runtime.outbox import OutboxPublisher

SCHEMA = "participant_inventory"
ME = service.Identity(
    owner="inventory", principal="custody-inventory", bindings=frozenset({"inventory.v1"})
)


@pytest.fixture
async def inventory(env: Env) -> AsyncIterator[InProcessFleet]:
    f = InProcessFleet(env)
    f.start("inventory")
    yield f
    await f.stop_all()


def _database(env: Env, name: str) -> db.Database:
    """A connection pool as the inventory participant's role; ``name`` becomes the
    connection's application_name (``custody-<name>``)."""
    url = db.with_user(env.settings.participant_database_url, "custody_participant_inventory")
    return db.Database(url, schema=SCHEMA, name=name, min_size=1, max_size=2)


@contextlib.asynccontextmanager
async def _deliveries(env: Env, bodies: Sequence[bytes]) -> AsyncIterator[list[broker.Delivery]]:
    """Publish ``bodies`` to the inventory command queue and take them back as real
    broker deliveries (in publish order); acked on exit."""
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", list(bodies))
    async with (
        client(env.settings, "races") as amqp,
        amqp.consume([broker.command_queue("inventory.v1")], prefetch=100) as inbox,
    ):
        got = [await asyncio.wait_for(inbox.get(), 10) for _ in bodies]
        by_body = {d.body: d for d in got}
        try:
            yield [by_body[b] for b in bodies]
        finally:
            for d in got:
                await d.ack()


async def _accepted_together(env: Env, cmds: Sequence[Any]) -> None:
    """Accept ``cmds`` in one acceptance transaction of a seeding participant (no
    executor runs), so that an executor later claims them in one batch."""
    seed_db = _database(env, "inventory-seed")
    await seed_db.open()
    try:
        seeder = service.Participant(
            ME, samples.HANDLERS["inventory"], env.participant_settings("inventory"), seed_db
        )
        async with _deliveries(env, [codec.encode(c) for c in cmds]) as ds:
            assert await seeder.accept(ds) == ["accepted"] * len(cmds)
    finally:
        await seed_db.close()


class _Transactions:
    """Counts the transactions a database opens from now on (``n``)."""

    def __init__(self, database: db.Database) -> None:
        self.n = 0
        opened = database.transaction

        @contextlib.asynccontextmanager
        async def counted(*args: Any, **kwargs: Any) -> AsyncIterator[db.Tx]:
            self.n += 1
            async with opened(*args, **kwargs) as tx:
                yield tx

        database.transaction = counted  # type: ignore[method-assign]


class _Savepoints:
    """Counts the savepoints transactions open from now on (``n``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        opened = db.Tx.savepoint

        def counted(tx: db.Tx) -> Any:
            self.n += 1
            return opened(tx)

        monkeypatch.setattr(db.Tx, "savepoint", counted)


@contextlib.asynccontextmanager
async def _inline(
    env: Env, handlers: Mapping[str, service.Handler], inline: Collection[str]
) -> AsyncIterator[tuple[service.Participant, _Transactions]]:
    """A participant on its own database whose ``inline`` operations run in the
    acceptance transaction, and the count of the transactions it opens."""
    part_db = _database(env, "inventory-inline")
    await part_db.open()
    try:
        participant = service.Participant(
            ME, handlers, env.participant_settings("inventory"), part_db, inline=inline
        )
        yield participant, _Transactions(part_db)
    finally:
        await part_db.close()


async def _accept(env: Env, participant: service.Participant, cmds: Sequence[Any]) -> list[str]:
    """``cmds`` delivered and accepted in one batch; each one's decision."""
    async with _deliveries(env, [codec.encode(c) for c in cmds]) as ds:
        return await participant.accept(ds)


STOCK = f"SELECT available FROM {SCHEMA}.stock WHERE sku = 'sku-1'"


async def _outbox(env: Env) -> list[Any]:
    rows = await env.sql(f"SELECT body FROM {SCHEMA}.outbox", participant=True)
    return [codec.decode_receipt(bytes(r[0])) for r in rows]


def _about(cmd: Any, kind: Literal["query", "cancel"]) -> dict[str, Any]:
    """The fields a query or a cancel shares with the submit it is about."""
    return {
        "request_id": identity.request_id(cmd.operation_id, cmd.attempt, kind),
        "tenant": cmd.tenant,
        "operation_id": cmd.operation_id,
        "attempt": cmd.attempt,
        "operation": cmd.operation,
        "target": cmd.target,
        "digest": cmd.digest,
        "issued_at": datetime.now(UTC),
        "submit_request_id": cmd.request_id,
    }


def _query(cmd: Any) -> QueryCommand:
    return QueryCommand(**_about(cmd, "query"))


def _cancel(cmd: Any) -> CancelCommand:
    return CancelCommand(**_about(cmd, "cancel"), reason="customer cancelled the order")


# --- defect 5: a repeated query is answered again -------------------------------------


async def test_a_repeated_query_is_answered_again_with_the_latest_receipt(
    env: Env, inventory: InProcessFleet
) -> None:
    """ "A participant answers every query it receives, a repeated one included." The
    seed: "A restored engine can predate an effect that already committed elsewhere" and
    "Receipt retention and deduplication history must cover every permitted retry,
    replay and restore horizon": a restored engine re-issues a query under the same
    request id (query ids count from its attempts table); the participant, whose first
    answer was already published, must send the answer again — with its current latest
    receipt — or the engine's operation waits in reconcile_pending until its deadline."""
    cmd = submit()
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)])

    async def done() -> bool:
        return await _status(env, cmd.request_id) == "succeeded"

    await wait_until(done, what="the command to complete")
    await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=1.0)

    q = _query(cmd)
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(q)])
    [first] = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=2.0)
    answer = codec.decode_receipt(first.body)
    assert isinstance(answer, QueryAnswer)
    assert answer.receipt is not None and answer.receipt.status == "succeeded"

    async def published() -> bool:
        return (
            await env.scalar(
                f"SELECT status FROM {SCHEMA}.outbox WHERE id = %s",
                (answer.answer_id,),
                participant=True,
            )
            == "published"
        )

    await wait_until(published, what="the first answer marked published")

    # the same query again (after an engine restore): a new delivery, the same identity
    again_q = q.model_copy(update={"issued_at": datetime.now(UTC)})
    await publish_raw(
        env.settings,
        broker.EXCHANGE_COMMANDS,
        "inventory.v1",
        [codec.encode(again_q)],
        message_id=str(uuid.uuid4()),
    )
    again = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=2.0)
    inventory.check_alive()
    assert len(again) == 1, "the repeated query must be answered"
    second = codec.decode_receipt(again[0].body)
    assert isinstance(second, QueryAnswer)
    assert second.in_reply_to == q.request_id
    assert again[0].user_id == "custody-inventory"
    latest = await env.scalar(
        f"SELECT body FROM {SCHEMA}.receipts WHERE request_id = %s"
        " ORDER BY owner_revision DESC LIMIT 1",
        (cmd.request_id,),
        participant=True,
    )
    assert second.receipt == codec.decode_receipt(bytes(latest)), "the current latest receipt"


# --- defect 9: a concurrent conflicting (or duplicate) acceptance -------------------------


class HeldAcceptance(service.Participant):
    """A replica whose acceptance transaction, once its inbox insert is done, stays
    open until the test releases it (a barrier at a handler-free point)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.inside = asyncio.Event()
        self.release = asyncio.Event()

    async def _emit(
        self,
        tx: db.Tx,
        receipts: Sequence[OperationReceipt],
        answers: Sequence[QueryAnswer] = (),
        unjournaled: Sequence[OperationReceipt] = (),
        trace: Mapping[str, str | None] | None = None,
    ) -> service.Queued:
        if receipts and not self.inside.is_set():
            self.inside.set()
            await self.release.wait()
        return await super()._emit(tx, receipts, answers, unjournaled, trace)


async def _waiting_on_a_lock(env: Env, application: str) -> bool:
    n = await env.scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = %s AND wait_event_type = 'Lock'",
        (application,),
        participant=True,
    )
    return bool(n == 1)


async def _raced(
    env: Env, first: bytes, second: bytes, *, inline: Collection[str] = ()
) -> list[list[str]]:
    """Replica A accepts ``first`` and holds its transaction open once its inbox insert
    is done; replica B accepts ``second`` until its statement waits on A's row; then A
    commits. Returns A's and B's decisions."""
    settings = env.participant_settings("inventory")
    db_a, db_b = _database(env, "inventory-a"), _database(env, "inventory-b")
    await db_a.open()
    await db_b.open()
    a = HeldAcceptance(ME, samples.HANDLERS["inventory"], settings, db_a, inline=inline)
    b = service.Participant(ME, samples.HANDLERS["inventory"], settings, db_b)
    try:
        async with _deliveries(env, [first, second]) as [da, d_b]:
            accepted = asyncio.create_task(a.accept([da]))
            await asyncio.wait_for(a.inside.wait(), 10)
            raced = asyncio.create_task(b.accept([d_b]))
            await wait_until(
                lambda: _waiting_on_a_lock(env, "custody-inventory-b"),
                timeout=10,
                what="replica B's statement waiting on replica A's row",
            )
            a.release.set()
            return list(await asyncio.wait_for(asyncio.gather(accepted, raced), 10))
    finally:
        a.release.set()
        await db_a.close()
        await db_b.close()


@pytest.mark.parametrize("same_input", [False, True], ids=["changed-input", "same-input"])
async def test_two_replicas_accepting_one_identity_at_once_decide_from_the_insert(
    env: Env, same_input: bool
) -> None:
    """ "Reusing that identity with changed input conflicts", and "The same command
    identity with the same semantic input returns the existing receipt" — also when
    two replicas receive the identity at the same moment. Replica A's acceptance has
    inserted its inbox row and holds its transaction open; replica B's insert waits on
    that row; A commits. B must not report `accepted` for work it does not hold: with
    changed input it records the conflict and answers it, with the same input it is a
    duplicate and writes no receipt of its own."""
    cmd = submit()
    other = cmd
    if not same_input:
        other = cmd.model_copy(update={"input": {"order_id": "o-1", "sku": "sku-1", "quantity": 9}})
        other = other.model_copy(update={"digest": other.semantic_digest()})
    decided = await _raced(env, codec.encode(cmd), codec.encode(other))
    assert decided == [["accepted"], ["duplicate" if same_input else "conflict"]]
    conflicts = await env.sql(
        f"SELECT request_id::text, stored_digest, received_digest FROM {SCHEMA}.conflicts",
        participant=True,
    )
    out = await _outbox(env)
    accepted = [r for r in out if isinstance(r, OperationReceipt) and r.status == "accepted"]
    answers = [r for r in out if isinstance(r, OperationReceipt) and r.error is not None]
    assert len(accepted) == 1, "one accepted receipt, from the replica that holds the work"
    assert accepted[0].command_digest == cmd.digest
    if same_input:
        assert conflicts == []
        assert len(out) == 1
    else:
        assert conflicts == [(cmd.request_id, cmd.digest, other.digest)]
        assert [(r.status, r.error.code if r.error else None) for r in answers] == [
            ("rejected", "digest_conflict")
        ]
        assert answers[0].command_digest == other.digest
    assert (
        await env.scalar(
            f"SELECT digest FROM {SCHEMA}.inbox WHERE request_id = %s",
            (cmd.request_id,),
            participant=True,
        )
        == cmd.digest
    )


async def test_a_cancel_that_loses_the_race_to_its_submit_leaves_no_tombstone(env: Env) -> None:
    """ "Cancellation before acceptance also requires a durable record": the tombstone is
    that record, and it stands for a cancel that came first. Replica A's acceptance of
    the submit has inserted its inbox row and holds its transaction open (a paused or
    stalled replica); replica B receives the cancel, sees no row yet, and offers the
    cancel's inbox row, which waits on A's; A commits. The submit won: B answers with
    the real state, and leaves no tombstone beside the executed command (a tombstone
    says "refuse this command when it comes", which it no longer means)."""
    cmd = submit()
    # A runs the handler in its acceptance (inline): the command has executed when A
    # commits, so the cancel can no longer prevent it
    decided = await _raced(
        env, codec.encode(cmd), codec.encode(_cancel(cmd)), inline={"inventory.reserve"}
    )
    assert decided == [["accepted"], ["cancel"]]
    assert await _status(env, cmd.request_id) == "succeeded"
    tombstones = await env.scalar(
        f"SELECT count(*) FROM {SCHEMA}.tombstones WHERE request_id = %s",
        (cmd.request_id,),
        participant=True,
    )
    assert tombstones == 0, "the submit won: no record that it was cancelled first"
    cancelled = [r for r in await _outbox(env) if r.status == "cancelled"]
    assert cancelled == [], "answered with the real state, never cancelled"


# --- defect 11: a slow handler never blocks acceptance --------------------------------


@contextlib.asynccontextmanager
async def _serving(env: Env, handlers: Mapping[str, service.Handler]) -> AsyncIterator[None]:
    """The inventory participant's real runtime (consumer, executor, publisher) with
    test handlers, in this event loop."""
    stop = supervisor.Stop(grace_s=10)
    settings = env.participant_settings("inventory")
    settings = dataclasses.replace(
        settings,
        participant_database_url=db.with_user(
            settings.participant_database_url, "custody_participant_inventory"
        ),
    )
    run = Running(
        "inventory",
        stop,
        asyncio.create_task(
            service.serve(ME, handlers, settings, stop, probes.Health(), schema=SCHEMA)
        ),
    )
    try:
        yield
        assert not run.task.done(), f"the participant stopped: {run.task}"
    finally:
        stop.event.set()
        await asyncio.wait_for(run.task, 15)


async def test_a_slow_handler_does_not_block_acceptance_of_a_cancel_or_a_new_submit(
    env: Env,
) -> None:
    """Participant acceptance — "The executor retained a recoverable operation and its
    identity" — must never wait behind execution, while participant completion — "The
    business effect and terminal receipt are authoritative" — still commits once. A
    handler blocks; meanwhile a cancel for another claimed command of the same batch
    and a new submit arrive: both are accepted within seconds ("Cancellation is a
    request to settle work consistently with the executor's durable state": the other
    command had not started, so it is cancelled and never runs). Released, the slow
    handler's effect and terminal receipt commit exactly once."""
    gate = asyncio.Event()
    entered: list[str] = []

    async def gated_reserve(call: Call) -> Mapping[str, Any]:
        entered.append(call.request_id)
        await gate.wait()
        return await samples.reserve(call)

    one, two, late = submit(), submit(), submit()
    # one and two accepted in one transaction, so the executor claims them in one batch
    await _accepted_together(env, [one, two])

    async def op_status(cmd: Any) -> str | None:
        return await _status(env, cmd.request_id)

    async with _serving(env, {"inventory.reserve": gated_reserve}):
        try:

            async def blocked() -> bool:
                return len(entered) == 1

            await wait_until(blocked, timeout=15, what="the first handler to block")
            running = one if entered[0] == one.request_id else two
            waiting = two if running is one else one
            await publish_raw(
                env.settings,
                broker.EXCHANGE_COMMANDS,
                "inventory.v1",
                [codec.encode(_cancel(waiting)), codec.encode(late)],
            )

            async def accepted_meanwhile() -> bool:
                return (await op_status(waiting), await op_status(late)) == (
                    "cancelled",
                    "accepted",
                )

            await wait_until(
                accepted_meanwhile,
                timeout=5,
                what="the cancel and the new submit accepted while the handler is blocked",
            )
            assert entered == [running.request_id], "the slow handler is still running alone"
            assert await op_status(running) == "accepted"
            gate.set()

            async def settled() -> bool:
                return (await op_status(running), await op_status(late)) == (
                    "succeeded",
                    "succeeded",
                )

            await wait_until(settled, timeout=15, what="the released handlers to complete")
        finally:
            gate.set()  # before the participant stops: never leave its handler blocked

    assert sorted(entered) == sorted([running.request_id, late.request_id])
    assert await op_status(waiting) == "cancelled"
    for cmd, effects in ((running, 1), (waiting, 0), (late, 1)):
        assert (
            await env.scalar(
                f"SELECT count(*) FROM {SCHEMA}.reservations WHERE operation_id = %s",
                (cmd.operation_id,),
                participant=True,
            )
            == effects
        )
    journal = await env.sql(
        f"SELECT owner_revision, body FROM {SCHEMA}.receipts WHERE request_id = %s"
        " ORDER BY owner_revision",
        (running.request_id,),
        participant=True,
    )
    statuses = [(rev, codec.decode_receipt(bytes(body)).status) for rev, body in journal]
    assert statuses == [(1, "accepted"), (2, "succeeded")]
    [cancelled] = await env.sql(
        f"SELECT body FROM {SCHEMA}.receipts WHERE request_id = %s AND owner_revision = 2",
        (waiting.request_id,),
        participant=True,
    )
    assert codec.decode_receipt(bytes(cancelled[0])).status == "cancelled"


async def test_a_cancel_for_the_command_being_executed_is_answered_without_waiting(
    env: Env,
) -> None:
    """ "Work with an unresolved effect remains Cancelling until authoritative evidence
    resolves it" and "A success that wins the race remains Succeeded on the operation".
    A cancel for the very command whose handler is running cannot prevent its effect:
    acceptance does not wait for the handler, it answers with the current state (the
    latest receipt, `accepted`, sent again); the handler's success, committed with its
    effect, is the evidence that settles it."""
    gate = asyncio.Event()
    entered: list[str] = []

    async def gated_reserve(call: Call) -> Mapping[str, Any]:
        entered.append(call.request_id)
        await gate.wait()
        return await samples.reserve(call)

    cmd = submit()
    accepted_id = identity.receipt_id(cmd.request_id, 1)

    async def accepted_receipt_sends() -> int:
        rows = await env.sql(
            f"SELECT publish_attempts FROM {SCHEMA}.outbox WHERE id = %s AND status = 'published'",
            (accepted_id,),
            participant=True,
        )
        return int(rows[0][0]) if rows else 0

    async with _serving(env, {"inventory.reserve": gated_reserve}):
        try:
            await publish_raw(
                env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)]
            )

            async def running() -> bool:
                return entered == [cmd.request_id] and await accepted_receipt_sends() == 1

            await wait_until(running, timeout=15, what="the handler blocked, `accepted` sent")
            await publish_raw(
                env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(_cancel(cmd))]
            )

            async def answered() -> bool:
                return await accepted_receipt_sends() == 2

            await wait_until(
                answered, timeout=5, what="the cancel answered while the handler is blocked"
            )
            assert await _status(env, cmd.request_id) == "accepted"
            gate.set()

            async def succeeded() -> bool:
                return await _status(env, cmd.request_id) == "succeeded"

            await wait_until(succeeded, timeout=15, what="the released handler to complete")
        finally:
            gate.set()

    assert entered == [cmd.request_id]
    assert (
        await env.scalar(
            f"SELECT count(*) FROM {SCHEMA}.reservations WHERE operation_id = %s",
            (cmd.operation_id,),
            participant=True,
        )
        == 1
    )
    journal = await env.sql(
        f"SELECT owner_revision, body FROM {SCHEMA}.receipts WHERE request_id = %s"
        " ORDER BY owner_revision",
        (cmd.request_id,),
        participant=True,
    )
    statuses = [(rev, codec.decode_receipt(bytes(body)).status) for rev, body in journal]
    assert statuses == [(1, "accepted"), (2, "succeeded")], "no cancelled receipt"


async def test_a_transient_database_conflict_in_a_handler_is_retried_not_counted_as_a_failure(
    env: Env,
) -> None:
    """ "Participant completion: The business effect and terminal receipt are
    authoritative." A deadlock or a serialization failure inside a handler's
    transaction (two executors updating the same business rows) says nothing about
    the work: the effect was rolled back with it. It must not count as one of the
    handler's runs, nor after a few of them become a ``failed`` / ``handler_error``
    receipt that the engine would take as authoritative. The handler raises a
    deadlock more times than a failing handler is allowed to run, then succeeds: the
    operation succeeds, its effect is applied once, and no run was used up."""
    conflicts = {"left": service.MAX_EXECUTIONS + 2}

    async def conflicted_reserve(call: Call) -> Mapping[str, Any]:
        if conflicts["left"]:
            conflicts["left"] -= 1
            await call.tx.business(
                "DO $$ BEGIN RAISE EXCEPTION 'forced' USING ERRCODE = '40P01'; END $$"
            )
        return await samples.reserve(call)

    cmd = submit()
    async with _serving(env, {"inventory.reserve": conflicted_reserve}):
        await publish_raw(
            env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)]
        )

        async def settled() -> bool:
            return await _status(env, cmd.request_id) not in (None, "accepted")

        await wait_until(settled, timeout=20, what="the conflicted command to settle")
    assert conflicts["left"] == 0
    assert await _status(env, cmd.request_id) == "succeeded"
    assert (
        await env.scalar(
            f"SELECT executions FROM {SCHEMA}.inbox WHERE request_id = %s",
            (cmd.request_id,),
            participant=True,
        )
        == 0
    )
    assert (
        await env.scalar(
            f"SELECT count(*) FROM {SCHEMA}.reservations WHERE operation_id = %s",
            (cmd.operation_id,),
            participant=True,
        )
        == 1
    )


async def test_a_batch_of_fast_handlers_commits_in_a_few_transactions_each_effect_once(
    env: Env,
) -> None:
    """ "Participant completion: The business effect and terminal receipt are
    authoritative": each handler's effect commits together with its terminal receipt,
    and a handler that fails has neither (its savepoint is rolled back), while the
    others of its batch keep theirs. Fast handlers of one claimed batch share their
    commits (a commit per handler was the participant's largest cost per operation):
    40 commands accepted together complete in far fewer than 40 transactions."""
    cmds = [submit() for _ in range(40)]
    bad = cmds[7]

    async def reserve_or_fail(call: Call) -> Mapping[str, Any]:
        if call.request_id == bad.request_id:
            await samples.reserve(call)  # an effect, then a bug: both rolled back
            raise RuntimeError("a bug after the effect")
        return await samples.reserve(call)

    await _accepted_together(env, cmds)

    exec_db = _database(env, "inventory-exec")
    await exec_db.open()
    transactions = _Transactions(exec_db)
    try:
        executor = service.Participant(
            ME,
            {**samples.HANDLERS["inventory"], "inventory.reserve": reserve_or_fail},
            env.participant_settings("inventory"),
            exec_db,
        )
        assert await executor.execute() == len(cmds)
    finally:
        await exec_db.close()

    statuses = {c.request_id: await _status(env, c.request_id) for c in cmds}
    assert statuses.pop(bad.request_id) == "accepted", "the failing handler waits to run again"
    assert set(statuses.values()) == {"succeeded"}
    effects = await env.scalar(
        f"SELECT count(*) FROM {SCHEMA}.reservations WHERE operation_id = ANY(%s)",
        ([c.operation_id for c in cmds],),
        participant=True,
    )
    assert effects == len(cmds) - 1
    journaled = await env.scalar(
        f"SELECT count(*) FROM {SCHEMA}.receipts WHERE request_id = ANY(%s) AND owner_revision = 2",
        ([c.request_id for c in cmds],),
        participant=True,
    )
    assert journaled == len(cmds) - 1
    # the claim, then the handlers' transactions (each gathers up to 50 ms of handler
    # time, so a loaded machine needs a few); one per handler would be 41
    assert transactions.n <= 8, f"{transactions.n} transactions for {len(cmds)} handlers"


async def test_an_accepted_receipt_superseded_before_it_is_sent_is_not_sent(env: Env) -> None:
    """ "Workflow separates the intent to execute an operation from transport
    acceptance, participant acceptance and business completion. These facts may become
    visible at different times." An ``accepted`` receipt still waiting in the outbox
    when the terminal receipt commits says nothing the terminal one does not (its
    owner revision is higher, and the engine takes a terminal receipt without the
    accepted one: a lost ``accepted`` is ordinary). It is not sent — one broker message
    and one receipt application less per operation under load — but it stays in the
    participant's journal, so a query still sees the full history. An ``accepted``
    receipt already sent or being sent is left alone."""
    superseded, sent = submit(), submit()
    seed_db = _database(env, "inventory-seed")
    await seed_db.open()
    try:
        participant = service.Participant(
            ME, samples.HANDLERS["inventory"], env.participant_settings("inventory"), seed_db
        )
        async with _deliveries(env, [codec.encode(superseded), codec.encode(sent)]) as ds:
            assert await participant.accept(ds) == ["accepted", "accepted"]
        # the second one's accepted receipt went out before its handler ran
        await env.sql(
            f"UPDATE {SCHEMA}.outbox SET status = 'published', published_at = now() WHERE id = %s",
            (identity.receipt_id(sent.request_id, 1),),
            participant=True,
        )
        assert await participant.execute() == 2
    finally:
        await seed_db.close()
    rows = {
        str(r[0]): (r[1], r[2])
        for r in await env.sql(
            f"SELECT id, status, last_error FROM {SCHEMA}.outbox", participant=True
        )
    }
    accepted_id = identity.receipt_id(superseded.request_id, 1)
    assert rows[accepted_id][0] == "published", "superseded: never to be sent"
    assert "superseded" in (rows[accepted_id][1] or "")
    assert rows[identity.receipt_id(superseded.request_id, 2)] == ("pending", None)
    assert rows[identity.receipt_id(sent.request_id, 1)] == ("published", None)
    assert rows[identity.receipt_id(sent.request_id, 2)] == ("pending", None)
    journal = await env.sql(
        f"SELECT owner_revision FROM {SCHEMA}.receipts WHERE request_id = %s"
        " ORDER BY owner_revision",
        (superseded.request_id,),
        participant=True,
    )
    assert [r[0] for r in journal] == [1, 2]
    published = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=0.5)
    assert published == [], "nothing is published by the executor itself"


async def test_a_fast_handler_completes_in_its_acceptance_transaction(env: Env) -> None:
    """ "Participant acceptance: The executor retained a recoverable operation and its
    identity" and "Participant completion: The business effect and terminal receipt are
    authoritative" — two durable facts, which one transaction may make durable together
    before the ack. A participant that runs its (fast) handlers inline commits, for each
    new command, the inbox row, the effect and the terminal receipt in the acceptance
    transaction; no ``accepted`` receipt is made for it (it would be overtaken before it
    could be sent: said to no one), the terminal one is journaled and sent. A handler
    that fails with a bug stays accepted, its ``accepted`` receipt is sent, and the
    executor runs it later; a cancel in the same batch settles its command before any
    handler runs; a repeated command is answered from the journal and not run again."""
    ok, buggy, withdrawn = submit(), submit(), submit()
    runs: list[str] = []

    async def reserve(call: Call) -> Mapping[str, Any]:
        runs.append(call.request_id)
        if call.request_id == buggy.request_id:
            raise RuntimeError("a bug")
        return await samples.reserve(call)

    handlers = {**samples.HANDLERS["inventory"], "inventory.reserve": reserve}
    async with _inline(env, handlers, {"inventory.reserve"}) as (participant, _):
        cmds = [ok, buggy, withdrawn, _cancel(withdrawn)]
        assert await _accept(env, participant, cmds) == ["accepted"] * 3 + ["cancel"]
        assert await _accept(env, participant, [ok]) == ["duplicate"]

    assert sorted(runs) == sorted([ok.request_id, buggy.request_id]), "run once, cancel first"
    statuses = {c.request_id: await _status(env, c.request_id) for c in (ok, buggy, withdrawn)}
    assert statuses == {
        ok.request_id: "succeeded",
        buggy.request_id: "accepted",
        withdrawn.request_id: "cancelled",
    }
    pending = {
        str(r[0])
        for r in await env.sql(
            f"SELECT id FROM {SCHEMA}.outbox WHERE status = 'pending'", participant=True
        )
    }
    assert identity.receipt_id(ok.request_id, 2) in pending
    assert identity.receipt_id(ok.request_id, 1) not in pending, "accepted: never said"
    assert identity.receipt_id(buggy.request_id, 1) in pending, "still to run: say accepted"
    journal = await env.sql(
        f"SELECT owner_revision FROM {SCHEMA}.receipts WHERE request_id = %s"
        " ORDER BY owner_revision",
        (ok.request_id,),
        participant=True,
    )
    assert [r[0] for r in journal] == [2]
    assert (
        await env.scalar(
            f"SELECT count(*) FROM {SCHEMA}.reservations WHERE operation_id = ANY(%s)",
            ([ok.operation_id, buggy.operation_id, withdrawn.operation_id],),
            participant=True,
        )
        == 1
    )


async def test_a_handler_that_fails_after_it_wrote_leaves_no_effect_without_a_savepoint_of_its_own(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Participant completion: The business effect and terminal receipt are
    authoritative": a handler that fails leaves no effect, whether it failed before or
    after it wrote, and the others of its batch keep theirs, each once. Handlers run
    without a savepoint of their own (two statements per command): one that fails
    before writing had nothing to undo; one that fails after it wrote rolls back the
    whole acceptance transaction, which runs again at once with that operation's
    handlers in savepoints — for its next runs too, not for the other operations."""
    reserves = [submit() for _ in range(10)]
    releases = [submit(operation="inventory.release") for _ in range(4)]
    cmds = [*reserves[:5], *releases[:2], *reserves[5:], *releases[2:]]
    refused_early, refused_late = reserves[3], releases[1]

    async def reserve(call: Call) -> Mapping[str, Any]:
        if call.request_id == refused_early.request_id:
            raise service.BusinessFailure("out_of_stock", "refused before any write")
        return await samples.reserve(call)

    async def release(call: Call) -> Mapping[str, Any]:
        result = await samples.release(call)
        if call.request_id == refused_late.request_id:
            raise service.BusinessFailure("release_refused", "refused after its writes")
        return result

    savepoints = _Savepoints(monkeypatch)
    before = await env.scalar(STOCK, participant=True)
    handlers = {"inventory.reserve": reserve, "inventory.release": release}
    async with _inline(env, handlers, set(handlers)) as (participant, transactions):
        assert await _accept(env, participant, cmds) == ["accepted"] * len(cmds)
        assert transactions.n == 2, "the first run rolled back whole, the second committed"
        assert savepoints.n == len(releases), "a savepoint for each release of the second run"

        # the next batch: the releases keep their savepoints, the reserves go without
        more = [submit(), submit(operation="inventory.release"), submit()]
        savepoints.n = transactions.n = 0
        assert await _accept(env, participant, more) == ["accepted"] * len(more)
        assert (transactions.n, savepoints.n) == (1, 1)

    statuses = {c.request_id: await _status(env, c.request_id) for c in [*cmds, *more]}
    assert statuses.pop(refused_early.request_id) == "failed"
    assert statuses.pop(refused_late.request_id) == "failed"
    assert set(statuses.values()) == {"succeeded"}
    reserved = await env.scalar(
        f"SELECT count(*) FROM {SCHEMA}.reservations WHERE operation_id = ANY(%s)",
        ([c.operation_id for c in [*cmds, *more]],),
        participant=True,
    )
    released = await env.sql(
        f"SELECT operation_id FROM {SCHEMA}.releases WHERE operation_id = ANY(%s)",
        ([c.operation_id for c in [*cmds, *more]],),
        participant=True,
    )
    assert reserved == len(reserves) - 1 + 2
    assert sorted(str(r[0]) for r in released) == sorted(
        c.operation_id for c in [*releases, more[1]] if c is not refused_late
    ), "each effect once; none of the handler that failed after writing"
    after = await env.scalar(STOCK, participant=True)
    assert after == before - 2 * (len(reserves) - 1 + 2) + 2 * (len(releases) - 1 + 1)
    receipts = {
        r.request_id: r
        for r in await _outbox(env)
        if r.request_id in {refused_early.request_id, refused_late.request_id}
        and r.status == "failed"
    }
    assert {r.effect for r in receipts.values()} == {"none"} and len(receipts) == 2


async def test_a_handler_that_refuses_after_only_reading_is_not_redone_and_keeps_no_savepoint(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Participant completion: The business effect and terminal receipt are
    authoritative": a handler that fails after it only read (``Tx.read``; the sample
    reserve reads its stock row, locked, and refuses when it is short) leaves no effect,
    and has nothing to undo: its batch commits in one run, without a savepoint, and the
    operation's next runs take none either; the others of the batch keep their effects,
    each once. A read that is not a SELECT is refused before it is sent: its handler
    fails before it wrote, alone (a bug: deferred, to run again later, not an
    outcome)."""
    reserves = [submit() for _ in range(6)]
    short = submit(input={"order_id": "o-2", "sku": "sku-rare", "quantity": 1000})
    misread = submit()
    cmds = [*reserves[:3], short, misread, *reserves[3:]]

    async def reserve(call: Call) -> Mapping[str, Any]:
        if call.request_id == misread.request_id:
            await call.tx.read("UPDATE stock SET available = 0")  # type: ignore[arg-type]
        return await samples.reserve(call)

    savepoints = _Savepoints(monkeypatch)
    before = await env.scalar(STOCK, participant=True)
    rare = f"SELECT available FROM {SCHEMA}.stock WHERE sku = 'sku-rare'"
    rare_before = await env.scalar(rare, participant=True)
    handlers = {"inventory.reserve": reserve}
    async with _inline(env, handlers, set(handlers)) as (participant, transactions):
        assert await _accept(env, participant, cmds) == ["accepted"] * len(cmds)
        assert (transactions.n, savepoints.n) == (1, 0), "one run, no savepoint"

        more = [submit(), submit(input={"order_id": "o-3", "sku": "sku-rare", "quantity": 9})]
        transactions.n = 0
        assert await _accept(env, participant, more) == ["accepted"] * len(more)
        assert (transactions.n, savepoints.n) == (1, 0), "the next runs are not careful"

    statuses = {c.request_id: await _status(env, c.request_id) for c in [*cmds, *more]}
    assert statuses.pop(short.request_id) == "failed"
    assert statuses.pop(misread.request_id) == "accepted"  # deferred: a handler bug
    assert statuses.pop(more[1].request_id) == "failed"
    assert set(statuses.values()) == {"succeeded"}
    assert await _effects(env, "reservations", [*cmds, *more]) == sorted(
        c.operation_id for c in [*reserves, more[0]]
    ), "each effect once; none of the handlers that failed"
    assert await env.scalar(STOCK, participant=True) == before - 2 * (len(reserves) + 1)
    assert await env.scalar(rare, participant=True) == rare_before
    receipts = {
        r.request_id: r
        for r in await _outbox(env)
        if r.request_id in {short.request_id, more[1].request_id} and r.status == "failed"
    }
    assert {r.effect for r in receipts.values()} == {"none"} and len(receipts) == 2


async def test_a_handler_whose_read_failed_is_redone_even_when_it_hides_the_error(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that fails aborts the transaction: it counts as a write, so a handler that
    catches its error and refuses is redone as one that wrote (its batch runs again with
    that operation's handlers in savepoints, for its next runs too), never taken for a
    refusal with nothing to undo; its failure is its receipt and the others of the
    batch keep their effects."""
    reserves = [submit() for _ in range(4)]
    hiding = reserves[1]

    async def reserve(call: Call) -> Mapping[str, Any]:
        if call.request_id == hiding.request_id:
            try:
                await call.tx.read("SELECT 1 / 0")
            except psycopg.Error as exc:
                raise service.BusinessFailure("bad_read", str(exc)) from exc
        return await samples.reserve(call)

    savepoints = _Savepoints(monkeypatch)
    handlers = {"inventory.reserve": reserve}
    async with _inline(env, handlers, set(handlers)) as (participant, transactions):
        assert await _accept(env, participant, reserves) == ["accepted"] * len(reserves)
        assert transactions.n == 2, "the first run rolled back whole, the second committed"
        # redone as a handler of its operation that wrote: the operation's next runs
        # keep their savepoints (not a unit whose failing write was nobody's)
        more = [submit(), submit()]
        savepoints.n = transactions.n = 0
        assert await _accept(env, participant, more) == ["accepted"] * len(more)
        assert (transactions.n, savepoints.n) == (1, len(more))
    statuses = {c.request_id: await _status(env, c.request_id) for c in reserves}
    assert statuses.pop(hiding.request_id) == "failed"
    assert set(statuses.values()) == {"succeeded"}
    assert await _effects(env, "reservations", reserves) == sorted(
        c.operation_id for c in reserves if c is not hiding
    )


async def _effects(env: Env, table: str, cmds: Sequence[Any]) -> list[str]:
    rows = await env.sql(
        f"SELECT operation_id FROM {SCHEMA}.{table} WHERE operation_id = ANY(%s)",
        ([c.operation_id for c in cmds],),
        participant=True,
    )
    return sorted(str(r[0]) for r in rows)


async def test_the_writes_of_a_batch_of_handlers_are_answered_together_each_effect_once(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Participant completion: The business effect and terminal receipt are
    authoritative": every handler of a batch that returned has its effect once, with
    its terminal receipt, in the one transaction. A handler's write that returns no
    rows is not waited for on its own: the batch's writes are answered together, so a
    batch of 12 handlers of two writes each waits a few times, not 24."""
    releases = [submit(operation="inventory.release") for _ in range(12)]
    before = await env.scalar(STOCK, participant=True)
    waits = RoundTrips(monkeypatch)
    handlers = samples.HANDLERS["inventory"]
    async with _inline(env, handlers, {"inventory.release"}) as (participant, transactions):
        assert await _accept(env, participant, releases) == ["accepted"] * len(releases)

    assert transactions.n == 1
    assert waits.n <= 4, f"{waits.n} round trips for 24 handler writes"
    statuses = {await _status(env, c.request_id) for c in releases}
    assert statuses == {"succeeded"}
    assert await _effects(env, "releases", releases) == sorted(c.operation_id for c in releases)
    assert await env.scalar(STOCK, participant=True) == before + 2 * len(releases)
    terminal = [r for r in await _outbox(env) if r.status == "succeeded"]
    assert sorted(r.request_id for r in terminal) == sorted(c.request_id for c in releases)


async def test_an_inline_batch_is_accepted_in_two_round_trips_and_hands_its_receipts_after(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Participant completion: The business effect and terminal receipt are
    authoritative": a batch's acceptance, effects and terminal receipts commit together,
    and the receipts it queued go to the participant's own publisher only after that
    commit, the ones its insert took. Whatever the batch's size the unit costs two
    round trips (the inbox's insert, with the tombstones in the same statement; then the
    handlers' writes, the inbox rows' completion, the receipts' insert, the outbox's
    and the COMMIT, all answered together, the ids with the commit's answer), where it
    cost six, then four, then three."""
    releases = [submit(operation="inventory.release") for _ in range(12)]
    committed: list[int] = []  # of the handed rows, those another session saw when handed
    url = env.settings.participant_database_url

    class Sender(OutboxPublisher):
        """The participant's own publisher, as acceptance sees it: what it is handed is
        kept as it would be sent (nothing is sent here)."""

        def hand(self, rows: Sequence[dict[str, Any]]) -> None:
            super().hand(rows)
            with psycopg.connect(url, autocommit=True) as conn:
                seen = conn.execute(
                    f"SELECT count(*) FROM {SCHEMA}.outbox WHERE id = ANY(%s::uuid[])",
                    ([r["id"] for r in rows],),
                ).fetchone()
            committed.append(seen[0] if seen else 0)

    async with _inline(env, samples.HANDLERS["inventory"], {"inventory.release"}) as (
        participant,
        transactions,
    ):
        sender = _own_sender(participant, Sender)
        trips = RoundTrips(monkeypatch)
        assert await _accept(env, participant, releases) == ["accepted"] * len(releases)
        assert trips.n == 2, f"{trips.n} round trips"

    assert transactions.n == 1
    handed = sender.handed
    assert {await _status(env, c.request_id) for c in releases} == {"succeeded"}
    assert sorted(r["operation_id"] for r in handed) == sorted(c.operation_id for c in releases)
    assert committed == [len(releases)], "handed over once their commit was visible"
    assert {r["publish_attempts"] for r in handed} == {1}
    claimed = await env.sql(
        f"SELECT DISTINCT claimed_by FROM {SCHEMA}.outbox WHERE status = 'pending'",
        participant=True,
    )
    assert claimed == [("test-sender",)]


async def test_the_crash_point_before_the_receipt_is_sent_comes_before_its_publish(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Participant completion: The business effect and terminal receipt are
    authoritative", under the fault that kills a participant after the effect and its
    receipt committed but before the receipt left (tests/acceptance/
    test_commit_boundaries.py, ``make chaos``): that fault must be reached before the
    receipt's publish starts. Handed over to a sender that waits for work, the receipt
    leaves within the hand-over (``OutboxPublisher.hand_over``), so the crash point comes
    before it; after it, the kill would test a receipt already sent."""
    release = submit(operation="inventory.release")
    published: list[str] = []
    at_crash_point: list[list[str]] = []

    class Recorder:
        async def publish_many(self, items: Sequence[broker.Outgoing]) -> list[broker.Outcome]:
            published.extend(i.message_id for i in items)
            return [broker.Outcome(i.message_id, True) for i in items]

    def crash_point(name: str) -> None:
        if name == "after_effect_before_receipt_sent":
            at_crash_point.append(list(published))

    monkeypatch.setattr(service.faults, "crash_point", crash_point)
    async with _inline(env, samples.HANDLERS["inventory"], {"inventory.release"}) as (
        participant,
        _,
    ):
        sender = _own_sender(participant, OutboxPublisher, Recorder())
        sender._looping = True  # its loop waits for work: a hand-over sends at once
        assert await _accept(env, participant, [release]) == ["accepted"]
        for _ in range(5):
            await asyncio.sleep(0)
    assert at_crash_point == [[]], "the crash point came after the receipt's publish"
    assert len(published) == 1, "the receipt was sent, from the hand-over"


def _own_sender(
    participant: service.Participant,
    kind: type[OutboxPublisher],
    publisher: object = None,
) -> OutboxPublisher:
    """The participant's own publisher of its receipts (holder ``test-sender``), of
    ``kind``, publishing through ``publisher`` (none: nothing is sent), set on it."""
    sender = kind(
        owner="inventory",
        database=cast(db.Database, None),
        lease=None,
        publisher=cast(broker.Publisher, publisher),
        batch_size=50,
        claim_ttl_s=60.0,
        engine=False,
    )
    sender.holder = "test-sender"
    participant.sender = sender
    return sender


async def _bad_write(call: Call) -> None:
    """A write that fails (a release's quantity is NOT NULL), sent without waiting: its
    error is raised later, by a statement that is not its handler's."""
    await call.tx.business(
        "INSERT INTO releases (operation_id, order_id, sku, quantity) VALUES (%s, %s, %s, NULL)",
        (call.operation_id, "bad", "sku-1"),
    )


def _release_with_a_bad_write(bad: Any) -> service.Handler:
    """The sample release handler, which also sends a failing write for ``bad``."""

    async def release(call: Call) -> Mapping[str, Any]:
        result = await samples.release(call)
        if call.request_id == bad.request_id:
            await _bad_write(call)
        return result

    return release


async def test_a_write_sent_without_waiting_that_fails_leaves_no_effect_and_blames_its_handler(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Participant completion: The business effect and terminal receipt are
    authoritative": a handler whose write fails leaves no effect, and the others of its
    batch keep theirs, each once. The failed write was sent without waiting, so its
    error is raised later (in another handler's statement, or once the batch's writes
    are answered), where it is nobody's: the whole transaction rolls back and runs
    again with every handler in a savepoint, whose writes are answered before it ends.
    There the error is raised in the handler that caused it, which fails alone (a bug:
    its command stays accepted for the executor), and its operation's next runs are
    careful."""
    cmds = [submit(operation="inventory.release") for _ in range(6)]
    reserve = submit()  # waits for its UPDATE's rows, after the bad write was sent
    cmds.insert(4, reserve)
    bad = cmds[2]

    release = _release_with_a_bad_write(bad)
    savepoints = _Savepoints(monkeypatch)
    before = await env.scalar(STOCK, participant=True)
    handlers = {**samples.HANDLERS["inventory"], "inventory.release": release}
    async with _inline(env, handlers, set(handlers)) as (participant, transactions):
        assert await _accept(env, participant, cmds) == ["accepted"] * len(cmds)
        assert transactions.n == 2, "the first run rolled back whole, the second committed"
        assert savepoints.n == len(cmds), "the second run: every handler in a savepoint"

        # the next batch: the releases keep savepoints, the reserve goes without
        more = [submit(operation="inventory.release"), submit()]
        savepoints.n = transactions.n = 0
        assert await _accept(env, participant, more) == ["accepted"] * len(more)
        assert (transactions.n, savepoints.n) == (1, 1)

    statuses = {c.request_id: await _status(env, c.request_id) for c in [*cmds, *more]}
    assert statuses.pop(bad.request_id) == "accepted", "a bug: left to the executor"
    assert set(statuses.values()) == {"succeeded"}
    good = [c for c in [*cmds, *more] if c is not bad and c.operation == "inventory.release"]
    assert await _effects(env, "releases", [*cmds, *more]) == sorted(c.operation_id for c in good)
    assert await _effects(env, "reservations", [reserve, more[1]]) == sorted(
        [reserve.operation_id, more[1].operation_id]
    )
    assert await env.scalar(STOCK, participant=True) == before + 2 * len(good) - 2 * 2


@pytest.mark.parametrize("path", ["inline", "executor"])
async def test_a_write_sent_without_waiting_that_fails_at_the_commit_leaves_no_effect(
    env: Env, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """ "Participant completion: The business effect and terminal receipt are
    authoritative": the last handler's write that fails, sent without waiting, is
    answered only with the completion, the receipts and the COMMIT (one flight). Its
    error there is nobody's: nothing of the unit is kept, and it runs again with every
    handler in a savepoint, where the error is the failing handler's alone (a bug: its
    command stays accepted). The others' effects and receipts are kept, each once. Run
    inline (the acceptance transaction) and by the executor (a claimed batch)."""
    cmds = [submit(operation="inventory.release") for _ in range(4)]
    bad = cmds[-1]

    release = _release_with_a_bad_write(bad)
    savepoints = _Savepoints(monkeypatch)
    before = await env.scalar(STOCK, participant=True)
    handlers = {**samples.HANDLERS["inventory"], "inventory.release": release}
    inline = set(handlers) if path == "inline" else set()
    if path == "executor":
        await _accepted_together(env, cmds)
        # the executor runs a claimed batch in acceptance order: the bad one last, so
        # that its error is raised by the COMMIT, not by the next command's lock
        await env.sql(
            f"UPDATE {SCHEMA}.inbox SET accepted_at = accepted_at + interval '1 second'"
            " WHERE request_id = %s",
            (bad.request_id,),
            participant=True,
        )
    async with _inline(env, handlers, inline) as (participant, transactions):
        if path == "inline":
            assert await _accept(env, participant, cmds) == ["accepted"] * len(cmds)
        else:
            assert await participant.execute() == len(cmds)
            transactions.n -= 1  # the claim's own
        assert transactions.n == 2, "the first run rolled back whole, the second committed"
        assert savepoints.n == len(cmds), "the second run: every handler in a savepoint"

    statuses = {c.request_id: await _status(env, c.request_id) for c in cmds}
    assert statuses.pop(bad.request_id) == "accepted", "a bug: left to the executor"
    assert set(statuses.values()) == {"succeeded"}
    good = [c for c in cmds if c is not bad]
    assert await _effects(env, "releases", cmds) == sorted(c.operation_id for c in good)
    assert await env.scalar(STOCK, participant=True) == before + 2 * len(good)
    terminal = [r for r in await _outbox(env) if r.request_id in {c.request_id for c in cmds}]
    assert sorted(r.request_id for r in terminal if r.status == "succeeded") == sorted(
        c.request_id for c in good
    ), "a terminal receipt for each kept effect, once; none for the failed handler"


async def test_a_completion_whose_inbox_row_moved_under_its_lock_fails_its_unit_whole(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Participant completion: The business effect and terminal receipt are
    authoritative": the completion of a batch's inbox rows is guarded by the status they
    were locked in (accepted). It is sent with the COMMIT, not waited for: a row no
    longer accepted fails the statement there (CU004, the unit is redone, re-reading
    everything), so the unit keeps nothing, not even the other rows' completion; a batch
    whose rows are all still accepted completes in the COMMIT's one round trip."""
    moved, kept = submit(), submit()
    await _accepted_together(env, [moved, kept])
    await env.sql(
        f"UPDATE {SCHEMA}.inbox SET status = 'failed' WHERE request_id = %s",
        (moved.request_id,),
        participant=True,
    )

    def receipt(c: Any) -> OperationReceipt:
        cmd = {
            "request_id": c.request_id,
            "tenant": c.tenant,
            "operation_id": c.operation_id,
            "attempt": c.attempt,
        }
        return service.make_receipt(
            cmd,
            ME,
            status="succeeded",
            effect="applied",
            revision=2,
            in_reply_to=c.request_id,
            digest=c.digest,
            result={"ok": True},
        )

    database = _database(env, "inventory-complete")
    await database.open()
    try:
        with pytest.raises(errors.DatabaseError) as failed:
            async with database.transaction() as tx:
                await service.complete(tx, [receipt(kept), receipt(moved)])
        assert failed.value.sqlstate == errors.ROW_CHANGED_SQLSTATE
        assert failed.value.kind is errors.Retry.RETRY
        assert await _status(env, kept.request_id) == "accepted", "nothing of the unit kept"

        trips = RoundTrips(monkeypatch)
        async with database.transaction() as tx:
            await service.complete(tx, [receipt(kept)])
        assert trips.n == 1
    finally:
        await database.close()
    assert await _status(env, kept.request_id) == "succeeded"
    assert await _status(env, moved.request_id) == "failed"


async def test_a_rerun_in_savepoints_is_its_own_units_not_the_other_loops(env: Env) -> None:
    """ "Participant completion: The business effect and terminal receipt are
    authoritative": acceptance and the executor run at once on one participant, each in
    its own task. An acceptance whose write sent without waiting failed runs again with
    every handler in a savepoint; while it does, the executor's unit runs and commits
    as it would have (no savepoints of its own), and the rerun stays one in savepoints
    after that commit. Each effect once, none of the failed write's."""
    good, bad = submit(operation="inventory.release"), submit(operation="inventory.release")
    claimed = submit()  # accepted earlier, for the executor
    await _accepted_together(env, [claimed])
    rerunning, executed = asyncio.Event(), asyncio.Event()
    seen: dict[str, list[bool]] = {"acceptance": [], "executor": []}

    async def release(call: Call) -> Mapping[str, Any]:
        if call.request_id == bad.request_id:
            seen["acceptance"].append(service.careful_unit())
            if service.careful_unit():  # the rerun: the executor runs while it is here
                rerunning.set()
                await asyncio.wait_for(executed.wait(), 10)
                seen["acceptance"].append(service.careful_unit())
        result = await samples.release(call)
        if call.request_id == bad.request_id and not service.careful_unit():
            await _bad_write(call)
        return result

    async def reserve(call: Call) -> Mapping[str, Any]:
        seen["executor"].append(service.careful_unit())
        return {"reserved": 0}

    async def executor() -> int:
        await asyncio.wait_for(rerunning.wait(), 10)
        try:
            return await participant.execute()
        finally:
            executed.set()

    handlers = {"inventory.release": release, "inventory.reserve": reserve}
    async with _inline(env, handlers, {"inventory.release"}) as (participant, _):
        decisions, ran = await asyncio.gather(_accept(env, participant, [good, bad]), executor())
    assert decisions == ["accepted", "accepted"]
    assert ran == 1
    assert seen["acceptance"] == [False, True, True], "its rerun in savepoints, throughout"
    assert seen["executor"] == [False], "the other loop's unit runs as it would have"
    assert {await _status(env, c.request_id) for c in [good, bad, claimed]} == {"succeeded"}
    assert await _effects(env, "releases", [good, bad]) == sorted(
        [good.operation_id, bad.operation_id]
    ), "each release once, the failed write's row not kept"
