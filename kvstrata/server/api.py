"""Assembles one rank's FastAPI app: routes, the OpenAI error shape, the gates
(`kvstrata/http/gates.py`), and a lifespan that starts and stops the engine thread, the
kv_events publisher and the registration with routers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvstrata.cluster.registration import Membership, Registrar
from kvstrata.http.errors import install_error_handlers
from kvstrata.http.gates import add_gates
from kvstrata.pd import prefill_endpoints
from kvstrata.server import (
    cache_routes,
    kv_events,
    native_routes,
    openai_routes,
    profile_routes,
    responses_routes,
    session_routes,
)
from kvstrata.server.kv_events import KvEventPublisher, PublisherConfig
from kvstrata.server.l3_index import L3Index
from kvstrata.server.state import ServerState


def build_app(state: ServerState) -> FastAPI:
    config = state.config
    l3_index = L3Index.of(state.engine_loop.engine)  # before the engine thread starts
    publisher = KvEventPublisher(
        state.engine_loop,
        config.rank,
        PublisherConfig(config.kv_events_queue_size, config.kv_events_load_interval_s),
        l3_store=l3_index.store_id if l3_index is not None else None,
    )
    registrar = None
    if config.router_urls:
        assert config.cluster_key is not None  # ServerConfig.validate
        role = "prefill" if state.info["disaggregation_mode"] == "prefill" else "decode"
        membership = Membership(role, config.own_url, config.rank)
        registrar = Registrar(
            config.router_urls, membership, config.cluster_key, config.register_interval_s
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine_loop.start()
        if registrar is not None:
            registrar.start()
        try:
            yield
        finally:
            await stop_announcing(app)
            if state.decode_sender is not None:
                await state.decode_sender.close()
            await state.engine_loop.stop()  # aborts whatever is still in flight
            await asyncio.to_thread(state.tracer.shutdown)  # export the spans left

    app = FastAPI(
        title="kvstrata",
        summary="One kvstrata rank: OpenAI-compatible and native generation endpoints.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.kvstrata = state
    app.state.kvstrata_events = publisher
    app.state.kvstrata_l3 = l3_index
    app.state.kvstrata_registrar = registrar
    install_error_handlers(app)
    app.include_router(kv_events.router)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(native_routes.router)
    app.include_router(prefill_endpoints.router)
    app.include_router(cache_routes.router)
    app.include_router(profile_routes.router)
    app.include_router(session_routes.router)
    add_gates(app, state.config)
    return app


async def stop_announcing(app: FastAPI) -> None:
    """The first step of a stop: deregister from the routers (no new requests come) and
    end the event streams (open streams would hold up the drain). Idempotent."""
    app.state.kvstrata_events.close()
    registrar: Registrar | None = app.state.kvstrata_registrar
    if registrar is not None:
        await registrar.stop()
