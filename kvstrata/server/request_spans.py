"""A rank's spans of one generation request (docs/tracing.md): the request's own span
(under the router's attempt, by `traceparent`) and, per engine request as its first token
arrives, its queue wait, prefix match per tier with the local-prefill decision, its
L3 restore and its prefill, from the timestamps the engine thread recorded."""

from __future__ import annotations

import time

from kvstrata.core import RequestOutput
from kvstrata.http.tracing import AttributeValue, Span, wall_ns
from kvstrata.runtime.request_group import RequestGroup

REQUEST_SPAN = "kvstrata.rank.request"
QUEUE_SPAN = "kvstrata.rank.queue"
PREFIX_MATCH_SPAN = "kvstrata.rank.prefix_match"
L3_RESTORE_SPAN = "kvstrata.rank.l3_restore"
PREFILL_SPAN = "kvstrata.rank.prefill"
UNIFIED = "unified"  # the prefill path of a request on a rank without PD


def prefix_attributes(out: RequestOutput) -> dict[str, AttributeValue]:
    """Where the request's prompt KV came from: cached per tier, transferred from a prefill
    rank, or computed here (a decode rank's local-prefill decision: `prefill_path`)."""
    usage = out.cache_usage
    path = usage.prefill_path.value if usage.prefill_path is not None else UNIFIED
    return {
        "kvstrata.rid": out.rid,
        "kvstrata.prompt_tokens": len(out.prompt_ids),
        "kvstrata.cache.l1_tokens": usage.l1_tokens,
        "kvstrata.cache.l2_tokens": usage.l2_tokens,
        "kvstrata.cache.l3_tokens": usage.l3_tokens,
        "kvstrata.transferred_tokens": usage.transferred_tokens,
        "kvstrata.local_prefill_tokens": usage.local_prefill_tokens,
        "kvstrata.prefill_path": path,
    }


def record_first_token(span: Span, submitted_s: float, out: RequestOutput) -> None:
    """The spans of one engine request, recorded as its first token arrives:

    submitted | queue | admitted (prefix matched, pages attached) | prefill | first token
    The L3 prefetch runs while the request queues: its span covers the queue."""
    first_token_s = time.monotonic()
    admitted_s = out.admitted_s if out.admitted_s is not None else first_token_s
    submitted, admitted = wall_ns(submitted_s), wall_ns(admitted_s)
    rid = {"kvstrata.rid": out.rid}
    span.record(QUEUE_SPAN, submitted, admitted, rid)
    attributes = prefix_attributes(out)
    span.record(PREFIX_MATCH_SPAN, admitted, admitted, attributes)
    if out.cache_usage.l3_tokens:
        restored = rid | {"kvstrata.cache.l3_tokens": out.cache_usage.l3_tokens}
        span.record(L3_RESTORE_SPAN, submitted, admitted, restored)
    path = {"kvstrata.prefill_path": attributes["kvstrata.prefill_path"]}
    span.record(PREFILL_SPAN, admitted, wall_ns(first_token_s), rid | path)


def trace_group(span: Span, group: RequestGroup) -> None:
    """Record each request of `group` under `span` as it gets its first token; end `span`
    when the group is closed."""
    submitted_s = time.monotonic()
    group.call_on_first_token(lambda out: record_first_token(span, submitted_s, out))
    group.call_on_close(span.end)
