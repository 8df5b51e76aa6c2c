"""The overlapped decode stepper against the synchronous one (`--overlap-schedule on` vs
`off`), on CPU where both are exact: identical tokens whatever stops a request (stop token,
stop string, max_tokens, context length), with admissions and aborts landing while a step
is in flight, with sampled requests among greedy ones, and no page or lock left behind."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvstrata import LLM, SamplingParams
from kvstrata.engine.engine import Engine
from kvstrata.engine.stepper import OverlapStepper, SyncStepper

PAGE = 4


def engine(model: Path, overlap: str, **flags: object) -> Engine:
    return LLM(str(model), page_size=PAGE, num_kv_pages=512, overlap_schedule=overlap,
               **flags).engine  # fmt: skip


def assert_idle(eng: Engine) -> None:
    assert not eng.has_unfinished
    load = eng.load()
    assert load.num_used_pages == 0
    assert eng.cache.num_locked_pages == 0


def run_all(eng: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    rids = [eng.add_request(p, sp).rid for p, sp in zip(prompts, params)]
    done: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for out in eng.step():
            if out.finished:
                done[out.rid] = out.output_ids
    return [done[rid] for rid in rids]


def test_auto_is_off_on_cpu_and_on_means_the_overlap_stepper(tiny_llama: Path) -> None:
    assert isinstance(engine(tiny_llama, "auto").stepper, SyncStepper)
    assert isinstance(engine(tiny_llama, "on").stepper, OverlapStepper)


def test_every_stop_reason_gives_the_same_tokens(tiny_llama: Path) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(rng.randrange(3, 30))] for _ in range(12)]
    twelve = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    probe = run_all(engine(tiny_llama, "off"), prompts, [twelve] * len(prompts))
    params = []
    for i, tokens in enumerate(probe):
        if i % 3 == 0:  # stops on a token it samples mid-way (data-dependent, like eos)
            params.append(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                         stop_token_ids=[tokens[4]]))  # fmt: skip
        else:  # different lengths: requests leave the batch at different steps
            params.append(SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True))
    want = run_all(engine(tiny_llama, "off"), prompts, params)
    overlapped = engine(tiny_llama, "on")
    assert run_all(overlapped, prompts, params) == want
    assert overlapped.stepper.num_overlapped_steps > 0
    assert_idle(overlapped)


def test_stop_strings_and_context_length(tiny_llama: Path) -> None:
    off, on = (engine(tiny_llama, mode, max_model_len=40) for mode in ("off", "on"))
    prompt = list(range(5, 30))
    text = off.tokenizer.decode(run_all(off, [prompt], [SamplingParams(
        max_tokens=15, temperature=0.0, ignore_eos=True)])[0])  # fmt: skip
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = [
        SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True, stop=[stop]),
        SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True),  # hits 40 tokens
    ]
    assert run_all(on, [prompt, prompt[:-3]], params) == run_all(off, [prompt, prompt[:-3]],
                                                                  params)  # fmt: skip
    assert_idle(on)


def test_admissions_and_aborts_while_a_step_is_in_flight(tiny_llama: Path) -> None:
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]
    want = run_all(engine(tiny_llama, "off"), prompts[1:], [greedy] * 3)
    eng = engine(tiny_llama, "on")
    first = eng.add_request(prompts[0], greedy)
    second = eng.add_request(prompts[1], greedy)
    outputs: dict[str, list[int]] = {}
    late: list[str] = []
    for step in range(60):
        for out in eng.step():
            if out.finished:
                outputs[out.rid] = out.output_ids
        if step == 3:
            assert isinstance(eng.stepper, OverlapStepper) and eng.stepper.pending is not None
            eng.abort(first.rid)  # its in-flight token is dropped, its pages go back
        if step in (5, 9):  # arrive mid-decode: the overlap pauses for their admission
            late.append(eng.add_request(prompts[2 + len(late)], greedy).rid)
        if not eng.has_unfinished:
            break
    assert [outputs[second.rid], outputs[late[0]], outputs[late[1]]] == want
    assert first.rid not in outputs
    assert_idle(eng)


def test_sampled_requests_among_greedy_ones(tiny_llama: Path) -> None:
    prompts = [list(range(3, 20)), list(range(40, 52)), list(range(60, 75))]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    ]
    eng = engine(tiny_llama, "on")
    assert run_all(eng, prompts, params) == run_all(engine(tiny_llama, "off"), prompts, params)
    assert_idle(eng)


@pytest.mark.parametrize("hicache", [False, True], ids=["radix", "radix+L2"])
def test_next_turn_hits_the_cache_the_same_way(tiny_llama: Path, hicache: bool) -> None:
    greedy = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    flags = {"enable_hierarchical_cache": True} if hicache else {}
    off, on = (engine(tiny_llama, mode, **flags) for mode in ("off", "on"))
    history: list[int] = list(range(7, 30))
    for _ in range(3):
        (got,) = run_all(on, [history], [greedy])
        assert [got] == run_all(off, [history], [greedy])
        history = history + got + [1, 2, 3]
    assert on.load().num_cached_pages == off.load().num_cached_pages
    assert_idle(on)
