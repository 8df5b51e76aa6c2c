"""The discrete-event run of one policy over a trace. The router side is the real one
(policy, WorkerRegistry, digest replicas fed by `CacheDigest.delta_since`, pushed a short
lag after each change as the event stream does, or every poll interval); each decode
rank is a FIFO prefill lane (`TtftCosts` of the work the cache did not save) followed by
decoding, over a real `RankCache`."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstrata.router.policies import make_policy
from kvstrata.router.policy import RankLoad, RoutingDecision, RoutingRequest
from kvstrata.router.prefix import routed_boundary_hashes
from kvstrata.router.ttft import TtftCosts
from kvstrata.router.workers import RankState, Role, RoutedRequest, WorkerRegistry
from kvstrata.sim.cache import Admission, CachePolicy, RankCache, SimClock
from kvstrata.sim.config import SimConfig
from kvstrata.sim.events import EventQueue
from kvstrata.sim.trace import SIM_NAMESPACE, TraceRequest, TraceTokens


@dataclass
class _Job:
    """One request on its rank, from routing to the end of its decode."""

    request: TraceRequest
    token_ids: list[int]
    page_hashes: list[bytes]
    decision: RoutingDecision
    routed: RoutedRequest
    admission: Admission | None = None
    start_s: float = 0.0

    def hashes(self, num_pages: int) -> list[bytes]:
        return self.page_hashes[:num_pages]


@dataclass
class RunStats:
    """What one run measured (report.py turns it into a result row)."""

    num_requests: int = 0
    num_dropped: int = 0  # requests longer than a rank's whole L1
    input_tokens: int = 0
    hit_tokens: list[int] = field(default_factory=lambda: [0, 0, 0])  # L1, L2, L3
    estimated_matched_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    imbalance: list[float] = field(default_factory=list)  # max/mean queued, per arrival
    branches: dict[str, int] = field(default_factory=dict)
    requests_per_rank: list[int] = field(default_factory=list)


class _Rank:
    def __init__(self, index: int, cache: RankCache) -> None:
        self.index = index
        self.cache = cache
        self.waiting: deque[_Job] = deque()
        self.in_prefill: _Job | None = None
        self.num_decoding = 0
        # Whether anything happened here since the router last heard. An update of an
        # unchanged rank would say what the router already holds, so none is sent.
        self.changed = True
        self.push_due = False  # events: an update is on its way to the router

    @property
    def num_queued_reqs(self) -> int:
        return len(self.waiting) + (self.in_prefill is not None) + self.num_decoding

    def load(self) -> RankLoad:
        """What the rank's /get_load would say (queued tokens: waiting prompts, as the
        engine counts them)."""
        allocator, radix = self.cache.allocator, self.cache.radix
        num_free, num_cached = allocator.num_free_pages, radix.num_cached_pages
        return RankLoad(
            num_running_reqs=(self.in_prefill is not None) + self.num_decoding,
            num_waiting_reqs=len(self.waiting),
            num_queued_tokens=sum(job.request.input_len for job in self.waiting),
            num_free_pages=num_free,
            num_cached_pages=num_cached,
            num_used_pages=allocator.num_total_pages - num_free - num_cached,
            num_total_pages=allocator.num_total_pages,
            extra={"num_locked_pages": radix.num_locked_pages},
        )


class ClusterSim:
    """Runs `policy` over `requests` once; `run()` returns the stats."""

    def __init__(self, config: SimConfig, policy: str, requests: list[TraceRequest]) -> None:
        self.config = config
        self.requests = requests
        router_config = config.router_config(policy)
        self.policy = make_policy(router_config)
        self.costs = TtftCosts.from_config(router_config)
        self.workers = WorkerRegistry((), router_config.decode, unhealthy_after_failures=1)
        self.tokens = TraceTokens(config.block_size, config.page_size)
        num_l1_pages = config.l1_tokens_per_rank // config.page_size
        num_l2_pages = int(num_l1_pages * config.l2_ratio)
        l3: set[bytes] | None = set() if config.l3 else None
        self.clock = SimClock()  # every cache's retention runs on the simulated time
        self.ranks = [
            _Rank(
                i,
                RankCache(
                    num_l1_pages, num_l2_pages, config.page_size, l3, CachePolicy(), self.clock
                ),
            )
            for i in range(config.num_decode)
        ]
        self.stats = RunStats(requests_per_rank=[0] * config.num_decode)
        self._events = EventQueue(self.clock)
        self._num_pending = 0  # arrivals not yet finished decoding
        # How a change on a rank reaches the router: pushed after the event lag, or left
        # for the next poll tick.
        pushed = config.digest_updates == "events"
        self._on_change: Callable[[float, _Rank], None] = (
            self._push_soon if pushed else lambda now, rank: None
        )

    def run(self) -> RunStats:
        self._poll(0.0)  # ranks come up healthy with empty caches
        for request in self.requests:
            self._at(request.arrival_s, self._arrive, request)
        self._num_pending = len(self.requests)
        if self.config.digest_updates == "poll":
            self._at(self.config.load_poll_interval_s, self._poll_tick)
        self._events.run()
        return self.stats

    # -- events ----------------------------------------------------------------------

    def _at(self, time_s: float, handler: Callable[..., None], *args: Any) -> None:
        self._events.at(time_s, handler, *args)

    def _poll_tick(self, now: float) -> None:
        self._poll(now)
        if self._num_pending:
            self._at(now + self.config.load_poll_interval_s, self._poll_tick)

    def _poll(self, now: float) -> None:
        for rank in self.ranks:
            self._update(rank)

    def _changed(self, now: float, rank: _Rank) -> None:
        rank.changed = True
        self._on_change(now, rank)

    def _push_soon(self, now: float, rank: _Rank) -> None:
        if not rank.push_due:
            rank.push_due = True
            self._at(now + self.config.kv_event_lag_s, self._push, rank)

    def _push(self, now: float, rank: _Rank) -> None:
        rank.push_due = False
        self._update(rank)

    def _update(self, rank: _Rank) -> None:
        """The router's copy of `rank` (load, digest delta) becomes what the rank holds."""
        if not rank.changed:
            return
        rank.changed = False
        state = self.workers.decode[rank.index]
        mark = self.workers.poll_mark(state)
        delta = None
        if self.policy.uses_digests:
            replica = state.digest
            epoch, version = (replica.epoch, replica.version) if replica else (None, None)
            chunk_size = self.config.dp_routing_digest_chunk_size
            delta = rank.cache.digest.delta_since(chunk_size, epoch, version)
            delta = delta.with_namespace(SIM_NAMESPACE)
        self.workers.on_poll_answer(state, rank.load(), mark, self.policy.uses_digests, delta)

    def _arrive(self, now: float, request: TraceRequest) -> None:
        stats = self.stats
        queued = [rank.num_queued_reqs for rank in self.ranks]
        mean = sum(queued) / len(queued)
        if mean > 0:
            stats.imbalance.append(max(queued) / mean)
        if not self.ranks[0].cache.fits_ever(request.input_len + request.output_len):
            stats.num_dropped += 1
            self._num_pending -= 1
            return
        page_hashes = self.tokens.page_hashes(request)
        routing = RoutingRequest(
            num_prompt_tokens=request.input_len, page_hash_source=lambda ns, ps: page_hashes
        )
        decision = self.policy.choose(routing, self.workers.views(Role.DECODE))
        state = self.workers.decode[decision.index]
        hashes = routed_boundary_hashes(routing, state.view())
        routed = self.workers.begin_request(
            state, request.input_len, hashes, request.input_len - decision.matched_tokens
        )
        stats.branches[decision.branch] = stats.branches.get(decision.branch, 0) + 1
        stats.estimated_matched_tokens += decision.matched_tokens
        stats.requests_per_rank[decision.index] += 1
        job = _Job(request, self.tokens.token_ids(request), page_hashes, decision, routed)
        rank = self.ranks[decision.index]
        self._changed(now, rank)
        rank.waiting.append(job)
        self._try_start(now, rank)

    def _try_start(self, now: float, rank: _Rank) -> None:
        """Start the head of the rank's queue if its lane is free and its pages fit (FIFO:
        nobody overtakes a request waiting for pages)."""
        if rank.in_prefill is not None or not rank.waiting:
            return
        job = rank.waiting[0]
        total_len = job.request.input_len + job.request.output_len
        admission = rank.cache.try_admit(job.token_ids, job.hashes, total_len)
        if admission is None:
            return  # a finishing request frees pages and calls again
        rank.waiting.popleft()
        self._changed(now, rank)
        job.admission, job.start_s = admission, now
        rank.in_prefill = job
        cached_len = admission.l1_len + admission.l2_len + admission.l3_len
        service_s = self.costs.compute_s(
            job.request.input_len - cached_len, admission.l2_len, admission.l3_len
        )
        self._at(now + service_s, self._first_token, rank, job)

    def _first_token(self, now: float, rank: _Rank, job: _Job) -> None:
        ttft_s = now - job.request.arrival_s
        admission = job.admission
        assert admission is not None
        stats = self.stats
        stats.num_requests += 1
        stats.input_tokens += job.request.input_len
        for tier, num_tokens in enumerate((admission.l1_len, admission.l2_len, admission.l3_len)):
            stats.hit_tokens[tier] += num_tokens
        stats.ttft_s.append(ttft_s)
        state = self.workers.decode[rank.index]
        self.workers.first_token(state, job.routed)  # the router sees the stream start
        if self.config.ttft_calibrate and job.decision.estimated_ttft_s is not None:
            self.workers.observe_ttft(state, job.decision.estimated_ttft_s, ttft_s)
        rank.in_prefill = None
        rank.num_decoding += 1
        self._changed(now, rank)
        decode_s = job.request.output_len * self.config.decode_s_per_token
        self._at(now + decode_s, self._finish, rank, job)
        self._try_start(now, rank)

    def _finish(self, now: float, rank: _Rank, job: _Job) -> None:
        assert job.admission is not None
        rank.cache.release(job.admission, job.token_ids, job.hashes)
        rank.num_decoding -= 1
        self._changed(now, rank)
        state: RankState = self.workers.decode[rank.index]
        self.workers.end_request(state, job.routed)
        self._num_pending -= 1
        self._try_start(now, rank)
