"""The routing contract and the load-only policies: a policy reads a snapshot of every rank
(`RankView`) and one request (`RoutingRequest`) and returns a `RoutingDecision`; the router
owns the state the views are built from. Cache-aware policies: cache_aware.py, ttft.py;
the registry of names: policies.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvstrata.kvcache.hashing import page_hashes

if TYPE_CHECKING:
    from kvstrata.config import RouterConfig
    from kvstrata.core import SessionRef
    from kvstrata.kvcache.digest_wire import DigestReplica

# (namespace seed, page size) -> the chained hash of every full page of a prompt
PageHashSource = Callable[[bytes, int], list[bytes]]

_LOAD_FIELDS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_queued_tokens",
    "num_free_pages",
    "num_cached_pages",
    "num_used_pages",
    "num_total_pages",
    "max_local_prefill_tokens",
)
# Fields a rank may leave out (older ranks, other roles), and the value that keeps the
# router's behaviour from before the field existed.
_LOAD_DEFAULTS = {"max_local_prefill_tokens": 0}


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
    # Decode rank: the most uncached prompt tokens it would now prefill itself (local
    # prefill) instead of sending them to a prefill rank; 0: it prefills nothing itself.
    max_local_prefill_tokens: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> RankLoad:
        """Raises ValueError if a common field is missing (and has no default) or is not
        an integer."""
        values = {}
        for name in _LOAD_FIELDS:
            value = body.get(name, _LOAD_DEFAULTS.get(name))
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

    @property
    def num_available_pages(self) -> int:
        """Free pages plus cached pages no running request pins (evictable)."""
        num_locked = self.extra.get("num_locked_pages", 0)
        num_locked = num_locked if isinstance(num_locked, int) else 0
        return self.num_free_pages + max(0, self.num_cached_pages - num_locked)


def l3_store_of(load: RankLoad | None) -> str | None:
    """The L3 store a rank restores from, as its pushed load says (None: none, or a
    polled load, which does not say)."""
    store = load.extra.get("l3_store") if load is not None else None
    return store if isinstance(store, str) and store else None


@dataclass(frozen=True)
class RankView:
    """What a policy knows of one rank. The `*_since_poll` counts are the router's own
    decisions (and ends) for this rank after the poll that answered `load` was sent: the
    rank may not have counted them, so the estimates add them (a burst does not all land
    on one idle rank). `routed_prefixes` are the chunk-boundary hashes of requests
    routed to this rank that its digest may not show yet, so a burst sharing a new
    prefix does not scatter; `routed_pages`, those of their first chunk's pages."""

    index: int
    url: str
    healthy: bool
    load: RankLoad | None  # None until the rank first answered a poll
    num_inflight: int = 0  # forwarded by this router and not yet answered
    num_routed_since_poll: int = 0
    num_routed_tokens_since_poll: int = 0  # prompt tokens, where the router knew them
    num_routed_new_tokens_since_poll: int = 0  # of those, not expected to be cached there
    # Of `num_routed_since_poll`, those decided before the answer arrived (the rank may
    # have counted them); and this router's requests there that ended since the send.
    num_routed_during_poll: int = 0
    num_ended_since_poll: int = 0
    num_unprefilled_tokens: int = 0  # new tokens of this router's requests before their first token
    digest: DigestReplica | None = None  # None: no digest (no prefix cache or not polled)
    routed_prefixes: Mapping[bytes, int] = field(default_factory=dict)
    # First-chunk page hashes of requests routed here (prefix.RoutedPages): a prompt
    # shorter than one chunk is matched by them.
    routed_pages: Mapping[bytes, object] = field(default_factory=dict)
    ttft_scale: float = 1.0  # observed / estimated TTFT of this rank (EWMA), for `ttft`

    @property
    def l3_store(self) -> str | None:
        return l3_store_of(self.load)

    @property
    def estimated_queued_reqs(self) -> int:
        """This router's requests in flight there now, plus what the rank counted beyond
        every request of this router it could have counted: those in flight at some
        moment while the poll was out (never below 0). So a request the router saw end is
        not counted again because the last answer predates its end, nor twice because
        the rank counted it and it was routed after the poll was sent."""
        polled = self.load.num_queued_reqs if self.load is not None else 0
        num_routed_after_answer = self.num_routed_since_poll - self.num_routed_during_poll
        return max(self.num_inflight, polled + num_routed_after_answer - self.num_ended_since_poll)

    @property
    def estimated_queued_tokens(self) -> int:
        polled = self.load.num_queued_tokens if self.load is not None else 0
        return polled + self.num_routed_tokens_since_poll

    @property
    def load_key(self) -> tuple[int, int, int]:
        """Least loaded first: fewest requests, then fewest tokens, then lowest index."""
        return (self.estimated_queued_reqs, self.estimated_queued_tokens, self.index)

    @property
    def spread_key(self) -> tuple[int, int, int, int]:
        """Least loaded first (requests then tokens, which count what was routed since
        the poll), then the rank whose cache held the fewest pages at the poll, then the
        lowest index: new prefixes fill empty ranks instead of piling on the lowest."""
        num_cached_pages = self.load.num_cached_pages if self.load is not None else 0
        return (
            self.estimated_queued_reqs,
            self.estimated_queued_tokens,
            num_cached_pages,
            self.index,
        )


class RoutingRequest:
    """One request as a policy sees it: its prompt length and, on demand, the chained
    page hashes at chunk boundaries that digests are keyed by, computed once per
    (namespace, page size). The router passes token ids; the simulator a hash source."""

    def __init__(
        self,
        token_ids: Sequence[int] | None = None,
        num_prompt_tokens: int | None = None,
        page_hash_source: PageHashSource | None = None,
    ) -> None:
        self.token_ids = token_ids
        self.num_prompt_tokens = (
            num_prompt_tokens if num_prompt_tokens is not None else len(token_ids or ())
        )
        self._source = page_hash_source
        self._page_hashes: dict[tuple[bytes, int], list[bytes]] = {}
        # L3-aware routing: {L3 store id: leading pages of this prompt it holds}, filled
        # by the router (router/l3.py) before a policy with `uses_l3` decides.
        self.l3_pages: dict[str, int] = {}
        # The decode rank that holds the conversation this request continues (a Responses
        # API follow-up): taken whenever it may take the request, before any policy.
        self.home_url: str | None = None
        # The agent session the request is a turn of (router/session_routing.py).
        self.session: SessionRef | None = None

    @property
    def has_tokens(self) -> bool:
        return self._source is not None or self.token_ids is not None

    def page_hashes(self, namespace: bytes, page_size: int) -> list[bytes]:
        key = (namespace, page_size)
        hashes = self._page_hashes.get(key)
        if hashes is None:
            if self._source is not None:
                hashes = self._source(namespace, page_size)
            elif self.token_ids is not None:
                hashes = page_hashes(self.token_ids, page_size, namespace)
            else:
                hashes = []
            self._page_hashes[key] = hashes
        return hashes

    def boundary_hashes(self, namespace: bytes, page_size: int, chunk_size: int) -> list[bytes]:
        """The hash of the page ending at each multiple of `chunk_size` tokens."""
        num_chunk_pages = chunk_size // page_size
        return self.page_hashes(namespace, page_size)[num_chunk_pages - 1 :: num_chunk_pages]


@dataclass(frozen=True)
class RoutingDecision:
    """The rank a policy picked, the rule that picked it (a metrics label), and how many
    prompt tokens the policy expects that rank to hold already (0 if it does not know).
    `policy` names the policy that decided (a delegating policy reports its delegate)."""

    index: int
    url: str
    branch: str
    matched_tokens: int = 0
    policy: str = ""
    estimated_ttft_s: float | None = None  # the `ttft` policy's estimate for this rank
    session: str = ""  # a session's turn: kept, parent, new or moved:<reason> (a trace label)


class Policy(ABC):
    """Picks one healthy rank. `choose` is called on the router's event loop with the
    views of every rank of one role, in index order (the same list shape every call);
    a policy may keep its own state (e.g. a cursor) but never mutates the views.
    `needs_tokens`: the router tokenizes each request so its prefix hashes are known."""

    name: ClassVar[str]
    needs_tokens: bool = False
    uses_digests: ClassVar[bool] = False  # the router polls decode ranks' cache digests
    uses_l3: ClassVar[bool] = False  # the router asks the L3 stores what they hold first

    @classmethod
    def from_config(cls, config: RouterConfig) -> Policy:
        """Build the policy from the router's options (policies with knobs override)."""
        return cls()

    @abstractmethod
    def choose(self, request: RoutingRequest, ranks: Sequence[RankView]) -> RoutingDecision:
        """Raises NoRankAvailable when no rank in `ranks` is healthy."""

    def decide(self, rank: RankView, branch: str, **fields: Any) -> RoutingDecision:
        return RoutingDecision(rank.index, rank.url, branch, policy=self.name, **fields)


def healthy_ranks(ranks: Sequence[RankView]) -> list[RankView]:
    healthy = [rank for rank in ranks if rank.healthy]
    if not healthy:
        raise NoRankAvailable(f"none of the {len(ranks)} ranks is healthy")
    return healthy


def least_loaded(ranks: Sequence[RankView]) -> RankView:
    return min(ranks, key=lambda r: r.load_key)


def emptiest(ranks: Sequence[RankView]) -> RankView:
    """The least-loaded rank, ties to the one caching least (`RankView.spread_key`)."""
    return min(ranks, key=lambda r: r.spread_key)


class RoundRobin(Policy):
    """The next healthy rank after the one picked last, cyclically by position."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next_position = 0

    def choose(self, request: RoutingRequest, ranks: Sequence[RankView]) -> RoutingDecision:
        healthy_ranks(ranks)
        for offset in range(len(ranks)):
            position = (self._next_position + offset) % len(ranks)
            rank = ranks[position]
            if rank.healthy:
                self._next_position = (position + 1) % len(ranks)
                return self.decide(rank, self.name)
        raise AssertionError("unreachable: a healthy rank exists")


class ShortestQueue(Policy):
    """Fewest estimated running + waiting requests; ties go to fewer queued tokens, then
    to the lower index."""

    name = "shortest_queue"

    def choose(self, request: RoutingRequest, ranks: Sequence[RankView]) -> RoutingDecision:
        return self.decide(least_loaded(healthy_ranks(ranks)), self.name)


class TotalTokens(Policy):
    """Fewest estimated queued tokens; ties go to fewer requests, then the lower index.
    Decisions since the last poll add their prompt length when the router knew it (token
    ids given or a policy tokenized), else they only count as requests."""

    name = "total_tokens"

    def choose(self, request: RoutingRequest, ranks: Sequence[RankView]) -> RoutingDecision:
        best = min(
            healthy_ranks(ranks),
            key=lambda r: (r.estimated_queued_tokens, r.estimated_queued_reqs, r.index),
        )
        return self.decide(best, self.name)
