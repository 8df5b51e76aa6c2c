"""--otlp-traces-endpoint end to end: a router, a prefill rank and a decode rank (real
processes) export to an OTLP/HTTP receiver run here; one PD request with a client
`traceparent` gives one connected span tree under the client's span, with the router's
decision, the decode rank's queue and prefix match, the prefill compute and the transfer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from pd_harness import generate, start_decode, start_prefill
from server_harness import ServerProcess, _free_port, spawn
from test_router import wait_healthy

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
EXPECTED = {
    "kvstrata.router.request",
    "kvstrata.router.decision",
    "kvstrata.router.attempt",
    "kvstrata.rank.request",
    "kvstrata.rank.queue",
    "kvstrata.rank.prefix_match",
    "kvstrata.rank.prefill",
    "kvstrata.pd.room",
    "kvstrata.pd.prefill",
    "kvstrata.pd.prefill_queue",
    "kvstrata.pd.prefill_compute",
    "kvstrata.pd.transfer",
}


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf, every span kept."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                assert self.path == "/v1/traces", self.path
                assert self.headers["content-type"] == "application/x-protobuf"
                receiver.add(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received = ReceivedSpan(
                        resource["service.name"],
                        span.name,
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in span.attributes},
                    )
                    with self._lock:
                        self.spans.append(received)

    def wait_for(self, names: set[str], timeout_s: float = 30.0) -> list[ReceivedSpan]:
        deadline_s = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if names <= {span.name for span in spans}:
                return spans
            missing = names - {span.name for span in spans}
            assert time.monotonic() < deadline_s, f"spans never exported: {missing}"
            time.sleep(0.1)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()


@pytest.fixture
def cluster(
    tiny_llama: Path,
    tmp_path: Path,
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[list[ServerProcess]]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s
    traced = ("--otlp-traces-endpoint", receiver.url)
    started: list[ServerProcess] = []
    try:
        started.append(start_prefill(tiny_llama, tmp_path, *traced))
        started.append(start_decode(tiny_llama, tmp_path, [started[0].base_url], *traced))
        port = _free_port()
        ranks = ("--prefill", started[0].base_url, "--decode", started[1].base_url)
        flags = ("--log-level", "warning", "--load-poll-interval-s", "0.2", *traced)
        router = spawn(tmp_path / "router.log", port, "router", *ranks, *flags)
        started.append(router)
        wait_healthy(router)
        yield started
    finally:
        for process in started:
            process.stop()


def test_one_pd_request_gives_one_connected_trace(
    cluster: list[ServerProcess], receiver: Receiver
) -> None:
    prefill, decode, router = cluster
    with httpx.Client(base_url=router.base_url, timeout=60) as http:
        response = generate(http, list(range(1, 41)), traceparent=TRACEPARENT)
    assert response.status_code == 200, response.text
    spans = receiver.wait_for(EXPECTED)

    assert {span.trace_id for span in spans} == {TRACE_ID}
    ids = {span.span_id for span in spans}
    for span in spans:  # every parent is the client's span or one of the tree's
        assert span.parent_span_id in ids | {CLIENT_SPAN_ID}, span
    roots = [span for span in spans if span.parent_span_id == CLIENT_SPAN_ID]
    assert [span.name for span in roots] == ["kvstrata.router.request"]
    assert {span.service for span in spans} == {
        "kvstrata-router",
        "kvstrata-decode-rank0",
        "kvstrata-prefill-rank0",
    }
    named = {span.name: span for span in spans}
    parent_of = {span.span_id: span for span in spans}
    for child, parent in (
        ("kvstrata.rank.request", "kvstrata.router.attempt"),
        ("kvstrata.pd.room", "kvstrata.rank.request"),
        ("kvstrata.pd.prefill", "kvstrata.pd.room"),
        ("kvstrata.pd.transfer", "kvstrata.pd.prefill"),
    ):
        assert parent_of[named[child].parent_span_id].name == parent, child

    decision = named["kvstrata.router.decision"].attributes
    assert decision["kvstrata.route.policy"] == "round_robin"
    assert decision["kvstrata.route.candidates"] == [decode.base_url]
    assert decision["kvstrata.route.decode_url"] == decode.base_url
    assert decision["kvstrata.route.prefill_url"] == prefill.base_url
    match = named["kvstrata.rank.prefix_match"].attributes
    assert match["kvstrata.prefill_path"] == "remote"
    assert match["kvstrata.prompt_tokens"] == 40
    assert match["kvstrata.transferred_tokens"] + match["kvstrata.cache.l1_tokens"] == 40
    assert "kvstrata.rid" in named["kvstrata.rank.queue"].attributes
    assert named["kvstrata.pd.prefill_compute"].attributes["kvstrata.prompt_tokens"] == 40
    transfer = named["kvstrata.pd.transfer"].attributes
    assert transfer["kvstrata.transfer.bytes"] > 0 and transfer["kvstrata.transfer.pages"] > 0
    assert transfer["kvstrata.transfer.gb_per_s"] >= 0
    room = named["kvstrata.pd.room"].attributes
    assert room["kvstrata.prefill_url"] == prefill.base_url
    assert room["kvstrata.pages_written"] == transfer["kvstrata.transfer.pages"]
