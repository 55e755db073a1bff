"""Observability of real worker processes over the real RabbitMQ and Postgres.

Every worker type serves /healthz, /readyz and /metrics (CUSTODY_METRICS_PORT); the
metrics text passes ``promtool check metrics`` and each process exports the metric
families it owns; liveness does not depend on the broker or the database while
readiness follows the connections; every log line is a JSON object matching
tests/fixtures/log_event.schema.json with a stable event name, and a SIGTERM'd worker
logs worker.started / worker.draining / worker.stopped and exits 0; the W3C trace
context of a start request is stored with the instance and each outbox row and
carried in the commands' AMQP headers, never in their digest; no secret reaches a log
line, and ``custody config show`` redacts them.

Dependencies are made unreachable for one worker only, through a TCP proxy the test
owns (127.0.0.1, in front of 5672 or 5432): the shared broker and database are never
stopped. Every wait is a bounded poll; nothing sleeps a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from contracts import codec
from contracts.models import StartRequest, SubmitCommand
from tests.acceptance.support import Crew, all_finished, environ_of, state
from tests.conftest import DEV_PASSWORD, MGMT, Env
from tests.harness import client, order, publish_raw, publish_starts
from workers.core import commands
from workers.harness.fleet import ENGINE_WORKERS, PARTICIPANTS, Fleet, Proc
from workers.io import broker
from workers.settings import ROOT

pytestmark = pytest.mark.acceptance

PROMTOOL = ROOT / ".venv-tools" / "bin" / "promtool"
CHECK_JSONSCHEMA = ROOT / ".venv-tools" / "bin" / "check-jsonschema"
LOG_SCHEMA = ROOT / "tests" / "fixtures" / "log_event.schema.json"
TOOLS_HOW = "run `bash scripts/install-lint-tools.sh` (it installs .venv-tools)"
GRACE_S = 25.0
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
LIFECYCLE = ("worker.started", "worker.draining", "worker.stopped")

# The families the issue lists, and the process that records each (read from the code:
# workers/runtime/outbox.py, committer.py, receipts.py, reconciler.py, consumer.py,
# engine.py, runtime.redo and participant.py). A participant runs its own outbox
# publisher and consumer, so it also exports the outbox, confirm and redelivery
# families under its own owner label.
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
        Expect("custody_outbox_published_total", {"owner": "engine"}, 15),
    ],
    "committer": [
        Expect("custody_quarantined_total", {"source": broker.QUEUE_REQUESTS}, 1),
        Expect("custody_redeliveries_total", {"worker": "committer"}),
        Expect("custody_transitions_total", {"kind": "start"}, 5),
    ],
    "receipts": [
        Expect("custody_receipts_total", {"verdict": "apply"}, 15),
        Expect("custody_quarantined_total", {"source": broker.QUEUE_RECEIPTS}, 1),
        Expect("custody_redeliveries_total", {"worker": "receipts"}),
        Expect("custody_operation_end_to_end_seconds_count", {}, 15),
        Expect("custody_operation_end_to_end_seconds_bucket", {"le": "+Inf"}, 15),
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
        Expect("custody_redeliveries_total", {"worker": "inventory"}),
    ],
}


# -- processes and HTTP --------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


# -- a TCP proxy the test owns ----------------------------------------------------------


class Proxy:
    """127.0.0.1:<port> forwarding to a local service port. ``cut()`` aborts every
    connection and refuses new ones (accept, then reset); ``heal()`` forwards again;
    ``hang()`` accepts and never answers. Only the processes pointed at it are affected."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.mode = "open"
        self.accepted = 0
        self.refused = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self._abort_all()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def amqp_url(self, url: str) -> str:
        parsed = urllib.parse.urlsplit(url)
        creds = parsed.netloc.rsplit("@", 1)[0] + "@" if "@" in parsed.netloc else ""
        return parsed._replace(netloc=f"{creds}127.0.0.1:{self.port}").geturl()

    def cut(self) -> None:
        self.mode = "refuse"
        self._abort_all()

    def hang(self) -> None:
        self.mode = "hang"

    def heal(self) -> None:
        self.mode = "open"

    def cut_when_a_channel_opens(self) -> None:
        """Forward, and cut (as :meth:`cut`) the moment a client sends its first frame on
        a channel other than 0 (Channel.Open): its connection is up, nothing on it yet."""
        self.mode = "cut_on_channel"

    def _abort_all(self) -> None:
        for w in list(self._links):
            w.transport.abort()
        self._links.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        try:
            if self.mode == "refuse":
                self.refused += 1
                writer.transport.abort()
                return
            if self.mode == "hang":
                self._links.add(writer)
                with contextlib.suppress(OSError):
                    await reader.read()
                return
            try:
                up_reader, up_writer = await asyncio.open_connection(
                    "127.0.0.1", self.upstream_port
                )
            except OSError:
                writer.transport.abort()
                return
            self._links |= {writer, up_writer}
            watch = _ChannelWatch() if self.mode == "cut_on_channel" else None
            await asyncio.gather(
                self._pump(reader, up_writer, watch), self._pump(up_reader, writer)
            )
        finally:
            self._links.discard(writer)
            writer.transport.abort()
            self._tasks.discard(task)

    async def _pump(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        watch: _ChannelWatch | None = None,
    ) -> None:
        try:
            while data := await src.read(65536):
                if watch is not None and watch.channel_frame(data):
                    self.cut()
                    return
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            self._links.discard(dst)
            dst.transport.abort()


class _ChannelWatch:
    """Reads a client's AMQP 0-9-1 byte stream (protocol header, then frames of type(1)
    channel(2) size(4) payload frame-end(1)) and says when a frame on a channel other
    than 0 begins."""

    def __init__(self) -> None:
        self.buf = b""
        self.header = False

    def channel_frame(self, data: bytes) -> bool:
        self.buf += data
        if not self.header:
            if len(self.buf) < 8:
                return False
            self.buf, self.header = self.buf[8:], True
        while len(self.buf) >= 7:
            if int.from_bytes(self.buf[1:3], "big") != 0:
                return True
            size = int.from_bytes(self.buf[3:7], "big")
            if len(self.buf) < size + 8:
                return False
            self.buf = self.buf[size + 8 :]
        return False


def amqp_port(url: str) -> int:
    return urllib.parse.urlsplit(url).port or 5672


def pg_proxied_url(url: str, port: int) -> str:
    params = psycopg.conninfo.conninfo_to_dict(url)
    params.update(host="127.0.0.1", port=str(port))
    return psycopg.conninfo.make_conninfo(**params)


def pg_port(url: str) -> int:
    return int(psycopg.conninfo.conninfo_to_dict(url).get("port") or 5432)


# -- a. probes and metrics ------------------------------------------------------------------


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


# -- b. liveness and readiness -------------------------------------------------------------


async def consuming(env: Env, crew: Crew, worker: str, n: int) -> None:
    """Wait until a consuming worker has handled its n-th malformed message (its
    consumer is really running): a receipt the receipts worker quarantines, a command
    a participant refuses. The publisher consumes nothing: no-op."""
    if worker == "receipts":
        await publish_raw(env.settings, broker.EXCHANGE_RECEIPTS, broker.RECEIPTS_KEY, [b"[1"])
        query, participant = "SELECT count(*) FROM custody.quarantine", False
    elif worker in PARTICIPANTS:
        binding = f"{worker}.v1"
        await publish_raw(env.settings, broker.EXCHANGE_COMMANDS, binding, [b"[1"])
        query, participant = f"SELECT count(*) FROM participant_{worker}.refused", True
    else:
        return

    async def handled() -> bool:
        return int(await env.scalar(query, participant=participant)) >= n

    await crew.wait(handled, timeout=20, what=f"{worker} to consume its malformed message #{n}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("worker", ["publisher", "receipts", "inventory"])
async def test_a_broker_outage_turns_readyz_503_while_healthz_stays_200_and_both_recover(
    env: Env, crew: Crew, worker: str
) -> None:
    """One worker reaches RabbitMQ through a proxy the test owns. Cutting the proxy
    (every connection reset, reconnects refused) turns its /readyz 503 while /healthz
    stays 200 and the process lives through refused reconnects; healing the proxy brings
    /readyz back to 200 (aio-pika's robust connection), the worker does real work again,
    and a SIGTERM still drains it to exit 0."""
    url = env.participant_amqp(worker) if worker in PARTICIPANTS else env.settings.amqp_url
    async with Proxy(amqp_port(url)) as proxy:
        s = start(crew, worker, CUSTODY_AMQP_URL=proxy.amqp_url(url))
        await wait_ready(crew, [s])
        await consuming(env, crew, worker, 1)

        proxy.cut()

        async def not_ready_but_alive() -> bool:
            assert await status_of(s, "/healthz") == 200, f"/healthz failed:\n{tail(s.proc)}"
            return await status_of(s, "/readyz") == 503

        await poll(not_ready_but_alive, timeout=20, what="/readyz 503", alive=[s.proc])
        refused = proxy.refused

        async def tried_again() -> bool:
            assert await status_of(s, "/healthz") == 200, f"/healthz failed:\n{tail(s.proc)}"
            assert await status_of(s, "/readyz") == 503, "ready while the broker is unreachable"
            return proxy.refused > refused

        await poll(tried_again, timeout=30, what="a refused reconnect attempt", alive=[s.proc])

        proxy.heal()

        async def ready_again() -> bool:
            assert await status_of(s, "/healthz") == 200, f"/healthz failed:\n{tail(s.proc)}"
            return await status_of(s, "/readyz") == 200

        try:
            await poll(ready_again, timeout=30, what="/readyz 200 again", alive=[s.proc])
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{tail(s.proc)}") from None

        for other in (*ENGINE_WORKERS, *PARTICIPANTS):
            if other != worker:
                start(crew, other, port=0)
        n = 3
        await publish_starts(env.settings, [order(i) for i in range(n)])
        try:
            await crew.wait(all_finished(env, n), timeout=40, what="work through the worker")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {await state(env)}\n{tail(s.proc)}") from None
        assert await sigterm(crew, s.proc) == 0, tail(s.proc)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("worker", ["receipts", "inventory"])
async def test_a_connection_lost_while_the_consumer_is_set_up_does_not_kill_the_worker(
    env: Env, crew: Crew, worker: str
) -> None:
    """The broker connection drops right after the AMQP handshake, when the worker opens
    its first channel (to set up its consumer), and stays down a while: the worker lives
    (/healthz 200) and is not ready; once the broker is back it becomes ready and
    consumes."""
    url = env.participant_amqp(worker) if worker in PARTICIPANTS else env.settings.amqp_url
    async with Proxy(amqp_port(url)) as proxy:
        proxy.cut_when_a_channel_opens()
        s = start(crew, worker, CUSTODY_AMQP_URL=proxy.amqp_url(url))

        async def cut_and_retried() -> bool:
            assert await status_of(s, "/healthz") in (None, 200)
            return proxy.mode == "refuse" and proxy.refused > 0

        try:
            await poll(cut_and_retried, timeout=30, what="a refused reconnect", alive=[s.proc])
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{tail(s.proc)}") from None
        assert await status_of(s, "/healthz") == 200
        assert await status_of(s, "/readyz") == 503
        proxy.heal()
        await wait_ready(crew, [s])
        await consuming(env, crew, worker, 1)


@pytest.mark.timeout(90)
async def test_readyz_is_503_until_the_worker_has_connected(env: Env, crew: Crew) -> None:
    """While the broker does not answer the AMQP handshake, a starting worker is alive
    (/healthz 200) but not ready (/readyz 503)."""
    async with Proxy(amqp_port(env.settings.amqp_url)) as proxy:
        proxy.hang()
        s = start(crew, "publisher", CUSTODY_AMQP_URL=proxy.amqp_url(env.settings.amqp_url))

        async def alive() -> bool:
            return await status_of(s, "/healthz") == 200 and proxy.accepted > 0

        await poll(alive, timeout=20, what="/healthz 200 and a connection attempt", alive=[s.proc])
        readiness = await http_get(s.port, "/readyz")
        assert readiness is not None and readiness[0] == 503, (
            f"/readyz while the AMQP handshake is unanswered: {readiness}"
        )


@pytest.mark.timeout(90)
async def test_a_database_outage_keeps_healthz_200_turns_readyz_503_and_both_recover(
    env: Env, crew: Crew
) -> None:
    """The same contract for Postgres: one worker reaches it through a proxy; cut it,
    /healthz stays 200 and the process lives, /readyz turns 503; heal it, /readyz 200."""
    url = env.settings.database_url
    async with Proxy(pg_port(url)) as proxy:
        s = start(crew, "publisher", CUSTODY_DATABASE_URL=pg_proxied_url(url, proxy.port))
        await wait_ready(crew, [s])
        proxy.cut()

        async def not_ready_but_alive() -> bool:
            assert await status_of(s, "/healthz") == 200, f"/healthz failed:\n{tail(s.proc)}"
            return await status_of(s, "/readyz") == 503

        try:
            await poll(not_ready_but_alive, timeout=20, what="/readyz 503", alive=[s.proc])
        finally:
            proxy.heal()

        async def ready_again() -> bool:
            assert await status_of(s, "/healthz") == 200, f"/healthz failed:\n{tail(s.proc)}"
            return await status_of(s, "/readyz") == 200

        await poll(ready_again, timeout=30, what="/readyz 200 again", alive=[s.proc])


# -- c. JSON logs and the lifecycle of a SIGTERM ---------------------------------------------


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


# -- d. trace context ---------------------------------------------------------------------------


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
        start_id = str(uuid.uuid4())
        async with client(env.settings) as amqp:
            pub = await amqp.publisher(window=8, timeout_s=10, user_id=None)
            request = StartRequest(
                tenant="acme",
                start_request_id=start_id,
                process="order-fulfilment",
                input=order(1),
                requested_by="test",
            )
            [outcome] = await pub.publish_many(
                [
                    broker.Outgoing(
                        start_id,
                        broker.EXCHANGE_REQUESTS,
                        broker.START_KEY,
                        codec.encode(request),
                        {"traceparent": traceparent},
                    )
                ]
            )
        assert outcome.ok, outcome.error

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
        headers = [json.loads(r.outbox_row["headers"])["traceparent"] for r in rebuilt]
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
        assert codec.decode_command(replay.body).semantic_digest() == command.digest
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
            return got is None and len(receipts) >= 6

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


# -- e. secrets --------------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_no_secret_reaches_a_log_line_and_config_show_redacts_them(
    env: Env, crew: Crew, tmp_path: Path
) -> None:
    """Engine workers get a database URL with a password in CUSTODY_DATABASE_URL and
    their AMQP URL (a dedicated broker user with a recognisable password) only from the
    file named by CUSTODY_AMQP_URL_FILE, through a proxy that is cut once so the
    connection code logs its failures; participants get a key=value conninfo with a
    password. After a workload and a SIGTERM, no secret appears anywhere in any worker's
    log, and ``custody config show`` redacts every one of them."""
    tag = uuid.uuid4().hex[:8]
    pg_secret, pgkv_secret, amqp_secret = (
        f"pg-s3cr3t-{tag}",
        f"pgkv-s3cr3t-{tag}",
        f"amqp-s3cr3t-{tag}",
    )
    secrets = (pg_secret, pgkv_secret, amqp_secret, DEV_PASSWORD)
    user = f"custody-obs-{tag}"
    engine_db = psycopg.conninfo.conninfo_to_dict(env.settings.database_url)
    part_db = psycopg.conninfo.conninfo_to_dict(env.settings.participant_database_url)
    db_url = (
        f"postgresql://{engine_db.get('user', 'postgres')}:{pg_secret}"
        f"@127.0.0.1:{engine_db.get('port', 5432)}/{engine_db['dbname']}"
    )
    part_url = psycopg.conninfo.make_conninfo(**{**part_db, "password": pgkv_secret})
    # No CUSTODY_AMQP_URL at all: it and CUSTODY_AMQP_URL_FILE are exclusive.
    base = {k: v for k, v in env.fleet_env().items() if k != "CUSTODY_AMQP_URL"}
    base["CUSTODY_PARTICIPANT_DATABASE_URL"] = part_url
    # Without the fleet's per-worker roles (workers.harness.fleet.role_env), which would set
    # CUSTODY_AMQP_URL for every worker and so exclude CUSTODY_AMQP_URL_FILE.
    secret_crew = Crew(
        env, Fleet(env=base, log_dir=tmp_path / "secret-logs", least_privilege=False)
    )
    await broker.ensure_user(
        MGMT, user, amqp_secret, env.vhost, configure=".*", write=".*", read=".*"
    )
    try:
        async with Proxy(amqp_port(env.settings.amqp_url)) as proxy:
            amqp_url = (
                urllib.parse.urlsplit(env.settings.amqp_url)
                ._replace(netloc=f"{user}:{amqp_secret}@127.0.0.1:{proxy.port}")
                .geturl()
            )
            url_file = tmp_path / "amqp_url"
            url_file.write_text(amqp_url + "\n")
            engine_env = {"CUSTODY_DATABASE_URL": db_url, "CUSTODY_AMQP_URL_FILE": str(url_file)}
            engine = [start(secret_crew, w, **engine_env) for w in ENGINE_WORKERS]
            parts = [start(secret_crew, p) for p in PARTICIPANTS]
            for s in engine:
                assert "CUSTODY_AMQP_URL" not in environ_of(s.proc), s.proc.name
            await wait_ready(secret_crew, [*engine, *parts])
            assert proxy.accepted >= len(engine), "the engine workers did not use the file's URL"

            proxy.cut()

            async def refused() -> bool:
                return proxy.refused > 0

            await poll(
                refused, timeout=30, what="a refused reconnect", alive=[s.proc for s in engine]
            )
            proxy.heal()
            await wait_ready(secret_crew, engine)
            n = 3
            await publish_starts(env.settings, [order(i) for i in range(n)])
            await secret_crew.wait(all_finished(env, n), timeout=40, what=f"{n} instances finished")
            codes = await asyncio.to_thread(secret_crew.stop_all, GRACE_S)
        assert set(codes.values()) == {0}, codes
        logged = [p for p in secret_crew.fleet.procs if p.name.startswith(ENGINE_WORKERS)]
        reconnects = sum("Connection attempt" in p.log.read_text() for p in logged)
        assert reconnects, "the outage left no connection failure in any log: nothing was tested"
        for proc in secret_crew.fleet.procs:
            text = proc.log.read_text(errors="replace")
            assert "worker.stopped" in text, f"{proc.name} log is incomplete:\n{text[-2000:]}"
            leaked = [s for s in secrets if s in text]
            assert not leaked, f"{proc.name} logged secrets {leaked}"

        shown = subprocess.run(
            [sys.executable, "-m", "workers.cli", "config", "show"],
            cwd=ROOT,
            env={**os.environ, **base, **engine_env},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert shown.returncode == 0, shown.stderr
        output = shown.stdout + shown.stderr
        leaked = [s for s in secrets if s in output]
        assert not leaked, f"config show printed secrets {leaked}:\n{output}"
        config = json.loads(shown.stdout)
        assert config["amqp_url"].startswith(f"amqp://{user}:***@127.0.0.1:"), config["amqp_url"]
        assert config["database_url"].startswith("postgresql://postgres:***@"), config
        assert "password=***" in config["participant_database_url"], config
        assert "guest:***@" in config["amqp_management_url"], config
    finally:
        secret_crew.fleet.stop(grace_s=GRACE_S)
        with contextlib.suppress(Exception):
            await broker.management(MGMT, "DELETE", f"/api/users/{urllib.parse.quote(user)}")
