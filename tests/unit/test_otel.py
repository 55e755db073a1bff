"""The tracing glue (workers/runtime/otel.py) without sockets: off is a shared no-op
with no OpenTelemetry imported; on, spans chain as the fleet's do (the real OTLP path
is in tests/acceptance/test_otel.py), into the SDK's in-memory exporter."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from workers import errors
from workers.core import tracing
from workers.io import broker
from workers.runtime import otel


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.install(provider)
    try:
        yield exporter
    finally:
        otel.shutdown()


def delivery(traceparent: str | None, message_id: str = "m-1") -> broker.Delivery:
    headers = {"traceparent": traceparent} if traceparent else {}
    return broker.Delivery(
        body=b"{}",
        message_id=message_id,
        user_id=None,
        headers=headers,
        redelivered=False,
        routing_key="inventory.v1",
        _message=None,  # type: ignore[arg-type]
        exchange="custody.commands",
    )


def span_id(traceparent: str) -> int:
    return int(traceparent.split("-")[2], 16)


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_SDK_DISABLED": "TRUE"}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, None),
        ({"OTEL_SERVICE_NAME": "x"}, None),
    ],
)
def test_tracing_is_on_by_the_opentelemetry_variables(env: dict[str, str], on: str | None) -> None:
    assert otel.enabled_by(env) == on


def test_off_is_one_shared_no_op_and_imports_no_opentelemetry() -> None:
    """In a fresh interpreter: the worker's modules, configured without the variables,
    have imported nothing of OpenTelemetry, and every wrapper is the same no-op."""
    code = """
import sys
from workers.engine import committer, receipts, reconciler
from workers.participant import service
from workers.runtime import otel
assert otel.configure("committer", {}) is False
d = None
noop = otel.NOOP
assert otel.transaction("starts", "committer") is noop
assert otel.claimed("successors", "committer") is noop
assert otel.handler("reserve", None, "participant-inventory") is noop
assert otel.consuming("committer", [object()]) is noop
out = [object()]
assert otel.publishing(out, "engine") == (out, None)
assert otel.delivery_context(object()) is None
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_tracing_on_without_the_extra_is_one_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(errors.ConfigError, match=r"custody\[otel\].*OTEL_EXPORTER_OTLP_ENDPOINT"):
        otel.configure("committer", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
    assert not otel.enabled()


def test_configure_names_the_service_after_the_worker_unless_told() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}
    try:
        assert otel.configure("participant-inventory", env)
        assert otel.service_name() == "custody-participant-inventory"
    finally:
        otel.install(None)  # nothing was exported: no shutdown (it would try to send)


def test_without_a_tracer_rows_get_a_span_id_of_their_own() -> None:
    parent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    first, second = tracing.child(parent), tracing.child(parent)
    assert first != second and first.split("-")[1] == "a" * 32 and "b" * 16 not in first


async def test_consume_transaction_and_rows_chain_into_real_spans(
    spans: InMemorySpanExporter,
) -> None:
    caller = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    d = delivery(caller)
    with otel.consuming("committer", [d]):
        consumed = otel.delivery_context(d)
        assert consumed is not None and consumed.split("-")[1] == "1" * 32
        async with otel.transaction("starts", "committer") as span:
            span.set(operation_id=["op-1"], instance_id=["i-1"], message_id=["m-1"])
            row = tracing.child(consumed)  # what an outbox row written here stores
            assert row == span.traceparent
        assert tracing.child(consumed) == consumed  # after the transaction: the consume span
    outgoing, published = otel.publishing(
        [broker.Outgoing("m-2", "custody.commands", "inventory.v1", b"{}", {"traceparent": row})],
        "engine",
    )
    assert published is not None
    published.settled([broker.Outcome("m-2", True)])
    wire = outgoing[0].headers["traceparent"]
    got = {s.name: s for s in spans.get_finished_spans()}
    assert set(got) == {
        "process custody.commands",
        "transaction starts",
        "publish custody.commands",
    }
    process, commit, publish = (
        got["process custody.commands"],
        got["transaction starts"],
        got["publish custody.commands"],
    )
    assert process.parent is not None and process.parent.span_id == int("2" * 16, 16)
    assert commit.parent is not None and commit.parent.span_id == process.context.span_id
    assert publish.parent is not None and publish.parent.span_id == commit.context.span_id
    assert span_id(wire) == publish.context.span_id
    assert {s.context.trace_id for s in got.values()} == {int("1" * 32, 16)}
    assert commit.attributes is not None and commit.attributes["custody.operation_id"] == ("op-1",)
    assert process.attributes is not None
    assert process.attributes["messaging.system"] == "rabbitmq"
    assert process.attributes["messaging.destination.name"] == "custody.commands"
    assert process.attributes["messaging.message.id"] == "m-1"


async def test_a_failed_transaction_and_an_unconfirmed_publish_are_errors(
    spans: InMemorySpanExporter,
) -> None:
    with pytest.raises(RuntimeError):
        async with otel.transaction("receipts", "receipts"):
            raise RuntimeError("boom")
    _, published = otel.publishing([broker.Outgoing("m", "custody.receipts", "r", b"")], "x")
    assert published is not None
    published.settled([broker.Outcome("m", False, "nack: refused")])
    outcomes = {s.name: (s.attributes or {})["custody.outcome"] for s in spans.get_finished_spans()}
    assert outcomes == {"transaction receipts": "RuntimeError", "publish custody.receipts": "nack"}


async def test_an_idle_claim_loop_exports_nothing(spans: InMemorySpanExporter) -> None:
    async with otel.claimed("deadlines", "reconciler"):
        pass
    instance = "00-" + "3" * 32 + "-" + "4" * 16 + "-01"
    async with otel.claimed("successors", "committer") as span:
        assert tracing.child(instance) == instance  # rows continue what the work came with
        assert isinstance(span, otel.Claimed)
        span.parent(instance)
        span.set(operation_id=["op"])
    [only] = spans.get_finished_spans()
    assert only.name == "transaction successors"
    assert only.parent is not None and only.parent.span_id == int("4" * 16, 16)
