"""The discrete-event run of one cache policy over an agentic workload: a session's turn
arrives `pause_s` after its previous turn ended (and the sub-agents it waits for
returned), on its root's rank; it waits FIFO for the rank's prefill lane (`TtftCosts` of
the work the cache did not save, a unified rank: no transfer), decodes, and is released
into the rank's real caches, which end its session's turn. Time is virtual (SimClock)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvstrata.core import SessionRef
from kvstrata.router.ttft import TtftCosts
from kvstrata.sim.agent_sessions import AgentSession, AgentWorkload
from kvstrata.sim.agent_tokens import Context, SimTokens
from kvstrata.sim.cache import Admission, CachePolicy, RankCache, SimClock
from kvstrata.sim.config import SimConfig
from kvstrata.sim.events import EventQueue


@dataclass(frozen=True)
class RunSpec:
    """One run: its name, how each rank's cache keeps pages, and each tier's size."""

    name: str
    policy: CachePolicy
    num_l1_pages: int
    num_l2_pages: int


@dataclass(frozen=True)
class TurnRecord:
    """One simulated turn. Its prompt split by where its KV came from:

    [0, l1_len) L1 | [.., +l2_len) L2 | [.., +l3_len) L3 | computed_len prefilled, of
    which recomputed_len were in this rank's cache before (evicted since), and
    stranded_len are still held by a tier, stranded behind the page that went."""

    session: int
    turn: int
    idle_s: float | None  # a resumed turn: seconds since its session's previous turn ended
    ttft_s: float  # wait_s, then the prefill lane's work
    wait_s: float  # queued: for the lane, or for L1 pages
    prompt_len: int
    l1_len: int
    l2_len: int
    l3_len: int
    recomputed_len: int
    stranded_len: int  # past the first missing page, held by L1 or L2 yet unusable

    @property
    def computed_len(self) -> int:
        return self.prompt_len - self.l1_len - self.l2_len - self.l3_len


@dataclass
class RunStats:
    name: str
    turns: list[TurnRecord] = field(default_factory=list)
    num_dropped_turns: int = 0  # prompts longer than a rank's whole L1: never admitted
    working_set_pages_mean: float = 0.0  # per rank, at turn arrivals (LiveWorkingSet)
    working_set_pages_max: int = 0
    end_s: float = 0.0
    cache_counters: dict[str, float] = field(default_factory=dict)  # summed over ranks


class LiveWorkingSet:
    """The distinct full pages the live sessions' contexts hold on one rank (a page shared
    by several counts once), sampled at every turn's arrival: "L1 for a quarter of the
    live sessions" is a quarter of its mean, the working set a request arrives to. A
    session is live from its first arrival to the end of its last turn."""

    def __init__(self) -> None:
        self._counts: Counter[bytes] = Counter()
        self._held: dict[int, list[bytes]] = {}
        self._sum_pages = 0
        self._num_samples = 0
        self.max_pages = 0

    def hold(self, session: int, page_hashes: list[bytes]) -> None:
        old = self._held.get(session, [])
        # Chained hashes: equal hashes at position i mean equal prefixes through i.
        if old and len(page_hashes) >= len(old) and page_hashes[len(old) - 1] == old[-1]:
            self._counts.update(page_hashes[len(old) :])
        else:
            self._drop(old)
            self._counts.update(page_hashes)
        self._held[session] = list(page_hashes)

    def sample(self) -> None:
        """A turn arrives: count what the live sessions hold now."""
        self._sum_pages += len(self._counts)
        self._num_samples += 1
        self.max_pages = max(self.max_pages, len(self._counts))

    def close(self, session: int) -> None:
        self._drop(self._held.pop(session, []))

    @property
    def mean_pages(self) -> float:
        return self._sum_pages / self._num_samples if self._num_samples else 0.0

    def _drop(self, page_hashes: list[bytes]) -> None:
        self._counts.subtract(page_hashes)
        for page_hash in page_hashes:
            if self._counts[page_hash] <= 0:
                del self._counts[page_hash]


@dataclass
class _Job:
    session: AgentSession
    turn: int
    arrival_s: float
    idle_s: float | None
    context: Context  # what the turn sends (the session's own, grown, for appended turns)
    ref: SessionRef
    admission: Admission | None = None


class _Lane:
    """One rank: its caches, a FIFO prefill lane, and what it has computed."""

    def __init__(self, cache: RankCache) -> None:
        self.cache = cache
        self.waiting: deque[_Job] = deque()
        self.busy = False
        # Pages this rank's cache was ever given: computing one again is a recompute (a
        # page two queued turns both compute before either is released is not).
        self.cached_once: set[bytes] = set()
        self.live = LiveWorkingSet()


class AgentSim:
    """Runs `spec` over `workload` once; `run()` returns the stats."""

    def __init__(self, config: SimConfig, workload: AgentWorkload, spec: RunSpec) -> None:
        self.config = config
        self.workload = workload
        self.scale = config.agentic_time_scale
        self.clock = SimClock()
        self.costs = TtftCosts(
            prefill_s_per_token=1.0 / config.prefill_tokens_per_s,
            transfer_s_per_token=0.0,
            l2_s_per_token=1.0 / config.l2_tokens_per_s,
            l3_s_per_token=1.0 / config.l3_tokens_per_s,
        )
        l3: set[bytes] | None = set() if config.l3 else None
        page_size = config.page_size
        self.lanes = [
            _Lane(
                RankCache(
                    spec.num_l1_pages, spec.num_l2_pages, page_size, l3, spec.policy, self.clock
                )
            )
            for _ in range(config.num_decode)
        ]
        self.tokens = SimTokens(workload, page_size)
        self.stats = RunStats(spec.name)
        self._contexts: dict[int, Context] = {}
        self._lane_of: dict[int, _Lane] = {}
        self._last_end_s: dict[int, float] = {}
        self._next_turn_index: dict[int, int] = {}  # the turn a session sends next
        self._children_out: Counter[int] = Counter()  # joined sub-agents still running
        self._events = EventQueue(self.clock)

    def run(self) -> RunStats:
        for number, root in enumerate(self.workload.roots):
            self._lane_of[root.index] = self.lanes[number % len(self.lanes)]
            self._contexts[root.index] = self.tokens.root_context(root.kind)
            self._at(root.start_s / self.scale, self._arrive, root, 0)
        self._events.run()
        stats = self.stats
        stats.end_s = self.clock.now_s
        means = [lane.live.mean_pages for lane in self.lanes]
        stats.working_set_pages_mean = sum(means) / len(means)
        stats.working_set_pages_max = max(lane.live.max_pages for lane in self.lanes)
        for lane in self.lanes:
            for key, value in lane.cache.tiers.metrics().items():
                stats.cache_counters[key] = stats.cache_counters.get(key, 0.0) + value
        return stats

    def _at(self, time_s: float, handler: Callable[..., None], *args: Any) -> None:
        self._events.at(time_s, handler, *args)

    # -- a turn's life: arrive -> (queue) -> prefill -> first token -> decode -> finish ----

    def _arrive(self, now: float, session: AgentSession, turn_index: int) -> None:
        lane = self._lane_of[session.index]
        turn = session.turns[turn_index]
        context = self.tokens.prompt(self._contexts[session.index], turn.prompt)
        if not lane.cache.fits_ever(len(context) + turn.output_len):
            self.stats.num_dropped_turns += len(session.turns) - turn_index
            self._close(now, session)
            return
        idle_s = now - self._last_end_s[session.index] if turn_index else None
        parent = (
            self.workload.sessions[session.parent].session_id
            if session.parent is not None
            else None
        )
        ref = SessionRef(session.session_id, parent, final=turn_index == len(session.turns) - 1)
        lane.cache.turn_started(ref)
        lane.live.hold(session.index, context.page_hashes)
        lane.live.sample()
        lane.waiting.append(_Job(session, turn_index, now, idle_s, context, ref))
        self._try_start(now, lane)

    def _try_start(self, now: float, lane: _Lane) -> None:
        """Start the head of the queue if the lane is free and its pages fit (FIFO: no
        one overtakes a turn waiting for pages)."""
        if lane.busy or not lane.waiting:
            return
        job = lane.waiting[0]
        output_len = job.session.turns[job.turn].output_len
        prompt_len = len(job.context)
        admission = lane.cache.try_admit(
            job.context.token_ids, job.context.hashes, prompt_len + output_len
        )
        if admission is None:
            return  # a finishing turn frees pages and calls again
        lane.waiting.popleft()
        lane.busy = True
        job.admission = admission
        cached_len = admission.l1_len + admission.l2_len + admission.l3_len
        page_size = self.config.page_size
        computed_pages = job.context.page_hashes[cached_len // page_size :]
        recomputed_len = page_size * sum(h in lane.cached_once for h in computed_pages)
        num_matched = cached_len // page_size
        stranded_len = page_size * lane.cache.stranded_pages(job.context.page_hashes, num_matched)
        self.stats.turns.append(
            TurnRecord(
                job.session.index,
                job.turn,
                job.idle_s,
                0.0,  # set at the first token
                now - job.arrival_s,
                prompt_len,
                admission.l1_len,
                admission.l2_len,
                admission.l3_len,
                recomputed_len,
                stranded_len,
            )
        )
        service_s = self.costs.compute_s(
            prompt_len - cached_len, admission.l2_len, admission.l3_len, transferred=False
        )
        self._at(now + service_s, self._first_token, lane, job, len(self.stats.turns) - 1)

    def _first_token(self, now: float, lane: _Lane, job: _Job, record_index: int) -> None:
        record = self.stats.turns[record_index]
        self.stats.turns[record_index] = replace(record, ttft_s=now - job.arrival_s)
        lane.busy = False
        output_len = job.session.turns[job.turn].output_len
        self._at(now + output_len * self.config.decode_s_per_token, self._finish, lane, job)
        self._try_start(now, lane)

    def _finish(self, now: float, lane: _Lane, job: _Job) -> None:
        session, turn = job.session, job.session.turns[job.turn]
        context = job.context
        context.extend(self.tokens.fresh(turn.output_len))  # the answer joins the context
        assert job.admission is not None
        lane.cache.release(job.admission, context.token_ids, context.hashes, job.ref)
        lane.cached_once.update(context.page_hashes)
        self._contexts[session.index] = context
        self._last_end_s[session.index] = now
        self._next_turn_index[session.index] = job.turn + 1
        for child_index in turn.children:
            child = self.workload.sessions[child_index]
            self._lane_of[child_index] = lane
            self._contexts[child_index] = context.copy()
            self._children_out[session.index] += child.joins_parent
            self._at(now + child.turns[0].pause_s / self.scale, self._arrive, child, 0)
        if job.turn == len(session.turns) - 1:
            self._close(now, session)
        else:
            lane.live.hold(session.index, context.page_hashes)
            if not self._children_out[session.index]:
                self._next_turn(now, session, job.turn + 1)
        self._try_start(now, lane)

    def _next_turn(self, now: float, session: AgentSession, turn_index: int) -> None:
        pause_s = session.turns[turn_index].pause_s / self.scale
        self._at(now + pause_s, self._arrive, session, turn_index)

    def _close(self, now: float, session: AgentSession) -> None:
        """The session's last turn ended (or it was dropped): it leaves the working set;
        a parent waiting for it resumes when it was the last one out."""
        self._lane_of[session.index].live.close(session.index)
        self._contexts.pop(session.index, None)
        parent = session.parent
        if parent is None or not session.joins_parent:
            return
        self._children_out[parent] -= 1
        if self._children_out[parent] == 0 and parent in self._contexts:
            self._next_turn(now, self.workload.sessions[parent], self._next_turn_index[parent])
