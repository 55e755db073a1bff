"""What the observability acceptance tests share (test_metrics, test_probes, test_logs,
test_traces, test_secrets): the tools they run, the metric families each process owns,
starting a worker that serves HTTP, bounded polls, and reading metrics text and JSON
log lines."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.acceptance.support import Crew
from tests.conftest import Env
from tests.harness import publish_raw
from workers.harness.fleet import ENGINE_WORKERS, PARTICIPANTS, Proc, free_port
from workers.io import broker
from workers.settings import ROOT

PROMTOOL = ROOT / ".venv-tools" / "bin" / "promtool"
CHECK_JSONSCHEMA = ROOT / ".venv-tools" / "bin" / "check-jsonschema"
LOG_SCHEMA = ROOT / "tests" / "fixtures" / "log_event.schema.json"
TOOLS_HOW = "run `bash scripts/install-lint-tools.sh` (it installs .venv-tools)"
GRACE_S = 25.0
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
LIFECYCLE = ("worker.started", "worker.draining", "worker.stopped")

# The families the issue lists, and the process that records each (read from the code:
# workers/runtime/outbox.py, engine/committer.py, engine/receipts.py, engine/reconciler.py,
# runtime/consume.py, engine/context.py, runtime/supervisor.redo and participant/service.py).
# A participant runs its own outbox publisher and consumer, so it also exports the outbox,
# confirm and redelivery families under its own owner label.
ISSUE_FAMILIES = (
    "custody_outbox_pending_rows",
    "custody_outbox_oldest_pending_age_seconds",
    "custody_publish_confirm_latency_seconds",
    "custody_outbox_publish_failures_total",
    "custody_receipts_total",
    "custody_quarantined_total",
    "custody_redeliveries_total",
    "custody_operations",
    "custody_lease_losses_total",
    "custody_operation_end_to_end_seconds",
)


@dataclass(frozen=True)
class Expect:
    """A sample the owning process must export: its name and a subset of its labels."""

    sample: str
    labels: Mapping[str, str]
    at_least: float = 0.0


OWNED: dict[str, list[Expect]] = {
    "publisher": [
        Expect("custody_outbox_pending_rows", {"owner": "engine"}, 1),
        Expect("custody_outbox_oldest_pending_age_seconds", {"owner": "engine"}, 0.001),
        Expect("custody_publish_confirm_latency_seconds_count", {"owner": "engine"}, 1),
        Expect("custody_publish_confirm_latency_seconds_bucket", {"le": "+Inf"}, 1),
        Expect("custody_outbox_publish_failures_total", {"owner": "engine", "kind": "returned"}, 1),
        # the submits leave from the committer: the publisher sends the rest (none here)
        Expect("custody_outbox_published_total", {"owner": "engine"}),
    ],
    "committer": [
        Expect("custody_quarantined_total", {"source": broker.QUEUE_REQUESTS}, 1),
        Expect("custody_redeliveries_total", {"worker": "committer"}),
        Expect("custody_transitions_total", {"kind": "start"}, 5),
        # it sends the submits it commits: the 5 instances' first operations (the receipt
        # consumer activates and sends the others)
        Expect("custody_outbox_published_total", {"owner": "engine"}, 5),
        Expect("custody_publish_confirm_latency_seconds_count", {"owner": "engine"}, 1),
        Expect("custody_dispatch_paused", {"owner": "engine", "scope": "committer"}),
    ],
    "receipts": [
        Expect("custody_receipts_total", {"verdict": "apply"}, 15),
        Expect("custody_quarantined_total", {"source": broker.QUEUE_RECEIPTS}, 1),
        Expect("custody_redeliveries_total", {"worker": "receipts"}),
        Expect("custody_operation_end_to_end_seconds_count", {}, 15),
        Expect("custody_operation_end_to_end_seconds_bucket", {"le": "+Inf"}, 15),
        # the successors it activates in the receipts' transactions, and their submits it
        # sends: 5 instances' second and third operations (a successor it could not
        # lock at once is the committer's: none here, one instance at a time per batch)
        Expect("custody_transitions_total", {"kind": "successor"}, 15),
        Expect("custody_outbox_published_total", {"owner": "engine"}, 10),
        Expect("custody_publish_confirm_latency_seconds_count", {"owner": "engine"}, 1),
        Expect("custody_dispatch_paused", {"owner": "engine", "scope": "receipts"}),
    ],
    "reconciler": [
        Expect("custody_operations", {"status": "succeeded"}, 15),
        Expect("custody_operations", {"status": "outcome_unknown"}),
        Expect("custody_operations", {"status": "reconcile_pending"}),
        Expect("custody_operations", {"status": "cancelling"}),
        Expect("custody_lease_losses_total", {"worker": "reconciler"}, 1),
    ],
    "inventory": [
        Expect(
            "custody_participant_commands_total", {"owner": "inventory", "decision": "accepted"}, 5
        ),
        Expect("custody_publish_confirm_latency_seconds_count", {"owner": "inventory"}, 1),
        Expect("custody_outbox_pending_rows", {"owner": "inventory"}),
        Expect("custody_outbox_oldest_pending_age_seconds", {"owner": "inventory"}),
        Expect("custody_redeliveries_total", {"worker": "participant-inventory"}),
    ],
}
# The worker name each served process has in its logs and its ``worker`` metric label.
WORKER_NAMES = {**{w: w for w in ENGINE_WORKERS}, **{p: f"participant-{p}" for p in PARTICIPANTS}}


# -- processes and HTTP --------------------------------------------------------------


@dataclass
class Served:
    """A worker process started with CUSTODY_METRICS_PORT."""

    worker: str
    proc: Proc
    port: int


def start(crew: Crew, worker: str, *, port: int | None = None, **env: str) -> Served:
    """Start an engine worker or a participant (by name), optionally serving HTTP."""
    extra = dict(env)
    port = free_port() if port is None else port
    if port:
        extra["CUSTODY_METRICS_PORT"] = str(port)
    if worker in PARTICIPANTS:
        extra.setdefault("CUSTODY_AMQP_URL", crew.env.participant_amqp(worker))
        proc = crew.fleet.start("participant", name=worker, extra_env=extra)
    else:
        assert worker in ENGINE_WORKERS, worker
        proc = crew.fleet.start(worker, extra_env=extra)
    return Served(worker, proc, port)


async def http_get(port: int, path: str) -> tuple[int, str] | None:
    """(status, body), or None while nothing answers on the port."""

    def call() -> tuple[int, str] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode()
        except OSError:
            return None

    return await asyncio.to_thread(call)


async def status_of(s: Served, path: str) -> int | None:
    got = await http_get(s.port, path)
    return None if got is None else got[0]


async def metrics_text(s: Served) -> str:
    got = await http_get(s.port, "/metrics")
    assert got is not None and got[0] == 200, f"{s.proc.name} /metrics: {got}"
    return got[1]


async def wait_ready(crew: Crew, served: Iterable[Served], timeout: float = 30) -> None:
    """/healthz 200 and /readyz 200 with every connection up, for each process."""
    for s in served:

        async def ready(s: Served = s) -> bool:
            health, readiness = (
                await http_get(s.port, "/healthz"),
                await http_get(s.port, "/readyz"),
            )
            if health is None or readiness is None or readiness[0] != 200:
                return False
            assert health == (200, '{"status":"alive"}'), f"{s.proc.name} /healthz {health}"
            body = json.loads(readiness[1])
            return body.get("ready") is True and body.get("broker") is True

        await crew.wait(ready, timeout=timeout, what=f"{s.proc.name} /readyz 200 (connected)")


async def poll(
    check: Callable[[], Awaitable[bool]],
    *,
    timeout: float,
    what: str,
    alive: Iterable[Proc] = (),
) -> None:
    """A bounded poll that fails at once if one of ``alive`` exits."""
    procs = list(alive)
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        dead = [(p.name, p.popen.returncode) for p in procs if p.popen.poll() is not None]
        assert not dead, f"worker died while waiting for {what}: {dead}"
        if await check():
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


def tail(proc: Proc, lines: int = 30) -> str:
    return "\n".join(proc.log.read_text(errors="replace").splitlines()[-lines:])


async def sigterm(crew: Crew, proc: Proc, timeout: float = GRACE_S) -> int:
    crew.fleet.signal(proc, signal.SIGTERM)
    try:
        code = await asyncio.to_thread(proc.popen.wait, timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{proc.name} did not exit within {timeout}s of SIGTERM") from None
    crew.retired.add(proc.name)
    return int(code)


# -- metrics text ----------------------------------------------------------------------


def declared(text: str) -> dict[str, str]:
    """Family name -> type, from the # TYPE lines."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            out[name] = kind
    return out


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def missing(text: str, expected: Iterable[Expect]) -> list[str]:
    got = samples(text)
    out = []
    for e in expected:
        values = [
            v
            for name, labels, v in got
            if name == e.sample and all(labels.get(k) == val for k, val in e.labels.items())
        ]
        if not values:
            out.append(f"{e.sample}{dict(e.labels)} absent")
        elif max(values) < e.at_least:
            out.append(f"{e.sample}{dict(e.labels)} = {max(values)} < {e.at_least}")
    return out


def promtool_check(text: str) -> tuple[int, str]:
    assert PROMTOOL.exists(), f"{PROMTOOL} is missing: {TOOLS_HOW}"
    done = subprocess.run(
        [str(PROMTOOL), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done.returncode, done.stdout + done.stderr


# -- logs --------------------------------------------------------------------------------


def log_objects(proc: Proc) -> list[dict[str, Any]]:
    """Every line of a worker's log file as a JSON object (fails on the first that is not)."""
    out = []
    for n, line in enumerate(proc.log.read_text(errors="replace").splitlines(), 1):
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"{proc.name} log line {n} is not JSON: {line[:300]!r}") from None
        assert isinstance(obj, dict), f"{proc.name} log line {n} is not an object: {line[:300]!r}"
        out.append(obj)
    return out


def schema_errors(procs: Iterable[Proc], tmp_path: Path) -> str:
    """check-jsonschema on every log line of every process ('' when all are valid)."""
    assert CHECK_JSONSCHEMA.exists(), f"{CHECK_JSONSCHEMA} is missing: {TOOLS_HOW}"
    folder = tmp_path / "log-lines"
    folder.mkdir(exist_ok=True)
    files = []
    for proc in procs:
        for n, obj in enumerate(log_objects(proc), 1):
            path = folder / f"{proc.name}.line-{n:04d}.json"
            path.write_text(json.dumps(obj))
            files.append(str(path))
    assert files, "no log lines at all"
    done = subprocess.run(
        [str(CHECK_JSONSCHEMA), "--schemafile", str(LOG_SCHEMA), *files],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return "" if done.returncode == 0 else (done.stdout + done.stderr)[-4000:]


def events(proc: Proc, name: str) -> list[dict[str, object]]:
    return [o for o in log_objects(proc) if o.get("event") == name]


async def consumes(env: Env, crew: Crew, worker: str) -> None:
    """The worker's consumer really runs: a malformed message it must isolate is
    isolated (a receipt the receipts worker quarantines, a command a participant
    refuses)."""
    if worker == "receipts":
        await publish_raw(env.settings, broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY, [b"[1"])
        query, participant = "SELECT count(*) FROM custody.quarantine", False
    else:
        await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, f"{worker}.v1", [b"[1"])
        query, participant = f"SELECT count(*) FROM participant_{worker}.refused", True

    async def handled() -> bool:
        return int(await env.scalar(query, participant=participant)) >= 1

    await crew.wait(handled, timeout=30, what=f"{worker} to consume a malformed message")
