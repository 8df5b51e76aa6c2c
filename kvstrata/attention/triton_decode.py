"""Split-K paged decode attention (one query token per sequence, GQA-aware):
`_decode_kernel` over a range of each sequence's keys per split, `_reduce_kernel` joining
the splits, and their launcher `decode_attention`. Never syncs with the host."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.attention.triton_tiles import (
    DECODE_CONFIG,
    DECODE_CONFIG_FP8,
    TileConfig,
    dot_precision,
    half_dots,
)
from kvstrata.pdl import NO_PDL, Pdl, wait_for_inputs

# Arguments that change from step to step are not specialized on (value or 16-byte
# alignment), so a new batch shape never triggers a recompile mid-run.


@triton.jit(
    do_not_specialize=["num_splits", "stride_pt", "stride_os", "stride_lt", "stride_lh"],
    do_not_specialize_on_alignment=["page_table_ptr", "seq_lens_ptr"],
)
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    v_scale,
    num_splits,
    stride_qt,
    stride_qh,
    stride_slot,
    stride_cache_head,
    stride_pt,
    stride_ot,
    stride_oh,
    stride_os,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    HALF_DOTS: tl.constexpr,
    EARLY_V: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (seq, kv_head, split): the GROUP query heads sharing kv_head attend over one
    # contiguous range of the sequence's keys, so each key is read once per kv head.
    # DIRECT (one split): write the normalised output; else write it per split with its
    # log-sum-exp for _reduce_kernel. An empty range (padding row, short sequence) writes
    # lse = -inf and zeros.
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(seq_lens_ptr + seq)
    # Splits cover whole tiles, so only the last tile of the last busy split is partial.
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask = offs_h < GROUP
    dim_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    if HALF_DOTS:  # fp8 pages: fp16 dots (fp8 -> fp16 is one native convert; bf16 is not)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(page_table_ptr + seq * stride_pt + offs_n // PAGE_SIZE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        kv_offs = slot[:, None] * stride_slot + kv_head * stride_cache_head + offs_d[None, :]
        kv_mask = n_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        if EARLY_V:
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: each tile has a valid key
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        if not EARLY_V:
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale  # x 1.0 is exact
    if DIRECT:
        dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + split * stride_os
        tl.store(dst + offs_d[None, :], out, mask=q_mask)
        lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
        tl.store(lse_ptr + seq * stride_lt + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_lt", "stride_lh"])
def _reduce_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (seq, q_head): combine the splits' outputs weighted by exp(lse - max lse).
    # Empty splits carry lse = -inf and weigh 0; a row with no keys at all comes out 0.
    wait_for_inputs(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = seq * stride_pt + head * stride_ph
    lse_offs = seq * stride_lt + head * stride_lh + offs_s
    lse = tl.load(lse_ptr + lse_offs, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weight = tl.where(lse > float("-inf"), tl.exp(lse - lse_max), 0.0)
    mask = s_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    parts = tl.load(
        part_ptr + base + offs_s[:, None] * stride_ps + offs_d[None, :], mask=mask, other=0.0
    )
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + seq * stride_ot + head * stride_oh + offs_d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]: one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor,
    config: TileConfig | None = None,
    pdl: Pdl = NO_PDL,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """An fp8 cache is read into q's dtype: K's scale folds into the softmax scale, V's
    multiplies the output. `config`: by default the tuned one for the pages' dtype."""
    if config is None:
        config = DECODE_CONFIG_FP8 if k_cache.element_size() == 1 else DECODE_CONFIG
    num_seqs, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    direct = num_splits == 1
    if direct:
        target, lse = out, out  # lse unused
    else:
        target = torch.empty(
            (num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        lse = torch.empty((num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        target,
        lse,
        scale * k_scale,
        v_scale,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        page_table.stride(0),
        target.stride(0),
        target.stride(1),
        0 if direct else target.stride(2),
        0 if direct else lse.stride(0),
        0 if direct else lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=config.block_n,
        BLOCK_D=block_d,
        DIRECT=direct,
        PRECISION=dot_precision(q.dtype),
        HALF_DOTS=half_dots(q, k_cache),
        EARLY_V=config.early_v,
        PDL=pdl.enabled,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.options(),
    )
    if not direct:
        _reduce_kernel[(num_seqs, num_q_heads)](
            target,
            lse,
            out,
            num_splits,
            target.stride(0),
            target.stride(1),
            target.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=num_splits,
            BLOCK_D=block_d,
            PDL=pdl.enabled,
            **pdl.options(),
        )
