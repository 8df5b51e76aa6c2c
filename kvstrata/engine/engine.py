"""The engine loop: schedule -> run the model -> sample -> commit tokens and stops.
Owns the requests of one rank, its L1 pool and prefix cache. Not thread-safe: exactly
one thread drives it (the offline API's caller or the server's engine thread)."""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from pathlib import Path

from kvstrata.attention import make_attention_backend
from kvstrata.attention.base import AttentionBackend
from kvstrata.config import ConfigError, EngineConfig
from kvstrata.core import (
    CacheUsage,
    FinishReason,
    PrefillPath,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from kvstrata.disagg.decode import DecodeHandoff, PrefillDispatch
from kvstrata.disagg.factory import make_handoff, pool_storage
from kvstrata.disagg.prefill import PrefillHandoff
from kvstrata.disagg.protocol import PrefillResult, PrefillTask
from kvstrata.disagg.transport.base import TransferError
from kvstrata.engine.choices import ChoiceForks, choice_params
from kvstrata.engine.kv_manager import RequestKV
from kvstrata.engine.memory import (
    bind_device,
    make_compute_stream,
    num_l1_pages,
    resolve_device,
    resolve_dtype,
)
from kvstrata.engine.runner import build_runner
from kvstrata.engine.sampler import Sampler
from kvstrata.engine.scheduler import Scheduler
from kvstrata.engine.stepper import make_stepper
from kvstrata.engine.stopping import StopChecker
from kvstrata.kvcache.digest_wire import DigestDelta
from kvstrata.kvcache.factory import make_tiered_cache, namespace_of
from kvstrata.kvcache.pages import KVPool, PageAllocator
from kvstrata.model.config import ModelConfig
from kvstrata.model.loader import load_model
from kvstrata.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of how busy the engine is and how its L1 pages are used."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_queued_tokens: int
    num_free_pages: int
    num_cached_pages: int
    num_total_pages: int
    num_locked_pages: int = 0  # cached pages pinned by running requests
    num_pd_rooms: int = 0  # decode: handoffs preallocated, in transfer or being released
    max_local_prefill_tokens: int = 0  # decode: uncached tokens it would prefill itself

    @property
    def num_used_pages(self) -> int:
        return self.num_total_pages - self.num_free_pages - self.num_cached_pages


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        config = config.resolved()
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.device = resolve_device(config.device)
        bind_device(self.device)  # for the loads and captures below; step binds again
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config)
        self.max_model_len = self._max_model_len()
        self.model = load_model(config.model, self.dtype, self.device)
        has_tokenizer = (Path(config.model) / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer(config.model) if has_tokenizer else None

        mc = self.model_config
        num_pages = num_l1_pages(config, mc, self.dtype, self.device)
        pool_shape = (mc.num_layers, 2, num_pages, config.page_size, mc.num_kv_heads, mc.head_dim)
        pool_data, self.shm_path = pool_storage(config, pool_shape, self.dtype, self.device)
        self.pool = KVPool(
            num_pages, config.page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim,
            self.dtype, self.device, pool_data,
        )  # fmt: skip
        self.allocator = PageAllocator(num_pages)
        self.tiers = make_tiered_cache(config, self.pool, self.allocator)
        self.cache = self.tiers.l1
        self.kv = RequestKV(
            self.allocator, self.tiers, config.page_size, namespace_of(config, self.dtype)
        )
        self.scheduler = Scheduler(config, self.kv)
        num_params = sum(p.numel() for p in self.model.parameters())
        self.handoff = make_handoff(
            config, self.kv, self.scheduler, self.pool, self.shm_path, num_params,
            self.max_model_len,
        )  # fmt: skip
        self.runner = build_runner(
            config, self.model, self._attention_backend(), self.device, self.max_model_len
        )
        eos_ids = tuple(mc.eos_token_ids) + (self.tokenizer.eos_token_ids if self.tokenizer else ())
        eos_ids = tuple(dict.fromkeys(eos_ids))
        self.sampler = Sampler(config.seed, eos_ids)
        self.stopper = StopChecker(self.tokenizer, eos_ids, self.max_model_len)
        self.forks = ChoiceForks()
        # Requests that want their prompt's logprobs: while any lives, steps run through
        # `run_with_prompt_rows` (the plain step reads only this set's size).
        self._prompt_logprob_rids: set[str] = set()
        self.requests: dict[str, Request] = {}
        # Each running request's CacheUsage, built at its first token (when it is final:
        # admission and any PD transfer come before) and reused for every later output.
        self._cache_usage: dict[str, CacheUsage] = {}
        self.made_progress = False  # whether the last step ran a batch
        self.stepper = make_stepper(config, self)
        self._rid_counter = itertools.count()
        # Last: ordered after everything queued above (--compute-stream).
        self.compute_stream = make_compute_stream(config, self.device)

    def bind_thread(self) -> None:
        """Make this engine's device current on the calling thread (the engine thread)."""
        bind_device(self.device, self.compute_stream)

    def _max_model_len(self) -> int:
        model_len = self.model_config.max_context_len
        if self.config.max_model_len is None:
            return model_len
        if self.config.max_model_len > model_len:
            raise ConfigError(
                f"--max-model-len {self.config.max_model_len} exceeds the model's context "
                f"length {model_len}"
            )
        return self.config.max_model_len

    def _attention_backend(self) -> AttentionBackend:
        config = self.config
        return make_attention_backend(
            config.attention_backend, self.pool, self.device, config.disable_pdl
        )

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
        seed (choices.py). In unified mode choices 1.. wait until choice 0 computed the
        prompt, so they hit its pages in the prefix cache; elsewhere each computes its own."""
        self.validate(prompt_ids, params)
        if len(set(rids)) != len(rids) or any(rid in self.requests for rid in rids):
            raise ValueError(f"request ids {rids!r} are not all new")
        reqs = [self._new_request(prompt_ids, choice_params(params, i), rid)
                for i, rid in enumerate(rids)]  # fmt: skip
        shares = len(reqs) > 1 and self.config.disaggregation_mode == "null"
        for req in reqs[:1] if shares else reqs:
            self._queue(req)
        if shares:
            self.forks.hold(reqs[0], reqs[1:])
        return reqs

    def _new_request(self, prompt_ids: list[int], params: SamplingParams, rid: str) -> Request:
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(rid, list(prompt_ids), params, arrival_s=time.monotonic())
        self.requests[rid] = req
        self.sampler.track(req)
        if params.prompt_logprobs is not None:
            self._prompt_logprob_rids.add(rid)
        return req

    def _queue(self, req: Request) -> None:
        self.handoff.add(req)
        self.kv.start_prefetch(req)

    def _release_choices(self, req: Request) -> None:
        """`req` computed its prompt (or ended): queue the choices that waited for it.
        Choice 0 gives its pages to the prefix cache and queues again at the head, so the
        others (behind it) hit the prompt's full pages; it recomputes only its last page."""
        others = self.forks.take(req.rid)
        if (
            others
            and req.status is RequestStatus.RUNNING
            and req.prompt_len >= self.config.page_size
        ):
            self.scheduler.preempt(req)
        for other in others:
            self._queue(other)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the request can never run here. Reads only facts fixed at
        construction (vocabulary, context length, pool size), so any thread may call it."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        total_len = len(prompt_ids) + params.max_tokens
        if total_len > self.max_model_len:
            raise ValueError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"is longer than the context length ({self.max_model_len} tokens)"
            )
        if self.kv.num_pages_for(total_len) > self.allocator.num_total_pages:
            raise ValueError(
                f"the request needs {self.kv.num_pages_for(total_len)} KV pages; the pool "
                f"holds {self.allocator.num_total_pages}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        ids = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
        if any(t >= vocab_size for t in ids):
            raise ValueError(
                f"a logit_bias or stop_token_ids token id is outside the vocabulary "
                f"[0, {vocab_size})"
            )

    def abort(self, rid: str) -> RequestOutput | None:
        """Stop a request wherever it is and release everything it holds."""
        req = self.requests.get(rid)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return self._output(req, [])

    # -- the loop ---------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished + self.handoff.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the requests that produced a token."""
        # Engines on several GPUs (or with their own streams) may share a thread (tests, LLM).
        bind_device(self.device, self.compute_stream)
        self.tiers.poll()
        self.handoff.before_step()
        expired = [self._expire(req) for req in self.handoff.take_expired()]
        return expired + self.stepper.step()

    def _expire(self, req: Request) -> RequestOutput:
        waited_s = time.monotonic() - req.arrival_s
        self._finish(req, FinishReason.ABORT)
        message = f"no KV pages for this request after {waited_s:.0f} s; try again later"
        return dataclasses.replace(self._output(req, []), error=message)

    def commit_token(self, req: Request, token_id: int) -> RequestOutput:
        """Record a sampled token of `req` (its KV up to it is computed); stop it if done."""
        reason = self.stopper.append(req, token_id)
        if reason is not None:
            self._finish(req, reason)
        else:
            self._release_choices(req)
        return self._output(req, [token_id])

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if self.forks.drop(req):  # a choice still waiting for its choice 0
            req.status, req.finish_reason = RequestStatus.FINISHED, reason
        elif self.handoff.holds(req):
            self.handoff.drop(req)
            req.status, req.finish_reason = RequestStatus.FINISHED, reason
        else:
            kept = self.handoff.before_release(req, reason)
            self.scheduler.finish(req, reason, release_pages=not kept)
        self.stopper.release(req.rid)
        self.sampler.release(req.rid)
        self._prompt_logprob_rids.discard(req.rid)
        self._cache_usage.pop(req.rid, None)
        del self.requests[req.rid]
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

    # -- PD disaggregation (disagg/): one side of a prefill/decode pair --------------

    def add_prefill_task(self, task: PrefillTask, rid: str | None = None) -> Request:
        """Prefill mode: compute the task's prompt; its only output is the first token,
        and the decode rank's missing pages are written before its pages are released."""
        assert isinstance(self.handoff, PrefillHandoff), "not a prefill rank"
        params = SamplingParams(**{**task.sampling, "max_tokens": 1})
        req = self.add_request(task.token_ids, params, rid=rid)
        self.handoff.track(req, task)
        return req

    def collect_prefill_result(self, rid: str) -> PrefillResult:
        assert isinstance(self.handoff, PrefillHandoff), "not a prefill rank"
        return self.handoff.collect(rid)

    def take_prefill_tasks(self) -> list[PrefillTask]:
        """`take_prefill_dispatch`'s rooms, for a caller that runs no dispatcher (the
        requests prefilled here need nothing from it)."""
        return self.take_prefill_dispatch().tasks

    def take_prefill_dispatch(self) -> PrefillDispatch:
        """Decode mode: the handoffs preallocated since the last call, to send out, and
        the requests this rank took to prefill itself."""
        assert isinstance(self.handoff, DecodeHandoff), "not a decode rank"
        return self.handoff.take_dispatch()

    def complete_transfer(self, result: PrefillResult) -> RequestOutput:
        """Decode mode: the room's KV arrived; the request starts decoding from the
        prefill rank's first token. Raises TransferError if the handoff is inconsistent."""
        assert isinstance(self.handoff, DecodeHandoff), "not a decode rank"
        if not 0 <= result.first_token_id < self.model_config.vocab_size:
            raise TransferError(
                f"room {result.room}: first token id {result.first_token_id} is outside the "
                f"vocabulary [0, {self.model_config.vocab_size})"
            )
        waiting = self.handoff.request_in(result.room)
        record = result.first_token_logprobs
        if (
            waiting is not None
            and waiting.params.logprobs is not None
            and (record is None or record.token_id != result.first_token_id)
        ):
            raise TransferError(f"room {result.room}: no logprobs for the first token")
        req = self.handoff.complete(result)
        if req.params.logprobs is not None and record is not None:
            req.output_logprobs.append(record)
        reason = self.stopper.append(req, result.first_token_id)
        if reason is not None:
            self._finish(req, reason)
        return self._output(req, [result.first_token_id])

    def fail_room(self, room: str, message: str) -> RequestOutput | None:
        """Decode mode: the room's transfer failed; the request ends with `message`. Its
        pages stay held until `release_room`."""
        assert isinstance(self.handoff, DecodeHandoff), "not a decode rank"
        req = self.handoff.request_in(room)
        if req is None:
            return None
        self._finish(req, FinishReason.ABORT)
        return dataclasses.replace(self._output(req, []), error=message)

    def requeue_room(self, room: str, path: PrefillPath) -> bool:
        """Decode mode: the room failed; its request starts again on `path` (a new room,
        or prefilled here) while the room's pages wait for `release_room`. False if the
        room's request is gone."""
        assert isinstance(self.handoff, DecodeHandoff), "not a decode rank"
        return self.handoff.requeue(room, path)

    def release_room(self, room: str) -> bool:
        """Decode mode: the prefill rank of an abandoned room will not write any more
        (it acknowledged the abort, finished, or died): free the room's pages."""
        assert isinstance(self.handoff, DecodeHandoff), "not a decode rank"
        return self.handoff.release_room(room)

    def close(self) -> None:
        """Release transports and storage (the engine is not used afterwards)."""
        self.handoff.close()
        self.tiers.close()

    # -- cache and load -----------------------------------------------------------

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
            num_waiting_reqs=len(self.scheduler.waiting) + self.handoff.num_unfinished,
            num_queued_tokens=self.scheduler.num_queued_tokens,
            num_free_pages=self.allocator.num_free_pages,
            num_cached_pages=self.cache.num_cached_pages,
            num_total_pages=self.allocator.num_total_pages,
            num_locked_pages=self.cache.num_locked_pages,
            num_pd_rooms=self.handoff.num_unfinished,
            max_local_prefill_tokens=self.handoff.max_local_prefill_tokens,
        )
