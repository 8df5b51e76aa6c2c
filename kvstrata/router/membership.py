"""Ranks that come and go: `POST /workers` (a rank registers, `kvstrata serve
--register-with`), `DELETE /workers/{id}` (it leaves) and `GET /workers` on the router,
all rank-to-rank (cluster key), and the reaper that removes a registered rank that died
without deregistering. Each rank in the registry has an event subscription (events.py).
Discovery (discovery.py) joins and leaves ranks through the same `join` and `leave`."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any, Literal, Protocol

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvstrata.http.errors import OpenAIError
from kvstrata.http.middleware import CLUSTER_KEY_HEADER, holds_cluster_key
from kvstrata.router.events import EventStreams, stop_task
from kvstrata.router.workers import LoadInquirer, RankState, Role, WorkerRegistry

logger = logging.getLogger("kvstrata.router")
REAP_INTERVAL_S = 1.0
MAX_URL_CHARS = 2048

router = APIRouter()


class RankSource(Protocol):
    """What follows a source of ranks beside the registrations (discovery.py's
    `Discovery`): started and stopped with the membership."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...


class WorkerRegistration(BaseModel):
    """The body of POST /workers (unknown fields are refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["prefill", "decode"]
    url: str = Field(max_length=MAX_URL_CHARS)
    rank: int = Field(0, ge=0, description="The rank's --rank: its place in the router's list.")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")) or len(url.split("/")) != 3:
            raise ValueError(f"must be an http(s) URL of a host and port, got {url!r}")
        return url


class Membership:
    """Who is behind the router: joins and leaves (the registry holds the ranks, the
    streams follow each one) and the removal of registered ranks that stay unhealthy."""

    def __init__(
        self,
        registry: WorkerRegistry,
        inquirer: LoadInquirer,
        streams: EventStreams | None,
        remove_after_s: float,
    ) -> None:
        self.registry = registry
        self.inquirer = inquirer
        self.streams = streams  # None: --no-kv-events
        self.remove_after_s = remove_after_s
        self._reaper: asyncio.Task[None] | None = None
        self.discovery: RankSource | None = None  # --discovery kubernetes|file, set by its builder

    def start(self) -> None:
        if self.streams is not None:
            for rank in self.registry.ranks:
                self.streams.watch(rank)
        self._reaper = asyncio.create_task(self._reap(), name="kvstrata-reaper")
        if self.discovery is not None:
            self.discovery.start()

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await stop_task(self._reaper)
        if self.streams is not None:
            await self.streams.stop()

    def find(self, url: str) -> RankState | None:
        return next((rank for rank in self.registry.ranks if rank.url == url), None)

    async def register(self, body: WorkerRegistration) -> tuple[RankState, bool]:
        """The rank of `body` (True: it is new). Raises OpenAIError 409 if its URL is
        known in the other role."""
        role = Role(body.role)
        known = self.find(body.url)
        if known is not None:
            if known.role is not role:
                raise OpenAIError(
                    409,
                    f"{body.url} is registered as a {known.role.value} rank",
                    "role",
                    "role_conflict",
                )
            return known, False
        return await self.join(role, body.url, body.rank, "registered", registered=True), True

    async def join(
        self, role: Role, url: str, order: int, how: str, registered: bool = False
    ) -> RankState:
        """A new rank (its URL not in the registry): polled at once, then followed."""
        rank = self.registry.insert(role, url, order, registered=registered)
        rank.unhealthy_since_s = time.monotonic()  # not healthy until it answers
        logger.info("%s %s (%s)", rank.name, how, rank.worker_id)
        await self.inquirer.poll_rank(rank)  # routable at once if it answers
        if self.streams is not None:
            self.streams.watch(rank)
        return rank

    async def deregister(self, worker_id: str) -> RankState | None:
        rank = next((r for r in self.registry.ranks if r.worker_id == worker_id), None)
        if rank is not None:
            await self._remove(rank, "deregistered")
        return rank

    async def leave(self, rank: RankState, why: str) -> None:
        """Take `rank` out (a no-op if it was removed already)."""
        if any(known is rank for known in self.registry.of(rank.role)):
            await self._remove(rank, why)

    async def _remove(self, rank: RankState, why: str) -> None:
        self.registry.remove(rank)
        if self.streams is not None:
            await self.streams.unwatch(rank)
        logger.info("%s removed: %s", rank.name, why)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            now_s = time.monotonic()
            for rank in list(self.registry.ranks):
                since_s = rank.unhealthy_since_s
                if (
                    rank.registered
                    and not rank.healthy
                    and since_s is not None
                    and (now_s - since_s >= self.remove_after_s)
                ):
                    await self._remove(rank, f"unhealthy for {now_s - since_s:.0f} s")


def _membership(request: Request) -> Membership:
    state = request.app.state.kvstrata_router
    if not holds_cluster_key(request.scope["headers"], state.config.cluster_key):
        raise OpenAIError(
            401,
            f"{request.url.path} is for the ranks of this cluster: send "
            f"{CLUSTER_KEY_HEADER} (and start the router with the cluster key)",
            code="invalid_cluster_key",
        )
    return state.membership


# The key is checked at the door (ClusterKeyMiddleware of ROUTER_CLUSTER_PATHS, app.py)
# before the body is read: FastAPI parses a JSON body before it runs dependencies, so a
# malformed one would otherwise answer 400 to a caller without the key. Checked again here.
MembershipDep = Annotated[Membership, Depends(_membership)]


@router.post("/workers", status_code=201)
async def add_worker(body: WorkerRegistration, membership: MembershipDep) -> JSONResponse:
    """Register a rank (201), or find it registered already (200): its record either way."""
    rank, created = await membership.register(body)
    return JSONResponse(rank.to_json(), status_code=201 if created else 200)


@router.delete("/workers/{worker_id}")
async def remove_worker(worker_id: str, membership: MembershipDep) -> dict[str, Any]:
    rank = await membership.deregister(worker_id)
    if rank is None:
        raise OpenAIError(404, f"no worker {worker_id!r}", "worker_id", "not_found")
    return {"id": worker_id, "removed": True, "url": rank.url}


@router.get("/workers")
async def list_workers(membership: MembershipDep) -> list[dict[str, Any]]:
    return [rank.to_json() for rank in membership.registry.ranks]
