"""Session affinity, the one step between a request and the decode policy: a turn of a
known session goes to its home rank while the `ttft` cost model prices it within
--session-move-margin of the cheapest rank, and leaves it (counted, with the reason) when
the home is gone, may not take it, is overloaded or is priced out; a sub-agent's first
turn prefers its parent's home by the same rule. Requests without a session pass through."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvstrata.core import SessionRef
from kvstrata.http.errors import OpenAIError
from kvstrata.http.session_id import (
    FINAL_HEADERS,
    PARENT_HEADERS,
    SESSION_HEADERS,
    SessionHeaderError,
    session_of,
)
from kvstrata.router.metrics import RouterMetrics
from kvstrata.router.policy import RankView, RoutingDecision, RoutingRequest, least_loaded
from kvstrata.router.prefix import estimate_prefix
from kvstrata.router.rank_state import Role
from kvstrata.router.sessions import SessionTable
from kvstrata.router.ttft import TtftCosts, rank_ttft_s, relative_scales

if TYPE_CHECKING:
    from kvstrata.config import RouterConfig

NEW, KEPT, PARENT, MOVED = "new", "kept", "parent", "moved"
OUTCOMES = (NEW, KEPT, PARENT, MOVED)
GONE, UNHEALTHY, OVERLOADED, CHEAPER = "gone", "unhealthy", "overloaded", "cheaper"
RESPONSE = "response"  # a Responses API follow-up goes where its previous answer is stored
MOVE_REASONS = (GONE, UNHEALTHY, OVERLOADED, CHEAPER, RESPONSE)
SESSION_POLICY = "session"  # the `decisions` label of a turn this step placed itself
FORWARDED_HEADERS = SESSION_HEADERS + PARENT_HEADERS + FINAL_HEADERS
RESPONSES_PATH = "/v1/responses"

# The policy's pick over the ranks as shown (a home it may not use shown unhealthy).
Pick = Callable[[Sequence[RankView]], RoutingDecision]


@dataclass(frozen=True)
class Verdict:
    """The move rule's answer for one turn: `move` None keeps it on `rank` (its home);
    CHEAPER sends it to `rank` (the cheapest); any other reason leaves the choice to the
    policy, the home hidden. `ttft_s` and `matched_tokens`: the model's, for `rank`."""

    move: str | None
    rank: RankView | None = None
    ttft_s: float | None = None
    matched_tokens: int = 0


@dataclass(frozen=True)
class MoveRule:
    """A session leaves its home rank, checked in this order, when the home is gone (not
    in the registry); may not take the request (unhealthy, breaker open, or it failed
    this request: the router shows those as unhealthy); has more than `max_extra_reqs`
    queued requests beyond the least-loaded rank (the policies' overload rule); or its
    estimated TTFT (the `ttft` model over each rank's whole expected prefix) is above
    (1 + `move_margin`) x the cheapest rank's. The price test needs the request's tokens
    and the home's digest: without them the model cannot see what the home holds, and
    only the first three rules apply."""

    costs: TtftCosts
    move_margin: float
    max_extra_reqs: int

    def judge(self, request: RoutingRequest, ranks: Sequence[RankView], home_url: str) -> Verdict:
        home = next((rank for rank in ranks if rank.url == home_url), None)
        if home is None:
            return Verdict(GONE)
        if not home.healthy:
            return Verdict(UNHEALTHY)
        healthy = [rank for rank in ranks if rank.healthy]
        least = least_loaded(healthy)
        if home.estimated_queued_reqs - least.estimated_queued_reqs > self.max_extra_reqs:
            return Verdict(OVERLOADED)
        if not request.has_tokens or home.digest is None:
            return Verdict(None, home)
        scales = relative_scales(healthy)
        priced: dict[int, tuple[float, int]] = {}  # rank index -> (TTFT s, matched tokens)
        for rank in healthy:
            estimate = estimate_prefix(request, rank)
            ttft_s = rank_ttft_s(request, rank, estimate, self.costs, scales[rank.index])
            priced[rank.index] = (ttft_s, estimate.matched_tokens)
        cheapest = min(healthy, key=lambda rank: (priced[rank.index][0], rank.spread_key))
        if priced[home.index][0] > (1 + self.move_margin) * priced[cheapest.index][0]:
            return Verdict(CHEAPER, cheapest, *priced[cheapest.index])
        return Verdict(None, home, *priced[home.index])


class SessionAffinity:
    """The session step of the router's decode choice (routing.py), and what the rest of
    the router asks about sessions: the session a request names (app.py), the headers
    forwarded with it, the session of a relayed Responses API answer, and closing a
    session after its final turn (proxy.py). `rule` None (--no-session-affinity):
    sessions are read, checked and forwarded, never routed or tracked."""

    def __init__(
        self,
        metrics: RouterMetrics,
        rule: MoveRule | None,
        from_user: bool = False,
        table: SessionTable | None = None,
    ) -> None:
        self.metrics = metrics
        self.rule = rule
        self.from_user = from_user
        self.table = table if table is not None else SessionTable()
        metrics.sessions.set_function(lambda: len(self.table))
        for outcome in OUTCOMES:  # every series shows from the start, at 0
            metrics.session_routes.labels(outcome)
        for reason in MOVE_REASONS:
            metrics.session_moves.labels(reason)

    @classmethod
    def of(cls, config: RouterConfig, metrics: RouterMetrics) -> SessionAffinity:
        rule = None
        if config.session_affinity:
            costs = TtftCosts.from_config(config)
            rule = MoveRule(costs, config.session_move_margin, config.dp_routing_max_extra_reqs)
        return cls(metrics, rule, config.session_id_from_user)

    def session_of(self, headers: Mapping[str, str], body: object, path: str) -> SessionRef | None:
        """The session a request names: its headers', else its `user` field's (with
        --session-id-from-user), else, for a Responses API follow-up, its previous
        answer's. A bad value is a 400 naming the header (as the ranks answer it)."""
        fields = body if isinstance(body, dict) else {}
        user = fields.get("user")
        try:
            user_id = user if isinstance(user, str) else None
            session = session_of(headers, user_id, from_user=self.from_user)
        except SessionHeaderError as e:
            raise OpenAIError(400, str(e), "session", "invalid_session") from None
        previous = fields.get("previous_response_id")
        if session is None and path == RESPONSES_PATH and isinstance(previous, str):
            session_id = self.table.session_of_response(previous)
            session = SessionRef(session_id) if session_id is not None else None
        return session

    @staticmethod
    def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
        """The request's session headers, unchanged: the rank reads them too."""
        return {name: headers[name] for name in FORWARDED_HEADERS if name in headers}

    def route(
        self,
        request: RoutingRequest,
        ranks: Sequence[RankView],
        pick: Pick,
        pinned: RoutingDecision | None = None,
    ) -> RoutingDecision:
        """The decode rank of `request`; `ranks` as the policy would see them. `pinned`:
        the rank holding the Responses API answer it continues, which must answer it
        (when it may): the session follows it there."""
        session = request.session
        if session is None or self.rule is None:
            return pinned if pinned is not None else pick(ranks)
        home_url, via_parent = self._home_url(session)
        move: str | None = None
        if pinned is not None:
            decision = pinned
            move = RESPONSE if home_url not in (None, pinned.url) else None
        elif home_url is None:
            decision = pick(ranks)
        else:
            verdict = self.rule.judge(request, ranks, home_url)
            move = verdict.move
            if verdict.rank is not None:
                decision = self._decide(verdict, PARENT if via_parent else KEPT)
            else:
                decision = pick([_hidden(r) if r.url == home_url else r for r in ranks])
        if home_url is None:
            outcome = NEW
        elif move is None:
            outcome = PARENT if via_parent else KEPT
        else:
            outcome = MOVED
            self.metrics.session_moves.labels(move).inc()
        self.metrics.session_routes.labels(outcome).inc()
        self.table.place(session, decision.url)
        return replace(decision, session=outcome if move is None else f"{outcome}:{move}")

    def _home_url(self, session: SessionRef) -> tuple[str | None, bool]:
        """The session's home rank; for a sub-agent's first turn its parent's (True)."""
        home = self.table.home_of(session.session_id)
        if home is None and session.parent_id is not None:
            parent = self.table.home_of(session.parent_id)
            return (parent.rank_url, True) if parent is not None else (None, False)
        return (home.rank_url if home is not None else None), False

    def _decide(self, verdict: Verdict, kept_branch: str) -> RoutingDecision:
        assert verdict.rank is not None
        branch = kept_branch if verdict.move is None else verdict.move
        self.metrics.decisions.labels(Role.DECODE.value, SESSION_POLICY, branch).inc()
        return RoutingDecision(
            verdict.rank.index,
            verdict.rank.url,
            branch,
            verdict.matched_tokens,
            SESSION_POLICY,
            verdict.ttft_s,
        )

    def relayed_response(
        self, response_id: str | None, session: SessionRef | None, rank_url: str
    ) -> None:
        """A Responses API answer `response_id` came from `rank_url`: a follow-up naming
        it is a turn of `session`; a chain that names none is a session of its own, named
        by its first answer (as the ranks name it), at home where that was answered."""
        if response_id is None or self.rule is None:
            return
        if session is None:
            try:
                session = SessionRef(response_id)
            except ValueError:
                return  # not an id a session can have: the chain routes by its home only
            self.table.place(session, rank_url)
        self.table.learn_response(response_id, session.session_id)

    def answered(self, session: SessionRef | None) -> None:
        """A request of `session` was answered (or failed for good): its final turn
        closes it, and the router forgets it."""
        if session is not None and session.final:
            self.table.forget(session.session_id)


def _hidden(rank: RankView) -> RankView:
    return replace(rank, healthy=False)
