"""The router's spans of one forwarded request (docs/tracing.md): its routing decision
(policy, candidates, the ranks chosen, the estimated TTFT and the branch that says why)
and each attempt, whose trace context the decode rank receives."""

from __future__ import annotations

from collections.abc import Sequence

from kvstrata.http.tracing import AttributeValue, Span
from kvstrata.router.attempt import Route
from kvstrata.router.workers import RankState

DECISION_SPAN = "kvstrata.router.decision"
ATTEMPT_SPAN = "kvstrata.router.attempt"
LOCAL = "local"  # the prefill "rank" of a PD route the decode rank prefills itself


def decision_attributes(
    route: Route, candidates: Sequence[RankState], num_prompt_tokens: int
) -> dict[str, AttributeValue]:
    """What the decision span carries; `candidates`: the healthy decode ranks."""
    decision = route.decision
    attributes: dict[str, AttributeValue] = {
        "kvstrata.route.policy": decision.policy,
        "kvstrata.route.branch": decision.branch,
        "kvstrata.route.candidates": [rank.url for rank in candidates],
        "kvstrata.route.decode_url": route.decode.url,
        "kvstrata.route.decode_rank": route.decode.index,
        "kvstrata.route.prefill_url": route.prefill.url if route.prefill is not None else LOCAL,
        "kvstrata.route.matched_tokens": decision.matched_tokens,
        "kvstrata.route.prompt_tokens": num_prompt_tokens,
    }
    if decision.estimated_ttft_s is not None:
        attributes["kvstrata.route.estimated_ttft_s"] = decision.estimated_ttft_s
    if decision.session:  # kept, parent, new or moved:<reason> (session_routing.py)
        attributes["kvstrata.route.session"] = decision.session
    return attributes


def trace_route(
    request_span: Span,
    route: Route,
    candidates: Sequence[RankState],
    num_prompt_tokens: int,
    decided_ns: tuple[int, int],
    attempt: int,
) -> Span:
    """Record the decision, made over `decided_ns` (start, end), under the request's span;
    the attempt's span, started now: its headers go to the decode rank."""
    attributes = decision_attributes(route, candidates, num_prompt_tokens)
    request_span.record(DECISION_SPAN, *decided_ns, attributes)
    return request_span.child(
        ATTEMPT_SPAN,
        {"kvstrata.attempt": attempt, "kvstrata.route.decode_url": route.decode.url},
    )
