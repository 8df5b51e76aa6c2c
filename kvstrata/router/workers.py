"""The router's registry of prefill and decode ranks (health, last load, its own in-flight
and routed counts) and the load inquirer that polls every rank's `GET /get_load`.
All of it lives on the router's event loop; nothing here is touched from another thread."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from kvstrata.router.policy import RankLoad, RankView

logger = logging.getLogger("kvstrata.router")


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class PollMark:
    """The rank's routed counts when a poll was sent: decisions after it are not in the
    load that poll returns."""

    num_routed: int
    num_routed_tokens: int


@dataclass
class RankState:
    """The router's record of one rank."""

    role: Role
    index: int
    url: str
    # Not healthy until the first poll answers: a rank that never came up gets nothing.
    healthy: bool = False
    num_consecutive_failures: int = 0
    last_error: str | None = None
    load: RankLoad | None = None
    num_inflight: int = 0
    num_routed: int = 0  # every decision for this rank since the router started
    num_routed_tokens: int = 0
    mark: PollMark = PollMark(0, 0)  # counts when the poll that sent `load` was sent

    @property
    def name(self) -> str:
        return f"{self.role.value} rank {self.index} ({self.url})"

    def view(self) -> RankView:
        return RankView(
            index=self.index,
            url=self.url,
            healthy=self.healthy,
            load=self.load,
            num_inflight=self.num_inflight,
            num_routed_since_poll=self.num_routed - self.mark.num_routed,
            num_routed_tokens_since_poll=self.num_routed_tokens - self.mark.num_routed_tokens,
        )

    def to_json(self) -> dict[str, Any]:
        view = self.view()
        return {
            "role": self.role.value,
            "index": self.index,
            "url": self.url,
            "healthy": self.healthy,
            "num_consecutive_failures": self.num_consecutive_failures,
            "last_error": self.last_error,
            "num_inflight": self.num_inflight,
            "num_routed": self.num_routed,
            "num_routed_since_poll": view.num_routed_since_poll,
            "load": self.load.to_json() if self.load is not None else None,
        }


class WorkerRegistry:
    """Every rank behind the router, by role, in the order given on the command line.

    Health: a successful poll makes a rank healthy; `unhealthy_after_failures`
    consecutive failed polls, or one failed forward, make it unhealthy; policies skip
    unhealthy ranks, so it gets no requests until a poll succeeds again."""

    def __init__(
        self, prefill_urls: tuple[str, ...], decode_urls: tuple[str, ...],
        unhealthy_after_failures: int,
    ) -> None:  # fmt: skip
        self.prefill = [RankState(Role.PREFILL, i, url) for i, url in enumerate(prefill_urls)]
        self.decode = [RankState(Role.DECODE, i, url) for i, url in enumerate(decode_urls)]
        self.unhealthy_after_failures = unhealthy_after_failures

    @property
    def ranks(self) -> list[RankState]:
        return self.prefill + self.decode

    @property
    def is_disaggregated(self) -> bool:
        """False: the decode list holds unified ranks, which need no prefill URL."""
        return bool(self.prefill)

    def of(self, role: Role) -> list[RankState]:
        return self.prefill if role is Role.PREFILL else self.decode

    def views(self, role: Role) -> list[RankView]:
        return [rank.view() for rank in self.of(role)]

    def num_healthy(self, role: Role) -> int:
        return sum(rank.healthy for rank in self.of(role))

    @property
    def is_ready(self) -> bool:
        """Requests can be served: a healthy decode rank, and a healthy prefill rank if
        the cluster is disaggregated."""
        prefill_ok = not self.is_disaggregated or self.num_healthy(Role.PREFILL) > 0
        return prefill_ok and self.num_healthy(Role.DECODE) > 0

    # -- routing accounting --

    def begin_request(self, rank: RankState, num_prompt_tokens: int) -> None:
        rank.num_routed += 1
        rank.num_routed_tokens += num_prompt_tokens
        rank.num_inflight += 1

    def end_request(self, rank: RankState) -> None:
        rank.num_inflight -= 1

    # -- health --

    def poll_mark(self, rank: RankState) -> PollMark:
        return PollMark(rank.num_routed, rank.num_routed_tokens)

    def on_poll_ok(self, rank: RankState, load: RankLoad, mark: PollMark) -> None:
        if not rank.healthy:
            logger.info("%s is healthy", rank.name)
        rank.healthy = True
        rank.num_consecutive_failures = 0
        rank.last_error = None
        rank.load = load
        rank.mark = mark

    def on_poll_failed(self, rank: RankState, error: str) -> None:
        rank.num_consecutive_failures += 1
        rank.last_error = error
        if rank.healthy and rank.num_consecutive_failures >= self.unhealthy_after_failures:
            self._mark_unhealthy(rank, error)

    def on_forward_failed(self, rank: RankState, error: str) -> None:
        rank.last_error = error
        if rank.healthy:
            self._mark_unhealthy(rank, error)

    def _mark_unhealthy(self, rank: RankState, error: str) -> None:
        logger.warning("%s is unhealthy: %s", rank.name, error)
        rank.healthy = False


class LoadInquirer:
    """Polls every rank's `GET /get_load` each `interval_s` seconds, all ranks at once,
    and reports each answer (or failure) to the registry."""

    def __init__(
        self, registry: WorkerRegistry, client: httpx.AsyncClient, interval_s: float,
        timeout_s: float,
    ) -> None:  # fmt: skip
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(rank) for rank in self.registry.ranks))

    async def _poll(self, rank: RankState) -> None:
        mark = self.registry.poll_mark(rank)
        try:
            response = await self.client.get(f"{rank.url}/get_load", timeout=self.timeout_s)
            if response.status_code != 200:
                raise ValueError(f"answered {response.status_code}: {response.text[:200]}")
            load = RankLoad.from_json(response.json())
        except (httpx.HTTPError, ValueError) as e:
            self.registry.on_poll_failed(rank, f"{type(e).__name__}: {e}".rstrip(": "))
            return
        self.registry.on_poll_ok(rank, load, mark)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll_once()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvstrata-load-inquirer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
