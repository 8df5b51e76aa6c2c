"""Plain `mooncake` writes: a write's transfers (one per run of pages consecutive in both
pools, mooncake_plan.py) sent as a sliding window with a bounded amount in flight."""

from __future__ import annotations

import time
from typing import Any

from kvstrata.disagg.transport.base import TransferError
from kvstrata.disagg.transport.mooncake_coalesce import Progress
from kvstrata.disagg.transport.mooncake_engine import COMPLETED, PENDING
from kvstrata.disagg.transport.mooncake_plan import Transfer

# The tcp transport queues at most 1024 slices of 64 KiB per peer (plus 1024 waiting up to
# 1 s) and FAILS what overflows instead of waiting: a write keeps at most this much in
# flight (<= 768 slices; transfers are at most 4 MiB, see mooncake_plan.py).
MAX_INFLIGHT_BYTES = 32 << 20
MAX_INFLIGHT_TRANSFERS = 256
_POLL_S = 0.0002  # between status polls of in-flight transfers


def write_polled(engine: Any, session: str, transfers: list[Transfer], progress: Progress) -> None:
    """Keeps a sliding window of transfers in flight until all settle; polled from Python,
    so each poll needs this thread to get the GIL back. Hands what is still in flight to
    `progress.leave` if abandoned or failed."""
    pending: dict[int, int] = {}  # batch id -> bytes
    num_submitted, inflight_bytes = 0, 0
    error = ""
    try:
        while True:
            while (
                not error
                and not progress.abandoned()
                and num_submitted < len(transfers)
                and len(pending) < MAX_INFLIGHT_TRANSFERS
                and (
                    not pending
                    or inflight_bytes + transfers[num_submitted].num_bytes <= MAX_INFLIGHT_BYTES
                )
            ):
                t = transfers[num_submitted]
                batch_id = engine.transfer_submit_write(session, t.src_ptr, t.dst_ptr, t.num_bytes)
                if batch_id == 0:  # no segment for the session, or the submit was refused
                    error = f"submitting a transfer to {session} failed"
                    break
                pending[batch_id] = t.num_bytes
                inflight_bytes += t.num_bytes
                num_submitted += 1
            for batch_id in list(pending):
                status = engine.transfer_check_status(batch_id)
                if status == PENDING:
                    continue
                inflight_bytes -= pending.pop(batch_id)
                progress.moved()
                if status != COMPLETED:
                    # A _TIMED_OUT batch is not freed by the engine: it leaks (rare, small).
                    error = error or f"a transfer to {session} failed (status {status})"
            if not pending and (error or num_submitted == len(transfers)):
                break
            if progress.abandoned():
                return
            time.sleep(_POLL_S)
    finally:
        progress.leave(list(pending))
    if error:
        raise TransferError(error)
