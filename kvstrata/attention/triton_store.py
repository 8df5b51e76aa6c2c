"""The Triton kernel that writes a step's new K/V into the paged L1 pool at each token's
slot (the `triton` backend's store when no fused kernel wrote them already)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.kvcache.kv_scales import fp8_max, is_fp8
from kvstrata.model.triton_rope import quantize
from kvstrata.pdl import NO_PDL, Pdl, wait_for_inputs


def quant_max(cache: torch.Tensor) -> float:
    """The QUANT_MAX of a cache: its dtype's largest value if fp8, else 0 (no scaling)."""
    return fp8_max(cache.dtype) if is_fp8(cache.dtype) else 0.0


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_slot,
    stride_cache_head,
    inv_k_scale,
    inv_v_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT_MAX: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per token. slot < 0 marks a padding row (CUDA-graph batches): no write.
    # QUANT_MAX > 0 (an fp8 cache): values are divided by their scale and saturated.
    wait_for_inputs(PDL)
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src_k = k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot * stride_slot + offs_h[:, None] * stride_cache_head + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    if QUANT_MAX > 0:
        k = quantize(k, inv_k_scale, QUANT_MAX)
        v = quantize(v, inv_v_scale, QUANT_MAX)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    pdl: Pdl = NO_PDL,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token t's K/V ([num_tokens, num_kv_heads, head_dim]) at slot_mapping[t];
    negative slots are skipped. An fp8 cache stores K / k_scale and V / v_scale."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous"
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        1.0 / k_scale,
        1.0 / v_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT_MAX=quant_max(k_cache),
        PDL=pdl.enabled,
        **pdl.options(),
    )
