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
from pathlib import Path

import pytest

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
from tests.harness import order, publish_starts
from tests.proxy import Proxy, amqp_port
from workers.harness.fleet import ENGINE_WORKERS, PARTICIPANTS

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
