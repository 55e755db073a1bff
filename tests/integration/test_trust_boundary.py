"""The trust boundary on the engine side: ApplyReceiptAsync's validation, in order.

Every refused receipt is quarantined with a machine-readable reason, acked, and
changes no state; the receipt consumer keeps running.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest

from contracts import codec, identity
from contracts.models import OperationReceipt, ReceiptError
from tests.conftest import MGMT, Env, wait_until
from tests.harness import InProcessFleet, order, publish_raw, publish_starts
from workers.io import broker


@dataclass
class Op:
    id: str
    tenant: str
    attempt: int
    digest: str
    request_id: str


@pytest.fixture
async def engine_only(env: Env) -> AsyncIterator[InProcessFleet]:
    """The engine without participants: the first operation waits, dispatched."""
    f = InProcessFleet(env)
    f.start_all(participants=())
    yield f
    f.check_alive()
    await f.stop_all()


@pytest.fixture
async def op(env: Env, engine_only: InProcessFleet) -> Op:
    await publish_starts(env.settings, [order(1)])

    async def dispatched() -> bool:
        return (
            await env.scalar("SELECT count(*) FROM custody.operations WHERE status = 'dispatched'")
            == 1
        )

    await wait_until(dispatched, what="the first operation dispatched")
    [(oid, tenant, attempt, digest, request_id)] = await env.sql(
        "SELECT o.id::text, o.tenant, o.attempt, o.digest, a.request_id::text"
        " FROM custody.operations o JOIN custody.attempts a ON a.operation_id = o.id"
    )
    return Op(oid, tenant, attempt, digest, request_id)


def receipt(
    op: Op, revision: int = 1, status: str = "accepted", effect: str = "none", **overrides: Any
) -> OperationReceipt:
    fields: dict[str, Any] = {
        "receipt_id": identity.receipt_id(op.request_id, revision),
        "tenant": op.tenant,
        "operation_id": op.id,
        "attempt": op.attempt,
        "request_id": op.request_id,
        "in_reply_to": op.request_id,
        "owner": "inventory",
        "principal": "custody-inventory",
        "command_digest": op.digest,
        "owner_revision": revision,
        "status": status,
        "effect": effect,
        "emitted_at": datetime.now(UTC),
    }
    if status == "succeeded":
        fields["result"] = {"reservation_id": op.id}
    fields.update(overrides)
    if "receipt_id" not in overrides:  # derived from the request it speaks of
        fields["receipt_id"] = identity.receipt_id(fields["request_id"], revision)
    return OperationReceipt.model_validate(fields)


async def send(
    env: Env, *bodies: bytes, as_user: str | None = "inventory", user_id: str | None = "default"
) -> None:
    """Publish receipts as a participant's broker user (user_id validated by RabbitMQ)."""
    settings = env.participant_settings(as_user) if as_user else env.settings
    uid = (f"custody-{as_user}" if as_user else None) if user_id == "default" else user_id
    await publish_raw(
        settings, broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY, list(bodies), user_id=uid
    )


async def quarantined(env: Env, reason: str, n: int = 1) -> None:
    async def seen() -> bool:
        return (
            await env.scalar("SELECT count(*) FROM custody.quarantine WHERE reason = %s", (reason,))
            >= n
        )

    await wait_until(seen, timeout=15, what=f"{n} quarantine row(s) with reason {reason}")


async def operation_state(env: Env, op: Op) -> tuple[Any, ...]:
    [row] = await env.sql(
        "SELECT status::text, effect::text, owner_revision, result"
        " FROM custody.operations WHERE id = %s",
        (op.id,),
    )
    return row


async def applied(env: Env, op: Op, revision: int) -> None:
    async def done() -> bool:
        return (await operation_state(env, op))[2] == revision

    await wait_until(done, what=f"owner revision {revision} applied")


def body(r: OperationReceipt, **raw_overrides: Any) -> bytes:
    data = orjson.loads(codec.encode(r))
    data.update(raw_overrides)
    return orjson.dumps(data)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda r: b"{not json", "malformed_json"),
        (lambda r: b"\xff\xfe", "not_utf8"),
        (lambda r: body(r, owner_revision="1"), "schema"),  # strict: no coercion
        (lambda r: body(r, surprise=True), "schema"),  # unknown field
        (
            lambda r: orjson.dumps(
                {k: v for k, v in orjson.loads(body(r)).items() if k != "command_digest"}
            ),
            "schema",
        ),  # missing field
        (lambda r: body(r, type="custody.receipt.v9"), "unknown_type"),
        (lambda r: body(r, result={"x": 1.5}), "non_canonical_value"),
        (lambda r: body(r, result={"blob": "x" * 300_000}), "oversized"),
    ],
    ids=[
        "non-json",
        "not-utf8",
        "wrong-type",
        "unknown-field",
        "missing-field",
        "unknown-version",
        "float",
        "oversized",
    ],
)
async def test_rule_1_schema_invalid_receipts_are_quarantined_with_their_reason(
    env: Env, op: Op, make: Any, reason: str
) -> None:
    """Rule 1, schema: strict pydantic; unknown fields, wrong types, missing fields,
    non-JSON and bodies over the configured limit are quarantined, never applied."""
    await send(env, make(receipt(op)))
    await quarantined(env, reason)
    assert await operation_state(env, op) == ("dispatched", "unknown", 0, None)


async def test_rule_2_a_receipt_for_another_tenant_is_quarantined(env: Env, op: Op) -> None:
    """Rule 2: the exact tenant of the operation."""
    await send(env, codec.encode(receipt(op, tenant="globex")))
    await quarantined(env, "wrong_tenant")
    assert (await operation_state(env, op))[0] == "dispatched"


async def test_rule_3_principal_must_be_the_broker_validated_user(env: Env, op: Op) -> None:
    """Rule 3: the delivery's broker-validated user_id must be the receipt's principal:
    payments cannot speak for inventory, and a receipt without user_id is refused."""
    forged = receipt(op)  # claims custody-inventory
    await send(env, codec.encode(forged), as_user="payments")  # user_id custody-payments
    await quarantined(env, "principal_mismatch")
    await send(env, codec.encode(forged), as_user=None, user_id=None)  # guest, no user_id
    await quarantined(env, "missing_user_id")
    assert (await operation_state(env, op))[0] == "dispatched"


async def test_rule_3_only_the_pinned_owner_and_principal_may_answer(env: Env, op: Op) -> None:
    """Rule 3: owner and principal of the route binding the operation pinned."""
    other = receipt(op, owner="payments", principal="custody-payments")
    await send(env, codec.encode(other), as_user="payments")
    await quarantined(env, "wrong_owner")
    assert (await operation_state(env, op))[0] == "dispatched"


async def test_rule_3_rabbitmq_refuses_a_spoofed_user_id(env: Env, op: Op) -> None:
    """RabbitMQ validates user_id: payments cannot publish as custody-inventory."""
    with pytest.raises(AssertionError):
        await send(env, codec.encode(receipt(op)), as_user="payments", user_id="custody-inventory")
    assert await env.scalar("SELECT count(*) FROM custody.receipt_inbox") == 0


async def test_rule_4_unknown_operation_request_or_attempt_is_quarantined(env: Env, op: Op) -> None:
    """Rule 4: the operation exists; the attempt and the request id were issued for it."""
    ghost = Op(str(uuid.uuid4()), op.tenant, 1, op.digest, str(uuid.uuid4()))
    await send(env, codec.encode(receipt(ghost)))
    await quarantined(env, "unknown_operation")
    other_request = receipt(op, request_id=str(uuid.uuid4()))
    await send(env, codec.encode(other_request))
    wrong_attempt = receipt(op, attempt=2)
    await send(env, codec.encode(wrong_attempt))
    await quarantined(env, "unknown_request", n=2)
    assert (await operation_state(env, op))[0] == "dispatched"


async def test_rule_5_a_receipt_for_another_digest_is_quarantined(env: Env, op: Op) -> None:
    """Rule 5: the receipt's command digest equals the operation's digest."""
    await send(env, codec.encode(receipt(op, command_digest="f" * 64)))
    await quarantined(env, "digest_mismatch")
    assert (await operation_state(env, op))[0] == "dispatched"


async def test_rule_6_owner_revisions_never_roll_back(env: Env, op: Op) -> None:
    """Rule 6: "Older owner revisions cannot roll state backward. A repeated owner
    revision with changed content is rejected." Equal and identical is a no-op."""
    await send(env, codec.encode(receipt(op, 1)))
    await applied(env, op, 1)
    done = receipt(op, 2, "succeeded", "applied")
    await send(env, codec.encode(done))
    await applied(env, op, 2)
    after = await operation_state(env, op)
    assert after[:3] == ("succeeded", "applied", 2)

    # receipt ids are derived from (request, revision), or the conflict way: the only
    # unseen id a different statement about this request can carry is the conflict one
    unseen_id = identity.conflict_receipt_id(op.request_id, op.digest)
    await send(env, codec.encode(done))  # equal revision, identical content
    changed = receipt(
        op,
        2,
        "succeeded",
        "applied",
        receipt_id=unseen_id,
        result={"reservation_id": "someone else"},
    )
    await send(env, codec.encode(changed))
    await quarantined(env, "revision_conflict")
    older = receipt(
        op,
        1,
        "failed",
        "none",
        receipt_id=unseen_id,
        error=ReceiptError(code="late", message="an older statement"),
    )
    await send(env, codec.encode(older))

    async def stale_recorded() -> bool:
        return (
            await env.scalar("SELECT count(*) FROM custody.receipt_inbox WHERE decision = 'stale'")
            == 1
        )

    await wait_until(stale_recorded, what="the older revision recorded as stale")
    assert await operation_state(env, op) == after
    assert (
        await env.scalar("SELECT count(*) FROM custody.history WHERE event = 'operation.succeeded'")
        == 1
    )


async def test_rule_7_a_success_after_an_authoritative_failure_is_an_integrity_violation(
    env: Env, op: Op
) -> None:
    """Rule 7: the status change must be allowed by the lifecycle: a terminal state is
    never left, so a success for an attempt whose effect was authoritatively none is
    quarantined, not applied."""
    failed = receipt(op, 1, "failed", "none", error=ReceiptError(code="declined", message="no"))
    await send(env, codec.encode(failed))
    await applied(env, op, 1)
    await send(env, codec.encode(receipt(op, 2, "succeeded", "applied")))
    await quarantined(env, "illegal_transition")
    assert (await operation_state(env, op))[:2] == ("failed", "none")


async def test_successful_application_records_result_and_successor_intent_once(
    env: Env, op: Op
) -> None:
    """ "Successful application records the result and next-step intent atomically",
    once: a redelivered receipt adds nothing."""
    done = receipt(op, 1, "succeeded", "applied")
    await send(env, codec.encode(done))
    await applied(env, op, 1)
    await send(env, codec.encode(done), codec.encode(done))

    async def next_node() -> bool:
        return (
            await env.scalar("SELECT count(*) FROM custody.operations WHERE node = 'charge'") == 1
        )

    await wait_until(next_node, what="the successor operation")
    assert await env.sql(
        "SELECT outcome, next_node FROM custody.successor_intents WHERE from_operation_id = %s",
        (op.id,),
    ) == [("succeeded", "charge")]
    [(status, result)] = await env.sql(
        "SELECT status::text, result FROM custody.operations WHERE id = %s", (op.id,)
    )
    assert (status, result) == ("succeeded", {"reservation_id": op.id})
    assert await env.scalar("SELECT count(*) FROM custody.receipt_inbox") == 1


# --- owner revisions: every seen revision, identity derivation, column bounds -----------


async def test_a_changed_receipt_at_a_seen_but_ignored_revision_is_refused(
    env: Env, op: Op
) -> None:
    """The seed: "A repeated owner revision with changed content is rejected." A
    revision the engine saw and ignored (a late ``accepted``) is seen all the same: a
    different statement at that revision, under another receipt id, is refused,
    whether its id is made up or derived the conflict way."""
    await send(env, codec.encode(receipt(op, 1)))
    await applied(env, op, 1)
    await send(env, codec.encode(receipt(op, 2)))  # accepted again: recorded, ignored

    async def ignored() -> bool:
        return (
            await env.scalar(
                "SELECT count(*) FROM custody.receipt_inbox WHERE owner_revision = 2"
                " AND decision = 'ignored'"
            )
            == 1
        )

    await wait_until(ignored, what="revision 2 recorded as ignored")
    made_up = receipt(op, 2, "succeeded", "applied", receipt_id=str(uuid.uuid4()))
    await send(env, codec.encode(made_up))
    await quarantined(env, "receipt_id_mismatch")
    conflict_id = identity.conflict_receipt_id(op.request_id, op.digest)
    derived_otherwise = receipt(op, 2, "succeeded", "applied", receipt_id=conflict_id)
    await send(env, codec.encode(derived_otherwise))
    await quarantined(env, "revision_conflict")
    assert await operation_state(env, op) == ("accepted", "unknown", 1, None)


async def test_an_owner_revision_beyond_its_column_is_quarantined_not_dead_lettered(
    env: Env, op: Op, engine_only: InProcessFleet
) -> None:
    """Bad input gets a quarantine row with its reason: an owner revision of 2**31
    (the column is int4) is refused by the contract, not by Postgres halfway through
    the batch (which would dead-letter it and the receipts beside it)."""
    huge = receipt(op, 1).model_dump(mode="json") | {"owner_revision": 2**31}
    huge["receipt_id"] = identity.receipt_id(op.request_id, 2**31)
    await send(env, orjson.dumps(huge), codec.encode(receipt(op, 1)))
    await quarantined(env, "schema")
    await applied(env, op, 1)  # the legitimate receipt beside it applied
    depths = await broker.queue_depths(MGMT, env.vhost)
    assert depths.get(broker.QUEUE_DEAD, 0) == 0, "nothing dead-lettered"
    engine_only.check_alive()


async def test_a_known_receipt_resent_by_another_principal_is_refused_not_a_duplicate(
    env: Env, op: Op
) -> None:
    """Validation order: the seen-receipt check comes after tenant and principal. The
    exact bytes of an applied receipt, re-sent by another participant's broker user,
    are a principal mismatch (quarantined), not a harmless duplicate."""
    r = codec.encode(receipt(op, 1))
    await send(env, r)
    await applied(env, op, 1)
    await send(env, r, as_user="payments")
    await quarantined(env, "principal_mismatch")
