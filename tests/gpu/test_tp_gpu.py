"""Tensor-parallel ranks on CUDA (issue 32): NCCL between the workers, CUDA graphs and the
overlapped schedule captured with the all-reduces inside; TP 2 against TP 1 in fp32 (greedy
tokens equal, prompt logprobs within 1e-4); PD between TP 2 ranks (each worker's slice over
CUDA IPC, and over the Mooncake Transfer Engine) against one unified TP 2 rank. Needs two
GPUs: skipped on one."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_pd_engine import serve_pd
from test_tp import assert_same
from test_tp_pd import DECODE_CACHE, SAMPLING, answers, conversations, pd_pair

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
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


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_tp2_equals_tp1_on_cuda(tiny_qwen3: Path, graphs: bool) -> None:
    flags = {"disable_cuda_graph": not graphs}
    want, got = outputs(tiny_qwen3, **flags), outputs(tiny_qwen3, tp_size=2, **flags)
    assert_same(want, got)


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
