"""Request tracing, as the rest of kvstrata sees it: the `Tracer` and `Span` contracts, the
null tracer (no --otlp-traces-endpoint: nothing is recorded, nothing imported) and the
factory that picks it or the OpenTelemetry one (otel_tracing.py); W3C `traceparent`."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType

# A span's attribute values, as OTLP carries them.
AttributeValue = str | bool | int | float | list[str]
Attributes = Mapping[str, AttributeValue]
NO_ATTRIBUTES: Attributes = MappingProxyType({})
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"


def wall_ns(monotonic_s: float) -> int:
    """A moment of the monotonic clock (the engine thread's timestamps) as nanoseconds
    since the epoch (what spans carry), read against the two clocks now."""
    return time.time_ns() - round((time.monotonic() - monotonic_s) * 1e9)


class Span(ABC):
    """One timed operation of a request. Spans are built on the event loop only: the engine
    thread records timestamps, and spans are made from them afterwards with explicit
    start and end times. `end` is called once; a child may be made after its parent ended."""

    @abstractmethod
    def child(
        self, name: str, attributes: Attributes = NO_ATTRIBUTES, start_ns: int | None = None
    ) -> Span:
        """A span under this one, started at `start_ns` (default: now)."""

    @abstractmethod
    def set(self, attributes: Attributes) -> None: ...

    @abstractmethod
    def end(self, end_ns: int | None = None) -> None:
        """End at `end_ns` (default: now)."""

    @abstractmethod
    def headers(self) -> dict[str, str]:
        """The W3C trace-context headers that make a callee's spans this span's children."""

    def record(
        self, name: str, start_ns: int, end_ns: int, attributes: Attributes = NO_ATTRIBUTES
    ) -> Span:
        """A finished child spanning [start_ns, end_ns]."""
        span = self.child(name, attributes, start_ns)
        span.end(max(start_ns, end_ns))
        return span


class Tracer(ABC):
    """Starts the span that represents one incoming call, under the caller's span when its
    headers carry a `traceparent`, and flushes what was recorded when the process stops."""

    @abstractmethod
    def request_span(
        self, name: str, headers: Mapping[str, str], attributes: Attributes = NO_ATTRIBUTES
    ) -> Span: ...

    @abstractmethod
    def shutdown(self) -> None:
        """Export what is still buffered (bounded by the exporter's timeout); idempotent."""


class NullSpan(Span):
    """Records nothing; one instance serves every request."""

    def child(
        self, name: str, attributes: Attributes = NO_ATTRIBUTES, start_ns: int | None = None
    ) -> Span:
        return self

    def set(self, attributes: Attributes) -> None:
        pass

    def end(self, end_ns: int | None = None) -> None:
        pass

    def headers(self) -> dict[str, str]:
        return {}


NULL_SPAN = NullSpan()


class NullTracer(Tracer):
    def request_span(
        self, name: str, headers: Mapping[str, str], attributes: Attributes = NO_ATTRIBUTES
    ) -> Span:
        return NULL_SPAN

    def shutdown(self) -> None:
        pass


NULL_TRACER = NullTracer()


def make_tracer(endpoint: str | None, service_name: str) -> Tracer:
    """The OpenTelemetry tracer exporting to `endpoint` (OTLP/HTTP), or the null tracer
    when it is None. The SDK is imported here, only when asked for."""
    if endpoint is None:
        return NULL_TRACER
    from kvstrata.http.otel_tracing import OtelTracer, otlp_exporter

    return OtelTracer(service_name, otlp_exporter(endpoint))
