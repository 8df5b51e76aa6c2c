"""`GrammarBook`: the grammar matcher of each constrained request (engine thread): which
tokens its next step may sample (a bitmask applied to the logits before any draw or
logprob), the tokens it accepts as they are committed (sampled here, or a prefill rank's
first token), and whether its output is complete. The compiler is made on first use."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from kvstrata.core import GrammarSpec, Request
from kvstrata.engine.grammar_compiler import CompiledGrammar, GrammarCompiler, GrammarError


class GrammarBook:
    """Owns one matcher per live constrained request, by rid; `make_compiler` builds the
    compiler the first time a grammar is asked for (None: this engine has no tokenizer)."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler] | None) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._matchers: dict[str, Any] = {}  # rid -> xgrammar.GrammarMatcher
        self._bitmask: torch.Tensor | None = None  # [rows, words] int32, reused
        # Tokens a matcher refused: a prefill rank's first token the decode rank's matcher
        # does not take (their grammars differ), or a bug. Each fails its request.
        self.num_rejected_tokens = 0

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler (made on first use, from any thread); raises GrammarError if this
        model has no tokenizer."""
        with self._compiler_lock:
            if self._compiler is None:
                if self._make_compiler is None:
                    raise GrammarError(
                        "structured output needs a tokenizer; this model directory has none"
                    )
                self._compiler = self._make_compiler()
            return self._compiler

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec` (cached; any thread). Raises GrammarError naming the problem."""
        return self.compiler.compile(spec)

    def track(self, req: Request) -> None:
        """A matcher for `req` if it is constrained; raises GrammarError."""
        spec = req.params.grammar
        if spec is None:
            return
        import xgrammar as xgr

        self._matchers[req.rid] = xgr.GrammarMatcher(self.compile(spec).handle)

    def release(self, rid: str) -> None:
        self._matchers.pop(rid, None)

    @property
    def num_tracked(self) -> int:
        return len(self._matchers)

    def mask(self, requests: list[Request], *logits: torch.Tensor) -> None:
        """Set to -inf, in place in each tensor of `logits` ([len(requests), vocab]), the
        logits of tokens each constrained row may not take next; unconstrained rows are
        left alone. One bitmask per step, however many tensors it is applied to."""
        rows = [k for k, req in enumerate(requests) if req.rid in self._matchers]
        if not rows or not logits:
            return
        import xgrammar as xgr

        vocab_size = logits[0].shape[1]
        bitmask = self._bitmask_for(len(requests), vocab_size)
        for k in rows:
            self._matchers[requests[k].rid].fill_next_token_bitmask(bitmask, k)
        on_device = bitmask[: len(requests)].to(logits[0].device, non_blocking=True)
        for tensor in logits:
            xgr.apply_token_bitmask_inplace(tensor, on_device, vocab_size=vocab_size, indices=rows)

    def accept(self, req: Request, token_id: int) -> bool:
        """Advance `req`'s matcher by its committed token; False if the grammar refuses
        it (counted). Unconstrained requests accept everything."""
        matcher = self._matchers.get(req.rid)
        if matcher is None or matcher.accept_token(token_id):
            return True
        self.num_rejected_tokens += 1
        return False

    def is_complete(self, req: Request) -> bool:
        """The output matched the whole grammar and took its stop token: nothing more may
        follow (the request ends even with ignore_eos)."""
        matcher = self._matchers.get(req.rid)
        return matcher is not None and matcher.is_terminated()

    def metrics(self) -> dict[str, float]:
        compiles = self._compiler.num_compiles if self._compiler is not None else 0
        return {
            "grammar_requests": len(self._matchers),
            "grammar_rejected_tokens": self.num_rejected_tokens,
            "grammar_compiles": compiles,
        }

    def _bitmask_for(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        import xgrammar as xgr

        bitmask = self._bitmask
        num_words = (vocab_size + 31) // 32
        if bitmask is None or bitmask.shape[0] < num_rows or bitmask.shape[1] != num_words:
            bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), vocab_size)
            self._bitmask = bitmask
        return bitmask

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.close()
