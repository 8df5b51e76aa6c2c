"""Admission, batching, chunked prefill and preemption. There are no prefill or decode
phases: each request's computed tokens catch up to its known tokens, and every step
hands out token counts under one budget (decodes first, then prefill chunks, then new
requests in FIFO order). Owns every request's status and preemption count; a request's
pages and computed tokens are the KV manager's (kv_manager.py)."""

from __future__ import annotations

from collections import deque

from kvstrata.config import EngineConfig
from kvstrata.core import Batch, FinishReason, Request, RequestStatus, ScheduledRequest
from kvstrata.engine.kv_manager import RequestKV


class Scheduler:
    def __init__(self, config: EngineConfig, kv: RequestKV) -> None:
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.max_prefill_tokens = config.max_prefill_tokens_per_step
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.chunked_prefill = config.scheduler.enable_chunked_prefill
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_queued_tokens(self) -> int:
        """Tokens still to compute for queued requests (their prompts, uncached part unknown)."""
        return sum(req.num_tokens - req.num_computed_tokens for req in self.waiting)

    @property
    def num_prefill_tokens_left(self) -> int:
        """Prompt tokens not computed yet: queued requests' and running prefill chunks'."""
        running = sum(
            left for req in self.running if (left := req.num_tokens - req.num_computed_tokens) > 1
        )
        return self.num_queued_tokens + running

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """`req`'s whole prompt KV is in its pages, written from outside (a PD transfer):
        it joins the running batch, and its next step is a decode."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def recompute(self, req: Request) -> None:
        """`req`, holding no pages, lost KV it was promised from outside (an L3 read that
        never came): queue it to be computed again, counted as a preemption of the request
        (its usage keeps what its first attach found), not as one of this scheduler's."""
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.add(req)

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        items: list[ScheduledRequest] = []
        # Decodes first: they are cheap and hold the latency users see between tokens.
        # A decode has one token left (its last sample): it computes and samples it.
        chunks: list[Request] = []  # running requests with more than one token left
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted by an earlier request of this loop
            if req.num_tokens - req.num_computed_tokens != 1:
                chunks.append(req)
            elif self._grow_or_preempt(req, 1, items):
                items.append(ScheduledRequest(req, req.num_computed_tokens, 1, samples=True))
                budget -= 1
        # Then prefill chunks, in running order: under their own budget beside decodes
        # (whose pace it keeps), under the step's alone.
        prefill_budget = self.max_prefill_tokens if items else budget
        for req in chunks:
            if min(budget, prefill_budget) <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            num_left = req.num_tokens - req.num_computed_tokens
            num_new = self._chunk(num_left, min(budget, prefill_budget), alone=not items)
            if num_new == 0 or not self._grow_or_preempt(req, num_new, items):
                continue
            items.append(self._item(req, num_new))
            budget -= num_new
            prefill_budget -= num_new
        admitted: list[Request] = []
        for req in list(self.waiting):
            if min(budget, prefill_budget) <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not self.kv.prefetch_ready(req):
                continue  # still waiting for L3: not a capacity question, others may go
            match = self.kv.match(req)
            num_left = req.num_tokens - match.prefix_len
            num_new = self._chunk(num_left, min(budget, prefill_budget), alone=not items)
            # Keep a page per running request free so admissions do not force preemptions.
            if num_new == 0 or not self.kv.try_attach(
                req, match, match.prefix_len + num_new, reserve_pages=len(self.running)
            ):
                break  # FIFO: nothing overtakes a request that waits for room
            admitted.append(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            items.append(self._item(req, num_new))
            budget -= num_new
            prefill_budget -= num_new
        for req in admitted:
            self.waiting.remove(req)
        return Batch(items)

    def _chunk(self, num_left: int, budget: int, alone: bool) -> int:
        if self.chunked_prefill:
            return min(num_left, budget)
        # Unchunked: the whole remainder must fit, unless it runs alone in the step.
        return num_left if num_left <= budget or alone else 0

    def _item(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        return ScheduledRequest(req, start, num_new, samples=start + num_new == req.num_tokens)

    def _grow_or_preempt(
        self, req: Request, num_new: int, scheduled: list[ScheduledRequest]
    ) -> bool:
        """Get pages for `req`'s next chunk, preempting the newest running requests not
        yet in this step's batch (possibly `req` itself) until they fit. Pinned requests
        (a transfer reads their pages) are never preempted: with only those left, `req`
        waits for a later step."""
        while not self.kv.try_grow(req, req.num_computed_tokens + num_new):
            in_batch = {id(item.request) for item in scheduled}
            victim = next(
                (
                    r
                    for r in reversed(self.running)
                    if id(r) not in in_batch and not self.kv.is_pinned(r)
                ),
                None,
            )
            if victim is None:
                return False
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request) -> None:
        """Free `req`'s pages (its computed KV stays in the prefix cache while it lasts)
        and put it back at the head of the queue to be recomputed."""
        self.kv.release(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: FinishReason, release_pages: bool = True) -> None:
        """Take `req` out; its pages go back to the cache unless the caller keeps them
        (and releases them through `kv` later)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            if release_pages:
                self.kv.release(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
            self.kv.forget(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def held_requests(self) -> list[tuple[str, Request]]:
        """(place, request) for every request queued or running here."""
        return [("running", r) for r in self.running] + [("waiting", r) for r in self.waiting]

    @property
    def counts(self) -> dict[str, int]:
        return {"running": len(self.running), "waiting": len(self.waiting)}

    def check_integrity(self) -> list[str]:
        """Running requests are RUNNING, waiting ones WAITING and hold no pages or lock."""
        violations = [
            f"scheduler: running request {r.rid} is {r.status.value}"
            for r in self.running
            if r.status is not RequestStatus.RUNNING
        ]
        for req in self.waiting:
            if req.status is not RequestStatus.WAITING:
                violations.append(f"scheduler: waiting request {req.rid} is {req.status.value}")
            if req.page_ids or req.cache_handle:
                violations.append(f"waiting request {req.rid} holds pages or a lock")
        return violations

    def finish_unqueued(self, req: Request, reason: FinishReason) -> None:
        """A request that never reached this scheduler (held by the role or waiting for
        its first choice) ended: only its status changes."""
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
