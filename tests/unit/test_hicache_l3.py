"""L3 through the engine (file backend, CPU): after a flush the next request is served
from storage with identical greedy output; two engines share one directory; corrupt,
foreign and unwritable storage only ever cost misses."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from kvstrata import LLM, RequestOutput, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompts(seed: int = 0, num: int = 3, length: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(length)] for _ in range(num)]


def hicache_llm(model: Path, directory: Path, **extra: object) -> LLM:
    options: dict[str, object] = dict(
        page_size=4,
        num_kv_pages=256,
        enable_hierarchical_cache=True,
        hicache_storage_backend="file",
        hicache_storage_dir=str(directory),
        hicache_storage_prefetch_policy="wait_complete",
        hicache_prefetch_threshold=4,
    )
    options.update(extra)
    return LLM(str(model), **options)


def expected_outputs(model: Path, batch: list[list[int]]) -> list[list[int]]:
    reference = LLM(str(model), page_size=4, disable_radix_cache=True)
    return [o.output_ids for o in reference.generate(input_ids=batch, sampling_params=GREEDY)]


def run(llm: LLM, batch: list[list[int]]) -> list[RequestOutput]:
    return [llm.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in batch]


def test_flush_then_reuse_from_l3(tiny_llama: Path, tmp_path: Path) -> None:
    batch = prompts()
    expected = expected_outputs(tiny_llama, batch)
    llm = hicache_llm(tiny_llama, tmp_path / "l3")
    assert [o.output_ids for o in run(llm, batch)] == expected
    assert llm.engine.flush_cache()  # waits for the L3 writes, drops L1 and L2
    outs = run(llm, batch)
    assert [o.output_ids for o in outs] == expected
    for out in outs:  # 69 matchable tokens -> 68 in whole pages, all from L3
        assert (out.cache_usage.l1_tokens, out.cache_usage.l2_tokens) == (0, 0)
        assert out.cache_usage.l3_tokens == 68
    assert llm.engine.tiers.stats.hit_tokens_l3 == 3 * 68
    assert llm.engine.load().num_used_pages == 0


def test_second_engine_reuses_pages_of_the_first(tiny_llama: Path, tmp_path: Path) -> None:
    batch = prompts(1)
    expected = expected_outputs(tiny_llama, batch)
    first = hicache_llm(tiny_llama, tmp_path / "shared")
    run(first, batch)
    first.engine.tiers.wait_io()
    second = hicache_llm(tiny_llama, tmp_path / "shared")
    outs = run(second, batch)
    assert [o.output_ids for o in outs] == expected
    assert all(o.cache_usage.l3_tokens == 68 for o in outs)


def page_files(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.kvpage"))


def test_corrupt_page_is_a_miss(tiny_llama: Path, tmp_path: Path) -> None:
    batch = prompts(2, num=1)
    expected = expected_outputs(tiny_llama, batch)
    llm = hicache_llm(tiny_llama, tmp_path / "l3")
    run(llm, batch)
    llm.engine.flush_cache()
    files = page_files(tmp_path / "l3")
    assert len(files) == 19  # (70 prompt + 8 output - 1 uncomputed) // 4
    for path in files:  # flip one payload byte in every page
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    (out,) = run(llm, batch)
    assert out.output_ids == expected[0]
    assert out.cache_usage.l3_tokens == 0
    storage = llm.engine.tiers.l3.backend
    assert storage.stats().num_corrupt_pages >= 1


def test_foreign_namespace_page_is_a_miss(tiny_llama: Path, tmp_path: Path) -> None:
    batch = prompts(3, num=1)
    expected = expected_outputs(tiny_llama, batch)
    ours = hicache_llm(tiny_llama, tmp_path / "ours")
    run(ours, batch)
    ours.engine.flush_cache()
    theirs = hicache_llm(tiny_llama, tmp_path / "theirs", cache_salt="another-model")
    run(theirs, batch)
    theirs.engine.tiers.wait_io()
    # Put the other namespace's pages under our keys: same tokens, different namespace.
    for our_path, their_path in zip(page_files(tmp_path / "ours"), page_files(tmp_path / "theirs")):
        shutil.copyfile(their_path, our_path)
    (out,) = run(ours, batch)
    assert out.output_ids == expected[0]
    assert out.cache_usage.l3_tokens == 0
    assert ours.engine.tiers.l3.backend.stats().num_corrupt_pages >= 1


def test_unwritable_storage_still_serves(tiny_llama: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the L3 directory should be")
    batch = prompts(4, num=2)
    expected = expected_outputs(tiny_llama, batch)
    llm = hicache_llm(tiny_llama, blocker / "l3")
    assert [o.output_ids for o in run(llm, batch)] == expected
    llm.engine.flush_cache()
    outs = run(llm, batch)
    assert [o.output_ids for o in outs] == expected
    assert all(o.cache_usage.l3_tokens == 0 for o in outs)
    assert llm.engine.tiers.l3.backend.stats().num_set_failures > 0


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_other_prefetch_policies_stay_correct(
    tiny_llama: Path, tmp_path: Path, policy: str
) -> None:
    batch = prompts(5)
    expected = expected_outputs(tiny_llama, batch)
    llm = hicache_llm(tiny_llama, tmp_path / "l3", hicache_storage_prefetch_policy=policy)
    run(llm, batch)
    llm.engine.flush_cache()
    assert [o.output_ids for o in run(llm, batch)] == expected
    assert llm.engine.load().num_used_pages == 0
