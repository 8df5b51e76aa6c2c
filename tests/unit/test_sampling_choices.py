"""`n` choices of one prompt (engine/choices.py): choice 0 computes the prompt, the others
wait for it and then hit its full pages in the prefix cache (the prompt is prefilled once,
counted exactly); each choice draws from its own seed; held choices abort cleanly."""

from __future__ import annotations

import random
from pathlib import Path

import torch
from test_engine import assert_idle

from kvstrata import LLM, SamplingParams
from kvstrata.core import Batch
from kvstrata.engine.engine import Engine

PAGE = 4


def count_computed_tokens(engine: Engine) -> list[int]:
    """Wraps the runner: the tokens each step computes, appended to the returned list."""
    counts: list[int] = []
    run = engine.runner.run

    def counting(batch: Batch) -> torch.Tensor:
        counts.append(batch.num_tokens)
        return run(batch)

    engine.runner.run = counting  # type: ignore[method-assign]
    return counts


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300) for _ in range(length)]


def test_choices_share_the_prompt_prefill(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=PAGE)
    computed = count_computed_tokens(llm.engine)
    prompt, max_tokens = prompt_of(1, 30), 8
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    (single,) = llm.generate(input_ids=[prompt], sampling_params=greedy)
    llm.engine.flush_cache()
    computed.clear()
    outs = llm.generate(input_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=3))  # fmt: skip
    assert [o.output_ids for o in outs] == [single.output_ids] * 3
    # Choice 0: the prompt (30), then again from its last full page (28) to its first
    # token (3 tokens), then max_tokens - 2 decodes. Choices 1 and 2 hit 28 tokens: 2
    # prompt tokens each, then max_tokens - 1 decodes. Without sharing: 3 x 30 prompt.
    assert sum(computed) == 30 + 3 + (max_tokens - 2) + 2 * (2 + max_tokens - 1)
    assert [o.cached_tokens for o in outs] == [0, 28, 28]
    assert_idle(llm)


def test_seeded_choices_differ_and_repeat(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=PAGE)
    prompts = [prompt_of(2, 9), prompt_of(3, 14)]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, n=3)
    first = [o.output_ids for o in llm.generate(input_ids=prompts, sampling_params=params)]
    again = [o.output_ids for o in llm.generate(input_ids=prompts, sampling_params=params)]
    assert len(first) == 6 and first == again
    assert len({tuple(ids) for ids in first[:3]}) == 3  # the choices of prompt 0 differ
    single = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    alone = llm.generate(input_ids=prompts, sampling_params=single)
    assert [first[0], first[3]] == [o.output_ids for o in alone]  # choice 0 keeps the seed


def test_aborting_held_and_running_choices_leaks_nothing(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=PAGE)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=3)
    reqs = engine.add_choices(prompt_of(4, 21), params, ["a", "b", "c"])
    assert engine.forks.num_held == 2
    assert engine.abort("c") is not None  # held: never queued
    engine.step()  # choice 0's prefill and first token: "b" is queued now
    assert engine.forks.num_held == 0
    finished = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                finished[out.rid] = out
    assert sorted(finished) == ["a", "b"]
    assert finished["a"].output_ids == finished["b"].output_ids
    assert reqs[2].is_finished
    # Aborting choice 0 before its first token releases the held ones to run alone.
    engine.add_choices(prompt_of(5, 13), params, ["x", "y"])
    engine.abort("x")
    outs = []
    while engine.has_unfinished:
        outs += [o for o in engine.step() if o.finished]
    assert [o.rid for o in outs] == ["y"] and len(outs[0].output_ids) == 6
    assert_idle(llm)
