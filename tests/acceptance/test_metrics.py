"""Observability of real worker processes: probes and metrics.

Every worker type serves /healthz, /readyz and /metrics (CUSTODY_METRICS_PORT); the
metrics text passes ``promtool check metrics``, each process exports exactly the metric
families its worker type owns (``workers.runtime.metrics.FAMILIES``) with samples for
them (``OWNED``) and its build info, and a malformed receipt is counted as a
quarantine. A deliberate dispatch pause shows in the dispatch gauges and never as an
outbox row waiting to be sent; a fenced confirm mark is one lease loss of the worker.

The shared broker and database are never stopped: a dependency is made unreachable for
one worker only, through the TCP proxy in ``tests/proxy.py``. Every wait is a bounded
poll; nothing sleeps a fixed time. The helpers live in ``tests/acceptance/observability.py``.
"""

from __future__ import annotations

import os
import platform
import signal
import uuid

import pytest

from tests.acceptance.observability import (
    ISSUE_FAMILIES,
    OWNED,
    WORKER_NAMES,
    Expect,
    Served,
    declared,
    metrics_text,
    missing,
    promtool_check,
    samples,
    start,
    status_of,
    wait_ready,
)
from tests.acceptance.support import Crew, all_finished, freeze_past_lease, state
from tests.conftest import Env
from tests.harness import order, publish_raw, publish_starts
from workers.core import names
from workers.harness.fleet import ENGINE_WORKERS
from workers.io import broker
from workers.runtime import metrics
from workers.settings import ROOT

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

    everywhere: dict[str, str] = {}
    for w, text in texts.items():
        families = declared(text)
        everywhere.update(families)
        # only the owner exports a family: no other process's 0 for a scaler to read
        exported = {f for f in families if f.startswith("custody_") and not f.endswith("_created")}
        owns = {
            f.name + ("_total" if f.kind == "counter" else "")  # as the TYPE line names it
            for f in metrics.owned(names.kind_of(WORKER_NAMES[w]))
        }
        assert exported == owns, (
            f"{w} exports families it does not own: {sorted(exported - owns)}; "
            f"lacks its own: {sorted(owns - exported)}"
        )
        build = {
            "worker": WORKER_NAMES[w],
            "version": metrics.version(),
            "python": platform.python_version(),
            "revision": metrics.git_head(ROOT) or "unknown",
        }
        assert not missing(text, [Expect("custody_build_info", build, 1)]), (
            f"{w}: no custody_build_info{build}:\n"
            + "\n".join(line for line in text.splitlines() if "build_info" in line)
        )
        rc, out = promtool_check(text)
        assert rc == 0 and out == "", f"promtool check metrics on {w}: rc {rc}\n{out}"
    absent = [f for f in ISSUE_FAMILIES if f not in everywhere]
    assert not absent, f"no process declares {absent}"
    assert everywhere["custody_publish_confirm_latency_seconds"] == "histogram"
    assert everywhere["custody_operation_end_to_end_seconds"] == "histogram"
    assert everywhere["custody_operations"] == "gauge"
    assert everywhere["custody_outbox_pending_rows"] == "gauge"
    # the committer's successor-backlog trigger reads the reconciler's gauge alone
    assert "custody_successor_intents_pending" in declared(texts["reconciler"])
    assert "custody_successor_intents_pending" not in declared(texts["committer"])


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


def _values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(labels, value) for n, labels, value in samples(text) if n == name]


@pytest.mark.timeout(120)
async def test_a_deliberate_dispatch_pause_is_counted_as_held_never_as_a_stuck_outbox(
    env: Env, crew: Crew
) -> None:
    """A submit held by the global pause (``custody dispatch pause``), then by its
    instance's pause, stays pending on purpose: the publisher's outbox gauges (what
    ``CustodyOutboxStuck`` and the publisher's scaler read) do not count it, however old
    it gets, while the reconciler's dispatch gauges show the pauses and the held submit;
    resumed, it is sent and nothing is held."""
    publisher, reconciler = start(crew, "publisher"), start(crew, "reconciler")
    start(crew, "committer", port=0)
    await wait_ready(crew, [publisher, reconciler])
    await env.sql("UPDATE custody.control SET dispatch_paused = true")
    await publish_starts(env.settings, [order(0)])

    async def held_submit() -> bool:
        return bool(
            await env.scalar(
                "SELECT count(*) FROM custody.outbox WHERE kind = 'submit' AND status = 'pending'"
                " AND created_at < now() - interval '2 seconds'"
            )
        )

    await crew.wait(held_submit, timeout=30, what="a submit held for 2s by the global pause")

    async def shows(text_of: Served, name: str, labels: dict[str, str], value: float) -> bool:
        text = await metrics_text(text_of)
        got = [v for lab, v in _values(text, name) if labels.items() <= lab.items()]
        return got == [value]

    async def paused_globally() -> bool:
        return await shows(
            reconciler, "custody_dispatch_paused", {"owner": "engine", "scope": "global"}, 1
        ) and await shows(reconciler, "custody_dispatch_held_submits", {}, 1)

    await crew.wait(paused_globally, timeout=20, what="the reconciler's global-pause gauges")
    text = await metrics_text(publisher)
    assert _values(text, "custody_outbox_pending_rows") == [({"owner": "engine"}, 0.0)], text
    assert _values(text, "custody_outbox_oldest_pending_age_seconds") == [
        ({"owner": "engine"}, 0.0)
    ], "a submit held by the global pause counted as waiting to be sent"
    assert _values(text, "custody_dispatch_paused") == [
        ({"owner": "engine", "scope": "publisher"}, 0.0)
    ], "the publisher was started without CUSTODY_DISPATCH_PAUSED"

    # the instance's own pause holds it too, once the global one is lifted
    await env.sql("UPDATE custody.instances SET dispatch_paused = true")
    await env.sql("UPDATE custody.control SET dispatch_paused = false")

    async def paused_for_the_instance() -> bool:
        return (
            await shows(reconciler, "custody_dispatch_paused", {"scope": "global"}, 0)
            and await shows(reconciler, "custody_dispatch_paused_instances", {}, 1)
            and await shows(reconciler, "custody_dispatch_held_submits", {}, 1)
        )

    await crew.wait(paused_for_the_instance, timeout=20, what="the instance-pause gauges")
    text = await metrics_text(publisher)
    assert _values(text, "custody_outbox_oldest_pending_age_seconds") == [
        ({"owner": "engine"}, 0.0)
    ], "a submit held by its instance's pause counted as waiting to be sent"

    await env.sql("UPDATE custody.instances SET dispatch_paused = false")

    async def sent() -> bool:
        return not await env.scalar(
            "SELECT count(*) FROM custody.outbox WHERE kind = 'submit' AND status = 'pending'"
        ) and await shows(reconciler, "custody_dispatch_held_submits", {}, 0)

    await crew.wait(sent, timeout=30, what="the resumed submit sent and nothing held")


@pytest.mark.timeout(120)
async def test_a_fenced_confirm_mark_counts_one_lease_loss_labelled_with_the_worker(
    env: Env, crew: Crew
) -> None:
    """The committer (which sends the submits it commits) freezes between a confirm and
    its mark, past its lease; resumed, its heartbeat takes the lease back (epoch 2) and
    the mark is refused by the fence (``lease.fenced``). That is one lease loss:
    ``custody_lease_losses_total`` is 1, for ``worker="committer"``, and there is no
    sample for the outbox's owner (``engine``)."""
    zombie = start(crew, "committer", CUSTODY_STOP_POINTS="after_confirm_before_mark")
    await wait_ready(crew, [zombie])
    await publish_starts(env.settings, [order(0)])

    holder = await freeze_past_lease(env, zombie.proc, "committer")
    os.kill(zombie.proc.popen.pid, signal.SIGCONT)

    async def fenced_and_retaken() -> bool:
        epoch = await env.scalar(
            "SELECT max(epoch) FROM custody.leases WHERE holder LIKE %s", (holder,)
        )
        return epoch == 2 and "lease.fenced" in zombie.proc.log.read_text()

    await crew.wait(fenced_and_retaken, timeout=30, what="the mark fenced and the lease retaken")
    # one more start through the resumed committer: it works on under epoch 2
    published = sum(
        v for _, v in _values(await metrics_text(zombie), "custody_outbox_published_total")
    )
    await publish_starts(env.settings, [order(1)])

    async def moved_on() -> bool:
        text = await metrics_text(zombie)
        return sum(v for _, v in _values(text, "custody_outbox_published_total")) > published

    await crew.wait(moved_on, timeout=30, what="the resumed committer to publish again")
    losses = _values(await metrics_text(zombie), "custody_lease_losses_total")
    assert losses == [({"worker": "committer"}, 1.0)], (
        f"one lease loss of worker committer, counted once; got {losses}"
    )
