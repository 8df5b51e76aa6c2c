"""Forwarding one generation request: pick a decode rank (and a prefill rank when the
cluster is disaggregated), send the body to the decode rank with the prefill rank's URL in
PREFILL_URL_HEADER, and relay the answer: JSON as it came, SSE chunk by chunk, reading the
usage the rank reports and the time to the first streamed bytes on the way. A rank that
cannot be reached is marked unhealthy; the client gets an OpenAI-shaped 502/503."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvstrata.errors_text import describe_error
from kvstrata.router.body import Outgoing, RelayBody
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.policy import NoRankAvailable, Policy, RoutingDecision, RoutingRequest
from kvstrata.router.prefix import routed_boundary_hashes
from kvstrata.router.usage import CachedTokens, SseUsage, usage_of_json
from kvstrata.router.workers import RankState, Role, RoutedRequest, WorkerRegistry
from kvstrata.server.errors import CLIENT_GONE, OpenAIError, error_body
from kvstrata.server.state import PREFILL_URL_HEADER, until_disconnect

# Response headers worth relaying; hop-by-hop ones (length, encoding) are the router's own.
_RELAYED_HEADERS = ("content-type", "cache-control", "x-accel-buffering")

logger = logging.getLogger("kvstrata.router")


@dataclass(frozen=True)
class Route:
    """Where one request goes: the decode rank that answers it and the prefill rank that
    computes its prompt (None: the decode rank is a unified rank)."""

    decode: RankState
    prefill: RankState | None
    decision: RoutingDecision


class _Lease:
    """One forwarded request's place in the ranks' in-flight and routed counts (and its
    prefix in the decode rank's routed prefixes); released once."""

    def __init__(self, workers: WorkerRegistry, route: Route, request: RoutingRequest) -> None:
        self._workers = workers
        self._held: list[tuple[RankState, RoutedRequest]] = []
        num_tokens = request.num_prompt_tokens
        decode_view = route.decode.view()
        hashes = routed_boundary_hashes(request, decode_view)
        num_new = num_tokens - route.decision.matched_tokens
        self._held.append(
            (route.decode, workers.begin_request(route.decode, num_tokens, hashes, num_new))
        )
        if route.prefill is not None:
            self._held.append((route.prefill, workers.begin_request(route.prefill, num_tokens)))

    def first_token(self) -> None:
        if self._held:
            rank, routed = self._held[0]  # the decode rank
            self._workers.first_token(rank, routed)

    def release(self) -> None:
        for rank, routed in self._held:
            self._workers.end_request(rank, routed)
        self._held = []


class Forwarder:
    def __init__(
        self, workers: WorkerRegistry, client: httpx.AsyncClient, metrics: RouterMetrics,
        policy: Policy, prefill_policy: Policy, calibrate_ttft: bool = True,
    ) -> None:  # fmt: skip
        self.workers = workers
        self.client = client
        self.metrics = metrics
        self.policy = policy
        self.prefill_policy = prefill_policy
        self.calibrate_ttft = calibrate_ttft

    def route(self, request: RoutingRequest) -> Route:
        """Raises OpenAIError(503) when no decode (or prefill) rank is healthy."""
        decision = self._choose(Role.DECODE, self.policy, request)
        decode = self.workers.decode[decision.index]
        prefill = None
        if self.workers.is_disaggregated:
            prefill_decision = self._choose(Role.PREFILL, self.prefill_policy, request)
            prefill = self.workers.prefill[prefill_decision.index]
        self.metrics.matched_tokens.inc(decision.matched_tokens)
        return Route(decode, prefill, decision)

    def _choose(self, role: Role, policy: Policy, request: RoutingRequest) -> RoutingDecision:
        try:
            decision = policy.choose(request, self.workers.views(role))
        except NoRankAvailable:
            ranks = self.workers.of(role)
            errors = "; ".join(f"{r.url}: {r.last_error or 'no answer yet'}" for r in ranks)
            raise OpenAIError(
                503, f"no healthy {role.value} rank ({errors})", code="no_healthy_rank"
            ) from None
        label = decision.policy or policy.name
        self.metrics.decisions.labels(role.value, label, decision.branch).inc()
        return decision

    async def forward(self, request: Request, path: str, outgoing: Outgoing) -> Response:
        """Forward a generation request and relay the answer. A rank that refuses the
        connection has not seen the request, so another one is tried. The body and the
        routing request are released once a rank answered (or none will)."""
        try:
            return await self._forward(request, path, outgoing)
        finally:
            outgoing.release()

    async def _forward(self, request: Request, path: str, outgoing: Outgoing) -> Response:
        assert outgoing.body is not None and outgoing.routing is not None
        for _ in range(len(self.workers.decode)):
            route = self.route(outgoing.routing)
            lease = _Lease(self.workers, route, outgoing.routing)
            self._count_request(route)
            sent_s = time.monotonic()
            send = self.client.send(self._build(request, path, outgoing.body, route), stream=True)
            try:
                upstream = await until_disconnect(request, send)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                lease.release()
                self.failed(route.decode, "connect", e)
                continue
            except httpx.HTTPError as e:
                lease.release()
                self.failed(route.decode, "send", e)
                raise OpenAIError(
                    502, f"decode rank {route.decode.url} failed: {describe_error(e)}",
                    code="upstream_error",
                ) from e  # fmt: skip
            except BaseException:  # e.g. the handler cancelled at shutdown
                lease.release()
                raise
            outgoing.release()  # the rank has the body: nothing here needs it any more
            if upstream is None:  # the client left before the rank answered
                lease.release()
                return Response(status_code=CLIENT_GONE)
            if upstream.status_code >= 500:
                self._count_error(route.decode, f"status_{upstream.status_code}")
            return await self._relay(request, upstream, route, lease, sent_s)
        raise OpenAIError(503, "no decode rank accepted the connection", code="no_healthy_rank")

    def _build(self, request: Request, path: str, body: RelayBody, route: Route) -> httpx.Request:
        # Streamed in slices with the length declared, so the rank can refuse an
        # oversized body before reading it, and httpx keeps no joined copy.
        headers = {
            "content-type": request.headers.get("content-type", "application/json"),
            "content-length": str(body.num_bytes),
        }
        if route.prefill is not None:
            headers[PREFILL_URL_HEADER] = route.prefill.url
        url = f"{route.decode.url}{path}"
        if request.url.query:
            url += f"?{request.url.query}"
        return self.client.build_request("POST", url, content=body.chunks(), headers=headers)

    async def _relay(
        self, request: Request, upstream: httpx.Response, route: Route, lease: _Lease,
        sent_s: float,
    ) -> Response:  # fmt: skip
        headers = {k: upstream.headers[k] for k in _RELAYED_HEADERS if k in upstream.headers}
        if headers.get("content-type", "").startswith("text/event-stream"):

            async def on_close() -> None:
                lease.release()
                await _close(upstream)

            chunks = self._stream(upstream, route, lease, sent_s)
            return RelayStream(chunks, upstream.status_code, headers, on_close)
        try:
            content = await until_disconnect(request, upstream.aread())
        except httpx.HTTPError as e:
            self.failed(route.decode, "read", e)
            raise OpenAIError(
                502, f"decode rank {route.decode.url} failed mid-response: {describe_error(e)}",
                code="upstream_error",
            ) from e  # fmt: skip
        finally:
            lease.release()
            await _close(upstream)
        if content is None:
            return Response(status_code=CLIENT_GONE)
        if upstream.status_code == 200:
            self._count_usage(route, usage_of_json(content))
        return Response(content, status_code=upstream.status_code, headers=headers)

    async def _stream(
        self, upstream: httpx.Response, route: Route, lease: _Lease, sent_s: float
    ) -> AsyncGenerator[bytes, None]:
        # Chunks go out as they arrive. When the client leaves, the response closes this
        # generator (or cancels it), which closes the upstream connection: the rank sees
        # its client go and aborts the request, freeing its pages.
        usage = SseUsage()
        first = True
        try:
            async for chunk in upstream.aiter_raw():
                if first and upstream.status_code == 200:
                    first = False
                    lease.first_token()
                    self._observe_ttft(route, time.monotonic() - sent_s)
                usage.feed(chunk)
                yield chunk
            if upstream.status_code == 200:
                self._count_usage(route, usage.usage)
        except httpx.HTTPError as e:
            self.failed(route.decode, "stream", e)
            message = f"decode rank {route.decode.url} failed mid-stream: {describe_error(e)}"
            event = json.dumps(error_body(502, message, code="upstream_error"))
            yield f"data: {event}\n\ndata: [DONE]\n\n".encode()
        finally:
            lease.release()
            await _close(upstream)

    def _observe_ttft(self, route: Route, observed_s: float) -> None:
        estimated_s = route.decision.estimated_ttft_s
        if self.calibrate_ttft and estimated_s is not None:
            self.workers.observe_ttft(route.decode, estimated_s, observed_s)

    def _count_usage(self, route: Route, usage: CachedTokens | None) -> None:
        """Estimated vs actual cached tokens, for answers whose usage the router saw."""
        if usage is None:
            return
        rank = route.decode
        labels = (rank.role.value, str(rank.index), rank.url)
        for kind, num_tokens in (
            ("prompt", usage.prompt_tokens), ("estimated", route.decision.matched_tokens),
            ("l1", usage.l1_tokens), ("l2", usage.l2_tokens), ("l3", usage.l3_tokens),
        ):  # fmt: skip
            self.metrics.usage_tokens.labels(*labels, kind).inc(num_tokens)

    def failed(self, rank: RankState, kind: str, error: Exception) -> None:
        """A forward to `rank` failed at the transport level: stop routing to it."""
        self._count_error(rank, kind)
        self.workers.on_forward_failed(rank, f"{kind}: {describe_error(error)}")

    def _count_request(self, route: Route) -> None:
        for rank in (route.decode, route.prefill):
            if rank is not None:
                self.metrics.requests.labels(rank.role.value, str(rank.index), rank.url).inc()

    def _count_error(self, rank: RankState, kind: str) -> None:
        labels = (rank.role.value, str(rank.index), rank.url, kind)
        self.metrics.upstream_errors.labels(*labels).inc()


class RelayStream(StreamingResponse):
    """Relays an upstream SSE body with the upstream's status. However the response ends
    (stream done, client gone, handler cancelled) it closes the chunk generator and then
    awaits `on_close`, which also covers a generator that never started."""

    def __init__(
        self, chunks: AsyncGenerator[bytes, None], status_code: int, headers: dict[str, str],
        on_close: Callable[[], Awaitable[None]],
    ) -> None:  # fmt: skip
        super().__init__(chunks, status_code=status_code, headers=headers)
        self._chunks = chunks
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (OSError, ClientDisconnect):
            pass  # the client is gone; there is nobody to report to
        finally:
            await self._chunks.aclose()
            await self._on_close()


async def _close(upstream: httpx.Response) -> None:
    # Shielded: this runs while the handler is being cancelled for a client disconnect,
    # and an unfinished close would leave the rank generating for nobody.
    with anyio.CancelScope(shield=True):
        await upstream.aclose()
