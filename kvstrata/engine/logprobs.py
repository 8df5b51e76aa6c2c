"""Token log-probabilities: for each row of a logits batch, the logprob of one chosen token
and the most likely tokens with theirs, computed on the device in one pass over the batch
and read back with one copy."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstrata.core import TokenLogprobs


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int]
) -> list[TokenLogprobs]:
    """Row k: the logprob of `token_ids[k]` under softmax(`logits[k]`) (float32) and its
    `num_top[k]` most likely tokens, most likely first (equal logprobs: lower id first;
    topk's order among ties is unspecified, so the host sorts them)."""
    if not token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_index = torch.tensor(token_ids, dtype=torch.long).to(logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_index).squeeze(1).tolist()
    max_top = max(num_top)
    top_values: list[list[float]] = [[] for _ in token_ids]
    top_ids: list[list[int]] = [[] for _ in token_ids]
    if max_top > 0:
        top = torch.topk(logprobs, min(max_top, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    results = []
    for k, token_id in enumerate(token_ids):
        pairs = sorted(zip(top_ids[k], top_values[k]), key=lambda p: (-p[1], p[0]))
        results.append(TokenLogprobs(token_id, chosen[k], tuple(pairs[: num_top[k]])))
    return results
