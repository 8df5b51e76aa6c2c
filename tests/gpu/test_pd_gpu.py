"""PD on CUDA: the decode rank's L1 pool shared through a CUDA IPC handle. In one process
(engine level) and across real prefill/decode server processes; greedy fp32 output must
equal the unified engine's, and decode caching must hit."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from pd_harness import generate, start_decode, start_prefill
from test_pd_engine import GREEDY as PD_GREEDY
from test_pd_engine import serve_pd

from kvstrata import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
FP32 = {"dtype": "float32", "page_size": 4, "num_kv_pages": 256, "device": "cuda"}


def unified(model: Path, prompt: list[int]) -> list[int]:
    llm = LLM(str(model), disable_radix_cache=True, **FP32)
    return llm.generate(input_ids=[prompt], sampling_params=GREEDY)[0].output_ids


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
# (prefill device, decode device): one GPU, and each role on its own GPU.
DEVICE_PAIRS = [
    pytest.param("cuda", "cuda", id="one-gpu"),
    pytest.param("cuda:0", "cuda:1", id="two-gpus", marks=TWO_GPUS),
]


@pytest.mark.parametrize(("prefill_device", "decode_device"), DEVICE_PAIRS)
def test_pd_in_process_over_cuda_ipc(
    tiny_llama: Path, prefill_device: str, decode_device: str
) -> None:
    """Both engines in one process: the sender reaches the decode pool directly (CUDA
    cannot open a handle of its own process). Three turns of a conversation, then a
    repeated prompt served from decode L1."""
    prefill = LLM(
        str(tiny_llama), disaggregation_mode="prefill", **FP32 | {"device": prefill_device}
    ).engine
    decode = LLM(
        str(tiny_llama), disaggregation_mode="decode", disaggregation_decode_local_prefill="never",
        disaggregation_decode_enable_radix_cache=True, **FP32 | {"device": decode_device},
    ).engine  # fmt: skip
    if ":" in decode_device:
        assert (prefill.pool.data.device, decode.pool.data.device) == (
            torch.device(prefill_device), torch.device(decode_device)
        )  # fmt: skip
    assert "cuda_ipc" in decode.role.receiver.endpoint()
    reference = LLM(str(tiny_llama), disable_radix_cache=True, **FP32)

    def want(prompt: list[int]) -> list[int]:
        return reference.generate(input_ids=[prompt], sampling_params=PD_GREEDY)[0].output_ids

    rng = random.Random(3)
    history: list[int] = []
    for turn in range(3):
        history = history + [rng.randrange(500) for _ in range(17)]
        out = serve_pd(prefill, decode, history)
        assert out.output_ids == want(history)
        if turn > 0:
            assert out.cache_usage.l1_tokens > 0
        history = history + out.output_ids
    prompt = history[:45]
    first = serve_pd(prefill, decode, prompt)
    again = serve_pd(prefill, decode, prompt)
    assert first.output_ids == again.output_ids == want(prompt)
    assert again.cache_usage.transferred_tokens <= 4


@pytest.mark.parametrize(("prefill_device", "decode_device"), DEVICE_PAIRS)
def test_pd_across_processes_over_cuda_ipc(
    tiny_llama: Path, tmp_path: Path, prefill_device: str, decode_device: str
) -> None:
    prefill = start_prefill(
        tiny_llama, tmp_path / "p", "--dtype", "float32", "--device", prefill_device
    )
    decode = start_decode(
        tiny_llama, tmp_path / "d", [prefill.base_url], "--dtype", "float32",
        "--device", decode_device, "--disaggregation-decode-enable-radix-cache",
    )  # fmt: skip
    try:
        with httpx.Client(base_url=decode.base_url, timeout=120) as http:
            prompt = list(range(30, 75))
            for _ in range(2):
                body = generate(http, prompt).json()
                assert body["output_ids"] == unified(tiny_llama, prompt)
            assert body["usage"]["kvstrata"]["cached_tokens_l1"] == 44
    finally:
        assert decode.stop() == 0, decode.log()
        assert prefill.stop() == 0, prefill.log()


@pytest.mark.parametrize(("prefill_device", "decode_device"), DEVICE_PAIRS)
def test_ipc_kernel_write_equals_torch_write(prefill_device: str, decode_device: str) -> None:
    """The transport's Triton path (one kernel storing into the decode pool, across GPUs
    over peer access) against its torch gather/copy/scatter path, bit for bit."""
    from kvstrata.disagg.transport.ipc import IpcReceiver, IpcSender
    from kvstrata.kvcache.pages import KVPool

    dims = (16, 3, 2, 64)  # page size, layers, kv heads, head dim
    local = KVPool(40, *dims, torch.bfloat16, prefill_device)
    local.data.normal_()
    remotes = [KVPool(24, *dims, torch.bfloat16, decode_device) for _ in range(2)]
    src, dst = [39, 0, 17, 5, 22], [3, 23, 0, 11, 7]
    for remote, use_kernel in zip(remotes, (True, False)):
        sender = IpcSender(local, use_kernel=use_kernel)
        sender.write(IpcReceiver(remote, None).endpoint(), src, dst)
        assert not sender._direct_only, "the kernel path fell back to torch"
    assert torch.equal(remotes[0].data, remotes[1].data)
    assert remotes[0].data.abs().sum() > 0
    # Started rather than written: the kernel is queued and lands once its event fires.
    started = KVPool(24, *dims, torch.bfloat16, decode_device)
    pending = IpcSender(local).start(IpcReceiver(started, None).endpoint(), src, dst)
    while not pending.poll():
        pass
    assert torch.equal(started.data, remotes[0].data)
