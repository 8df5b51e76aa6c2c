"""`Registrar`: a rank's membership in its routers (`kvstrata serve --register-with`):
it registers (POST /workers) at start and again every interval, so a router that
restarted learns it back, and deregisters (DELETE /workers/{id}) when the rank stops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import httpx

from kvstrata.errors_text import describe_error
from kvstrata.http.middleware import CLUSTER_KEY_HEADER

logger = logging.getLogger("kvstrata.server")
DEREGISTER_TIMEOUT_S = 2.0  # a stopping rank waits this long at most for each router
RETRY_S = 0.5  # until a router first answers


@dataclass(frozen=True)
class Membership:
    """What a rank announces: its role in the router's lists, URL and rank index."""

    role: str  # "prefill" or "decode" (a unified rank serves as a decode rank)
    url: str
    rank: int

    def to_json(self) -> dict[str, str | int]:
        return {"role": self.role, "url": self.url, "rank": self.rank}


@dataclass
class Registrar:
    router_urls: list[str]
    membership: Membership
    cluster_key: str
    interval_s: float
    _ids: dict[str, str] = field(default_factory=dict)  # router URL -> the id it gave
    _problems: dict[str, str] = field(default_factory=dict)  # router URL -> last error
    _task: asyncio.Task[None] | None = None
    _client: httpx.AsyncClient | None = None

    def start(self) -> None:
        self._client = httpx.AsyncClient(
            headers={CLUSTER_KEY_HEADER: self.cluster_key}, timeout=DEREGISTER_TIMEOUT_S
        )
        self._task = asyncio.create_task(self._run(), name="kvstrata-registrar")

    async def _run(self) -> None:
        while True:
            await asyncio.gather(*(self._register(url) for url in self.router_urls))
            # A router not reached yet (it may be starting) is asked again soon.
            missing = any(url not in self._ids for url in self.router_urls)
            await asyncio.sleep(min(self.interval_s, RETRY_S) if missing else self.interval_s)

    async def _register(self, router_url: str) -> None:
        assert self._client is not None
        try:
            response = await self._client.post(
                f"{router_url}/workers", json=self.membership.to_json()
            )
            if response.status_code not in (200, 201):
                raise ValueError(f"answered {response.status_code}: {response.text[:200]}")
            worker_id = response.json()["id"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            problem = describe_error(e, qualified=True)
            if self._problems.get(router_url) != problem:  # once per new reason
                # Before the first success the router may still be starting: not a fault.
                level = logging.WARNING if router_url in self._ids else logging.INFO
                logger.log(level, "registering with the router %s failed: %s", router_url, problem)
            self._problems[router_url] = problem
            return
        if self._ids.get(router_url) != worker_id:
            logger.info("registered with the router %s as %s", router_url, worker_id)
        self._ids[router_url] = worker_id
        self._problems.pop(router_url, None)

    async def stop(self) -> None:
        """Stop registering and deregister from every router (best effort: a router that
        does not answer drops the rank by health watching instead)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._client is None:
            return
        await asyncio.gather(*(self._deregister(url, wid) for url, wid in self._ids.items()))
        self._ids.clear()
        await self._client.aclose()
        self._client = None

    async def _deregister(self, router_url: str, worker_id: str) -> None:
        assert self._client is not None
        try:
            response = await self._client.delete(f"{router_url}/workers/{worker_id}")
        except httpx.TransportError as e:  # the router is gone (or stopped before us)
            logger.info("deregistering from %s: %s", router_url, describe_error(e))
            return
        except httpx.HTTPError as e:
            logger.warning("deregistering from %s failed: %s", router_url, describe_error(e))
            return
        if response.status_code not in (200, 404):  # 404: the router forgot it already
            logger.warning("deregistering from %s: answered %d", router_url, response.status_code)
