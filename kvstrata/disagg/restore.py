"""L3 restores beside the PD transfer, on the decode rank: the rooms whose task claimed
pages still being read from L3, and where each such read stands. `ParallelRestore` lets
a task go out while the read runs; `SerialRestore` (the off switch) makes it wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvstrata.core import Request, TierMatch
from kvstrata.engine.kv_manager import RequestKV
from kvstrata.kvcache.tiers import PendingRead


class RestoreSpan(NamedTuple):
    """Pages [first_page, end_page) of a request's chain that its task claims before they
    arrived: they follow its L1 + L2 match and come from an L3 read in flight (empty when
    the read brings nothing beyond the match)."""

    read: PendingRead
    first_page: int
    end_page: int

    @property
    def num_pages(self) -> int:
        return self.end_page - self.first_page


class RestoreOutcome(NamedTuple):
    """A claimed span settled: its request's KV is valid on [0, valid_len)."""

    room: str
    req: Request
    valid_len: int
    claimed_len: int

    @property
    def is_whole(self) -> bool:
        return self.valid_len == self.claimed_len


@dataclass
class _Restore:
    req: Request
    span: RestoreSpan
    l1_page_ids: list[int]  # the request's own pages the span's KV goes into


class L3Restores(Protocol):
    def span_for(self, req: Request, match: TierMatch) -> RestoreSpan | None:
        """The in-flight L3 pages `req`'s task may claim beyond `match`, or None: the
        task waits for its prefetch (called only while it is not ready). Only pages L3
        said it holds are claimed, so a miss is never mistaken for a hole."""
        ...

    def begin(self, room: str, req: Request, span: RestoreSpan) -> None:
        """`req` holds pages for the whole prompt; load the span into them on arrival."""
        ...

    def poll(self) -> list[RestoreOutcome]:
        """Spans that settled since the last call (landed whole, short or timed out)."""
        ...

    def is_pending(self, room: str) -> bool: ...

    def forget(self, room: str) -> None:
        """The room's pages changed hands (abort, failure): load nothing into them."""
        ...

    def count_repair(self, num_tokens: int) -> None:
        """A request recomputes `num_tokens` because claimed pages never came."""
        ...

    def metrics(self) -> dict[str, float]: ...

    def check_integrity(self, rooms: dict[str, Request]) -> list[str]:
        """Violations: a pending span whose room is not one of `rooms` (by room id) or
        whose target pages are not its request's."""
        ...


class SerialRestore:
    """The off switch: a task never claims pages before they arrived."""

    def span_for(self, req: Request, match: TierMatch) -> RestoreSpan | None:
        return None

    def begin(self, room: str, req: Request, span: RestoreSpan) -> None:
        raise AssertionError("SerialRestore claims no span")

    def poll(self) -> list[RestoreOutcome]:
        return []

    def is_pending(self, room: str) -> bool:
        return False

    def forget(self, room: str) -> None:
        pass

    def count_repair(self, num_tokens: int) -> None:
        raise AssertionError("SerialRestore claims no span, so nothing needs repair")

    def metrics(self) -> dict[str, float]:
        return {}

    def check_integrity(self, rooms: dict[str, Request]) -> list[str]:
        return []


class ParallelRestore:
    """Invariant: a pending room's request keeps `num_computed_tokens` at the end of its
    valid KV (its L1 + L2 match); only a settled span moves it, to the first page that did
    not arrive. Pages beyond it are never read as KV before the span settles."""

    def __init__(self, kv: RequestKV, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv = kv
        self.clock = clock  # the prefetch deadlines' clock (tests move it)
        self.page_size = kv.page_size
        self._pending: dict[str, _Restore] = {}  # by room id
        self.num_spans = 0
        self.num_restored_pages = 0
        self.num_missing_pages = 0  # claimed pages that never arrived (repaired)
        self.num_timeouts = 0
        self.num_repairs = 0
        self.num_repaired_tokens = 0

    def span_for(self, req: Request, match: TierMatch) -> RestoreSpan | None:
        read = self.kv.tiers.pending_read(req.rid)
        if read is None or read.num_present is None:
            return None  # L3 has not said what it holds yet (one round trip, no bytes)
        first_page = match.prefix_len // self.page_size
        if first_page < read.first_page:
            return None  # a gap before the read (a tier lost pages): wait as before
        end_page = max(read.first_page + read.num_present, first_page)
        return RestoreSpan(read, first_page, end_page)

    def begin(self, room: str, req: Request, span: RestoreSpan) -> None:
        if span.num_pages == 0:
            return
        assert req.num_computed_tokens == span.first_page * self.page_size
        l1_page_ids = req.page_ids[span.first_page : span.end_page]
        self._pending[room] = _Restore(req, span, l1_page_ids)
        self.num_spans += 1

    def poll(self) -> list[RestoreOutcome]:
        if not self._pending:
            return []
        now_s = self.clock()
        settled: list[RestoreOutcome] = []
        for room, restore in list(self._pending.items()):
            read = restore.span.read
            if read.landed:
                first = restore.span.first_page - read.first_page
                hashes = read.page_hashes[first : first + restore.span.num_pages]
                num_pages = self.kv.tiers.load_into(hashes, restore.l1_page_ids)
            elif read.deadline_s is not None and now_s >= read.deadline_s:
                num_pages = 0  # the read may still land in L2; this request stops waiting
                self.num_timeouts += 1
            else:
                continue
            del self._pending[room]
            settled.append(self._settle(room, restore, num_pages))
        return settled

    def _settle(self, room: str, restore: _Restore, num_pages: int) -> RestoreOutcome:
        req, span = restore.req, restore.span
        restored_len = num_pages * self.page_size
        self.kv.count_restored(req, restored_len)
        self.num_restored_pages += num_pages
        self.num_missing_pages += span.num_pages - num_pages
        return RestoreOutcome(room, req, req.num_computed_tokens, span.end_page * self.page_size)

    def is_pending(self, room: str) -> bool:
        return room in self._pending

    def forget(self, room: str) -> None:
        self._pending.pop(room, None)

    def count_repair(self, num_tokens: int) -> None:
        self.num_repairs += 1
        self.num_repaired_tokens += num_tokens

    def metrics(self) -> dict[str, float]:
        return {
            "pd_parallel_restores": self.num_spans,
            "pd_parallel_restore_pages": self.num_restored_pages,
            "pd_parallel_restore_missing_pages": self.num_missing_pages,
            "pd_parallel_restore_timeouts": self.num_timeouts,
            "pd_parallel_restores_pending": len(self._pending),
            "pd_restore_repairs": self.num_repairs,
            "pd_restore_repaired_tokens": self.num_repaired_tokens,
        }

    def check_integrity(self, rooms: dict[str, Request]) -> list[str]:
        violations = []
        for room, restore in self._pending.items():
            req, span = restore.req, restore.span
            if rooms.get(room) is not req:
                violations.append(f"L3 restore of room {room} has no live room")
            elif req.page_ids[span.first_page : span.end_page] != restore.l1_page_ids:
                violations.append(f"L3 restore of room {room} targets pages not its own")
            elif req.num_computed_tokens != span.first_page * self.page_size:
                violations.append(f"room {room} counts KV of pages still being restored")
        return violations


def make_l3_restores(kv: RequestKV, enabled: bool, has_l3: bool) -> L3Restores:
    """Parallel only where L3 reads exist to run beside a transfer."""
    return ParallelRestore(kv) if enabled and has_l3 else SerialRestore()
