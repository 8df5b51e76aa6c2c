"""The vocabulary every discovery source shares: a rank it found (`DiscoveredRank`), the
callback it publishes the whole set it sees to, and the `DiscoverySource` protocol."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvstrata.router.workers import Role


@dataclass(frozen=True)
class DiscoveredRank:
    """A rank a source sees: where it serves, its role, its place in its role's list."""

    url: str
    role: Role
    order: int = 0


Publish = Callable[[frozenset[DiscoveredRank]], None]


class DiscoverySource(Protocol):
    """Watches one place for ranks and calls `publish` with the whole set each time it
    changes (on the router's event loop). `run` returns only when cancelled."""

    name: str

    async def run(self, publish: Publish) -> None: ...
