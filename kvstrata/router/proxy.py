"""Forwarding one generation request: its route (routing.py), the body sent to the decode
rank with the prefill rank's URL in PREFILL_URL_HEADER (none: the decode rank prefills the
prompt itself), and the answer decided on its status and first bytes, then relayed chunk
by chunk (passthrough.py). An attempt that fails before any byte reached the client
(refused, reset, 502/503) is sent again to ranks it has not tried, within the retry policy
and the circuit breakers; one that ended in its rank's engine failure is not, and a body
whose rank died holding it goes to one more rank at most, then is quarantined (poison.py).
What each attempt tells about its ranks is counted by outcomes.py. A request's session
headers go to the rank as sent; its final turn closes the session once answered."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import Request
from fastapi.responses import Response

from kvstrata.errors_text import describe_error
from kvstrata.http.disconnect import until_disconnect
from kvstrata.http.errors import CLIENT_GONE, OpenAIError, error_body
from kvstrata.http.middleware import CLIENT_HEADER, PREFILL_URL_HEADER
from kvstrata.http.tracing import NULL_SPAN, NULL_TRACER, Span, Tracer
from kvstrata.router import relay
from kvstrata.router import retry as retries
from kvstrata.router.attempt import Attempt, Route
from kvstrata.router.body import Outgoing, RelayBody
from kvstrata.router.breaker import CircuitBreakers
from kvstrata.router.client_limit import client_of
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.outcomes import ForwardOutcomes
from kvstrata.router.passthrough import PassThrough
from kvstrata.router.poison import DIED_HOLDING_IT, ENGINE_FAILURE, MAX_STRIKES, PoisonLedger
from kvstrata.router.policy import Policy, RoutingRequest
from kvstrata.router.relay import close_upstream
from kvstrata.router.response_homes import RESPONSE_ID_HEADER, ResponseHomes
from kvstrata.router.retry import Attempts, Failure, RetryPolicy
from kvstrata.router.route_trace import trace_route
from kvstrata.router.routing import RouteChooser
from kvstrata.router.session_routing import SessionAffinity
from kvstrata.router.workers import WorkerRegistry

# A failed attempt's own answer (a 502/503 error body), and any error body, is read up to
# this size before anything goes out; a 502/503 is kept to relay if no attempt is left.
MAX_FAILED_ANSWER_BYTES = 64 * 1024
POISON_REQUEST = "poison_request"  # the error code of a request refused for quarantine


class Forwarder:
    def __init__(
        self,
        workers: WorkerRegistry,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        policy: Policy,
        prefill_policy: Policy,
        calibrate_ttft: bool = True,
        retry: RetryPolicy | None = None,
        breakers: CircuitBreakers | None = None,
        poison: PoisonLedger | None = None,
        tracer: Tracer = NULL_TRACER,
        sessions: SessionAffinity | None = None,
    ) -> None:
        """`retry` None: one attempt per request; `breakers` None: none ever opens;
        `poison` None: bodies are remembered 600 s, 4096 at most. `tracer`: the spans of
        each request (http/tracing.py). `sessions` None: sessions are not routed."""
        self.workers = workers
        self.client = client
        self.metrics = metrics
        self.policy = policy
        self.retry = retry or RetryPolicy(1, 0.0, 0.0, 1.0, 0.0)
        self.breakers = breakers or CircuitBreakers(0, 0.0)
        self.poison = poison or PoisonLedger(600.0, 4096)
        self.tracer = tracer
        self.sessions = sessions if sessions is not None else SessionAffinity(metrics, None)
        self.chooser = RouteChooser(
            workers, metrics, policy, prefill_policy, self.breakers, self.sessions
        )
        self.outcomes = ForwardOutcomes(workers, metrics, self.poison, calibrate_ttft)
        self.passthrough = PassThrough(self.outcomes, self.breakers)
        self._rng = random.Random()
        self.homes = ResponseHomes()  # Responses API answers relayed: the rank of each
        metrics.watch_breakers(self.breakers, workers)

    def route(self, request: RoutingRequest, attempts: Attempts | None = None) -> Route:
        return self.chooser.route(request, attempts)

    async def forward(self, request: Request, path: str, outgoing: Outgoing) -> Response:
        """Forward a generation request and relay the answer, retrying attempts that
        failed before any byte reached the client. The body and the routing request are
        released once an answer is on its way to the client (or none will be)."""
        span = self.tracer.request_span("kvstrata.router.request", request.headers, {"path": path})
        session = outgoing.routing.session if outgoing.routing is not None else None
        try:
            return await self._forward(request, path, outgoing, span)
        finally:
            outgoing.release()
            self.sessions.answered(session)
            span.end()  # as the answer starts (a stream's relay goes on after)

    async def _forward(
        self, request: Request, path: str, outgoing: Outgoing, span: Span = NULL_SPAN
    ) -> Response:
        assert outgoing.body is not None and outgoing.routing is not None
        digest = await outgoing.body.digest_off_loop(path)
        quarantine = self.poison.quarantine(digest)
        if quarantine is not None:  # sent to no rank
            self.metrics.poison.labels("refused").inc()
            raise OpenAIError(422, quarantine.message, code=POISON_REQUEST)
        attempts = Attempts(self.retry)
        failure: Failure | None = None
        while True:
            decided_ns = time.time_ns()
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
            healthy = [rank for rank in self.workers.decode if rank.healthy]
            num_tokens = outgoing.routing.num_prompt_tokens
            decided = (decided_ns, time.time_ns())
            trace = trace_route(span, route, healthy, num_tokens, decided, attempts.num_attempts)
            try:
                result = await self._try(request, path, outgoing, route, digest, trace)
                if isinstance(result, Failure):
                    trace.set({"kvstrata.failure": result.cause})
            finally:
                trace.end()
            if not isinstance(result, Failure):
                return result
            failure = result
            prefill_url = route.prefill.url if route.prefill is not None else None
            attempts.record(route.decode.url, prefill_url, failure)
            if not attempts.may_retry:
                self.metrics.retries_exhausted.labels(failure.cause).inc()
                return failure.final_answer()
            wait_s = self.retry.backoff_s(attempts.num_attempts, self._rng)
            if await until_disconnect(request, asyncio.sleep(wait_s, True)) is None:
                return Response(status_code=CLIENT_GONE)

    async def _try(
        self,
        request: Request,
        path: str,
        outgoing: Outgoing,
        route: Route,
        digest: bytes,
        trace: Span = NULL_SPAN,
    ) -> Response | Failure:
        assert outgoing.body is not None and outgoing.routing is not None
        attempt = Attempt(self.workers, self.breakers, route, outgoing.routing)
        self.outcomes.count_request(route)
        sent_s = time.monotonic()
        built = self._build(request, path, outgoing.body, route, trace.headers())
        send = self.client.send(built, stream=True)
        try:
            upstream = await until_disconnect(request, send)
        except httpx.HTTPError as e:
            return self._broken(attempt, "send", e, digest)
        except BaseException:  # e.g. the handler cancelled at shutdown
            attempt.abandoned()
            raise
        if upstream is None:  # the client left before the rank answered
            attempt.abandoned()
            return Response(status_code=CLIENT_GONE)
        cause = retries.cause_of_status(upstream.status_code)
        if cause is not None:
            return await self._refused(attempt, upstream, cause)
        return await self._relay(request, upstream, attempt, outgoing, sent_s, digest)

    def _broken(
        self, attempt: Attempt, stage: str, error: httpx.HTTPError, digest: bytes
    ) -> Failure:
        """The decode rank's connection failed before its answer was complete (nothing
        reached the client): a Failure if the cause is retryable, else a 502. A rank that
        died holding a body that another attempt's rank died holding too is not retried."""
        decode = attempt.route.decode
        cause = retries.cause_of_error(error)
        self.outcomes.failed(decode, stage if cause in (None, "reset") else cause, error)
        attempt.failed(decode_only=True)
        message = f"decode rank {decode.url} failed: {describe_error(error)}"
        if cause is None:
            raise OpenAIError(502, message, code="upstream_error") from error
        if retries.died_holding_it(error):
            strikes = self.outcomes.strike(digest, decode, DIED_HOLDING_IT)
            if len(strikes) >= MAX_STRIKES:
                raise OpenAIError(
                    502,
                    f"{message}; not sent to another rank: {self.outcomes.quarantined(strikes)}",
                    code=POISON_REQUEST,
                ) from error
        return Failure(cause, message)

    async def _refused(
        self,
        attempt: Attempt,
        upstream: httpx.Response,
        cause: str,
        first: bytes = b"",
        rest: AsyncIterator[bytes] | None = None,
    ) -> Failure:
        """A 502/503 from the rank (or a stream that opened with a 503 event: `first`, then
        `rest`): its answer is kept (bounded) to relay if no other attempt is left."""
        rank = attempt.route.decode
        self.outcomes.count_error(rank, cause)
        rest = upstream.aiter_bytes() if rest is None else rest
        try:
            content = first + await relay.read_bounded(rest, MAX_FAILED_ANSWER_BYTES)
        except httpx.HTTPError as e:
            message = f"decode rank {rank.url} answered {upstream.status_code}, then failed"
            content = json.dumps(error_body(upstream.status_code, message)).encode()
            self.outcomes.failed(rank, "read", e)
        finally:
            attempt.failed()
            await close_upstream(upstream)
        answer = Response(content, upstream.status_code, relay.relayed_headers(upstream))
        return Failure(cause, f"decode rank {rank.url} answered {upstream.status_code}", answer)

    def _build(
        self,
        request: Request,
        path: str,
        body: RelayBody,
        route: Route,
        trace_headers: dict[str, str],
    ) -> httpx.Request:
        # Streamed in slices with the length declared, so the rank can refuse an
        # oversized body before reading it, and httpx keeps no joined copy.
        headers = {
            "content-type": request.headers.get("content-type", "application/json"),
            "content-length": str(body.num_bytes),
            **trace_headers,  # the attempt's span: the decode rank's spans go under it
            **self.sessions.forwarded_headers(request.headers),
        }
        if route.prefill is not None:
            headers[PREFILL_URL_HEADER] = route.prefill.url
        client = client_of(request)
        if client is not None:  # the rank's own per-client bound counts the client, not us
            headers[CLIENT_HEADER] = client
        url = f"{route.decode.url}{path}"
        if request.url.query:
            url += f"?{request.url.query}"
        return self.client.build_request("POST", url, content=body.chunks(), headers=headers)

    async def _relay(
        self,
        request: Request,
        upstream: httpx.Response,
        attempt: Attempt,
        outgoing: Outgoing,
        sent_s: float,
        digest: bytes,
    ) -> Response | Failure:
        """The answer, decided on its status and first bytes (the first chunk; an error
        body read whole, bounded) before any goes out: a connection that breaks before
        that is a failed attempt, one that breaks after is the client's error to see."""
        headers = relay.relayed_headers(upstream)
        is_stream = relay.is_event_stream(headers)
        chunks = upstream.aiter_raw() if is_stream else upstream.aiter_bytes()
        try:
            first = await until_disconnect(
                request, relay.first_bytes(upstream, chunks, is_stream, MAX_FAILED_ANSWER_BYTES)
            )
        except httpx.HTTPError as e:
            await close_upstream(upstream)
            return self._broken(attempt, "stream" if is_stream else "read", e, digest)
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
        if (is_stream or upstream.status_code == 500) and retries.is_engine_failure(first):
            return await self._engine_failed(attempt, upstream, first, headers, digest)
        if upstream.status_code >= 500:
            self.outcomes.count_error(attempt.route.decode, f"status_{upstream.status_code}")
        attempt.succeeded()
        response_id, rank_url = upstream.headers.get(RESPONSE_ID_HEADER), attempt.route.decode.url
        self.homes.learn(response_id, rank_url)
        session = outgoing.routing.session if outgoing.routing is not None else None
        self.sessions.relayed_response(response_id, session, rank_url)
        outgoing.release()  # the answer is on its way: no retry needs the body any more
        if is_stream:
            body = self.passthrough.stream_body(upstream, first, chunks, attempt, sent_s, digest)
        else:  # a JSON answer is sent once the rank has computed all of it
            attempt.lease.release()
            body = self.passthrough.json_body(upstream, first, chunks, attempt.route)
            if "content-length" in upstream.headers and "content-encoding" not in upstream.headers:
                headers["content-length"] = upstream.headers["content-length"]

        async def on_close() -> None:
            attempt.lease.release()
            await close_upstream(upstream)

        return relay.RelayedAnswer(body, on_close, upstream.status_code, headers)

    async def _engine_failed(
        self,
        attempt: Attempt,
        upstream: httpx.Response,
        content: bytes,
        headers: dict[str, str],
        digest: bytes,
    ) -> Response:
        """The rank's engine failed in a step that held the request (a 500, or a stream's
        first event, with the code engine_failed): the rank is going down, and the request
        may be what broke it, so it is not retried. Its breaker counts a failure."""
        rank = attempt.route.decode
        self.outcomes.engine_failed(rank, "its engine failed")
        attempt.failed(decode_only=True)
        await close_upstream(upstream)
        strikes = self.outcomes.strike(digest, rank, ENGINE_FAILURE)
        error = retries.error_of(content) or {}
        message = (
            f"decode rank {rank.url}: {error.get('message') or 'its engine failed'}; not "
            "retried: its attempt ended in an engine failure, which the request itself may "
            "have caused"
        )
        if len(strikes) >= MAX_STRIKES:
            message += f"; {self.outcomes.quarantined(strikes)}"
        body = json.dumps(error_body(500, message, code=retries.ENGINE_FAILED))
        if relay.is_event_stream(headers):  # as the rank's stream was: 200, one error event
            return Response(f"data: {body}\n\ndata: [DONE]\n\n", 200, headers)
        return Response(body, 500, {"content-type": "application/json"})
