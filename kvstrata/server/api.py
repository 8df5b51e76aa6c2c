"""Assembles one rank's FastAPI app: routes, the OpenAI error shape, the gates (connection
rate, API key, cluster key, body size; the router uses the same but the cluster key), and
a lifespan that starts and stops the engine thread."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvstrata.config import RouterConfig, ServerConfig
from kvstrata.server import cache_routes, native_routes, openai_routes, pd
from kvstrata.server.errors import install_error_handlers
from kvstrata.server.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    ClusterKeyMiddleware,
)
from kvstrata.server.rate_limit import NewConnectionLimitMiddleware
from kvstrata.server.state import ServerState


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine_loop.start()
        try:
            yield
        finally:
            if state.dispatcher is not None:
                await state.dispatcher.close()
            await state.engine_loop.stop()  # aborts whatever is still in flight

    app = FastAPI(
        title="kvstrata",
        summary="One kvstrata rank: OpenAI-compatible and native generation endpoints.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.kvstrata = state
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(native_routes.router)
    app.include_router(pd.router)
    app.include_router(cache_routes.router)
    add_gates(app, state.config)
    return app


def add_gates(app: FastAPI, config: ServerConfig | RouterConfig) -> None:
    """The gates every request passes before routing, on ranks and the router alike. The
    last middleware added runs first: connection rate, then API key, then (ranks) the
    cluster key of rank-to-rank paths, then body size."""
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    if isinstance(config, ServerConfig):  # the router offers no rank-to-rank path
        app.add_middleware(ClusterKeyMiddleware, cluster_key=config.cluster_key)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    if config.new_connections_per_s > 0:
        app.add_middleware(
            NewConnectionLimitMiddleware,
            rate_per_s=config.new_connections_per_s,
            burst=config.new_connections_burst,
        )
