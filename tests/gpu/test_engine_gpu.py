"""The engine on CUDA: greedy tokens of a tiny fp32 model are identical with and without
CUDA graphs, with and without the overlapped decode schedule, with the triton and torch
attention backends, with fused and reference elementwise ops, and with programmatic
dependent launch on and off; mixed batches,
preemption and the graph size limit are exercised."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata import LLM, SamplingParams

pytest.importorskip("triton")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(num: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 90, (num,), generator=gen).tolist()
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n in lens]


def generate(model_dir: Path, batch: list[list[int]], **config: Any) -> list[list[int]]:
    config.setdefault("cuda_graph_max_bs", 16)  # fewer captures: faster tests
    config.setdefault("num_kv_pages", 256)  # small pools: test processes share the GPU
    llm = LLM(model_dir, device="cuda", dtype="float32", page_size=16, **config)
    outs = llm.generate(input_ids=batch, sampling_params=GREEDY)
    del llm
    torch.cuda.empty_cache()
    return [out.output_ids for out in outs]


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen3"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def test_cuda_graphs_do_not_change_tokens(model_dir: Path) -> None:
    batch = prompts(11)
    eager = generate(model_dir, batch, disable_cuda_graph=True)
    graphs = generate(model_dir, batch, cuda_graph_max_bs=8)  # 11 rows: some eager steps
    assert graphs == eager


def test_overlap_schedule_does_not_change_tokens(model_dir: Path) -> None:
    # 11 rows with graphs up to 8: follow-up steps both replayed and eager.
    batch = prompts(11, seed=4)
    sync = generate(model_dir, batch, overlap_schedule="off")
    assert generate(model_dir, batch, overlap_schedule="on", cuda_graph_max_bs=8) == sync
    assert generate(model_dir, batch, overlap_schedule="on", disable_cuda_graph=True) == sync


def test_own_compute_stream_does_not_change_tokens(model_dir: Path) -> None:
    # The seam of --compute-stream: graphs replayed and eager steps, overlap on and off.
    batch = prompts(11, seed=6)
    default = generate(model_dir, batch, compute_stream="default", cuda_graph_max_bs=8)
    assert generate(model_dir, batch, compute_stream="own", cuda_graph_max_bs=8) == default
    assert generate(model_dir, batch, compute_stream="own", overlap_schedule="off") == default


def test_triton_matches_torch_backend(model_dir: Path) -> None:
    batch = prompts(6, seed=1)
    torch_out = generate(
        model_dir, batch, attention_backend="torch", disable_fused_ops=True,
        disable_cuda_graph=True,
    )  # fmt: skip
    assert generate(model_dir, batch, attention_backend="triton") == torch_out
    assert generate(model_dir, batch, disable_fused_ops=True) == torch_out


def test_batch1_decode_paths_do_not_change_tokens(model_dir: Path) -> None:
    """One request at a time, so decode steps take the batch-1 GEMVs (SiLU-mul folded
    into the down projection's): the same tokens with programmatic dependent launch on and
    off, with and without graphs, and as the reference ops."""
    for prompt in prompts(3, seed=5):
        reference = generate(model_dir, [prompt], disable_fused_ops=True, disable_cuda_graph=True)
        assert generate(model_dir, [prompt], disable_pdl=True, disable_cuda_graph=True) == reference
        assert generate(model_dir, [prompt]) == reference


def test_mixed_batches_and_preemption(model_dir: Path) -> None:
    # A tiny pool and token budget force chunked prefill next to decodes, and preemption.
    batch = prompts(9, seed=2)
    small = generate(model_dir, batch, num_kv_pages=24, max_num_batched_tokens=64)
    big = generate(model_dir, batch, disable_cuda_graph=True)
    assert small == big


def test_cpu_reference_agrees(model_dir: Path) -> None:
    batch = prompts(4, seed=3)
    llm = LLM(model_dir, device="cpu", page_size=16)
    cpu = [o.output_ids for o in llm.generate(input_ids=batch, sampling_params=GREEDY)]
    assert generate(model_dir, batch) == cpu
