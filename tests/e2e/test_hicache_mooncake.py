"""HiCache with a real Mooncake Store as L3 (the test starts `mooncake_master`): flush
then reuse from L3 with identical greedy output, and a master killed mid-run costs only
misses (counted), never a failed request or a wrong token."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from mooncake_fixtures import MooncakeMaster

from kvstrata import LLM, SamplingParams

PAGE = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def mooncake_llm(model: Path, master: MooncakeMaster) -> LLM:
    return LLM(
        str(model), page_size=PAGE, num_kv_pages=256, enable_hierarchical_cache=True,
        hicache_storage_backend="mooncake",
        hicache_storage_backend_extra_config=json.dumps(master.storage_options(timeout_s=2)),
        hicache_storage_prefetch_policy="wait_complete", hicache_prefetch_threshold=4,
    )  # fmt: skip


def run(llm: LLM, prompts: list[list[int]]) -> list:
    return [llm.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in prompts]


def expected(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model), page_size=PAGE, disable_radix_cache=True, num_kv_pages=256)
    return [o.output_ids for o in llm.generate(input_ids=prompts, sampling_params=GREEDY)]


def test_flush_then_reuse_from_mooncake(tiny_llama: Path, mooncake_master: MooncakeMaster) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(500) for _ in range(50)] for _ in range(3)]
    want = expected(tiny_llama, prompts)
    llm = mooncake_llm(tiny_llama, mooncake_master)
    assert [o.output_ids for o in run(llm, prompts)] == want
    assert llm.engine.flush_cache()
    outs = run(llm, prompts)
    assert [o.output_ids for o in outs] == want
    assert all(o.cache_usage.l3_tokens == 48 for o in outs)  # 49 matchable -> 48
    assert llm.engine.tiers.metrics()["hicache_l3_num_hits"] >= 3 * 12
    llm.engine.close()


def test_master_killed_mid_run_costs_only_misses(
    tiny_llama: Path, mooncake_master: MooncakeMaster
) -> None:
    rng = random.Random(8)
    prompts = [[rng.randrange(500) for _ in range(50)] for _ in range(4)]
    want = expected(tiny_llama, prompts)
    llm = mooncake_llm(tiny_llama, mooncake_master)
    assert [o.output_ids for o in run(llm, prompts[:2])] == want[:2]
    mooncake_master.kill()
    assert llm.engine.flush_cache()  # L3 writes now fail or time out: counted, not raised
    outs = run(llm, prompts)
    assert [o.output_ids for o in outs] == want
    assert all(o.cache_usage.l3_tokens == 0 for o in outs)
    metrics = llm.engine.tiers.metrics()
    assert metrics["hicache_l3_num_errors"] + metrics["hicache_l3_num_set_failures"] > 0
    load = llm.engine.load()
    assert load.num_used_pages == 0 and llm.engine.cache.num_locked_pages == 0
    # The master comes back: the same engine writes and reads L3 again.
    mooncake_master.start()
    fresh = [random.Random(9).randrange(500) for _ in range(50)]
    (fresh_want,) = expected(tiny_llama, [fresh])
    deadline = time.monotonic() + 60
    while True:  # the client re-registers with the new master within a few seconds
        (out,) = run(llm, [fresh])
        assert out.output_ids == fresh_want
        assert llm.engine.flush_cache()
        (again,) = run(llm, [fresh])
        assert again.output_ids == fresh_want
        if again.cache_usage.l3_tokens == 48 or time.monotonic() > deadline:
            break
        fresh = [t + 1 for t in fresh]
        (fresh_want,) = expected(tiny_llama, [fresh])
    assert again.cache_usage.l3_tokens == 48
    llm.engine.close()
