"""Triton paged attention against the torch reference: ragged decode and extend batches,
partial pages, GQA, page sizes 16/64/128, fp32 and bf16; padding rows of CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from paged_cases import make_case, rel_error

from kvstrata.attention.torch_ref import TorchAttention

triton_paged = pytest.importorskip("kvstrata.attention.triton_paged")
store_kv = pytest.importorskip("kvstrata.attention.triton_store").store_kv

# ||out - ref|| / ||ref||: fp32 dots run in IEEE fp32; bf16 rounds q/k/v, p and the output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}

LAYOUTS = {
    # name: (query_lens, kv_lens)
    "decode_ragged": ([1] * 5, [1, 17, 64, 300, 2049]),
    "decode_long_single": ([1], [4100]),  # one sequence: many splits
    "extend_no_prefix": ([37, 128, 5], [37, 128, 5]),
    "extend_cached_prefix": ([1, 90, 200], [33, 1000, 263]),
    "mixed_decodes_then_extends": ([1, 1, 1, 64, 3], [700, 5, 129, 64, 500]),
}
HEADS = [(32, 8, 128), (16, 8, 128), (8, 8, 64), (12, 2, 128)]  # (q heads, kv heads, dim)


@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_torch_reference(page_size: int, dtype: torch.dtype, layout: str) -> None:
    query_lens, kv_lens = LAYOUTS[layout]
    heads = HEADS[(list(LAYOUTS).index(layout) + page_size // 16) % len(HEADS)]
    num_q_heads, num_kv_heads, head_dim = heads
    case = make_case(
        query_lens, kv_lens, page_size=page_size, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device="cuda", seed=3,
    )  # fmt: skip
    ref_pool, test_pool = case.pools
    ref = TorchAttention(ref_pool).forward(0, case.q, case.k, case.v, case.scale, case.meta)
    out = triton_paged.TritonPagedAttention(test_pool).forward(
        0, case.q, case.k, case.v, case.scale, case.meta
    )
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert rel_error(out, ref) < TOLERANCE[dtype], (heads, rel_error(out, ref))
    # The store is a copy: both pools hold exactly the same bits afterwards.
    assert torch.equal(ref_pool.k_cache[0], test_pool.k_cache[0])
    assert torch.equal(ref_pool.v_cache[0], test_pool.v_cache[0])


@pytest.mark.parametrize("num_splits", [1, 4, 32])
def test_decode_splits_agree(num_splits: int) -> None:
    case = make_case(
        [1] * 3, [10, 900, 3000], page_size=16, num_q_heads=32, num_kv_heads=8,
        head_dim=128, dtype=torch.float32, device="cuda", seed=4,
    )  # fmt: skip
    pool = case.pools[0]
    store_kv(case.k, case.v, pool.k_cache[0], pool.v_cache[0], case.meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    tensors = case.meta.tensors
    assert tensors is not None
    triton_paged.decode_attention(
        case.q, pool.k_cache[0], pool.v_cache[0], tensors.page_table, tensors.seq_lens,
        case.scale, num_splits, out,
    )  # fmt: skip
    ref = TorchAttention(case.pools[1]).forward(0, case.q, case.k, case.v, case.scale, case.meta)
    assert rel_error(out, ref) < 1e-5


def test_padding_rows_write_nothing_and_read_nothing() -> None:
    case = make_case(
        [1, 1], [20, 40], page_size=16, num_q_heads=8, num_kv_heads=2, head_dim=64,
        dtype=torch.bfloat16, device="cuda", seed=5,
    )  # fmt: skip
    pool = case.pools[0]
    before_k, before_v = pool.k_cache[0].clone(), pool.v_cache[0].clone()
    padding_slots = torch.full((2,), -1, dtype=torch.long, device="cuda")
    store_kv(case.k, case.v, pool.k_cache[0], pool.v_cache[0], padding_slots)
    assert torch.equal(pool.k_cache[0], before_k) and torch.equal(pool.v_cache[0], before_v)
    tensors = case.meta.tensors
    assert tensors is not None
    zero_lens = torch.zeros(2, dtype=torch.int32, device="cuda")
    for num_splits in (1, 8):
        out = torch.full_like(case.q, float("nan"))
        triton_paged.decode_attention(
            case.q, pool.k_cache[0], pool.v_cache[0], tensors.page_table, zero_lens,
            case.scale, num_splits, out,
        )  # fmt: skip
        assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("layout", ["decode_ragged", "mixed_decodes_then_extends"])
def test_pdl_launches_give_the_same_bits(layout: str) -> None:
    """The backend's kernels launched with programmatic dependent launch, one layer after
    another in a CUDA graph: the same stores and outputs as plain launches."""
    from kvstrata.pdl import Pdl

    query_lens, kv_lens = LAYOUTS[layout]
    case = make_case(
        query_lens, kv_lens, page_size=16, num_q_heads=32, num_kv_heads=8, head_dim=128,
        dtype=torch.bfloat16, device="cuda", seed=8,
    )  # fmt: skip
    plain_pool, pdl_pool = case.pools
    plain = triton_paged.TritonPagedAttention(plain_pool)
    pdl = triton_paged.TritonPagedAttention(pdl_pool, Pdl(True))
    args = (case.q, case.k, case.v, case.scale, case.meta)
    want = plain.forward(0, *args)
    for _ in range(3):  # same input each time: the output may not drift
        want = plain.forward(0, *args) + want
    pdl.forward(0, *args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = pdl.forward(0, *args)
        for _ in range(3):
            got = pdl.forward(0, *args) + got
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    assert torch.equal(plain_pool.k_cache[0], pdl_pool.k_cache[0])
