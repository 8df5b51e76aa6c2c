"""The end of a rank whose engine failed beyond one request: `FatalExit` stops the server
(its requests already failed), and the process exits with ENGINE_FAILED_EXIT so that its
supervisor starts it again; if the drain does not end in FATAL_DRAIN_S, it exits at once.
A rank never lingers half-dead, answering 503 to everything while its process lives."""

from __future__ import annotations

import logging
import os
import threading

import uvicorn

ENGINE_FAILED_EXIT = 70  # EX_SOFTWARE: an internal error
FATAL_DRAIN_S = 10.0

logger = logging.getLogger("kvstrata.server")


class FatalExit:
    """Call on the event loop once the engine failed; `exit_code` is then set."""

    def __init__(self, server: uvicorn.Server, drain_s: float = FATAL_DRAIN_S) -> None:
        self.server = server
        self.drain_s = drain_s
        self.exit_code: int | None = None

    def __call__(self) -> None:
        if self.exit_code is not None:
            return
        self.exit_code = ENGINE_FAILED_EXIT
        logger.critical("stopping: the engine failed; exiting with status %d", self.exit_code)
        self.server.should_exit = True
        # A drain that hangs (a handler stuck on a failed device) must not keep the rank up.
        timer = threading.Timer(self.drain_s, os._exit, (ENGINE_FAILED_EXIT,))
        timer.daemon = True
        timer.start()
