"""How an engine step runs a batch: `SyncStepper` (schedule, run, read the sampled tokens,
commit them) and `OverlapStepper`, which launches decode step N+1 from step N's tokens
still on the device before reading them, so the host side of a step (reading tokens,
stop checks, outputs, scheduling, input building) runs while the GPU computes the next.
`make_stepper` picks one (`--overlap-schedule`)."""

from __future__ import annotations

import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvstrata.core import Batch, ErrorKind, RequestOutput, RequestStatus, ScheduledRequest
from kvstrata.engine.sampler import RowFailure

if TYPE_CHECKING:
    from kvstrata.config.sections import SpeedOptions
    from kvstrata.engine.engine import Engine


class Stepper(Protocol):
    @property
    def made_progress(self) -> bool:
        """Whether the last step ran a batch."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run one step; return the requests that produced a token."""
        ...

    def metrics(self) -> dict[str, float]:
        """Steps by how they ran (for /metrics: where decode time goes)."""
        ...


class SyncStepper:
    """One batch at a time: its tokens are on the host before the next is scheduled."""

    def __init__(self, engine: Engine) -> None:
        # A weak proxy: the engine owns its stepper, so a strong reference back would be
        # a cycle that keeps a dropped engine (and its KV pool) until a full collection.
        self.engine: Engine = weakref.proxy(engine)
        self.made_progress = False
        self.num_steps = 0  # batches run here
        self.num_decode_steps = 0  # of which every item decoded one token

    def metrics(self) -> dict[str, float]:
        return {"steps_sync": self.num_steps, "steps_sync_decode_only": self.num_decode_steps}

    def step(self) -> list[RequestOutput]:
        batch = self.engine.scheduler.schedule()
        self.made_progress = not batch.is_empty
        return self.run(batch) if not batch.is_empty else []

    def run(self, batch: Batch) -> list[RequestOutput]:
        engine = self.engine
        start_s = time.perf_counter()
        self.num_steps += 1
        self.num_decode_steps += all(item.num_new_tokens == 1 for item in batch.items)
        engine.kv.before_batch(batch.items)
        engine.role.before_forward(batch)
        failures: list[RowFailure] = []
        if engine.num_prompt_logprob_requests:
            logits, prompt_rows = engine.runner.run_with_prompt_rows(batch)
            failures += engine.sampler.record_prompt_logprobs(prompt_rows, engine.runner.logits_of)
        else:
            logits = engine.runner.run(batch)
        sampling = [item.request for item in batch.items if item.samples]
        sampled = engine.sampler.sample(logits, sampling)  # on the host: the step is done
        engine.role.observe_step(batch, time.perf_counter() - start_s)
        for item in batch.items:
            engine.kv.mark_computed(item.request, item.end)
        failed = {id(f.request): f for f in failures + sampled.failures}
        outputs = [
            engine.fail_request(f.request, f.message, ErrorKind.FAILED) for f in failed.values()
        ]
        for req, token_id in zip(sampled.requests, sampled.token_ids):
            if id(req) not in failed:
                outputs.append(engine.commit_token(req, token_id))
        return outputs


@dataclass
class _Launched:
    """A decode step on its way: one greedy token per item, not yet read on the host."""

    items: list[ScheduledRequest]
    tokens: torch.Tensor  # int64 [len(items)] on the device: the next step's input ids
    tokens_host: torch.Tensor  # where `tokens` is copied without blocking (pinned on CUDA)
    ready: torch.cuda.Event | None  # fires once `tokens_host` holds them (None on CPU)


class OverlapStepper:
    """Keeps one decode step in flight. Step N+1 is launched only for exactly the requests
    of step N, all still running, none of which can reach a length limit at N (so it is
    known on the host that each needs one more token), and only with every page already
    granted; anything else (admissions, prefill chunks, preemption, sampling that is not
    greedy) goes through `SyncStepper` once step N is read. Greedy rows under a grammar
    overlap too: N+1's forward is launched first, then N is read (its tokens advance the
    matchers) while it runs, then N+1's mask is filled and its tokens drawn.

    Invariant: a request that stops at N (eos, stop string) or is aborted while N+1 is in
    flight only loses N+1's token, which is discarded. N+1 writes the KV of position
    `N.end`, past every full page that `release` hands to the prefix cache, and it runs on
    the compute stream before any later use of the pages freed meanwhile."""

    def __init__(self, engine: Engine, sync: SyncStepper) -> None:
        self.engine: Engine = weakref.proxy(engine)  # as SyncStepper's: no cycle
        self.sync = sync
        self.pending: _Launched | None = None
        self.made_progress = False
        self.num_overlapped_steps = 0  # steps launched before the previous one was read
        # Why a decode step was not followed by an overlapped one (its next step then
        # goes through the synchronous path): where overlap is lost.
        self.no_follow: Counter[str] = Counter()

    def metrics(self) -> dict[str, float]:
        counts = {f"overlap_lost_{why}": float(n) for why, n in self.no_follow.items()}
        return self.sync.metrics() | counts | {"steps_overlapped": self.num_overlapped_steps}

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        if self.pending is None:
            batch = engine.scheduler.schedule()
            self.made_progress = not batch.is_empty
            if batch.is_empty:
                return []
            if not self._overlappable(batch.items) or not self._plain(batch.items):
                return self.sync.run(batch)
            engine.kv.before_batch(batch.items)
            self.pending = self._launch(batch.items, engine.runner.run(batch))
        launched = self.pending
        follow = self._follow_up(launched)
        self.pending = None
        self.made_progress = True
        if follow is None:
            return self._resolve(launched)
        logits = engine.runner.run_decode(follow, launched.tokens)
        self.num_overlapped_steps += 1
        if engine.sampler.grammars.num_tracked:
            # N+1's mask needs N's tokens in the matchers: read N while N+1's forward runs,
            # then mask and draw N+1 (a row that stopped at N is released: left unmasked,
            # its token is discarded).
            outputs = self._resolve(launched)
            self.pending = self._launch(follow, logits)
            return outputs
        self.pending = self._launch(follow, logits)
        return self._resolve(launched)

    @staticmethod
    def _overlappable(items: list[ScheduledRequest]) -> bool:
        return all(
            item.num_new_tokens == 1 and item.samples and item.request.params.is_greedy
            for item in items
        )

    def _plain(self, items: list[ScheduledRequest]) -> bool:
        """No adjustment or logprobs: the argmax of the raw logits, under its grammar's
        mask if it has one, is each item's token. One check while no request of the engine
        needs them."""
        if not self.engine.sampler.num_adjusted:
            return True
        return all(
            item.request.params.is_plain or item.request.params.is_plain_but_grammar
            for item in items
        )

    def _launch(self, items: list[ScheduledRequest], logits: torch.Tensor) -> _Launched:
        """Draw the items' tokens from `logits` (masked in place by their grammars, whose
        matchers have taken every earlier token) without waiting for them."""
        grammars = self.engine.sampler.grammars
        if grammars.num_tracked:
            grammars.mask([item.request for item in items], logits)
        tokens = logits.argmax(dim=-1)
        if not tokens.is_cuda:
            return _Launched(items, tokens, tokens, None)
        tokens_host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        tokens_host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Launched(items, tokens, tokens_host, ready)

    def _follow_up(self, launched: _Launched) -> list[ScheduledRequest] | None:
        """Step N+1's items (same requests and order as N), or None if it cannot go yet."""
        engine = self.engine
        scheduler = engine.scheduler
        if scheduler.waiting or len(scheduler.running) != len(launched.items):
            # someone else wants the step: schedule it normally after N
            return self._lost("waiting" if scheduler.waiting else "batch_changed")
        max_model_len = engine.max_model_len
        follow = []
        for item in launched.items:
            req = item.request
            if req.status is not RequestStatus.RUNNING or req.num_computed_tokens != item.start:
                return self._lost("not_running")
            num_outputs_after = req.num_output_tokens + 1
            if num_outputs_after >= req.params.max_tokens or req.num_tokens + 1 >= max_model_len:
                return self._lost("length")
            follow.append(ScheduledRequest(req, item.end, 1, True))
        for item in follow:
            if not engine.kv.try_grow(item.request, item.start + 1):
                # pages grown so far stay with their requests: used next step
                return self._lost("pages")
        return follow

    def _lost(self, why: str) -> list[ScheduledRequest] | None:
        """No follow-up (None), counted by why."""
        self.no_follow[why] += 1
        return None

    def _resolve(self, launched: _Launched) -> list[RequestOutput]:
        if launched.ready is not None:
            launched.ready.synchronize()
        token_ids = launched.tokens_host.tolist()
        outputs = []
        for item, token_id in zip(launched.items, token_ids):
            req = item.request
            if req.status is not RequestStatus.RUNNING or req.num_computed_tokens != item.start:
                continue  # stopped or aborted after this step was launched
            self.engine.kv.mark_computed(req, item.end)
            outputs.append(self.engine.commit_token(req, token_id))
        return outputs


def make_stepper(config: SpeedOptions, engine: Engine) -> Stepper:
    """`--overlap-schedule auto` overlaps where host time is worth hiding: CUDA graphs on."""
    sync = SyncStepper(engine)
    mode = config.overlap_schedule
    if mode == "auto":
        mode = "on" if engine.device.type == "cuda" and not config.disable_cuda_graph else "off"
    return OverlapStepper(engine, sync) if mode == "on" else sync
