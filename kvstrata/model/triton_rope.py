"""Fused per-head q/k RMSNorm + RoPE in one Triton pass, optionally writing k and v straight
into their slots of the paged KV cache (`fused_qk_norm_rope_store`); rounds where the torch
reference rounds."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvstrata.pdl import NO_PDL, Pdl, wait_for_inputs

if TYPE_CHECKING:  # the attention backend's type only: attention imports the KV pool
    from kvstrata.attention.base import KVDestination


@triton.jit
def quantize(x, inv_scale, QUANT_MAX: tl.constexpr):
    """x / scale, saturated to the fp8 range (the caller casts): what the torch reference
    and the attention backend's store kernel write (tests/gpu/test_fp8_kv_gpu.py)."""
    return tl.clamp(x.to(tl.float32) * inv_scale, -QUANT_MAX, QUANT_MAX)


@triton.jit
def _norm_rope_heads(
    src_ptr,
    dst_row,
    w_ptr,
    cos_row,
    sin_row,
    token,
    stride_st,
    stride_sh,
    stride_dh,
    num_heads,
    eps,
    inv_scale,
    HAS_NORM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANT_MAX: tl.constexpr,
):
    # All heads of one token: optional RMSNorm over head_dim (= 2 * HALF), then RoPE in
    # the half-split layout: out_lo = lo*cos_lo - hi*sin_lo, out_hi = hi*cos_hi + lo*sin_hi.
    # QUANT_MAX > 0 (an fp8 cache): rounded to the compute dtype first, as the reference
    # stores the K it computed, then divided by the scale and saturated.
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    src = src_ptr + token * stride_st + offs_h[:, None] * stride_sh + offs_d[None, :]
    lo = tl.load(src, mask=mask, other=0.0)
    hi = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = lo.dtype
    lo = lo.to(tl.float32)
    hi = hi.to(tl.float32)
    if HAS_NORM:
        ms = (tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)) / (2 * HALF)
        inv_rms = (1.0 / tl.sqrt(ms + eps))[:, None]
        w_lo = tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
        w_hi = tl.load(w_ptr + HALF + offs_d).to(tl.float32)[None, :]
        # Round where the reference rounds: the normalised value, then the weighted one.
        lo = (w_lo * (lo * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        hi = (w_hi * (hi * inv_rms).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    cos_lo = tl.load(cos_row + offs_d)[None, :]
    cos_hi = tl.load(cos_row + HALF + offs_d)[None, :]
    sin_lo = tl.load(sin_row + offs_d)[None, :]
    sin_hi = tl.load(sin_row + HALF + offs_d)[None, :]
    out_lo = lo * cos_lo - hi * sin_lo
    out_hi = hi * cos_hi + lo * sin_hi
    if QUANT_MAX > 0:
        out_lo = quantize(out_lo.to(dtype), inv_scale, QUANT_MAX)
        out_hi = quantize(out_hi.to(dtype), inv_scale, QUANT_MAX)
    # The token's row of the destination: a contiguous [heads, head_dim] output, or its
    # slot of the paged KV cache (heads `stride_dh` apart).
    dst = dst_row + offs_h[:, None] * stride_dh + offs_d[None, :]
    tl.store(dst, out_lo.to(dst_row.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out_hi.to(dst_row.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_out_ptr,
    k_out_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_slot,
    stride_cache_head,
    num_q_heads,
    num_kv_heads,
    eps,
    inv_k_scale,
    inv_v_scale,
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    QUANT_MAX: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per token; q (and k unless STORE_KV) go to contiguous [tokens, heads,
    # head_dim] outputs. STORE_KV: k (after norm + RoPE) and v go straight to the token's
    # slot of the layer's paged KV cache, as `_store_kv_kernel` would put them; a
    # negative slot (a CUDA-graph padding row) writes nothing.
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos_row = cos_ptr + token * stride_cos
    sin_row = sin_ptr + token * stride_cos
    _norm_rope_heads(
        q_ptr,
        q_out_ptr + token * num_q_heads * 2 * HALF,
        qw_ptr,
        cos_row,
        sin_row,
        token,
        stride_qt,
        stride_qh,
        2 * HALF,
        num_q_heads,
        eps,
        1.0,
        HAS_NORM,
        HALF,
        BLOCK_HQ,
        0.0,
    )
    if STORE_KV:
        slot = tl.load(slots_ptr + token).to(tl.int64)
        if slot >= 0:
            _norm_rope_heads(
                k_ptr,
                k_cache_ptr + slot * stride_slot,
                kw_ptr,
                cos_row,
                sin_row,
                token,
                stride_kt,
                stride_kh,
                stride_cache_head,
                num_kv_heads,
                eps,
                inv_k_scale,
                HAS_NORM,
                HALF,
                BLOCK_HK,
                QUANT_MAX,
            )
            offs_h = tl.arange(0, BLOCK_HK)
            offs_d = tl.arange(0, 2 * HALF)
            mask = (offs_h < num_kv_heads)[:, None]
            v = tl.load(
                v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask,
            )
            if QUANT_MAX > 0:
                v = quantize(v, inv_v_scale, QUANT_MAX)
            dst = v_cache_ptr + slot * stride_slot + offs_h[:, None] * stride_cache_head
            tl.store(dst + offs_d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    else:
        _norm_rope_heads(
            k_ptr,
            k_out_ptr + token * num_kv_heads * 2 * HALF,
            kw_ptr,
            cos_row,
            sin_row,
            token,
            stride_kt,
            stride_kh,
            2 * HALF,
            num_kv_heads,
            eps,
            1.0,
            HAS_NORM,
            HALF,
            BLOCK_HK,
            0.0,
        )


def fused_qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pdl: Pdl = NO_PDL,
) -> tuple[torch.Tensor, torch.Tensor]:
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q_out = _launch_qk_norm_rope(q, k, None, q_weight, k_weight, eps, cos, sin, k_out, None, pdl)
    return q_out, k_out


def fused_qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: KVDestination,
    pdl: Pdl = NO_PDL,
) -> torch.Tensor:
    """`qk_norm_rope`, with k and v written into their slots of the KV cache instead of
    returned: the attention backend's store kernel is not needed. Returns q."""
    return _launch_qk_norm_rope(q, k, v, q_weight, k_weight, eps, cos, sin, None, kv_cache, pdl)


def _launch_qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_out: torch.Tensor | None,
    kv_cache: KVDestination | None,
    pdl: Pdl,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, "pow2 head_dim"
    q_out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if not num_tokens:
        return q_out
    has_norm = q_weight is not None and k_weight is not None
    if kv_cache is not None:
        assert v is not None and v.stride(2) == 1
        k_cache, v_cache, slots = kv_cache.k_cache, kv_cache.v_cache, kv_cache.slot_mapping
        stride_slot, stride_cache_head = k_cache.stride(1), k_cache.stride(2)
        inv_k_scale, inv_v_scale = 1.0 / kv_cache.k_scale, 1.0 / kv_cache.v_scale
    else:
        v, k_cache, v_cache, slots = k, q_out, q_out, q_out  # unused pointers
        stride_slot = stride_cache_head = 0
        inv_k_scale = inv_v_scale = 1.0
    _qk_norm_rope_kernel[(num_tokens,)](
        q,
        k,
        v,
        q_out,
        k_out if k_out is not None else q_out,
        q_weight if has_norm else q,
        k_weight if has_norm else k,
        cos,
        sin,
        k_cache,
        v_cache,
        slots,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        stride_slot,
        stride_cache_head,
        num_q_heads,
        num_kv_heads,
        eps,
        inv_k_scale,
        inv_v_scale,
        HAS_NORM=has_norm,
        STORE_KV=kv_cache is not None,
        QUANT_MAX=kv_cache.quant_max if kv_cache is not None else 0.0,
        HALF=head_dim // 2,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        PDL=pdl.enabled,
        num_warps=4,
        **pdl.options(),
    )
    return q_out
