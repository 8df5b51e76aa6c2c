"""Seeded sampling is deployment-independent: output token i of a seeded request depends
only on (seed, i) and its logits, not on batch mates, on earlier draws in this process, or
on whether a prefill rank sampled the first token (engine/sampler.py)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from kvstrata import LLM, SamplingParams
from kvstrata.core import Request, RequestOutput
from kvstrata.engine.engine import Engine
from kvstrata.engine.sampler import Sampler, draw_seed

PAGE = 4
VOCAB = 1000  # flat logits over this many tokens: two unrelated draws agree ~1/1000


def request_at(rid: str, params: SamplingParams, num_output_tokens: int) -> Request:
    """A request about to sample its output token `num_output_tokens`."""
    return Request(rid, [1, 2, 3], params, output_ids=[7] * num_output_tokens)


def test_a_draw_depends_on_seed_and_token_index_only() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 0.1  # nearly flat: the draw decides the token
    seeded = SamplingParams(temperature=0.9, seed=1)
    other = SamplingParams(temperature=0.9, seed=99)
    for index in range(6):
        alone = (
            Sampler(default_seed=0).sample(logits[1:2], [request_at("b", seeded, index)]).token_ids
        )
        batch = [
            request_at("a", other, 3),
            request_at("b", seeded, index),
            request_at("c", SamplingParams(temperature=0.7), 0),  # unseeded batch mate
        ]
        # A sampler that already drew other tokens (as a unified rank has, for this
        # request's earlier tokens) gives the same draw as a fresh one (a decode rank's).
        busy = Sampler(default_seed=5)
        for earlier in range(index):
            busy.sample(logits, [request_at("b", seeded, earlier)] * 3)
        assert busy.sample(logits, batch).token_ids[1] == alone[0]
        assert Sampler(default_seed=0).sample(logits, batch).token_ids[1] == alone[0]


def test_token_indices_and_seeds_draw_different_streams() -> None:
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(temperature=1.0, seed=1)
    tokens = [
        Sampler(0).sample(logits, [request_at("r", params, i)]).token_ids[0] for i in range(20)
    ]
    assert len(set(tokens)) > 15  # not one repeated draw
    assert len({draw_seed(1, i) for i in range(100)} | {draw_seed(2, i) for i in range(100)}) == 200
    for seed in (-1, 0, 2**70):
        assert 0 <= draw_seed(seed, 3) < 2**64


def serve_pd(
    prefill: Engine, decode: Engine, prompt: list[int], params: SamplingParams
) -> RequestOutput:
    """One request through decode-first PD, both engines in this process (ipc transport):
    the prefill engine samples token 0, the decode engine the rest."""
    req = decode.add_request(prompt, params)
    while True:
        for out in decode.step():
            if out.rid == req.rid and out.finished:
                return out
        for task in decode.role.take_tasks():
            p_req = prefill.role.add_prefill_task(task)
            while prefill.has_unfinished:
                prefill.step()
            out = decode.role.complete_transfer(prefill.role.collect(p_req.rid))
            if out.finished:
                return out


def test_seeded_request_gives_the_same_tokens_unified_and_pd(tiny_llama: Path) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (9, 14, 21)]
    unified = LLM(str(tiny_llama), page_size=PAGE)
    prefill = LLM(
        str(tiny_llama), page_size=PAGE, disaggregation_mode="prefill", num_kv_pages=256
    ).engine
    decode = LLM(
        str(tiny_llama), page_size=PAGE, disaggregation_mode="decode", num_kv_pages=256,
        disaggregation_decode_local_prefill="never",  # the prefill rank samples token 0
    ).engine  # fmt: skip
    outputs_by_seed: dict[int, list[list[int]]] = {}
    for seed in (1, 2, 3):
        params = SamplingParams(max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True)
        batched = unified.generate(input_ids=prompts, sampling_params=params)
        for prompt, out in zip(prompts, batched):
            (alone,) = unified.generate(input_ids=[prompt], sampling_params=params)
            assert alone.output_ids == out.output_ids
            pd = serve_pd(prefill, decode, prompt, params)
            assert pd.cache_usage.transferred_tokens == len(prompt)  # it went through PD
            assert pd.output_ids == out.output_ids
        outputs_by_seed[seed] = [out.output_ids for out in batched]
    # The seed matters (the test would pass vacuously if sampling were greedy).
    assert len({str(outputs) for outputs in outputs_by_seed.values()}) == 3
