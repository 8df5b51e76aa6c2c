"""The logits adjustments a request may ask for, applied to a batch's rows at once before
sampling (vLLM's order and semantics): min_tokens (eos and stop token ids masked), logit_bias,
then repetition (prompt + output tokens), frequency and presence (output tokens) penalties.
Owns the per-request token counts the penalties read (`TokenCounts`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.core import Request, SamplingParams


def needs_counts(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


class TokenCounts:
    """For each request with a penalty: how often each token occurs in its output so far,
    and which tokens its prompt holds, as rows of two device tables (one row per request,
    so a batch's rows are gathered in one indexing op).

    Invariant: a row counts exactly `output_ids[:num_counted]` of its request; `rows`
    first counts whatever was appended since (sampled here, or a PD first token, or tokens
    kept across a preemption: output_ids survive it, so the counts stay right). A row lives
    from the request's first penalised step until `release` (its end)."""

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self._num_counted: dict[str, int] = {}
        self._free_slots: list[int] = []
        self._output: torch.Tensor | None = None  # int32 [capacity, vocab]
        self._prompt: torch.Tensor | None = None  # bool [capacity, vocab]

    @property
    def num_rows(self) -> int:
        return len(self._slot)

    def rows(
        self, requests: Sequence[Request], vocab_size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts int32 [len(requests), vocab], prompt mask bool [same]) for the
        requests, in order, brought up to date with their output tokens. The tables take
        their width from the first call (one engine: one vocabulary)."""
        slots = [self._slot_of(req, vocab_size, device) for req in requests]
        assert self._output is not None and self._prompt is not None
        new_slots: list[int] = []
        new_tokens: list[int] = []
        for req, slot in zip(requests, slots):
            counted = self._num_counted[req.rid]
            if counted < req.num_output_tokens:
                new_tokens.extend(req.output_ids[counted:])
                new_slots.extend([slot] * (req.num_output_tokens - counted))
                self._num_counted[req.rid] = req.num_output_tokens
        if new_tokens:
            index = torch.tensor([new_slots, new_tokens], dtype=torch.long).to(device)
            ones = torch.ones(len(new_tokens), dtype=torch.int32, device=device)
            self._output.index_put_((index[0], index[1]), ones, accumulate=True)
        slot_index = torch.tensor(slots, dtype=torch.long).to(device)
        return self._output[slot_index], self._prompt[slot_index]

    def release(self, rid: str) -> None:
        slot = self._slot.pop(rid, None)
        if slot is not None:
            del self._num_counted[rid]
            self._free_slots.append(slot)

    def _slot_of(self, req: Request, vocab_size: int, device: torch.device) -> int:
        slot = self._slot.get(req.rid)
        if slot is not None:
            return slot
        if not self._free_slots:
            self._grow(vocab_size, device)
        slot = self._free_slots.pop()
        assert self._output is not None and self._prompt is not None
        self._output[slot].zero_()
        self._prompt[slot].zero_()
        self._prompt[slot, torch.tensor(req.prompt_ids, dtype=torch.long).to(device)] = True
        self._slot[req.rid] = slot
        self._num_counted[req.rid] = 0
        return slot

    def _grow(self, vocab_size: int, device: torch.device) -> None:
        """Double the tables (new rows are zeroed when handed out)."""
        old = 0 if self._output is None else self._output.shape[0]
        capacity = max(8, 2 * old)
        output = torch.zeros((capacity, vocab_size), dtype=torch.int32, device=device)
        prompt = torch.zeros((capacity, vocab_size), dtype=torch.bool, device=device)
        if self._output is not None and self._prompt is not None:
            output[:old] = self._output
            prompt[:old] = self._prompt
        self._output, self._prompt = output, prompt
        self._free_slots.extend(range(capacity - 1, old - 1, -1))


class LogitsAdjuster:
    """Applies each request's min_tokens, logit_bias and penalties to its logits row."""

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.counts = TokenCounts()

    def apply(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """`logits` [len(requests), vocab] adjusted, as a new tensor (the input is kept:
        logprobs are reported from the raw logits)."""
        out = logits.clone()
        device = out.device
        self._mask_stops(out, requests)
        bias_rows, bias_ids, bias_values = [], [], []
        for row, req in enumerate(requests):
            for token_id, bias in req.params.logit_bias:
                bias_rows.append(row)
                bias_ids.append(token_id)
                bias_values.append(bias)
        if bias_rows:
            index = torch.tensor([bias_rows, bias_ids], dtype=torch.long).to(device)
            values = torch.tensor(bias_values, dtype=out.dtype).to(device)
            out.index_put_((index[0], index[1]), values, accumulate=True)
        penalised = [row for row, req in enumerate(requests) if needs_counts(req.params)]
        if penalised:
            out[_rows(penalised, device)] = self._penalise(
                out[_rows(penalised, device)], [requests[row] for row in penalised]
            )
        return out

    def release(self, rid: str) -> None:
        self.counts.release(rid)

    def _mask_stops(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Below min_tokens a row may not pick eos (unless ignore_eos) or a stop token id."""
        rows: list[int] = []
        token_ids: list[int] = []
        for row, req in enumerate(requests):
            params = req.params
            if req.num_output_tokens >= params.min_tokens:
                continue
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned.update(self.eos_token_ids)
            rows.extend([row] * len(banned))
            token_ids.extend(banned)
        if rows:
            index = torch.tensor([rows, token_ids], dtype=torch.long).to(logits.device)
            logits[index[0], index[1]] = float("-inf")

    def _penalise(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        device = logits.device
        output_counts, prompt_mask = self.counts.rows(requests, logits.shape[-1], device)
        params = [req.params for req in requests]
        rep, freq, pres = (
            torch.tensor([getattr(p, name) for p in params], dtype=logits.dtype)
            .to(device)
            .unsqueeze(1)
            for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")
        )
        output_mask = output_counts > 0
        # Repetition: a seen token's logit moves toward "less likely" whatever its sign.
        seen = prompt_mask | output_mask
        repeated = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, repeated, logits)
        return logits - freq * output_counts.to(logits.dtype) - pres * output_mask.to(logits.dtype)


def _rows(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).to(device)
