"""Causal paged extend attention: `_extend_kernel` runs a step's multi-token queries over
their cached prefix and their own new keys (already stored), launched by
`extend_attention`. GQA-aware; never syncs with the host."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.attention.base import PagedTensors
from kvstrata.attention.triton_tiles import (
    EXTEND_CONFIG,
    EXTEND_CONFIG_FP8,
    EXTEND_CONFIG_FP32,
    TileConfig,
    dot_precision,
    half_dots,
)
from kvstrata.pdl import NO_PDL, Pdl, wait_for_inputs

# Arguments that change from step to step are not specialized on (value or 16-byte
# alignment), so a new batch shape never triggers a recompile mid-run.


@triton.jit(
    do_not_specialize=["first_seq", "stride_pt"],
    do_not_specialize_on_alignment=["query_start_ptr", "seq_lens_ptr", "page_table_ptr"],
)
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_ptr,
    seq_lens_ptr,
    page_table_ptr,
    scale,
    v_scale,
    first_seq,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_slot,
    stride_cache_head,
    stride_pt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    HALF_DOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (query block, first_seq + i, q_head). The sequence's new tokens are its last q_len
    # keys, already stored in its pages; query j (absolute position prefix_len + j) sees
    # keys [0, prefix_len + j]:
    #     keys:    [0 ........ prefix_len)[prefix_len ........ kv_len)
    #               cached prefix          this step's tokens (causal)
    wait_for_inputs(PDL)
    block = tl.program_id(0)
    seq = first_seq + tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if block * BLOCK_M >= q_len:
        return
    kv_len = tl.load(seq_lens_ptr + seq)
    prefix_len = kv_len - q_len
    kv_head = head // GROUP

    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    dim_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q_mask = m_mask[:, None] & dim_mask[None, :]
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=q_mask,
        other=0.0,
    )
    if HALF_DOTS:  # fp8 pages: fp16 dots (fp8 -> fp16 is one native convert; bf16 is not)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    q_pos = prefix_len + offs_m
    end = prefix_len + tl.minimum((block + 1) * BLOCK_M, q_len)  # keys this block can see

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(page_table_ptr + seq * stride_pt + offs_n // PAGE_SIZE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE
        kv_offs = slot[:, None] * stride_slot + kv_head * stride_cache_head + offs_d[None, :]
        kv_mask = n_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # Key 0 is in the first tile and visible to every row, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale  # x 1.0 is exact
    dst = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def extend_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], all of the step's tokens
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tensors: PagedTensors,
    scale: float,
    out: torch.Tensor,
    config: TileConfig | None = None,
    pdl: Pdl = NO_PDL,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attention for sequences [tensors.num_decodes, num_seqs) of the step. An fp8 cache
    is read into q's dtype: K's scale folds into the softmax scale, V's scales the output."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    first_seq = tensors.num_decodes
    num_seqs = tensors.seq_lens.shape[0] - first_seq
    if config is None and q.dtype == torch.float32:
        config = EXTEND_CONFIG_FP32
    elif config is None:
        config = EXTEND_CONFIG_FP8 if k_cache.element_size() == 1 else EXTEND_CONFIG
    grid = (triton.cdiv(tensors.max_query_len, config.block_m), num_seqs, num_q_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        tensors.query_start_loc,
        tensors.seq_lens,
        tensors.page_table,
        scale * k_scale,
        v_scale,
        first_seq,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        tensors.page_table.stride(0),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PRECISION=dot_precision(q.dtype),
        HALF_DOTS=half_dots(q, k_cache),
        PDL=pdl.enabled,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.options(),
    )
