"""Token logprobs (engine/logprobs.py): each output token's logprob and its top
alternatives equal log_softmax of the model's raw logits (before penalties, bias and
temperature, vLLM's default), computed here in plain torch from the logits the sampler saw;
one record per output token, greedy or sampled, with adjustments or not."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from test_sampling_penalties import Recorder

from kvstrata import LLM, SamplingParams
from kvstrata.engine.logprobs import token_logprobs


def test_records_equal_log_softmax_with_sorted_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0]])
    first, second = token_logprobs(logits, [3, 2], [2, 4])
    ref = torch.log_softmax(logits, dim=-1)
    assert first.token_id == 3 and first.logprob == float(ref[0, 3])
    assert first.top == ((1, float(ref[0, 1])), (2, float(ref[0, 2])))  # tie: lower id first
    assert [t for t, _ in second.top] == [0, 1, 2, 3]
    assert token_logprobs(logits, [0, 0], [0, 0])[0].top == ()


def test_engine_logprobs_follow_the_model_logits(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=4)
    recorder = Recorder(llm.engine)
    rng = random.Random(0)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (11, 6, 19)]
    params = [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=7, temperature=0.9, seed=2, ignore_eos=True, logprobs=0,
                       repetition_penalty=1.5, logit_bias={3: 2.0}),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),  # no logprobs
    ]  # fmt: skip
    outs = llm.generate(input_ids=prompts, sampling_params=params)
    assert outs[2].logprobs is None
    seen: dict[str, list[tuple[torch.Tensor, int]]] = {}
    for logits, requests, token_ids in recorder.calls:
        for row, (req, token_id) in enumerate(zip(requests, token_ids)):
            seen.setdefault(req.rid, []).append((logits[row], token_id))
    for out, p in zip(outs[:2], params):
        assert out.logprobs is not None and len(out.logprobs) == len(out.output_ids) == 7
        for record, (row, token_id) in zip(out.logprobs, seen[out.rid]):
            ref = torch.log_softmax(row, dim=-1)
            assert record.token_id == token_id
            assert record.logprob == float(ref[token_id])
            top = torch.topk(ref, p.logprobs or 0)
            assert [t for t, _ in record.top] == top.indices.tolist()
            assert [lp for _, lp in record.top] == top.values.tolist()
    # Greedy: the chosen token is the most likely one.
    assert all(r.token_id == r.top[0][0] for r in outs[0].logprobs or [])
