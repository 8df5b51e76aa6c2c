"""Sessions at the router, exactly: the session table (LRU bound, parents, responses),
the move rule's every reason against hand-computed `ttft` prices (fake rank views), and the
session step in front of the `ttft` and `cache_aware` policies (kept, parent, new, moved,
a Responses follow-up pinned, no session, --no-session-affinity), with its counters."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from test_cache_policies import PROMPT, URLS, request, view

from kvstrata.core import SessionRef
from kvstrata.router.cache_aware import CacheAware
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.policy import Policy, RankView, RoutingDecision, RoutingRequest
from kvstrata.router.session_routing import MoveRule, SessionAffinity, Verdict
from kvstrata.router.sessions import SessionTable
from kvstrata.router.ttft import Ttft, TtftCosts

# One second per computed token, nothing else: a rank's price is its queued tokens plus
# the prompt tokens it does not hold (PROMPT: 32 tokens, chunks of 8).
COSTS = TtftCosts(1.0, 0.0, 0.0, 0.0)
RULE = MoveRule(COSTS, move_margin=1.0, max_extra_reqs=2)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        self.now_s += 1.0
        return self.now_s


# -- the table --


def test_the_table_forgets_the_least_recently_routed_session_first() -> None:
    table = SessionTable(max_sessions=2, clock=Clock())
    table.place(SessionRef("a"), URLS[0])
    table.place(SessionRef("b"), URLS[1])
    assert table.home_of("a") is not None  # a lookup does not count as a turn
    table.place(SessionRef("b"), URLS[0])
    table.place(SessionRef("c"), URLS[2])
    assert table.home_of("a") is None  # routed longest ago
    b, c = table.home_of("b"), table.home_of("c")
    assert b is not None and c is not None
    assert (b.rank_url, b.last_seen_s, c.rank_url, c.last_seen_s) == (URLS[0], 3.0, URLS[2], 4.0)
    assert len(table) == 2
    table.check_integrity()


def test_the_table_keeps_a_parent_named_once_and_forgets_a_closed_session() -> None:
    table = SessionTable(clock=Clock())
    table.place(SessionRef("child", "parent"), URLS[1])
    table.place(SessionRef("child"), URLS[2])  # a later turn need not name its parent
    home = table.home_of("child")
    assert home is not None and (home.rank_url, home.parent_id) == (URLS[2], "parent")
    assert table.forget("child") and not table.forget("child")
    assert len(table) == 0


def test_the_table_remembers_the_session_of_each_response_within_the_bound() -> None:
    table = SessionTable(max_sessions=2)
    for number in range(3):
        table.learn_response(f"resp_{number}", "s")
    assert [table.session_of_response(f"resp_{n}") for n in range(3)] == [None, "s", "s"]
    table.check_integrity()


# -- the move rule, every reason --


def test_a_session_stays_home_while_its_price_is_within_the_margin() -> None:
    # Home (rank 0) holds 3 chunks: 56 queued + 8 computed = 64 s; rank 1: 32 s. 64 is
    # not above (1 + 1) x 32: kept. One more queued token moves it to rank 1.
    ranks = [view(0, num_chunks=3, queued_tokens=56), view(1), view(2, queued_tokens=5)]
    assert RULE.judge(request(), ranks, URLS[0]) == Verdict(None, ranks[0], 64.0, 24)
    ranks[0] = view(0, num_chunks=3, queued_tokens=57)
    assert RULE.judge(request(), ranks, URLS[0]) == Verdict("cheaper", ranks[1], 32.0, 0)


def test_a_margin_of_zero_moves_at_any_cheaper_rank() -> None:
    ranks = [view(0, num_chunks=1, queued_tokens=9), view(1)]  # 9 + 24 = 33 s against 32 s
    rule = MoveRule(COSTS, move_margin=0.0, max_extra_reqs=2)
    assert rule.judge(request(), ranks, URLS[0]).move == "cheaper"
    assert RULE.judge(request(), ranks, URLS[0]).move is None


def test_a_session_leaves_a_home_that_is_gone_or_may_not_take_it() -> None:
    ranks = [view(0, num_chunks=4, healthy=False), view(1)]
    assert RULE.judge(request(), ranks, URLS[0]) == Verdict("unhealthy")
    assert RULE.judge(request(), ranks, "http://127.0.0.1:9999") == Verdict("gone")


def test_a_session_leaves_a_home_past_the_overload_bound() -> None:
    # Rank 1 is the least loaded (1 request): home at 1 + 2 stays, at 1 + 3 moves, even
    # though it holds the whole prompt.
    ranks = [view(0, num_chunks=4, queued=3), view(1, queued=1)]
    assert RULE.judge(request(), ranks, URLS[0]).move is None
    ranks[0] = view(0, num_chunks=4, queued=4)
    assert RULE.judge(request(), ranks, URLS[0]) == Verdict("overloaded")


def test_without_tokens_or_a_home_digest_only_load_and_health_move_a_session() -> None:
    # The model cannot see what the home holds: its 1000 queued tokens do not move it.
    ranks = [view(0, queued_tokens=1000), view(1)]
    assert RULE.judge(RoutingRequest(), ranks, URLS[0]) == Verdict(None, ranks[0])
    no_digest = RankView(0, URLS[0], True, ranks[0].load)
    assert RULE.judge(request(), [no_digest, ranks[1]], URLS[0]) == Verdict(None, no_digest)


# -- the session step in front of a policy --


def affinity(rule: MoveRule | None = RULE) -> SessionAffinity:
    return SessionAffinity(RouterMetrics(), rule, table=SessionTable(clock=Clock()))


def turn(session: SessionRef | None, tokens: Sequence[int] = PROMPT) -> RoutingRequest:
    routing = request(tokens)
    routing.session = session
    return routing


def count(step: SessionAffinity, name: str, **labels: str) -> float:
    value = step.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


class Recording:
    """The policy's pick, recording the views it was shown."""

    def __init__(self, policy: Policy, routing: RoutingRequest) -> None:
        self.policy, self.routing = policy, routing
        self.shown: list[list[bool]] = []

    def __call__(self, ranks: Sequence[RankView]) -> RoutingDecision:
        self.shown.append([rank.healthy for rank in ranks])
        return self.policy.choose(self.routing, ranks)


POLICIES = [CacheAware(max_extra_reqs=2), Ttft(COSTS, reuse_weight=0.0)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_request_without_a_session_is_the_policy_s_alone(policy: Policy) -> None:
    step, ranks, routing = affinity(), [view(0, queued=1), view(1)], turn(None)
    assert step.route(routing, ranks, Recording(policy, routing)) == policy.choose(routing, ranks)
    assert len(step.table) == 0
    assert count(step, "kvstrata_router_session_routes_total", outcome="new") == 0


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_session_is_placed_by_the_policy_then_kept_then_moved_off_an_overloaded_home(
    policy: Policy,
) -> None:
    step = affinity()
    first = turn(SessionRef("s"))
    pick = Recording(policy, first)
    # New: the policy's pick (every rank equal: the lowest index), recorded as its home.
    decision = step.route(first, [view(0), view(1)], pick)
    assert (decision.index, decision.policy, decision.session) == (0, policy.name, "new")
    # Rank 0 has a request more: both policies would pick rank 1, the session stays.
    ranks = [view(0, queued=1), view(1)]
    assert policy.choose(first, ranks).index == 1
    decision = step.route(turn(SessionRef("s")), ranks, pick)
    assert (decision.index, decision.policy, decision.branch) == (0, "session", "kept")
    assert decision.session == "kept" and decision.estimated_ttft_s == 32.0
    assert pick.shown == [[True, True]]  # the policy was not asked
    # Three beyond the least loaded: the policy picks, the home hidden from it.
    decision = step.route(turn(SessionRef("s")), [view(0, queued=3), view(1)], pick)
    assert (decision.index, decision.policy, decision.session) == (
        1,
        policy.name,
        "moved:overloaded",
    )
    assert pick.shown[-1] == [False, True]
    home = step.table.home_of("s")
    assert home is not None and home.rank_url == URLS[1]
    routes = "kvstrata_router_session_routes_total"
    assert [count(step, routes, outcome=o) for o in ("new", "kept", "moved")] == [1, 1, 1]
    moves = "kvstrata_router_session_moves_total"
    assert [count(step, moves, reason=r) for r in ("overloaded", "cheaper")] == [1, 0]
    assert count(step, "kvstrata_router_sessions") == 1
    decisions = "kvstrata_router_decisions_total"
    assert count(step, decisions, role="decode", policy="session", branch="kept") == 1


def test_a_cheaper_rank_takes_the_session_beyond_the_margin() -> None:
    step = affinity()
    step.table.place(SessionRef("s"), URLS[0])
    ranks = [view(0, num_chunks=3, queued_tokens=57), view(1), view(2, queued_tokens=1)]
    pick = Recording(CacheAware(max_extra_reqs=2), turn(None))
    decision = step.route(turn(SessionRef("s")), ranks, pick)
    assert (decision.index, decision.policy, decision.branch) == (1, "session", "cheaper")
    assert decision.session == "moved:cheaper"
    assert decision.estimated_ttft_s == 32.0 and pick.shown == []
    assert count(step, "kvstrata_router_session_moves_total", reason="cheaper") == 1


def test_a_sub_agent_s_first_turn_goes_to_its_parent_s_home_by_the_same_rule() -> None:
    step = affinity()
    step.table.place(SessionRef("parent"), URLS[1])
    ranks = [view(0), view(1, num_chunks=4, queued=2), view(2)]
    pick = Recording(CacheAware(max_extra_reqs=2), turn(None))
    decision = step.route(turn(SessionRef("child", "parent")), ranks, pick)
    assert (decision.index, decision.branch, decision.session) == (1, "parent", "parent")
    child = step.table.home_of("child")
    assert child is not None and (child.rank_url, child.parent_id) == (URLS[1], "parent")
    # The next sub-agent finds the parent's home overloaded (3 beyond ranks 0 and 2).
    ranks[1] = view(1, num_chunks=4, queued=3)
    decision = step.route(turn(SessionRef("other", "parent")), ranks, pick)
    assert (decision.index, decision.session) == (0, "moved:overloaded")
    routes = "kvstrata_router_session_routes_total"
    assert [count(step, routes, outcome=o) for o in ("parent", "moved", "new")] == [1, 1, 0]


def test_a_responses_follow_up_goes_where_its_answer_is_stored_and_the_session_follows() -> None:
    step = affinity()
    step.table.place(SessionRef("s"), URLS[0])
    pinned = RoutingDecision(2, URLS[2], "home", policy="home")
    pick = Recording(CacheAware(max_extra_reqs=2), turn(None))
    decision = step.route(turn(SessionRef("s")), [view(0), view(1), view(2)], pick, pinned)
    assert (decision.index, decision.policy, decision.session) == (2, "home", "moved:response")
    home = step.table.home_of("s")
    assert home is not None and home.rank_url == URLS[2] and pick.shown == []


def test_a_chain_of_responses_is_a_session_named_by_its_first_answer() -> None:
    step = affinity()
    step.relayed_response("resp_1", None, URLS[1])  # a first answer, no session named
    step.relayed_response("resp_2", SessionRef("resp_1"), URLS[1])
    body = {"previous_response_id": "resp_2"}
    assert step.session_of({}, body, "/v1/responses") == SessionRef("resp_1")
    assert step.session_of({}, body, "/v1/chat/completions") is None
    home = step.table.home_of("resp_1")
    assert home is not None and home.rank_url == URLS[1]


def test_a_final_turn_closes_its_session_once_answered() -> None:
    step = affinity()
    step.table.place(SessionRef("s"), URLS[0])
    step.answered(SessionRef("s"))
    assert step.table.home_of("s") is not None
    step.answered(SessionRef("s", final=True))
    assert step.table.home_of("s") is None


def test_without_session_affinity_sessions_are_read_but_never_routed() -> None:
    step = affinity(rule=None)
    routing, ranks = turn(SessionRef("s")), [view(0, queued=1), view(1)]
    decision = step.route(routing, ranks, Recording(CacheAware(max_extra_reqs=2), routing))
    assert (decision.index, decision.session) == (1, "")
    step.relayed_response("resp_1", None, URLS[0])
    assert len(step.table) == 0
    assert step.session_of({"x-session-id": "s"}, None, "/generate") == SessionRef("s")


def test_the_session_a_request_names_and_the_400_of_a_bad_one() -> None:
    from kvstrata.http.errors import OpenAIError

    step, by_user = affinity(), SessionAffinity(RouterMetrics(), RULE, from_user=True)
    headers = {"x-dynamo-session-id": "s", "x-parent-session-id": "p", "x-session-final": "1"}
    assert step.session_of(headers, None, "/generate") == SessionRef("s", "p", True)
    assert step.session_of({}, {"user": "alice"}, "/v1/completions") is None
    assert by_user.session_of({}, {"user": "alice"}, "/v1/completions") == SessionRef("alice")
    assert SessionAffinity.forwarded_headers(headers | {"x-other": "x"}) == headers
    with pytest.raises(OpenAIError) as refused:
        step.session_of({"x-session-id": "two words"}, None, "/generate")
    error = refused.value
    assert (error.status_code, error.param, error.code) == (400, "session", "invalid_session")
    assert "x-session-id" in error.message
