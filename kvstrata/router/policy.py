"""Routing policies: which rank gets the next request. A policy reads a snapshot of every
rank (`RankView`) and returns a `RoutingDecision`; the router owns the state the views are
built from. New policies (`cache_aware`, `ttft`) are more `Policy` subclasses in POLICIES."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from kvstrata.config import RouterConfig

_LOAD_FIELDS = (
    "num_running_reqs", "num_waiting_reqs", "num_queued_tokens", "num_free_pages",
    "num_cached_pages", "num_used_pages", "num_total_pages",
)  # fmt: skip


class NoRankAvailable(RuntimeError):
    """Every rank a policy could pick is unhealthy (or there is none)."""


@dataclass(frozen=True)
class RankLoad:
    """One rank's answer to `GET /get_load`. `extra` keeps the fields beyond the common
    ones exactly as the rank sent them (e.g. a cache digest), for policies that use them."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_queued_tokens: int
    num_free_pages: int
    num_cached_pages: int
    num_used_pages: int
    num_total_pages: int
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RankLoad:
        """Raises ValueError if a common field is missing or not an integer."""
        values = {}
        for name in _LOAD_FIELDS:
            value = body.get(name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"/get_load: {name} is missing or not an integer: {value!r}")
            values[name] = value
        extra = {k: v for k, v in body.items() if k not in _LOAD_FIELDS}
        return cls(**values, extra=extra)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _LOAD_FIELDS} | dict(self.extra)

    @property
    def num_queued_reqs(self) -> int:
        return self.num_running_reqs + self.num_waiting_reqs


@dataclass(frozen=True)
class RankView:
    """What a policy knows of one rank. The `*_since_poll` counts are the router's own
    decisions for this rank made after the rank sent `load`: the rank could not count
    them yet, so the estimates add them (a burst does not all land on one idle rank)."""

    index: int
    url: str
    healthy: bool
    load: RankLoad | None  # None until the rank first answered a poll
    num_inflight: int = 0  # forwarded by this router and not yet answered
    num_routed_since_poll: int = 0
    num_routed_tokens_since_poll: int = 0  # prompt tokens, where the router knew them

    @property
    def estimated_queued_reqs(self) -> int:
        polled = self.load.num_queued_reqs if self.load is not None else 0
        return polled + self.num_routed_since_poll

    @property
    def estimated_queued_tokens(self) -> int:
        polled = self.load.num_queued_tokens if self.load is not None else 0
        return polled + self.num_routed_tokens_since_poll


@dataclass(frozen=True)
class RoutingDecision:
    """The rank a policy picked, the rule that picked it (a metrics label), and how many
    prompt tokens the policy expects that rank to hold already (0 if it does not know)."""

    index: int
    url: str
    branch: str
    matched_tokens: int = 0


class Policy(ABC):
    """Picks one healthy rank. `choose` is called on the router's event loop with the
    views of every rank of one role, in index order (the same list shape every call);
    a policy may keep its own state (e.g. a cursor) but never mutates the views.
    `needs_tokens`: the router tokenizes each request and passes its prompt token ids
    (else `request_tokens` may be None)."""

    name: ClassVar[str]
    needs_tokens: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: RouterConfig) -> Policy:
        """Build the policy from the router's options (policies with knobs override)."""
        return cls()

    @abstractmethod
    def choose(
        self, request_tokens: Sequence[int] | None, ranks: Sequence[RankView]
    ) -> RoutingDecision:
        """Raises NoRankAvailable when no rank in `ranks` is healthy."""


def healthy_ranks(ranks: Sequence[RankView]) -> list[RankView]:
    healthy = [rank for rank in ranks if rank.healthy]
    if not healthy:
        raise NoRankAvailable(f"none of the {len(ranks)} ranks is healthy")
    return healthy


class RoundRobin(Policy):
    """The next healthy rank after the one picked last, cyclically by position."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next_position = 0

    def choose(
        self, request_tokens: Sequence[int] | None, ranks: Sequence[RankView]
    ) -> RoutingDecision:
        healthy_ranks(ranks)
        for offset in range(len(ranks)):
            position = (self._next_position + offset) % len(ranks)
            rank = ranks[position]
            if rank.healthy:
                self._next_position = (position + 1) % len(ranks)
                return RoutingDecision(rank.index, rank.url, self.name)
        raise AssertionError("unreachable: a healthy rank exists")


class ShortestQueue(Policy):
    """Fewest estimated running + waiting requests; ties go to fewer queued tokens, then
    to the lower index."""

    name = "shortest_queue"

    def choose(
        self, request_tokens: Sequence[int] | None, ranks: Sequence[RankView]
    ) -> RoutingDecision:
        best = min(
            healthy_ranks(ranks),
            key=lambda r: (r.estimated_queued_reqs, r.estimated_queued_tokens, r.index),
        )
        return RoutingDecision(best.index, best.url, self.name)


class TotalTokens(Policy):
    """Fewest estimated queued tokens; ties go to fewer requests, then the lower index.
    Decisions since the last poll add their prompt length when the router knew it (token
    ids given or a policy tokenized), else they only count as requests."""

    name = "total_tokens"

    def choose(
        self, request_tokens: Sequence[int] | None, ranks: Sequence[RankView]
    ) -> RoutingDecision:
        best = min(
            healthy_ranks(ranks),
            key=lambda r: (r.estimated_queued_tokens, r.estimated_queued_reqs, r.index),
        )
        return RoutingDecision(best.index, best.url, self.name)


# --load-balance-method values; the prefill side always uses ShortestQueue.
POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (RoundRobin, ShortestQueue, TotalTokens)
}


def make_policy(config: RouterConfig) -> Policy:
    try:
        policy_cls = POLICIES[config.load_balance_method]
    except KeyError:
        raise ValueError(
            f"--load-balance-method {config.load_balance_method} has no implementation"
        ) from None
    return policy_cls.from_config(config)
