"""Observability of real worker processes: JSON logs and the lifecycle of a SIGTERM.

Every log line is a JSON object matching tests/fixtures/log_event.schema.json with a
stable event name, also through a broker outage, and a SIGTERM'd worker logs
worker.started / worker.draining / worker.stopped and exits 0.

The shared broker and database are never stopped: a dependency is made unreachable for
one worker only, through the TCP proxy in ``tests/proxy.py``. Every wait is a bounded
poll; nothing sleeps a fixed time. The helpers live in ``tests/acceptance/observability.py``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import urllib.parse
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from contracts import codec
from contracts.models import OperationReceipt
from tests.acceptance.observability import (
    GRACE_S,
    LIFECYCLE,
    log_objects,
    poll,
    schema_errors,
    sigterm,
    start,
    status_of,
    wait_ready,
)
from tests.acceptance.support import Crew, all_finished
from tests.conftest import Env
from tests.harness import client, order, publish_starts
from tests.proxy import Proxy, amqp_port
from workers.harness.fleet import ENGINE_WORKERS, PARTICIPANTS, Proc
from workers.io import broker

pytestmark = pytest.mark.acceptance


@pytest.mark.timeout(90)
async def test_every_log_line_is_a_schema_valid_json_event_and_sigterm_logs_the_lifecycle(
    env: Env, crew: Crew, tmp_path: Path
) -> None:
    """The whole fleet (every engine worker, every participant) runs a workload and is
    SIGTERM'd: each exits 0; every line each wrote (stdout and stderr share its log
    file) is a JSON object valid against tests/fixtures/log_event.schema.json; each log
    holds worker.started, worker.draining and worker.stopped in that order, the last
    line is worker.stopped with exit_code 0 and the worker's name."""
    procs = [start(crew, w, port=0).proc for w in (*ENGINE_WORKERS, *PARTICIPANTS)]
    n = 5
    await publish_starts(env.settings, [order(i) for i in range(n)])
    await crew.wait(all_finished(env, n), timeout=45, what=f"{n} instances finished")

    codes = await asyncio.to_thread(crew.stop_all, GRACE_S)
    assert codes == {p.name: 0 for p in procs}, f"exit codes after SIGTERM: {codes}"

    errors = schema_errors(procs, tmp_path)
    assert not errors, f"log lines that break the schema:\n{errors}"
    for proc in procs:
        objects = log_objects(proc)
        events = [o["event"] for o in objects]
        positions = [events.index(e) if e in events else -1 for e in LIFECYCLE]
        assert -1 not in positions, f"{proc.name} lifecycle events missing: {events}"
        assert positions == sorted(positions), f"{proc.name} lifecycle out of order: {events}"
        assert all(events.count(e) == 1 for e in LIFECYCLE), f"{proc.name}: {events}"
        last = objects[-1]
        assert last["event"] == "worker.stopped", f"{proc.name} last line: {last}"
        assert last["exit_code"] == 0 and last["level"] == "info", last
        name = proc.name.rsplit("-", 1)[0]  # "committer-1", "participant-inventory-1"
        started = objects[events.index("worker.started")]
        assert started["worker"] == last["worker"] == name, (started, last)
        assert all(o["logger"] for o in objects)


@pytest.mark.timeout(90)
async def test_log_lines_stay_schema_valid_through_a_broker_outage(
    env: Env, crew: Crew, tmp_path: Path
) -> None:
    url = env.settings.amqp_url
    async with Proxy(amqp_port(url)) as proxy:
        s = start(crew, "publisher", CUSTODY_AMQP_URL=proxy.amqp_url(url))
        await wait_ready(crew, [s])
        proxy.cut()

        async def refused_twice() -> bool:
            return proxy.refused >= 1 and await status_of(s, "/readyz") == 503

        await poll(refused_twice, timeout=30, what="a refused reconnect", alive=[s.proc])
        proxy.heal()
        await wait_ready(crew, [s])
        assert await sigterm(crew, s.proc) == 0
    errors = schema_errors([s.proc], tmp_path)
    assert not errors, f"log lines that break the schema:\n{errors}"


# -- correlation and custody events ------------------------------------------------------

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
ISO_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{6}Z$")


def _events(proc: Proc, name: str) -> list[dict[str, Any]]:
    return [o for o in log_objects(proc) if o.get("event") == name]


async def _publish(env: Env, items: list[broker.Outgoing]) -> None:
    async with client(env.settings) as amqp:
        pub = await amqp.publisher(window=8, timeout_s=10, user_id=None)
        outcomes = await pub.publish_many(items)
    assert all(o.ok for o in outcomes), outcomes


@pytest.mark.timeout(120)
async def test_lines_inside_a_unit_carry_its_real_ids_and_a_quarantine_is_an_event(
    env: Env, crew: Crew, tmp_path: Path
) -> None:
    """At CUSTODY_LOG_LEVEL=debug, one instance started with a known traceparent: the
    committer's ``unit.done`` of the start request carries its message id, the trace id,
    the instance id and its first operation id, as the database has them; the receipt
    consumer's ``unit.done`` lines carry the operation's ids. A receipt forged for that
    operation by another user is quarantined: ``quarantine.recorded`` (a warning) with its
    reason, the message id and trace id it was sent with and the real operation and
    instance ids. Every line is schema-valid, ``ts`` ISO-8601 UTC, on stdout."""
    procs = [
        start(crew, w, port=0, CUSTODY_LOG_LEVEL="debug").proc
        for w in (*ENGINE_WORKERS, *PARTICIPANTS)
    ]
    item = broker.start_request(
        tenant="acme", process="order-fulfilment", input=order(0), requested_by="test"
    )
    await _publish(env, [replace(item, headers={"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01"})])
    await crew.wait(all_finished(env, 1), timeout=45, what="the instance finished")
    [(iid,)] = await env.sql("SELECT id::text FROM custody.instances")
    ops = await env.sql(
        "SELECT o.id::text, a.request_id::text, a.digest, o.owner FROM custody.operations o"
        " JOIN custody.attempts a ON a.operation_id = o.id AND a.kind = 'submit'"
        " WHERE o.instance_id = %s ORDER BY o.created_at",
        (iid,),
    )
    op_ids = {op for op, _, _, _ in ops}
    by = {p.name.rsplit("-", 1)[0]: p for p in procs}

    [started] = [o for o in _events(by["committer"], "unit.done") if o.get("outcome") == "started"]
    assert started["level"] == "debug" and started["worker"] == "committer"
    assert started["message_id"] == item.message_id, started
    assert started["trace_id"] == TRACE and started["instance_id"] == iid, started
    assert started["operation_id"] == ops[0][0], (started, ops)
    assert isinstance(started["duration_ms"], float) and started["batch_size"] >= 1
    # a delivery's lines (not its sender's polling units: unit=outbox.publish)
    applied = [o for o in _events(by["receipts"], "unit.done") if "unit" not in o]
    assert applied, "no unit.done line of the receipt consumer"
    for line in applied:
        assert line["trace_id"] == TRACE and line["instance_id"] == iid, line
        assert line["operation_id"] in op_ids and line["message_id"], line
    assert {o["operation_id"] for o in applied} == op_ids

    # a receipt for the first operation, from a user that is not its participant
    op, request_id, digest, owner = ops[0]
    forged = OperationReceipt(
        receipt_id=str(uuid.uuid4()),
        tenant="acme",
        operation_id=op,
        attempt=1,
        request_id=request_id,
        in_reply_to=request_id,
        owner=owner,
        principal=f"custody-{owner}",
        command_digest=digest,
        owner_revision=9,
        status="succeeded",
        effect="applied",
        result={},
        emitted_at=dt.datetime.now(dt.UTC),
    )
    forged_id = str(uuid.uuid4())
    await _publish(
        env,
        [
            broker.Outgoing(
                forged_id,
                broker.EXCHANGE_RECEIPTS,
                broker.RECEIPTS_KEY,
                codec.encode(forged),
                {"traceparent": f"00-{TRACE}-b7ad6b7169203331-01"},
            )
        ],
    )

    async def quarantined() -> bool:
        return bool(_events(by["receipts"], "quarantine.recorded"))

    await crew.wait(quarantined, timeout=30, what="quarantine.recorded in the receipts log")
    [q] = _events(by["receipts"], "quarantine.recorded")
    reason = await env.scalar(
        "SELECT reason FROM custody.quarantine WHERE message_id = %s", (forged_id,)
    )
    assert q["level"] == "warning" and q["reason"] == reason and q["detail"], q
    assert q["message_id"] == forged_id and q["trace_id"] == TRACE, q
    assert q["operation_id"] == op and q["instance_id"] == iid, q
    assert q["source"] == broker.QUEUE_RECEIPTS and q["worker"] == "receipts", q

    codes = await asyncio.to_thread(crew.stop_all, GRACE_S)
    assert set(codes.values()) == {0}, codes
    errors = schema_errors(procs, tmp_path)
    assert not errors, f"log lines that break the schema:\n{errors}"
    for proc in procs:
        for obj in log_objects(proc):
            assert ISO_UTC.match(obj["ts"]), obj
            assert dt.datetime.fromisoformat(obj["ts"]).utcoffset() == dt.timedelta(0)


@pytest.mark.timeout(90)
async def test_at_info_no_unit_line_is_written(env: Env, crew: Crew) -> None:
    s = start(crew, "committer", port=0)
    await publish_starts(env.settings, [order(0)])

    async def committed() -> bool:
        return bool(await env.scalar("SELECT count(*) FROM custody.instances"))

    await crew.wait(committed, timeout=30, what="the instance committed")
    assert await sigterm(crew, s.proc) == 0
    events = {o["event"] for o in log_objects(s.proc)}
    assert "unit.done" not in events and not {o["level"] for o in log_objects(s.proc)} & {"debug"}


@pytest.mark.timeout(90)
async def test_a_broker_connection_killed_is_a_custody_loss_and_reconnect(
    env: Env, crew: Crew
) -> None:
    """The broker closes a worker's connection (management API DELETE, as an operator or
    a node shutdown would): the worker logs ``broker.connection_lost`` with the node and
    the broker's reason, then ``broker.connected`` with phase ``reconnect`` and how long
    it was down, and serves again."""
    s = start(crew, "receipts")
    await wait_ready(crew, [s])
    names: list[str] = []

    async def listed() -> bool:
        # the management API lists a new connection after its stats interval
        connections = await broker.management(
            env.settings.amqp_management_url,
            "GET",
            f"/api/vhosts/{urllib.parse.quote(env.vhost, safe='')}/connections"
            "?columns=name,client_properties",
        )
        names[:] = [
            c["name"]
            for c in connections or []
            if (c.get("client_properties") or {}).get("connection_name") == "custody-receipts"
        ]
        return bool(names)

    await poll(listed, timeout=30, what="the worker's connection listed", alive=[s.proc])
    for name in names:
        await broker.management(
            env.settings.amqp_management_url,
            "DELETE",
            f"/api/connections/{urllib.parse.quote(name, safe='')}",
        )

    async def reconnected() -> bool:
        return any(o.get("phase") == "reconnect" for o in _events(s.proc, "broker.connected"))

    await poll(reconnected, timeout=30, what="broker.connected phase=reconnect", alive=[s.proc])
    [lost] = _events(s.proc, "broker.connection_lost")
    assert lost["level"] == "warning" and lost["worker"] == "receipts", lost
    assert lost["node"] and "CONNECTION_FORCED" in lost["error"], lost
    back = next(o for o in _events(s.proc, "broker.connected") if o["phase"] == "reconnect")
    assert back["down_s"] >= 0 and back["ts"] >= lost["ts"], back
    await wait_ready(crew, [s])
    assert await sigterm(crew, s.proc) == 0
