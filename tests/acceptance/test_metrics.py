"""Observability of real worker processes: probes and metrics.

Every worker type serves /healthz, /readyz and /metrics (CUSTODY_METRICS_PORT); the
metrics text passes ``promtool check metrics`` and each process exports the metric
families it owns (``OWNED``), and a malformed receipt is counted as a quarantine.

The shared broker and database are never stopped: a dependency is made unreachable for
one worker only, through the TCP proxy in ``tests/proxy.py``. Every wait is a bounded
poll; nothing sleeps a fixed time. The helpers live in ``tests/acceptance/observability.py``.
"""

from __future__ import annotations

import uuid

import pytest

from tests.acceptance.observability import (
    ISSUE_FAMILIES,
    OWNED,
    Expect,
    declared,
    metrics_text,
    missing,
    promtool_check,
    start,
    status_of,
    wait_ready,
)
from tests.acceptance.support import Crew, all_finished, state
from tests.conftest import Env
from tests.harness import order, publish_raw, publish_starts
from workers.harness.fleet import ENGINE_WORKERS
from workers.io import broker

pytestmark = pytest.mark.acceptance


@pytest.mark.timeout(90)
async def test_every_worker_serves_probes_and_promtool_clean_metrics_with_the_families_it_owns(
    env: Env, crew: Crew
) -> None:
    """Each worker type (and a participant) as a real process with CUSTODY_METRICS_PORT:
    /healthz 200, /readyz 200 once connected, unknown paths 404; after a small workload
    (5 instances, one malformed start request, one malformed receipt, one unroutable
    outbox row, one expired lease) every /metrics text passes ``promtool check metrics``
    silently, declares every family the issue lists, and the process that owns each
    family exports its samples."""
    served = {w: start(crew, w) for w in (*ENGINE_WORKERS, "inventory")}
    for other in ("payments", "shipping"):
        start(crew, other, port=0)
    await wait_ready(crew, served.values())
    for s in served.values():
        assert await status_of(s, "/nope") == 404, s.proc.name

    n = 5
    await publish_starts(env.settings, [order(i) for i in range(n)])
    await publish_raw(env.settings, broker.EXCHANGE_REQUESTS, broker.START_KEY, [b"{not json"])
    await publish_raw(env.settings, broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY, [b"[1, 2"])
    # An outbox row no queue is bound for: the broker returns it (mandatory publish).
    await env.sql(
        "INSERT INTO custody.outbox (id, kind, exchange, routing_key, body)"
        " VALUES (%s, 'query', %s, 'nobody.v1', %s)",
        (uuid.uuid4(), broker.EXCHANGE_COMMANDS, b"{}"),
    )
    await crew.wait(all_finished(env, n), timeout=45, what=f"{n} instances finished")
    # The reconciler's lease expires under it (a paused zombie): its heartbeat finds out.
    await env.sql(
        "UPDATE custody.leases SET expires_at = clock_timestamp() - interval '1 second'"
        " WHERE worker = 'reconciler'"
    )

    texts: dict[str, str] = {}

    async def all_exported() -> bool:
        for w, s in served.items():
            texts[w] = await metrics_text(s)
        return not any(missing(texts[w], OWNED[w]) for w in served)

    try:
        await crew.wait(all_exported, timeout=30, what="every owned metric sample")
    except AssertionError as exc:
        gaps = {w: missing(texts.get(w, ""), OWNED[w]) for w in served}
        raise AssertionError(f"{exc}: {gaps}; state {await state(env)}") from None

    quarantined = dict(await env.sql("SELECT source, reason FROM custody.quarantine"))
    for w, source in (("committer", broker.QUEUE_REQUESTS), ("receipts", broker.QUEUE_RECEIPTS)):
        reason = quarantined[source]
        assert not missing(texts[w], [Expect("custody_quarantined_total", {"reason": reason})]), (
            f"{w} exports no quarantine sample with the stored reason {reason!r}"
        )

    for w, text in texts.items():
        families = declared(text)
        absent = [f for f in ISSUE_FAMILIES if f not in families]
        assert not absent, f"{w} /metrics does not declare {absent}"
        assert families["custody_publish_confirm_latency_seconds"] == "histogram"
        assert families["custody_operation_end_to_end_seconds"] == "histogram"
        assert families["custody_operations"] == "gauge"
        assert families["custody_outbox_pending_rows"] == "gauge"
        rc, out = promtool_check(text)
        assert rc == 0 and out == "", f"promtool check metrics on {w}: rc {rc}\n{out}"


@pytest.mark.timeout(90)
async def test_a_malformed_receipt_is_counted_in_custody_receipts_total_as_quarantine(
    env: Env, crew: Crew
) -> None:
    """custody_receipts_total is "receipts handled by the receipt consumer, by verdict":
    a receipt that does not even decode is handled (quarantined and acked), so it must
    be counted with verdict="quarantine", like a decoded receipt that is refused."""
    receipts = start(crew, "receipts")
    await wait_ready(crew, [receipts])
    await publish_raw(env.settings, broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY, [b"[1, 2"])

    async def quarantined() -> bool:
        return bool(await env.scalar("SELECT count(*) FROM custody.quarantine"))

    await crew.wait(quarantined, timeout=30, what="the malformed receipt quarantined")
    text = ""

    async def counted() -> bool:
        nonlocal text
        text = await metrics_text(receipts)
        return not missing(text, [Expect("custody_quarantined_total", {}, 1)])

    await crew.wait(counted, timeout=10, what="custody_quarantined_total")
    assert not missing(text, [Expect("custody_receipts_total", {"verdict": "quarantine"}, 1)]), (
        "custody_receipts_total has no verdict=quarantine sample for the malformed receipt:\n"
        + "\n".join(line for line in text.splitlines() if "custody_receipts" in line)
    )
