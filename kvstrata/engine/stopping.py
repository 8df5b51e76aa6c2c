"""When a request stops (eos, stop token ids, stop strings, max_tokens, context length;
none but the limits before min_tokens) and the text it has produced so far. Owns each
running request's incremental decoder."""

from __future__ import annotations

from kvstrata.core import FinishReason, Request
from kvstrata.model.tokenizer import IncrementalDecoder, Tokenizer


class StopChecker:
    def __init__(
        self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._decoders: dict[str, IncrementalDecoder] = {}

    def append(self, req: Request, token_id: int) -> FinishReason | None:
        """Record a sampled token on `req`; return why it must stop, if it must."""
        req.output_ids.append(token_id)
        params = req.params
        reason: FinishReason | None = None
        # Below min_tokens the sampler masks eos and stop ids; stop strings found in that
        # text never stop the request (vLLM's rule).
        early = req.num_output_tokens < params.min_tokens
        if not early and (
            token_id in params.stop_token_ids
            or (not params.ignore_eos and token_id in self.eos_token_ids)
        ):
            reason = FinishReason.STOP
        elif self.tokenizer is not None and self._update_text(req, cut=not early):
            self.release(req.rid)  # the text is final: cut at the stop string
            return FinishReason.STOP
        elif req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self._flush(req)
        return reason

    def visible_text(self, req: Request) -> str:
        """Text safe to show a streaming client: while a stop string could still be
        forming at the end, that tail is held back."""
        if req.is_finished or not req.params.stop:
            return req.output_text
        hold = max(len(s) for s in req.params.stop) - 1
        return req.output_text[: max(0, len(req.output_text) - hold)]

    def release(self, rid: str) -> None:
        self._decoders.pop(rid, None)

    def _update_text(self, req: Request, cut: bool) -> bool:
        """Extend `req.output_text`; with `cut`, True if it now contains a stop string
        (the text is cut just before it)."""
        assert self.tokenizer is not None
        decoder = self._decoders.get(req.rid)
        if decoder is None:
            decoder = self._decoders[req.rid] = IncrementalDecoder(self.tokenizer)
        old_len = len(req.output_text)
        req.output_text += decoder.step(req.output_ids)
        return cut and self._cut_at_stop(req, old_len)

    def _flush(self, req: Request) -> None:
        decoder = self._decoders.pop(req.rid, None)
        if decoder is not None:
            old_len = len(req.output_text)
            req.output_text += decoder.flush()
            self._cut_at_stop(req, old_len)

    @staticmethod
    def _cut_at_stop(req: Request, old_len: int) -> bool:
        if not req.params.stop or len(req.output_text) == old_len:
            return False
        # Only text that overlaps the new delta can hold a stop string not seen before.
        longest = max(len(s) for s in req.params.stop)
        search_from = max(0, old_len - longest + 1)
        hits = [i for s in req.params.stop if (i := req.output_text.find(s, search_from)) >= 0]
        if not hits:
            return False
        req.output_text = req.output_text[: min(hits)]
        return True
