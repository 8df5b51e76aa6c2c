"""FP8 KV pages on CUDA (issue 31): the store kernel and the fused RoPE + store write
exactly the bytes the torch reference stores (x / scale, saturated, rounded to nearest);
the decode and extend kernels read them within the bf16 kernel's tolerance of the torch
reference over the same pages, and within a stated quantization error of bf16 pages;
CUDA graphs, the overlapped schedule, the unfused ops and PD over CUDA IPC keep an fp8
engine's greedy tokens (fp32 compute)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from paged_cases import make_case, rel_error

from kvstrata import LLM, SamplingParams
from kvstrata.attention.base import KVDestination
from kvstrata.attention.torch_ref import TorchAttention, stored
from kvstrata.kvcache.kv_scales import KVScales
from kvstrata.kvcache.pages import KVPool

triton_paged = pytest.importorskip("kvstrata.attention.triton_paged")
store_kv = pytest.importorskip("kvstrata.attention.triton_store").store_kv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_pd_engine import GREEDY as PD_GREEDY  # noqa: E402
from test_pd_engine import serve_pd  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# ||fp8 pages' attention - bf16 pages' attention|| / ||bf16's|| on unit-normal K/V: e4m3
# keeps 3 mantissa bits (relative rounding error <= 2^-4), e5m2 keeps 2 (<= 2^-3).
QUANT_ERROR = {torch.float8_e4m3fn: 0.06, torch.float8_e5m2: 0.12}
SCALES = (0.37, 0.21)  # not powers of two: the division rounds too
LAYOUTS = {
    "decode_ragged": ([1] * 5, [1, 17, 64, 300, 2049]),
    "extend_cached_prefix": ([1, 90, 200], [33, 1000, 263]),
    "mixed_decodes_then_extends": ([1, 1, 1, 64, 3], [700, 5, 129, 64, 500]),
}


def fp8_pools(case: Any, kv_dtype: torch.dtype) -> tuple[KVPool, KVPool]:
    """Two fp8 pools (scales SCALES) holding the case's cached pages as the reference
    stores them."""
    source = case.pools[0]
    num_pages, page_size, num_kv_heads, head_dim = source.k_cache[0].shape
    scales = KVScales((SCALES[0],), (SCALES[1],), "calibrated")
    pools = []
    for _ in range(2):
        pool = KVPool(
            num_pages, page_size, 1, num_kv_heads, head_dim, kv_dtype, "cuda", scales=scales
        )
        pool.k_cache[0].copy_(stored(source.k_cache[0], pool.k_cache[0], SCALES[0]))
        pool.v_cache[0].copy_(stored(source.v_cache[0], pool.v_cache[0], SCALES[1]))
        pools.append(pool)
    return pools[0], pools[1]


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_attention_matches_the_reference(kv_dtype: torch.dtype, layout: str) -> None:
    query_lens, kv_lens = LAYOUTS[layout]
    case = make_case(
        query_lens,
        kv_lens,
        page_size=16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
        seed=11,
    )
    ref_pool, test_pool = fp8_pools(case, kv_dtype)
    ref = TorchAttention(ref_pool).forward(0, case.q, case.k, case.v, case.scale, case.meta)
    out = triton_paged.TritonPagedAttention(test_pool).forward(
        0, case.q, case.k, case.v, case.scale, case.meta
    )
    bf16 = TorchAttention(case.pools[1]).forward(0, case.q, case.k, case.v, case.scale, case.meta)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert rel_error(out, ref) < 1.5e-2, rel_error(out, ref)  # the bf16 kernel's tolerance
    # Both stores (Triton's, the reference's) wrote the step's K/V to the same bytes.
    assert torch.equal(ref_pool.data.view(torch.uint8), test_pool.data.view(torch.uint8))
    error = rel_error(out, bf16)
    print(
        f"\n{layout} {kv_dtype}: fp8 vs bf16 pages {error:.4f}, kernel vs reference "
        f"{rel_error(out, ref):.5f}"
    )
    assert error < QUANT_ERROR[kv_dtype]


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
def test_store_saturates_and_skips_padding(kv_dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    k = 300 * torch.randn(40, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(40, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(64 * 16, device="cuda")[:40]
    slots[::7] = -1
    k_cache = torch.zeros(64, 16, 8, 128, dtype=kv_dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    store_kv(k, v, k_cache, v_cache, slots, k_scale=0.002, v_scale=0.01)
    written = slots >= 0
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k.view(-1, 8, 128)[slots[written]] = stored(k[written], k_cache, 0.002)
    want_v.view(-1, 8, 128)[slots[written]] = stored(v[written], v_cache, 0.01)
    # Byte for byte, padding rows and unwritten slots still zero.
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    assert torch.isfinite(k_cache.float()).all()  # 300 * N(0,1) / 0.002 saturates, never inf
    assert k_cache.float().abs().max() == torch.finfo(kv_dtype).max


@pytest.mark.parametrize("kv_dtype", FP8, ids=["e4m3", "e5m2"])
def test_fused_rope_store_writes_the_store_kernels_bytes(kv_dtype: torch.dtype) -> None:
    from kvstrata.model.layers import RotaryEmbedding
    from kvstrata.model.triton_ops import TRITON_OPS as OPS

    gen = torch.Generator(device="cuda").manual_seed(9)
    num_tokens = 37
    qkv = torch.randn(num_tokens, 48 * 128, generator=gen, device="cuda").to(torch.bfloat16)
    q = qkv[:, : 32 * 128].view(num_tokens, 32, 128)
    k = qkv[:, 32 * 128 : 40 * 128].view(num_tokens, 8, 128)
    v = qkv[:, 40 * 128 :].view(num_tokens, 8, 128)
    rope = RotaryEmbedding(128, 1e6, None).cuda()
    cos, sin = rope.cos_sin(torch.randint(0, 40000, (num_tokens,), device="cuda"))
    weights = (torch.ones(128, device="cuda").to(torch.bfloat16),) * 2
    slots = torch.randperm(64 * 16, device="cuda")[:num_tokens]
    slots[::5] = -1
    fused, unfused = (
        KVDestination(
            torch.zeros(64, 16, 8, 128, device="cuda", dtype=kv_dtype),
            torch.zeros(64, 16, 8, 128, device="cuda", dtype=kv_dtype),
            slots,
            *SCALES,
            torch.finfo(kv_dtype).max,
        )
        for _ in range(2)
    )
    q_fused = OPS.qk_norm_rope_store(q, k, v, *weights, 1e-6, cos, sin, fused)
    q_rope, k_rope = OPS.qk_norm_rope(q, k, *weights, 1e-6, cos, sin)
    store_kv(
        k_rope, v, unfused.k_cache, unfused.v_cache, slots, k_scale=SCALES[0], v_scale=SCALES[1]
    )
    assert torch.equal(q_fused, q_rope)
    assert torch.equal(fused.k_cache.view(torch.uint8), unfused.k_cache.view(torch.uint8))
    assert torch.equal(fused.v_cache.view(torch.uint8), unfused.v_cache.view(torch.uint8))


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def generate(model: Path, batch: list[list[int]], **flags: Any) -> list[list[int]]:
    flags = {"cuda_graph_max_bs": 8, "num_kv_pages": 256, "kv_cache_dtype": "fp8"} | flags
    llm = LLM(str(model), device="cuda", dtype="float32", page_size=16, **flags)
    outs = llm.generate(input_ids=batch, sampling_params=GREEDY)
    del llm
    torch.cuda.empty_cache()
    return [out.output_ids for out in outs]


def test_cuda_graphs_and_overlap_keep_fp8_tokens(tiny_llama: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, 500, (int(n),), generator=gen).tolist() for n in range(5, 60, 5)]
    eager = generate(tiny_llama, batch, disable_cuda_graph=True, overlap_schedule="off")
    assert generate(tiny_llama, batch, overlap_schedule="off") == eager
    assert generate(tiny_llama, batch, overlap_schedule="on") == eager
    assert generate(tiny_llama, batch, disable_fused_ops=True, disable_cuda_graph=True) == eager


def test_pd_over_cuda_ipc_in_fp8_equals_the_unified_engine(tiny_llama: Path) -> None:
    flags = {
        "device": "cuda",
        "dtype": "float32",
        "page_size": 4,
        "num_kv_pages": 256,
        "kv_cache_dtype": "fp8",
    }
    prefill = LLM(str(tiny_llama), disaggregation_mode="prefill", **flags).engine
    decode = LLM(
        str(tiny_llama),
        disaggregation_mode="decode",
        disaggregation_decode_local_prefill="never",
        disaggregation_decode_enable_radix_cache=True,
        **flags,
    ).engine
    unified = LLM(str(tiny_llama), disable_radix_cache=True, **flags)
    history: list[int] = []
    try:
        for turn in range(3):
            history = history + [(37 * turn + 11 * i) % 500 for i in range(13)]
            out = serve_pd(prefill, decode, history)
            (want,) = unified.generate(input_ids=[history], sampling_params=PD_GREEDY)
            assert out.output_ids == want.output_ids
            history = history + out.output_ids
        assert decode.pool.data.dtype == torch.float8_e4m3fn
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_fp8_pages_through_l2_keep_tokens(tiny_llama: Path, io_backend: str) -> None:
    """A small L1 over an L2: pages go to host memory and come back through the copier
    (the Triton copy kernel or torch indexing), byte for byte."""
    gen = torch.Generator().manual_seed(5)
    firsts = [torch.randint(0, 500, (40,), generator=gen).tolist() for _ in range(8)]
    seconds = [[*p, 7, 8, 9] for p in firsts]  # second turns: their prefixes went to L2
    want = generate(tiny_llama, firsts, disable_radix_cache=True)
    want += generate(tiny_llama, seconds, disable_radix_cache=True)
    llm = LLM(
        str(tiny_llama),
        device="cuda",
        dtype="float32",
        page_size=16,
        kv_cache_dtype="fp8",
        num_kv_pages=24,
        enable_hierarchical_cache=True,
        hicache_ratio=4,
        hicache_io_backend=io_backend,
        cuda_graph_max_bs=8,
    )
    got = [o.output_ids for o in llm.generate(input_ids=firsts, sampling_params=GREEDY)]
    got += [o.output_ids for o in llm.generate(input_ids=seconds, sampling_params=GREEDY)]
    hits_l2 = llm.engine.tiers.metrics()["hicache_hit_tokens_l2"]
    del llm
    torch.cuda.empty_cache()
    assert got == want
    assert hits_l2 > 0
