"""FP8 KV pages (`--kv-cache-dtype fp8_e4m3|fp8_e5m2`, issue 31) on the CPU reference path:
one byte a value in L1, L2 and L3 and on the PD wire (twice the pages from the same
bytes); PD with decode L1+L2+L3 in fp8 gives the unified fp8 engine's greedy tokens
exactly (fp32 compute); an L3 page written under one KV dtype is never read under the
other; a prefill and a decode rank of different KV dtypes are refused, naming both."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

from kvstrata import LLM
from kvstrata.config import ConfigError, EngineConfig
from kvstrata.disagg.wire import TaskRefused, parse_task
from kvstrata.engine.engine import Engine
from kvstrata.engine.memory import resolve_kv_dtype
from kvstrata.pd.prefill_endpoints import _task_limits

sys.path.insert(0, str(Path(__file__).parent))
from test_pd_engine import GREEDY, PAGE, serve_pd

# A unified rank with L1 + L2 + L3 (file; add hicache_storage_dir) that waits for L3 reads.
L3_FLAGS = {
    "page_size": PAGE,
    "num_kv_pages": 64,
    "enable_hierarchical_cache": True,
    "hicache_storage_backend": "file",
    "hicache_storage_prefetch_policy": "wait_complete",
    "hicache_prefetch_threshold": 4,
}


def fp8_pair(model: Path, kv_dtype: str, **decode_flags: object) -> tuple[Engine, Engine]:
    prefill = LLM(
        str(model),
        page_size=PAGE,
        disaggregation_mode="prefill",
        num_kv_pages=256,
        kv_cache_dtype=kv_dtype,
    ).engine
    decode = LLM(
        str(model),
        page_size=PAGE,
        disaggregation_mode="decode",
        disaggregation_decode_local_prefill="never",
        kv_cache_dtype=kv_dtype,
        **decode_flags,
    ).engine
    return prefill, decode


def test_the_flag_resolves_and_fp8_pages_take_half_the_bytes(tiny_llama: Path) -> None:
    cpu = torch.device("cpu")
    assert resolve_kv_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_dtype("fp8", torch.float32, cpu) == torch.float8_e4m3fn
    assert resolve_kv_dtype("fp8_e5m2", torch.bfloat16, cpu) == torch.float8_e5m2
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        EngineConfig.from_flags(model=str(tiny_llama), kv_cache_dtype="int4")
    sizes = {}
    for dtype in ("bf16", "fp8"):
        with LLM(
            str(tiny_llama), page_size=PAGE, kv_cache_size_gb=0.01, kv_cache_dtype=dtype
        ) as llm:
            sizes[dtype] = llm.engine.pool.num_pages
            assert llm.engine.pool.data.element_size() == (2 if dtype == "bf16" else 1)
            per_token = llm.engine.metrics()["kv_bytes_per_token"]  # as /metrics shows it
            assert per_token == llm.engine.pool.page_bytes // PAGE
    assert sizes["fp8"] // 2 == sizes["bf16"]  # the same bytes (to a page of rounding)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_pd_with_decode_tiers_in_fp8_equals_the_unified_fp8_engine(
    tiny_llama: Path, tmp_path: Path, kv_dtype: str
) -> None:
    """Two turns per conversation, the second through the decode rank's L1 + L2 + L3
    (a small L1, so pages go down the tiers), token for token as one unified fp8 engine."""
    rng = random.Random(31)
    firsts = [[rng.randrange(1, 500) for _ in range(rng.randint(9, 30))] for _ in range(6)]
    seconds = [p + [rng.randrange(1, 500) for _ in range(8)] for p in firsts]
    with LLM(str(tiny_llama), page_size=PAGE, num_kv_pages=256, kv_cache_dtype=kv_dtype) as one:
        want = [
            out.output_ids
            for out in one.generate(input_ids=firsts + seconds, sampling_params=GREEDY)
        ]
    prefill, decode = fp8_pair(
        tiny_llama,
        kv_dtype,
        num_kv_pages=40,  # about three conversations: pages go down to L2 and L3
        disaggregation_decode_enable_radix_cache=True,
        disaggregation_decode_enable_hicache=True,
        hicache_ratio=2,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "l3"),
    )
    try:
        got = [serve_pd(prefill, decode, prompt).output_ids for prompt in firsts + seconds]
        stats = decode.tiers.metrics()
    finally:
        prefill.close()
        decode.close()
    assert got == want
    assert stats["hicache_hit_tokens_l2"] + stats["hicache_hit_tokens_l3"] > 0
    assert decode.pool.data.dtype == prefill.pool.data.dtype == one.engine.pool.data.dtype


def test_l3_pages_of_one_kv_dtype_are_never_read_under_another(
    tiny_llama: Path, tmp_path: Path
) -> None:
    rng = random.Random(3)
    prompt = [rng.randrange(1, 500) for _ in range(64)]
    flags = L3_FLAGS
    pairs = (("auto", "fp8"), ("fp8", "auto"), ("fp8", "fp8_e5m2"), ("fp8", "fp8"))
    for index, (writer, reader) in enumerate(pairs):
        store = {"hicache_storage_dir": str(tmp_path / f"l3-{index}")}  # one L3 per pair
        with LLM(str(tiny_llama), kv_cache_dtype=writer, **flags | store) as llm:
            llm.generate(input_ids=[prompt], sampling_params=GREEDY)
            llm.engine.tiers.wait_io()  # type: ignore[attr-defined]
        with LLM(str(tiny_llama), kv_cache_dtype=reader, **flags | store) as llm:
            (out,) = llm.generate(input_ids=[prompt], sampling_params=GREEDY)
        assert (out.cache_usage.l3_tokens > 0) == (writer == reader), (writer, reader)


def test_a_pair_of_different_kv_dtypes_is_refused_naming_both(tiny_llama: Path) -> None:
    prefill = LLM(
        str(tiny_llama), page_size=PAGE, disaggregation_mode="prefill", num_kv_pages=64
    ).engine
    decode = LLM(
        str(tiny_llama),
        page_size=PAGE,
        disaggregation_mode="decode",
        num_kv_pages=64,
        kv_cache_dtype="fp8",
        disaggregation_decode_local_prefill="never",
    ).engine
    try:
        decode.add_request([5, 6, 7, 8, 9, 10], GREEDY)
        while not (tasks := decode.role.take_tasks()):
            decode.step()
        wire = parse_task(json.dumps(tasks[0].to_json()))  # what the prefill rank checks
        with pytest.raises(TaskRefused, match=r"float8_e4m3fn, this prefill rank's torch\.float32"):
            _task_limits(prefill).check(wire)
    finally:
        prefill.close()
        decode.close()
