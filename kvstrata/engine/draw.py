"""How a batch's rows become tokens: greedy rows take their argmax; sampled rows are
tempered, cut to top-k and top-p all at once, and draw by the exponential race (the argmax
of p / E with E ~ Exp(1) drawn from the row's own generator, a draw from p). One host
sync per batch, and no `torch.multinomial`, which on CUDA is a device-side assert (fatal to
the process) for a row without a finite, positive mass: such a row is reported instead."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kvstrata.core import Request, SamplingParams

GeneratorOf = Callable[[Request, torch.device], torch.Generator]


class Draws(NamedTuple):
    """One token per row; `invalid_rows`: rows that had nothing to draw from (their
    token is meaningless and must not be used)."""

    token_ids: list[int]
    invalid_rows: list[int]


def draw(logits: torch.Tensor, requests: Sequence[Request], generator_of: GeneratorOf) -> Draws:
    """Row k of `logits` ([len(requests), vocab]) draws request k's next token."""
    greedy_ids = logits.argmax(dim=-1)
    sampled = [k for k, req in enumerate(requests) if not req.params.is_greedy]
    if not sampled:
        return Draws(greedy_ids.tolist(), [])
    device = logits.device
    index = torch.tensor(sampled, dtype=torch.long).to(device)
    probs = sampling_probs(logits[index], [requests[k].params for k in sampled])
    # Each row's noise comes from its own generator (a seeded row's is reseeded for this
    # token), so a row draws the same token alone or in any batch. A launched kernel has
    # taken its generator's seed and offset, so reseeding for the next row is safe.
    noise = torch.empty_like(probs)
    for i, k in enumerate(sampled):
        noise[i].exponential_(generator=generator_of(requests[k], device))
    token_ids = greedy_ids.clone()
    token_ids[index] = (probs / noise).argmax(dim=-1)
    valid = torch.ones_like(token_ids)
    valid[index] = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).long()
    host_ids, host_valid = torch.stack([token_ids, valid]).tolist()
    return Draws(host_ids, [k for k, ok in enumerate(host_valid) if not ok])


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from ([rows, vocab]): logits over temperature,
    cut to the top-k logits and the top-p mass where a row asks for them."""
    device, vocab_size = logits.device, logits.shape[-1]
    temperatures = _column([p.temperature for p in params], logits.dtype, device)
    scaled = logits / temperatures
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    if any(top_ks):
        # Rank the raw logits: a huge temperature can round every scaled logit to 0, and
        # then a cut-off on the scaled ones would keep the whole vocabulary.
        top = logits.topk(max(top_ks), dim=-1).values
        kth = top.gather(1, _column([max(k - 1, 0) for k in top_ks], torch.long, device))
        kth = torch.where(_column(top_ks, torch.long, device) > 0, kth, float("-inf"))
        scaled = scaled.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        # Keep the smallest set whose mass reaches top_p: a token stays if the mass before
        # it is still below top_p. The top token always stays, also when top_p is below
        # float32's range and compares as 0 (else no token would be left); a row with
        # top_p 1 drops nothing (its rounded mass may pass 1 before the tail).
        top_ps = _column(
            [p.top_p if p.top_p < 1.0 else float("inf") for p in params], probs.dtype, device
        )
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_ps
        drop[:, 0] = False
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device).unsqueeze(1)
