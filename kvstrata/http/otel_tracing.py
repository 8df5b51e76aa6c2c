"""The OpenTelemetry `Tracer` (tracing.py's contract): its own SDK provider (never the
process-global one) with a batching span processor, so ending a span only queues it and
a background thread exports; imported only when --otlp-traces-endpoint is set."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvstrata.http.tracing import NO_ATTRIBUTES, Attributes, Span, Tracer

OTLP_TRACES_PATH = "/v1/traces"
_PROPAGATOR = TraceContextTextMapPropagator()


def otlp_exporter(endpoint: str) -> OTLPSpanExporter:
    """OTLP/HTTP protobuf to `endpoint`, its /v1/traces path added unless given."""
    url = endpoint.rstrip("/")
    if not url.endswith(OTLP_TRACES_PATH):
        url += OTLP_TRACES_PATH
    return OTLPSpanExporter(endpoint=url)


class OtelSpan(Span):
    def __init__(self, tracer: trace.Tracer, span: trace.Span) -> None:
        self._tracer = tracer
        self._span = span

    def child(
        self, name: str, attributes: Attributes = NO_ATTRIBUTES, start_ns: int | None = None
    ) -> Span:
        context = trace.set_span_in_context(self._span)
        span = self._tracer.start_span(
            name, context, attributes=dict(attributes), start_time=start_ns
        )
        return OtelSpan(self._tracer, span)

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(dict(attributes))

    def end(self, end_ns: int | None = None) -> None:
        self._span.end(end_ns)

    def headers(self) -> dict[str, str]:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(self._span))
        return carrier


class OtelTracer(Tracer):
    """Spans of one process (`service_name`: its role and rank) exported by `exporter`.
    `batch` False exports each span as it ends (unit tests with an in-memory exporter)."""

    def __init__(self, service_name: str, exporter: SpanExporter, batch: bool = True) -> None:
        resource = Resource.create({"service.name": service_name})
        self._provider = TracerProvider(resource=resource)
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("kvstrata")

    def request_span(
        self, name: str, headers: Mapping[str, str], attributes: Attributes = NO_ATTRIBUTES
    ) -> Span:
        context = _PROPAGATOR.extract(headers)
        span = self._tracer.start_span(
            name, context, trace.SpanKind.SERVER, attributes=dict(attributes)
        )
        return OtelSpan(self._tracer, span)

    def shutdown(self) -> None:
        self._provider.shutdown()  # flushes the batch processor first
