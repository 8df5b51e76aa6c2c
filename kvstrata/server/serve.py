"""`kvstrata serve`: load the engine, then run the app under uvicorn until SIGTERM/SIGINT,
draining in-flight requests for a grace period before aborting them, and exit 0."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from kvstrata.config import EngineConfig, ServerConfig
from kvstrata.disagg.factory import PD_ROLES
from kvstrata.engine.engine import Engine
from kvstrata.http.ingress import uvicorn_config
from kvstrata.runtime.engine_loop import EngineLoop
from kvstrata.runtime.fatal import FatalExit
from kvstrata.server.api import build_app, stop_announcing
from kvstrata.server.state import ServerState

# After the grace period the engine aborts what is left; this long again is allowed for
# those aborted responses to reach their clients before uvicorn cancels the handlers.
ABORT_DRAIN_S = 5.0

logger = logging.getLogger("kvstrata.server")


class _GracefulServer(uvicorn.Server):
    """uvicorn stops accepting and waits for open requests; we abort the engine's
    requests when the grace period ends, so each one still gets a proper final answer.
    Before any of it, `before_drain` runs (deregister from routers, end event streams)."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine_loop: EngineLoop,
        grace_s: float,
        before_drain: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(config)
        self._engine_loop = engine_loop
        self._grace_s = grace_s
        self._before_drain = before_drain

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._before_drain()
        timer = asyncio.get_running_loop().call_later(self._grace_s, self._engine_loop.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    # uvicorn re-raises the signal it stopped on once shutdown is complete; by then all is
    # drained, so the process ends with status 0 instead of dying by the signal.
    raise SystemExit(0)


def run_server(engine_config: EngineConfig, config: ServerConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if logging.getLogger().level > logging.DEBUG:
        # httpx logs every call to another rank at INFO; shown only at --log-level debug.
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    engine = Engine(engine_config.with_l3_key(config.cluster_key), PD_ROLES)  # config errors first
    # The engine thread closes the engine as it stops; the `with` closes it if it never ran.
    with engine:
        fatal = _serve(engine, engine_config, config)
    if fatal.exit_code is not None:
        sys.exit(fatal.exit_code)  # the engine failed: a supervisor starts the rank again


def _serve(engine: Engine, engine_config: EngineConfig, config: ServerConfig) -> FatalExit:
    """Serve until shutdown; what the engine thread's failure (if any) asks of the process."""
    state = ServerState.build(engine, config)
    logger.info(
        "serving %s on http://%s:%d (rank %d, %d KV pages of %d tokens)",
        state.model_name,
        config.host,
        config.port,
        config.rank,
        state.info["num_total_pages"],
        engine_config.pool.page_size,
    )
    app = build_app(state)
    uv_config = uvicorn_config(
        app,
        config,
        files_per_connection=1,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=config.shutdown_grace_s + ABORT_DRAIN_S,
    )
    server = _GracefulServer(
        uv_config, state.engine_loop, config.shutdown_grace_s, lambda: stop_announcing(app)
    )
    fatal = state.engine_loop.on_fatal = FatalExit(server)
    server.run()
    return fatal
