"""The router's registry of prefill and decode ranks (each a `RankState`, rank_state.py:
health, last load, cache digest, routed counts) and the load inquirer that polls the
`GET /get_load` of every rank whose event stream (events.py) is down. All of it lives on
the router's event loop (or in the simulator's single thread)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import httpx

from kvstrata.errors_text import describe_error
from kvstrata.kvcache.digest_wire import DigestDelta, DigestReplica
from kvstrata.router.policy import RankLoad, RankView
from kvstrata.router.prefix import RoutedPages, RoutedPrefixes
from kvstrata.router.rank_state import PollMark, RankState, Role, RoutedRequest

# The registry's vocabulary, imported from here by the proxy, the simulator and tests.
__all__ = ["LoadInquirer", "PollMark", "RankState", "Role", "RoutedRequest", "WorkerRegistry"]

# Weight of the newest observation in a rank's TTFT scale, and the scale's bounds.
TTFT_EWMA_WEIGHT = 0.2
TTFT_SCALE_RANGE = (0.1, 10.0)

logger = logging.getLogger("kvstrata.router")


class WorkerRegistry:
    """Every rank behind the router, by role, in the order given on the command line.

    Health: a successful poll makes a rank healthy; `unhealthy_after_failures`
    consecutive failed polls, or one failed forward, make it unhealthy; policies skip
    unhealthy ranks, so it gets no requests until a poll succeeds again. A poll that
    times out while the rank answers its own /health is slow, not failed: a busy rank
    (a long prefill step holds its /get_load) keeps its health and its last load."""

    def __init__(
        self,
        prefill_urls: tuple[str, ...],
        decode_urls: tuple[str, ...],
        unhealthy_after_failures: int,
    ) -> None:
        self.prefill: list[RankState] = []
        self.decode: list[RankState] = []
        self.unhealthy_after_failures = unhealthy_after_failures
        self._num_ids = 0
        # Once PD, always PD: a cluster whose prefill ranks all left still needs one.
        self._disaggregated = bool(prefill_urls)
        for role, urls in ((Role.PREFILL, prefill_urls), (Role.DECODE, decode_urls)):
            for position, url in enumerate(urls):
                self.insert(role, url, position)

    def insert(self, role: Role, url: str, order: int, registered: bool = False) -> RankState:
        """A new rank, placed after the ranks of its role with an `order` not above its
        own; every index after it moves up by one."""
        self._num_ids += 1
        rank = RankState(
            role,
            0,
            url,
            worker_id=f"{role.value}-{self._num_ids}",
            order=order,
            registered=registered,
        )
        ranks = self.of(role)
        position = sum(1 for other in ranks if other.order <= order)
        ranks.insert(position, rank)
        self._reindex(ranks)
        self._disaggregated = self._disaggregated or role is Role.PREFILL
        return rank

    def remove(self, rank: RankState) -> None:
        """Take `rank` out of its list (its requests in flight still end on the record)."""
        ranks = self.of(rank.role)
        ranks.remove(rank)
        self._reindex(ranks)

    @staticmethod
    def _reindex(ranks: list[RankState]) -> None:
        # A policy's decision names a rank by its index: the position in its list.
        for index, rank in enumerate(ranks):
            rank.index = index

    @property
    def ranks(self) -> list[RankState]:
        return self.prefill + self.decode

    @property
    def is_disaggregated(self) -> bool:
        """False: the decode list holds unified ranks, which need no prefill URL."""
        return self._disaggregated

    def of(self, role: Role) -> list[RankState]:
        return self.prefill if role is Role.PREFILL else self.decode

    def views(self, role: Role) -> list[RankView]:
        return [rank.view() for rank in self.of(role)]

    def num_healthy(self, role: Role) -> int:
        return sum(rank.healthy for rank in self.of(role))

    @property
    def is_ready(self) -> bool:
        """Requests can be served: a healthy decode rank, and in a disaggregated cluster
        a healthy prefill rank, or a verdict on every one (none answered: the decode ranks
        prefill themselves, `is_degraded`). Before the first verdict on the prefill ranks
        the router waits, so a starting cluster does not prefill on its decode ranks."""
        if self.num_healthy(Role.DECODE) == 0:
            return False
        judged = (rank.healthy or rank.last_error is not None for rank in self.prefill)
        return not self.is_disaggregated or all(judged)

    @property
    def is_degraded(self) -> bool:
        """Disaggregated, but no prefill rank is healthy: decode ranks prefill locally."""
        return self.is_disaggregated and self.num_healthy(Role.PREFILL) == 0

    # -- routing accounting --

    def begin_request(
        self,
        rank: RankState,
        num_prompt_tokens: int,
        boundary_hashes: Sequence[bytes] = (),
        num_new_tokens: int | None = None,
        first_chunk_pages: Sequence[bytes] = (),
    ) -> RoutedRequest:
        """Count a decision for `rank`: the request's prompt tokens (`num_new_tokens` of
        them not expected to be cached there; default all) and its chunk-boundary hashes,
        which later requests then match as if the rank's digest held them, and the page
        hashes of its first chunk, which later requests shorter than a chunk match."""
        num_new_tokens = num_prompt_tokens if num_new_tokens is None else num_new_tokens
        rank.num_routed += 1
        rank.num_routed_tokens += num_prompt_tokens
        rank.num_routed_new_tokens += num_new_tokens
        rank.num_unprefilled_tokens += num_new_tokens
        rank.num_inflight += 1
        rank.routed.add(boundary_hashes)
        rank.routed_pages.add(first_chunk_pages)
        return RoutedRequest(tuple(boundary_hashes), num_new_tokens, rank.routed)

    def first_token(self, rank: RankState, routed: RoutedRequest) -> None:
        """The request's first token arrived: its prefill is done."""
        rank.num_unprefilled_tokens -= routed.num_unprefilled_tokens
        routed.num_unprefilled_tokens = 0

    def end_request(self, rank: RankState, routed: RoutedRequest | None = None) -> None:
        rank.num_inflight -= 1
        if routed is not None:
            self.first_token(rank, routed)
            if routed.prefixes is rank.routed:  # else the rank's cache reset since
                rank.routed.end(routed.boundary_hashes, rank.num_ended)
        rank.num_ended += 1

    def observe_ttft(self, rank: RankState, estimated_s: float, observed_s: float) -> None:
        """Fold one observed TTFT into the rank's scale (observed / estimated, EWMA)."""
        if estimated_s <= 1e-3:
            return  # a near-zero estimate says nothing about the rank's speed
        ratio = observed_s / estimated_s
        scale = (1 - TTFT_EWMA_WEIGHT) * rank.ttft_scale + TTFT_EWMA_WEIGHT * ratio
        rank.ttft_scale = min(max(scale, TTFT_SCALE_RANGE[0]), TTFT_SCALE_RANGE[1])

    # -- health, load and digests --

    def poll_mark(self, rank: RankState) -> PollMark:
        return PollMark(
            rank.num_routed, rank.num_routed_tokens, rank.num_routed_new_tokens, rank.num_ended
        )

    def on_poll_ok(self, rank: RankState, load: RankLoad, mark: PollMark) -> None:
        if not rank.healthy:
            logger.info("%s is healthy", rank.name)
        rank.healthy = True
        rank.unhealthy_since_s = None
        rank.num_consecutive_failures = 0
        rank.num_consecutive_slow_polls = 0
        rank.last_error = None
        rank.load = load
        rank.mark = mark
        rank.num_routed_at_answer = rank.num_routed

    def on_poll_answer(
        self,
        rank: RankState,
        load: RankLoad,
        mark: PollMark,
        asked_digest: bool = False,
        delta: DigestDelta | None = None,
    ) -> None:
        """A poll's answer, applied in the one safe order: the load, then the digest (if
        it was asked for; None: the rank serves none), then forgetting the routed
        prefixes the digest now shows. The router and the simulator both come here."""
        self.on_poll_ok(rank, load, mark)
        if asked_digest:
            self.on_digest(rank, delta)
        self.settle_routed(rank, mark)

    def settle_routed(self, rank: RankState, mark: PollMark) -> None:
        """After a poll (and its digest) were applied: forget routed prefixes the rank's
        digest now shows. Not while the digest copy was just dropped (a delta out of
        sequence): until a snapshot arrives, those prefixes are the router's only record
        of where a conversation lives."""
        if rank.digest is None and rank.digest_dropped:
            return
        rank.routed.settle(mark.num_ended)

    def on_digest(self, rank: RankState, delta: DigestDelta | None) -> None:
        """The digest part of a poll's answer (None: the rank serves none). A delta that
        does not start at the router's version drops the copy: the next poll asks for a
        snapshot."""
        if delta is None:
            rank.digest = None
            return
        if delta.full and rank.digest_epoch not in (None, delta.epoch):
            # The rank's cache was reset: what the router sent there is gone too, so no
            # prefix traffic follows it until the rank's digest shows something again.
            logger.info(
                "%s: its cache was reset (digest epoch %s -> %s)",
                rank.name,
                rank.digest_epoch,
                delta.epoch,
            )
            rank.digest = None
            rank.routed = RoutedPrefixes()
            rank.routed_pages = RoutedPages()
        if rank.digest is None:
            rank.digest = DigestReplica()
        rank.digest_dropped = not rank.digest.apply(delta)
        if not rank.digest_dropped:
            rank.digest_epoch = delta.epoch
        if rank.digest_dropped:
            logger.info("%s: digest delta out of sequence; asking for a snapshot", rank.name)
            rank.digest = None

    def on_poll_failed(self, rank: RankState, error: str) -> None:
        rank.num_consecutive_failures += 1
        rank.last_error = error
        if rank.healthy and rank.num_consecutive_failures >= self.unhealthy_after_failures:
            self._mark_unhealthy(rank, error)

    def on_poll_slow(self, rank: RankState, error: str) -> None:
        """The poll timed out but the rank's /health answered: neither a failure nor an
        answer (its health, failure count and last load stay as they were)."""
        rank.num_consecutive_slow_polls += 1
        if rank.num_consecutive_slow_polls == 1:
            logger.info("%s is slow to answer /get_load (%s) but alive", rank.name, error)

    def on_forward_failed(self, rank: RankState, error: str) -> None:
        rank.last_error = error
        if rank.healthy:
            self._mark_unhealthy(rank, error)

    def _mark_unhealthy(self, rank: RankState, error: str) -> None:
        logger.warning("%s is unhealthy: %s", rank.name, error)
        rank.healthy = False
        rank.unhealthy_since_s = time.monotonic()


class LoadInquirer:
    """Polls every rank's `GET /get_load` each `interval_s` seconds, all ranks at once,
    and reports each answer (or failure) to the registry. A poll that times out asks the
    rank's `GET /health` (same timeout): answered, the poll was slow; else it failed."""

    def __init__(
        self,
        registry: WorkerRegistry,
        client: httpx.AsyncClient,
        interval_s: float,
        timeout_s: float,
        digest_chunk_size: int | None = None,
    ) -> None:
        """`digest_chunk_size`: ask decode ranks for their cache digest at that size."""
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.digest_chunk_size = digest_chunk_size
        self._task: asyncio.Task[None] | None = None

    async def poll_once(self, include_live: bool = True) -> None:
        """Poll every rank (`include_live` False: those whose event stream is down)."""
        ranks = [r for r in self.registry.ranks if include_live or not r.events_live]
        await asyncio.gather(*(self._poll(rank) for rank in ranks))

    async def poll_rank(self, rank: RankState) -> None:
        """Poll one rank now (one that just joined)."""
        await self._poll(rank)

    async def _poll(self, rank: RankState) -> None:
        mark = self.registry.poll_mark(rank)
        params: dict[str, str | int] = {}
        asks_digest = rank.role is Role.DECODE and self.digest_chunk_size is not None
        if asks_digest:
            assert self.digest_chunk_size is not None
            replica = rank.digest or DigestReplica()
            params = replica.query(self.digest_chunk_size)
        try:
            response = await self.client.get(
                f"{rank.url}/get_load", params=params, timeout=self.timeout_s
            )
            if response.status_code != 200:
                raise ValueError(f"answered {response.status_code}: {response.text[:200]}")
            body = response.json()
            digest_body = body.pop("digest", None)
            digest_error = body.pop("digest_error", None)
            load = RankLoad.from_json(body)
        except httpx.TimeoutException as e:
            error = describe_error(e, qualified=True)
            health_error = await self._health_error(rank)
            if health_error is None:
                self.registry.on_poll_slow(rank, error)
            else:
                self.registry.on_poll_failed(rank, f"{error}; /health: {health_error}")
            return
        except (httpx.HTTPError, ValueError) as e:
            self.registry.on_poll_failed(rank, describe_error(e, qualified=True))
            return
        if rank.events_live:
            return  # the stream came up meanwhile: its events are newer than this answer
        delta = _parse_digest(rank, digest_body, digest_error) if asks_digest else None
        self.registry.on_poll_answer(rank, load, mark, asks_digest, delta)

    async def _health_error(self, rank: RankState) -> str | None:
        return await self.health_error(rank.url)

    async def health_error(self, url: str) -> str | None:
        """Why the /health of the rank at `url` did not answer 200 in time; None if it did.
        A rank answers it from its event loop, without waiting for the engine thread."""
        try:
            response = await self.client.get(f"{url}/health", timeout=self.timeout_s)
        except httpx.HTTPError as e:
            return describe_error(e, qualified=True)
        return None if response.status_code == 200 else f"answered {response.status_code}"

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll_once(include_live=False)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvstrata-load-inquirer")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _parse_digest(rank: RankState, body: Any, error: Any) -> DigestDelta | None:
    """The delta in a poll's answer; None (logged once per new reason) if there is none
    or it is unusable."""
    delta, problem = None, None
    if error:
        problem = f"serves no digest: {error}"
    elif body is not None:
        try:
            delta = DigestDelta.from_json(body)
        except ValueError as e:
            problem = f"sent a malformed digest: {e}"
    if problem is not None and problem != rank.digest_problem:
        logger.warning("%s %s", rank.name, problem)
    rank.digest_problem = problem
    return delta
