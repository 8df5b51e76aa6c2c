"""Shared vocabulary: the request, its sampling parameters, a scheduled batch and a
step's outputs. Dataclasses (and one NamedTuple) with derived properties only; behaviour
lives in the managers that own state (scheduler, caches, runner)."""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from kvstrata.grammar_spec import GrammarKind, GrammarSpec
from kvstrata.session_ref import SessionRef

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
MAX_LOGPROBS = 20  # the most alternatives a token's logprobs may list (OpenAI's bound)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_CACHE_PRIORITY = 99  # retention priorities are in [0, 99] (SGLang's range)
# repetition_penalty's range: vLLM takes any value > 0, but beyond these a float32 logit
# divided or multiplied by it can overflow to inf (and sampling to NaN).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding options. `temperature == 0` means greedy (exact)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Choices of one prompt (see Engine.add_choices); each choice is its own request.
    n: int = 1
    # Logits adjustments, vLLM's semantics (engine/penalties.py): repetition over prompt
    # and output tokens, presence and frequency over output tokens only.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # no eos or stop token id (nor stop string) before this many tokens
    # Logprobs of each output token (with this many top alternatives); None: not returned.
    logprobs: int | None = None
    # Logprobs of each prompt token after the first (echo); None: not returned.
    prompt_logprobs: int | None = None
    # Output constrained to a grammar (engine/grammar.py): each step samples only tokens
    # the grammar allows (logprobs are of that masked distribution); None: unconstrained.
    grammar: GrammarSpec | None = None
    # How long the request's cached pages should outlive it (kvcache/retention.py, read by
    # --radix-eviction-policy priority): a priority in [0, 99] that falls to 0 once the
    # pages went cache_retention_s without a hit (None: while they are cached).
    cache_priority: int = 0
    cache_retention_s: float | None = None
    # The agent session the request is a turn of (kvcache/sessions.py): between its turns
    # the session's pages keep the paused retention; a sub-agent names its parent; the
    # final turn closes it. Cache placement only: never changes the tokens.
    session: SessionRef | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples so params stay hashable.
        object.__setattr__(self, "stop", _as_tuple(self.stop, str))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, int))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(
            self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias or ()))
        )
        grammar = self.grammar
        if isinstance(grammar, dict):  # as asdict() and JSON carry it (a PD task)
            grammar = GrammarSpec(GrammarKind(grammar["kind"]), str(grammar.get("source", "")))
            object.__setattr__(self, "grammar", grammar)
        if grammar is not None and not isinstance(grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec, got {type(grammar).__name__}")
        self._check_extras()
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def _check_extras(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(
                f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}"
            )
        if any(t < 0 or abs(b) > MAX_LOGIT_BIAS for t, b in self.logit_bias):
            raise ValueError("logit_bias maps token ids >= 0 to values in [-100, 100]")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not 0 <= self.cache_priority <= MAX_CACHE_PRIORITY:
            raise ValueError(
                f"priority must be in [0, {MAX_CACHE_PRIORITY}], got {self.cache_priority}"
            )
        if self.cache_retention_s is not None and not 0 < self.cache_retention_s < math.inf:
            raise ValueError(f"retention_seconds must be > 0, got {self.cache_retention_s}")
        session = self.session
        if isinstance(session, dict):  # as asdict() and JSON carry it (a PD task)
            session = SessionRef(**session)
            object.__setattr__(self, "session", session)
        if session is not None and not isinstance(session, SessionRef):
            raise ValueError(f"session must be a SessionRef, got {type(session).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @functools.cached_property
    def is_plain(self) -> bool:
        """No logits adjustment and no logprobs: the sampler's fast path (cached: it is
        read for every request of every step)."""
        return (
            self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and self.repetition_penalty == 1.0
            and not self.logit_bias
            and self.min_tokens == 0
            and self.logprobs is None
            and self.prompt_logprobs is None
            and self.grammar is None
        )

    @functools.cached_property
    def is_plain_but_grammar(self) -> bool:
        """Plain but for a grammar: the draw, if greedy, is the argmax of the raw logits
        under the grammar's mask (the overlapped step's path)."""
        return self.grammar is not None and replace(self, grammar=None).is_plain

    def masks_every_token(self, eos_token_ids: tuple[int, ...], vocab_size: int) -> bool:
        """Whether min_tokens would mask the whole vocabulary (every id a stop token id or,
        unless ignore_eos, an eos): such a request can never sample, so it is refused."""
        if self.min_tokens == 0:
            return False
        banned = set(self.stop_token_ids)
        if not self.ignore_eos:
            banned.update(eos_token_ids)
        return len({t for t in banned if 0 <= t < vocab_size}) >= vocab_size

    @property
    def is_greedy(self) -> bool:
        # Dividing logits by a temperature this small overflows to inf (NaN probabilities);
        # the distribution is a point mass on the argmax anyway.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def _as_tuple(value: Any, kind: type) -> tuple:
    if isinstance(value, kind):
        return (value,)
    return tuple(value or ())


class TokenLogprobs(NamedTuple):
    """A token's log-probability under the model (raw logits: before penalties, bias and
    temperature, as vLLM reports by default) and the `top` most likely tokens there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class PrefillPath(str, enum.Enum):
    """Where a decode rank's request got its uncached prompt KV (conditional PD)."""

    LOCAL = "local"  # the decode rank prefilled it in its own steps
    REMOTE = "remote"  # a prefill rank computed it and the transport wrote it


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop string or stop token id
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # client went away or the server aborted it


@dataclass
class Request:
    """One generation request and its progress.

    Token regions (indices into `token_ids`):

        [0, num_cached_tokens)            served from the prefix cache at admission
        [num_cached_tokens, num_computed) KV computed by this engine
        [num_computed, len(token_ids))    not yet computed (prompt tail or the last
                                          sampled token, whose KV the next step writes)

    `page_ids` are the L1 pages holding KV for [0, num_computed_tokens), in order. While
    held the list only grows in place; release and (re)admission assign a new list (the
    CUDA-graph runner's persistent page table relies on this to skip unchanged rows).
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float = 0.0
    admitted_s: float | None = None  # monotonic: when it first got pages (left the queue)
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit of the first admission, all tiers
    num_cached_tokens_l2: int = 0  # of which restored from L2 host memory
    num_cached_tokens_l3: int = 0  # of which prefetched from L3 storage
    num_transferred_tokens: int = 0  # PD decode: prompt KV received from a prefill rank
    prefill_path: PrefillPath | None = None  # PD decode: set when the path is chosen
    page_hashes: list[bytes] = field(default_factory=list)  # chained, full pages only
    num_preemptions: int = 0
    page_ids: list[int] = field(default_factory=list)
    cache_handle: CacheHandle | None = None  # its locked prefix path in the prefix cache
    output_text: str = ""  # decoded text, maintained by the detokenizer when present
    # params.logprobs set: entry i belongs to output_ids[i] (the sampler records it)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # params.prompt_logprobs set: entry i belongs to prompt_ids[i + 1]
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


class ScheduledRequest(NamedTuple):
    """Compute tokens [start, start + num_new_tokens) of `request` in this step.

    A NamedTuple rather than a frozen dataclass: one is built per request per step, and
    a tuple is about three times cheaper to build (a 256-request decode step builds 256)."""

    request: Request
    start: int
    num_new_tokens: int
    samples: bool  # the chunk reaches the last known token, so a token is sampled

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True)
class Batch:
    """What the scheduler hands the runner for one step."""

    items: list[ScheduledRequest]

    @property
    def num_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.items)

    @property
    def is_empty(self) -> bool:
        return not self.items


class CacheHandle:
    """Names a path a prefix cache matched (`PrefixMatch.handle`, `Request.cache_handle`).
    Opaque: only the cache that made it reads what it names (kvstrata/kvcache/); everyone
    else passes it back to that cache's contract (`PrefixCache` in kvcache/base.py)."""

    __slots__ = ()


@dataclass(frozen=True)
class PrefixMatch:
    """The longest page-aligned cached prefix of a token sequence in L1.

    `page_ids` are valid only while `handle` is locked in the cache that returned it.
    """

    prefix_len: int
    page_ids: list[int]
    handle: CacheHandle

    @property
    def num_pages(self) -> int:
        return len(self.page_ids)


@dataclass(frozen=True)
class TierMatch:
    """A cached prefix split by tier (DESIGN section 1):

    [0, l1_len)                 L1 pages `l1.page_ids` (valid while `l1.handle` is locked)
    [l1_len, prefix_len)        L2 host pages `host_page_ids`, to load back into L1;
                                `l3_len` tokens of them arrived by L3 prefetch
    """

    l1: PrefixMatch
    host_page_ids: list[int] = field(default_factory=list)
    host_page_hashes: list[bytes] = field(default_factory=list)
    l2_len: int = 0
    l3_len: int = 0

    @property
    def l1_len(self) -> int:
        return self.l1.prefix_len

    @property
    def prefix_len(self) -> int:
        return self.l1.prefix_len + self.l2_len + self.l3_len


@dataclass(frozen=True)
class CacheUsage:
    """Where a request's prompt KV came from instead of being computed: cached tokens per
    tier (L1 device, L2 host, L3 storage), tokens received by PD transfer, and on a decode
    rank the tokens it prefilled itself (conditional disaggregation)."""

    l1_tokens: int = 0
    l2_tokens: int = 0
    l3_tokens: int = 0
    transferred_tokens: int = 0
    local_prefill_tokens: int = 0  # PD decode: prompt KV the decode rank computed itself
    prefill_path: PrefillPath | None = None  # PD decode: local or remote prefill

    @property
    def cached_tokens(self) -> int:
        return self.l1_tokens + self.l2_tokens + self.l3_tokens


class ErrorKind(enum.Enum):
    """Why a request ended in an error, which decides who may try it again."""

    # This rank could not serve it now (no KV pages in time, a PD room failed): another
    # rank, or this one later, may well serve it.
    UNAVAILABLE = "unavailable"
    # The request met an error of its own in the engine (its sampling raised): sent again,
    # it would meet it again. Only this request failed; the engine goes on.
    FAILED = "failed"


@dataclass(frozen=True)
class RequestError:
    """Why a request failed, and of which kind."""

    message: str
    kind: ErrorKind = ErrorKind.UNAVAILABLE


@dataclass(frozen=True)
class RequestOutput:
    """The state of one request after a step, as the offline API and the server see it."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    cache_usage: CacheUsage
    error: RequestError | None = None  # why the request failed, when it did not finish normally
    logprobs: list[TokenLogprobs] | None = None  # of output_ids, when params.logprobs is set
    prompt_logprobs: list[TokenLogprobs] | None = None  # of prompt_ids[1:], when asked for
    admitted_s: float | None = None  # `Request.admitted_s` (request tracing reads it)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from any cache tier (not transferred ones)."""
        return self.cache_usage.cached_tokens
