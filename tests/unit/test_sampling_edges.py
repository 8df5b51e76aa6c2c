"""Sampling parameters at the edge of their valid ranges (found by fuzzing the server)
still sample a token instead of failing the engine: a temperature or top_p too small
for float32 keeps only the most likely token."""

from __future__ import annotations

import pytest
import torch

from kvstrata.core import Request, SamplingParams
from kvstrata.engine.sampler import Sampler


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1e-300),
        SamplingParams(top_p=1e-300),
        SamplingParams(temperature=1e-3, top_p=1e-300),
        SamplingParams(temperature=0.5, top_k=1),
    ],
    ids=["tiny-temperature", "tiny-top-p", "tiny-top-p-low-temperature", "top-k-1"],
)
def test_extreme_params_pick_the_argmax(params: SamplingParams) -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert Sampler(default_seed=0).sample(logits, [Request("r", [1], params)]).token_ids == [1]


def test_huge_temperature_samples_from_the_allowed_tokens() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    request = Request("r", [1], SamplingParams(temperature=1e300, top_k=2, seed=7))
    assert Sampler(default_seed=0).sample(logits, [request]).token_ids[0] in (1, 3)
