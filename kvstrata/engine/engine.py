"""The engine loop: schedule -> run the model -> sample -> commit tokens and stops.
Owns the requests of one rank, its L1 pool and prefix cache. Not thread-safe: exactly
one thread drives it (the offline API's caller or the server's engine thread)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstrata.config import EngineConfig
from kvstrata.core import (
    CacheUsage,
    ErrorKind,
    FinishReason,
    PrefillPath,
    Request,
    RequestError,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    TokenLogprobs,
)
from kvstrata.engine.choices import ChoiceForks, choice_params
from kvstrata.engine.grammar import GrammarBook
from kvstrata.engine.grammar_compiler import GrammarCompiler
from kvstrata.engine.load import EngineLoad
from kvstrata.engine.memory import apply_mps_priority, bind_device, make_compute_stream
from kvstrata.engine.parts import EngineParts, resolve_model_source
from kvstrata.engine.request_check import RequestCheck
from kvstrata.engine.role import UNIFIED_ROLES, RoleFactory, RoleParts
from kvstrata.engine.sampler import Sampler
from kvstrata.engine.scheduler import Scheduler
from kvstrata.engine.session_prefetch import SessionPrefetcher
from kvstrata.engine.step_clock import StepClock
from kvstrata.engine.stepper import make_stepper
from kvstrata.engine.stopping import StopChecker
from kvstrata.engine.tp_runner import TPRunner

if TYPE_CHECKING:
    from kvstrata.kvcache.digest_wire import DigestDelta


class Engine:
    """Runs steps over its requests; knows no PD role: `roles` picks the collaborator
    (engine/role.py) that requests enter and leave through, and that the server talks to
    for a role's own commands. A context manager: `close` (at exit) releases what it
    holds. No part of it refers back to it strongly, so a dropped engine is freed by
    reference counting alone, and its L1 pool's memory is given back as it dies even if
    some part outlives it."""

    def __init__(self, config: EngineConfig, roles: RoleFactory = UNIFIED_ROLES) -> None:
        self.config = config = resolve_model_source(config)
        apply_mps_priority(config)  # before this process's CUDA context exists
        parts = EngineParts.build(config, roles)
        self.model_config, self.device, self.dtype = parts.model_config, parts.device, parts.dtype
        self.max_model_len = parts.max_model_len
        self.model, self.tokenizer, self.runner = parts.model, parts.tokenizer, parts.runner
        self.pool, self.shm_path = parts.pool, parts.shm_path
        self._release_pool = weakref.finalize(self, self.pool.release)  # at close or death
        self._release_pool.atexit = False  # the process gives everything back then
        self.allocator, self.tiers, self.kv = parts.allocator, parts.tiers, parts.kv
        self.cache = self.tiers.l1
        self.sessions = parts.sessions  # agent sessions' state (kvcache/sessions.py)
        self.session_prefetch = SessionPrefetcher(self.kv, self.sessions)
        self.scheduler = Scheduler(config, self.kv)
        role_parts = RoleParts(
            config,
            self.kv,
            self.scheduler,
            self.pool,
            self.shm_path,
            parts.num_params,
            self.max_model_len,
            self.model_config.vocab_size,
            parts.tp,
        )
        # The role gets its services through a weak proxy: the engine owns the role, and a
        # strong reference back would be a cycle holding a dropped engine's pool.
        self.role = roles.make_role(role_parts, weakref.proxy(self))
        self.eos_token_ids = eos_ids = parts.eos_token_ids
        make_compiler = None
        if self.tokenizer is not None:  # no closure over the engine: no reference cycle
            make_compiler = functools.partial(
                GrammarCompiler, self.tokenizer, self.model_config.vocab_size, eos_ids
            )
        self.sampler = Sampler(config.scheduler.seed, eos_ids, GrammarBook(make_compiler))
        self.stopper = StopChecker(self.tokenizer, eos_ids, self.max_model_len)
        self.check_request = RequestCheck(
            self.model_config.vocab_size,
            self.max_model_len,
            self.allocator.num_total_pages,
            self.kv.num_pages_for,
            self.tokenizer is not None,
            tuple(eos_ids),
            self.sampler.grammars,
        )
        self.forks = ChoiceForks()
        # Requests that want their prompt's logprobs: while any lives, steps run through
        # `run_with_prompt_rows` (the plain step reads only this set's size).
        self._prompt_logprob_rids: set[str] = set()
        self.requests: dict[str, Request] = {}
        # Each running request's CacheUsage, built at its first token (when it is final:
        # admission and any PD transfer come before) and reused for every later output.
        self._cache_usage: dict[str, CacheUsage] = {}
        self.stepper = make_stepper(config.speed, self)
        self.clock = StepClock()  # host seconds of the steps by part (/metrics)
        self._rid_counter = itertools.count()
        self._closed = False
        # Last: ordered after everything queued above (--compute-stream).
        self.compute_stream = make_compute_stream(config, self.device)

    def bind_thread(self) -> None:
        """Make this engine's device current on the calling thread (the engine thread)."""
        bind_device(self.device, self.compute_stream)

    @property
    def made_progress(self) -> bool:
        """Whether the last step ran a batch (the stepper's to know)."""
        return self.stepper.made_progress

    # -- requests ---------------------------------------------------------------

    @property
    def num_prompt_logprob_requests(self) -> int:
        return len(self._prompt_logprob_rids)

    def new_rid(self) -> str:
        return f"req-{next(self._rid_counter)}"

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None
    ) -> Request:
        """Queue a request; raises ValueError naming the problem for invalid input."""
        self.validate(prompt_ids, params)
        req = self._new_request(prompt_ids, params, rid if rid is not None else self.new_rid())
        self._queue(req)
        return req

    def add_choices(
        self, prompt_ids: list[int], params: SamplingParams, rids: list[str]
    ) -> list[Request]:
        """`len(rids)` choices of one prompt, choice i as request `rids[i]` with its own
        seed (choices.py). Where the role lets them share the prompt (unified), choices
        1.. wait until choice 0 computed it, so they hit its pages in the prefix cache;
        elsewhere each computes (or receives) its own."""
        self.validate(prompt_ids, params)
        if len(set(rids)) != len(rids) or any(rid in self.requests for rid in rids):
            raise ValueError(f"request ids {rids!r} are not all new")
        reqs = [
            self._new_request(prompt_ids, choice_params(params, i), rid)
            for i, rid in enumerate(rids)
        ]
        shares = len(reqs) > 1 and self.role.choices_share_prompt
        for req in reqs[:1] if shares else reqs:
            self._queue(req)
        if shares:
            self.forks.hold(reqs[0], reqs[1:])
        return reqs

    def _new_request(self, prompt_ids: list[int], params: SamplingParams, rid: str) -> Request:
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, list(prompt_ids), params, arrival_s=time.monotonic())
        self.sampler.track(req)  # first: it may refuse the request (its grammar)
        self.requests[rid] = req
        if params.prompt_logprobs is not None:
            self._prompt_logprob_rids.add(rid)
        self.sessions.turn_started(params.session)
        return req

    def _queue(self, req: Request) -> None:
        self.role.add(req)
        self.kv.start_prefetch(req)

    def _release_choices(self, req: Request) -> None:
        """`req` computed its prompt (or ended): queue the choices that waited for it.
        Choice 0 gives its pages to the prefix cache and queues again at the head, so the
        others (behind it) hit the prompt's full pages; it recomputes only its last page."""
        others = self.forks.take(req.rid)
        if (
            others
            and req.status is RequestStatus.RUNNING
            and req.prompt_len >= self.config.pool.page_size
        ):
            self.scheduler.preempt(req)
        for other in others:
            self._queue(other)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run here (any thread)."""
        self.check_request(prompt_ids, params)

    def abort(self, rid: str) -> RequestOutput | None:
        """Stop a request wherever it is and release everything it holds."""
        req = self.requests.get(rid)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return self._output(req, [])

    # -- the loop ---------------------------------------------------------------

    def running_rids(self) -> list[str]:
        """The requests a step may be running now (the scheduler's running set)."""
        return [req.rid for req in self.scheduler.running]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished + self.role.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the requests that produced a token."""
        # Engines on several GPUs (or with their own streams) may share a thread (tests, LLM).
        bind_device(self.device, self.compute_stream)
        self.clock.start()
        self.tiers.poll()
        self.session_prefetch.poll()
        self.clock.lap("tiers")
        self.role.before_step()
        expired = [self._expire(req) for req in self.role.take_expired()]
        self.clock.lap("role")
        outputs = expired + self.stepper.step()
        self.clock.lap("stepper")
        return outputs

    def _expire(self, req: Request) -> RequestOutput:
        waited_s = time.monotonic() - req.arrival_s
        message = f"no KV pages for this request after {waited_s:.0f} s; try again later"
        return self.fail_request(req, message)

    def fail_request(
        self, req: Request, message: str, kind: ErrorKind = ErrorKind.UNAVAILABLE
    ) -> RequestOutput:
        """End `req` (an abort) wherever it is; its final output carries the error."""
        self._finish(req, FinishReason.ABORT)
        return dataclasses.replace(self._output(req, []), error=RequestError(message, kind))

    def commit_token(
        self, req: Request, token_id: int, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        """Record a sampled token of `req` (its KV up to it is computed); stop it if done.
        `logprobs`: the token's, when it was sampled elsewhere (a prefill rank's first
        token), kept if the request asks for them."""
        if logprobs is not None and req.params.logprobs is not None:
            req.output_logprobs.append(logprobs)
        if not self.sampler.grammars.accept(req, token_id):
            # Masked sampling never picks such a token: a prefill rank's first token under
            # another grammar, or a bug. Counted (grammar_rejected_tokens in /metrics).
            kind = req.params.grammar.kind.value if req.params.grammar else "grammar"
            message = f"token {token_id} does not match the request's {kind}"
            return self.fail_request(req, message, ErrorKind.FAILED)
        reason = self.stopper.append(req, token_id)
        if reason is None and self.sampler.grammars.is_complete(req):
            reason = FinishReason.STOP  # the grammar took its stop token: nothing may follow
        if reason is not None:
            self._finish(req, reason)
        else:
            self._release_choices(req)
        return self._output(req, [token_id])

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if self.forks.drop(req):  # a choice still waiting for its choice 0
            self.scheduler.finish_unqueued(req, reason)
        elif self.role.holds(req):
            self.role.drop(req)
            self.scheduler.finish_unqueued(req, reason)
        else:
            kept = self.role.before_release(req, reason)
            self.scheduler.finish(req, reason, release_pages=not kept)
        self.stopper.release(req.rid)
        self.sampler.release(req.rid)
        self._prompt_logprob_rids.discard(req.rid)
        self._cache_usage.pop(req.rid, None)
        del self.requests[req.rid]
        self.sessions.turn_ended(req.params.session)
        self._release_choices(req)

    def _output(self, req: Request, new_token_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            rid=req.rid,
            prompt_ids=req.prompt_ids,
            output_ids=list(req.output_ids),
            new_token_ids=new_token_ids,
            text=self.stopper.visible_text(req),
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            cache_usage=self._cache_usage_of(req),
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
            admitted_s=req.admitted_s,
        )

    def _cache_usage_of(self, req: Request) -> CacheUsage:
        usage = self._cache_usage.get(req.rid)
        if usage is not None:
            return usage
        usage = CacheUsage(
            l1_tokens=req.num_cached_tokens - req.num_cached_tokens_l2 - req.num_cached_tokens_l3,
            l2_tokens=req.num_cached_tokens_l2,
            l3_tokens=req.num_cached_tokens_l3,
            transferred_tokens=req.num_transferred_tokens,
            local_prefill_tokens=(
                req.prompt_len - req.num_cached_tokens
                if req.prefill_path is PrefillPath.LOCAL and req.output_ids
                else 0
            ),
            prefill_path=req.prefill_path,
        )
        if req.output_ids and not req.is_finished:  # final from the first token on
            self._cache_usage[req.rid] = usage
        return usage

    def watch_workers(self, on_lost: Callable[[Exception], None]) -> None:
        """Call `on_lost` (on a watch thread) once a tensor-parallel worker of this rank
        exits before `close`; a TP 1 rank has none to watch."""
        if isinstance(self.runner, TPRunner):
            self.runner.workers.watch(on_lost)

    def close(self) -> None:
        """Release transports, storage connections and the L1 pool's memory; idempotent.
        The engine is not used afterwards. Each part is released even if one before it
        raised; the pool goes last, once no transfer or copy can still touch it."""
        if self._closed:
            return
        self._closed = True
        self.sampler.grammars.close()
        try:
            self.role.close()
        finally:
            try:
                self.tiers.close()
            finally:
                self.runner.close()  # a TP rank's followers stop here
                self._release_pool()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- cache and load -----------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """The cache tiers', the role's, the grammars' and the steps' counters for
        /metrics."""
        parts = self.tiers.metrics() | self.role.metrics() | self.sampler.grammars.metrics()
        kv = {"kv_bytes_per_token": self.pool.page_bytes // self.config.pool.page_size}
        sessions = self.session_prefetch.metrics()
        return parts | self.stepper.metrics() | self.clock.metrics() | kv | sessions

    def flush_cache(self) -> bool:
        """Drop every cached page; refused (False) while requests are in flight."""
        if self.has_unfinished:
            return False
        self.tiers.flush()
        return True

    def cache_digest(
        self, chunk_size: int, epoch: str | None = None, since_version: int | None = None
    ) -> DigestDelta | None:
        """The cache digest at `chunk_size`-token boundaries: the changes since
        (`epoch`, `since_version`), or a full snapshot when those are unknown here. None
        without a prefix cache. Raises ValueError for a chunk size that is not a multiple
        of the page size."""
        digest = self.tiers.digest
        if digest is None:
            return None
        delta = digest.delta_since(chunk_size, epoch, since_version)
        return delta.with_namespace(self.kv.namespace)

    def load(self) -> EngineLoad:
        return EngineLoad(
            num_running_reqs=len(self.scheduler.running),
            num_waiting_reqs=len(self.scheduler.waiting) + self.role.num_unfinished,
            num_queued_tokens=self.scheduler.num_queued_tokens,
            num_free_pages=self.allocator.num_free_pages,
            num_cached_pages=self.cache.num_cached_pages,
            num_total_pages=self.allocator.num_total_pages,
            num_locked_pages=self.cache.num_locked_pages,
            num_pd_rooms=self.role.num_unfinished,
            max_local_prefill_tokens=self.role.max_local_prefill_tokens,
        )
