"""The fused Triton elementwise ops against the torch reference ops (TORCH_OPS)."""

from __future__ import annotations

import pytest
import torch
from paged_cases import rel_error

from kvstrata.model.layers import TORCH_OPS, ModelOps, RotaryEmbedding

triton_ops = pytest.importorskip("kvstrata.model.triton_ops")
OPS = triton_ops.TRITON_OPS
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 37, 1000])
def test_fused_ops_match_reference(dtype: torch.dtype, num_tokens: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(shape, generator=gen, device="cuda")).to(dtype)

    tol = TOLERANCE[dtype]
    hidden, weight = rand(num_tokens, 1024), 1 + rand(1024, std=0.1)
    eps = 1e-6
    assert (
        rel_error(OPS.rms_norm(hidden, weight, eps), TORCH_OPS.rms_norm(hidden, weight, eps)) < tol
    )
    delta = rand(num_tokens, 1024)
    got = OPS.add_rms_norm(hidden, delta, weight, eps)
    want = TORCH_OPS.add_rms_norm(hidden, delta, weight, eps)
    assert torch.equal(got[0], want[0])
    assert rel_error(got[1], want[1]) < tol

    # q/k as strided views of one fused projection, as a fused qkv layout would give.
    qkv = rand(num_tokens, (16 + 2 * 8) * 128)
    q = qkv[:, : 16 * 128].view(num_tokens, 16, 128)
    k = qkv[:, 16 * 128 : 24 * 128].view(num_tokens, 8, 128)
    rope = RotaryEmbedding(128, 1e6, None).cuda()
    cos, sin = rope.cos_sin(torch.randint(0, 40000, (num_tokens,), device="cuda"))
    q_weight, k_weight = 1 + rand(128, std=0.1), 1 + rand(128, std=0.1)
    for weights in ((q_weight, k_weight), (None, None)):
        got = OPS.qk_norm_rope(q, k, *weights, 1e-6, cos, sin)
        want = TORCH_OPS.qk_norm_rope(q, k, *weights, 1e-6, cos, sin)
        assert rel_error(got[0], want[0]) < tol and rel_error(got[1], want[1]) < tol

    gate, up = rand(num_tokens, 3000), rand(num_tokens, 3000)
    assert rel_error(OPS.silu_mul(gate, up), TORCH_OPS.silu_mul(gate, up)) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 12288), (1000, 1000), (37, 200)])
def test_gemv_matches_linear(dtype: torch.dtype, n: int, k: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(1, k, generator=gen, device="cuda").to(dtype)
    weight = (0.05 * torch.randn(n, k, generator=gen, device="cuda")).to(dtype)
    bias = torch.randn(n, generator=gen, device="cuda").to(dtype)
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    got = OPS.linear(x, weight, bias)
    assert got.shape == (1, n) and got.dtype == dtype
    assert rel_error(got, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_error(OPS.linear(x, weight, None), want - bias.double()) < 1e-2
    # The down projection with silu(gate) * up made inside the GEMV: bit-identical to the
    # unfused pair, and close to the reference.
    gate_up = torch.randn(1, 2 * k, generator=gen, device="cuda").to(dtype)
    gate, up = gate_up.split(k, dim=-1)
    fused = OPS.silu_mul_linear(gate, up, weight)
    assert torch.equal(fused, OPS.linear(OPS.silu_mul(gate, up), weight, None))
    reference = TORCH_OPS.silu_mul_linear(gate.double(), up.double(), weight.double())
    assert rel_error(fused, reference) < (1e-6 if dtype == torch.float32 else 1e-2)
    rows = torch.randn(3, k, generator=gen, device="cuda").to(dtype)  # not a GEMV: cuBLAS
    assert torch.equal(OPS.linear(rows, weight, None), torch.nn.functional.linear(rows, weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_with_kv_store_equals_rope_then_store(dtype: torch.dtype) -> None:
    """The fused q/k norm + RoPE + KV store against the fused RoPE followed by the
    attention backend's store kernel: bit for bit, padding slots untouched."""
    from kvstrata.attention.base import KVDestination
    from kvstrata.attention.triton_store import store_kv

    gen = torch.Generator(device="cuda").manual_seed(7)
    num_tokens = 37
    qkv = torch.randn(num_tokens, (32 + 2 * 8) * 128, generator=gen, device="cuda").to(dtype)
    q = qkv[:, : 32 * 128].view(num_tokens, 32, 128)
    k = qkv[:, 32 * 128 : 40 * 128].view(num_tokens, 8, 128)
    v = qkv[:, 40 * 128 :].view(num_tokens, 8, 128)
    rope = RotaryEmbedding(128, 1e6, None).cuda()
    cos, sin = rope.cos_sin(torch.randint(0, 40000, (num_tokens,), device="cuda"))
    weights = (
        (1 + 0.1 * torch.randn(128, device="cuda")).to(dtype),
        torch.ones(128, device="cuda").to(dtype),
    )
    slots = torch.randperm(64 * 16, device="cuda")[:num_tokens]
    slots[::5] = -1  # padding rows of a CUDA-graph batch
    fused, unfused = (
        KVDestination(torch.zeros(64, 16, 8, 128, device="cuda", dtype=dtype),
                      torch.zeros(64, 16, 8, 128, device="cuda", dtype=dtype), slots)
        for _ in range(2)
    )  # fmt: skip
    q_fused = OPS.qk_norm_rope_store(q, k, v, *weights, 1e-6, cos, sin, fused)
    q_rope, k_rope = OPS.qk_norm_rope(q, k, *weights, 1e-6, cos, sin)
    store_kv(k_rope, v, unfused.k_cache, unfused.v_cache, slots)
    assert torch.equal(q_fused, q_rope)
    assert torch.equal(fused.k_cache, unfused.k_cache)
    assert torch.equal(fused.v_cache, unfused.v_cache)


def _layer_chain(ops: ModelOps, x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """Add + norm, GEMV, SiLU-mul-in-GEMV, again and again: each kernel reads the last's
    output, which PDL launches may only do after their wait."""
    norm_weight, gate_up, down = weights
    delta = torch.zeros_like(x)
    for _ in range(6):
        x, h = ops.add_rms_norm(x, delta, norm_weight, 1e-6)
        gate, up = ops.linear(h, gate_up, None).split(down.shape[1], dim=-1)
        delta = ops.silu_mul_linear(gate, up, down)
    return ops.add_rms_norm(x, delta, norm_weight, 1e-6)[1]


def test_pdl_launches_compute_the_same_bits() -> None:
    """Kernels launched with programmatic dependent launch, replayed in a CUDA graph, give
    what plain launches give, bit for bit: every kernel waits for its inputs."""
    from kvstrata.pdl import Pdl

    pdl_ops = triton_ops.make_triton_ops(Pdl(True))
    gen = torch.Generator(device="cuda").manual_seed(11)
    hidden, inter = 2048, 5120
    weights = [
        (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).bfloat16(),
        (0.03 * torch.randn(2 * inter, hidden, generator=gen, device="cuda")).bfloat16(),
        (0.03 * torch.randn(hidden, inter, generator=gen, device="cuda")).bfloat16(),
    ]
    x = torch.randn(1, hidden, generator=gen, device="cuda").bfloat16()
    want = _layer_chain(OPS, x, weights)
    assert torch.equal(_layer_chain(pdl_ops, x, weights), want)  # eager, PDL
    _layer_chain(pdl_ops, x, weights)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = _layer_chain(pdl_ops, x, weights)
    for _ in range(10):
        got.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
