"""The correctness invariant on CPU: greedy tokens are identical to transformers, and
identical whether the prefix came from the cache or was computed, whatever the batching,
chunking or preemption."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvstrata import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def random_prompts(seed: int, lengths: list[int], vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def assert_idle(llm: LLM) -> None:
    """Nothing leaked: no request left, every page free or cached, no lock held."""
    load = llm.engine.load()
    assert load.num_running_reqs == 0 and load.num_waiting_reqs == 0
    assert load.num_used_pages == 0
    assert llm.engine.cache.num_locked_pages == 0
    assert load.num_free_pages + load.num_cached_pages == load.num_total_pages


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_transformers(arch: str, tiny_llama: Path, tiny_qwen3: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = tiny_llama if arch == "llama" else tiny_qwen3
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = random_prompts(1, [1, 9, 40, 130])
    llm = LLM(str(model_dir), page_size=4)
    outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert out.output_ids == ref[0, len(prompt) :].tolist()
    assert_idle(llm)


def test_radix_cache_hits_give_identical_output(tiny_llama: Path) -> None:
    """Full hit, partial hit, a hit ending mid-page, and a next turn that extends the
    previous prompt + answer: outputs equal the cache-off engine's, with exact hits."""
    page_size = 4
    (base,) = random_prompts(2, [30])
    (other,) = random_prompts(3, [20])
    cached = LLM(str(tiny_llama), page_size=page_size)
    uncached = LLM(str(tiny_llama), page_size=page_size, disable_radix_cache=True)

    first = cached.generate(input_ids=[base], sampling_params=GREEDY)[0]
    assert first.cached_tokens == 0
    next_turn = base + first.output_ids + other
    cases = [
        (base, 28),  # full hit: all but the last token, rounded down to a page
        (base[:17] + other, 16),  # partial hit ending mid-page (17 shared tokens)
        (base[:8] + other, 8),  # partial hit on a page boundary
        (next_turn, 44),  # the next turn hits prompt + answer: 30 + 15 computed -> 44
    ]
    for prompt, expected_hit in cases:
        hit = cached.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
        miss = uncached.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
        assert hit.cached_tokens == expected_hit
        assert miss.cached_tokens == 0
        assert hit.output_ids == miss.output_ids
    assert_idle(cached)
    assert_idle(uncached)
    assert uncached.engine.load().num_cached_pages == 0


def test_batch_of_16_equals_one_at_a_time(tiny_llama: Path) -> None:
    prompts = random_prompts(4, [5 + 7 * i for i in range(16)])
    llm = LLM(str(tiny_llama), page_size=8, disable_radix_cache=True)
    batched = llm.generate(input_ids=prompts, sampling_params=GREEDY)
    alone = [llm.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
    assert [o.output_ids for o in batched] == [o.output_ids for o in alone]
    assert_idle(llm)


def test_chunked_prefill_on_and_off_agree(tiny_llama: Path) -> None:
    prompts = random_prompts(5, [100, 37, 64, 3])
    chunked = LLM(str(tiny_llama), page_size=4, max_num_batched_tokens=16)
    whole = LLM(
        str(tiny_llama), page_size=4, max_num_batched_tokens=16, enable_chunked_prefill=False
    )
    reference = LLM(str(tiny_llama), page_size=4, disable_radix_cache=True)
    expected = [o.output_ids for o in reference.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert [o.output_ids for o in chunked.generate(input_ids=prompts, sampling_params=GREEDY)] == (
        expected
    )
    assert [o.output_ids for o in whole.generate(input_ids=prompts, sampling_params=GREEDY)] == (
        expected
    )
    assert_idle(chunked)
    assert_idle(whole)


def test_every_output_of_a_request_reports_its_cache_usage(tiny_llama: Path) -> None:
    """The engine reuses a request's CacheUsage after its first token; every output
    reports the same hit, including across a preemption, and nothing is kept after a
    request finishes or is aborted."""
    (base,) = random_prompts(4, [30])
    engine = LLM(str(tiny_llama), page_size=4, num_kv_pages=24).engine
    engine.add_request(base, GREEDY)
    while engine.has_unfinished:
        engine.step()
    usages: dict[str, set[int]] = {}
    hit = engine.add_request(base, SamplingParams(max_tokens=40, temperature=0.0,
                                                  ignore_eos=True))  # fmt: skip
    others = [engine.add_request(p, GREEDY) for p in random_prompts(5, [20, 26])]
    for step in range(200):
        for out in engine.step():
            usages.setdefault(out.rid, set()).add(out.cached_tokens)
        if step == 15:
            assert engine.abort(others[1].rid) is not None  # still in flight
        if not engine.has_unfinished:
            break
    assert usages[hit.rid] == {28}  # all but the last token, rounded down to a page
    assert usages[others[0].rid] == {0}
    assert engine.scheduler.num_preemptions > 0
    assert not engine._cache_usage


@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_preemption_gives_identical_output(tiny_llama: Path, disable_radix_cache: bool) -> None:
    prompts = random_prompts(6, [30, 25, 33, 28, 31, 27])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(tiny_llama), page_size=4, disable_radix_cache=True)
    # 15 pages of 4 tokens hold one 57-token request but never all six at once.
    tight = LLM(
        str(tiny_llama), page_size=4, num_kv_pages=30, disable_radix_cache=disable_radix_cache
    )
    expected = [o.output_ids for o in roomy.generate(input_ids=prompts, sampling_params=params)]
    got = [o.output_ids for o in tight.generate(input_ids=prompts, sampling_params=params)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert_idle(tight)


def test_text_prompts_and_finish_reasons(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=4)
    (out,) = llm.generate(["Hello there"], SamplingParams(max_tokens=5, temperature=0.0))
    assert out.finish_reason is not None
    assert len(out.output_ids) <= 5
    assert out.text == llm.tokenizer.decode(out.output_ids)
    # A stop token id: generation ends at the first occurrence of the 3rd greedy token.
    (ref,) = llm.generate(input_ids=[[1, 2, 3]], sampling_params=GREEDY)
    stop_id = ref.output_ids[2]
    first = ref.output_ids.index(stop_id)
    (stopped,) = llm.generate(
        input_ids=[[1, 2, 3]],
        sampling_params=SamplingParams(
            max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]
        ),
    )
    assert stopped.output_ids == ref.output_ids[: first + 1]
    assert stopped.finish_reason.value == "stop"
    assert_idle(llm)


def test_stop_string_cuts_text(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    (ref,) = llm.generate(["The cache"], params)
    text = ref.text
    printable = [i for i in range(2, len(text) - 2) if text[i : i + 2].isprintable()]
    assert printable, f"no printable stretch in {text!r}"
    stop = text[printable[0] : printable[0] + 2]
    (cut,) = llm.generate(
        ["The cache"], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    )
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason.value == "stop"
    assert_idle(llm)


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=4)
    prompts = random_prompts(7, [10, 20, 30])
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    alone = llm.generate(input_ids=[prompts[1]], sampling_params=seeded)[0]
    together = llm.generate(input_ids=prompts, sampling_params=seeded)[1]
    assert alone.output_ids == together.output_ids
    top1 = SamplingParams(max_tokens=12, temperature=0.7, top_k=1, ignore_eos=True)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert (
        llm.generate(input_ids=prompts, sampling_params=top1)[0].output_ids
        == llm.generate(input_ids=prompts, sampling_params=greedy)[0].output_ids
    )
    assert_idle(llm)


def test_invalid_arguments_name_the_problem(tiny_llama: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such model directory"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--page-size"):
        LLM(str(tiny_llama), page_size=0)
    with pytest.raises(ValueError, match="--dtype"):
        LLM(str(tiny_llama), dtype="int3")
    with pytest.raises(TypeError):
        LLM(str(tiny_llama), no_such_option=1)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLM(str(tmp_path))
    llm = LLM(str(tiny_llama), page_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="longer than the context length"):
        llm.generate(input_ids=[[1] * 60], sampling_params=SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(input_ids=[[1, 10**6]])
    with pytest.raises(ValueError, match="empty"):
        llm.generate(input_ids=[[]])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert_idle(llm)  # a rejected batch queues nothing
