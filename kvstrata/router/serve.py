"""`kvstrata router`: build the router from its config and run it under uvicorn until
SIGTERM/SIGINT, then exit 0."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from kvstrata.config import RouterConfig
from kvstrata.http.ingress import uvicorn_config
from kvstrata.router.app import build_router_app
from kvstrata.router.state import RouterState

logger = logging.getLogger("kvstrata.router")


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    # uvicorn re-raises the signal it stopped on once shutdown is complete; exit 0 then.
    raise SystemExit(0)


def run_router(config: RouterConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if logging.getLogger().level > logging.DEBUG:
        # httpx logs every /get_load poll at INFO; those lines show only at --log-level debug.
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    state = RouterState.build(config)
    logger.info(
        "routing on http://%s:%d: %d prefill, %d decode ranks, %s",
        config.host,
        config.port,
        len(config.prefill),
        len(config.decode),
        state.forwarder.policy.name,
    )
    # Each relayed request holds a connection to a rank too: two open files per client.
    uv_config = uvicorn_config(
        build_router_app(state),
        config,
        files_per_connection=2,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
    )
    uvicorn.Server(uv_config).run()
