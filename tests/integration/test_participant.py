"""Participant runtime: acceptance, completion, and the same command delivered twice."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest

from contracts import codec, identity
from contracts.models import Lineage, OperationReceipt, SubmitCommand, Target
from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, drain, publish_raw
from workers.io import broker


def _receipt(body: bytes) -> OperationReceipt:
    """A receipt (never a query answer) off the receipts queue."""
    decoded = codec.decode_receipt(body)
    assert isinstance(decoded, OperationReceipt), decoded
    return decoded


def submit(**overrides: object) -> SubmitCommand:
    instance = str(uuid.uuid4())
    op = identity.operation_id("acme", instance, "reserve", 1)
    fields: dict[str, object] = {
        "request_id": identity.request_id(op, 1, "submit"),
        "tenant": "acme",
        "operation_id": op,
        "attempt": 1,
        "operation": "inventory.reserve",
        "target": Target(route="inventory", owner="inventory", binding="inventory.v1"),
        "digest": "0" * 64,
        "issued_at": datetime.now(UTC),
        "input": {"order_id": "o-1", "sku": "sku-1", "quantity": 2},
        "lineage": Lineage(
            instance_id=instance,
            process="order-fulfilment",
            process_version=1,
            node="reserve",
            activation=1,
        ),
    }
    fields.update(overrides)
    cmd = SubmitCommand.model_validate(fields)
    return cmd.model_copy(update={"digest": cmd.semantic_digest()})


@pytest.fixture
async def inventory(env: Env) -> AsyncIterator[InProcessFleet]:
    f = InProcessFleet(env)
    f.start("inventory")
    yield f
    await f.stop_all()


async def _status(env: Env, request_id: str) -> str | None:
    rows = await env.sql(
        "SELECT status FROM participant_inventory.inbox WHERE request_id = %s",
        (request_id,),
        participant=True,
    )
    return rows[0][0] if rows else None


async def test_same_command_delivered_twice_executes_once_with_identical_receipts(
    env: Env, inventory: InProcessFleet
) -> None:
    """ "The same command identity with the same semantic input returns the existing
    receipt": a redelivery never runs the handler again, and re-emits the very same
    receipt (same id, same bytes)."""
    cmd = submit()
    body = codec.encode(cmd)
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [body])

    async def done() -> bool:
        return await _status(env, cmd.request_id) == "succeeded"

    await wait_until(done, what="the first delivery to complete")
    first = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=1.0)
    # the duplicate, with retry-varying transport facts changed
    later = cmd.model_copy(update={"issued_at": datetime.now(UTC)})
    await publish_raw(
        env.settings,
        broker.EXCHANGE_COMMANDS,
        "inventory.v1",
        [codec.encode(later)],
        message_id=str(uuid.uuid4()),
    )
    again = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=2.0)
    inventory.check_alive()

    effects = await env.scalar(
        "SELECT count(*) FROM participant_inventory.reservations WHERE operation_id = %s",
        (cmd.operation_id,),
        participant=True,
    )
    assert effects == 1
    # the samples' handlers run inline: no accepted receipt, only the terminal one
    assert [_receipt(d.body).status for d in first] == ["succeeded"]
    assert len(again) == 1, "the duplicate must be answered with the existing receipt"
    assert again[0].body == first[-1].body
    assert again[0].message_id == first[-1].message_id == identity.receipt_id(cmd.request_id, 2)
    assert again[0].user_id == "custody-inventory"


async def test_changed_input_under_the_same_identity_conflicts_and_executes_nothing(
    env: Env, inventory: InProcessFleet
) -> None:
    """ "Reusing that identity with changed input conflicts": recorded durably, the
    original untouched, a rejected/digest_conflict answer, no second effect."""
    cmd = submit()
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)])

    async def done() -> bool:
        return await _status(env, cmd.request_id) == "succeeded"

    await wait_until(done, what="the original to complete")
    await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=1.0)
    changed = cmd.model_copy(update={"input": {"order_id": "o-1", "sku": "sku-1", "quantity": 9}})
    changed = changed.model_copy(update={"digest": changed.semantic_digest()})
    await publish_raw(
        env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(changed)]
    )
    answers = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=2.0)

    assert len(answers) == 1
    answer = _receipt(answers[0].body)
    assert (answer.status, answer.effect) == ("rejected", "none")
    assert answer.error is not None and answer.error.code == "digest_conflict"
    conflicts = await env.sql(
        "SELECT stored_digest, received_digest FROM participant_inventory.conflicts",
        participant=True,
    )
    assert conflicts == [(cmd.digest, changed.digest)]
    rows = await env.sql(
        "SELECT quantity FROM participant_inventory.reservations WHERE operation_id = %s",
        (cmd.operation_id,),
        participant=True,
    )
    assert rows == [(2,)], "the original effect stands, and nothing else executed"
    assert (
        await env.scalar(
            "SELECT digest FROM participant_inventory.inbox WHERE request_id = %s",
            (cmd.request_id,),
            participant=True,
        )
        == cmd.digest
    )


async def _redelivered(env: Env, body: bytes) -> None:
    """Put ``body`` back in the inventory queue with the broker's redelivered flag set."""
    from tests.harness import client

    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [body])
    async with (
        client(env.settings) as amqp,
        amqp.consume([broker.command_queue("inventory.v1")], prefetch=1) as inbox,
    ):
        d = await inbox.get()
        await d.requeue()


@pytest.mark.parametrize("variation", ["traceparent", "message_id", "issued_at", "redelivered"])
async def test_retry_varying_transport_facts_do_not_change_semantic_identity(
    env: Env, inventory: InProcessFleet, variation: str
) -> None:
    """ "Retry-varying tracing headers and transport delivery tags do not define
    semantic identity": a redelivery that differs only in a transport fact gets the
    existing receipt, and the handler does not run again."""
    from tests.harness import client

    cmd = submit()
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)])

    async def done() -> bool:
        return await _status(env, cmd.request_id) == "succeeded"

    await wait_until(done, what="the first delivery to complete")
    first = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=1.0)
    if variation == "traceparent":
        async with client(env.settings) as amqp:
            pub = await amqp.publisher(window=1, timeout_s=5, user_id=None)
            [ok] = await pub.publish_many(
                [
                    broker.Outgoing(
                        str(uuid.uuid4()),
                        broker.EXCHANGE_COMMANDS,
                        "inventory.v1",
                        codec.encode(cmd),
                        {"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"},
                    )
                ]
            )
            assert ok.ok
    elif variation == "message_id":
        await publish_raw(
            env.settings,
            broker.EXCHANGE_COMMANDS,
            "inventory.v1",
            [codec.encode(cmd)],
            message_id=str(uuid.uuid4()),
        )
    elif variation == "issued_at":
        later = cmd.model_copy(update={"issued_at": datetime.now(UTC)})
        await publish_raw(
            env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(later)]
        )
    else:
        [run] = inventory.running
        await inventory.stop(run)
        await _redelivered(env, codec.encode(cmd))
        inventory.start("inventory")
    again = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=2.0)
    assert [d.body for d in again] == [first[-1].body]
    assert (
        await env.scalar(
            "SELECT count(*) FROM participant_inventory.reservations WHERE operation_id = %s",
            (cmd.operation_id,),
            participant=True,
        )
        == 1
    )


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        (Target(route="payments", owner="payments", binding="payments.v1"), "wrong_owner"),
        (Target(route="inventory", owner="inventory", binding="inventory.v9"), "wrong_owner"),
    ],
    ids=["other-owner", "other-binding"],
)
async def test_a_command_for_another_owner_or_binding_is_refused_and_recorded(
    env: Env, inventory: InProcessFleet, target: Target, reason: str
) -> None:
    """A command whose target owner or route binding is not this participant's is
    refused and recorded; nothing is accepted or executed."""
    cmd = submit(target=target)
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)])

    async def refused() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM participant_inventory.refused WHERE reason = %s",
                (reason,),
                participant=True,
            )
            == 1
        )

    await wait_until(refused, what="the refusal recorded")
    assert await _status(env, cmd.request_id) is None
    assert await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=0.5) == []


async def test_a_command_whose_digest_does_not_match_its_fields_is_refused(
    env: Env, inventory: InProcessFleet
) -> None:
    """ "A participant persists the semantic command digest": it recomputes it, and a
    command whose digest does not bind its own input is refused, not executed."""
    cmd = submit().model_copy(update={"input": {"order_id": "o-1", "sku": "sku-1", "quantity": 50}})
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)])

    async def refused() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM participant_inventory.refused"
                " WHERE reason = 'digest_mismatch'",
                participant=True,
            )
            == 1
        )

    await wait_until(refused, what="the refusal recorded")
    assert await _status(env, cmd.request_id) is None
    assert (
        await env.scalar(
            "SELECT count(*) FROM participant_inventory.reservations", participant=True
        )
        == 0
    )


async def test_an_unknown_operation_is_answered_rejected_with_effect_none(
    env: Env, inventory: InProcessFleet
) -> None:
    """An operation with no handler is retained and answered `rejected`, effect none,
    so the engine learns it authoritatively instead of timing out."""
    cmd = submit(operation="inventory.teleport")
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)])
    [answer] = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=2.0)
    receipt = _receipt(answer.body)
    assert (receipt.status, receipt.effect) == ("rejected", "none")
    assert receipt.error is not None and receipt.error.code == "unknown_operation"
    assert await _status(env, cmd.request_id) == "rejected"
