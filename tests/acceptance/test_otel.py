"""OpenTelemetry (issue 13): a fleet of real worker processes exporting over OTLP/HTTP
to a collector in the test (stdlib ``http.server`` on 127.0.0.1, the protobuf decoded
with ``opentelemetry-proto``), so the configuration path is the one operators use: only
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.

On: one trace from the start request to the instance's end, every span's parent is a
span that was exported (or the caller's), and publish → consume → transaction chains
carry the real operation, instance and message ids. Off: nothing is exported, and the
W3C context is carried as before (``tests/acceptance/test_traces.py``).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tests.acceptance.observability import TRACEPARENT, start
from tests.acceptance.support import Crew, all_finished
from tests.conftest import Env
from tests.harness import order, publish_starts
from workers.harness.fleet import ENGINE_WORKERS, PARTICIPANTS
from workers.io import broker

pytestmark = pytest.mark.acceptance

# the committer publishes the submits it commits: no publisher in an unfaulted trace
SERVICES = {
    "custody-committer",
    "custody-receipts",
    *(f"custody-participant-{p}" for p in PARTICIPANTS),
}


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent: str
    kind: int
    attributes: dict[str, Any]

    def ids(self, key: str) -> list[str]:
        value = self.attributes.get(f"custody.{key}", [])
        return value if isinstance(value, list) else [value]


def _value(v: Any) -> Any:
    field = v.WhichOneof("value")
    if field == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, field) if field else None


class Collector:
    """An OTLP/HTTP trace receiver: what the workers' exporters POST to /v1/traces."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                collector.add(self.path, request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, path: str, request: Any) -> None:
        assert path == "/v1/traces", path
        got = []
        for rs in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            service=attrs.get("service.name", ""),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent=s.parent_span_id.hex(),
                            kind=s.kind,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self.lock:
            self.requests += 1
            self.spans.extend(got)

    def snapshot(self) -> list[Span]:
        with self.lock:
            return list(self.spans)


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    c.thread.start()
    try:
        yield c
    finally:
        c.server.shutdown()
        c.server.server_close()


async def start_one(env: Env, traceparent: str) -> str:
    [start_id] = await publish_starts(env.settings, [order(1)], traceparent=traceparent)
    return start_id


def span_of(traceparent: str) -> str:
    match = TRACEPARENT.match(traceparent)
    assert match, traceparent
    return match.group(2)


@pytest.mark.timeout(120)
async def test_one_trace_from_start_to_end_exported_over_otlp(
    env: Env, crew: Crew, collector: Collector
) -> None:
    trace_id, caller = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    tracing_on = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    for w in (*ENGINE_WORKERS, *PARTICIPANTS):
        start(crew, w, port=0, **tracing_on)
    start_id = await start_one(env, f"00-{trace_id}-{caller}-01")
    await crew.wait(all_finished(env, 1), timeout=60, what="the instance finished")
    [(instance_id,)] = await env.sql(
        "SELECT id::text FROM custody.instances WHERE start_request_id = %s", (start_id,)
    )
    rows = await env.sql(
        "SELECT o.id::text, o.routing_key, o.headers->>'traceparent', o.operation_id::text"
        " FROM custody.outbox o JOIN custody.operations op ON op.id = o.operation_id"
        " WHERE op.instance_id = %s ORDER BY o.created_at",
        (instance_id,),
    )
    assert [r[1] for r in rows] == ["inventory.v1", "payments.v1", "shipping.v1"], rows
    operations = [r[3] for r in rows]

    def in_trace() -> list[Span]:
        return [s for s in collector.snapshot() if s.trace_id == trace_id]

    def orphans_in(spans: list[Span]) -> list[Span]:
        known = {s.span_id for s in spans}
        return [s for s in spans if s.parent and s.parent not in known and s.parent != caller]

    async def all_exported() -> bool:
        # each process exports on its own schedule: a publish span ends after its
        # confirm and mark, and can reach the collector after the spans of everything
        # downstream of it, so the wait covers the whole tree, not only its leaves
        spans = in_trace()
        receipts = {
            o for s in spans if s.name == "transaction receipts" for o in s.ids("operation_id")
        }
        published = {
            s.attributes["messaging.message.id"]
            for s in spans
            if s.name == f"publish {broker.EXCHANGE_COMMANDS}"
        }
        sent = {r[0] for r in rows} <= published
        return set(operations) <= receipts and sent and not orphans_in(spans)

    await crew.wait(all_exported, timeout=30, what="every worker's spans, parents included")
    spans = in_trace()
    by_id = {s.span_id: s for s in spans}
    assert {s.service for s in spans} >= SERVICES, {s.service for s in spans}
    # the trace stitches: every parent is a span that was exported, or the caller's
    assert not orphans_in(spans), orphans_in(spans)

    # the start: committer's consume span under the caller's, its transaction under it
    [consumed] = [s for s in spans if s.name == f"process {broker.EXCHANGE_REQUESTS}"]
    assert consumed.parent == caller and consumed.service == "custody-committer"
    assert consumed.attributes["messaging.system"] == "rabbitmq"
    assert consumed.attributes["messaging.message.id"] == start_id
    [began] = [s for s in spans if s.name == "transaction starts"]
    assert began.parent == consumed.span_id
    assert began.ids("instance_id") == [instance_id] and began.ids("operation_id") == [
        operations[0]
    ]
    assert began.attributes["custody.outcome"] == "ok"

    # the first submit leaves from the committer's own sender, the others from the
    # receipt consumer's, which activates each successor in the receipt's transaction
    senders = ["custody-committer", "custody-receipts", "custody-receipts"]
    for (message_id, routing_key, stored, operation_id), sender in zip(rows, senders, strict=True):
        # publish: a child of what the outbox row stores (a span that was exported)
        [published] = [
            s
            for s in spans
            if s.name == f"publish {broker.EXCHANGE_COMMANDS}"
            and s.attributes["messaging.message.id"] == message_id
        ]
        assert published.service == sender
        assert published.parent == span_of(stored) and span_of(stored) in by_id
        assert by_id[span_of(stored)].service == "custody-committer"
        assert published.attributes["messaging.rabbitmq.destination.routing_key"] == routing_key
        assert published.attributes["messaging.operation"] == "publish"
        # consume: the participant's span is the publish span's child (the wire header)
        [got] = [
            s
            for s in spans
            if s.parent == published.span_id and s.name == f"process {broker.EXCHANGE_COMMANDS}"
        ]
        assert got.service == f"custody-participant-{routing_key.split('.')[0]}"
        assert got.attributes["messaging.message.id"] == message_id
        # the acceptance transaction under it, with the real ids
        [accepted] = [s for s in spans if s.parent == got.span_id]
        assert accepted.name == "transaction acceptance"
        assert accepted.ids("operation_id") == [operation_id]
        assert accepted.ids("message_id") == [message_id]
        # the handler (inline) and the receipt it publishes, consumed by the engine
        [handled] = [
            s
            for s in spans
            if s.name.startswith("handle ") and operation_id in s.ids("operation_id")
        ]
        assert handled.service == got.service
        [receipt] = [
            s
            for s in spans
            if s.parent == handled.span_id and s.name == f"publish {broker.EXCHANGE_RECEIPTS}"
        ]
        [applied] = [s for s in spans if s.parent == receipt.span_id]
        assert applied.service == "custody-receipts"
        assert applied.name == f"process {broker.EXCHANGE_RECEIPTS}"
        [transaction] = [s for s in spans if s.parent == applied.span_id]
        assert transaction.name == "transaction receipts"
        assert operation_id in transaction.ids("operation_id")
        assert instance_id in transaction.ids("instance_id")


@pytest.mark.timeout(120)
async def test_tracing_off_exports_nothing(env: Env, crew: Crew, collector: Collector) -> None:
    """No OTEL_ variable: the fleet works, nothing reaches the collector (not even at
    shutdown, when an SDK would flush), and the commands stay in the caller's trace."""
    trace_id, caller = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    for w in (*ENGINE_WORKERS, *PARTICIPANTS):
        start(crew, w, port=0, OTEL_SERVICE_NAME="custody-should-not-export")
    start_id = await start_one(env, f"00-{trace_id}-{caller}-01")
    await crew.wait(all_finished(env, 1), timeout=60, what="the instance finished")
    stored = await env.sql(
        "SELECT o.headers->>'traceparent' FROM custody.outbox o"
        " JOIN custody.operations op ON op.id = o.operation_id"
        " JOIN custody.instances i ON i.id = op.instance_id WHERE i.start_request_id = %s",
        (start_id,),
    )
    assert len(stored) == 3 and all(r[0].split("-")[1] == trace_id for r in stored), stored
    codes = crew.fleet.stop(grace_s=25)
    assert all(c == 0 for c in codes.values()), codes
    assert collector.requests == 0 and collector.snapshot() == []
