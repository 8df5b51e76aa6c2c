"""Tensor-parallel ranks on the CPU (issue 32): `--tp-size N` runs N worker processes over
gloo, each with its shard of heads, MLP and vocabulary and its head slice of every L1, L2
and L3 page; one scheduler on the leader, whose L1 <-> L2 copies and L3 reads and writes
every worker mirrors, and whose fp8 scale calibration every worker joins. Against TP 1 in
fp32: prompt logprobs within 1e-4 and greedy tokens equal (tiny Llama and Qwen3 at TP 2,
SmolLM2 at TP 3: 9 heads, 3 KV heads), through chunked prefill, preemption and aborts with
every invariant holding; what does not divide is refused naming the
flag; a dead follower stops the rank's next step with an error naming it; the overlapped
schedule's device-side input ids reach every worker."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from real_model import smollm2  # noqa: F401 - the session fixture

from kvstrata import LLM, SamplingParams
from kvstrata.config import ConfigError
from kvstrata.engine.invariants import check_engine
from kvstrata.engine.tp_runner import WorkerLost

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=0)


def outputs(model: Path, prompts: list[list[int]], **flags: Any) -> list[Any]:
    flags = {"page_size": 4, "num_kv_pages": 128, "dtype": "float32"} | flags
    with LLM(str(model), **flags) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        assert check_engine(llm.engine).violations == []
    return outs


def assert_same(want: list[Any], got: list[Any], logprobs: str = "prompt_logprobs") -> None:
    """Greedy tokens equal, and the `logprobs` field's values within 1e-4."""
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    gaps = [
        abs(a.logprob - b.logprob)
        for w, g in zip(want, got)
        for a, b in zip(getattr(w, logprobs), getattr(g, logprobs))
    ]
    assert max(gaps) < 1e-4, max(gaps)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_tp2_equals_tp1(arch: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(arch)
    prompts = [[(7 * i + n) % 500 + 1 for i in range(n)] for n in (3, 17, 40, 61)]
    # Small steps and a small pool: chunked prefill, and preemption of a running request.
    flags = {"max_num_batched_tokens": 24, "num_kv_pages": 40}
    assert_same(outputs(model, prompts, **flags), outputs(model, prompts, tp_size=2, **flags))


def test_overlapped_decode_broadcasts_its_device_ids(tiny_llama: Path) -> None:
    """The overlapped schedule's decode steps take their input ids on the device from the
    step before: the leader broadcasts them to the followers."""
    prompts = [[3 + i for i in range(n)] for n in (5, 17, 40)]
    flags = {"overlap_schedule": "on"}
    assert_same(
        outputs(tiny_llama, prompts, **flags), outputs(tiny_llama, prompts, tp_size=2, **flags)
    )


def test_tp2_with_l2_equals_tp1_and_hits_l2(tiny_qwen3: Path) -> None:
    """A small L1 over an L2: second turns find their first turns' pages in host memory,
    loaded back on every worker's slice (the leader's copier calls, mirrored)."""
    firsts = [[(5 * i + n) % 500 + 1 for i in range(n)] for n in (30, 41, 52, 63)]
    seconds = [[*p, 9, 8, 7, 6, 5] for p in firsts]
    flags = {"num_kv_pages": 32, "enable_hierarchical_cache": True, "hicache_ratio": 4}
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)  # prefix hits
    runs = []
    for tp in (1, 2):
        with LLM(str(tiny_qwen3), page_size=4, dtype="float32", tp_size=tp, **flags) as llm:
            outs = llm.generate(input_ids=firsts, sampling_params=plain)
            outs += llm.generate(input_ids=seconds, sampling_params=plain)
            assert llm.engine.tiers.metrics()["hicache_hit_tokens_l2"] > 0
            assert check_engine(llm.engine).violations == []
        runs.append([out.output_ids for out in outs])
    assert runs[1] == runs[0]


def test_tp2_with_l3_restores_every_slice(tiny_qwen3: Path, tmp_path: Path) -> None:
    """L1 + L2 + L3 (file), the cache flushed between turns: second turns are served
    from L3, each worker reading its own slice of each page (keys salted by slice), as TP
    1 serves them; a TP 1 rank over the same directory reads none of the TP 2 slices."""
    firsts = [[(5 * i + n) % 500 + 1 for i in range(n)] for n in (30, 41, 52)]
    seconds = [[*p, 9, 8, 7, 6, 5] for p in firsts]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    flags = {
        "page_size": 4,
        "dtype": "float32",
        "num_kv_pages": 64,
        "hicache_ratio": 2,
        "enable_hierarchical_cache": True,
        "hicache_storage_backend": "file",
        "hicache_storage_prefetch_policy": "wait_complete",
        "hicache_prefetch_threshold": 4,
    }
    runs = []
    for tp in (1, 2):
        store = {"hicache_storage_dir": str(tmp_path / f"tp{tp}")}
        with LLM(str(tiny_qwen3), tp_size=tp, **flags, **store) as llm:
            outs = llm.generate(input_ids=firsts, sampling_params=plain)
            llm.engine.tiers.wait_io()  # type: ignore[attr-defined]
            assert llm.engine.flush_cache()
            outs += llm.generate(input_ids=seconds, sampling_params=plain)
            assert llm.engine.tiers.metrics()["hicache_hit_tokens_l3"] > 0
            assert check_engine(llm.engine).violations == []
        runs.append([out.output_ids for out in outs])
    assert runs[1] == runs[0]
    with LLM(str(tiny_qwen3), **flags, hicache_storage_dir=str(tmp_path / "tp2")) as llm:
        (out,) = llm.generate(input_ids=[seconds[0]], sampling_params=plain)
        assert out.cache_usage.l3_tokens == 0


def test_calibrated_fp8_scales_are_the_whole_models(tiny_llama: Path, tmp_path: Path) -> None:
    """--kv-scales-calibrate on a TP rank: every worker runs the pass on its heads and the
    largest values are taken over the group, so the scales (and tokens) are TP 1's."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["a", "page", "of", "the", "cache", "holds", "tokens"] * 80))
    fp8 = {"kv_cache_dtype": "fp8", "kv_scales_calibrate": 200, "kv_scales_text": str(text)}
    prompts = [[(3 * i + n) % 500 + 1 for i in range(n)] for n in (7, 33)]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs, scales = [], []
    for tp in (1, 2):
        with LLM(str(tiny_llama), page_size=4, num_kv_pages=64, tp_size=tp, **fp8) as llm:
            scales.append(llm.engine.pool.scales)
            outs = llm.generate(input_ids=prompts, sampling_params=plain)
        runs.append([out.output_ids for out in outs])
    assert scales[1] == scales[0] and not scales[0].is_unit
    assert runs[1] == runs[0]


def test_smollm2_tp3_equals_tp1(smollm2: Path) -> None:  # noqa: F811
    prompts = [[(13 * i + n) % 4000 + 10 for i in range(n)] for n in (9, 50)]
    assert_same(outputs(smollm2, prompts), outputs(smollm2, prompts, tp_size=3))


def test_aborts_leave_every_worker_consistent(tiny_llama: Path) -> None:
    with LLM(str(tiny_llama), page_size=4, num_kv_pages=64, dtype="float32", tp_size=2) as llm:
        engine = llm.engine
        reqs = [engine.add_request([5 + i] * (10 + i), GREEDY) for i in range(4)]
        for _ in range(3):
            engine.step()
        engine.abort(reqs[1].rid)
        engine.abort(reqs[3].rid)
        while engine.has_unfinished:
            engine.step()
        assert check_engine(engine).violations == []
        (out,) = llm.generate(input_ids=[[9, 8, 7, 6]], sampling_params=GREEDY)
    (want,) = outputs(tiny_llama, [[9, 8, 7, 6]])
    assert out.output_ids == want.output_ids


def test_what_does_not_divide_is_refused(tiny_llama: Path) -> None:
    model = str(tiny_llama)  # 4 heads, 2 KV heads
    with pytest.raises(
        ConfigError, match=r"num_attention_heads \(4\) is not divisible by --tp-size 3"
    ):
        LLM(model, page_size=4, num_kv_pages=16, tp_size=3)
    with pytest.raises(ConfigError, match="--tp-size must be >= 1"):
        LLM(model, tp_size=0)


def test_a_dead_follower_stops_the_rank_naming_it(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), page_size=4, num_kv_pages=32, dtype="float32", tp_size=2)
    try:
        runner = llm.engine.runner
        (follower,) = runner.workers.procs  # type: ignore[union-attr]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(10)
        with pytest.raises(WorkerLost, match=r"worker kvstrata-tp1 \(pid \d+\) exited"):
            llm.generate(input_ids=[[1, 2, 3]], sampling_params=GREEDY)
    finally:
        llm.close()
