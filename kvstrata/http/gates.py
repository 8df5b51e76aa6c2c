"""The gates every HTTP request passes before routing, on ranks and the router alike
(connection rate, API key, the cluster key of rank-to-rank paths, body size), added in one
place from the front end's config."""

from __future__ import annotations

from fastapi import FastAPI

from kvstrata.config import RouterConfig, ServerConfig
from kvstrata.http.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    ClusterKeyMiddleware,
)
from kvstrata.http.rate_limit import NewConnectionLimitMiddleware


def add_gates(app: FastAPI, config: ServerConfig | RouterConfig) -> None:
    """The gates every request passes before routing, on ranks and the router alike. The
    last middleware added runs first: connection rate, then API key, then (ranks) the
    cluster key of rank-to-rank paths, then body size."""
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    if isinstance(config, ServerConfig):  # the router offers no rank-to-rank path
        app.add_middleware(ClusterKeyMiddleware, cluster_key=config.cluster_key)
    if config.api_key is not None:
        # The router's /workers is called by ranks, which hold the cluster key only.
        prefixes = ("/workers",) if isinstance(config, RouterConfig) else ()
        app.add_middleware(
            ApiKeyMiddleware,
            api_key=config.api_key,
            cluster_key_prefixes=prefixes,
            cluster_key=config.cluster_key,
        )
    if config.new_connections_per_s > 0:
        app.add_middleware(
            NewConnectionLimitMiddleware,
            rate_per_s=config.new_connections_per_s,
            burst=config.new_connections_burst,
        )
