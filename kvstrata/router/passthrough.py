"""`PassThrough`: a decided answer's body relayed to the client chunk by chunk, JSON and
SSE alike (the router never holds a whole answer), its usage and first-byte time read on
the way. Bytes went out, so a failure is never retried: an SSE stream ends with an
OpenAI-shaped error event, a JSON answer with a dropped connection."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import httpx

from kvstrata.errors_text import describe_error
from kvstrata.http.errors import error_body
from kvstrata.router import relay
from kvstrata.router import retry as retries
from kvstrata.router.attempt import Attempt, Route
from kvstrata.router.breaker import CircuitBreakers, Ticket
from kvstrata.router.outcomes import ForwardOutcomes
from kvstrata.router.poison import DIED_HOLDING_IT, ENGINE_FAILURE, MAX_STRIKES
from kvstrata.router.relay import close_upstream
from kvstrata.router.usage import JsonUsage, SseUsage

logger = logging.getLogger("kvstrata.router")


class PassThrough:
    """The body of a `RelayedAnswer`; what it yields has reached the client, so nothing
    it relays is sent to another rank."""

    def __init__(self, outcomes: ForwardOutcomes, breakers: CircuitBreakers) -> None:
        self.outcomes = outcomes
        self.breakers = breakers

    async def json_body(
        self, upstream: httpx.Response, first: bytes, chunks: AsyncIterator[bytes], route: Route
    ) -> AsyncGenerator[bytes, None]:
        # Chunks go out as they arrive; only the usage object is read on the way.
        usage = JsonUsage()
        try:
            usage.feed(first)
            yield first
            async for chunk in chunks:
                usage.feed(chunk)
                yield chunk
        except httpx.HTTPError as e:
            # Bytes went out: no error can be added to a JSON body, so the client's
            # connection is dropped (RelayedAnswer) rather than the answer cut short.
            self.outcomes.failed(route.decode, "read", e)
            self.breakers.on_failure(Ticket(route.decode.url, probe=False))
            logger.warning(
                "decode rank %s failed while its JSON answer was relayed (%s): "
                "the client's connection is dropped",
                route.decode.url,
                describe_error(e),
            )
            raise relay.UpstreamBroke from e
        if upstream.status_code == 200:
            self.outcomes.count_usage(route, usage.usage)

    async def stream_body(
        self,
        upstream: httpx.Response,
        first: bytes,
        chunks: AsyncIterator[bytes],
        attempt: Attempt,
        sent_s: float,
        digest: bytes,
    ) -> AsyncGenerator[bytes, None]:
        # Chunks go out as they arrive. When the client leaves, the response closes this
        # generator (or cancels it), which closes the upstream connection: the rank sees
        # its client go and aborts the request, freeing its pages.
        route, usage = attempt.route, SseUsage()
        try:
            if upstream.status_code == 200:
                attempt.lease.first_token()
                self.outcomes.observe_ttft(route, time.monotonic() - sent_s)
            usage.feed(first)
            yield first
            async for chunk in chunks:
                usage.feed(chunk)
                yield chunk
            if usage.error_code == retries.ENGINE_FAILED:  # after tokens went out
                self.outcomes.engine_failed(route.decode, "mid-stream")
                self.breakers.on_failure(Ticket(route.decode.url, probe=False))
                self.outcomes.strike(digest, route.decode, ENGINE_FAILURE)
            elif upstream.status_code == 200:
                self.outcomes.count_usage(route, usage.usage)
        except httpx.HTTPError as e:
            # Bytes went out: not retried. The breaker counts it like any failed forward.
            self.outcomes.failed(route.decode, "stream", e)
            self.breakers.on_failure(Ticket(route.decode.url, probe=False))
            message = f"decode rank {route.decode.url} failed mid-stream: {describe_error(e)}"
            if retries.died_holding_it(e):
                strikes = self.outcomes.strike(digest, route.decode, DIED_HOLDING_IT)
                if len(strikes) >= MAX_STRIKES:
                    message += f"; {self.outcomes.quarantined(strikes)}"
            event = json.dumps(error_body(502, message, code="upstream_error"))
            yield f"data: {event}\n\ndata: [DONE]\n\n".encode()
        finally:
            attempt.lease.release()
            await close_upstream(upstream)
