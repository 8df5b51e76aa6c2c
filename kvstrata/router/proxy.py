"""Forwarding one generation request: pick a decode rank (and a prefill rank when the
cluster is disaggregated), send the body to the decode rank with the prefill rank's URL in
PREFILL_URL_HEADER, and relay the answer: JSON as it came, SSE chunk by chunk, reading the
usage the rank reports and the time to the first streamed bytes on the way. An attempt
that fails before any byte reached the client (refused, reset, 502/503) is sent again to
ranks it has not tried, within the retry policy and the circuit breakers; once a byte
went out, a failure reaches the client as an OpenAI-shaped error event."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvstrata.errors_text import describe_error
from kvstrata.http.closing_stream import ClosingStream
from kvstrata.router import relay
from kvstrata.router import retry as retries
from kvstrata.router.attempt import Attempt, Route
from kvstrata.router.body import Outgoing, RelayBody
from kvstrata.router.breaker import CircuitBreakers, Ticket
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.policy import NoRankAvailable, Policy, RoutingDecision, RoutingRequest
from kvstrata.router.relay import close_upstream
from kvstrata.router.retry import Attempts, Failure, RetryPolicy
from kvstrata.router.usage import CachedTokens, SseUsage, usage_of_json
from kvstrata.router.workers import RankState, Role, WorkerRegistry
from kvstrata.server.errors import CLIENT_GONE, OpenAIError, error_body
from kvstrata.server.state import PREFILL_URL_HEADER, until_disconnect

# A failed attempt's own answer (a 502/503 error body) is kept up to this size, to be
# relayed if no attempt is left.
MAX_FAILED_ANSWER_BYTES = 64 * 1024
Urls = set[str] | frozenset[str]


class Forwarder:
    def __init__(
        self, workers: WorkerRegistry, client: httpx.AsyncClient, metrics: RouterMetrics,
        policy: Policy, prefill_policy: Policy, calibrate_ttft: bool = True,
        retry: RetryPolicy | None = None, breakers: CircuitBreakers | None = None,
    ) -> None:  # fmt: skip
        """`retry` None: one attempt per request; `breakers` None: none ever opens."""
        self.workers = workers
        self.client = client
        self.metrics = metrics
        self.policy = policy
        self.prefill_policy = prefill_policy
        self.calibrate_ttft = calibrate_ttft
        self.retry = retry or RetryPolicy(1, 0.0, 0.0, 1.0, 0.0)
        self.breakers = breakers or CircuitBreakers(0, 0.0)
        self._rng = random.Random()
        metrics.watch_breakers(self.breakers, workers)

    def route(self, request: RoutingRequest, attempts: Attempts | None = None) -> Route:
        """The best route that avoids ranks whose breaker is open and, where another is
        left, the ranks of the request's failed attempts (a decode rank's failure need not
        be its own: in a PD cluster it may answer for its prefill rank), never a route
        tried before. Raises OpenAIError(503) when no decode (or prefill) rank is left."""
        tried = frozenset() if attempts is None else attempts.tried_urls
        avoid = self._avoid(Role.DECODE, tried) if self.workers.is_disaggregated else tried
        decision = self._choose(Role.DECODE, self.policy, request, avoid)
        decode = self.workers.decode[decision.index]
        prefill = None
        if self.workers.is_disaggregated:
            avoid = self._avoid(Role.PREFILL, tried)
            prefill_decision = self._choose(Role.PREFILL, self.prefill_policy, request, avoid)
            prefill = self.workers.prefill[prefill_decision.index]
            if attempts is not None and (decode.url, prefill.url) in attempts.tried_routes:
                raise OpenAIError(503, f"every route of this request failed (last: decode "
                                  f"rank {decode.url}, prefill rank {prefill.url})",
                                  code="no_healthy_rank")  # fmt: skip
        self.metrics.matched_tokens.inc(decision.matched_tokens)
        return Route(decode, prefill, decision)

    def _avoid(self, role: Role, tried: Urls) -> Urls:
        """`tried`, unless no rank of `role` would be left: then none."""
        if any(self._may_send(rank, tried) for rank in self.workers.of(role)):
            return tried
        return frozenset()

    def _may_send(self, rank: RankState, avoid: Urls) -> bool:
        return rank.healthy and rank.url not in avoid and self.breakers.allows(rank.url)

    def _choose(
        self, role: Role, policy: Policy, request: RoutingRequest, avoid: Urls
    ) -> RoutingDecision:
        ranks = self.workers.of(role)
        # A rank the request may not go to is shown to the policy as unhealthy, which
        # every policy skips; the indices stay the registry's.
        views = [view if self._may_send(rank, avoid) else dataclasses.replace(view, healthy=False)
                 for rank, view in zip(ranks, self.workers.views(role))]  # fmt: skip
        try:
            decision = policy.choose(request, views)
        except NoRankAvailable:
            errors = "; ".join(f"{r.url}: {self._why_not(r, avoid)}" for r in ranks)
            raise OpenAIError(
                503, f"no healthy {role.value} rank ({errors})", code="no_healthy_rank"
            ) from None
        label = decision.policy or policy.name
        self.metrics.decisions.labels(role.value, label, decision.branch).inc()
        return decision

    def _why_not(self, rank: RankState, avoid: Urls) -> str:
        if rank.url in avoid:
            return f"failed this request ({rank.last_error or 'answered an error'})"
        if rank.healthy and not self.breakers.allows(rank.url):
            return f"circuit breaker {self.breakers.state(rank.url).value}"
        return rank.last_error or "no answer yet"

    async def forward(self, request: Request, path: str, outgoing: Outgoing) -> Response:
        """Forward a generation request and relay the answer, retrying attempts that
        failed before any byte reached the client. The body and the routing request are
        released once an answer is on its way to the client (or none will be)."""
        try:
            return await self._forward(request, path, outgoing)
        finally:
            outgoing.release()

    async def _forward(self, request: Request, path: str, outgoing: Outgoing) -> Response:
        assert outgoing.body is not None and outgoing.routing is not None
        attempts = Attempts(self.retry)
        failure: Failure | None = None
        while True:
            try:
                route = self.route(outgoing.routing, attempts)
            except OpenAIError:
                if failure is None:
                    raise
                self.metrics.retries_exhausted.labels(failure.cause).inc()
                if failure.answer is None:
                    raise  # no rank left to try: the 503 says why for each
                return failure.answer
            if failure is not None:  # counted once it is sent: a rank was left for it
                self.metrics.retries.labels(failure.cause).inc()
            result = await self._try(request, path, outgoing, route)
            if not isinstance(result, Failure):
                return result
            failure = result
            prefill_url = route.prefill.url if route.prefill is not None else None
            attempts.record(route.decode.url, prefill_url, failure.cause)
            if not attempts.may_retry:
                self.metrics.retries_exhausted.labels(failure.cause).inc()
                return failure.final_answer()
            wait_s = self.retry.backoff_s(attempts.num_attempts, self._rng)
            if await until_disconnect(request, asyncio.sleep(wait_s, True)) is None:
                return Response(status_code=CLIENT_GONE)

    async def _try(
        self, request: Request, path: str, outgoing: Outgoing, route: Route
    ) -> Response | Failure:
        assert outgoing.body is not None and outgoing.routing is not None
        attempt = Attempt(self.workers, self.breakers, route, outgoing.routing)
        self._count_request(route)
        sent_s = time.monotonic()
        send = self.client.send(self._build(request, path, outgoing.body, route), stream=True)
        try:
            upstream = await until_disconnect(request, send)
        except httpx.HTTPError as e:
            return self._broken(attempt, "send", e)
        except BaseException:  # e.g. the handler cancelled at shutdown
            attempt.abandoned()
            raise
        if upstream is None:  # the client left before the rank answered
            attempt.abandoned()
            return Response(status_code=CLIENT_GONE)
        cause = retries.cause_of_status(upstream.status_code)
        if cause is not None:
            return await self._refused(attempt, upstream, cause)
        if upstream.status_code >= 500:
            self._count_error(route.decode, f"status_{upstream.status_code}")
        return await self._relay(request, upstream, attempt, outgoing, sent_s)

    def _broken(self, attempt: Attempt, stage: str, error: httpx.HTTPError) -> Failure:
        """The decode rank's connection failed before its answer was complete (nothing
        reached the client): a Failure if the cause is retryable, else a 502."""
        decode = attempt.route.decode
        cause = retries.cause_of_error(error)
        self.failed(decode, stage if cause in (None, "reset") else cause, error)
        attempt.failed(decode_only=True)
        message = f"decode rank {decode.url} failed: {describe_error(error)}"
        if cause is None:
            raise OpenAIError(502, message, code="upstream_error") from error
        return Failure(cause, message)

    async def _refused(
        self, attempt: Attempt, upstream: httpx.Response, cause: str, first: bytes = b"",
        rest: AsyncIterator[bytes] | None = None,
    ) -> Failure:  # fmt: skip
        """A 502/503 from the rank (or a stream that opened with a 503 event: `first`, then
        `rest`): its answer is kept (bounded) to relay if no other attempt is left."""
        rank = attempt.route.decode
        self._count_error(rank, cause)
        rest = upstream.aiter_bytes() if rest is None else rest
        try:
            content = first + await relay.read_bounded(rest, MAX_FAILED_ANSWER_BYTES)
        except httpx.HTTPError as e:
            message = f"decode rank {rank.url} answered {upstream.status_code}, then failed"
            content = json.dumps(error_body(upstream.status_code, message)).encode()
            self.failed(rank, "read", e)
        finally:
            attempt.failed()
            await close_upstream(upstream)
        answer = Response(content, upstream.status_code, relay.relayed_headers(upstream))
        return Failure(cause, f"decode rank {rank.url} answered {upstream.status_code}", answer)

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
        self, request: Request, upstream: httpx.Response, attempt: Attempt, outgoing: Outgoing,
        sent_s: float,
    ) -> Response | Failure:  # fmt: skip
        """The answer, once its first bytes are in hand (SSE: the first chunk; else the
        whole body) and before any goes out: a connection that breaks before that is a
        failed attempt, one that breaks after is the client's error to see."""
        headers = relay.relayed_headers(upstream)
        is_stream = relay.is_event_stream(headers)
        chunks = upstream.aiter_raw()
        try:
            first = await until_disconnect(
                request, relay.first_chunk(chunks) if is_stream else upstream.aread()
            )
        except httpx.HTTPError as e:
            await close_upstream(upstream)
            return self._broken(attempt, "stream" if is_stream else "read", e)
        except BaseException:
            attempt.abandoned()
            await close_upstream(upstream)
            raise
        if first is None:  # the client left
            attempt.abandoned()
            await close_upstream(upstream)
            return Response(status_code=CLIENT_GONE)
        cause = retries.cause_of_first_event(first) if is_stream else None
        if cause is not None:  # failed before its first token: nothing of it went out
            return await self._refused(attempt, upstream, cause, first, chunks)
        attempt.succeeded()
        outgoing.release()  # the answer is on its way: no retry needs the body any more
        if is_stream:

            async def on_close() -> None:
                attempt.lease.release()
                await close_upstream(upstream)

            stream = self._stream(upstream, first, chunks, attempt, sent_s)
            return ClosingStream(stream, on_close, upstream.status_code, headers)
        attempt.lease.release()
        await close_upstream(upstream)
        if upstream.status_code == 200:
            self._count_usage(attempt.route, usage_of_json(first))
        return Response(first, status_code=upstream.status_code, headers=headers)

    async def _stream(
        self, upstream: httpx.Response, first: bytes, chunks: AsyncIterator[bytes],
        attempt: Attempt, sent_s: float,
    ) -> AsyncGenerator[bytes, None]:  # fmt: skip
        # Chunks go out as they arrive. When the client leaves, the response closes this
        # generator (or cancels it), which closes the upstream connection: the rank sees
        # its client go and aborts the request, freeing its pages.
        route, usage = attempt.route, SseUsage()
        try:
            if upstream.status_code == 200:
                attempt.lease.first_token()
                self._observe_ttft(route, time.monotonic() - sent_s)
            usage.feed(first)
            yield first
            async for chunk in chunks:
                usage.feed(chunk)
                yield chunk
            if upstream.status_code == 200:
                self._count_usage(route, usage.usage)
        except httpx.HTTPError as e:
            # Bytes went out: not retried. The breaker counts it like any failed forward.
            self.failed(route.decode, "stream", e)
            self.breakers.on_failure(Ticket(route.decode.url, probe=False))
            message = f"decode rank {route.decode.url} failed mid-stream: {describe_error(e)}"
            event = json.dumps(error_body(502, message, code="upstream_error"))
            yield f"data: {event}\n\ndata: [DONE]\n\n".encode()
        finally:
            attempt.lease.release()
            await close_upstream(upstream)

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
        for rank in route.ranks:
            self.metrics.requests.labels(rank.role.value, str(rank.index), rank.url).inc()

    def _count_error(self, rank: RankState, kind: str) -> None:
        labels = (rank.role.value, str(rank.index), rank.url, kind)
        self.metrics.upstream_errors.labels(*labels).inc()
