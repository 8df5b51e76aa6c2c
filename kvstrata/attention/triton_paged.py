"""The `triton` attention backend: split-K decode (+ reduce) and causal extend kernels
over the L1 pool, GQA-aware, and the KV store of `triton_store`. GPU only
(TRITON_INTERPRET=1 runs it on CPU tensors for tests). Reads `meta.tensors`; never syncs
with the host, so it can be captured in a CUDA graph."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvstrata.attention.base import AttentionMetadata, KVDestination, PagedTensors
from kvstrata.attention.triton_store import store_kv
from kvstrata.kvcache.pages import KVPool
from kvstrata.pdl import NO_PDL, Pdl, wait_for_inputs

# Arguments that change from step to step are not specialized on (value or 16-byte
# alignment), so a new batch shape never triggers a recompile mid-run.
MAX_SPLITS = 32  # split-K fan-out cap for decode; powers of two only (reduce block size)


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of an attention kernel (bench/kernels.py sweeps these)."""

    block_n: int  # keys per tile
    num_warps: int
    num_stages: int
    block_m: int = 0  # extend: query rows per program
    early_v: bool = False  # decode: issue the V load before the softmax


# Chosen by bench/kernels.py on an H200 (docs/results.md): decode reads KV at ~4 TB/s
# with 3 stages and V issued early; 64 x 32 extend tiles beat 128 x 64 by ~20%.
DECODE_CONFIG = TileConfig(block_n=64, num_warps=4, num_stages=3, early_v=True)
EXTEND_CONFIG = TileConfig(block_n=32, num_warps=4, num_stages=3, block_m=64)
EXTEND_CONFIG_FP32 = TileConfig(block_n=32, num_warps=4, num_stages=2, block_m=32)


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
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        if EARLY_V:
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: each tile has a valid key
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        if not EARLY_V:
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
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
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # Key 0 is in the first tile and visible to every row, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def num_decode_splits(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Split-K fan-out: enough programs for about two waves over the SMs, a power of two
    in [1, MAX_SPLITS]. Depends on the batch shape only (never on KV lengths), so a
    CUDA graph captured for a batch size stays valid for any lengths."""
    wanted = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    splits = 1
    while splits < wanted and splits < MAX_SPLITS:
        splits *= 2
    return splits


def _precision(dtype: torch.dtype) -> str:
    # fp32 runs must match the torch reference closely: no tf32 in the dots.
    return "ieee" if dtype == torch.float32 else "tf32"


class TritonPagedAttention:
    """Paged attention kernels over `pool`. Sequences [0, num_decodes) of a step (one
    query token each) take the split-K decode kernel; the rest take the extend kernel.
    `pdl`: launch them with programmatic dependent launch."""

    needs_tensors = True  # reads meta.tensors (see AttentionBackend)
    cuda_graph_safe = True  # no host syncs, no host data: capturable
    accepts_stored_kv = True  # k = v = None: the caller wrote them to kv_destination

    def __init__(self, pool: KVPool, pdl: Pdl = NO_PDL) -> None:
        self.pool = pool
        self.pdl = pdl
        device = pool.k_cache[0].device
        self.num_sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 132
        )

    def kv_destination(self, layer_id: int, meta: AttentionMetadata) -> KVDestination:
        return KVDestination(
            self.pool.k_cache[layer_id], self.pool.v_cache[layer_id], meta.slot_mapping
        )

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        scale: float,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tensors = meta.tensors
        if tensors is None:
            raise ValueError("the triton backend needs meta.tensors (built by the runner)")
        k_cache = self.pool.k_cache[layer_id]
        v_cache = self.pool.v_cache[layer_id]
        if k is not None and v is not None:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, self.pdl)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = tensors.num_decodes
        num_seqs = tensors.seq_lens.shape[0]
        if num_decodes > 0:
            splits = num_decode_splits(num_decodes, k_cache.shape[2], self.num_sms)
            decode_attention(
                q[:num_decodes],
                k_cache,
                v_cache,
                tensors.page_table[:num_decodes],
                tensors.seq_lens[:num_decodes],
                scale,
                splits,
                out[:num_decodes],
                pdl=self.pdl,
            )
        if num_decodes < num_seqs:
            extend_attention(q, k_cache, v_cache, tensors, scale, out, pdl=self.pdl)
        return out


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]: one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor,
    config: TileConfig = DECODE_CONFIG,
    pdl: Pdl = NO_PDL,
) -> None:
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
        scale,
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
        PRECISION=_precision(q.dtype),
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


def extend_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim], all of the step's tokens
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tensors: PagedTensors,
    scale: float,
    out: torch.Tensor,
    config: TileConfig | None = None,
    pdl: Pdl = NO_PDL,
) -> None:
    """Attention for sequences [tensors.num_decodes, num_seqs) of the step."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    first_seq = tensors.num_decodes
    num_seqs = tensors.seq_lens.shape[0] - first_seq
    if config is None:
        config = EXTEND_CONFIG_FP32 if q.dtype == torch.float32 else EXTEND_CONFIG
    grid = (triton.cdiv(tensors.max_query_len, config.block_m), num_seqs, num_q_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        tensors.query_start_loc,
        tensors.seq_lens,
        tensors.page_table,
        scale,
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
        PRECISION=_precision(q.dtype),
        PDL=pdl.enabled,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **pdl.options(),
    )
