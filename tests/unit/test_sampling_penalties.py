"""Logits adjustments (engine/penalties.py) against a plain torch reference written here,
element by element in vLLM's order: min_tokens masks eos and stop ids, logit_bias adds,
repetition divides/multiplies the logits of prompt and output tokens, frequency and
presence subtract per output occurrence. Exact in fp32, on the sampler's own inputs and on
the tiny model's logits through the engine, across preemption and in PD."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import torch
from test_seeded_sampling import serve_pd

from kvstrata import LLM, SamplingParams
from kvstrata.core import Request, TokenLogprobs
from kvstrata.disagg.protocol import PrefillResult, PrefillTask
from kvstrata.engine.engine import Engine
from kvstrata.engine.penalties import LogitsAdjuster
from kvstrata.engine.sampler import Sampled

PAGE = 4
EOS = (7,)
PENALISED = SamplingParams(
    max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.7,
    frequency_penalty=0.6, presence_penalty=0.4, logit_bias={11: 3.5, 40: -2.0},
)  # fmt: skip


def reference(logits: torch.Tensor, req: Request, eos: tuple[int, ...]) -> torch.Tensor:
    """The adjusted row, token by token (no vectorisation to share bugs with)."""
    x = logits.clone()
    p = req.params
    f32 = torch.float32
    if len(req.output_ids) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = float("-inf")
    for t, bias in p.logit_bias:
        x[t] = x[t] + torch.tensor(bias, dtype=f32)
    rep = torch.tensor(p.repetition_penalty, dtype=f32)
    for t in set(req.prompt_ids) | set(req.output_ids):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(req.output_ids):
        count = torch.tensor(float(req.output_ids.count(t)), dtype=f32)
        x[t] = x[t] - torch.tensor(p.frequency_penalty, dtype=f32) * count
        x[t] = x[t] - torch.tensor(p.presence_penalty, dtype=f32)
    return x


def test_a_batch_of_mixed_adjustments_equals_the_reference() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    vocab = 64
    cases = [
        PENALISED,
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(min_tokens=3, stop_token_ids=[5, 9]),
        SamplingParams(min_tokens=3, ignore_eos=True, logit_bias={7: 50.0}),
        SamplingParams(frequency_penalty=-1.5, presence_penalty=2.0),
    ]
    adjuster = LogitsAdjuster(EOS)
    requests = [
        Request(f"r{i}", [rng.randrange(vocab) for _ in range(9)], params,
                output_ids=[rng.randrange(8) for _ in range(i)])
        for i, params in enumerate(cases)
    ]  # fmt: skip
    for step in range(4):  # counts carry over between steps, growing with the outputs
        logits = torch.randn(len(requests), vocab) * 3
        got = adjuster.apply(logits, requests)
        for row, req in enumerate(requests):
            assert torch.equal(got[row], reference(logits[row], req, EOS)), (step, row)
            req.output_ids.append(rng.randrange(8))
    for req in requests:
        adjuster.release(req.rid)
    assert adjuster.counts.num_rows == 0


class Recorder:
    """Wraps an engine's sampler: each call's raw logits and requests as they were."""

    def __init__(self, engine: Engine) -> None:
        self.calls: list[tuple[torch.Tensor, list[Request], list[int]]] = []
        self._sample = engine.sampler.sample
        engine.sampler.sample = self  # type: ignore[method-assign]

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> Sampled:
        snapshot = [
            Request(r.rid, list(r.prompt_ids), r.params, output_ids=list(r.output_ids))
            for r in requests
        ]
        sampled = self._sample(logits, requests)
        assert not sampled.failures
        self.calls.append((logits.clone(), snapshot, sampled.token_ids))
        return sampled


def check_against_reference(recorder: Recorder, eos: tuple[int, ...]) -> int:
    num_checked = 0
    for logits, requests, token_ids in recorder.calls:
        for row, (req, token_id) in enumerate(zip(requests, token_ids)):
            if req.params.is_plain or not req.params.is_greedy:
                continue  # the reference checks the adjusted argmax
            assert token_id == int(reference(logits[row], req, eos).argmax())
            num_checked += 1
    return num_checked


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300) for _ in range(n)] for n in lengths]


def test_engine_tokens_follow_the_reference_on_model_logits(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=PAGE)
    engine_eos = llm.engine.sampler.adjuster.eos_token_ids
    recorder = Recorder(llm.engine)
    batch = prompts(1, [13, 21, 8])
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    params = [PENALISED, plain, SamplingParams(max_tokens=12, temperature=0.8, seed=3,
                                                repetition_penalty=1.3, top_k=20)]  # fmt: skip
    outs = llm.generate(input_ids=batch, sampling_params=params)
    assert check_against_reference(recorder, engine_eos) == 12  # the greedy penalised one
    (unpenalised,) = llm.generate(input_ids=batch[:1], sampling_params=plain)
    assert outs[0].output_ids != unpenalised.output_ids  # the penalties changed the tokens
    assert (
        outs[1].output_ids
        == llm.generate(input_ids=batch[1:2], sampling_params=plain)[0].output_ids
    )  # a plain batch mate is untouched
    assert llm.engine.sampler.adjuster.counts.num_rows == 0  # released at the end


def test_preempted_requests_keep_their_counts(tiny_llama: Path) -> None:
    batch = prompts(2, [30, 25, 33, 28, 31, 27])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                            frequency_penalty=1.0, repetition_penalty=1.4)  # fmt: skip
    roomy = LLM(str(tiny_llama), page_size=PAGE, disable_radix_cache=True)
    tight = LLM(str(tiny_llama), page_size=PAGE, num_kv_pages=30)
    expected = [o.output_ids for o in roomy.generate(input_ids=batch, sampling_params=params)]
    got = [o.output_ids for o in tight.generate(input_ids=batch, sampling_params=params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_min_tokens_holds_eos_and_stop_ids_back(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=PAGE)
    eos = llm.engine.sampler.adjuster.eos_token_ids[0]
    forced = {eos: 100.0}  # eos is every step's argmax
    (early,) = llm.generate(
        input_ids=prompts(3, [10]),
        sampling_params=SamplingParams(max_tokens=10, temperature=0.0, logit_bias=forced),
    )
    assert early.output_ids == [eos]
    for min_tokens in (1, 4):
        (held,) = llm.generate(
            input_ids=prompts(3, [10]),
            sampling_params=SamplingParams(
                max_tokens=10, temperature=0.0, logit_bias=forced | {5: 99.0},
                stop_token_ids=[5], min_tokens=min_tokens,
            ),
        )  # fmt: skip
        # Below min_tokens neither eos nor the stop id 5 (next best) may be drawn; then
        # one of them is drawn and stops it at once.
        assert len(held.output_ids) == min_tokens + 1
        assert eos not in held.output_ids[:-1] and 5 not in held.output_ids[:-1]
        assert held.output_ids[-1] in (eos, 5)


def test_logit_bias_forces_a_token_with_sampling_too(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=PAGE)
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=1,
                            ignore_eos=True, logit_bias={42: 100.0})  # fmt: skip
    (out,) = llm.generate(input_ids=prompts(4, [9]), sampling_params=params)
    assert out.output_ids == [42] * 6


def test_sampling_and_first_token_logprobs_cross_the_wire() -> None:
    params = dataclasses.replace(PENALISED, logprobs=2, min_tokens=3)
    endpoint = {"backend": "ipc", "id": "pool", "shape": [2, 2, 8, PAGE, 2, 16],
                "dtype": "torch.float32", "shm_path": "/dev/shm/x", "owner": "0" * 32,
                "generation": 1}  # fmt: skip
    task = PrefillTask("room-1", [1, 2, 3], 0, [5], endpoint, dataclasses.asdict(params))
    assert SamplingParams(**PrefillTask.from_json(task.to_json()).sampling) == params
    record = TokenLogprobs(9, -0.25, ((9, -0.25), (3, -1.5)))
    result = PrefillResult("room-1", 9, 1, 0, first_token_logprobs=record)
    assert PrefillResult.from_json(json.loads(json.dumps(result.to_json()))) == result


def test_pd_first_token_is_the_unified_one(tiny_llama: Path) -> None:
    """The prefill rank samples the first token with the request's own adjustments (the
    repetition penalty over the prompt, the bias) and its logprobs; the decode rank goes
    on from there: the PD output equals the unified one, logprobs included."""
    prefill = LLM(str(tiny_llama), page_size=PAGE, disaggregation_mode="prefill").engine
    decode = LLM(str(tiny_llama), page_size=PAGE, disaggregation_mode="decode",
                 disaggregation_decode_local_prefill="never").engine  # fmt: skip
    unified = LLM(str(tiny_llama), page_size=PAGE)
    params = dataclasses.replace(PENALISED, logprobs=2, min_tokens=3)
    for prompt in prompts(5, [17, 26]):
        (expected,) = unified.generate(input_ids=[prompt], sampling_params=params)
        got = serve_pd(prefill, decode, prompt, params)
        assert got.output_ids == expected.output_ids
        assert got.logprobs is not None and expected.logprobs is not None
        assert [r.token_id for r in got.logprobs] == got.output_ids
        for a, b in zip(got.logprobs, expected.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-5
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert decode.sampler.adjuster.counts.num_rows == 0
    assert prefill.sampler.adjuster.counts.num_rows == 0


def test_overlapped_decoding_leaves_adjusted_requests_to_the_sampler(tiny_llama: Path) -> None:
    """The overlap stepper takes raw argmaxes: a batch with a penalised greedy request
    runs synchronously, so its tokens equal the synchronous engine's."""
    batch = prompts(6, [12, 19])
    params = [PENALISED, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)]
    sync = LLM(str(tiny_llama), page_size=PAGE, overlap_schedule="off")
    overlap = LLM(str(tiny_llama), page_size=PAGE, overlap_schedule="on")
    expected = [o.output_ids for o in sync.generate(input_ids=batch, sampling_params=params)]
    got = [o.output_ids for o in overlap.generate(input_ids=batch, sampling_params=params)]
    assert got == expected
    plain = overlap.generate(input_ids=batch, sampling_params=params[1])
    assert overlap.engine.stepper.num_overlapped_steps > 0  # plain batches still overlap
    assert [o.output_ids for o in plain][1] == expected[1]


def test_a_stop_string_counts_only_from_min_tokens_on(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=PAGE)
    greedy = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    (plain,) = llm.generate(["Once upon"], SamplingParams(**greedy))
    stop = plain.text[:1]  # the first character of the answer
    assert stop
    (cut,) = llm.generate(["Once upon"], SamplingParams(**greedy, stop=[stop]))
    assert cut.text == "" and len(cut.output_ids) < len(plain.output_ids)
    (held,) = llm.generate(["Once upon"], SamplingParams(**greedy, stop=[stop], min_tokens=8))
    assert held.output_ids == plain.output_ids and held.text == plain.text
