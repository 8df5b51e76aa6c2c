"""The batched draw (kvstrata/engine/draw.py): every row draws exactly the token it draws
alone, whatever its batch (greedy, tempered, top-k, top-p and seeded rows mixed); the draw
follows the distribution it is given (frequencies over many seeds); top-k and top-p keep
exactly the tokens the per-row rules keep; a row with no finite mass is reported."""

from __future__ import annotations

import torch

from kvstrata.core import Request, SamplingParams
from kvstrata.engine.draw import draw, sampling_probs
from kvstrata.engine.sampler import Sampler

VOCAB = 64


def request(params: SamplingParams, num_outputs: int = 0) -> Request:
    return Request("r", [1], params, output_ids=[0] * num_outputs)


def test_each_row_draws_what_it_draws_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(temperature=1.3, top_k=5, seed=2),
        SamplingParams(temperature=1.0, top_p=0.6, seed=3),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.8, seed=4),
        SamplingParams(temperature=1.0, seed=5),
    ]
    for index in range(5):  # five output positions: each reseeds per token
        requests = [request(p, index) for p in params]
        batch = draw(logits, requests, Sampler(0)._generator)
        alone = [
            draw(logits[k : k + 1], [requests[k]], Sampler(0)._generator).token_ids[0]
            for k in range(len(requests))
        ]
        assert batch.token_ids == alone and batch.invalid_rows == []
        assert batch.token_ids[0] == int(logits[0].argmax())


def test_the_draw_follows_its_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    counts = torch.zeros(4)
    num_draws = 4000
    sampler = Sampler(0)
    for seed in range(num_draws):
        (token,) = draw(logits, [request(SamplingParams(seed=seed))], sampler._generator).token_ids
        counts[token] += 1
    frequencies = counts / num_draws
    # 4,000 draws: a frequency's standard error is at most 0.008; 0.04 is 5 of them.
    assert torch.allclose(frequencies, probs, atol=0.04), frequencies


def test_top_k_and_top_p_keep_what_the_rules_say() -> None:
    logits = torch.tensor([[4.0, 3.0, 3.0, 1.0, 0.0], [4.0, 3.0, 2.0, 1.0, 0.0]])
    top_k = sampling_probs(logits[:1], [SamplingParams(top_k=2)])
    assert (top_k[0] > 0).tolist() == [True, True, True, False, False]  # ties with the kth stay
    probs = torch.softmax(logits[1], dim=-1)  # 0.64, 0.24, 0.09, 0.03, 0.01
    top_p = sampling_probs(logits[1:], [SamplingParams(top_p=0.8)])
    assert (top_p[0] > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(top_p[0][:2], probs[:2])
    # A row with top_p 1 beside one without drops nothing; tiny top_p keeps the top token.
    mixed = sampling_probs(logits, [SamplingParams(), SamplingParams(top_p=1e-45)])
    assert (mixed[0] > 0).all() and (mixed[1] > 0).tolist() == [True] + [False] * 4


def test_a_row_without_mass_is_reported_and_the_others_draw() -> None:
    logits = torch.randn(3, VOCAB)
    logits[1] = float("-inf")
    hot = SamplingParams(temperature=1.0, seed=9)
    draws = draw(logits, [request(hot), request(hot), request(hot)], Sampler(0)._generator)
    assert draws.invalid_rows == [1]
    assert 0 <= draws.token_ids[0] < VOCAB and 0 <= draws.token_ids[2] < VOCAB
