"""Discovery: ranks found by a source (`--discovery kubernetes|file`) joined to and left
from the one registry `/workers` feeds (membership.py). A source publishes the whole set
it sees; `Discovery` reconciles the registry with it and owns only the ranks it added."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvstrata.config import RouterConfig
from kvstrata.router.discovery_source import DiscoveredRank, DiscoverySource
from kvstrata.router.events import stop_task
from kvstrata.router.membership import Membership
from kvstrata.router.workers import RankState, Role

logger = logging.getLogger("kvstrata.router")


class Discovery:
    """Keeps the registry in step with a source: a rank the source sees joins once its own
    /health answers 200 (probed every `interval_s` until then); a rank this discovery
    added leaves once the source no longer sees it (or sees it in another role). A URL
    already in the registry (given on the command line, or registered) is left alone."""

    def __init__(
        self,
        membership: Membership,
        source: DiscoverySource,
        interval_s: float,
        has_cluster_key: bool = True,
    ) -> None:
        self.membership = membership
        self.source = source
        self.interval_s = interval_s
        # Without the cluster key the router cannot hand a decode rank a prefill URL (as
        # at start-up with --prefill): a prefill rank found then is left out, said once.
        self.has_cluster_key = has_cluster_key
        self._refused: set[str] = set()  # prefill URLs left out for that, logged once
        self.wanted: dict[str, DiscoveredRank] = {}  # by URL: what the source sees now
        self.joined: dict[str, RankState] = {}  # by URL: the ranks this discovery added
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def publish(self, ranks: frozenset[DiscoveredRank]) -> None:
        self.wanted = {rank.url: rank for rank in ranks}
        self._changed.set()

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self.source.run(self.publish), name="kvstrata-discovery"),
            asyncio.create_task(self._follow(), name="kvstrata-discovery-reconcile"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            await stop_task(task)

    async def _follow(self) -> None:
        while True:
            await self.reconcile()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.interval_s)
            self._changed.clear()

    async def reconcile(self) -> None:
        """Leaves first (a URL that moved roles leaves, then joins again), then joins."""
        how = f"found by {self.source.name} discovery"
        for url, rank in list(self.joined.items()):
            wanted = self.wanted.get(url)
            if self.membership.find(url) is not rank:
                del self.joined[url]  # removed by someone else (DELETE /workers)
            elif wanted is None or wanted.role is not rank.role:
                del self.joined[url]
                await self.membership.leave(rank, f"no longer seen by {self.source.name}")
        pending = [
            found
            for found in self.wanted.values()
            if found.url not in self.joined
            and self.membership.find(found.url) is None
            and self._may_join(found)
        ]
        errors = await asyncio.gather(
            *(self.membership.inquirer.health_error(found.url) for found in pending)
        )
        for found, error in zip(pending, errors, strict=True):
            if error is not None:
                logger.debug("%s (%s) not joined yet: /health %s", found.url, how, error)
            elif self.wanted.get(found.url) == found and self.membership.find(found.url) is None:
                self.joined[found.url] = await self.membership.join(
                    found.role, found.url, found.order, how
                )

    def _may_join(self, found: DiscoveredRank) -> bool:
        if found.role is not Role.PREFILL or self.has_cluster_key:
            return True
        if found.url not in self._refused:
            self._refused.add(found.url)
            logger.error(
                "prefill rank %s (found by %s discovery) left out: a router with prefill "
                "ranks needs the cluster key (--cluster-key-file)",
                found.url,
                self.source.name,
            )
        return False


def attach_discovery(config: RouterConfig, membership: Membership) -> None:
    """Attach the source of `config.discovery` to `membership` (it starts and stops it);
    static and register need none. The Kubernetes client is imported only here."""
    source: DiscoverySource
    if config.discovery == "file":
        from kvstrata.router.discovery_file import FileSource

        assert config.discovery_file is not None  # RouterConfig.validate
        source = FileSource(config.discovery_file, config.discovery_poll_interval_s)
    elif config.discovery == "kubernetes":
        from kvstrata.router.discovery_k8s import PodSource

        source = PodSource.of(config)
    else:
        return
    membership.discovery = Discovery(
        membership, source, config.discovery_poll_interval_s, config.cluster_key is not None
    )
