"""The batched draw on CUDA: every row draws exactly what it draws alone (seeded rows
reseeded per token, greedy, top-k and top-p rows mixed), with one host sync a batch."""

from __future__ import annotations

import torch

from kvstrata.core import Request, SamplingParams
from kvstrata.engine.draw import draw
from kvstrata.engine.sampler import Sampler


def test_each_row_draws_what_it_draws_alone_on_cuda() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 151936, device="cuda", generator=gen) * 4
    params = [
        SamplingParams(temperature=0.0) if k % 5 == 0
        else SamplingParams(temperature=0.6 + k / 64, top_k=(k % 3) * 20, top_p=1 - k / 128,
                            seed=k)
        for k in range(64)
    ]  # fmt: skip
    requests = [Request(str(k), [1], p, output_ids=[0] * 3) for k, p in enumerate(params)]
    batch = draw(logits, requests, Sampler(0)._generator)
    alone = [draw(logits[k : k + 1], [requests[k]], Sampler(0)._generator).token_ids[0]
             for k in range(64)]  # fmt: skip
    assert batch.token_ids == alone and batch.invalid_rows == []
