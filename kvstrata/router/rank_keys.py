"""`RankKeys`: the keys on the router's calls to its ranks, chosen by the path called. The
rank key goes only to the paths the router itself calls, the cluster key only where a rank
asks for it; any other path, or one that is not canonical, leaves with no key at all."""

from __future__ import annotations

import logging
from collections.abc import Generator

import httpx

from kvstrata.http.middleware import (
    CLIENT_HEADER,
    CLUSTER_KEY_HEADER,
    PREFILL_URL_HEADER,
    RANK_ONLY_PATHS,
)
from kvstrata.http.paths import path_problem

# Every path of a rank the router calls: what it forwards for clients (generation,
# /v1/models[/id], /tokenize, /detokenize), its own view (/server_info, /get_load,
# /health, /kv_events), /flush_cache fanned out and the L3 lookups. Not /debug/*,
# /metrics, /pd/* or /hicache/storage/clear: no route of the router leads there.
RANK_PATHS_CALLED = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/generate",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/server_info",
        "/get_load",
        "/health",
        "/flush_cache",
        "/kv_events",
        "/hicache/storage/exists",
    }
)
MODEL_PATH_PREFIX = "/v1/models/"  # /v1/models/{model_id}: a client's model id
RESPONSE_PATH_PREFIX = "/v1/responses/"  # /v1/responses/{id}: GET and DELETE
logger = logging.getLogger("kvstrata.router")


class RankKeys(httpx.Auth):
    """`rank_api_key` (Authorization) on RANK_PATHS_CALLED, /v1/models/{id} and
    /v1/responses/{id}; the cluster
    key on the rank-only paths (RANK_ONLY_PATHS) and on a request naming a prefill rank or
    its client (the router sets PREFILL_URL_HEADER and CLIENT_HEADER itself; it never
    passes on a client's). Looked up on the URL as sent, after httpx has resolved any
    dot segments."""

    def __init__(self, rank_api_key: str | None, cluster_key: str | None) -> None:
        self.rank_api_key = rank_api_key
        self.cluster_key = cluster_key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        path = request.url.path
        if path_problem(request.url.raw_path.partition(b"?")[0]) is None and (
            path in RANK_PATHS_CALLED or path.startswith((MODEL_PATH_PREFIX, RESPONSE_PATH_PREFIX))
        ):
            if self.rank_api_key:
                request.headers["authorization"] = f"Bearer {self.rank_api_key}"
            # A request naming a prefill rank or its client (CLIENT_HEADER) is believed
            # only with the key.
            named = PREFILL_URL_HEADER in request.headers or CLIENT_HEADER in request.headers
            keyed = path in RANK_ONLY_PATHS or named
            if self.cluster_key is not None and keyed:
                request.headers[CLUSTER_KEY_HEADER] = self.cluster_key
        else:  # a new call of the router's needs its path in RANK_PATHS_CALLED
            logger.warning(
                "calling %s%s without keys: not a path the router calls", request.url.host, path
            )
        yield request
