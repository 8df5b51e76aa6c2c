"""Bringing a launched cluster up: the --port check before anything starts, then the
waits, each bounded by the launch's deadline: every rank healthy (on a socket of its own),
every router proven to be this launch's (`port_owner.py`), every rank registered."""

from __future__ import annotations

import contextlib
import time

import httpx

from kvstrata.cluster.child import Child
from kvstrata.cluster.port_owner import LAUNCH_PROOF_PATH, PortOwner, port_in_use
from kvstrata.config import ConfigError

_POLL_S = 0.2
_ASK_TIMEOUT_S = 2.0


class ClusterStartError(RuntimeError):
    """A child exited or did not become healthy in time, or another process serves a
    router's port; the message says which (with the child's log tail)."""


def check_port_free(host: str, port: int) -> None:
    """Refuse a --port another process holds (another cluster's router, a `kvstrata
    serve`, anything): the user's traffic would reach it, not this cluster."""
    try:
        taken = port_in_use(host, port)
    except OSError as e:
        raise ConfigError(f"--host {host}: cannot listen on port {port} there: {e}") from e
    if taken:
        raise ConfigError(
            f"--port {port}: {host}:{port} is already in use by another process (another "
            "kvstrata launch, serve or router?); stop it, or pick another --port (0: a free one)"
        )


def wait_healthy(children: list[Child], deadline_s: float) -> None:
    """Wait until GET /health answers 200 on every child, from the child itself,
    restarting one that lost its free port to another process; raise ClusterStartError
    naming a child that exited."""
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.exit_code is not None:
                if child.lost_port_race():
                    child.start()
                    continue
                raise ClusterStartError(
                    f"{child.name} exited with status {child.exit_code} while starting; "
                    f"log {child.log_path}:\n{child.log_tail()}"
                )
            if child.is_healthy(_ASK_TIMEOUT_S):
                pending.remove(child)
        if pending and time.monotonic() > deadline_s:
            child = pending[0]
            raise ClusterStartError(
                f"{child.name} was not healthy in time; log {child.log_path}:\n{child.log_tail()}"
            )
        if pending:
            time.sleep(_POLL_S)


def wait_own_routers(routers: list[Child], deadline_s: float) -> None:
    """Wait until each router proves on its port that it is this launch's: it answers
    LAUNCH_PROOF_PATH with the HMAC of a fresh challenge under the launch's proof key.
    Another process answering there, or holding the port so that the router cannot
    listen, is a ClusterStartError naming the port."""
    for router in routers:
        while (owner := router.owner(_ASK_TIMEOUT_S)) is not PortOwner.CHILD:
            # The first router's port is the user's --port; the others' are free ports.
            where = f"--port {router.port}" if router.fixed_port else f"{router.name}'s port"
            if owner is PortOwner.OTHER:
                raise ClusterStartError(
                    f"{where}: {router.url} is served by another process (it answered "
                    f"{LAUNCH_PROOF_PATH} without this launch's proof); stop it, or pick "
                    "another --port"
                )
            if router.exit_code is not None:
                if router.lost_port_race():
                    router.start()
                    continue
                cause = (
                    f"{where}: port {router.port} is in use by another process; stop it, or "
                    "pick another --port"
                    if router.port_taken()
                    else f"{router.name} exited with status {router.exit_code} while starting"
                )
                raise ClusterStartError(f"{cause}; log {router.log_path}:\n{router.log_tail()}")
            if time.monotonic() > deadline_s:
                raise ClusterStartError(
                    f"{router.name} was not up in time; log {router.log_path}:\n{router.log_tail()}"
                )
            time.sleep(_POLL_S)


def wait_registered(routers: list[Child], expected: tuple[int, int], deadline_s: float) -> None:
    """Wait until every router lists every rank of the cluster, healthy (`expected`: the
    numbers of prefill and decode ranks)."""
    for router in routers:
        while True:
            with contextlib.suppress(httpx.TransportError, ValueError):
                body = httpx.get(router.url + "/health", timeout=_ASK_TIMEOUT_S).json()
                if (body["num_healthy_prefill"], body["num_healthy_decode"]) == expected and (
                    body["num_prefill"],
                    body["num_decode"],
                ) == expected:
                    break
            if router.exit_code is not None or time.monotonic() > deadline_s:
                raise ClusterStartError(
                    f"{router.name} did not see all {sum(expected)} ranks register in time; "
                    f"log {router.log_path}:\n{router.log_tail()}"
                )
            time.sleep(_POLL_S)
