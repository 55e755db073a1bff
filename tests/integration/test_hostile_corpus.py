"""A corpus of hostile messages into every queue the fleet consumes, while real work
runs: real work completes with exactly-once effects; every hostile message ends
quarantined (engine), refused (participant), or recorded stale, with its reason; no
worker stops."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from prometheus_client import REGISTRY

from contracts import codec, identity
from contracts.models import StartRequest
from tests.acceptance.support import assert_effects_once
from tests.conftest import Env, wait_until
from tests.harness import InProcessFleet, order, publish_raw, publish_starts
from tests.integration.test_participant import submit
from workers.io import broker
from workers.settings import ROOT

MALFORMED = [
    b"{",
    b"",
    b"null",
    b"[1, 2]",
    b"\xff\xfe\x00",
    b'{"type": "custody.',
    b"42",
    b'{"a": NaN}',
    b'"string"',
    b"{}",
]


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(depth):
        value = {"n": value}
    return value


def start_body(**overrides: Any) -> bytes:
    data = orjson.loads(
        codec.encode(
            StartRequest(
                tenant="acme",
                start_request_id=str(uuid.uuid4()),
                process="order-fulfilment",
                input=order(0),
                requested_by="hostile",
            )
        )
    )
    data.update(overrides)
    return orjson.dumps(data)


def hostile_starts(real_start_id: str) -> list[bytes]:
    out = list(MALFORMED)
    out += [start_body(input={"blob": "x" * (300_000 + i)}) for i in range(5)]
    out += [start_body(input=nested(40 + i)) for i in range(5)]
    out += [start_body(type=f"custody.start.v{2 + i}") for i in range(5)]
    out += [start_body(input={"amount": 1.5 + i}) for i in range(5)]
    out += [start_body(process=f"no-such-process-{i}") for i in range(5)]
    out += [start_body(start_request_id=real_start_id, input=order(1000 + i)) for i in range(5)]
    out += [start_body(input={"note": f"nul\u0000{i}"}) for i in range(5)]
    return out  # 45


def receipt_body(op: dict[str, Any], **overrides: Any) -> bytes:
    data: dict[str, Any] = {
        "type": "custody.receipt.v1",
        "receipt_id": str(uuid.uuid4()),
        "tenant": "acme",
        "operation_id": op["id"],
        "attempt": 1,
        "request_id": op["request_id"],
        "in_reply_to": op["request_id"],
        "owner": "inventory",
        "principal": "custody-inventory",
        "command_digest": op["digest"],
        "owner_revision": 9,
        "status": "succeeded",
        "effect": "applied",
        "result": {"forged": True},
        "error": None,
        "emitted_at": datetime.now(UTC).isoformat(),
    }
    data.update(overrides)
    if "receipt_id" not in overrides:  # derived from its request and revision, as a
        data["receipt_id"] = identity.receipt_id(data["request_id"], data["owner_revision"])
    return orjson.dumps(data)


def hostile_receipts(done: list[dict[str, Any]]) -> dict[str, list[bytes]]:
    """Receipts by publishing user; every one refers to work that already finished."""
    ops = [done[i % len(done)] for i in range(10)]
    as_inventory: list[bytes] = list(MALFORMED)
    as_inventory += [receipt_body(ops[i], result={"blob": "y" * (300_000 + i)}) for i in range(5)]
    as_inventory += [receipt_body(ops[i], result=nested(40 + i)) for i in range(5)]
    as_inventory += [receipt_body(op, tenant="globex") for op in ops]
    as_inventory += [receipt_body(op, operation_id=str(uuid.uuid4())) for op in ops]
    as_inventory += [receipt_body(op, request_id=str(uuid.uuid4())) for op in ops]
    as_inventory += [receipt_body(op, command_digest="e" * 64) for op in ops]
    # replays of real receipt ids with changed content
    as_inventory += [
        receipt_body(op, receipt_id=identity.receipt_id(op["request_id"], 2), owner_revision=2)
        for op in ops
    ]
    # older revisions (new ids, derived the only other way one can be): recorded
    # stale, never applied
    stale = [
        receipt_body(
            op,
            receipt_id=identity.conflict_receipt_id(op["request_id"], op["digest"]),
            owner_revision=1,
            status="failed",
            effect="none",
            result=None,
            error={"code": "late", "message": "old news"},
        )
        for op in ops
    ]
    forged = [receipt_body(op) for op in ops]  # claims inventory, published by payments
    unsigned = [receipt_body(op) for op in ops]  # published by guest without user_id
    return {"inventory": as_inventory, "stale": stale, "payments": forged, "guest": unsigned}


def hostile_commands(owner: str) -> list[bytes]:
    binding = f"{owner}.v1"
    good = submit()
    data = orjson.loads(codec.encode(good))
    out = list(MALFORMED[:5])
    out += [orjson.dumps({**data, "input": {"blob": "z" * (300_000 + i)}}) for i in range(3)]
    out += [orjson.dumps({**data, "type": f"custody.command.submit.v{2 + i}"}) for i in range(3)]
    out += [
        orjson.dumps(
            {
                **data,
                "request_id": str(uuid.uuid4()),
                "target": {"route": "x", "owner": "mallory", "binding": binding},
            }
        )
        for _ in range(5)
    ]
    out += [
        orjson.dumps(
            {
                **data,
                "request_id": str(uuid.uuid4()),
                "digest": "d" * 64,
                "target": {"route": owner, "owner": owner, "binding": binding},
            }
        )
        for _ in range(5)
    ]
    out += [orjson.dumps({**data, "input": {"x": f"\u0000{i}"}}) for i in range(3)]
    return out  # 24


@pytest.fixture
async def fleet(env: Env) -> AsyncIterator[InProcessFleet]:
    f = InProcessFleet(env)
    f.start_all()
    yield f
    await f.stop_all()


def _quarantine_metric() -> float:
    return sum(
        s.value
        for m in REGISTRY.collect()
        if m.name == "custody_quarantined"
        for s in m.samples
        if s.name == "custody_quarantined_total"
    )


async def test_a_hostile_corpus_into_every_queue_changes_nothing_while_real_work_completes(
    env: Env, fleet: InProcessFleet
) -> None:
    metric_before = _quarantine_metric()
    first = await publish_starts(env.settings, [order(i) for i in range(30)])

    async def some_done() -> bool:
        return (
            await env.scalar("SELECT count(*) FROM custody.instances WHERE status = 'completed'")
            >= 10
        )

    await wait_until(some_done, timeout=60, what="the first instances to complete")
    done = [
        dict(zip(("id", "request_id", "digest"), r, strict=True))
        for r in await env.sql(
            "SELECT o.id::text, a.request_id::text, o.digest FROM custody.operations o"
            " JOIN custody.attempts a ON a.operation_id = o.id"
            " WHERE o.node = 'reserve' AND o.status = 'succeeded' LIMIT 10"
        )
    ]
    starts = hostile_starts(first[0])
    receipts = hostile_receipts(done)
    commands = {owner: hostile_commands(owner) for owner in ("inventory", "payments", "shipping")}
    total = len(starts) + sum(map(len, receipts.values())) + sum(map(len, commands.values()))
    assert total >= 200

    s = env.settings
    await asyncio.gather(
        publish_starts(s, [order(i) for i in range(100, 130)]),  # real work, concurrently
        publish_raw(s, broker.EXCHANGE_REQUESTS, broker.START_KEY, starts),
        publish_raw(
            env.participant_settings("inventory"),
            broker.EXCHANGE_RECEIPTS,
            broker.RECEIPTS_KEY,
            receipts["inventory"] + receipts["stale"],
            user_id="custody-inventory",
        ),
        publish_raw(
            env.participant_settings("payments"),
            broker.EXCHANGE_RECEIPTS,
            broker.RECEIPTS_KEY,
            receipts["payments"],
            user_id="custody-payments",
        ),
        publish_raw(s, broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY, receipts["guest"]),
        *(
            publish_raw(s, broker.EXCHANGE_COMMANDS, f"{owner}.v1", bodies)
            for owner, bodies in commands.items()
        ),
    )

    engine_expected = (
        len(starts)
        + len(receipts["inventory"])
        + len(receipts["payments"])
        + len(receipts["guest"])
    )

    async def settled() -> bool:
        completed = await env.scalar(
            "SELECT count(*) FROM custody.instances WHERE status = 'completed'"
        )
        quarantined = await env.scalar("SELECT count(*) FROM custody.quarantine")
        return completed == 60 and quarantined >= engine_expected

    await wait_until(settled, timeout=90, what="real work done and the corpus quarantined")
    fleet.check_alive()

    by_source = dict(await env.sql("SELECT source, count(*) FROM custody.quarantine GROUP BY 1"))
    assert by_source == {
        broker.QUEUE_REQUESTS: len(starts),
        broker.QUEUE_RECEIPTS: engine_expected - len(starts),
    }
    reasons = dict(await env.sql("SELECT reason, count(*) FROM custody.quarantine GROUP BY 1"))
    assert reasons["principal_mismatch"] == 10
    assert reasons["missing_user_id"] == 10
    assert reasons["wrong_tenant"] == 10
    assert reasons["digest_mismatch"] == 10
    assert reasons["receipt_id_reuse"] == 10
    assert reasons["start_conflict"] == 5
    assert reasons["unknown_process"] == 5
    stale_ids = [orjson.loads(b)["receipt_id"] for b in receipts["stale"]]
    assert await env.scalar(
        "SELECT count(*) FROM custody.receipt_inbox WHERE decision = 'stale'"
        " AND receipt_id = ANY(%s::uuid[])",
        (stale_ids,),
    ) == len(stale_ids), "every older revision is recorded as stale, none applied"
    for owner, bodies in commands.items():

        async def refused(owner: str = owner, n: int = len(bodies)) -> bool:
            return (
                await env.scalar(
                    f"SELECT count(*) FROM participant_{owner}.refused", participant=True
                )
                == n
            )

        await wait_until(refused, timeout=15, what=f"{owner}'s refusals recorded")
    depths = await broker.queue_depths(s.amqp_management_url, env.vhost)
    assert depths.get(broker.QUEUE_DEAD, 0) == 0

    # real work: exactly once, untouched by the corpus
    assert (
        await env.scalar("SELECT count(*) FROM custody.operations WHERE status <> 'succeeded'") == 0
    )
    await assert_effects_once(env, 60)
    forged = await env.scalar(
        "SELECT count(*) FROM custody.operations WHERE result ? 'forged' OR owner_revision > 2"
    )
    assert forged == 0

    assert _quarantine_metric() - metric_before == engine_expected + sum(
        map(len, commands.values())
    )
    listing = subprocess.run(
        [sys.executable, "-m", "workers.cli", "quarantine", "list", "--json", "--limit", "1000"],
        cwd=ROOT,
        env={**os.environ, "CUSTODY_DATABASE_URL": s.database_url},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    rows = json.loads(listing.stdout)
    assert len(rows) == engine_expected
    assert all(r["reason"] and r["detail"] for r in rows)
