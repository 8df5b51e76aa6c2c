"""A per-client limit on the rate of new connections, shared by ranks and the router: one
token bucket per client address; the first request of a connection not seen before takes
a token, and without one gets 429 (OpenAI error shape, Retry-After). Plain ASGI."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from kvstrata.http.middleware import PUBLIC_PATHS, send_error

# Memory bounds: the (address, port) pairs of recent connections, and idle buckets.
_MAX_CONNECTIONS = 65_536
_MAX_CLIENTS = 65_536


@dataclass
class _Bucket:
    tokens: float
    updated_s: float


class TokenBuckets:
    """Buckets of `burst` tokens, refilled at `rate_per_s`, one per key. A key not seen
    starts full; when more than `max_clients` keys are tracked, the least recently used
    one is forgotten (it would start full again, which only errs on the generous side)."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = _MAX_CLIENTS,
    ) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"need rate_per_s > 0 and burst >= 1, got {rate_per_s}, {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._max_clients = max_clients
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def take(self, key: str) -> float:
        """Take one token for `key`: 0.0 if there was one, else the seconds until there is."""
        now_s = self._clock()
        bucket = self._buckets.pop(key, None) or _Bucket(float(self.burst), now_s)
        self._buckets[key] = bucket  # most recently used last
        while len(self._buckets) > self._max_clients:
            self._buckets.popitem(last=False)
        elapsed_s = max(0.0, now_s - bucket.updated_s)
        bucket.tokens = min(float(self.burst), bucket.tokens + elapsed_s * self.rate_per_s)
        bucket.updated_s = now_s
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / self.rate_per_s


class NewConnectionLimitMiddleware:
    """429 for a client address that opens connections faster than the buckets allow.

    ASGI shows requests, not connections: a request from an (address, port) pair not seen
    recently is a new connection; later requests on a kept-alive connection pass free.
    /health is never limited (probes must see the server, cheaply)."""

    def __init__(self, app: ASGIApp, rate_per_s: float, burst: int) -> None:
        self.app = app
        self.buckets = TokenBuckets(rate_per_s, burst)
        self._connections: OrderedDict[tuple[str, int], None] = OrderedDict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        if scope["type"] != "http" or not client or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        connection = (str(client[0]), int(client[1]))
        if connection in self._connections:
            self._connections.move_to_end(connection)
            await self.app(scope, receive, send)
            return
        wait_s = self.buckets.take(connection[0])
        if wait_s > 0:
            await send_error(
                send,
                429,
                f"too many new connections from {connection[0]}; retry in {wait_s:.2f} s",
                "rate_limit_exceeded",
                {"retry-after": str(math.ceil(wait_s)), "connection": "close"},
            )
            return
        self._connections[connection] = None
        while len(self._connections) > _MAX_CONNECTIONS:
            self._connections.popitem(last=False)
        await self.app(scope, receive, send)
