"""Tensor-parallel ranks on CUDA (issue 32): NCCL between the workers, CUDA graphs and the
overlapped schedule captured with the all-reduces inside; TP 2 against TP 1 in fp32 (greedy
tokens equal, prompt logprobs within 1e-4); PD between TP 2 ranks (each worker's slice over
CUDA IPC, and over the Mooncake Transfer Engine) against one unified TP 2 rank. Those need
two GPUs (skipped on one); on one, an NCCL group of one runs every collective, eager and
captured in a CUDA graph."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata import LLM, SamplingParams
from kvstrata.model.tp import TPGroup, leader_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_pd_engine import serve_pd
from test_tp import assert_same
from test_tp_pd import DECODE_CACHE, SAMPLING, answers, conversations, pd_pair

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
ONE_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=0)


def outputs(model: Path, **flags: Any) -> list[Any]:
    prompts = [[(7 * i + n) % 500 + 1 for i in range(n)] for n in (3, 17, 40, 61, 90)]
    flags = {
        "page_size": 16,
        "num_kv_pages": 256,
        "dtype": "float32",
        "device": "cuda:0",
        "cuda_graph_max_bs": 8,
    } | flags
    with LLM(str(model), **flags) as llm:
        return llm.generate(input_ids=prompts, sampling_params=GREEDY)


@ONE_GPU
def test_an_nccl_group_of_one_runs_every_collective_eager_and_in_a_cuda_graph() -> None:
    """The NCCL path as far as one device goes: the group a TP rank's workers form (its
    store, NCCL compute and gloo control groups), each collective the model runs, eager
    and captured in a CUDA graph as the model's are, then replayed on new inputs."""
    device = torch.device("cuda:0")
    group = TPGroup(leader_store("127.0.0.1", 1, 60.0), 0, 1, device, 60.0)
    try:
        x = torch.randn(4, 64, device=device)
        assert torch.equal(group.all_reduce(x.clone()), x)
        assert torch.equal(group.all_reduce_max(x.clone()), x)
        assert torch.equal(group.all_gather_last(x), x)
        assert torch.equal(group.broadcast_tensor(x.clone()), x)
        assert group.broadcast_object({"step": 1}) == {"step": 1}
        assert group.min_over_group(7) == 7
        static = x.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm up off the capture, as graph capture asks
            group.all_reduce(static.clone() * 2)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            summed = group.all_reduce(static * 2)
            gathered = group.all_gather_last(static)
        new = torch.randn(4, 64, device=device)
        static.copy_(new)
        graph.replay()
        torch.cuda.synchronize(device)
        assert torch.equal(summed, new * 2) and torch.equal(gathered, new)
    finally:
        group.close()


@TWO_GPUS
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_tp2_equals_tp1_on_cuda(tiny_qwen3: Path, graphs: bool) -> None:
    flags = {"disable_cuda_graph": not graphs}
    want, got = outputs(tiny_qwen3, **flags), outputs(tiny_qwen3, tp_size=2, **flags)
    assert_same(want, got)


@TWO_GPUS
@pytest.mark.parametrize("transport", ["ipc", "mooncake"])
def test_pd_between_tp2_ranks_on_cuda_equals_the_unified_tp2_rank(
    tiny_qwen3: Path, transport: str
) -> None:
    flags = {"page_size": 16, "dtype": "float32", "tp_size": 2, "device": "cuda:0"}
    prompts = conversations(36)
    with LLM(str(tiny_qwen3), num_kv_pages=256, **flags) as llm:
        want = answers(llm.engine, prompts)
    prefill, decode = pd_pair(tiny_qwen3, transport, flags, **DECODE_CACHE)
    try:
        got = [serve_pd(prefill, decode, prompt, SAMPLING) for prompt in prompts]
    finally:
        prefill.close()
        decode.close()
    assert_same(want, got, "logprobs")
