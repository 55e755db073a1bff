"""OpenTelemetry spans: publish, consume, each commit boundary's transaction and a
participant's handler, exported over OTLP/HTTP when configured. Off by default.

On, by the OpenTelemetry convention, when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set and ``OTEL_SDK_DISABLED`` is not
``true``; the SDK reads its other ``OTEL_*`` variables itself (headers, timeout,
sampler, resource attributes). ``OTEL_SERVICE_NAME`` defaults to the worker's
Deployment name (``custody-committer``, ``custody-participant-inventory``).

Free when off: nothing of OpenTelemetry is imported, and every wrapper below returns
the one shared no-op (``NOOP``) after a single test of a module global. The W3C context
custody already carries (``workers.core.tracing``) is then exactly what it was.

When on, the traceparents custody writes are those of real spans: a consume span is
the child of the delivery's ``traceparent`` header, the transaction under it is its
child, an outbox row written in that transaction continues the transaction span
(``tracing.continuing``), the publish span of that row is its child and its context is
the header on the wire, so the consumer's span is the publish span's child.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final

from workers import errors
from workers.core import tracing
from workers.io import broker

if TYPE_CHECKING:  # never imported at run time unless tracing is on
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

EXTRA_MISSING: Final = (
    "tracing is on ({var} is set) but OpenTelemetry is not installed: install custody with"
    " its otel extra (pip install 'custody[otel]'), or unset {var}"
)
SYSTEM: Final = "rabbitmq"

_tracer: Tracer | None = None
_provider: TracerProvider | None = None
# the consume span of each delivery of the batch being handled, by id(delivery)
_DELIVERIES: ContextVar[Mapping[int, str] | None] = ContextVar(
    "custody_otel_deliveries", default=None
)


def enabled_by(env: Mapping[str, str]) -> str | None:
    """The variable that turns tracing on, or None when it is off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        if env.get(var, "").strip():
            return var
    return None


def enabled() -> bool:
    return _tracer is not None


def configure(worker: str, env: Mapping[str, str] = os.environ) -> bool:
    """Start exporting this process's spans if the environment says so; returns whether
    it did. A worker told to trace without the ``otel`` extra refuses to start."""
    var = enabled_by(env)
    if var is None:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise errors.ConfigError(EXTRA_MISSING.format(var=var)) from exc
    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, but what it
    # is given wins: the worker's name only when the operator named no service
    given = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: f"custody-{worker}"}
    provider = TracerProvider(resource=Resource.create(given))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    install(provider)
    return True


def install(provider: TracerProvider | None) -> None:
    """Trace to ``provider`` (None: tracing off). ``configure`` calls it; tests install a
    provider with an in-memory exporter."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer("custody") if provider is not None else None


def service_name() -> str | None:
    """The ``service.name`` the spans are exported under (None: tracing is off)."""
    if _provider is None:
        return None
    return str(_provider.resource.attributes.get("service.name"))


def shutdown() -> None:
    """Export what is buffered and stop (at the end of the worker's life)."""
    provider = _provider
    install(None)
    if provider is not None:
        provider.shutdown()


class Noop:
    """What every wrapper returns when tracing is off: one shared object, no span."""

    __slots__ = ()
    recording: Final = False
    traceparent: Final[str | None] = None

    def __enter__(self) -> Noop:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    async def __aenter__(self) -> Noop:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def set(self, **attributes: Any) -> None:
        return None


NOOP: Final = Noop()


def _traceparent(span: Span) -> str:
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def _parent(traceparent: str | None) -> Context | None:
    """The context a span continues: a valid W3C traceparent, else a new trace."""
    if not tracing.valid(traceparent):
        return None
    from opentelemetry import trace

    assert traceparent is not None
    _, trace_id, span_id, flags = traceparent.split("-")
    remote = trace.SpanContext(
        int(trace_id, 16), int(span_id, 16), True, trace.TraceFlags(int(flags, 16))
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(remote))


def _header(headers: Mapping[str, Any]) -> str | None:
    value = headers.get("traceparent")
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    return value if isinstance(value, str) else None


def _value(v: Any) -> Any:
    if isinstance(v, list | tuple | set | frozenset):
        return list(dict.fromkeys(str(x) for x in v if x is not None))
    return v if isinstance(v, str | bool | int | float) else str(v)


class Spanned:
    """A live span: ``set`` adds ``custody.*`` attributes; as a context manager it is
    the current span, rows written under it continue it, and it ends on exit with
    ``custody.outcome`` (``ok``, or the exception's type)."""

    recording: Final = True

    def __init__(self, span: Span, continues: str | None = None) -> None:
        self.span = span
        self.traceparent = _traceparent(span)
        self._continues = continues
        self._tokens: list[Any] = []

    def set(self, **attributes: Any) -> None:
        self.span.set_attributes(
            {f"custody.{k}": _value(v) for k, v in attributes.items() if v is not None}
        )

    def __enter__(self) -> Spanned:
        from opentelemetry import context, trace

        self._tokens.append(context.attach(trace.set_span_in_context(self.span)))
        if self._continues:
            self._tokens.append(tracing.continuing({self._continues: self.traceparent}))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        from opentelemetry import context

        if self._continues:
            tracing.done_continuing(self._tokens.pop())
        context.detach(self._tokens.pop())
        end(self.span, exc)

    async def __aenter__(self) -> Spanned:
        return self.__enter__()

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        self.__exit__(kind, exc, tb)


def end(span: Span, exc: BaseException | None, error: str = "") -> None:
    from opentelemetry.trace import Status, StatusCode

    if exc is not None:
        span.record_exception(exc)
        error = type(exc).__name__
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.set_attribute("custody.outcome", error or "ok")
    span.end()


def transaction(boundary: str, worker: str) -> Spanned | Noop:
    """The span of one commit boundary's transaction: a child of the current span (the
    consume span of the batch's first delivery), or a new trace (a claim loop)."""
    if _tracer is None:
        return NOOP
    from opentelemetry import trace

    parent = trace.get_current_span()
    continues = _traceparent(parent) if parent.get_span_context().is_valid else None
    span = _tracer.start_span(
        f"transaction {boundary}",
        attributes={"custody.worker": worker, "custody.boundary": boundary},
    )
    return Spanned(span, continues)


class Claimed:
    """The span of a claim loop's transaction (successors, the reconciler's sweeps, a
    participant's executor), made when it ends and only if it did work (``set`` was
    called), so that an idle poll exports nothing. ``parent`` puts it in the trace of
    the work it claimed."""

    recording: Final = True
    traceparent: Final[str | None] = None  # rows written under it continue their own

    def __init__(self, boundary: str, worker: str) -> None:
        self.boundary, self.worker = boundary, worker
        self.attributes: dict[str, Any] = {}
        self._parent: str | None = None
        self._began = 0
        self._token: tracing.Continuing | None = None

    def set(self, **attributes: Any) -> None:
        self.attributes.update(attributes)

    def parent(self, traceparent: str | None) -> None:
        self._parent = self._parent or traceparent

    async def __aenter__(self) -> Claimed:
        self._began = time.time_ns()
        # its span does not exist yet: rows continue the spans their work came with
        self._token = tracing.continuing({})
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        if self._token is not None:
            tracing.done_continuing(self._token)
        if not self.attributes or _tracer is None:
            return
        span = _tracer.start_span(
            f"transaction {self.boundary}",
            context=_parent(self._parent),
            attributes={"custody.worker": self.worker, "custody.boundary": self.boundary},
            start_time=self._began,
        )
        Spanned(span).set(**self.attributes)
        end(span, exc)


def claimed(boundary: str, worker: str) -> Claimed | Noop:
    return NOOP if _tracer is None else Claimed(boundary, worker)


def handler(operation: str, parent: str | None, worker: str) -> Spanned | Noop:
    """The span of a participant's handler, a child of the command's context."""
    if _tracer is None:
        return NOOP
    span = _tracer.start_span(
        f"handle {operation}",
        context=_parent(tracing.child(parent)),
        attributes={"custody.worker": worker, "custody.operation": operation},
    )
    return Spanned(span)


def _messaging(operation: str, exchange: str, routing_key: str, message_id: str | None) -> Any:
    return {
        "messaging.system": SYSTEM,
        "messaging.operation": operation,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": exchange,
        "messaging.rabbitmq.destination.routing_key": routing_key,
        "messaging.message.id": message_id or "",
    }


class Consumed:
    """The consume spans of one batch: one per delivery, each a child of its message's
    ``traceparent`` header; the first is current while the batch is handled."""

    recording: Final = True

    def __init__(self, spans: Sequence[tuple[broker.Delivery, Span]]) -> None:
        self.spans = spans
        self._tokens: list[Any] = []

    def __enter__(self) -> Consumed:
        from opentelemetry import context, trace

        tps = {id(d): _traceparent(s) for d, s in self.spans}
        self._tokens.append(_DELIVERIES.set(tps))
        self._tokens.append(context.attach(trace.set_span_in_context(self.spans[0][1])))
        # a row continuing a delivery's own header continues its consume span
        headers = {
            str(h): tps[id(d)] for d, _ in self.spans if tracing.valid(h := _header(d.headers))
        }
        self._tokens.append(tracing.continuing(headers))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: Any) -> None:
        from opentelemetry import context

        tracing.done_continuing(self._tokens.pop())
        context.detach(self._tokens.pop())
        _DELIVERIES.reset(self._tokens.pop())
        for _, span in self.spans:
            end(span, exc)


def consuming(worker: str, batch: Sequence[broker.Delivery]) -> Consumed | Noop:
    if _tracer is None or not batch:
        return NOOP
    spans = []
    for d in batch:
        destination = d.exchange or d.routing_key
        attributes = _messaging("process", destination, d.routing_key, d.message_id)
        attributes["custody.worker"] = worker
        attributes["messaging.batch.message_count"] = len(batch)
        span = _tracer.start_span(
            f"process {destination}",
            context=_parent(_header(d.headers)),
            kind=_kind("CONSUMER"),
            attributes=attributes,
        )
        spans.append((d, span))
    return Consumed(spans)


def delivery_context(d: broker.Delivery) -> str | None:
    """The traceparent of a delivery's consume span (None when tracing is off): what a
    row recording the delivery continues, even if its message carried no trace."""
    if _tracer is None:
        return None
    return (_DELIVERIES.get() or {}).get(id(d))


def _kind(name: str) -> Any:
    from opentelemetry.trace import SpanKind

    return SpanKind[name]


class Published:
    """The publish spans of a batch of outbox rows, ended by their confirms."""

    def __init__(self, spans: Mapping[str, Span]) -> None:
        self.spans = spans

    def settled(self, outcomes: Sequence[broker.Outcome]) -> None:
        for o in outcomes:
            span = self.spans.get(o.message_id)
            if span is not None:
                end(span, None, "" if o.ok else o.error.split(":", 1)[0] or "not confirmed")

    def failed(self, exc: BaseException) -> None:
        for span in self.spans.values():
            end(span, exc)


def publishing(
    outgoing: Sequence[broker.Outgoing], outbox: str
) -> tuple[Sequence[broker.Outgoing], Published | None]:
    """A producer span per message, a child of the traceparent its outbox row stores;
    the message carries the span's context instead (the row keeps its own)."""
    if _tracer is None:
        return outgoing, None
    sent, spans = [], {}
    for m in outgoing:
        attributes = _messaging("publish", m.exchange, m.routing_key, m.message_id)
        attributes["custody.outbox"] = outbox  # engine, or the participant's name
        span = _tracer.start_span(
            f"publish {m.exchange}",
            context=_parent(_header(m.headers)),
            kind=_kind("PRODUCER"),
            attributes=attributes,
        )
        spans[m.message_id] = span
        sent.append(replace(m, headers={**m.headers, "traceparent": _traceparent(span)}))
    return sent, Published(spans)


# what a boundary's transaction holds while it runs: ``set`` its ids on any of them
Traced = Spanned | Claimed | Noop
