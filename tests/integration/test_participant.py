"""Participant runtime: acceptance, completion, and the same command delivered twice."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest

from contracts import codec, identity
from contracts.models import Lineage, SubmitCommand, Target
from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, drain, publish_raw
from workers import broker


def submit(**overrides: object) -> SubmitCommand:
    instance = str(uuid.uuid4())
    op = identity.operation_id("acme", instance, "reserve", 1)
    fields: dict[str, object] = {
        "request_id": identity.request_id(op, 1, "submit"), "tenant": "acme",
        "operation_id": op, "attempt": 1, "operation": "inventory.reserve",
        "target": Target(route="inventory", owner="inventory", binding="inventory.v1"),
        "digest": "0" * 64, "issued_at": datetime.now(UTC),
        "input": {"order_id": "o-1", "sku": "sku-1", "quantity": 2},
        "lineage": Lineage(instance_id=instance, process="order-fulfilment", process_version=1,
                           node="reserve", activation=1),
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
    rows = await env.sql("SELECT status FROM participant_inventory.inbox WHERE request_id = %s",
                         (request_id,), participant=True)
    return rows[0][0] if rows else None


async def test_same_command_delivered_twice_executes_once_with_identical_receipts(
    env: Env, inventory: InProcessFleet
) -> None:
    """"The same command identity with the same semantic input returns the existing
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
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(later)],
                      message_id=str(uuid.uuid4()))
    again = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=2.0)
    inventory.check_alive()

    effects = await env.scalar(
        "SELECT count(*) FROM participant_inventory.reservations WHERE operation_id = %s",
        (cmd.operation_id,), participant=True)
    assert effects == 1
    assert [codec.decode_receipt(d.body).status for d in first] == ["accepted", "succeeded"]
    assert len(again) == 1, "the duplicate must be answered with the existing receipt"
    assert again[0].body == first[1].body
    assert again[0].message_id == first[1].message_id == identity.receipt_id(cmd.request_id, 2)
    assert again[0].user_id == "custody-inventory"


async def test_changed_input_under_the_same_identity_conflicts_and_executes_nothing(
    env: Env, inventory: InProcessFleet
) -> None:
    """"Reusing that identity with changed input conflicts": recorded durably, the
    original untouched, a rejected/digest_conflict answer, no second effect."""
    cmd = submit()
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(cmd)])

    async def done() -> bool:
        return await _status(env, cmd.request_id) == "succeeded"

    await wait_until(done, what="the original to complete")
    await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=1.0)
    changed = cmd.model_copy(update={"input": {"order_id": "o-1", "sku": "sku-1", "quantity": 9}})
    changed = changed.model_copy(update={"digest": changed.semantic_digest()})
    await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, "inventory.v1", [codec.encode(changed)])
    answers = await drain(env.settings, broker.QUEUE_RECEIPTS, timeout=2.0)

    assert len(answers) == 1
    answer = codec.decode_receipt(answers[0].body)
    assert (answer.status, answer.effect) == ("rejected", "none")
    assert answer.error is not None and answer.error.code == "digest_conflict"
    conflicts = await env.sql(
        "SELECT stored_digest, received_digest FROM participant_inventory.conflicts",
        participant=True)
    assert conflicts == [(cmd.digest, changed.digest)]
    rows = await env.sql(
        "SELECT quantity FROM participant_inventory.reservations WHERE operation_id = %s",
        (cmd.operation_id,), participant=True)
    assert rows == [(2,)], "the original effect stands, and nothing else executed"
    assert await env.scalar("SELECT digest FROM participant_inventory.inbox WHERE request_id = %s",
                            (cmd.request_id,), participant=True) == cmd.digest
