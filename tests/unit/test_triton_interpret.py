"""The Triton kernels (paged attention, fused elementwise ops) run on CPU tensors under
TRITON_INTERPRET=1 and match the torch references: kernel logic is checked without a
GPU. The interpreter must be on before triton is first imported, so one driver test runs
this file's kernel tests in a child pytest with it set (they skip in the parent). bf16
is left to tests/gpu (the interpreter's bf16 dot is not faithful)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kvstrata.attention.base import KVDestination
from kvstrata.attention.torch_ref import TorchAttention
from kvstrata.model import layers
from kvstrata.model.layers import TORCH_OPS, RotaryEmbedding

pytest.importorskip("triton", minversion="3.7")  # older interpreters break on numpy >= 2.4

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_child = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET child")


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


paged_cases = _load(
    "kvstrata_tests_paged_cases", Path(__file__).parents[1] / "gpu" / "paged_cases.py"
)


@pytest.mark.skipif(INTERPRETED, reason="this is the driver")
def test_kernels_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.fixture
def kernels() -> dict[str, ModuleType]:
    from kvstrata.attention import triton_paged
    from kvstrata.model import triton_ops

    return {"triton_paged": triton_paged, "triton_ops": triton_ops}


@in_child
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("query_lens", "kv_lens", "page_size"),
    [
        ([1, 1, 1], [3, 40, 700], 16),  # ragged decode, split-K on the long one
        ([1, 20, 3], [17, 50, 3], 16),  # decode then extends with and without a prefix
        ([1, 70], [300, 150], 64),
    ],
)
def test_attention_kernels(
    kernels: dict[str, ModuleType],
    dtype: torch.dtype,
    query_lens: list[int],
    kv_lens: list[int],
    page_size: int,
) -> None:
    case = paged_cases.make_case(
        query_lens, kv_lens, page_size=page_size, num_q_heads=8, num_kv_heads=2,
        head_dim=16, dtype=dtype, device="cpu", seed=1,
    )  # fmt: skip
    ref_pool, test_pool = case.pools
    ref = TorchAttention(ref_pool).forward(0, case.q, case.k, case.v, case.scale, case.meta)
    backend = kernels["triton_paged"].TritonPagedAttention(test_pool)
    out = backend.forward(0, case.q, case.k, case.v, case.scale, case.meta)
    assert paged_cases.rel_error(out, ref) < (1e-5 if dtype == torch.float32 else 2e-3)
    assert torch.equal(ref_pool.k_cache[0], test_pool.k_cache[0])
    assert torch.equal(ref_pool.v_cache[0], test_pool.v_cache[0])


@in_child
def test_fused_ops(kernels: dict[str, ModuleType]) -> None:
    ops = kernels["triton_ops"].TRITON_OPS
    gen = torch.Generator().manual_seed(0)
    x, delta = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
    weight = 1 + 0.1 * torch.randn(96, generator=gen)
    close = paged_cases.rel_error
    assert close(ops.rms_norm(x, weight, 1e-6), TORCH_OPS.rms_norm(x, weight, 1e-6)) < 1e-6
    got = ops.add_rms_norm(x, delta, weight, 1e-6)
    want = TORCH_OPS.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(got[0], want[0]) and close(got[1], want[1]) < 1e-6
    q, k = torch.randn(7, 6, 16, generator=gen), torch.randn(7, 2, 16, generator=gen)
    cos, sin = RotaryEmbedding(16, 10000.0, None).cos_sin(torch.arange(3, 10))
    q_weight, k_weight = 1 + 0.1 * torch.randn(16, generator=gen), torch.ones(16)
    for weights in ((q_weight, k_weight), (None, None)):
        got = ops.qk_norm_rope(q, k, *weights, 1e-6, cos, sin)
        want = TORCH_OPS.qk_norm_rope(q, k, *weights, 1e-6, cos, sin)
        assert close(got[0], want[0]) < 1e-6 and close(got[1], want[1]) < 1e-6
        # The same with K/V written into a paged cache (slot -1: a padding row).
        v = torch.randn(7, 2, 16, generator=gen)
        slots = torch.tensor([5, 0, -1, 11, 2, 9, 7])
        caches = [KVDestination(torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16), slots)
                  for _ in range(2)]  # fmt: skip
        fused_q = ops.qk_norm_rope_store(q, k, v, *weights, 1e-6, cos, sin, caches[0])
        want_q = layers.qk_norm_rope_store(q, k, v, *weights, 1e-6, cos, sin, caches[1])
        assert close(fused_q, want_q) < 1e-6
        assert close(caches[0].k_cache, caches[1].k_cache) < 1e-6
        assert torch.equal(caches[0].v_cache, caches[1].v_cache)
        # Bit for bit what the unfused kernels store, and nothing at the padding row.
        k_cache = caches[0].k_cache.view(-1, 2, 16)
        assert torch.equal(k_cache[slots[slots >= 0]], got[1][slots >= 0])
        assert k_cache.abs().sum(dim=(1, 2)).count_nonzero() == 6
    gate, up = torch.randn(4, 2500, generator=gen), torch.randn(4, 2500, generator=gen)
    assert close(ops.silu_mul(gate, up), TORCH_OPS.silu_mul(gate, up)) < 1e-6
    row, weight, bias = (
        torch.randn(shape, generator=gen) for shape in ((1, 600), (70, 600), (70,))
    )
    assert close(ops.linear(row, weight, bias), TORCH_OPS.linear(row, weight, bias)) < 1e-6
    gate_up = torch.randn(1, 1200, generator=gen)  # one row: the fused SiLU-mul GEMV
    gate, up = gate_up.split(600, dim=-1)
    got = ops.silu_mul_linear(gate, up, weight)
    assert close(got, TORCH_OPS.silu_mul_linear(gate, up, weight)) < 1e-6
    assert torch.equal(got, ops.linear(ops.silu_mul(gate, up), weight, None))  # same order
