"""Which successors the receipt consumer activates in the receipt's own transaction
(``ReceiptConsumer._activate``; pure: its reads are given, nothing is written), and
which it leaves pending for the committer.

The seed: "A success that wins the race remains Succeeded on the operation, even when
cancellation prevents further successors" and "Workflow transition | Node state,
history, operation/attempt and dispatch intent commit together": a successor is
activated here only for an instance this transaction locked and found running, alone
for its instance in the batch, untouched by the batch's other receipts, and whose
pinned version is loaded; every other intent is the committer's, which judges it under
the instance's lock as it always did. The integration side (real locks, real commits):
tests/integration/test_receipt_activates.py.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from tests.harness import order
from workers.core import activation, lifecycle, process, records
from workers.engine.receipts import Reads, ReceiptConsumer, Step, Writes
from workers.settings import Settings

S, IS = lifecycle.Status, lifecycle.InstanceStatus


class _Answer:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self._rows = rows

    async def rows(self) -> list[dict[str, Any]]:
        return self._rows


@pytest.fixture(scope="module")
def consumer() -> ReceiptConsumer:
    settings = Settings()
    table, catalog = process.load_config(settings)
    return ReceiptConsumer(settings, cast(Any, None), None, catalog, table)


def _instance(c: ReceiptConsumer, status: str = "running", version: int = 1) -> dict[str, Any]:
    assert c.activator is not None
    return {
        "instance_id": uuid.uuid4(),
        "tenant": "acme",
        "instance_status": status,
        "process": "order-fulfilment",
        "process_version": version,
        "input": order(1),
        "traceparent": None,
        "routes": {
            name: r.model_dump(mode="json") for name, r in c.activator.routes.by_name.items()
        },
    }


def _reserved(instance: dict[str, Any], w: Writes, nxt: str = "charge") -> records.OperationRow:
    """The reserve of ``instance`` succeeding in this batch: its update and its intent."""
    row = records.OperationRow(
        id=str(uuid.uuid4()),
        tenant="acme",
        instance_id=instance["instance_id"],
        node="reserve",
        owner="inventory",
        principal="custody-inventory",
        attempt=1,
        status=S.DISPATCHED,
        effect=lifecycle.Effect.UNKNOWN,
        owner_revision=0,
        receipt_hash=None,
        process=("order-fulfilment", 1),
        created_at=datetime.now(UTC),
        instance_status=IS.RUNNING,
    )
    w.updates.append(
        records.OperationUpdate(
            id=row.id,
            expected=S.DISPATCHED,
            status=S.SUCCEEDED,
            effect=lifecycle.Effect.APPLIED,
            owner_revision=1,
            receipt_hash="h",
            result={"reservation_id": "res-1"},
            terminal=True,
        )
    )
    w.successors.append(records.SuccessorIntent(row.instance_id, row.id, S.SUCCEEDED, nxt))
    return row


async def _step(
    c: ReceiptConsumer,
    locked: list[dict[str, Any]],
    w: Writes,
    rows: list[records.OperationRow],
) -> Step:
    reads = Reads(cast(Any, _Answer(locked)), cast(Any, _Answer([])), cast(Any, _Answer([])))
    return await c._activate(reads, {r.id: r for r in rows}, w)


async def test_a_locked_running_instance_gets_its_next_node_from_the_batchs_own_result(
    consumer: ReceiptConsumer,
) -> None:
    """The charge is planned in this transaction, its input built from the reserve's
    result that this same batch writes (not yet in the table when the reads ran), and
    the intent is written done."""
    i = _instance(consumer)
    w = Writes()
    row = _reserved(i, w)
    step = await _step(consumer, [i], w, [row])
    [plan] = step.plans
    assert isinstance(plan, activation.Plan) and not step.finishes
    assert plan.node["node"] == "charge" and plan.node["activation"] == 1
    assert plan.operation.input["reservation"] == "res-1"
    assert [s.done for s in w.successors] == [True]


async def test_an_end_node_ends_the_instance_here(consumer: ReceiptConsumer) -> None:
    i = _instance(consumer)
    w = Writes()
    row = _reserved(i, w, nxt=process.END_COMPLETED)
    step = await _step(consumer, [i], w, [row])
    assert not step.plans
    [end] = step.finishes
    assert (end.instance_id, end.status) == (i["instance_id"], IS.COMPLETED)
    assert [s.done for s in w.successors] == [True]


@pytest.mark.parametrize(
    "case",
    [
        "not locked here",  # someone else holds the row: a cancel, the committer's claim
        "cancelling",
        "suspended",
        "cancelled",
        "changed in the batch",  # another receipt of the batch suspends it, say
        "two successors",
        "version not loaded",
    ],
)
async def test_anything_else_is_left_pending_for_the_committer(
    consumer: ReceiptConsumer, case: str
) -> None:
    i = _instance(
        consumer,
        status=case if case in ("cancelling", "suspended", "cancelled") else "running",
        version=99 if case == "version not loaded" else 1,
    )
    w = Writes()
    row = _reserved(i, w)
    rows = [row]
    if case == "changed in the batch":
        w.instance.append(records.InstanceChange(i["instance_id"], lifecycle.InstanceEvent.SUSPEND))
    if case == "two successors":
        rows.append(_reserved(i, w))
    locked = [] if case == "not locked here" else [i]
    step = await _step(consumer, locked, w, rows)
    assert not step.plans and not step.finishes
    assert all(not s.done for s in w.successors), w.successors
