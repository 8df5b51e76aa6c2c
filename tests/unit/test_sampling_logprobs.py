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


def test_prompt_logprobs_equal_transformers_across_chunks_and_cache(tiny_llama: Path) -> None:
    """echo's prompt logprobs: entry i is prompt token i + 1's logprob after tokens
    [0, i], from prompt chunks (16 tokens a step) and never from the prefix cache (a
    cached prompt is computed again); each position recorded once."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    llm = LLM(str(tiny_llama), page_size=4, max_num_batched_tokens=16)
    rng = random.Random(1)
    prompt = [rng.randrange(300) for _ in range(37)]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2)
    llm.generate(input_ids=[prompt], sampling_params=SamplingParams(max_tokens=1))  # cache it
    (out,) = llm.generate(input_ids=[prompt], sampling_params=params)
    assert out.cached_tokens == 0 and out.logprobs is None
    records = out.prompt_logprobs
    assert records is not None and [r.token_id for r in records] == prompt[1:]
    for i, record in enumerate(records):
        assert abs(record.logprob - float(ref[i, prompt[i + 1]])) < 1e-4
        assert [t for t, _ in record.top] == torch.topk(ref[i], 2).indices.tolist()
    assert llm.engine.num_prompt_logprob_requests == 0


def test_prompt_logprobs_survive_preemption(tiny_llama: Path) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (30, 25, 33, 28, 31, 27)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    roomy = LLM(str(tiny_llama), page_size=4, disable_radix_cache=True)
    tight = LLM(str(tiny_llama), page_size=4, num_kv_pages=30)
    expected = roomy.generate(input_ids=prompts, sampling_params=params)
    got = tight.generate(input_ids=prompts, sampling_params=params)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b in zip(got, expected):
        assert a.output_ids == b.output_ids
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        assert [r.token_id for r in a.prompt_logprobs] == a.prompt_ids[1:]
        assert all(
            abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.prompt_logprobs, b.prompt_logprobs)
        )
