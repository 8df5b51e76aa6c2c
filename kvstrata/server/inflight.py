"""`InflightPerClient`: how many engine requests each client has in flight on this rank,
bounded by --max-inflight-per-client (429 beyond it), so one client's batch cannot fill a
rank's queues ahead of everyone else. The client is the caller's address, or the client
the router names (CLIENT_HEADER, taken only from a caller holding the cluster key)."""

from __future__ import annotations

from collections import Counter

from fastapi import Request

from kvstrata.http.errors import OpenAIError
from kvstrata.http.middleware import CLIENT_HEADER, holds_cluster_key

_MAX_CLIENT_CHARS = 256


def client_of(request: Request, cluster_key: str | None) -> str:
    """Whom a request counts against: the router's word for it, else the peer address."""
    named = request.headers.get(CLIENT_HEADER)
    if named and holds_cluster_key(request.scope["headers"], cluster_key):
        return named[:_MAX_CLIENT_CHARS]
    return request.client.host if request.client is not None else "unknown"


class InflightPerClient:
    """Event loop only. `take` before a request's engine requests are queued, `give` once
    its group is closed (each take is given back exactly once)."""

    def __init__(self, max_per_client: int) -> None:
        self.max_per_client = max_per_client  # 0: no bound
        self._counts: Counter[str] = Counter()

    def take(self, client: str, num_requests: int) -> None:
        """Raises OpenAIError(429) if `client` would go past the bound."""
        held = self._counts[client]
        if self.max_per_client and held + num_requests > self.max_per_client:
            raise OpenAIError(
                429,
                f"{client} has {held} requests in flight on this rank; with "
                f"{num_requests} more it would pass --max-inflight-per-client "
                f"{self.max_per_client}: retry once some have finished",
                code="too_many_requests_in_flight",
            )
        self._counts[client] = held + num_requests

    def give(self, client: str, num_requests: int) -> None:
        left = self._counts[client] - num_requests
        if left > 0:
            self._counts[client] = left
        else:
            del self._counts[client]

    def held(self, client: str) -> int:
        return self._counts.get(client, 0)
