"""Observability of real worker processes: trace context.

The W3C trace context of a start request is stored with the instance and each outbox
row and carried in the commands' AMQP headers, never in their digest; a participant's
receipt continues the command's trace.

The shared broker and database are never stopped: a dependency is made unreachable for
one worker only, through the TCP proxy in ``tests/proxy.py``. Every wait is a bounded
poll; nothing sleeps a fixed time. The helpers live in ``tests/acceptance/observability.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import aio_pika
import pytest

from contracts import codec
from contracts.models import SubmitCommand
from tests.acceptance.observability import (
    TRACEPARENT,
    Expect,
    metrics_text,
    missing,
    start,
)
from tests.acceptance.support import Crew, all_finished
from tests.conftest import Env
from tests.harness import client, order, publish_starts
from workers.core import commands
from workers.harness.fleet import ENGINE_WORKERS, PARTICIPANTS
from workers.io import broker

pytestmark = pytest.mark.acceptance


def trace_parts(value: Any) -> tuple[str, str, str]:
    if isinstance(value, bytes):
        value = value.decode()
    match = TRACEPARENT.match(value if isinstance(value, str) else "")
    assert match, f"not a W3C traceparent: {value!r}"
    return match.group(1), match.group(2), match.group(3)


@pytest.mark.timeout(90)
async def test_traceparent_is_stored_with_the_outbox_row_carried_in_headers_and_not_digested(
    env: Env, crew: Crew
) -> None:
    """A start request carrying traceparent T: the instance stores T; the first command's
    outbox row stores a child of T in its headers column; the command message on the
    broker carries that traceparent (same trace id, new span id) and its body does not;
    the body's digest is its semantic digest. Replaying the identical command with a
    different traceparent is, for the participant, a duplicate with the same digest (no
    conflict, no refusal); and the successor commands stay in trace T."""
    trace_id, parent_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    traceparent = f"00-{trace_id}-{parent_span}-01"
    binding = "inventory.v1"

    connection = await aio_pika.connect_robust(env.settings.amqp_url)
    try:
        channel = await connection.channel()
        spy = await channel.declare_queue("", exclusive=True, auto_delete=True)
        await spy.bind(broker.EXCHANGE_COMMANDS, routing_key=binding)
        # Only the committer and the publisher: the command stays in its queue and the
        # spy gets a copy.
        for w in ("committer", "publisher"):
            start(crew, w, port=0)
        [start_id] = await publish_starts(env.settings, [order(1)], traceparent=traceparent)

        message: aio_pika.abc.AbstractIncomingMessage | None = None

        async def got_command() -> bool:
            nonlocal message
            message = await spy.get(no_ack=True, fail=False)
            return message is not None

        await crew.wait(got_command, timeout=30, what="the command on the spy queue")
        assert message is not None
        header = (message.headers or {}).get("traceparent")
        got_trace, got_span, flags = trace_parts(header)
        assert got_trace == trace_id, f"command trace id {got_trace}, start request's {trace_id}"
        assert got_span != parent_span, "the command must be a new span, not the caller's"
        assert flags == "01"

        stored = await env.sql(
            "SELECT o.headers->>'traceparent', o.body, i.traceparent FROM custody.outbox o"
            " JOIN custody.operations op ON op.id = o.operation_id"
            " JOIN custody.instances i ON i.id = op.instance_id WHERE o.id = %s",
            (message.message_id,),
        )
        assert stored, f"no outbox row {message.message_id}"
        row_traceparent, row_body, instance_traceparent = stored[0]
        assert row_traceparent == (header.decode() if isinstance(header, bytes) else header), (
            "the published header is not the outbox row's stored traceparent"
        )
        assert instance_traceparent == traceparent, "the instance keeps the caller's traceparent"
        assert bytes(row_body) == message.body, "the published body is not the outbox row's"

        command = codec.decode_command(message.body)
        assert isinstance(command, SubmitCommand)
        assert command.semantic_digest() == command.digest
        assert b"traceparent" not in message.body and trace_id.encode() not in message.body
        assert parent_span.encode() not in message.body and got_span.encode() not in message.body
        # The digest covers exactly the command's fields: a copy that differs in anything
        # semantic has another digest, while no field exists for a trace to change.
        assert "traceparent" not in SubmitCommand.model_fields
        changed = command.model_copy(update={"input": {**command.input, "quantity": 2}})
        assert changed.semantic_digest() != command.digest
        # The engine's own command builder, given the same pinned identity under two other
        # traces: the same digest (the published one), different trace headers.
        pinned = commands.Pinned(
            operation_id=command.operation_id,
            tenant=command.tenant,
            attempt=command.attempt,
            operation=command.operation,
            route=command.target.route,
            owner=command.target.owner,
            binding=command.target.binding,
            input=command.input,
            lineage=command.lineage.model_dump(mode="json"),
        )
        rebuilt = [
            commands.submit(pinned, traceparent=f"00-{uuid.uuid4().hex}-{parent_span}-01")
            for _ in range(2)
        ]
        assert {r.digest for r in rebuilt} == {command.digest}
        assert {r.request_id for r in rebuilt} == {command.request_id}
        headers = [r.outbox_row["headers"]["traceparent"] for r in rebuilt]
        assert headers[0] != headers[1], "the trace lives in the headers, not the identity"

        # Replay the identical command under another trace, then let the participant in.
        other = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
        await publish_with_headers(
            env, binding, message.body, message.message_id or "", {"traceparent": other}
        )
        replay = None

        async def got_replay() -> bool:
            nonlocal replay
            replay = await spy.get(no_ack=True, fail=False)
            return replay is not None

        await crew.wait(got_replay, timeout=10, what="the replay on the spy queue")
        assert replay is not None and trace_parts(replay.headers["traceparent"])[0] != trace_id
        replayed = codec.decode_command(replay.body)
        assert isinstance(replayed, SubmitCommand)
        assert replayed.semantic_digest() == command.digest
    finally:
        await connection.close()

    inventory = start(crew, "inventory")
    for w in ("receipts", "reconciler", "payments", "shipping"):
        start(crew, w, port=0)
    await crew.wait(all_finished(env, 1), timeout=45, what="the instance finished")
    text = ""

    async def duplicate_counted() -> bool:
        nonlocal text
        text = await metrics_text(inventory)
        return not missing(
            text,
            [
                Expect("custody_participant_commands_total", {"decision": "accepted"}, 1),
                Expect("custody_participant_commands_total", {"decision": "duplicate"}, 1),
            ],
        )

    await crew.wait(duplicate_counted, timeout=20, what="the participant's decisions")
    assert missing(text, [Expect("custody_participant_commands_total", {"decision": "conflict"})])
    inbox = await env.sql(
        "SELECT request_id::text, digest FROM participant_inventory.inbox", participant=True
    )
    assert inbox == [(command.request_id, command.digest)], inbox
    for table in ("conflicts", "refused"):
        rows = await env.scalar(
            f"SELECT count(*) FROM participant_inventory.{table}", participant=True
        )
        assert rows == 0, f"participant_inventory.{table} has {rows} rows"

    rows = await env.sql(
        "SELECT o.routing_key, o.headers->>'traceparent' FROM custody.outbox o"
        " JOIN custody.operations op ON op.id = o.operation_id"
        " JOIN custody.instances i ON i.id = op.instance_id"
        " WHERE i.start_request_id = %s ORDER BY o.created_at",
        (start_id,),
    )
    assert [r[0] for r in rows] == ["inventory.v1", "payments.v1", "shipping.v1"], rows
    parts = [trace_parts(r[1]) for r in rows]
    assert {p[0] for p in parts} == {trace_id}, f"every command of the instance in trace T: {rows}"
    spans = [p[1] for p in parts]
    assert len(set(spans)) == len(spans) and parent_span not in spans, spans


async def publish_with_headers(
    env: Env, routing_key: str, body: bytes, message_id: str, headers: Mapping[str, Any]
) -> None:
    async with client(env.settings, "replay") as amqp:
        pub = await amqp.publisher(window=8, timeout_s=10, user_id=None)
        [outcome] = await pub.publish_many(
            [broker.Outgoing(message_id, broker.EXCHANGE_COMMANDS, routing_key, body, headers)]
        )
    assert outcome.ok, outcome.error


@pytest.mark.timeout(90)
async def test_a_participants_receipt_continues_the_commands_trace(env: Env, crew: Crew) -> None:
    """The receipt answering a command is published in the command's trace (same trace
    id, its own span), through the participant's outbox row headers."""
    connection = await aio_pika.connect_robust(env.settings.amqp_url)
    try:
        channel = await connection.channel()
        spy = await channel.declare_queue("", exclusive=True, auto_delete=True)
        await spy.bind(broker.EXCHANGE_RECEIPTS, routing_key=broker.RECEIPTS_KEY)
        for w in (*ENGINE_WORKERS, *PARTICIPANTS):
            start(crew, w, port=0)
        await publish_starts(env.settings, [order(1)])
        await crew.wait(all_finished(env, 1), timeout=45, what="the instance finished")
        command_trace = trace_parts(
            await env.scalar(
                "SELECT headers->>'traceparent' FROM custody.outbox WHERE routing_key = %s",
                ("inventory.v1",),
            )
        )[0]
        receipts: list[aio_pika.abc.AbstractIncomingMessage] = []

        async def drained() -> bool:
            got = await spy.get(no_ack=True, fail=False)
            if got is not None:
                receipts.append(got)
            # one terminal receipt per operation (the samples' handlers run inline:
            # they make no accepted receipt)
            return got is None and len(receipts) >= 3

        await crew.wait(drained, timeout=20, what="the receipts on the spy queue")
    finally:
        await connection.close()
    stored = await env.sql(
        "SELECT headers->>'traceparent' FROM participant_inventory.outbox", participant=True
    )
    assert stored and all(r[0] for r in stored), f"participant outbox headers: {stored}"
    inventory = [r for r in receipts if r.user_id == "custody-inventory"]
    assert inventory, "no receipt from inventory"
    for r in inventory:
        assert trace_parts((r.headers or {}).get("traceparent"))[0] == command_trace
