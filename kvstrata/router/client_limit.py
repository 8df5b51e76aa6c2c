"""The bound on generation requests one client has in flight through the router
(`--max-inflight-per-client`): past it, 429 with Retry-After and the OpenAI error body, so
one client's batch cannot take every rank's queue from the others. A client is its
address, or, when the router has an API key, the key it presented; the forwarder names it
to the rank (CLIENT_HEADER), whose own per-client bound then counts it. Plain ASGI."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvstrata.http.middleware import send_error

# The routes a client's requests take rank time on; the rest are cheap and answered fast.
GENERATION_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate"}
)
RETRY_AFTER_S = 1  # no end time is known: a client's request may end at any moment
_STATE_KEY = "kvstrata_client"  # where a request's client is left for the forwarder


def client_of(request: Request) -> str | None:
    """The client the limit counted this request against (None: not a generation path)."""
    state = request.scope.get("state") or {}
    client = state.get(_STATE_KEY)
    return client if isinstance(client, str) else None


class ClientInflightLimit:
    """At most `max_inflight` generation requests per client at once (0: no bound, the
    client is only named), counted from the request's arrival to the end of its answer (a
    stream's last byte, or the client leaving). Runs inside the API key gate, so only
    holders of the key are counted. The counts live on the router's event loop; a client
    with none in flight holds no entry."""

    def __init__(
        self,
        app: ASGIApp,
        max_inflight: int,
        by_api_key: bool,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        assert max_inflight >= 0
        self.app = app
        self.max_inflight = max_inflight
        self.by_api_key = by_api_key
        self.on_refused = on_refused
        self.inflight: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        client, who = self._client(scope)
        scope.setdefault("state", {})[_STATE_KEY] = client  # this request's own copy
        num_inflight = self.inflight.get(client, 0)
        if self.max_inflight and num_inflight >= self.max_inflight:
            self.on_refused()
            await send_error(
                send,
                429,
                f"{who} has {num_inflight} requests in flight through the router, "
                f"the most --max-inflight-per-client allows; retry once one has ended",
                "too_many_requests_in_flight",
                {"retry-after": str(RETRY_AFTER_S)},
            )
            return
        self.inflight[client] = num_inflight + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.inflight[client] - 1
            if left:
                self.inflight[client] = left
            else:
                del self.inflight[client]

    def _client(self, scope: Scope) -> tuple[str, str]:
        """(the key counts are kept by, the client in words)."""
        if self.by_api_key:
            # The gate let it through: it holds the key. Kept hashed, never as given.
            authorization = dict(scope["headers"]).get(b"authorization", b"")
            return "key:" + hashlib.sha256(authorization).hexdigest(), "the API key's holder"
        address = scope.get("client")
        host = str(address[0]) if address else "unknown"
        return "address:" + host, f"client {host}"
