"""Turns validated request bodies into engine inputs: prompt token ids (chat template,
tokenization) and SamplingParams, checked against this rank's limits (characters before
tokenizing, tokens after) so that a request that reaches the engine can run. Defaults for
an absent max_tokens live here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstrata.config.costs import (
    ANSWER_BYTES_PER_LOGPROB,
    ANSWER_BYTES_PER_TOKEN,
    REQUEST_TOKENS_PER_POOL,
    RequestCosts,
)
from kvstrata.config.limits import CHARS_PER_TOKEN_BOUND, PromptBounds
from kvstrata.core import SamplingParams
from kvstrata.http.errors import OpenAIError
from kvstrata.http.grammar_inputs import request_grammar
from kvstrata.http.protocol import (
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    NativeSamplingParams,
    OpenAISampling,
)

if TYPE_CHECKING:
    from kvstrata.config import ServerConfig
    from kvstrata.model.tokenizer import Tokenizer

# max_tokens when a request leaves it out (always capped by the room left in the context):
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
# Chat has no fixed default: the rest of the context, as OpenAI and vLLM do.


@dataclass(frozen=True)
class RequestLimits:
    """What every request must fit on this rank; fixed at start-up."""

    vocab_size: int
    max_seq_len: int  # longest prompt + output: the context length, capped by the KV pool
    eos_token_ids: tuple[int, ...] = ()
    pool_tokens: int = 0  # tokens the L1 pool holds

    def check_cost(
        self, prompt_lens: Sequence[int], params: SamplingParams, costs: RequestCosts
    ) -> None:
        """After tokenizing: the whole request's KV tokens and its answer's estimated size
        within --max-request-tokens and --max-response-bytes (400 naming the flag)."""
        num_tokens = sum(prompt_lens) + len(prompt_lens) * params.n * params.max_tokens
        max_tokens = costs.max_request_tokens or REQUEST_TOKENS_PER_POOL * self.pool_tokens
        if num_tokens > max_tokens:
            raise OpenAIError(
                400,
                f"the request asks for {num_tokens} KV tokens (its prompts plus n x "
                f"max_tokens each); this server takes at most {max_tokens} per request "
                "(--max-request-tokens): lower n or max_tokens, or split the prompts",
                "max_tokens",
                "request_too_large",
            )
        num_bytes = answer_bytes(prompt_lens, params)
        if num_bytes > costs.max_response_bytes:
            raise OpenAIError(
                400,
                f"the answer could reach {num_bytes} bytes (n x max_tokens per prompt, "
                f"with logprobs); this server answers at most {costs.max_response_bytes} "
                "(--max-response-bytes): lower n, max_tokens or the logprobs asked for",
                "max_tokens",
                "response_too_large",
            )

    def prompt_bounds(self, config: ServerConfig) -> PromptBounds:
        """--max-prompt-tokens (default: the context, less one output token) and the body
        and character limits that follow from it."""
        max_prompt_tokens = config.max_prompt_tokens or self.max_seq_len - 1
        return PromptBounds.derive(max_prompt_tokens, config.max_body_bytes)

    def check_prompt(
        self, prompt_ids: Sequence[int], param: str, bounds: PromptBounds | None = None
    ) -> None:
        if not prompt_ids:
            raise OpenAIError(400, "the prompt is empty", param, "empty_prompt")
        if bounds is not None and len(prompt_ids) > bounds.max_prompt_tokens:
            raise OpenAIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; this server accepts at most "
                f"{bounds.max_prompt_tokens} (--max-prompt-tokens)",
                param,
                "prompt_too_long",
            )
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise OpenAIError(
                400,
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                param,
                "invalid_token_id",
            )
        if len(prompt_ids) >= self.max_seq_len:
            raise OpenAIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; this model's context holds "
                f"{self.max_seq_len} tokens including at least one output token",
                param,
                "context_length_exceeded",
            )

    def max_tokens(
        self, prompt_lens: Sequence[int], requested: int | None, default: int | None
    ) -> int:
        """The output budget shared by prompts of these lengths. An explicit value must fit
        the context after every prompt; a default is capped to fit (None: all the room)."""
        room = self.max_seq_len - max(prompt_lens)
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise OpenAIError(
                400,
                f"the prompt ({max(prompt_lens)} tokens) plus max_tokens ({requested}) is "
                f"longer than the context length ({self.max_seq_len} tokens)",
                "max_tokens",
                "context_length_exceeded",
            )
        return requested


def check_num_prompts(num_prompts: int, n: int, costs: RequestCosts) -> None:
    """Before tokenizing: at most --max-prompts-per-request prompts, and prompts x n at
    most --max-choices-per-request engine requests."""
    if num_prompts > costs.max_prompts_per_request:
        raise OpenAIError(
            400,
            f"the request lists {num_prompts} prompts; this server takes at most "
            f"{costs.max_prompts_per_request} (--max-prompts-per-request)",
            "prompt",
            "too_many_prompts",
        )
    if num_prompts * n > costs.max_choices_per_request:
        raise OpenAIError(
            400,
            f"{num_prompts} prompt(s) x n {n} is {num_prompts * n} choices; this server "
            f"makes at most {costs.max_choices_per_request} per request "
            "(--max-choices-per-request)",
            "n",
            "too_many_choices",
        )


def answer_bytes(prompt_lens: Sequence[int], params: SamplingParams) -> int:
    """An upper estimate of the answer's size: n x max_tokens tokens per prompt, each with
    its logprob alternatives, and the echoed prompt's tokens with theirs."""
    per_token = ANSWER_BYTES_PER_TOKEN
    if params.logprobs is not None:
        per_token += ANSWER_BYTES_PER_LOGPROB * (params.logprobs + 1)
    per_prompt_token = 0
    if params.prompt_logprobs is not None:
        per_prompt_token = ANSWER_BYTES_PER_TOKEN + ANSWER_BYTES_PER_LOGPROB * (
            params.prompt_logprobs + 1
        )
    return sum(
        params.n * (params.max_tokens * per_token + prompt_len * per_prompt_token)
        for prompt_len in prompt_lens
    )


def check_prompt_chars(bounds: PromptBounds, num_chars: int, param: str) -> None:
    """Before tokenizing: the text of one request may not exceed the character bound."""
    if num_chars > bounds.max_prompt_chars:
        raise OpenAIError(
            400,
            f"the prompt text has {num_chars} characters; this server tokenizes at most "
            f"{bounds.max_prompt_chars} ({CHARS_PER_TOKEN_BOUND} per token of "
            f"--max-prompt-tokens {bounds.max_prompt_tokens})",
            param,
            "prompt_too_long",
        )


def chat_text_chars(messages: list[ChatMessage]) -> int:
    return sum(len(m.text()) for m in messages)


def completion_text_chars(request: CompletionRequest) -> int:
    """Characters of the text prompts (0 for token ids), summed over a batch."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt if isinstance(p, str))


def sampling_params(
    fields: OpenAISampling | NativeSamplingParams,
    max_tokens: int,
    limits: RequestLimits,
    has_tokenizer: bool,
) -> SamplingParams:
    """The engine's params; logprobs are the caller's to add (each API names them its way)."""
    stop = [fields.stop] if isinstance(fields.stop, str) else list(fields.stop or [])
    if any(not s for s in stop):
        raise OpenAIError(400, "stop strings must not be empty", "stop", "invalid_value")
    if stop and not has_tokenizer:
        raise OpenAIError(400, "stop strings need a tokenizer; this model has none", "stop")
    min_param = "min_tokens" if isinstance(fields, OpenAISampling) else "min_new_tokens"
    if fields.min_tokens > max_tokens:
        raise OpenAIError(
            400,
            f"{min_param} ({fields.min_tokens}) is larger than max_tokens ({max_tokens})",
            min_param,
            "invalid_value",
        )
    bad_stop = [t for t in fields.stop_token_ids or () if t >= limits.vocab_size]
    if bad_stop:
        raise OpenAIError(
            400,
            f"stop_token_ids: token id {bad_stop[0]} is outside the vocabulary "
            f"[0, {limits.vocab_size})",
            "stop_token_ids",
            "invalid_token_id",
        )
    grammar = request_grammar(fields)
    if grammar is not None and not has_tokenizer:
        message = "structured output needs a tokenizer; this model has none"
        raise OpenAIError(400, message, grammar.param, "invalid_value")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=fields.temperature,
        top_k=max(fields.top_k, 0),  # -1 (vLLM/SGLang's "off") is our 0
        top_p=fields.top_p,
        seed=fields.seed,
        stop=tuple(stop),
        stop_token_ids=tuple(fields.stop_token_ids or ()),
        ignore_eos=fields.ignore_eos,
        n=fields.n if isinstance(fields, OpenAISampling) else 1,
        presence_penalty=fields.presence_penalty,
        frequency_penalty=fields.frequency_penalty,
        repetition_penalty=fields.repetition_penalty,
        logit_bias=_logit_bias(fields.logit_bias, limits.vocab_size),
        min_tokens=fields.min_tokens,
        grammar=grammar.spec if grammar is not None else None,
        cache_priority=fields.priority,
        cache_retention_s=fields.retention_seconds,
    )
    if params.masks_every_token(limits.eos_token_ids, limits.vocab_size):
        raise OpenAIError(
            400,
            f"stop_token_ids (with the model's eos) hold every token id of the "
            f"vocabulary: while {min_param} ({fields.min_tokens}) holds, no token could be "
            "sampled",
            "stop_token_ids",
            "invalid_value",
        )
    return params


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's shape: token ids as decimal strings."""
    pairs = []
    for key, value in (bias or {}).items():
        is_id = key.isdecimal() and key.isascii() and len(key) <= 10  # int() of any length
        token_id = int(key) if is_id else -1
        if not 0 <= token_id < vocab_size:
            raise OpenAIError(
                400,
                f"logit_bias key {key!r} is not a token id in [0, {vocab_size})",
                "logit_bias",
                "invalid_token_id",
            )
        pairs.append((token_id, value))
    return tuple(pairs)


def completion_num_prompts(request: CompletionRequest) -> int:
    """How many prompts a completions request lists (before tokenizing any)."""
    prompt = request.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return max(len(prompt), 1)


def completion_prompt_ids(
    tokenizer: Tokenizer | None, request: CompletionRequest
) -> list[list[int]]:
    """One token id list per prompt. Blocking: run off the loop."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [_encode(tokenizer, prompt, "prompt")]
    if not prompt:
        return [[]]
    # The schema admits one shape per list (texts, ids, or lists of ids): its first item's.
    if isinstance(prompt[0], str):
        return [_encode(tokenizer, text, "prompt") for text in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(ids) for ids in prompt]


def completion_prompt_texts(
    tokenizer: Tokenizer | None, request: CompletionRequest, prompts: list[list[int]]
) -> list[str]:
    """What `echo` prepends: each prompt as sent, token-id prompts decoded (special tokens
    included: the echo is the prompt itself)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return [text for text in prompt]
    if tokenizer is None:
        raise OpenAIError(400, "echo of token ids needs a tokenizer; this model has none", "echo")
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


def generate_prompt_ids(tokenizer: Tokenizer | None, request: GenerateRequest) -> list[int]:
    if (request.text is None) == (request.input_ids is None):
        raise OpenAIError(400, "give exactly one of 'text' and 'input_ids'", "text")
    if request.input_ids is not None:
        return list(request.input_ids)
    return _encode(tokenizer, request.text or "", "text")


def _encode(tokenizer: Tokenizer | None, text: str, param: str) -> list[int]:
    if tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer; send token ids", param)
    return tokenizer.encode(text)
