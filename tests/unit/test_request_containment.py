"""A failure one request causes fails that request only (docs/reliability.md,
"Containment"): a row the sampler cannot sample fails alone; in a real engine step (fp32,
tiny model) the other requests of the batch get exactly the tokens they get alone and the
engine's invariants hold afterwards; a constraint that masks every token is refused
before the engine runs anything; the request costs a rank takes are bounded."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.config import ServerConfig
from kvstrata.core import ErrorKind, Request
from kvstrata.engine.invariants import check_engine
from kvstrata.engine.penalties import LogitsAdjuster
from kvstrata.engine.sampler import Sampler
from kvstrata.http.errors import OpenAIError
from kvstrata.http.inputs import RequestLimits, answer_bytes, check_num_prompts
from kvstrata.server.inflight import InflightPerClient

POISON_BIAS = ((7, -1.0),)  # the marker of the request whose adjustment is made to raise


def test_a_row_without_a_distribution_fails_alone() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [float("-inf")] * 4, [1.0, 0.0, 5.0, 0.0]])
    hot = SamplingParams(temperature=1.0, seed=3)
    requests = [Request("a", [1], hot), Request("bad", [1], hot), Request("c", [1], hot)]
    sampled = Sampler(default_seed=0).sample(logits, requests)
    assert [r.rid for r in sampled.requests] == ["a", "c"]
    assert [f.request.rid for f in sampled.failures] == ["bad"]
    assert "no token has a finite, positive probability" in sampled.failures[0].message
    # The rows that sampled drew what they draw alone (seeded draws reseed per token).
    alone = Sampler(default_seed=0).sample(logits[[0, 2]], [requests[0], requests[2]])
    assert sampled.token_ids == alone.token_ids


def test_a_failing_request_in_an_engine_step_fails_alone(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_apply = LogitsAdjuster.apply

    def apply(self: LogitsAdjuster, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        if any(req.params.logit_bias == POISON_BIAS for req in requests):
            raise RuntimeError("injected: this request's adjustment breaks")
        return real_apply(self, logits, requests)

    monkeypatch.setattr(LogitsAdjuster, "apply", apply)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    penalised = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                               repetition_penalty=1.3)  # fmt: skip
    poison = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=POISON_BIAS)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24]]
    alone = LLM(str(tiny_llama), page_size=4, dtype="float32")
    expected = alone.generate(sampling_params=[greedy, penalised],
                              input_ids=[prompts[0], prompts[2]])  # fmt: skip

    llm = LLM(str(tiny_llama), page_size=4, dtype="float32")
    engine = llm.engine
    reqs = [engine.add_request(p, params) for p, params in
            zip(prompts, [greedy, poison, penalised])]  # fmt: skip
    finals = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finals[out.rid] = out
    bad = finals[reqs[1].rid]
    assert bad.error is not None and bad.error.kind is ErrorKind.FAILED
    assert "injected" in bad.error.message
    assert finals[reqs[0].rid].error is None and finals[reqs[2].rid].error is None
    assert finals[reqs[0].rid].output_ids == expected[0].output_ids
    assert finals[reqs[2].rid].output_ids == expected[1].output_ids
    report = check_engine(engine)
    assert report.ok and report.idle, report.to_json()
    # And the engine goes on serving.
    (again,) = llm.generate(sampling_params=greedy, input_ids=[prompts[0]])
    assert again.output_ids == expected[0].output_ids


def test_every_token_masked_is_refused_before_the_engine(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=4)
    vocab_size = llm.engine.model_config.vocab_size
    impossible = SamplingParams(max_tokens=4, min_tokens=3, temperature=1.0,
                                stop_token_ids=tuple(range(vocab_size)))  # fmt: skip
    with pytest.raises(ValueError, match="no token could be sampled"):
        llm.engine.add_request([5, 6, 7], impossible)
    assert not llm.engine.has_unfinished
    # Without min_tokens, or with an id left over, the same stop ids are fine.
    llm.engine.validate([5, 6, 7], SamplingParams(stop_token_ids=tuple(range(vocab_size))))
    one_left = SamplingParams(min_tokens=3, stop_token_ids=tuple(range(1, vocab_size)))
    llm.engine.validate([5], dataclasses.replace(one_left, ignore_eos=True))


def test_request_costs_are_bounded_at_the_door() -> None:
    costs = ServerConfig(max_prompts_per_request=4, max_choices_per_request=8,
                         max_response_bytes=100_000)  # fmt: skip
    check_num_prompts(4, 2, costs)
    with pytest.raises(OpenAIError, match="--max-prompts-per-request") as raised:
        check_num_prompts(5, 1, costs)
    assert raised.value.status_code == 400 and raised.value.param == "prompt"
    with pytest.raises(OpenAIError, match="--max-choices-per-request"):
        check_num_prompts(3, 3, costs)
    limits = RequestLimits(vocab_size=100, max_seq_len=1000, pool_tokens=1000)
    limits.check_cost([100, 100], SamplingParams(max_tokens=100, n=8), costs)  # 1,800 tokens
    with pytest.raises(OpenAIError, match="--max-request-tokens"):
        limits.check_cost([100, 100], SamplingParams(max_tokens=500, n=4), costs)  # 4,200
    # 1 x 100 tokens x (16 + 21 x 64) bytes: 136 kB > 100 kB
    logprobs = SamplingParams(max_tokens=100, logprobs=20)
    assert answer_bytes([10], logprobs) == 100 * (16 + 21 * 64)
    with pytest.raises(OpenAIError, match="--max-response-bytes"):
        limits.check_cost([10], logprobs, costs)


def test_inflight_per_client_is_bounded_and_given_back() -> None:
    inflight = InflightPerClient(max_per_client=4)
    inflight.take("a", 3)
    inflight.take("b", 4)
    with pytest.raises(OpenAIError, match="--max-inflight-per-client") as raised:
        inflight.take("a", 2)
    assert raised.value.status_code == 429
    inflight.give("a", 3)
    inflight.take("a", 4)
    assert inflight.held("a") == 4 and inflight.held("b") == 4
    inflight.give("a", 4)
    assert inflight.held("a") == 0
