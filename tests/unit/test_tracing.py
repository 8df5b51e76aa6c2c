"""Request tracing's span-building pieces against the OpenTelemetry SDK's in-memory
exporter: the null tracer, traceparent in and out, and the spans of the router's decision,
a rank's request (queue, prefix match per tier, L3 restore, prefill) and a PD room
(prefill queue and compute, transfer bytes and GB/s)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvstrata.core import CacheUsage, PrefillPath, RequestOutput
from kvstrata.disagg.protocol import PrefillResult
from kvstrata.http.otel_tracing import OtelTracer, otlp_exporter
from kvstrata.http.tracing import NULL_SPAN, NULL_TRACER, make_tracer, wall_ns
from kvstrata.pd.room_trace import (
    PREFILL_COMPUTE_SPAN,
    PREFILL_QUEUE_SPAN,
    TRANSFER_SPAN,
    record_prefill,
)
from kvstrata.router.attempt import Route
from kvstrata.router.policy import RoutingDecision
from kvstrata.router.route_trace import ATTEMPT_SPAN, DECISION_SPAN, trace_route
from kvstrata.router.workers import WorkerRegistry
from kvstrata.runtime.request_group import RequestGroup
from kvstrata.server.request_spans import (
    L3_RESTORE_SPAN,
    PREFILL_SPAN,
    PREFIX_MATCH_SPAN,
    QUEUE_SPAN,
    record_first_token,
    trace_group,
)

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN_ID = 0x00F067AA0BA902B7
CLIENT_HEADERS = {"traceparent": f"00-{TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"}


@pytest.fixture
def exported() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exported: InMemorySpanExporter) -> OtelTracer:
    return OtelTracer("test", exported, batch=False)


def by_name(exported: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exported.get_finished_spans()}


def output(usage: CacheUsage, admitted_s: float | None) -> RequestOutput:
    return RequestOutput(
        "r-0", list(range(40)), [7], [7], "", False, None, usage, admitted_s=admitted_s
    )


def test_null_tracer_records_nothing_and_imports_no_sdk() -> None:
    assert make_tracer(None, "x") is NULL_TRACER
    span = NULL_TRACER.request_span("a", CLIENT_HEADERS)
    assert span is NULL_SPAN and span.child("b") is NULL_SPAN and span.headers() == {}
    code = (
        "import sys, kvstrata.router.app, kvstrata.http.tracing as t; t.make_tracer(None, 'x');"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry.sdk')], 'SDK';"
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_exporter_url_gets_the_traces_path() -> None:
    assert otlp_exporter("http://h:4318/")._endpoint == "http://h:4318/v1/traces"
    assert otlp_exporter("http://h:4318/v1/traces")._endpoint == "http://h:4318/v1/traces"


def test_request_span_continues_the_client_trace_and_hands_it_on(
    tracer: OtelTracer, exported: InMemorySpanExporter
) -> None:
    span = tracer.request_span("kvstrata.rank.request", CLIENT_HEADERS, {"k": 1})
    child = span.child("inner")
    headers = child.headers()
    child.end()
    span.end()
    spans = by_name(exported)
    outer, inner = spans["kvstrata.rank.request"], spans["inner"]
    assert outer.context.trace_id == inner.context.trace_id == TRACE_ID
    assert outer.parent is not None and outer.parent.span_id == CLIENT_SPAN_ID
    assert inner.parent is not None and inner.parent.span_id == outer.context.span_id
    version, trace_id, parent_id, _ = headers["traceparent"].split("-")
    assert (version, int(trace_id, 16), int(parent_id, 16)) == (
        "00",
        TRACE_ID,
        inner.context.span_id,
    )
    assert outer.attributes == {"k": 1}


def test_router_decision_span(tracer: OtelTracer, exported: InMemorySpanExporter) -> None:
    workers = WorkerRegistry(("http://p:1",), ("http://d:1", "http://d:2"), 2)
    decode = workers.decode[1]
    decision = RoutingDecision(1, decode.url, "match", 32, "ttft", estimated_ttft_s=0.25)
    route = Route(decode, workers.prefill[0], decision)
    request = tracer.request_span("kvstrata.router.request", CLIENT_HEADERS)
    attempt = trace_route(request, route, workers.decode, 48, (1_000, 2_000), 0)
    attempt.end()
    request.end()
    spans = by_name(exported)
    chosen = spans[DECISION_SPAN]
    assert (chosen.start_time, chosen.end_time) == (1_000, 2_000)
    assert dict(chosen.attributes or {}) == {
        "kvstrata.route.policy": "ttft",
        "kvstrata.route.branch": "match",
        "kvstrata.route.candidates": ("http://d:1", "http://d:2"),
        "kvstrata.route.decode_url": "http://d:2",
        "kvstrata.route.decode_rank": 1,
        "kvstrata.route.prefill_url": "http://p:1",
        "kvstrata.route.matched_tokens": 32,
        "kvstrata.route.prompt_tokens": 48,
        "kvstrata.route.estimated_ttft_s": 0.25,
    }
    root = spans["kvstrata.router.request"].context.span_id
    assert chosen.parent is not None and chosen.parent.span_id == root
    assert spans[ATTEMPT_SPAN].parent is not None and spans[ATTEMPT_SPAN].parent.span_id == root


def test_rank_request_spans_per_tier(tracer: OtelTracer, exported: InMemorySpanExporter) -> None:
    span = tracer.request_span("kvstrata.rank.request", CLIENT_HEADERS)
    submitted_s = time.monotonic() - 0.5
    admitted_s = submitted_s + 0.2
    usage = CacheUsage(16, 8, 4, 12, 0, PrefillPath.REMOTE)
    record_first_token(span, submitted_s, output(usage, admitted_s))
    span.end()
    spans = by_name(exported)
    queue = spans[QUEUE_SPAN]
    assert queue.end_time is not None and queue.start_time is not None
    assert abs((queue.end_time - queue.start_time) / 1e9 - 0.2) < 0.01
    assert abs(queue.end_time - wall_ns(admitted_s)) < 10_000_000
    match = dict(spans[PREFIX_MATCH_SPAN].attributes or {})
    assert match == {
        "kvstrata.rid": "r-0",
        "kvstrata.prompt_tokens": 40,
        "kvstrata.cache.l1_tokens": 16,
        "kvstrata.cache.l2_tokens": 8,
        "kvstrata.cache.l3_tokens": 4,
        "kvstrata.transferred_tokens": 12,
        "kvstrata.local_prefill_tokens": 0,
        "kvstrata.prefill_path": "remote",
    }
    assert (spans[L3_RESTORE_SPAN].attributes or {})["kvstrata.cache.l3_tokens"] == 4
    assert (spans[PREFILL_SPAN].attributes or {})["kvstrata.prefill_path"] == "remote"
    parent = spans["kvstrata.rank.request"].context.span_id
    assert all(
        s.parent is not None and s.parent.span_id == parent
        for s in spans.values()
        if s.name != "kvstrata.rank.request"
    )


def test_no_l3_span_without_l3_tokens(tracer: OtelTracer, exported: InMemorySpanExporter) -> None:
    span = tracer.request_span("r", {})
    record_first_token(span, time.monotonic(), output(CacheUsage(16), None))
    names = set(by_name(exported))
    assert L3_RESTORE_SPAN not in names and {QUEUE_SPAN, PREFIX_MATCH_SPAN} <= names
    assert (by_name(exported)[PREFIX_MATCH_SPAN].attributes or {})["kvstrata.prefill_path"] == (
        "unified"
    )


def test_prefill_room_spans(tracer: OtelTracer, exported: InMemorySpanExporter) -> None:
    span = tracer.request_span("kvstrata.pd.prefill", CLIENT_HEADERS)
    now_s = time.monotonic()
    result = PrefillResult("room-1", 5, 4, 8, prefill_s=0.3, send_s=0.002)
    out = output(CacheUsage(8), admitted_s=now_s - 0.25)
    record_prefill(span, now_s - 0.3, out, now_s - 0.05, result, page_bytes=1_000_000)
    span.end()
    spans = by_name(exported)
    transfer = dict(spans[TRANSFER_SPAN].attributes or {})
    assert transfer["kvstrata.transfer.bytes"] == 4_000_000
    assert transfer["kvstrata.transfer.pages"] == 4
    assert transfer["kvstrata.transfer.gb_per_s"] == pytest.approx(2.0)
    moved = spans[TRANSFER_SPAN]
    assert moved.end_time is not None and moved.start_time is not None
    assert moved.end_time - moved.start_time == 2_000_000
    compute = spans[PREFILL_COMPUTE_SPAN]
    assert (compute.attributes or {})["kvstrata.prefill_cached_tokens"] == 8
    assert compute.end_time is not None and compute.start_time is not None
    assert abs((compute.end_time - compute.start_time) / 1e9 - 0.2) < 0.01
    assert PREFILL_QUEUE_SPAN in spans


def test_group_records_each_first_token_once_and_ends_on_close(
    tracer: OtelTracer, exported: InMemorySpanExporter
) -> None:
    async def run() -> None:
        group = RequestGroup(["g-0", "g-1"], None, lambda rids: None)
        span = tracer.request_span("kvstrata.rank.request", {})
        trace_group(span, group)
        usage = CacheUsage(0)
        for rid in ("g-0", "g-0", "g-1"):
            group._deliver(RequestOutput(rid, [1], [2], [2], "", False, None, usage))
        group.close()

    asyncio.run(run())
    names = [span.name for span in exported.get_finished_spans()]
    assert names.count(QUEUE_SPAN) == 2 and names.count("kvstrata.rank.request") == 1


def test_the_flag_is_checked_on_router_and_rank() -> None:
    from kvstrata.config import ConfigError, RouterConfig, ServerConfig

    url = "http://127.0.0.1:4318"
    assert RouterConfig(decode=("http://d:1",), otlp_traces_endpoint=url).otlp_traces_endpoint
    assert ServerConfig(otlp_traces_endpoint=url).otlp_traces_endpoint == url
    with pytest.raises(ConfigError, match="--otlp-traces-endpoint"):
        ServerConfig(otlp_traces_endpoint="127.0.0.1:4318")
