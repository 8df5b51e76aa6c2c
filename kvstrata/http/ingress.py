"""The uvicorn config of a front end (a rank or the router) from its `IngressLimits`: the
connection gate (kvstrata/http/connections.py) sized to the process's open-file limit, the
idle, head and body deadlines, and the gate's 503s in the OpenAI error shape."""

from __future__ import annotations

import json
import logging
import resource
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from kvstrata.config.limits import RAISED_OPEN_FILES, ConnectionBudget, IngressLimits
from kvstrata.http.connections import ConnectionGate, ConnectionLimits, GatedH11Protocol
from kvstrata.http.errors import error_body

logger = logging.getLogger("kvstrata.server")


def open_file_limit() -> int:
    """The soft RLIMIT_NOFILE, raised first towards the hard limit (up to
    RAISED_OPEN_FILES): how many files this process may have open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinite = resource.RLIM_INFINITY
    wanted = RAISED_OPEN_FILES if hard == infinite else min(hard, RAISED_OPEN_FILES)
    if soft != infinite and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as e:  # a sandbox may refuse; the soft limit stands
            logger.warning("could not raise the open-file limit to %d: %s", wanted, e)
    return soft if soft != infinite else RAISED_OPEN_FILES


def uvicorn_config(
    app: ASGIApp, config: IngressLimits, files_per_connection: int, **options: Any
) -> uvicorn.Config:
    """uvicorn serving `app` behind the connection gate; `options` (host, port, log level,
    ...) go to uvicorn as they are. `files_per_connection`: the open files one client
    connection costs (the router's relayed requests each hold one to a rank as well).
    Raises ConfigError if --max-connections does not fit the open-file limit."""
    open_files = open_file_limit()
    budget = ConnectionBudget.of(config, open_files, files_per_connection)
    limits = ConnectionLimits(
        budget.max_connections,
        budget.max_connections_per_address,
        budget.num_reserved,
        config.keep_alive_timeout_s,
        config.header_timeout_s,
        config.body_timeout_s,
        config.min_body_bytes_per_s,
    )
    logger.info(
        "serving up to %d connections, %d per client address (open-file limit %d)",
        limits.max_connections,
        limits.max_connections_per_address,
        open_files,
    )
    gate = ConnectionGate(limits, _error_json)
    # ws="none": an upgrade would hand the socket to another protocol, past the gate.
    protocol = GatedH11Protocol.bound(gate)
    return uvicorn.Config(app, http=protocol, ws="none", backlog=budget.backlog, **options)


def _error_json(status_code: int, message: str, code: str) -> bytes:
    return json.dumps(error_body(status_code, message, code=code)).encode()
