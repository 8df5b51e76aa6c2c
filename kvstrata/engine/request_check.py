"""`RequestCheck`: what a request may ask of one engine, checked before it is queued (an
empty prompt, ids outside the vocabulary, a length past the context or the pool, stop
strings without a tokenizer, a grammar that does not compile). It reads only facts fixed
at construction, so any thread may call it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.core import SamplingParams
from kvstrata.engine.grammar import GrammarBook


@dataclass(frozen=True)
class RequestCheck:
    vocab_size: int
    max_model_len: int
    num_total_pages: int
    pages_for: Callable[[int], int]  # KV pages a sequence of this many tokens takes
    has_tokenizer: bool
    eos_token_ids: tuple[int, ...]
    grammars: GrammarBook

    def __call__(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (GrammarError for a grammar) if the request can never run."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab_size = self.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        total_len = len(prompt_ids) + params.max_tokens
        if total_len > self.max_model_len:
            raise ValueError(
                f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"is longer than the context length ({self.max_model_len} tokens)"
            )
        if self.pages_for(total_len) > self.num_total_pages:
            raise ValueError(
                f"the request needs {self.pages_for(total_len)} KV pages; the pool "
                f"holds {self.num_total_pages}"
            )
        if params.stop and not self.has_tokenizer:
            raise ValueError("stop strings need a tokenizer; this model directory has none")
        ids = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
        if any(t >= vocab_size for t in ids):
            raise ValueError(
                f"a logit_bias or stop_token_ids token id is outside the vocabulary "
                f"[0, {vocab_size})"
            )
        if params.masks_every_token(self.eos_token_ids, vocab_size):
            raise ValueError(
                f"stop_token_ids (with eos) hold every token id of the vocabulary; while "
                f"min_tokens ({params.min_tokens}) holds, no token could be sampled"
            )
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # cached; raises GrammarError
