"""The spans of a PD room (docs/tracing.md): on the decode rank, the room's call to its
prefill rank (whose trace context that rank receives); on the prefill rank, the room's
queue wait, its compute and its KV transfer (bytes, GB/s)."""

from __future__ import annotations

import time

from kvstrata.core import RequestOutput
from kvstrata.disagg.protocol import PrefillResult
from kvstrata.disagg.rooms import SentRoom
from kvstrata.http.tracing import Span, wall_ns

ROOM_SPAN = "kvstrata.pd.room"  # decode rank: the /pd/prefill call
PREFILL_REQUEST_SPAN = "kvstrata.pd.prefill"  # prefill rank: the /pd/prefill handler
PREFILL_QUEUE_SPAN = "kvstrata.pd.prefill_queue"
PREFILL_COMPUTE_SPAN = "kvstrata.pd.prefill_compute"
TRANSFER_SPAN = "kvstrata.pd.transfer"


def room_span(parent: Span, room: SentRoom) -> Span:
    """The decode rank's span of one room's call, started now under its request's span."""
    task = room.task
    return parent.child(
        ROOM_SPAN,
        {
            "kvstrata.room": task.room,
            "kvstrata.prefill_url": room.target or "",
            "kvstrata.attempt": len(room.history),
            "kvstrata.prefix_len": task.prefix_len,
            "kvstrata.sent_tokens": len(task.token_ids) - task.prefix_len,
            "kvstrata.pages": len(task.dst_page_ids),
        },
    )


def room_result_attributes(result: PrefillResult) -> dict[str, float | int]:
    return {
        "kvstrata.pages_written": result.num_pages_written,
        "kvstrata.prefill_s": result.prefill_s,
        "kvstrata.send_s": result.send_s,
    }


def record_prefill(
    span: Span,
    submitted_s: float,
    out: RequestOutput,
    first_token_s: float,
    result: PrefillResult,
    page_bytes: int,
) -> None:
    """The prefill rank's spans of one room, once its write settled (now):

    submitted | queue | admitted | compute | first token ...
                                   [now - send_s, now] transfer (it may overlap compute)"""
    admitted_s = out.admitted_s if out.admitted_s is not None else first_token_s
    room = {"kvstrata.room": result.room}
    span.record(PREFILL_QUEUE_SPAN, wall_ns(submitted_s), wall_ns(admitted_s), room)
    computed = room | {
        "kvstrata.prompt_tokens": len(out.prompt_ids),
        "kvstrata.cache.l1_tokens": out.cache_usage.l1_tokens,
        "kvstrata.prefill_cached_tokens": result.prefill_cached_tokens,
    }
    span.record(PREFILL_COMPUTE_SPAN, wall_ns(admitted_s), wall_ns(first_token_s), computed)
    kv_bytes = result.num_pages_written * page_bytes
    gb_per_s = kv_bytes / result.send_s / 1e9 if result.send_s > 0 else 0.0
    end_ns = time.time_ns()
    start_ns = end_ns - round(result.send_s * 1e9)
    moved = room | {
        "kvstrata.transfer.bytes": kv_bytes,
        "kvstrata.transfer.pages": result.num_pages_written,
        "kvstrata.transfer.gb_per_s": gb_per_s,
    }
    span.record(TRANSFER_SPAN, start_ns, end_ns, moved)
